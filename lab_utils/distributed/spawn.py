"""Launch N worker processes for a function from a notebook, with a process group in each.

``launch(fn, nprocs)`` spawns one process per rank on a free rendezvous port, initialises
``torch.distributed`` (NCCL when there is one GPU per rank, gloo otherwise), calls ``fn(ctx, **kwargs)``
and returns the results by rank. A worker's exception reaches the caller with its rank and traceback; a
timeout names what each rank was doing; on any failure, interrupt or exit every worker is stopped, so
no process and no port is left behind. Worker functions must live in an importable module (spawned
processes cannot see functions defined in a notebook).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lab_utils.procs import die_with_parent, free_port  # free_port: launch's rendezvous port (re-exported)

BACKENDS = ("auto", "nccl", "gloo")


class WorkerError(RuntimeError):
    """A worker raised; the message carries its rank and its traceback."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class WorkerTimeout(TimeoutError):
    """The workers did not finish in time; the message names what each rank was doing."""


@dataclass
class WorkerContext:
    """What a worker function receives: its rank, the world, the backend and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" or "gloo"
    device: str  # "cuda:<local_rank>" or "cpu"
    _events: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def status(self, text: str) -> None:
        """Tell the launcher what this rank is doing now (a timeout names it)."""
        if self._events is not None:
            self._events.put(("status", self.rank, text))

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()


def torch_gpu_count() -> int:
    """CUDA devices torch can use here (0 without a CUDA build of torch or without a GPU)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def choose_backend(nprocs: int, backend: str = "auto") -> str:
    """NCCL when each rank can have its own GPU, else gloo; an impossible request says why and what to use."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r}: the number of worker processes must be an integer >= 1")
    gpus = torch_gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= nprocs and _nccl_available() else "gloo"
    if backend == "nccl":
        if gpus < nprocs:
            raise ValueError(
                f"NCCL needs one GPU per rank: asked for {nprocs} ranks, {gpus} GPU(s) here. "
                + (f"Use backend='gloo' (CPU processes) or nprocs <= {gpus}" if gpus
                   else "With no GPU, use backend='gloo' (CPU processes)")
            )
        if not _nccl_available():
            raise ValueError("this torch build has no NCCL: use backend='gloo'")
    return backend


def _nccl_available() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_nccl_available()
    except ImportError:
        return False


# Linux: SIGKILL this worker if the notebook's kernel dies, so no worker is orphaned (one shared definition).
_die_with_parent = die_with_parent


def _worker(fn: Callable[..., Any], kwargs: dict[str, Any], rank: int, world: int, backend: str,
            port: int, events: Any, env: dict[str, str], timeout_s: float) -> None:
    _die_with_parent()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import datetime

        import torch
        import torch.distributed as dist

        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        events.put(("status", rank, "joining the process group"))
        kw: dict[str, Any] = {"device_id": torch.device(device)} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(timeout_s, 30)), **kw)
        ctx = WorkerContext(rank, world, rank, backend, device, events)
        try:
            result = fn(ctx, **kwargs)
        finally:
            dist.destroy_process_group()
        events.put(("done", rank, result))
    except BaseException:  # everything, including KeyboardInterrupt, goes back to the notebook with the rank
        events.put(("error", rank, traceback.format_exc()))


@contextlib.contextmanager
def _workers(procs: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        started = [p for p in procs if p.pid is not None]  # a failed start() must not hide the real error
        for p in started:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5
        for p in started:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


def launch(fn: Callable[..., Any], nprocs: int, *, backend: str = "auto", kwargs: dict[str, Any] | None = None,
           timeout_s: float = 300.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(ctx, **kwargs)`` on ``nprocs`` ranks; returns each rank's result, indexed by rank.

    ``env`` adds variables for the workers (they inherit the parent's, ``NCCL_*`` included).
    Raises ``WorkerError`` (rank and traceback) or ``WorkerTimeout`` (each rank's last status);
    in every case all workers are stopped before it returns.
    """
    if not callable(fn):
        raise TypeError(f"launch(fn=...): fn must be a function, got {type(fn).__name__}")
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"launch(fn={getattr(fn, '__name__', fn)!r}): worker functions must be defined at the top level of "
            "an importable module (e.g. lab_utils.distributed.collectives), not in a notebook cell"
        )
    chosen = choose_backend(nprocs, backend)
    if timeout_s <= 0:
        raise ValueError(f"launch(timeout_s={timeout_s!r}): must be > 0 seconds")
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    port = free_port()
    child_env = {k: v for k, v in (env or {}).items()}
    child_env.setdefault("NCCL_NVLS_ENABLE", os.environ.get("NCCL_NVLS_ENABLE", "0"))
    procs = [
        ctx.Process(target=_worker, args=(fn, kwargs or {}, r, nprocs, chosen, port, events, child_env, timeout_s),
                    daemon=True, name=f"nvlab-rank{r}")
        for r in range(nprocs)
    ]
    results: dict[int, Any] = {}
    status = {r: "starting" for r in range(nprocs)}
    with _workers(procs):
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                doing = "; ".join(f"rank {r}: {s}" for r, s in status.items() if r not in results)
                raise WorkerTimeout(f"workers did not finish within {timeout_s:g} s ({doing}); all were stopped")
            try:
                kind, rank, payload = events.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    r = procs.index(dead[0])
                    raise WorkerError(r, f"process exited with code {dead[0].exitcode} while {status[r]!r} "
                                         "(killed, out of memory, or a crash in native code)") from None
                continue
            if kind == "status":
                status[rank] = payload
            elif kind == "done":
                results[rank] = payload
            else:
                raise WorkerError(rank, payload)
    return [results[r] for r in range(nprocs)]
