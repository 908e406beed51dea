"""The worker launcher: real gloo process groups, errors, timeouts, environment, no survivors; leaving a group
ends its threads."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _dist_workers as w
import pytest

from lab_utils.distributed import spawn as d

ROOT = Path(__file__).resolve().parents[1]


def _children() -> list[int]:
    """Live worker processes of this test process (multiprocessing's resource tracker is not a worker)."""
    me, kids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cmd = (stat.parent / "cmdline").read_bytes() if int(fields[1]) == me else b""
        if fields[0] != "Z" and b"spawn_main" in cmd:
            kids.append(int(stat.parent.name))
    return kids


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
    # 20 s: time for two ranks to import torch and reach the collective on a busy 2-core runner, so the message
    # names it; the verdict is what the message says and that nothing survives, not how fast it came.
    t0 = time.monotonic()
    with pytest.raises(d.WorkerTimeout, match="all_reduce 1 MiB"):
        d.launch(w.hang_in_collective, 2, backend="gloo", timeout_s=20)
    assert time.monotonic() - t0 < 20 + 20  # the timeout, then at most 5 s of SIGTERM and 5 s of SIGKILL per rank
    assert _children() == []


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
