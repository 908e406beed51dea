"""Lab 02 DDP training: digits accuracy under DistributedDataParallel, and ResNet throughput scaling.

Worker functions for ``lab_utils.distributed.spawn.launch`` or torchrun (``scripts/train_ddp.py``): ``train_digits``
(correctness: N ranks reach the single-process test accuracy); ``throughput`` (speed: images/s per world size,
scaling efficiency, DDP's gradient buckets) lives in ``lab_utils.distributed.throughput`` and is importable from
here. Units are in names: ``_s`` seconds, ``samples_per_s`` per second of wall time. Accuracies are fractions in
[0, 1].

Design notes: docs/internals.md#lab_utilsdistributedddppy"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from lab_utils.args import check_int
from lab_utils.distributed.ddp_base import (
    all_reduce_values,
    amp_autocast,
    check_amp,
    each_world_size,
    grad_scaler,
    launch_ticking,
    share_cpu_threads,
    wrap_ddp,
)
from lab_utils.distributed.spawn import WorkerContext
from lab_utils.distributed.throughput import (  # noqa: F401 (the names callers use from here)
    H200_ONE_GPU_STEP_MS,
    NO_DDP,
    h200x2_results,
    overlap_experiment,
    record_name,
    scaling,
    throughput,
    with_reference_overlap,
    with_reference_scaling,
)
from lab_utils.models import digits_arrays, make_digits_cnn
from lab_utils.timing import sync

if TYPE_CHECKING:  # the tables are built in the launcher: ranks running a worker never import pandas
    import pandas as pd

# Hyperparameters of the digits runs (see ``train_digits``): the GLOBAL batch is held constant across world
# sizes, so N ranks take the same number of steps of the same size as one process, with the same lr.
DIGITS_DEFAULTS = {"epochs": 8, "global_batch": 64, "lr": 0.05, "momentum": 0.9, "width": 32}


# --- Digits data ----------------------------------------------------------------------------------


def _digits_tensors(device: str) -> dict[str, torch.Tensor]:
    # The whole set is 1797 * 64 floats: it lives on the device and batches are index gathers, no DataLoader.
    return {k: torch.from_numpy(v).to(device) for k, v in digits_arrays().items()}


def per_rank_batch(global_batch: int, world_size: int, accumulate: int = 1) -> int:
    """Micro-batch per rank so that one optimizer step sees ``global_batch`` images in all (must divide evenly)."""
    check_int(global_batch, "global_batch", "per_rank_batch")
    check_int(world_size, "world_size", "per_rank_batch")
    check_int(accumulate, "accumulate", "per_rank_batch")
    if global_batch % (world_size * accumulate):
        raise ValueError(f"per_rank_batch(global_batch={global_batch}): not divisible by world_size × accumulate "
                         f"= {world_size} × {accumulate}; choose a global batch that is")
    return global_batch // (world_size * accumulate)


def sampler_orders(n: int, world_size: int, epochs: int, seed: int = 0,
                   set_epoch: bool = True) -> list[list[list[int]]]:
    """The indices DistributedSampler(shuffle=True, seed) hands each rank, by epoch: ``orders[epoch][rank]``.

    No process group needed (the sampler is told num_replicas and rank). With ``set_epoch=False`` every epoch
    repeats epoch 0's order: the bug ``sampler.set_epoch(epoch)`` prevents."""
    check_int(n, "n", "sampler_orders")
    check_int(world_size, "world_size", "sampler_orders")
    check_int(epochs, "epochs", "sampler_orders")
    samplers = [DistributedSampler(range(n), num_replicas=world_size, rank=r, shuffle=True, seed=seed)
                for r in range(world_size)]
    orders = []
    for epoch in range(epochs):
        for s in samplers:
            if set_epoch:
                s.set_epoch(epoch)
        orders.append([list(s) for s in samplers])
    return orders


# --- Evaluation -----------------------------------------------------------------------------------


def _eval_counts(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 batch: int = 512) -> tuple[torch.Tensor, int]:
    """(number correct as a device tensor, number of samples) for inputs x (n, 1, 8, 8), labels y (n,)."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    with torch.no_grad():  # fp32 always, so a checkpoint evaluated later gives the same number
        for xb, yb in zip(x.split(batch), y.split(batch), strict=True):
            correct += (model(xb).argmax(1) == yb).sum()
    model.train(was_training)
    return correct, int(y.shape[0])


def _sharded_test_accuracy(ctx: WorkerContext, model: torch.nn.Module,
                           data: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Each rank scores its shard of the test set; the correct counts and sample counts are summed.

    DistributedSampler(shuffle=False) gives rank r the positions r, r+N, r+2N, ... of the index list padded
    (by repeating its head) to a multiple of N; a position is a real sample when it is < n. Those come
    first in the rank's list, so the rank keeps the first len(range(r, n, N)) indices and drops the padding
    (357 test images on 2 ranks: rank 0 scores 179, rank 1 178, not 179 + 179 with one image twice)."""
    n = int(data["y_test"].shape[0])
    sampler = DistributedSampler(range(n), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    real = len(range(ctx.rank, n, ctx.world_size))
    idx = torch.as_tensor(list(sampler)[:real], device=ctx.device)
    correct, count = _eval_counts(model, data["x_test"][idx], data["y_test"][idx])
    total_correct, total = all_reduce_values(ctx, [correct, count])
    if int(total) != n:
        raise RuntimeError(f"sharded evaluation counted {int(total)} test samples, expected {n}")
    return total_correct / total, int(total)


def evaluate(model: torch.nn.Module, device: str = "cpu") -> float:
    """Test-set accuracy (fraction) of a digits model in one process, fp32, on ``device``."""
    data = _digits_tensors(device)
    model = model.to(device)
    correct, count = _eval_counts(model, data["x_test"], data["y_test"])
    return int(correct) / count


def _save_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int,
                     width: int, accuracy: float) -> None:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},  # model.module's: no "module." keys
             "optimizer": opt.state_dict(), "epoch": epoch, "model_config": {"width": width}, "accuracy": accuracy}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


# --- Digits training worker -----------------------------------------------------------------------


def train_digits(ctx: WorkerContext, epochs: int = DIGITS_DEFAULTS["epochs"], batch_size: int = 64,
                 lr: float = DIGITS_DEFAULTS["lr"], seed: int = 0, amp: str | None = None, accumulate: int = 1,
                 checkpoint_path: str | None = None, set_epoch: bool = True,
                 momentum: float = DIGITS_DEFAULTS["momentum"],
                 width: int = DIGITS_DEFAULTS["width"], cpu_threads: int | None = 1) -> dict[str, Any]:
    """Worker: train the digits CNN under DDP; every rank returns the same all-reduced metrics.

    ``batch_size`` is the micro-batch per rank: a step sees batch_size × world_size × accumulate images (keep that
    ``global_batch`` and the lr constant to compare world sizes: ``digits_comparison``). ``amp``: None (fp32), 'bf16'
    or 'fp16' (+ GradScaler). All but the last of ``accumulate`` micro-steps run under ``no_sync()``.
    ``set_epoch=False``: every epoch repeats one order (the bug, on purpose). Rank 0 writes ``checkpoint_path``; the
    others wait at a barrier. ``cpu_threads``: torch threads per CPU rank (1: the CNN's ops are too small to split;
    None shares the cores).

    Returns accuracy (test, fraction), final_loss, samples_per_s (training images per wall second, all ranks), train_s,
    history (per epoch: train_loss, train_accuracy, test_accuracy, epoch_s, first_indices: this rank's first 8) and
    the configuration."""
    where = "train_digits"
    epochs = check_int(epochs, "epochs", where)
    batch_size = check_int(batch_size, "batch_size", where)
    accumulate = check_int(accumulate, "accumulate", where)
    amp = check_amp(amp, where)
    if not lr > 0:
        raise ValueError(f"{where}(lr={lr!r}): the learning rate must be > 0")
    share_cpu_threads(ctx, cpu_threads)

    ctx.status("loading digits")
    data = _digits_tensors(ctx.device)
    n_train = int(data["y_train"].shape[0])
    torch.manual_seed(seed)  # same initial weights on every rank (DDP also broadcasts rank 0's at construction)
    model = make_digits_cnn(width).to(ctx.device)
    ddp = wrap_ddp(ctx, model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    scaler = grad_scaler(ctx, amp)
    # Every rank builds the same permutation from (seed, epoch) and takes positions rank, rank+N, ...
    sampler = DistributedSampler(range(n_train), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed)

    history, train_s = [], 0.0
    for epoch in range(epochs):
        ctx.status(f"epoch {epoch + 1}/{epochs}")
        if set_epoch:
            sampler.set_epoch(epoch)  # a new permutation each epoch; without it, epoch 0's order every epoch
        order = list(sampler)
        idx = torch.as_tensor(order, device=ctx.device)  # (n_train / world_size,)
        batches = idx.split(batch_size)
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)  # kept on the device: no sync per step
        correct = torch.zeros((), dtype=torch.int64, device=ctx.device)
        sync(ctx.device)
        t0 = time.perf_counter()
        for i, b in enumerate(batches):
            group_start = i - i % accumulate
            group_len = min(accumulate, len(batches) - group_start)  # the epoch's last group may be shorter
            last = i - group_start == group_len - 1
            x, y = data["x_train"][b], data["y_train"][b]
            # no_sync around forward AND backward: DDP decides in forward whether backward will all-reduce.
            with contextlib.nullcontext() if last else ddp.no_sync():
                with amp_autocast(ctx, amp):
                    logits = ddp(x)  # (b, 10)
                loss = F.cross_entropy(logits.float(), y)
                scaler.scale(loss / group_len).backward()  # mean over the group's micro-batches
            if last:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach().double() * y.shape[0]
            correct += (logits.argmax(1) == y).sum()
        sync(ctx.device)
        epoch_s = all_reduce_values(ctx, [time.perf_counter() - t0], op="max")[0]  # the slowest rank sets the pace
        train_s += epoch_s
        # Sums of counts, never an average of per-rank averages (shards may differ in size).
        tot_loss, tot_correct, tot_seen = all_reduce_values(ctx, [loss_sum, correct, len(order)])
        test_acc, _ = _sharded_test_accuracy(ctx, ddp.module, data)
        history.append({"epoch": epoch + 1, "train_loss": tot_loss / tot_seen, "train_accuracy": tot_correct / tot_seen,
                        "test_accuracy": test_acc, "epoch_s": epoch_s, "first_indices": order[:8]})

    if checkpoint_path is not None:
        ctx.status("writing the checkpoint")
        if ctx.rank == 0:
            _save_checkpoint(checkpoint_path, ddp.module, opt, epochs, width, history[-1]["test_accuracy"])
        ctx.barrier()  # no rank returns (and no reader looks) before rank 0 has written the file

    global_batch = batch_size * ctx.world_size * accumulate
    return {"accuracy": history[-1]["test_accuracy"], "final_loss": history[-1]["train_loss"], "epochs": epochs,
            "samples_per_s": n_train * epochs / train_s if train_s > 0 else float("nan"), "train_s": train_s,
            "world_size": ctx.world_size, "rank": ctx.rank, "backend": ctx.backend, "device": str(ctx.device),
            "batch_size": batch_size, "accumulate": accumulate, "global_batch": global_batch,
            "steps_per_epoch": math.ceil(math.ceil(n_train / ctx.world_size / batch_size) / accumulate), "lr": lr,
            "momentum": momentum, "amp": amp, "fp16_scale": float(scaler.get_scale()) if amp == "fp16" else None,
            "seed": seed, "set_epoch": set_epoch,
            "checkpoint_path": None if checkpoint_path is None else os.fspath(checkpoint_path), "history": history}


def digits_comparison(nprocs_list: Sequence[int] = (1, 2), *, global_batch: int = DIGITS_DEFAULTS["global_batch"],
                      accumulate: int | Sequence[int] = 1, backend: str = "auto", timeout_s: float = 300.0,
                      progress: Callable[..., Any] | None = None, **kwargs: Any) -> pd.DataFrame:
    """``train_digits`` at each world size (same seed, same global batch): one row each, accuracy side by side.

    ``accumulate``: micro-steps per optimizer step, one value for all or one per world size. All world sizes run
    in one launch (``each_world_size``). ``progress`` steps per epoch that rank 0 starts (``launch_ticking``)."""
    sizes = [check_int(n, "nprocs_list", "digits_comparison") for n in nprocs_list]
    accs = [accumulate] * len(sizes) if isinstance(accumulate, int) else list(accumulate)
    if len(accs) != len(sizes):
        raise ValueError(f"digits_comparison(accumulate={accumulate!r}): one value, or one per world size")
    runs = [(n, {"batch_size": per_rank_batch(global_batch, n, a), "accumulate": a, **kwargs})
            for n, a in zip(sizes, accs, strict=True)]
    epochs = kwargs.get("epochs", DIGITS_DEFAULTS["epochs"])
    results = launch_ticking(each_world_size, max(sizes), {"fn": train_digits, "runs": runs}, backend=backend,
                              timeout_s=timeout_s, progress=progress, prefix="epoch ", desc="digits training: epochs",
                              total=epochs * len(runs) if isinstance(epochs, int) else None)
    rows = [{k: r[k] for k in ("world_size", "backend", "global_batch", "batch_size", "accumulate", "lr", "amp",
                               "epochs", "accuracy", "final_loss", "samples_per_s")} for r in results]
    import pandas as pd

    df = pd.DataFrame(rows)
    df["accuracy_vs_first"] = df["accuracy"] - df["accuracy"].iloc[0]
    return df
