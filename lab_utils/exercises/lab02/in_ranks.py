"""Running a student's function in real ranks for lab 02's rank exercises (02.2, 02.6, 02.7): where, how a failure
reads (the student's line, or where each rank was stuck), and the results made plain for the trip back."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab_utils.distributed import ranks as ranks_mod
from lab_utils.distributed.bandwidth import KIB, MIB
from lab_utils.distributed.plan import lab_plan
from lab_utils.distributed.spawn import WorkerError, WorkerTimeout, launch, torch_gpu_count
from lab_utils.exercises.framework import StudentLine, Wrong, student_frame
from lab_utils.exercises.outcomes import _short


def grading_ranks(backend: str | None = None, nprocs: int | None = None) -> tuple[str, int]:
    """(backend, ranks) the rank exercises run on: the lab's own (``distributed.plan.lab_plan``), NCCL on every
    GPU where there are two or more, else 2 gloo processes on the CPU (one GPU included); a ``backend`` or
    ``nprocs`` given is kept."""
    if backend is None or nprocs is None:
        plan = lab_plan(torch_gpu_count())
        backend, nprocs = backend or plan.backend, nprocs or plan.nprocs
    return backend, nprocs


def no_distributed() -> str | None:
    return None if dist.is_available() else "this torch build has no torch.distributed: no ranks can run here"


def exception_line(text: str, limit: int = 220) -> str:
    """The last line of a formatted traceback ("ValueError: ..."), shortened."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "an error"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _worker_frames(stack: str) -> list[Any]:
    """The frames of the thread that runs the launcher's ``_worker``, innermost first (none if not found)."""
    threads = map(ranks_mod.stack_frames, re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack))
    return next((frames for frames in threads if any(f.function == "_worker" for f in frames)), [])


def rank_failure(call: str, err: WorkerError | WorkerTimeout, shipped: ranks_mod.Shipped, timeout_s: float) -> Wrong:
    """The student's code failed in a rank: what it raised (or where each rank was stuck), at the student's line."""
    if isinstance(err, WorkerError):
        text = err.remote_traceback
        if "Traceback (most recent call last)" not in text:  # the process died: no Python traceback
            return Wrong(f"{call}: rank {err.rank}'s {text}")
        at = student_frame(text)
        return Wrong(f"{call} raised on rank {err.rank}: {exception_line(text)}" + (f" (at {at})" if at else ""))
    if _in_teardown(err):
        return Wrong(f"{call}: every rank finished its work, then rank {', '.join(map(str, sorted(err.stacks)))} "
                     "hung inside torch's dist.destroy_process_group() (a gloo teardown that waits for a peer "
                     "already gone; seen twice in a row here). Your code is not the cause: run the check again.")
    where = []
    for rank, stack in sorted(err.stacks.items()):
        mine = [f for f in ranks_mod.stack_frames(stack) if f.filename in shipped.files]
        # where the rank's main thread was: the innermost frame of the thread that runs the launcher's ``_worker``
        # (``torch/distributed/distributed_c10d.py:2184 in destroy_process_group``)
        at = next((f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} in {f.function}"
                   for f in _worker_frames(stack)[:1]), "")
        if mine:
            f = mine[0]
            line = StudentLine(f.filename, f.lineno, f.function, ranks_mod.code_at(f.filename, f.lineno))
            inner = f" (inside {at})" if at and not at.endswith(f" in {f.function}") else ""
            where.append(f"rank {rank} at {line}{inner}")
        else:
            where.append(f"rank {rank} outside your function (returned, or waiting for the others)"
                         + (f", at {at}" if at else ""))
    stuck = f" ({'; '.join(where)})" if where else ""
    late = str(err).split(";")[0] if err.straggler else f"did not finish within {timeout_s:g} s"
    return Wrong(f"{call}: {late}{stuck}: ranks waiting for each other? Every rank must "
                 "make the same collective calls in the same order: a collective (or a barrier) that only some "
                 "ranks reach, e.g. inside `if rank == 0:`, waits for ever.")


def _in_teardown(err: WorkerError | WorkerTimeout) -> bool:
    """Whether every rank still running was inside torch's destroy_process_group: the work was done."""
    return isinstance(err, WorkerTimeout) and bool(err.stacks) and all(
        any(f.function == "destroy_process_group" for f in _worker_frames(t)[:2]) for t in err.stacks.values())


def launch_again_once(worker: Callable[..., Any], nprocs: int, backend: str, timeout_s: float,
                      kwargs: dict[str, Any], **options: Any) -> list[Any]:
    """``launch``, once more when a rank did not follow its peers that had returned (``straggler_s``) or hung in
    torch's destroy_process_group: rare, gloo's teardown (the group's destruction, explicit or when DDP lets it
    go) can wait for a peer already gone. The second failure is raised."""
    try:
        return launch(worker, nprocs, backend=backend, timeout_s=timeout_s, kwargs=kwargs, **options)
    except WorkerTimeout as err:
        if not (err.straggler or _in_teardown(err)):
            raise
    return launch(worker, nprocs, backend=backend, timeout_s=timeout_s, kwargs=kwargs, **options)


def run_in_ranks(worker: Callable[..., Any], shipped: ranks_mod.Shipped, call: str, nprocs: int, backend: str,
                 timeout_s: float, kwargs: dict[str, Any], **options: Any) -> list[Any]:
    """The worker's results on the ranks (``options`` as ``launch``'s), or the student's failure as ``Wrong``."""
    try:
        return launch_again_once(worker, nprocs, backend, timeout_s, {"student": shipped, **kwargs}, **options)
    except (WorkerError, WorkerTimeout) as err:
        raise rank_failure(call, err, shipped, timeout_s) from None


@contextlib.contextmanager
def shipped_answer(fn: Any, var: str) -> Iterator[ranks_mod.Shipped]:
    """The student's ``var`` shipped to the ranks (``distributed.ranks.shipping``); ``Wrong`` when it cannot be."""
    try:
        with ranks_mod.shipping(fn) as shipped:
            yield shipped
    except ranks_mod.ShipError as err:
        raise Wrong(f"`{var}` cannot be sent to the ranks: {err}") from None


def plain(value: Any) -> Any:
    """The student's result as plain Python for the trip back from a rank (anything else becomes its repr)."""
    if value is None or isinstance(value, (int, float, str)):  # bool too
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if hasattr(value, "to_dict") and hasattr(value, "columns"):  # a DataFrame
        value = value.to_dict("records")
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    with contextlib.suppress(Exception):
        return float(value)  # numpy scalars
    return {"__repr__": f"{type(value).__name__}: {repr(value)[:80]}"}


def show(value: Any) -> str:
    """A value ``plain`` brought back, as a message shows it."""
    return f"a {value['__repr__']}" if isinstance(value, dict) and "__repr__" in value else _short(value, 100)


def fmt_bytes(n: int) -> str:
    """262144 -> '256 KiB': the largest unit that divides ``n`` (bytes) exactly."""
    return next((f"{n // size} {unit}" for unit, size in (("GiB", 2**30), ("MiB", MIB), ("KiB", KIB))
                 if n >= size and n % size == 0), f"{n} B")
