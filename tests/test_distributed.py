"""The worker launcher: real gloo process groups, errors, timeouts, environment, no survivors; leaving a group
ends its threads."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _dist_workers as w
import psutil
import pytest

from lab_utils.distributed import ranks
from lab_utils.distributed import spawn as d

ROOT = Path(__file__).resolve().parents[1]


def _children() -> list[int]:
    """Live rank processes of this test process: forked by its multiprocessing forkserver (or spawned by it)."""
    me = psutil.Process()
    ranks = []
    for kid in me.children():
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(kid.cmdline())
            if "forkserver" in cmd:
                ranks += [g.pid for g in kid.children() if g.status() != psutil.STATUS_ZOMBIE]
            elif "spawn_main" in cmd and kid.status() != psutil.STATUS_ZOMBIE:
                ranks.append(kid.pid)
    return ranks


def test_results_come_back_by_rank():
    out = d.launch(w.allreduce_sum, 2, backend="gloo", timeout_s=120)
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["sum"] == [3.0] * 4 and r["world"] == 2 and r["backend"] == "gloo" for r in out)
    assert _children() == []


def test_a_failing_worker_shows_rank_and_traceback_and_none_survive():
    with pytest.raises(d.WorkerError) as err:
        d.launch(w.fail_on_rank1, 2, backend="gloo", timeout_s=120)
    assert err.value.rank == 1
    assert "deliberate failure in a worker" in str(err.value) and "Traceback" in str(err.value)
    assert _children() == []


def test_a_timeout_names_the_collective_and_stops_all_workers():
    # The timeout counts from when both ranks are ready to run the function (their start on a busy runner is not
    # in it), so 3 s is enough for rank 1 to reach the collective and the message to name it.
    t0 = time.monotonic()
    with pytest.raises(d.WorkerTimeout, match=r"did not finish within 3 s .*all_reduce 1 MiB") as err:
        d.launch(w.hang_in_collective, 2, backend="gloo", timeout_s=3)
    # the start, the timeout, then at most 5 s of SIGTERM and 5 s of SIGKILL per rank
    assert time.monotonic() - t0 < d.STARTUP_TIMEOUT_S + 3 + 20
    assert _children() == []
    # Each rank's Python stack when time ran out, even from inside the blocking collective (faulthandler).
    frames = {r: [(Path(f.filename).name, f.function) for f in ranks.stack_frames(text)]
              for r, text in err.value.stacks.items()}
    assert ("_dist_workers.py", "hang_in_collective") in frames[1]
    assert ("distributed_c10d.py", "all_reduce") in frames[1]
    assert ("_dist_workers.py", "hang_in_collective") in frames[0]  # rank 0 sleeps before the collective


def test_nccl_with_more_ranks_than_gpus_says_so_and_offers_gloo():
    gpus = d.torch_gpu_count()
    with pytest.raises(ValueError, match=r"NCCL needs one GPU per rank.*gloo"):
        d.launch(w.allreduce_sum, gpus + 1, backend="nccl")


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_nprocs_is_named(bad):
    with pytest.raises(ValueError, match="nprocs"):
        d.launch(w.allreduce_sum, bad)


def test_functions_from_a_notebook_are_refused_with_the_fix():
    def local(ctx):
        return 1

    with pytest.raises(ValueError, match="importable module"):
        d.launch(local, 1)


def test_workers_keep_the_parents_nccl_settings(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    (r0,) = d.launch(w.read_env, 1, backend="gloo", env={"NCCL_ALGO": "Ring"},
                     kwargs={"names": ("NCCL_DEBUG", "NCCL_ALGO", "NCCL_NVLS_ENABLE")}, timeout_s=120)
    assert r0 == {"NCCL_DEBUG": "WARN", "NCCL_ALGO": "Ring", "NCCL_NVLS_ENABLE": "0"}


def test_gloo_ranks_that_join_their_own_group_see_no_gpu(monkeypatch):
    """A torchrun-style rank picks NCCL when torch.cuda.is_available(): on one GPU with two gloo ranks it would ask
    for a second GPU. gloo ranks started with group=False find CUDA_VISIBLE_DEVICES empty; the launcher's own
    groups and an explicit setting are left alone."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    names = {"names": ("CUDA_VISIBLE_DEVICES",)}
    (own,) = d.launch(w.read_env, 1, backend="gloo", group=False, kwargs=names, timeout_s=120)
    (made,) = d.launch(w.read_env, 1, backend="gloo", kwargs=names, timeout_s=120)
    (told,) = d.launch(w.read_env, 1, backend="gloo", group=False, env={"CUDA_VISIBLE_DEVICES": "0"}, kwargs=names,
                       timeout_s=120)
    assert (own, made, told) == ({"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": None},
                                 {"CUDA_VISIBLE_DEVICES": "0"})


def test_the_rendezvous_port_is_bound_before_any_worker_starts():
    """launch hosts the workers' store on a port the OS picks while binding it: no window in which another
    process could take it, and it is closed when launch returns."""
    with d._rendezvous_store(10) as port:
        with pytest.raises(OSError):
            socket.create_server(("127.0.0.1", port))
    socket.create_server(("127.0.0.1", port)).close()


# Two lives of a rank in a group, in one fresh interpreter: DDP built and stepped, then the group left; the second
# time a variable still holds the group, as a module-level default argument would.
_LIVES = """
import os, warnings
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from lab_utils.distributed import spawn

def gloo_threads():
    names = {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
    return sorted(n for n in names if "gloo" in n)

for keep in (False, True):
    ctx = spawn.start_process_group("gloo", 0, 1, 0, 30, store=dist.HashStore())
    held = dist.group.WORLD if keep else None
    model = DistributedDataParallel(torch.nn.Linear(4, 2))  # its constructor imports torch.distributed.nn
    model(torch.ones(3, 4)).sum().backward()
    del model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spawn.leave_process_group(ctx)
        spawn.leave_process_group(ctx)  # twice: a no-op
    print(keep, gloo_threads(), ["still referenced" in str(c.message) for c in caught])
    held = None  # the last reference: that group is destroyed here, before exit
"""


def test_leaving_a_group_ends_its_threads_and_a_kept_group_is_reported():
    """Gloo's loop and worker threads are gone when leave_process_group returns, DDP built and used: nothing of the
    group runs into interpreter shutdown, where a thread that touches Python aborts the process. A group something
    still holds is reported, not silently left running."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _LIVES], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr  # no abort at exit
    left, kept = out.stdout.splitlines()
    assert left == "False [] []", out.stderr
    assert kept.startswith("True ['") and kept.endswith("] [True]"), kept  # its threads still run, and it says so


def test_workers_die_with_a_killed_kernel(tmp_path):
    """If the notebook's kernel is killed, its workers go too (no orphans holding ports)."""
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import _dist_workers as w\n"
        "from lab_utils.distributed import spawn as d\n"
        "if __name__ == '__main__':\n"
        f"    d.launch(w.write_pid_and_sleep, 2, backend='gloo', kwargs={{'folder': {str(tmp_path)!r}}},\n"
        "             timeout_s=120)\n"
    )
    (tmp_path / "kernel.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "kernel.py")], start_new_session=False)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2, "workers did not start"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and ") Z" not in Path(f"/proc/{p}/stat").read_text()]
    assert alive == [], f"workers {alive} outlived their parent"


# --- ranks owning their group; subgroups; the root cause of a failure ------------------------------------------


def test_a_rank_can_join_groups_itself_like_under_torchrun():
    out = d.launch(w.two_groups, 2, backend="gloo", group=False, rendezvous=2, timeout_s=120)
    assert [r["sums"] for r in out] == [[[3.0, 3.0], [3.0, 3.0]]] * 2
    assert out[1]["env"] == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert _children() == []


def test_subgroups_of_the_first_n_ranks():
    out = d.launch(w.subgroups, 3, backend="gloo", timeout_s=120)
    assert out[0] == [(0, 1, 1.0), (0, 2, 2.0), (0, 3, 3.0)]
    assert out[1] == [None, (1, 2, 2.0), (1, 3, 3.0)] and out[2] == [None, None, (2, 3, 3.0)]


def test_the_failing_rank_is_reported_not_the_peer_that_lost_it():
    import queue

    lost = "Traceback (most recent call last):\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]"
    cause = "Traceback (most recent call last):\nZeroDivisionError: division by zero"
    q = queue.Queue()
    q.put(("status", 1, "busy"))
    q.put(("error", 1, cause))
    assert d._root_cause(q, 0, lost, pending=2) == (1, cause)
    assert d._root_cause(queue.Queue(), 0, lost, pending=2, grace_s=0.2) == (0, lost)  # nothing better came
    assert d._root_cause(queue.Queue(), 1, cause, pending=2) == (1, cause)  # not a peer's loss: no waiting


# --- notebook functions sent to the ranks as source ---------------------------------------------------------------

# What a notebook cell holds: a constant, a dtype, a helper and the worker, in __main__, with a source only
# linecache knows (as IPython registers each cell).
_CELL = """
import torch
import torch.distributed as dist
SCALE = 2.0
DTYPE = torch.float64


def helper(x):
    return x * SCALE


def worker(ctx, n=3):
    x = torch.full((n,), float(ctx.rank + 1), dtype=DTYPE)
    dist.all_reduce(x)
    if ctx.rank == 1 and n == 0:
        raise ValueError("rank 1 refuses")  # the line to report
    return helper(x).tolist()


def owner(value):
    dist.init_process_group("gloo")
    x = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x.item()
"""


_RAISE_LINE = _CELL.splitlines().index('        raise ValueError("rank 1 refuses")  # the line to report') + 1


def _run_cell(source: str, namespace: dict, filename: str) -> None:
    import linecache

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


@pytest.fixture
def cell():
    import linecache

    namespace = {"__name__": "__main__"}
    _run_cell(_CELL, namespace, "/tmp/ipykernel_0/2764.py")
    yield namespace
    for name in ("/tmp/ipykernel_0/2764.py", "/tmp/ipykernel_0/2765.py"):
        linecache.cache.pop(name, None)


def test_ship_writes_the_source_at_the_cells_line_numbers(cell, tmp_path):
    shipped = ranks.ship(cell["worker"], tmp_path)
    assert shipped.module is None and shipped.name == "worker"  # by source
    files = {Path(f).name: Path(f).read_text().splitlines() for f in shipped.files}
    assert set(files) == {"worker.py", "helper.py"}
    assert files["worker.py"][_RAISE_LINE - 1].strip() == 'raise ValueError("rank 1 refuses")  # the line to report'
    deps = Path(shipped.deps).read_text()
    assert "import torch as torch" in deps and "import torch.distributed as dist" in deps
    assert "SCALE = _nvlab_unpickle(" in deps and "DTYPE = _nvlab_unpickle(" in deps
    fn = shipped.load()  # in this process too
    assert fn.__name__ == "worker" and fn.__globals__["helper"](1.0) == 2.0
    lib = ranks.ship(d.launch, tmp_path)  # library code goes by reference
    assert lib.module is not None and lib.load() is d.launch


def test_ship_refuses_what_cannot_travel_and_says_why(cell, tmp_path):
    with pytest.raises(ranks.ShipError, match="lambda"):
        ranks.ship(lambda ctx: 1, tmp_path)

    def outer():
        def inner(ctx):
            return 1
        return inner

    with pytest.raises(ranks.ShipError, match="top level of a cell"):
        ranks.ship(outer(), tmp_path)
    _run_cell("import threading\nLOCK = threading.Lock()\nBIG = bytes(2**21)\n"
              "def uses_lock(ctx):\n    return LOCK\n\ndef uses_big(ctx):\n    return BIG\n", cell,
              "/tmp/ipykernel_0/2765.py")
    with pytest.raises(ranks.ShipError, match="`uses_lock` uses the notebook's `LOCK`.*cannot be sent"):
        ranks.ship(cell["uses_lock"], tmp_path)
    with pytest.raises(ranks.ShipError, match="2.0 MiB: too large"):
        ranks.ship(cell["uses_big"], tmp_path)
    with pytest.raises(ranks.ShipError, match="defined with `def`"):
        ranks.ship(print, tmp_path)


def test_notebook_functions_run_in_ranks_and_fail_at_their_own_line(cell):
    assert ranks.run(cell["worker"], 2, backend="gloo", timeout_s=120) == [[6.0] * 3, [6.0] * 3]
    with pytest.raises(d.WorkerError) as err:
        ranks.run(cell["worker"], 2, backend="gloo", kwargs={"n": 0}, timeout_s=120)
    assert err.value.rank == 1  # the rank that raised, not the peer that lost it
    tb = err.value.remote_traceback
    assert f'worker.py", line {_RAISE_LINE}, in worker' in tb and 'raise ValueError("rank 1 refuses")' in tb
    assert _children() == []


def test_a_notebook_function_can_own_its_group(cell):
    assert ranks.run(cell["owner"], 2, backend="gloo", group=False, kwargs={"value": 2.0}, timeout_s=120) == [6.0, 6.0]


def test_a_straggler_after_a_peer_returned_is_stopped_early():
    t0 = time.monotonic()
    with pytest.raises(d.WorkerTimeout, match=r"rank 1 still running 2 s after rank 0 returned") as err:
        d.launch(w.rank1_lingers, 2, backend="gloo", timeout_s=120, group=False, straggler_s=2)
    assert time.monotonic() - t0 < d.STARTUP_TIMEOUT_S + 2 + 20  # not the 120 s
    assert "rank1_lingers" in err.value.stacks[1] and _children() == []


def test_the_barrier_does_not_re_raise_an_operation_the_backend_refused():
    # gloo's own barrier re-raised an earlier refused operation's error on the rank whose worker thread still held it,
    # which desynchronised the ranks of the float8 sweep on a loaded machine; the context's barrier must not.
    out = d.launch(w.barrier_after_refused_op, 2, backend="gloo", timeout_s=120)
    assert [r["refused"] for r in out] == [20, 20]
    assert _children() == []
