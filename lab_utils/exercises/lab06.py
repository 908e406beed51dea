"""Lab 06 exercises: profiling and diagnosing a slow training program.

Four of the six are code the check runs: ``profile_steps(step, trace_path)`` (torch.profiler by hand, the Chrome
trace exported), ``gpu_busy_fraction(trace)`` (the union of kernel intervals over the steps' wall time, a
fraction 0..1), ``make_loader(dataset, batch_size, device)`` (the data-loading fix) and ``train_loop(model, opt,
batches, log_every)`` (no host sync per step). Two are readings: which bottleneck four trace summaries show, and
which side of the roofline ncu puts a GEMM and an elementwise kernel.

Design notes: docs/internals.md#lab_utilsexerciseslab06py
"""

from __future__ import annotations

import copy
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lab_utils.course import results
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    References,
    Wrong,
    choice,
    run_student,
    source_as,
)
from lab_utils.exercises.lab01 import grading_device  # the lab's own device: the GPU when torch can use one
from lab_utils.exercises.student import _is_students
from lab_utils.procs import temporary_folder
from lab_utils.profiling import trace as tr
from lab_utils.profiling.programs import PngDigits, close_iterator, loader_workers

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6",
    "reference_profile_steps", "reference_gpu_busy_fraction", "reference_make_loader", "reference_train_loop",
    "random_trace", "committed_traces", "DIAGNOSIS_CASES", "SCHEDULE",
]

SCHEDULE = {"wait": 1, "warmup": 1, "active": 3}
STEPS = sum(SCHEDULE.values())  # the step() calls profile_steps makes
ACTIVE_STEPS = {f"{tr.STEP_PREFIX}{i}" for i in range(SCHEDULE["wait"] + SCHEDULE["warmup"], STEPS)}
GRADER_RANGE = "grader_step"


# --- reference implementations (later cells of the lab use these) -------------------------------------------


def reference_profile_steps(step: Callable[[], Any], trace_path: str | Path) -> None:
    """Profile ``step()`` with a wait-1/warm-up-1/active-3 schedule and export the Chrome trace."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for _ in range(5):
            step()
            prof.step()  # tells the schedule a step ended; also labels each step ProfilerStep#N
    prof.export_chrome_trace(str(trace_path))


def reference_gpu_busy_fraction(trace: Mapping[str, Any]) -> float:
    """Union of kernel intervals, clipped to the steps' wall time, over that wall time."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    t0 = min(e["ts"] for e in steps)
    t1 = max([e["ts"] + e["dur"] for e in steps] + [end for start, end in kernels if start >= t0])
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in kernels:
        s, e = max(s, t0), min(e, t1)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += (cur_e - cur_s) if cur_e is not None else 0.0
    return busy / (t1 - t0)


def reference_make_loader(dataset: torch.utils.data.Dataset, batch_size: int,
                          device: str) -> torch.utils.data.DataLoader:
    """Batches prepared by worker processes ahead of the loop, in pinned memory when they go to a GPU."""
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=loader_workers(),
                                       pin_memory=device.startswith("cuda"), persistent_workers=True,
                                       prefetch_factor=4, drop_last=True)


def reference_train_loop(model: torch.nn.Module, opt: torch.optim.Optimizer,
                         batches: Sequence[tuple[torch.Tensor, torch.Tensor]], log_every: int) -> list[float]:
    """Train on ``batches``; return the mean loss of each window of ``log_every`` steps, read back once per window."""
    logged = []
    running = torch.zeros((), device=batches[0][0].device)
    for i, (x, y) in enumerate(batches, start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running += loss.detach()  # detach: keep the value, not the graph
        if i % log_every == 0:
            logged.append(running.item() / log_every)  # the only read-back: once per window
            running.zero_()
    return logged


# --- q1: the profiler by hand -------------------------------------------------------------------------------


def _grader_step(device: str) -> tuple[Callable[[], None], list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    x = torch.randn(128, 64, device=device)
    calls = [0]

    def step() -> None:
        with torch.profiler.record_function(GRADER_RANGE):
            model(x).square().mean().backward()
        calls[0] += 1

    return step, calls


def _grade_profile_steps(fn: Any) -> str:
    device = grading_device()
    step, calls = _grader_step(device)
    with temporary_folder("profile-check") as d:
        path = d / "trace.json"
        run_student(fn, step, str(path), what="profile_steps", call="profile_steps(step, trace_path)",
                    timeout_s=120)
        if calls[0] != STEPS:
            raise Wrong(f"step() was called {calls[0]} times; the schedule wait=1, warmup=1, active=3 needs "
                        f"{STEPS} calls, each followed by prof.step()")
        if not path.is_file():
            raise Wrong("no trace at trace_path: call prof.export_chrome_trace(trace_path) after the `with` block")
        trace = tr.load_trace(path)
    ev = tr.events(trace)
    steps = set(ev[(ev["cat"] == "user_annotation") & ev["name"].str.startswith(tr.STEP_PREFIX)]["name"])
    # CPU-side ranges only: on a GPU, record_function also leaves a gpu_user_annotation of the same name
    grader = int(((ev["name"] == GRADER_RANGE) & (ev["cat"] == "user_annotation")).sum())
    if grader == STEPS:
        raise Wrong("all 5 steps were recorded, the first (slow: one-time costs) included: pass "
                    "schedule=torch.profiler.schedule(wait=1, warmup=1, active=3) to profile()")
    if not steps:
        raise Wrong("the trace has no ProfilerStep# ranges: call prof.step() after each step() so the schedule "
                    "advances (without it nothing past 'wait' is recorded)")
    if steps != ACTIVE_STEPS:
        got = sorted(int(s.removeprefix(tr.STEP_PREFIX)) for s in steps)
        why = ("every step was recorded, the first (slow, one-time costs) included: pass "
               "schedule=torch.profiler.schedule(wait=1, warmup=1, active=3)" if len(got) == STEPS else
               "the schedule is not wait=1, warmup=1, active=3")
        raise Wrong(f"the trace holds steps {got}; expected {sorted(int(s[13:]) for s in ACTIVE_STEPS)}: {why}")
    if grader != SCHEDULE["active"]:
        raise Wrong(f"the step's own range appears {grader} times in the trace, expected {SCHEDULE['active']}")
    kernels = int((ev["cat"] == "kernel").sum())
    if device.startswith("cuda") and not kernels:
        raise Wrong("no GPU kernels in the trace: profile CUDA activity too, "
                    "activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]")
    return f"Your trace holds 3 steps, {len(ev)} events" + (f", {kernels} kernels." if kernels else ".")


q1 = CodeExercise(
    name="06.1 a trace by hand", var="profile_steps", grade=_grade_profile_steps,
    references=References("run torch.profiler with the schedule yourself", reference_profile_steps),
    signature="profile_steps(step, trace_path) -> None",
    hints=[
        "with torch.profiler.profile(activities=[...], schedule=torch.profiler.schedule(wait=1, warmup=1, "
        "active=3)) as prof: then call step() five times.",
        "After each step() call prof.step(): it moves the schedule on and names the step ProfilerStep#N. "
        "ProfilerActivity.CUDA records the kernels when torch.cuda.is_available().",
        "After the with block: prof.export_chrome_trace(trace_path).",
    ],
    solution_text=source_as(reference_profile_steps, "profile_steps(step, trace_path)"),
)


# --- q2: GPU busy fraction ----------------------------------------------------------------------------------


def random_trace(rng: random.Random) -> dict[str, Any]:
    """A trace with 3 steps, kernels on two streams that overlap, gaps, one kernel from before the steps and one
    that ends after the last step (the GPU finishing queued work after the host moved on)."""
    ev: list[dict[str, Any]] = []
    t = rng.uniform(1e6, 2e6)
    t0 = t
    ev.append({"ph": "X", "cat": "kernel", "name": "leftover_from_warmup", "ts": t0 - 300.0, "dur": 400.0,
               "pid": 0, "tid": 7})
    for i in range(3):
        dur = rng.uniform(800, 1500)
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i + 2}", "ts": t, "dur": dur,
                   "pid": 1, "tid": 1})
        k = t + rng.uniform(20, 60)
        while k < t + dur - 50:
            d = rng.uniform(10, 120)
            ev.append({"ph": "X", "cat": "kernel", "name": "gemm", "ts": k, "dur": d, "pid": 0, "tid": 7})
            if rng.random() < 0.5:  # a second stream overlapping this kernel
                ev.append({"ph": "X", "cat": "kernel", "name": "nccl_allreduce", "ts": k + d * rng.uniform(0.1, 0.6),
                           "dur": rng.uniform(30, 150), "pid": 0, "tid": 13})
            k += d + rng.uniform(0, 80)
        t += dur
    ev.append({"ph": "X", "cat": "kernel", "name": "tail", "ts": t - 40.0, "dur": rng.uniform(200, 500),
               "pid": 0, "tid": 7})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t0 + 5, "dur": 3000.0, "pid": 1, "tid": 1})
    rng.shuffle(ev)
    return {"traceEvents": ev}


def committed_traces() -> list[Path]:
    """Real traces kept from the reference runs (``reference_runs/*/traces_06/*.json.gz``)."""
    return sorted(p for d in results.reference_dirs() for p in (d / "traces_06").glob("*.json.gz"))


def slip_guesses(trace: Mapping[str, Any], want: float) -> list[tuple[str, float]]:
    """(what went wrong, the fraction that slip gives) for the usual slips on ``trace``; ``want`` is the right
    fraction. Computed once per trace: ``_slips`` matches an answer against them."""
    ev = tr.events(trace)
    k = ev[ev["cat"] == "kernel"]
    t0, t1 = tr.step_window(ev)
    total = float(k["dur_us"].sum())
    steps = ev[(ev["cat"] == "user_annotation") & ev["name"].str.startswith(tr.STEP_PREFIX)]
    s0, s1 = float(steps["ts_us"].min()), float(steps["end_us"].max())
    clipped = float((k["end_us"].clip(upper=t1) - k["ts_us"].clip(lower=t0)).clip(lower=0).sum())
    twice = ("overlapping kernels counted twice: two streams can run at once; take the union of the intervals "
             "(sort by start, merge overlaps), not the sum of durations")
    return [
        (twice, total / (t1 - t0)),
        (twice, clipped / (t1 - t0)),
        ("divided by the kernels' own time: the denominator is the steps' wall time", 1.0),
        ("kernels outside the steps counted too: clip each interval to the window first",
         tr.union_us(tr.kernel_intervals(k)) / (t1 - t0)),
        ("the window ends with the last ProfilerStep, but kernels still run after it: extend it to the last "
         "kernel's end", tr.union_us(tr.kernel_intervals(k), (s0, s1)) / (s1 - s0)),
        ("a percentage: return a fraction between 0 and 1", want * 100),
    ]


def _slips(trace: Mapping[str, Any], got: float, want: float,
           guesses: list[tuple[str, float]] | None = None) -> str | None:
    """The slip that gives ``got`` on ``trace`` (``guesses`` from ``slip_guesses``, when already computed)."""
    guesses = slip_guesses(trace, want) if guesses is None else guesses
    # The nearest guess within the grading's tolerance: two guesses can lie close together on a random trace (a
    # sum of durations of 0.9992 once read as "divided by the kernels' own time", which is exactly 1).
    near = [(abs(got - value), why) for why, value in guesses
            if math.isclose(got, value, rel_tol=1e-4) and not math.isclose(value, want, rel_tol=1e-4)]
    return min(near)[1] if near else None


def _grade_busy(fn: Any) -> str:
    rng = random.Random()
    cases: list[tuple[str, dict[str, Any]]] = [(f"random trace {i + 1}", random_trace(rng)) for i in range(3)]
    cases += [(p.name.removesuffix(".json.gz"), tr.load_trace(p)) for p in committed_traces()]
    device = grading_device()
    if device.startswith("cuda"):
        step, _ = _grader_step(device)
        with temporary_folder("busy-check") as d:
            reference_profile_steps(step, d / "t.json")
            cases.append(("a trace recorded now on this GPU", tr.load_trace(d / "t.json")))
    real = 0
    for label, trace in cases:
        want = reference_gpu_busy_fraction(trace)
        got = run_student(fn, copy.deepcopy(trace), what="gpu_busy_fraction", call=f"gpu_busy_fraction(<{label}>)",
                          returns=(float, int), returns_text="a number (a fraction of the wall time)")
        if not math.isclose(float(got), want, rel_tol=1e-4, abs_tol=1e-6):
            why = _slips(trace, float(got), want) or "check the union and the window rule"
            raise Wrong(f"on {label}: {float(got):.4f}, expected {want:.4f}: {why}")
        real += not label.startswith("random")
    return f"Right on {len(cases)} traces ({real} real)."


q2 = CodeExercise(
    name="06.2 GPU busy fraction", var="gpu_busy_fraction", grade=_grade_busy,
    references=References("take the union of the kernel intervals yourself",
                           reference_gpu_busy_fraction, "lab_utils.profiling.trace.busy_fraction"),
    signature="gpu_busy_fraction(trace) -> float",
    hints=[
        "Kernels are the events with cat == 'kernel' (ts and dur in µs); the steps are the 'user_annotation' "
        "events named ProfilerStep#N. Window: first step's start to the later of the last step's end and the "
        "last kernel's end (for kernels starting in the window).",
        "Two streams run at once: sort the (start, end) intervals, merge the overlapping ones, clip each to the "
        "window, then add up the merged lengths.",
        "return busy_us / (t1 - t0): a fraction, 1.0 when some kernel runs at every instant.",
    ],
    solution_text=source_as(reference_gpu_busy_fraction, "gpu_busy_fraction(trace)"),
)


# --- q4: the data loader ----------------------------------------------------------------------------------

LOADER_STORAGE_MS = 2.0  # per-sample read latency of the check's data set
LOADER_BATCH = 12
LOADER_STEP_S = 0.045  # the training step the loop simulates: longer than one batch's reads (12 × 2 ms)


def _batch_waits(loader: Any, batches: int = 7, step_s: float = LOADER_STEP_S) -> list[float]:
    """Seconds each ``next()`` waited, with a training step of ``step_s`` between them; the first two excluded
    (workers starting)."""
    waits = []
    it = iter(loader)
    try:
        for _ in range(batches):
            t0 = time.perf_counter()
            next(it)
            waits.append(time.perf_counter() - t0)
            time.sleep(step_s)
    finally:
        close_iterator(it)()
        if getattr(loader, "_iterator", None) is it:  # persistent workers: the next iter() would reset the shut one
            loader._iterator = None  # ("Queue is closed"); a fresh one is made instead
    return waits[2:]


def _grade_loader(fn: Any) -> str:
    device = grading_device()
    ds = PngDigits(size=16, storage_ms=LOADER_STORAGE_MS)
    loader = run_student(fn, ds, LOADER_BATCH, device, what="make_loader",
                         call=f"make_loader(dataset, {LOADER_BATCH}, {device!r})")
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise Wrong(f"returned a {type(loader).__name__}; return the torch.utils.data.DataLoader itself (the loop "
                    "calls iter() on it each epoch)")
    if loader.dataset is not ds:
        raise Wrong("the DataLoader is not over the `dataset` argument")
    if loader.batch_size != LOADER_BATCH:
        raise Wrong(f"batch_size is {loader.batch_size}; use the batch_size argument ({LOADER_BATCH})")
    if loader.num_workers < 1:
        raise Wrong("num_workers is 0: every sample is still read and decoded in the training process, between "
                    "steps (pinned memory alone does not change that); give it worker processes")
    if device.startswith("cuda") and not loader.pin_memory:
        raise Wrong("pin_memory is off: batches bound for the GPU should be page-locked so the copy can be "
                    "asynchronous (non_blocking=True) and runs at full PCIe speed")
    planted = torch.utils.data.DataLoader(ds, batch_size=LOADER_BATCH, shuffle=True, num_workers=0)
    for _ in range(2):  # a machine busy elsewhere can starve the workers for one measurement (CI): a miss, twice
        base, mine = sum(_batch_waits(planted)), sum(_batch_waits(loader))
        if mine <= 0.5 * base:
            break
    if mine > 0.5 * base:
        raise Wrong(f"each next() still waited {mine / 5 * 1e3:.1f} ms on average (a main-process loader: "
                    f"{base / 5 * 1e3:.1f} ms): are workers preparing the next batches while the step runs?")
    return (f"Waiting per batch: {base / 5 * 1e3:.1f} ms in the main process, {mine / 5 * 1e3:.2f} ms with your "
            f"loader ({loader.num_workers} workers).")


q4 = CodeExercise(
    name="06.4 fix the data loading", var="make_loader", grade=_grade_loader,
    references=References("build the DataLoader yourself", reference_make_loader),
    signature="make_loader(dataset, batch_size, device) -> DataLoader",
    hints=[
        "torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, ...): which arguments move the "
        "reading and decoding out of the training process?",
        "num_workers=k starts k processes that prepare batches ahead (prefetch_factor each); persistent_workers=True "
        "keeps them between epochs. pin_memory=True when the batches go to a GPU.",
        "Then copy with x.to(device, non_blocking=True): from pinned memory the copy overlaps the GPU's work.",
    ],
    solution_text=(
        "def make_loader(dataset, batch_size, device):\n"
        "    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True,\n"
        "                                       num_workers=max(1, (os.cpu_count() or 2) - 1),\n"
        "                                       pin_memory=device.startswith('cuda'), persistent_workers=True,\n"
        "                                       prefetch_factor=4, drop_last=True)"
    ),
)


# --- q5: no host sync per step ------------------------------------------------------------------------------

SYNC_CALLS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")


class SyncCounter(TorchFunctionMode):
    """Counts tensor read-backs to the host (``.item()``, ``.cpu()``, ``float(t)``, ``if t:``…) made directly
    by the student's own lines; the library's internals are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNC_CALLS:
            caller = sys._getframe(1)
            if _is_students(caller.f_code.co_filename):
                self.calls.append(f"{name} (line {caller.f_lineno})")
        return func(*args, **(kwargs or {}))


def _loop_setup(device: str, seed: int) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    batches = [(torch.randn(64, 32, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device))
               for _ in range(15)]
    return model, batches


def _grade_train_loop(fn: Any) -> str:
    device = grading_device()
    seed = random.randrange(10_000)
    log_every = random.choice((3, 5))
    model, batches = _loop_setup(device, seed)
    ref_model = copy.deepcopy(model)
    want = reference_train_loop(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), batches, log_every)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with SyncCounter() as counter:
        got = run_student(fn, model, opt, batches, log_every, what="train_loop",
                          call=f"train_loop(model, opt, batches, log_every={log_every})", returns=(list, tuple),
                          returns_text="a list of floats, one mean loss per window")
    logs = len(batches) // log_every
    if len(got) != logs:
        raise Wrong(f"returned {len(got)} values for {len(batches)} steps with log_every={log_every}; expected "
                    f"{logs}, one per window")
    try:
        got_f = [float(v) for v in got]
    except (TypeError, ValueError, RuntimeError):
        raise Wrong(f"the values are not numbers: {got[:2]!r}") from None
    if len(counter.calls) > logs:
        raise Wrong(f"{len(counter.calls)} read-backs to the host for {len(batches)} steps "
                    f"({', '.join(counter.calls[:3])}...): each one makes the CPU wait for the GPU. Keep a running "
                    f"sum on the device and read it once per window ({logs} in all)")
    for i, (g, w) in enumerate(zip(got_f, want, strict=True)):
        if not math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-6):
            fresh, _ = _loop_setup(device, seed)  # the last step's loss of each window: a common wrong answer
            per_step = reference_train_loop(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), batches, 1)
            why = ("that is the last step's loss of the window, not the mean over its steps"
                   if math.isclose(g, per_step[(i + 1) * log_every - 1], rel_tol=1e-4) else
                   "is the sum reset after each window, divided by log_every, and is zero_grad() called?")
            raise Wrong(f"window {i + 1}: {g:.5f}, expected {w:.5f}: {why}")
    return f"{len(counter.calls)} read-back(s) for {len(batches)} steps; the means match."


q5 = CodeExercise(
    name="06.5 no host sync per step", var="train_loop", grade=_grade_train_loop,
    references=References("write the training loop yourself", reference_train_loop),
    signature="train_loop(model, opt, batches, log_every) -> list[float]",
    hints=[
        "loss.item() (and float(loss), print(loss), if loss > x:) copies a value to the host: the CPU waits for "
        "every kernel queued so far, and cannot queue the next step meanwhile.",
        "Keep running = torch.zeros((), device=...) and add loss.detach() each step (detach: the value, not the "
        "graph). Every log_every steps read it once: running.item() / log_every, then zero it.",
        "Each step: the loss (cross_entropy of model(x) and y), the optimizer's zero_grad (set_to_none), backward, "
        "the optimizer's step; nothing in the step reads a value back.",
    ],
    solution_text=source_as(reference_train_loop, "train_loop(model, opt, batches, log_every)"),
)


# --- q3: diagnosis from trace summaries ---------------------------------------------------------------------

CAUSES = ("data", "sync", "launch", "precision")
_CAUSE_SYNONYMS = {
    "data": ["data loading", "dataloader", "loader", "input pipeline", "io"],
    "sync": ["host sync", "synchronization", "item", "host device sync", "read back"],
    "launch": ["launch bound", "kernel launch", "launch overhead", "small kernels", "cpu bound"],
    "precision": ["fp32", "dtype", "bf16", "mixed precision", "tensor cores"],
}
# The four planted programs behind the letters of the diagnosis table (not in the order the lab shows them).
DIAGNOSIS_CASES = {"A": "sync", "B": "precision", "C": "data", "D": "launch"}


def _grade_diagnosis(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise Wrong('expected a dict {"A": cause, "B": ..., "C": ..., "D": ...}')
    missing = sorted(set(DIAGNOSIS_CASES) - set(value))
    if missing:
        raise Wrong(f"no answer for {missing}; one of {list(CAUSES)} for each letter")
    picked = {letter: choice(value[letter], CAUSES, _CAUSE_SYNONYMS) for letter in DIAGNOSIS_CASES}
    if unknown := next((letter for letter, cause in picked.items() if cause is None), None):
        raise Wrong(f"{unknown}: {value[unknown]!r} is not one of {list(CAUSES)}")
    if wrong := [letter for letter, want in DIAGNOSIS_CASES.items() if picked[letter] != want]:
        raise Wrong(f"{len(wrong)} of 4 wrong ({', '.join(wrong)}): look at data_wait, syncs_per_step, "
                    "kernel_us with launches_per_step, and whether the kernels are half precision")


q3 = Exercise(
    name="06.3 diagnose four traces", var="diagnosis", grade=_grade_diagnosis,
    hints=[
        "data_wait is the share of the step spent in the DataLoader's next(); syncs_per_step counts host calls "
        "that wait for the GPU; a launch-bound step has many kernels of a few µs and a low busy fraction.",
        "A step whose kernels are long, the GPU busy, and no half-precision kernels: the tensor cores idle.",
    ],
    solution_text='diagnosis = {"A": "sync", "B": "precision", "C": "data", "D": "launch"}',
)


# --- q6: ncu's Speed of Light ---------------------------------------------------------------------------------

_BOUND_SYNONYMS = {"compute": ["compute bound", "sm", "math"], "memory": ["memory bound", "bandwidth",
                                                                        "bandwidth bound", "dram"]}


def _grade_bound(value: Any) -> None:
    if not isinstance(value, Mapping) or set(value) != {"gemm", "elementwise"}:
        raise Wrong('expected {"gemm": ..., "elementwise": ...} with "compute" or "memory" for each')
    got = {k: choice(v, ("compute", "memory"), _BOUND_SYNONYMS) for k, v in value.items()}
    if None in got.values():
        raise Wrong('answer "compute" or "memory" for each kernel')
    if got == {"gemm": "memory", "elementwise": "compute"}:
        raise Wrong("swapped: compare each kernel's Compute (SM) Throughput with its Memory Throughput (% of peak)")
    if got != {"gemm": "compute", "elementwise": "memory"}:
        raise Wrong("one of the two is wrong: which of the two Speed-of-Light percentages is near its peak?")


q6 = Exercise(
    name="06.6 read ncu's Speed of Light", var="kernel_bound", grade=_grade_bound,
    hints=[
        "Speed of Light gives percentages of the hardware's peak: Compute (SM) Throughput, Memory Throughput (the "
        "busiest memory unit: L1/shared, L2 or DRAM) and DRAM Throughput. HBM-bound means DRAM near its peak.",
        "The GEMM does 2n³ FLOPs on 3n² values (intensity in the thousands of FLOP/byte); the add does 1 FLOP per "
        "12 bytes.",
    ],
    solution_text='kernel_bound = {"gemm": "compute", "elementwise": "memory"}',
)
