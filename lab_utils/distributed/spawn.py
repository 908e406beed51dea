"""Launch N worker processes for a function from a notebook, with a process group in each.

``launch(fn, nprocs)`` spawns one process per rank, initialises ``torch.distributed`` (NCCL when there is one GPU per
rank, gloo otherwise), calls ``fn(ctx, **kwargs)`` and returns the results by rank. A failure names its rank; no process
and no port is left behind. ``launch(fn, nprocs, group=False)`` starts no group: each rank gets the environment torchrun
would give it. ``start_process_group`` and ``leave_process_group`` are the two ends of a rank's life in a group. Worker
functions must live in an importable module (``lab_utils.distributed.ranks`` ships notebook functions).

Design notes: docs/internals.md#lab_utilsdistributedspawnpy"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import queue as queue_mod
import re
import signal
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

from lab_utils.args import check_int
from lab_utils.procs import die_with, die_with_parent, temporary_folder

BACKENDS = ("auto", "nccl", "gloo")
# The group's collectives wait at least this long for a peer (a notebook's first NCCL call can take seconds).
MIN_GROUP_TIMEOUT_S = 30.0
# Starting the ranks (a new interpreter importing torch, joining the group) has its own limit: launch's timeout_s
# counts from the moment every rank is ready to run fn, so a busy machine's slow start never eats into it.
STARTUP_TIMEOUT_S = 180.0


class WorkerError(RuntimeError):
    """A worker raised; the message carries its rank and its traceback."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class WorkerTimeout(TimeoutError):
    """The workers did not finish in time; the message names what each rank was doing.

    ``stacks`` maps a rank to its Python stack when time ran out (``faulthandler``'s text, innermost call
    first), for the ranks that could write one."""

    def __init__(self, message: str, stacks: dict[int, str] | None = None, straggler: bool = False):
        super().__init__(message)
        self.stacks = dict(stacks or {})
        self.straggler = straggler  # a peer had returned: these ranks did not follow within straggler_s


@dataclass
class WorkerContext:
    """What a worker function receives: its rank, the world, the backend and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" or "gloo"
    device: str  # "cuda:<local_rank>" or "cpu"
    _events: Queue[tuple[str, int, Any]] | None = field(default=None, repr=False)
    # launch(group=False, rendezvous=k): the ports of the launcher's k stores (MASTER_PORT is the first);
    # a function that starts a second group in the same process points MASTER_PORT at the next one.
    rendezvous_ports: tuple[int, ...] = field(default=(), repr=False)
    # The process group this context's collectives use: None is the default (WORLD) group; ``subgroup`` makes
    # contexts for the first n ranks, whose rank and world_size are then those in the subgroup.
    group: Any = field(default=None, repr=False)

    def status(self, text: str) -> None:
        """Tell the launcher what this rank is doing now (a timeout names it); a no-op outside ``launch``."""
        if self._events is not None:
            self._events.put(("status", self.rank, text))

    def barrier(self) -> None:
        """Wait until every rank of this context's group gets here (bounded by the group's timeout)."""
        if self.backend == "nccl":
            dist.barrier(group=self.group, device_ids=[self.local_rank])
        else:
            # Not gloo's barrier: it also waits on every earlier operation its worker threads still hold and re-raises
            # their errors, so after an operation gloo refused (float8: "Invalid scalar type") a barrier raised that
            # error again on whichever rank's thread had not yet let go of it, and the ranks fell out of step (seen on
            # a loaded machine). A one-element all_reduce waits for every rank and for nothing else.
            dist.all_reduce(torch.zeros(1), group=self.group)

    def subgroup(self, n: int) -> WorkerContext | None:
        """A context for the first ``n`` ranks only, as if the job had ``n`` ranks; None on the other ranks.

        Every rank must call it (making a group is a collective), in the same order. Lets one launch measure
        several world sizes: the ranks outside the subgroup wait while the others run."""
        if not 1 <= n <= self.world_size:
            raise ValueError(f"subgroup(n={n!r}): between 1 and world_size={self.world_size}")
        if n == self.world_size and self.group is None:
            return self
        group = dist.new_group(list(range(n)))
        return None if self.rank >= n else dataclasses.replace(self, world_size=n, group=group)


def torch_gpu_count() -> int:
    """CUDA devices torch can use here (0 without a CUDA build of torch or without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(nprocs: int, backend: str = "auto") -> str:
    """NCCL when each rank can have its own GPU, else gloo; an impossible request says why and what to use."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
    check_int(nprocs, "nprocs", "choose_backend", what="the number of worker processes")
    gpus = torch_gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= nprocs and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if gpus < nprocs:
            raise ValueError(f"NCCL needs one GPU per rank: asked for {nprocs} ranks, {gpus} GPU(s) here. "
                             + (f"Use backend='gloo' (CPU processes) or nprocs <= {gpus}" if gpus
                                else "With no GPU, use backend='gloo' (CPU processes)"))
        if not dist.is_nccl_available():
            raise ValueError("this torch build has no NCCL: use backend='gloo'")
    return backend


# --- One rank's life in a process group -----------------------------------------------------------


def start_process_group(backend: str, rank: int, world_size: int, local_rank: int, timeout_s: float,
                        store: dist.Store | None = None,
                        events: Queue[tuple[str, int, Any]] | None = None) -> WorkerContext:
    """Join the default process group as ``rank`` of ``world_size``; returns this rank's context.

    NCCL ranks use GPU ``local_rank`` (set before any CUDA work, so NCCL's context lands there); gloo ranks the
    CPU. ``store``: the rendezvous store (``launch`` gives each worker a client of the one it hosts); None reads
    MASTER_ADDR and MASTER_PORT from the environment, as torchrun sets them. Every collective, the final
    barrier included, waits at most ``timeout_s`` seconds for a peer (then raises)."""
    device = "cpu"
    kw: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        kw["device_id"] = torch.device(device)
    kw.update({"init_method": "env://"} if store is None else {"store": store})
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            **kw)
    return WorkerContext(rank, world_size, local_rank, backend, device, events)


def leave_process_group(ctx: WorkerContext, synchronize: bool = True) -> None:
    """Destroy the process group now, so that its threads end here and not during interpreter shutdown.

    ``synchronize``: first wait at the group's barrier (after a success only: a failed rank's peers may be inside a
    collective). A group still referenced after destruction keeps its threads into interpreter shutdown, where they
    can abort the process: a RuntimeWarning says so. Safe to call twice."""
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
            warnings.warn(f"rank {ctx.rank}: the process group is still referenced after destroy_process_group(), so "
                          "its threads will run into interpreter shutdown and may abort the process at exit. Drop "
                          "models and tensors that hold it before leaving, and import modules that capture "
                          "group.WORLD (such as torch.distributed.nn) before init_process_group", RuntimeWarning,
                          stacklevel=2)


# --- The launcher ---------------------------------------------------------------------------------


# Ranks fork from multiprocessing's forkserver, which imports these once per launching process: a spawned rank
# imports torch anew (1.5 s of CPU each on an idle machine), a forked one starts in milliseconds. Importing them
# starts no CUDA context, so each rank still initializes its own GPU (fork after CUDA initialization is what breaks).
_PRELOAD = ["torch", "torch.distributed", "lab_utils.distributed.spawn"]


def mp_context() -> Any:
    """The multiprocessing context ranks start in: forkserver with torch preloaded, or spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts; later calls change nothing
    return ctx


# Environment for a rank whose function joins the group itself (launch(group=False)): the launcher hosts the
# store, and torch's env:// rendezvous connects every rank to it as a client, as under torchrun's agent.
_AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def _worker(fn: Callable[..., Any], kwargs: dict[str, Any], rank: int, world: int, backend: str,
            ports: tuple[int, ...], events: Queue[tuple[str, int, Any]], env: dict[str, str], timeout_s: float,
            group: bool, stack_file: str, launcher: int) -> None:
    # Linux: SIGKILL this worker if the notebook's kernel dies, so no worker is orphaned (its parent is the
    # forkserver, which stays while a rank lives)
    die_with_parent()
    die_with(launcher)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        # On SIGUSR1 (sent by launch when time is up) write every thread's Python stack, even from inside a
        # blocking collective, so a timeout can say which line each rank was stuck at.
        faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=True)  # noqa: SIM115
    if os.environ != env:  # a forked rank has the forkserver's environment: the launcher's, as it was then
        os.environ.clear()
        os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0])})
    try:
        if group:
            events.put(("status", rank, "joining the process group"))
            timeout = datetime.timedelta(seconds=timeout_s)
            store = dist.TCPStore("127.0.0.1", ports[0], world, is_master=False, timeout=timeout)
            ctx = start_process_group(backend, rank, world, rank, timeout_s, store=store, events=events)
            del store  # the group keeps its own reference; none may outlive it
        else:
            os.environ.update(_AGENT_STORE_ENV)
            device = f"cuda:{rank}" if backend == "nccl" else "cpu"
            ctx = WorkerContext(rank, world, rank, backend, device, events)
        ctx.rendezvous_ports = tuple(ports)
        events.put(("ready", rank, None))
        try:
            result = fn(ctx, **kwargs)
        except BaseException:
            # Reported before the group goes: leaving it makes the peers fail too ("connection closed by peer"),
            # and the launcher should hear the cause first.
            events.put(("error", rank, traceback.format_exc()))
            leave_process_group(ctx, synchronize=False)
            return
        ctx.status("returned; waiting at the final barrier for the other ranks" if group else "returned")
        # group=False: a function that left its group standing has it destroyed here, without a barrier (its
        # peers may have destroyed theirs), so no backend thread runs into interpreter shutdown.
        leave_process_group(ctx, synchronize=group)
        events.put(("done", rank, result))
    except BaseException:  # everything, including KeyboardInterrupt, goes back to the notebook with the rank
        events.put(("error", rank, traceback.format_exc()))


@contextlib.contextmanager
def _rendezvous_store(timeout_s: float) -> Iterator[int]:
    """A TCPStore hosted in this process for the workers to meet at; yields its port, closes it at the end.

    The store binds port 0 and listens before any worker starts, so the OS picks a free port and nothing can
    take it between the choice and its use (a port chosen first and bound later by rank 0 leaves that window)."""
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


# A rank that failed because a peer went away: its error is a consequence, not the cause.
_PEER_LOST = re.compile(r"closed by peer|reset by peer|remote worker|Broken pipe|communicator was aborted|"
                        r"Connection refused|NCCL.*(abort|error.*remote)", re.I)


def _root_cause(events: Queue[tuple[str, int, Any]], rank: int, text: str, pending: int,
                grace_s: float = 2.0) -> tuple[int, str]:
    """The error to report: the first one that is not a peer's loss, waiting ``grace_s`` for the others.

    When one rank raises, its peers fail in their next collective, and their errors may reach the queue first."""

    def lost(t: str) -> bool:
        return bool(_PEER_LOST.search(t.strip().splitlines()[-1] if t.strip() else ""))

    if not lost(text):
        return rank, text
    errors = [(rank, text)]
    deadline = time.monotonic() + grace_s
    while len(errors) < pending and (left := deadline - time.monotonic()) > 0:
        try:
            kind, r, payload = events.get(timeout=min(left, 0.2))
        except queue_mod.Empty:
            continue
        if kind == "error":
            if not lost(payload):
                return r, payload
            errors.append((r, payload))
    return errors[0]


def _stacks(procs: list[BaseProcess], files: list[str], wait_s: float = 1.0) -> dict[int, str]:
    """Each live worker's Python stack: SIGUSR1 makes its faulthandler write it; rank -> text."""
    asked = []
    for r, p in enumerate(procs):
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGUSR1)
                asked.append(r)
    out: dict[int, str] = {}
    seen: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        time.sleep(0.05)
        for r in list(asked):
            with contextlib.suppress(OSError):
                with open(files[r]) as f:
                    text = f.read()
                if "File " in text and seen.get(r) == text:  # written, and no longer growing
                    out[r] = text
                    asked.remove(r)
                seen[r] = text
    out.update({r: seen[r] for r in asked if "File " in seen.get(r, "")})
    return out


def launch(fn: Callable[..., Any], nprocs: int, *, backend: str = "auto", kwargs: dict[str, Any] | None = None,
           timeout_s: float = 300.0, env: dict[str, str] | None = None, group: bool = True,
           rendezvous: int = 1, straggler_s: float | None = None,
           on_status: Callable[[int, str], None] | None = None) -> list[Any]:
    """Run ``fn(ctx, **kwargs)`` on ``nprocs`` ranks; returns each rank's result, indexed by rank.

    ``timeout_s`` counts from when every rank is ready to run ``fn`` (starting them has ``STARTUP_TIMEOUT_S``). ``env``
    adds variables for the workers (they inherit the parent's, ``NCCL_*`` included). A collective waits at most
    max(``timeout_s``, 30) seconds for a peer. ``group=False``: no group is started for ``fn``, which joins one itself
    from the torchrun-style environment (see the module doc); ``rendezvous`` stores are hosted for it, one per group it
    starts in turn (their ports: ``ctx.rendezvous_ports``); on gloo its ranks see no GPU (``CUDA_VISIBLE_DEVICES=""``
    unless ``env`` sets it), so they choose gloo too. ``straggler_s``: how long the others may run on once one rank has
    returned (for functions whose ranks end together). ``on_status(rank, text)`` is called here, in the launcher, for
    each ``ctx.status`` of a rank. Raises ``WorkerError`` (rank and traceback) or ``WorkerTimeout``
    (each rank's last status and stack); in every case all workers are stopped before it returns."""
    if not callable(fn):
        raise TypeError(f"launch(fn=...): fn must be a function, got {type(fn).__name__}")
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(f"launch(fn={getattr(fn, '__name__', fn)!r}): worker functions must be defined at the top "
                         "level of an importable module (e.g. lab_utils.distributed.collectives), not in a notebook "
                         "cell; lab_utils.distributed.ranks.run sends a notebook's function to the ranks")
    chosen = choose_backend(nprocs, backend)
    if timeout_s <= 0:
        raise ValueError(f"launch(timeout_s={timeout_s!r}): must be > 0 seconds")
    check_int(rendezvous, "rendezvous", "launch", what="the number of stores")
    group_timeout_s = max(timeout_s, MIN_GROUP_TIMEOUT_S)
    ctx = mp_context()
    events = ctx.Queue()
    child_env = dict(env or {})
    child_env.setdefault("NCCL_NVLS_ENABLE", os.environ.get("NCCL_NVLS_ENABLE", "0"))
    if chosen == "gloo" and not group:
        # A rank that joins its group itself picks its backend from torch.cuda.is_available(), as a torchrun
        # script does: gloo ranks must find no GPU, or with fewer GPUs than ranks (one GPU, two ranks) they pick
        # NCCL and ask for a GPU that is not there ("invalid device ordinal").
        child_env.setdefault("CUDA_VISIBLE_DEVICES", "")
    child_env = {**os.environ, **child_env}  # the launcher's environment now, with the additions
    results: dict[int, Any] = {}
    status = {r: "starting" for r in range(nprocs)}
    with temporary_folder("stacks") as stack_dir:
        stack_files = [os.path.join(stack_dir, f"rank{r}.txt") for r in range(nprocs)]
        with contextlib.ExitStack() as stores:
            ports = tuple(stores.enter_context(_rendezvous_store(group_timeout_s)) for _ in range(rendezvous))
            procs = [ctx.Process(target=_worker, daemon=True, name=f"nvlab-rank{r}",
                                 args=(fn, kwargs or {}, r, nprocs, chosen, ports, events, child_env, group_timeout_s,
                                       group, stack_files[r], os.getpid())) for r in range(nprocs)]
            with _workers(procs):
                for p in procs:
                    p.start()
                ready: set[int] = set()
                first_done: float | None = None
                deadline = time.monotonic() + STARTUP_TIMEOUT_S  # then timeout_s, once every rank is ready
                while len(results) < nprocs:
                    left = deadline - time.monotonic()
                    if straggler_s is not None and first_done is not None and \
                            time.monotonic() - first_done > straggler_s:
                        late = [r for r in range(nprocs) if r not in results]
                        stacks = {r: t for r, t in _stacks(procs, stack_files).items() if r not in results}
                        raise WorkerTimeout(f"rank {', '.join(map(str, late))} still running {straggler_s:g} s after "
                                            f"rank {min(results)} returned; all were stopped", stacks, straggler=True)
                    if left <= 0:
                        doing = "; ".join(f"rank {r}: {s}" for r, s in status.items() if r not in results)
                        stacks = {r: t for r, t in _stacks(procs, stack_files).items() if r not in results}
                        what = f"finish within {timeout_s:g} s" if len(ready) == nprocs else \
                            f"start within {STARTUP_TIMEOUT_S:g} s"
                        raise WorkerTimeout(f"workers did not {what} ({doing}); all were stopped", stacks)
                    try:
                        kind, rank, payload = events.get(timeout=min(left, 0.5))
                    except queue_mod.Empty:
                        if dead := [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]:
                            r = procs.index(dead[0])
                            raise WorkerError(r, f"process exited with code {dead[0].exitcode} while {status[r]!r} "
                                                 "(killed, out of memory, or a crash in native code)") from None
                        continue
                    if kind == "ready":
                        ready.add(rank)
                        if len(ready) == nprocs:
                            deadline = time.monotonic() + timeout_s
                    elif kind == "status":
                        status[rank] = payload
                        if on_status is not None:
                            on_status(rank, payload)
                    elif kind == "done":
                        results[rank] = payload
                        first_done = first_done or time.monotonic()
                    else:
                        rank, payload = _root_cause(events, rank, payload, nprocs - len(results))
                        raise WorkerError(rank, payload)
    return [results[r] for r in range(nprocs)]
