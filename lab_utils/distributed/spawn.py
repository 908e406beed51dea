"""Launch N worker processes for a function from a notebook, with a process group in each.

``launch(fn, nprocs)`` spawns one process per rank, initialises ``torch.distributed`` (NCCL when there is one
GPU per rank, gloo otherwise), calls ``fn(ctx, **kwargs)`` and returns the results by rank. A worker's
exception reaches the caller with its rank and traceback; a timeout names what each rank was doing; on any
failure, interrupt or exit every worker is stopped, so no process and no port is left behind. Worker
functions must live in an importable module (spawned processes cannot see functions defined in a notebook).

``start_process_group`` and ``leave_process_group`` are the two ends of a rank's life in a group, shared with
``scripts/train_ddp.py`` under torchrun: a rank leaves by a barrier, then destroys the group while the
interpreter is still whole, so no backend thread runs into its shutdown.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take ``group=group.WORLD`` as a default
# argument, evaluated at import. DDP's constructor imports it (through torch._dynamo); imported after
# init_process_group, it would hold the default group for the life of the interpreter, destroy_process_group
# could not free it, and the backend's threads would run on into interpreter shutdown and abort the process
# there ("terminate called without an active exception", SIGABRT at exit).
import torch.distributed.nn  # noqa: F401

from lab_utils.procs import die_with_parent

BACKENDS = ("auto", "nccl", "gloo")
# The group's collectives wait at least this long for a peer (a notebook's first NCCL call can take seconds).
MIN_GROUP_TIMEOUT_S = 30.0


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
    _events: Queue[tuple[str, int, Any]] | None = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def status(self, text: str) -> None:
        """Tell the launcher what this rank is doing now (a timeout names it); a no-op outside ``launch``."""
        if self._events is not None:
            self._events.put(("status", self.rank, text))

    def barrier(self) -> None:
        """Wait until every rank gets here (bounded by the group's timeout)."""
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()


def torch_gpu_count() -> int:
    """CUDA devices torch can use here (0 without a CUDA build of torch or without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(nprocs: int, backend: str = "auto") -> str:
    """NCCL when each rank can have its own GPU, else gloo; an impossible request says why and what to use."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r}: the number of worker processes must be an integer >= 1")
    gpus = torch_gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= nprocs and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if gpus < nprocs:
            raise ValueError(
                f"NCCL needs one GPU per rank: asked for {nprocs} ranks, {gpus} GPU(s) here. "
                + (f"Use backend='gloo' (CPU processes) or nprocs <= {gpus}" if gpus
                   else "With no GPU, use backend='gloo' (CPU processes)")
            )
        if not dist.is_nccl_available():
            raise ValueError("this torch build has no NCCL: use backend='gloo'")
    return backend


# --------------------------------------------------------------------------------------------------
# One rank's life in a process group


def start_process_group(backend: str, rank: int, world_size: int, local_rank: int, timeout_s: float,
                        store: dist.Store | None = None,
                        events: Queue[tuple[str, int, Any]] | None = None) -> WorkerContext:
    """Join the default process group as ``rank`` of ``world_size``; returns this rank's context.

    NCCL ranks use GPU ``local_rank`` (set before any CUDA work, so NCCL's context lands there); gloo ranks the
    CPU. ``store``: the rendezvous store (``launch`` gives each worker a client of the one it hosts); None reads
    MASTER_ADDR and MASTER_PORT from the environment, as torchrun sets them. Every collective, the final
    barrier included, waits at most ``timeout_s`` seconds for a peer (then raises).
    """
    device = "cpu"
    kw: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        kw["device_id"] = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout,
                                **kw)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kw)
    return WorkerContext(rank, world_size, local_rank, backend, device, events)


def leave_process_group(ctx: WorkerContext, synchronize: bool = True) -> None:
    """Destroy the process group now, so that its threads end here and not during interpreter shutdown.

    ``synchronize``: first wait at a barrier until every rank is done (after a success; a rank that failed must
    not wait for peers that may be inside a collective). The barrier is bounded by the group's timeout, so a
    rank whose peer died raises instead of hanging. A group still referenced after destruction keeps its
    backend's threads (gloo's loop and workers, NCCL's watchdog) alive into interpreter shutdown, where one
    that touches Python aborts the process: that is reported as a RuntimeWarning. Safe to call twice.
    """
    if not dist.is_initialized():
        return
    try:
        if synchronize:
            ctx.barrier()
    finally:
        world = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        gc.collect()  # DDP's autograd hooks form reference cycles that keep the group until a collection
        if world() is not None:
            warnings.warn(
                f"rank {ctx.rank}: the process group is still referenced after destroy_process_group(), so its "
                "threads will run into interpreter shutdown and may abort the process at exit. Drop models and "
                "tensors that hold it before leaving, and import modules that capture group.WORLD (such as "
                "torch.distributed.nn) before init_process_group",
                RuntimeWarning, stacklevel=2,
            )


# --------------------------------------------------------------------------------------------------
# The launcher


def _worker(fn: Callable[..., Any], kwargs: dict[str, Any], rank: int, world: int, backend: str,
            port: int, events: Queue[tuple[str, int, Any]], env: dict[str, str], timeout_s: float) -> None:
    die_with_parent()  # Linux: SIGKILL this worker if the notebook's kernel dies, so no worker is orphaned
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        events.put(("status", rank, "joining the process group"))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        ctx = start_process_group(backend, rank, world, rank, timeout_s, store=store, events=events)
        del store  # the group keeps its own reference; none may outlive it
        done = False
        try:
            result = fn(ctx, **kwargs)
            done = True
        finally:
            leave_process_group(ctx, synchronize=done)
        events.put(("done", rank, result))
    except BaseException:  # everything, including KeyboardInterrupt, goes back to the notebook with the rank
        events.put(("error", rank, traceback.format_exc()))


@contextlib.contextmanager
def _rendezvous_store(timeout_s: float) -> Iterator[int]:
    """A TCPStore hosted in this process for the workers to meet at; yields its port, closes it at the end.

    The store binds port 0 and listens before any worker starts, so the OS picks a free port and nothing can
    take it between the choice and its use (a port chosen first and bound later by rank 0 leaves that window).
    """
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store  # stops the server thread and frees the port


@contextlib.contextmanager
def _workers(procs: list[BaseProcess]) -> Iterator[None]:
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

    ``env`` adds variables for the workers (they inherit the parent's, ``NCCL_*`` included). A collective waits
    at most max(``timeout_s``, 30) seconds for a peer. Raises ``WorkerError`` (rank and traceback) or
    ``WorkerTimeout`` (each rank's last status); in every case all workers are stopped before it returns.
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
    group_timeout_s = max(timeout_s, MIN_GROUP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    child_env = dict(env or {})
    child_env.setdefault("NCCL_NVLS_ENABLE", os.environ.get("NCCL_NVLS_ENABLE", "0"))
    results: dict[int, Any] = {}
    status = {r: "starting" for r in range(nprocs)}
    with _rendezvous_store(group_timeout_s) as port:
        procs = [
            ctx.Process(target=_worker, daemon=True, name=f"nvlab-rank{r}",
                        args=(fn, kwargs or {}, r, nprocs, chosen, port, events, child_env, group_timeout_s))
            for r in range(nprocs)
        ]
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
