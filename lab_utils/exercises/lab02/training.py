"""Lab 02's 02.6: one rank of a DDP training job (``train_ddp``), run in real ranks as torchrun would start it, and
judged from what each rank read, computed and saved, against the reference's run on the same ranks."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from lab_utils.distributed import ranks as ranks_mod
from lab_utils.distributed.spawn import WorkerContext
from lab_utils.exercises.framework import CodeExercise, References, Wrong, patched, source_as
from lab_utils.exercises.lab02.in_ranks import (
    exception_line,
    grading_ranks,
    launch_again_once,
    no_distributed,
    run_in_ranks,
    shipped_answer,
)
from lab_utils.models import DigitsCNN, digits_arrays
from lab_utils.procs import temporary_folder

# What the check trains: the digits CNN at width 16 (FP16 convolutions are slow on CPUs), a global batch of 64,
# two epochs (the least that shows whether the order changes), SGD with momentum 0.9.
DDP_CHECK = {"epochs": 2, "global_batch": 64, "lr": 0.05, "width": 16, "seed": 0}
CLIP_NORM = 5.0  # max_norm for clip_grad_norm_: loose enough to leave two epochs' learning alone (1.0 costs 6 points)
DDP_TIMEOUT_S = 180.0  # counted once every rank is ready: the check trains in 10-40 s on a loaded 2-core machine
# once one rank has returned, how long the others may take to follow: they trained in step, so only the end (the
# checkpoint after the barrier, the teardown) is left, seconds even on a loaded machine. A rank hung in gloo's
# teardown (about one run of the test suite in six) costs this long before the launch is tried again.
DDP_STRAGGLER_S = 15.0
ACCURACY_POINTS = 1.0  # how far below the reference's test accuracy the student's may be, in percentage points
_COVERAGE = 0.9  # an epoch's shards together must cover this share of the training set (drop_last may drop some)


def make_digits_model(width: int = DDP_CHECK["width"], seed: int = DDP_CHECK["seed"]) -> DigitsCNN:
    """The digits CNN with the same initial weights everywhere (seeded without touching the global generator)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DigitsCNN(width)


def reference_train_ddp(train_set: Dataset, make_model: Callable[[], torch.nn.Module], epochs: int,
                        batch_size: int, lr: float, checkpoint_path: str) -> None:
    """One rank of a DDP job, started as torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT set): FP16 autocast with a GradScaler, gradients clipped to norm 5 after unscaling, SGD with
    momentum 0.9; rank 0 writes the model's state dict to ``checkpoint_path``. ``batch_size`` is per rank."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    model = make_model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # this rank's 1/world_size of the samples
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type)  # FP16 gradients underflow to zero without loss scaling
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # DDP all-reduces the (scaled) gradients during backward
            scaler.unscale_(opt)  # the true gradients, before they are clipped
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=5.0)
            scaler.step(opt)  # skipped when the gradients overflowed
            scaler.update()
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), checkpoint_path)  # one writer: the ranks hold the same weights
    dist.barrier()  # nobody leaves before the checkpoint is complete
    dist.destroy_process_group()


class _RecordingDigits(Dataset):
    """The digits training set; remembers the index of every sample it hands out, in order (rank side)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y  # (n, 1, 8, 8) float32, (n,) int64
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def _note(self, indices: list[int]) -> None:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("the check's dataset records which samples each rank reads, which it cannot do in "
                               "DataLoader worker processes: use num_workers=0 (the default; the digits are in "
                               "memory already)")
        self.fetched.extend(indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._note([int(i)])
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._note([int(i) for i in indices])
        return [(self.x[i], self.y[i]) for i in indices]


class _TrainingProbe:
    """Watches torch.save, clip_grad_norm_ and the GradScaler while the student's function runs (rank side)."""

    def __init__(self) -> None:
        self.saves: list[str] = []
        self.clips = self.clips_scaled = self.scales = self.scales_disabled = 0
        self.norms: list[float] = []
        self.max_norms: set[float] = set()
        self._pending = False  # scale() was called and unscale_() not yet

    @contextlib.contextmanager
    def patched(self) -> Iterator[_TrainingProbe]:
        import torch.nn.utils.clip_grad as clip_mod
        import torch.serialization as ser
        from torch.amp.grad_scaler import GradScaler

        save, clip = torch.save, clip_mod.clip_grad_norm_
        scale, unscale = GradScaler.scale, GradScaler.unscale_

        def p_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            self.saves.append(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f))
            return save(obj, f, *args, **kwargs)

        def p_clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.clips += 1
            self.clips_scaled += self._pending
            self.max_norms.add(float(max_norm))
            total = clip(parameters, max_norm, *args, **kwargs)
            if len(self.norms) < 8:
                self.norms.append(float(total))
            return total

        def p_scale(scaler: GradScaler, outputs: Any) -> Any:
            if scaler.is_enabled():
                self.scales += 1
                self._pending = True
            else:
                self.scales_disabled += 1
            return scale(scaler, outputs)

        def p_unscale(scaler: GradScaler, optimizer: Any) -> Any:
            self._pending = False
            return unscale(scaler, optimizer)

        with patched((torch, "save", p_save), (ser, "save", p_save), (torch.nn.utils, "clip_grad_norm_", p_clip),
                     (clip_mod, "clip_grad_norm_", p_clip), (GradScaler, "scale", p_scale),
                     (GradScaler, "unscale_", p_unscale)):
            yield self


def _ddp_worker(ctx: WorkerContext, student: ranks_mod.Shipped, cfg: dict[str, Any], folder: str) -> dict[str, Any]:
    """Rank side of q6: run one train_ddp function in this rank and return what it did (the student's, or the
    reference's in a launch of its own: two trainings in one rank, one group after the other, hung a gloo rank in
    destroy_process_group while its peer waited in the next group's set-up)."""
    if not ctx.device.startswith("cuda"):
        torch.set_num_threads(1)  # the ranks share the cores; a small CNN gains nothing from more threads
    ctx.status("train_ddp")
    data = digits_arrays()
    train_set = _RecordingDigits(torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"]))
    models: list[DigitsCNN] = []
    forwards: list[tuple[bool, str]] = []

    def note_forward(module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and len(forwards) < 1000:
            kind = next(module.parameters()).device.type
            dtype = str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
            forwards.append((torch.is_autocast_enabled(kind), dtype))

    def make_model() -> DigitsCNN:
        model = make_digits_model(cfg["width"], cfg["seed"])
        model.register_forward_pre_hook(note_forward)
        models.append(model)
        return model

    probe = _TrainingProbe()
    with probe.patched():
        fn = student.load()
        fn(train_set, make_model, cfg["epochs"], cfg["batch_size"], cfg["lr"], os.path.join(folder, "student.pt"))
    left = dist.is_initialized()
    if left:
        dist.destroy_process_group()
    # numpy, not tensors: a tensor crosses the process boundary as shared memory that dies with this rank
    state = {k: v.detach().float().cpu().numpy().copy() for k, v in models[-1].state_dict().items()} if models else None
    watched = {k: v for k, v in vars(probe).items() if not k.startswith("_")}  # saves, clips, norms, scales, ...
    obs = {"rank": ctx.rank, "fetched": train_set.fetched, "n_train": len(train_set), "models": len(models),
           "forwards": len(forwards), "autocast": sorted(set(forwards)), **watched,
           "max_norms": sorted(probe.max_norms), "left_group": left, "state": state}
    models.clear()
    del train_set, fn
    gc.collect()  # DDP's hooks hold the group in reference cycles: gone before the next group starts
    return obs


def _tensors(state: dict[str, Any] | None) -> dict[str, torch.Tensor] | None:
    return None if state is None else {k: torch.as_tensor(v) for k, v in state.items()}


_REFERENCE_RUNS: dict[tuple[Any, ...], dict[str, Any]] = {}


def _evaluate(state: dict[str, torch.Tensor], width: int) -> float:
    # Imported here, in the launching process only: every rank imports this module to run _ddp_worker, and
    # lab_utils.distributed.ddp brings pandas, seconds of CPU per rank.
    from lab_utils.distributed.ddp import evaluate

    model = DigitsCNN(width)
    model.load_state_dict(state)
    return evaluate(model, "cpu")


def _checkpoint_state(path: str, width: int) -> dict[str, torch.Tensor] | str:
    """The model state dict in a checkpoint file (a plain state dict, or one under 'model'/'state_dict'; a
    DDP 'module.' prefix is accepted), or what is wrong with the file."""
    if not os.path.isfile(path):
        return "no file at checkpoint_path"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        return f"torch.load could not read it ({type(err).__name__}: {exception_line(str(err), 120)})"
    if isinstance(obj, dict):  # the state dict under the first of these keys that holds one
        obj = next((obj[k] for k in ("model", "model_state_dict", "state_dict") if isinstance(obj.get(k), dict)), obj)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        return f"it holds {type(obj).__name__}, not a model state dict (save model.state_dict())"
    state = {k.removeprefix("module."): v for k, v in obj.items()}
    try:
        DigitsCNN(width).load_state_dict(state)
    except RuntimeError as err:
        return f"its keys do not fit the model ({exception_line(str(err), 160)})"
    return state


def _judge_ddp(obs: list[dict[str, Any]], ref_acc: float, ckpt: str, cfg: dict[str, Any], call: str,
               backend: str) -> str:
    obs = [{**o, "state": _tensors(o["state"])} for o in obs]
    n, epochs = len(obs), cfg["epochs"]
    total = obs[0]["n_train"]
    if any(o["models"] == 0 for o in obs):
        raise Wrong(f"{call} never called make_model(): build the model with it, so every rank starts from the "
                    "weights the check knows")
    if any(o["forwards"] == 0 for o in obs):
        raise Wrong(f"{call}: the model make_model() returned never ran a training forward pass")
    # Data: disjoint shards, covering the set, in a new order every epoch.
    shards = []
    for o in obs:
        got = o["fetched"]
        if not got:
            raise Wrong(f"{call}: rank {o['rank']} read no sample from train_set: iterate over a DataLoader of it")
        if len(got) % epochs:
            raise Wrong(f"{call}: rank {o['rank']} read {len(got)} samples in {epochs} epochs, not the same number "
                        "each epoch: one pass over its shard per epoch")
        per = len(got) // epochs
        shards.append([got[e * per:(e + 1) * per] for e in range(epochs)])
    first = [set(s[0]) for s in shards]
    for r in range(1, n):
        common = first[0] & first[r]
        if common:
            if len(first[r]) > 0.9 * total and len(first[0]) > 0.9 * total:
                raise Wrong(f"{call}: rank {r} trained on the same {len(first[r])} samples as rank 0 in epoch 1: no "
                            "DistributedSampler. Each rank must read its own 1/world_size of the data: "
                            "DataLoader(train_set, batch_size=..., sampler=DistributedSampler(train_set))")
            raise Wrong(f"{call}: ranks 0 and {r} both read {len(common)} of the same samples in epoch 1: the "
                        "shards overlap. DistributedSampler(train_set) takes the rank and the world size from the "
                        "process group; pass it to the DataLoader as sampler=")
    covered = len(set().union(*first))
    if covered < _COVERAGE * total:
        raise Wrong(f"{call}: in epoch 1 the {n} ranks together read {covered} of the {total} training samples: "
                    "the shards should cover the data set (DistributedSampler gives each rank 1/world_size)")
    if epochs > 1 and all(s[0] == s[1] for s in shards):
        raise Wrong(f"{call}: every rank read its samples in the same order in epoch 1 and epoch 2: "
                    "sampler.set_epoch(epoch) is missing (DistributedSampler shuffles with seed + epoch, and its "
                    "epoch stays 0 unless told), or shuffle=False")
    # One model: the same parameters on every rank.
    for o in obs[1:]:
        diff = max(float((o["state"][k] - obs[0]["state"][k]).abs().max()) for k in obs[0]["state"])
        if diff > 1e-5:
            raise Wrong(f"{call}: after training, rank {o['rank']}'s parameters differ from rank 0's (by up to "
                        f"{diff:.3g}): each rank trained its own model on its own shard. Wrap the model in "
                        "DistributedDataParallel, which averages the gradients over the ranks in backward, and train "
                        "through the wrapper")
    # Precision: FP16 autocast, a GradScaler, unscaled before clipping.
    modes = obs[0]["autocast"]
    if not any(enabled for enabled, _ in modes):
        raise Wrong(f"{call}: the forward pass did not run under autocast: wrap the forward and the loss in "
                    "torch.autocast(device.type, dtype=torch.float16)")
    if not any(enabled and dtype == "float16" for enabled, dtype in modes):
        got = ", ".join(dt for on, dt in modes if on)
        raise Wrong(f"{call}: autocast ran in {got}; this exercise asks for float16 with a GradScaler (bfloat16 "
                    "needs no scaler, which is why it is the usual choice on GPUs that have it)")
    o0 = obs[0]
    if o0["scales"] == 0:
        extra = (" (it was created disabled: torch.cuda.amp.GradScaler() turns itself off without CUDA; use "
                 "torch.amp.GradScaler(device.type))") if o0["scales_disabled"] else ""
        raise Wrong(f"{call}: no GradScaler scaled the loss{extra}. In FP16, small gradients underflow to zero: "
                    "scaler.scale(loss).backward(), then scaler.step(opt) and scaler.update()")
    acc = _evaluate(o0["state"], cfg["width"])
    versus = f"test accuracy {100 * acc:.1f} % against the reference's {100 * ref_acc:.1f} %"
    if o0["clips"] == 0:
        raise Wrong(f"{call}: the gradients were never clipped: torch.nn.utils.clip_grad_norm_(model.parameters(), "
                    f"max_norm={CLIP_NORM:g}) each step, after scaler.unscale_(opt)")
    if o0["clips_scaled"]:
        norms = ", ".join(f"{v:.3g}" for v in o0["norms"][:3])
        raise Wrong(f"{call}: the gradients were clipped while still multiplied by the loss scale (norms {norms}, "
                    f"...): {versus}. The loss is scaled but never unscaled before clipping, so max_norm cut the "
                    "true gradients to about 1/65536 of it. Call scaler.unscale_(opt) before clip_grad_norm_")
    if o0["max_norms"] != [CLIP_NORM]:
        got = ", ".join(f"{v:g}" for v in o0["max_norms"])
        raise Wrong(f"{call}: clip_grad_norm_ was given max_norm={got}; this exercise clips at {CLIP_NORM:g} "
                    f"({versus})")
    if acc < ref_acc - ACCURACY_POINTS / 100:
        raise Wrong(f"{call}: {versus} after {epochs} epochs, more than {ACCURACY_POINTS:g} point below. Use the "
                    "given lr with SGD(momentum=0.9), batch_size per rank, and one optimizer step per batch")
    # One checkpoint, by rank 0, holding the trained weights.
    writers = [o["rank"] for o in obs if o["saves"]]
    if not writers:
        raise Wrong(f"{call}: no checkpoint was written: rank 0 saves model.state_dict() to checkpoint_path")
    if writers != [0]:
        if 0 in writers:
            who = "every rank" if len(writers) == n else "ranks " + ", ".join(map(str, writers))
            raise Wrong(f"{call}: {who} wrote the checkpoint: each rank saving. "
                        "The ranks hold the same weights, so only rank 0 should write (`if dist.get_rank() == 0:`); "
                        "several processes writing one file at once can leave it corrupt, and on a shared file "
                        "system each writes the whole model again")
        raise Wrong(f"{call}: rank {writers[0]} wrote the checkpoint, not rank 0: `if dist.get_rank() == 0:`")
    state = _checkpoint_state(ckpt, cfg["width"])
    if isinstance(state, str):
        raise Wrong(f"{call}: rank 0 saved, but the checkpoint at checkpoint_path is not usable: {state}")
    if any(not torch.equal(state[k].float(), o0["state"][k]) for k in o0["state"]):
        raise Wrong(f"{call}: the checkpoint holds other weights than the trained model: save after the last epoch")
    if any(o["left_group"] for o in obs):
        raise Wrong(f"{call}: the process group was still up when train_ddp returned: end with "
                    "dist.destroy_process_group() (after a dist.barrier(), so no rank leaves before rank 0's "
                    "checkpoint is complete); a group left to interpreter shutdown can abort the process")
    per = len(shards[0][0])
    return (f"On {n} {backend} ranks, {epochs} epochs: disjoint shards of {per} samples, a new order each epoch, "
            f"identical parameters on every rank, FP16 with the GradScaler unscaled before clipping, {versus}, "
            "one checkpoint written by rank 0.")


def _ddp_config(backend: str | None = None, nprocs: int | None = None) -> tuple[str, int, dict[str, Any]]:
    """(backend, ranks) as ``grading_ranks``, and the check's settings on that many ranks."""
    backend, nprocs = grading_ranks(backend, nprocs)
    cfg = dict(DDP_CHECK)
    cfg["batch_size"] = max(1, cfg.pop("global_batch") // nprocs)  # per rank (64 // 3 = 21 on 3 GPUs)
    return backend, nprocs, cfg


def _grade_train_ddp(fn: Any) -> str:
    backend, nprocs, cfg = _ddp_config()
    ref_acc = reference_ddp_run(nprocs, backend)["accuracy"]  # once per process: later checks reuse it
    call = (f"train_ddp(train_set, make_model, epochs={cfg['epochs']}, batch_size={cfg['batch_size']}, "
            f"lr={cfg['lr']}, checkpoint_path) on {nprocs} {backend} ranks")
    with shipped_answer(fn, "train_ddp") as shipped, temporary_folder("ddp-check") as folder:
        res = run_in_ranks(_ddp_worker, shipped, call, nprocs, backend, DDP_TIMEOUT_S,
                           {"cfg": cfg, "folder": folder}, group=False, straggler_s=DDP_STRAGGLER_S)
        return _judge_ddp(res, ref_acc, os.path.join(folder, "student.pt"), cfg, call, backend)


def reference_ddp_run(nprocs: int | None = None, backend: str | None = None) -> dict[str, Any]:
    """The reference ``train_ddp`` on the check's ranks and settings: its rank-0 weights and test accuracy.

    Runs it once (the check's own run is reused when the check ran first), so a lab with the exercise left blank
    still gets the number. Returns accuracy (fraction), state (the trained state dict), world_size, backend and
    the configuration.
    """
    backend, nprocs, cfg = _ddp_config(backend, nprocs)
    key = (backend, nprocs, tuple(sorted(cfg.items())), torch.__version__)
    if key not in _REFERENCE_RUNS:
        with ranks_mod.shipping(reference_train_ddp) as shipped, temporary_folder("ddp-ref") as folder:
            res = launch_again_once(_ddp_worker, nprocs, backend, DDP_TIMEOUT_S, {"student": shipped, "cfg": cfg,
                                    "folder": folder}, group=False, straggler_s=DDP_STRAGGLER_S)
        state = _tensors(res[0]["state"])
        _REFERENCE_RUNS[key] = {"accuracy": _evaluate(state, cfg["width"]), "state": state}
    return {**_REFERENCE_RUNS[key], "world_size": nprocs, "backend": backend, **cfg}  # accuracy, state


q6 = CodeExercise(
    name="02.6 DDP training: setup and step", var="train_ddp", grade=_grade_train_ddp,
    references=References("write the DDP setup and training step yourself",
                           reference_train_ddp, reference_ddp_run, "lab_utils.distributed.ddp.train_digits"),
    signature="train_ddp(train_set, make_model, epochs, batch_size, lr, checkpoint_path) -> None",
    applicable=no_distributed,
    hints=[
        "Setup: dist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo'); the device from "
        "LOCAL_RANK (torch.cuda.set_device) or the CPU; the model from make_model, moved there and wrapped in "
        "DistributedDataParallel; a DataLoader with sampler=DistributedSampler(train_set); SGD(lr, momentum=0.9); "
        "torch.amp.GradScaler(device.type).",
        "Each epoch: the sampler's set_epoch first (else every epoch shuffles alike). Each batch: forward and loss "
        "under torch.autocast(device.type, dtype=torch.float16); zero_grad; backward on the scaler's scaled loss; "
        "unscale_ the optimizer BEFORE clip_grad_norm_(..., max_norm=5.0); then the scaler's step and update.",
        "After training only rank 0 saves the state_dict of the wrapped model's weights to checkpoint_path; then "
        "dist.barrier() and destroy_process_group on every rank.",
    ],
    solution_text=source_as(reference_train_ddp,
                            "train_ddp(train_set, make_model, epochs, batch_size, lr, checkpoint_path)"),
)

