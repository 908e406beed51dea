"""Lab 02 DDP on the CPU with real gloo process groups (small sizes, one or two ranks)."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

torch = pytest.importorskip("torch")

import _dist_workers as w

from lab_utils import models
from lab_utils.distributed import ddp
from lab_utils.distributed.spawn import launch
from lab_utils.procs import group_still_its

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 4  # enough for > 95 % on the digits; each launch costs seconds of process start-up on a small CPU


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of two gloo ranks for every test of lab 02's training: the same seed and global batch on 1 and on 2
    ranks (the 1-rank run in a subgroup of rank 0, as digits_comparison and scaling do; the 2-rank run writes a
    checkpoint), an fp16 run with GradScaler and accumulation, then no_sync accumulation against one big batch."""
    ckpt = tmp_path_factory.mktemp("ddp") / "digits.pt"
    plan = [(1, {"epochs": EPOCHS, "batch_size": 64}),
            (2, {"epochs": EPOCHS, "batch_size": 32, "checkpoint_path": str(ckpt)}),
            (2, {"epochs": 1, "amp": "fp16", "accumulate": 2, "batch_size": ddp.per_rank_batch(64, 2, 2)})]
    by_rank = launch(w.ddp_digits_and_accumulation, 2, backend="gloo", kwargs={"plan": plan})
    assert by_rank[1][0][0] is None and by_rank[1][0][1]["world_size"] == 2  # rank 1 sat the 1-rank run out
    (one, two, fp16), accumulation = by_rank[0]
    return SimpleNamespace(one=one, two=two, ckpt=ckpt, fp16=fp16, accumulation=accumulation)


def test_import_does_no_work():
    code = ("import sys, torch.distributed as dist, lab_utils.distributed.ddp; "
            "print(dist.is_initialized(), 'sklearn' in sys.modules, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    # no process group, the digits come without scikit-learn, and a rank (which imports the module to run a
    # worker) starts without pandas: only the launcher builds tables
    assert out.stdout.strip() == "False False False"


def test_digits_split():
    d = models.digits_arrays()
    assert d["x_train"].shape == (1440, 1, 8, 8) and d["x_test"].shape == (357, 1, 8, 8)
    assert abs(float(d["x_train"].mean())) < 1e-4 and abs(float(d["x_train"].std()) - 1) < 1e-3
    # stratified: every class is 19-20 % of its share in the test set
    counts = [int((d["y_test"] == c).sum()) for c in range(10)]
    assert min(counts) >= 35 and max(counts) <= 36 and sum(counts) == 357


def test_models():
    cnn = models.make_digits_cnn()
    assert cnn(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert type(cnn).__name__ == "DigitsCNN" and models.DigitsCNN is type(cnn)
    tiny = models.make_resnet(8, 10, num_classes=10, image_size=32)
    assert tiny(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    r18 = models.make_resnet(64, 18, num_classes=1000, image_size=224)
    assert sum(p.numel() for p in r18.parameters()) == 11_689_512  # torchvision's resnet18
    assert models.param_mib(r18) == pytest.approx(11_689_512 * 4 / 2**20)


def test_bad_arguments():
    with pytest.raises(ValueError, match="global_batch=63"):
        ddp.per_rank_batch(63, 2)
    with pytest.raises(ValueError, match="one per world size"):
        ddp.digits_comparison((1, 2), accumulate=(1, 2, 4))
    assert ddp.per_rank_batch(64, 2, accumulate=2) == 16
    with pytest.raises(ValueError, match="amp='fp8'"):
        ddp.train_digits(SimpleNamespace(device="cpu", world_size=1, rank=0), amp="fp8")
    with pytest.raises(ValueError, match="depth=19"):
        models.make_resnet(8, 19)
    with pytest.raises(ValueError, match="unknown key"):
        ddp.overlap_experiment(2, variants=[{"bucket_mb": 1}])


def test_one_and_two_processes_agree(runs):
    one, two = runs.one, runs.two
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["global_batch"] == two["global_batch"] == 64 and two["batch_size"] == 32
    assert one["accuracy"] > 0.90 and two["accuracy"] > 0.90
    assert abs(one["accuracy"] - two["accuracy"]) <= 0.01
    assert len(two["history"]) == EPOCHS and two["samples_per_s"] > 0
    assert math.isfinite(two["final_loss"]) and two["final_loss"] < one["history"][0]["train_loss"]


def test_checkpoint_reproduces_accuracy(runs):
    two, ckpt = runs.two, runs.ckpt
    saved = torch.load(ckpt, weights_only=True)
    assert saved["epoch"] == EPOCHS and "optimizer" in saved
    assert not any(k.startswith("module.") for k in saved["model"])  # model.module's state dict
    model = models.make_digits_cnn(saved["model_config"]["width"])  # the model the checkpoint says, its weights
    model.load_state_dict(saved["model"])
    assert ddp.evaluate(model) == pytest.approx(two["accuracy"], abs=1.5 / 357)  # at most one image apart


def test_set_epoch_changes_the_order():
    on = ddp.sampler_orders(40, world_size=2, epochs=3, seed=0, set_epoch=True)
    off = ddp.sampler_orders(40, world_size=2, epochs=3, seed=0, set_epoch=False)
    assert on[0] != on[1] != on[2] and on[0][0] != on[1][0]
    assert off[0] == off[1] == off[2] == on[0]  # without set_epoch: epoch 0's order every epoch
    for epoch in on:  # the two ranks' shards are disjoint and cover everything
        assert sorted(epoch[0] + epoch[1]) == list(range(40))


def test_sharded_eval_counts_each_test_image_once():
    from torch.utils.data.distributed import DistributedSampler

    n, world = 357, 2
    kept = []
    for r in range(world):
        padded = list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False))
        assert len(padded) == 179  # the sampler pads 357 to 358
        kept += padded[: len(range(r, n, world))]
    assert sorted(kept) == list(range(n))


def test_accumulation_with_no_sync_matches_big_batch(runs):
    res = runs.accumulation
    assert res["global_batch"] == 32
    assert res["max_abs_diff"] <= 1e-5 * res["max_abs_grad"] + 1e-7


def test_fp16_grad_scaler_with_accumulation(runs):
    res = runs.fp16
    assert res["amp"] == "fp16" and res["accumulate"] == 2 and res["batch_size"] == 16 and res["global_batch"] == 64
    assert res["fp16_scale"] > 0 and math.isfinite(res["final_loss"])
    assert res["accuracy"] > 0.3  # learned something in one epoch (chance is 0.1)


def test_h200x2_reference_beside_local_tables():
    ref = ddp.h200x2_results()
    assert ref["ddp_images_per_s_2"] > ref["ddp_images_per_s_1"] > 1000
    local = pd.DataFrame({"world_size": [1, 2, 4], "images_per_s": [1.0, 2.0, 4.0]})
    out = ddp.with_reference_scaling(local)
    assert out["h200x2_images_per_s"].iloc[1] == ref["ddp_images_per_s_2"]
    assert out["h200x2_scaling_efficiency"].iloc[1] == pytest.approx(ref["ddp_scaling_efficiency"], rel=1e-9)
    assert math.isnan(out["h200x2_images_per_s"].iloc[2])  # that run had two GPUs
    variants = ["bucket_cap_mb=25", "bucket_cap_mb=1", ddp.NO_DDP, "bucket_cap_mb=7"]
    over = ddp.with_reference_overlap(pd.DataFrame({"variant": variants}))
    assert over["h200x2_step_ms"].iloc[1] == ref[ddp.record_name("bucket_cap_mb=1")]
    assert over["h200x2_step_ms"].iloc[2] == ref[ddp.record_name("no overlap (all-reduce after backward)")]
    assert over["h200x2_step_ms_vs_default"].iloc[0] == 1.0 and math.isnan(over["h200x2_step_ms"].iloc[3])
    assert ddp.record_name("bucket_cap_mb=25, gradient_as_bucket_view") in ref  # names as the lab records them
    assert ddp.with_reference_scaling(local, run_dir=ROOT / "no-such-run")["h200x2_images_per_s"].isna().all()


def test_throughput_scaling():
    df = ddp.scaling((1, 2), backend="gloo", steps=2, warmup_steps=1)
    assert list(df["world_size"]) == [1, 2]
    for col in ("step_ms", "images_per_s", "images_per_s_per_worker", "params_mib", "scaling_efficiency"):
        assert (df[col] > 0).all(), col
    assert df["scaling_efficiency"].iloc[0] == pytest.approx(1.0)
    assert df["global_batch"].tolist() == [16, 32]


def test_overlap_experiment():
    """Real gloo ranks: DDP's overlap controls (bucket size, no_sync accumulation) against no DDP at all; DDP has no
    "overlap" argument, and the variants say so."""
    df = ddp.overlap_experiment(2, variants=[{"bucket_cap_mb": 0.1}, {"accumulate": 3}, {"ddp": False}], repeats=1,
                                backend="gloo", steps=2, warmup_steps=1)
    assert df["variant"].tolist() == ["bucket_cap_mb=25", "bucket_cap_mb=0.1",
                                      "bucket_cap_mb=25, no_sync, all-reduce every 3 micro-batches",
                                      "no DDP: one all-reduce after backward"]
    assert df["accumulate"].tolist() == [1, 1, 3, 1] and df["ddp"].tolist() == [True, True, True, False]
    assert (df["step_ms"] > 0).all()  # per micro-batch, the accumulating variant included
    with pytest.raises(ValueError, match="unknown key.*'overlap'"):
        ddp.overlap_experiment(2, variants=[{"overlap": False}])
    assert "overlap" not in inspect.signature(ddp.throughput).parameters
    assert df["step_ms_vs_default"].iloc[0] == pytest.approx(1.0) and (df["images_per_s"] > 0).all()
    assert df["buckets"].iloc[1] > df["buckets"].iloc[0] == 1  # a smaller cap cuts the gradients into more buckets


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), found before anything is killed: once torchrun is gone its
    worker is re-parented and the link is lost."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(p: subprocess.Popen) -> None:
    """Stop a torchrun started with start_new_session, and its worker, which torchrun starts in a session of its
    own: SIGTERM to every process group (torchrun then stops its worker), SIGKILL to whatever is left after 5 s."""
    p.poll()
    if not group_still_its(p):  # exited, and its pid (the group's id) went to a new process meanwhile
        return
    groups = {p.pid}
    for pid in _descendants(p.pid):
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, sig)
        deadline = time.monotonic() + 5
        while groups and time.monotonic() < deadline:
            p.poll()  # reap torchrun, so a finished group reads as gone
            for g in list(groups):
                try:
                    os.killpg(g, 0)
                except ProcessLookupError:
                    groups.discard(g)
            time.sleep(0.05)
        if not groups:
            break
    p.wait(5)


NODE_TIMEOUT_S = 120  # both nodes together; alone the test takes about 10 s, 25 s beside a busy core
PEER_FAILED_GRACE_S = 15  # after one node failed, how long the other may take to notice before it is stopped


def _run_nodes(cmds: list[list[str]], logs: list[Path], cwd: Path, env: dict[str, str]) -> list[int | None]:
    """Start one torchrun per command, each in its own process group; wait until all exit, one fails (then give
    the others PEER_FAILED_GRACE_S), or NODE_TIMEOUT_S passes; stop whatever is left. Returns the exit codes
    (None: stopped by the test)."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log in zip(cmds, logs, strict=True):
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # own process group: killable as a whole
        deadline = time.monotonic() + NODE_TIMEOUT_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            # A node whose peer failed would wait in torchrun's exit barrier (300 s) or for a collective's timeout.
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + PEER_FAILED_GRACE_S)
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:  # also after a clean exit: nothing this test started may outlive it
            _stop(p)
    return codes


def test_two_node_loopback(tmp_path):
    """Two torchrun 'nodes' on this machine train together over gloo and both exit 0.

    They meet through a c10d rendezvous on a TCPStore this test hosts: it binds port 0 and listens before either
    node starts, so the OS picks the port and nothing can take it before use (a port chosen first and bound
    later by node 0 leaves that window). torchrun's rank-0 agent then binds the workers' store on port 0 too.
    """
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=60))
    out = tmp_path / "result.json"
    # TMPDIR: torchrun's log folders (torchelastic_*) stay inside the test's own folder
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--max-restarts=0",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", f"--rdzv-id=loopback-{os.getpid()}",
           "--rdzv-conf=is_host=0,join_timeout=60", "--local-addr=127.0.0.1",
           str(ROOT / "scripts" / "train_ddp.py"), "--backend", "gloo", "--epochs", "2", "--timeout-s", "60",
           "--out", str(out)]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    try:
        codes = _run_nodes([cmd, cmd], logs, tmp_path, env)
    finally:
        del store  # stops its server thread and frees the port
    both = "\n".join(f"--- {log.name} (exit code {code})\n{log.read_text()[-6000:]}"
                      for log, code in zip(logs, codes, strict=True))
    assert codes == [0, 0], f"exit codes {codes} (None: stopped after {NODE_TIMEOUT_S} s or a peer's failure)\n{both}"
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["backend"] == "gloo" and len(res["hosts"]) == 2, both
    assert res["accuracy"] > 0.8, both
