"""Exercise checks with four outcomes: not attempted, incorrect (with why), correct, not applicable on this tier; and
*not checked now* when something the check needs is not running yet (a server stopped), with what to run first.

A check takes the student's answer explicitly (``q1.check(flops)``), never notebook globals; a ``CodeExercise`` runs a
code answer (``run_student``) and refuses one that delegates to a reference implementation (``REFERENCES``).

Design notes: docs/internals.md#lab_utilsexercisesframeworkpy
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dis
import enum
import functools
import inspect
import itertools
import math
import os
import re
import signal
import sys
import textwrap
import threading
import time
import traceback
import types
import unittest.mock
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from lab_utils.course import progress
from lab_utils.distributed.ranks import is_library_file
from lab_utils.procs import Background


class Status(enum.Enum):
    NOT_ATTEMPTED = "not attempted"
    INCORRECT = "incorrect"
    CORRECT = "correct"
    NOT_APPLICABLE = "not applicable on this tier"
    NOT_NOW = "not checked now"


_MARK = {Status.NOT_ATTEMPTED: "[ ]", Status.INCORRECT: "[x]", Status.CORRECT: "[ok]", Status.NOT_APPLICABLE: "[n/a]",
         Status.NOT_NOW: "[..]"}


@dataclass
class Outcome:
    """What a check said. Printed in the notebook; also returned so tests can assert on it."""

    exercise: str
    status: Status
    message: str

    @property
    def correct(self) -> bool:
        return self.status is Status.CORRECT

    @property
    def graded(self) -> bool:
        """Whether the answer was judged (correct or incorrect), as opposed to blank or not applicable here."""
        return self.status in (Status.CORRECT, Status.INCORRECT)

    def _ipython_display_(self) -> None:
        """Nothing: ``check`` has already printed the outcome; a cell ending in a check shows it once."""

    def __str__(self) -> str:
        return f"{_MARK[self.status]} {self.exercise}: {self.status.value}. {self.message}"


class Wrong(Exception):
    """Raised by a grading function: the answer is wrong, and the message says why."""


class NotApplicable(Exception):
    """Raised by a grading function: this machine cannot run the check; the message says why."""


class NotNow(Exception):
    """Raised by a grading function (or a code exercise's ``applicable``): the check can run on this machine, but not
    now (its server is stopped); the message says what to run first."""


def is_blank(value: Any) -> bool:
    """True for an answer not filled in: None, ``...``, or a function whose body is only ``...``/``pass``
    (a docstring and comments allowed)."""
    if value is None or value is Ellipsis:
        return True
    code = getattr(value, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP", "CACHE")]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


class Shown(str):
    """Text a method has already printed, returned for tests and scripts: a notebook cell that ends in it shows
    nothing more (a plain ``str`` would be shown a second time, as its repr)."""

    def _ipython_display_(self) -> None:
        pass


_PLAIN_WORD = re.compile(r"(?:a|i|[a-z]{2,})(?=[\s,.:;!?]|$)")  # "the", "is", "a": not "x", "load_model's", "config="


def sentence(text: str) -> str:
    """``text`` with its first letter capitalised when it starts with a plain word ("the model's ..." -> "The
    model's ..."); a code name stays as written ("load_model's config=", "x is float32")."""
    return text[:1].upper() + text[1:] if _PLAIN_WORD.match(text) else text


def _short(value: Any, limit: int = 120) -> str:
    if isinstance(value, functools.partial):
        return f"functools.partial({_short(value.func)}, ...)"
    if callable(value) and hasattr(value, "__name__"):
        return f"<function {value.__name__}>"  # no address: outputs stay the same from run to run
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Exercise:
    """One question: ``grade(value)`` returns normally when right and raises ``Wrong(why)`` when not.

    ``grade`` may return a short text, added to the *correct* message (e.g. what the student's code measured);
    it may raise ``NotApplicable(why)`` when this machine cannot run the check.
    """

    name: str
    var: str
    grade: Callable[[Any], Any]
    hints: Sequence[str] = ()
    solution_text: str = ""
    hint_call: str = ""  # how the notebook asks for a hint, where not `ex.qN.hint()` (the quiz: runner.hint('id'))
    _hints_shown: int = field(default=0, repr=False)
    # the value of the last check that was correct, None until one is (or after a later one is not): what a later
    # cell uses instead of the student's name, so a blank or a wrong answer cannot fail that cell
    accepted: Any = field(default=None, init=False, repr=False)

    def check(self, value: Any, *, quiet: bool = False) -> Outcome:
        """Grade ``value`` (the student's ``var``); prints and returns the outcome."""
        out = self._outcome(value)
        self.accepted = value if out.correct else None
        progress.record(self.name, out.status.name, out.message, echo=_short(value))  # the student's record
        if not quiet:
            print(out)
        return out

    def _outcome(self, value: Any) -> Outcome:
        if is_blank(value):
            number = re.match(r"\d+[a-z]?\.(\d+)\b", self.name)  # "01.3 ..." (or "01b.3 ...") is the lab's `ex.q3`
            hint = f"`{self.hint_call}`" if self.hint_call else f"`ex.q{number[1]}.hint()`" if number else \
                "its `.hint()`"
            return Outcome(self.name, Status.NOT_ATTEMPTED,
                           f"Set `{self.var}` above and run this cell again ({hint} helps).")
        lab = re.match(r"(\d\d[a-z]?)\.", self.name)  # "09.7 ..." is lab 09's: its name for an object lab 01 shares
        handed = course_object(value, first=f"{_LAB}lab{lab[1]}" if lab else None)
        if handed:  # before grading: the course's own value would pass every check it was written for
            return self._incorrect(value, f"{handed}: an answer is your own work, not a value the course hands "
                                          f"out. Write `{self.var}` yourself")
        try:
            note = self.grade(value)
        except Wrong as why:
            return self._incorrect(value, why)
        except NotApplicable as why:
            return Outcome(self.name, Status.NOT_APPLICABLE, str(why))
        except NotNow as why:
            return Outcome(self.name, Status.NOT_NOW, sentence(str(why)))
        except Exception as err:  # the student's code failed inside the check: show it, don't crash
            return Outcome(self.name, Status.INCORRECT, f"checking `{self.var}` raised {type(err).__name__}: {err}")
        extra = f" {note}" if isinstance(note, str) and note else ""
        return Outcome(self.name, Status.CORRECT, f"`{self.var}` = {_short(value)}.{extra}")

    def _incorrect(self, value: Any, why: object) -> Outcome:
        return Outcome(self.name, Status.INCORRECT, f"`{self.var}` = {_short(value)}: {why}")

    def hint(self, n: int | None = None) -> Shown:
        """Print hint ``n`` (1-based), or the next one in order; the text is also returned (shown once in a cell)."""
        if not self.hints:
            text = "No hints for this one."
        else:
            if n is None:
                self._hints_shown = min(self._hints_shown + 1, len(self.hints))
                n = self._hints_shown
            if not 1 <= n <= len(self.hints):
                raise ValueError(f"hint(n={n}): {self.name} has hints 1..{len(self.hints)}")
            text = f"Hint {n}/{len(self.hints)}: {self.hints[n - 1]}"
        print(text)
        return Shown(text)

    def solution(self) -> Shown:
        """Print the worked solution; the text is also returned (shown once in a cell)."""
        text = f"Solution ({self.name}):\n{self.solution_text}"
        print(text)
        return Shown(text)


@dataclass
class CodeExercise(Exercise):
    """An exercise whose answer is a function that the check runs (through ``run_student``).

    ``signature`` is what the student must define, e.g. ``"time_ms(fn, iters, warmup, sync) -> float"``;
    ``applicable()`` returns why this machine cannot run the check (the outcome is then *not applicable on
    this tier*), or ``None``.
    """

    signature: str = ""
    applicable: Callable[[], str | None] | None = None
    lab: str = field(default="", init=False, repr=False)  # the module whose REFERENCES rows apply (the grader's)

    def __post_init__(self) -> None:
        self.lab = getattr(self.grade, "__module__", None) or ""

    def refusal(self, value: Any) -> Outcome | None:
        """*Incorrect* when ``value`` is, or reaches, a reference implementation of this exercise (found without
        running it: ``REFERENCES``); None otherwise, and for a blank or a value that is not a function."""
        if is_blank(value) or not callable(value):
            return None
        why = _delegation(value, _references_of(self.lab, self.var))
        return self._incorrect(value, why) if why else None

    def _outcome(self, value: Any) -> Outcome:
        # Refused first: a delegating answer is wrong on every machine, and nothing expensive has started yet.
        refused = self.refusal(value)
        if refused is not None:
            return refused
        try:
            reason = self.applicable() if self.applicable is not None else None
        except NotNow as why:
            return Outcome(self.name, Status.NOT_NOW, sentence(str(why)))
        if reason:
            still = (f" (`{self.var}` is still blank: write it anyway, it runs where this check can)"
                     if is_blank(value) else f" Your `{self.var}` was not run.")
            return Outcome(self.name, Status.NOT_APPLICABLE, f"{reason}{still}")
        if not is_blank(value) and not callable(value):
            return self._incorrect(value, f"expected a function `{self.signature or self.var}`, got a "
                                          f"{type(value).__name__}. Define it with `def` and pass the function itself "
                                          "(its name, without parentheses).")
        if is_blank(value):
            return super()._outcome(value)
        with _Guard(_references_of(self.lab, self.var)) as guard:
            try:
                out = super()._outcome(value)
            except ReferenceCalled:
                if guard.refused is None:  # an enclosing check's trap: that check decides
                    raise
        if guard.refused is not None:
            # However the grader took it (the student's code may even have caught the trap), the call is the verdict.
            return self._incorrect(value, guard.refused)
        return out


# --- answers that are the course's own objects: a public constant, or what a public helper returned ---------------
# Identity, never equality: a right answer written by hand equals the course's, but it is never the same object.

_NAME_CHARS = re.compile(r"[A-Za-z0-9_]*")  # a str constant of only these is interned by the compiler: shared
_HANDED_OUT: dict[int, tuple[str, Any]] = {}  # id -> (the call, its result): the latest, kept alive (no id reuse)
_HANDED_OUT_KEEP = 64


def _identifiable(obj: Any) -> bool:
    """Whether being this very object says where a value came from: not a singleton, a cached small int, an interned
    string, a function or a class (those are the references' business: ``REFERENCES``)."""
    if obj is None or isinstance(obj, (bool, enum.Enum, type, types.ModuleType)) or callable(obj):
        return False
    if isinstance(obj, int):
        return not -5 <= obj <= 256
    if isinstance(obj, (str, bytes)):
        return len(obj) > 1 and not (isinstance(obj, str) and _NAME_CHARS.fullmatch(obj))
    if isinstance(obj, (tuple, frozenset)):
        return len(obj) > 0
    return True


def hands_out(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a public helper whose result would pass as an answer (a value exercise's reference): each result is
    remembered (a string as a fresh copy, so that no student's literal is that object), and a check refuses it."""

    @functools.wraps(fn)
    def remembered(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if type(result) is str and len(result) > 1:
            result = result[:1] + result[1:]  # a new object: "real" is interned, and a student's "real" is that one
        if type(result) is str or _identifiable(result):
            _HANDED_OUT.pop(id(result), None)
            _HANDED_OUT[id(result)] = (f"what {fn.__module__}.{fn.__qualname__}(...) returned", result)
            while len(_HANDED_OUT) > _HANDED_OUT_KEEP:
                del _HANDED_OUT[next(iter(_HANDED_OUT))]
        return result

    remembered.__hands_out__ = True  # type: ignore[attr-defined]
    return remembered


def _inside(obj: Any, limit: int = 512) -> Iterator[Any]:
    """The objects a container holds, nested (dict values, items), at most ``limit``; containers only are opened."""
    todo, seen = [obj], 0
    while todo and seen < limit:
        cur = todo.pop()
        kids = list(itertools.islice(cur.values() if isinstance(cur, dict) else cur, limit)) \
            if isinstance(cur, (dict, list, tuple, set, frozenset)) else []
        for kid in kids:
            seen += 1
            yield kid
            todo.append(kid)


def _course_objects(first: str | None) -> dict[int, tuple[str, Any]]:
    """id -> (dotted name, object) of every identifiable public module-level object of ``lab_utils`` loaded so far;
    the module ``first`` wins a tie (lab 09's H200_RIDGE is lab 01's object)."""
    names = sorted((n for n in list(sys.modules) if n == "lab_utils" or n.startswith("lab_utils.")),
                   key=lambda n: n != first)
    found: dict[int, tuple[str, Any]] = {}
    for name in names:
        module = sys.modules.get(name)
        for attr, value in list(vars(module).items()) if module is not None else ():
            if not attr.startswith("_") and _identifiable(value):
                found.setdefault(id(value), (f"{name}.{attr}", value))
    return found


def course_object(value: Any, first: str | None = None) -> str | None:
    """How ``value`` is the course's own: "your answer is <a public object of lab_utils>", or what a ``hands_out``
    helper returned, or an equal copy built from one (it shares a list, a dict or a float with it); else None."""
    if not _identifiable(value) and not (type(value) is str and id(value) in _HANDED_OUT):
        return None
    if id(value) in _HANDED_OUT:
        return f"your answer is {_HANDED_OUT[id(value)][0]}"
    objects = _course_objects(first)
    if id(value) in objects:
        return f"your answer is {objects[id(value)][0]}"
    if not isinstance(value, (dict, list, tuple, set, frozenset)):
        return None
    shared = {id(x) for x in _inside(value) if _identifiable(x)}
    for name, obj in [*objects.values(), *_HANDED_OUT.values()]:
        if isinstance(obj, type(value)) and any(id(x) in shared for x in _inside(obj)):
            with contextlib.suppress(Exception):  # an odd __eq__ (arrays): not a copy we can tell
                if bool(value == obj):
                    return f"your answer is a copy of {name}"
    return None


# --- running the student's code --------------------------------------------------------------------


class StudentTimeout(BaseException):
    """Raised inside the student's code when its time is up (a BaseException, so `except Exception` in the
    student's own code cannot swallow it)."""


@dataclass(frozen=True)
class StudentLine:
    """One frame of the student's code: where it raised or where it was when time ran out."""

    filename: str
    lineno: int
    function: str
    code: str

    def __str__(self) -> str:
        where = "your code" if self.function in ("<module>", "<lambda>") else f"`{self.function}`"
        code = f": `{self.code}`" if self.code else ""
        return f"line {self.lineno} of {where}{code}"


def _is_students(filename: str) -> bool:
    """True for a frame of the student's code: a notebook cell, a test, exec'd text; not a library's file."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    return not is_library_file(filename)


_TB_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def student_frame(tb: TracebackType | BaseException | str | types.FrameType | None) -> StudentLine | None:
    """The innermost frame of the student's code in a traceback (an exception, its ``__traceback__``, the text of a
    formatted traceback, e.g. from another process) or a live stack (a thread's frame, e.g. one that ran out of
    time); ``None`` when no frame is the student's."""
    if isinstance(tb, BaseException):
        tb = tb.__traceback__
    frames: list[StudentLine] = []
    if isinstance(tb, str):
        block = tb.rsplit("Traceback (most recent call last):", 1)[-1]  # the last of a chain
        lines = block.splitlines()
        for i, line in enumerate(lines):
            m = _TB_LINE.match(line)
            if m:
                code = lines[i + 1].strip() if i + 1 < len(lines) and not _TB_LINE.match(lines[i + 1]) else ""
                frames.append(StudentLine(m["file"], int(m["line"]), m["func"].strip(), code))
    elif tb is not None:
        summary = traceback.extract_stack(tb) if isinstance(tb, types.FrameType) else traceback.extract_tb(tb)
        frames = [StudentLine(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in summary]
    mine = [f for f in frames if _is_students(f.filename)]
    return mine[-1] if mine else None


def raised_message(call: str, err: BaseException, tb: TracebackType | str | None = None) -> str:
    """``"time_ms(...) raised ZeroDivisionError: division by zero, at line 7 of `time_ms`: `return t / 0`"``."""
    at = student_frame(tb if tb is not None else err)
    first = (str(err).strip().splitlines() or [""])[0]  # the message's first line, at most 200 characters
    first = first if len(first) <= 200 else first[:197] + "..."
    what = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return f"{call} raised {what}" + (f", at {at}" if at else "")


class StudentThread(Background):
    """The student's ``fn(*args, **kwargs)`` running in a daemon thread (``Background``) that a check can stop."""

    def where(self) -> StudentLine | None:
        """The line of the student's code it is at now."""
        return student_frame(sys._current_frames().get(self.thread.ident or -1))

    def interrupt(self) -> StudentLine | None:
        """Raise ``StudentTimeout`` in it (best effort: Python code, not a blocking call into C); where it was."""
        at = self.where()
        if self.thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread.ident),
                                                       ctypes.py_object(StudentTimeout))
        return at


@contextlib.contextmanager
def _alarm(timeout_s: float) -> Iterator[None]:
    """Raise ``StudentTimeout`` in the main thread after ``timeout_s`` (SIGALRM); an outer timer is re-armed."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise StudentTimeout()

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-3), old_interval)


def _describe_call(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], what: str | None) -> str:
    def show(v: Any) -> str:
        if isinstance(v, (int, float, str, bool)) or v is None:
            return repr(v)
        return getattr(v, "__name__", None) or type(v).__name__

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{what or getattr(fn, '__name__', 'your function')}({', '.join(parts)})"


def run_student(
    fn: Callable[..., Any],
    *args: Any,
    what: str | None = None,
    call: str | None = None,
    timeout_s: float = 60.0,
    returns: type | tuple[type, ...] | None = None,
    returns_text: str = "",
    **kwargs: Any,
) -> Any:
    """Run the student's ``fn(*args, **kwargs)`` with a time limit and return its result.

    Raises ``Wrong`` (never the student's exception) when it raises (the exception and the student's own
    line), when it has not returned after ``timeout_s`` (the line it was at), or when ``returns`` is given
    and the result is not an instance of it (``returns_text`` says what was expected). ``Wrong`` and
    ``NotApplicable`` raised by a grader's callback inside the student's code pass through unchanged, and so does
    ``ReferenceCalled`` (the student's code called a reference implementation: the check refuses it).
    ``call`` is how the call is shown in messages (default: built from ``what`` and the arguments).
    In the main thread the limit is a SIGALRM; elsewhere the function runs in a helper thread, which is
    interrupted (best effort) when it runs over.
    """
    call = call or _describe_call(fn, args, kwargs, what)

    def timed_out(at: StudentLine | None) -> Wrong:
        where = f" (it was at {at})" if at else ""
        return Wrong(f"{call} did not return within {timeout_s:g} s{where}: an endless loop, or waiting for "
                     "work that never finishes?")

    result: Any = None
    err: BaseException | None = None
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        try:
            with _alarm(timeout_s):
                result = fn(*args, **kwargs)
        except BaseException as e:  # judged below (a StudentTimeout too, where the alarm fired outside it)
            err = e
    else:
        worker = StudentThread(functools.partial(fn, *args, **kwargs), name=f"student {what or 'code'}")
        worker.thread.join(timeout_s)
        if worker.thread.is_alive():
            raise timed_out(worker.interrupt())
        result, err = worker.result, worker.error
    if isinstance(err, StudentTimeout):
        raise timed_out(student_frame(err)) from None
    if isinstance(err, Exception) and not isinstance(err, (Wrong, NotApplicable, NotNow)):
        raise Wrong(raised_message(call, err)) from None
    if err is not None:
        raise err
    kinds = returns if isinstance(returns, tuple) else (returns,)
    if returns is not None and (not isinstance(result, kinds) or (isinstance(result, bool) and bool not in kinds)):
        hint = " (does it end with `return ...`?)" if result is None else ""
        raise Wrong(f"{call} returned {_short(result)} ({type(result).__name__}){hint}; "
                    f"expected {returns_text or getattr(returns, '__name__', returns)}")
    return result


# --- answers that hand the work to a reference implementation ------------------------------------------------


@dataclass(frozen=True)
class References:
    """The course's implementations of one exercise's answer (dotted names), and what to do instead (``fix``)."""

    fix: str
    targets: tuple[str, ...]


_LAB = "lab_utils.exercises."
_GRPC_HTTP = ("lab_utils.serving.client.infer", "lab_utils.serving.repository.reference_mlp")

# The one registry: "labNN.var" -> what a code answer to that exercise may not reach: the lab's reference_* (later
# cells call them, so a blank never stops a lab) and library functions doing the same job. A lab's public reference_*
# that no row names is refused in all its code exercises; value exercises have rows so every reference is named.
REFERENCES: dict[str, References] = {
    "lab00.cuda_ceiling": References("find the 'CUDA Version' field in the banner yourself", (
        f"{_LAB}lab00.reference_cuda_ceiling", "lab_utils.course.probe.parse_smi_header")),
    "lab00.nvml_inventory": References("ask NVML (pynvml) for each GPU yourself", (
        f"{_LAB}lab00.reference_nvml_inventory",)),
    "lab00.smi_inventory": References("read the CSV yourself (csv.reader)", (
        f"{_LAB}lab00.reference_smi_inventory", "lab_utils.course.probe.parse_smi_csv")),
    "lab00.cuda_verdict": References("apply the compatibility rules yourself", (f"{_LAB}lab00.cuda_verdict",)),
    "lab01.time_ms": References("write the timing loop yourself", (f"{_LAB}lab01.reference_time_ms",)),
    "lab01.matmul_tflops": References("make the inputs, time a @ b with `timer` and count the FLOPs yourself", (
        f"{_LAB}lab01.reference_matmul_tflops",)),
    "lab01.copy_gbps": References("make the buffers, time the copy with `timer` and count the bytes yourself", (
        f"{_LAB}lab01.reference_copy_gbps",)),
    "lab01.replay_with_graph": References("capture the chain in a CUDA graph and replay it yourself", (
        f"{_LAB}lab01.reference_replay_with_graph",)),
    "lab02.busbw_factor": References("write each collective's factor yourself", (
        f"{_LAB}lab02.reference_busbw_factor", "lab_utils.distributed.bandwidth.busbw_factor")),
    "lab02.allreduce_bench": References("time the all_reduce calls and compute the bandwidths yourself", (
        f"{_LAB}lab02.reference_allreduce_bench", "lab_utils.distributed.collectives.bare_allreduce_worker")),
    "lab02.train_ddp": References("write the DDP setup and training step yourself", (
        f"{_LAB}lab02.reference_train_ddp", f"{_LAB}lab02.reference_ddp_run",
        "lab_utils.distributed.ddp.train_digits")),
    "lab02.global_accuracy": References("all_reduce the counts and divide yourself", (
        f"{_LAB}lab02.reference_global_accuracy",)),
    "lab03.export_dynamic": References("call torch.onnx.export yourself", ("lab_utils.inference.onnx.export_onnx",)),
    "lab03.ort_timed": References("build the SessionOptions and the session, and time session.run, yourself", (
        "lab_utils.inference.onnx.ort_session", "lab_utils.inference.onnx.time_ort")),
    "lab03.quantize_int8": References("call ModelOpt's quantize yourself", (
        "lab_utils.inference.quantize.quantize_onnx",)),
    "lab03.trt_build_and_run": References("build and run the engine with TensorRT's API yourself", (
        "lab_utils.inference.tensorrt.build_plan", "lab_utils.inference.tensorrt.load_engine",
        "lab_utils.inference.tensorrt.TrtRunner")),
    "lab04.grpc_infer": References("send the request with tritonclient.grpc yourself", _GRPC_HTTP),
    "lab04.http_infer": References("send the request with tritonclient.http yourself", _GRPC_HTTP),
    "lab04.execute": References("gather the requests, run self.model once and split its answer yourself", (
        "lab_utils.serving.backend.model.TritonPythonModel.execute",
        "lab_utils.serving.backend.model.ExerciseModel.execute")),
    "lab05.watchdog": References("write the poll, restart and back-off loop yourself", (
        "lab_utils.monitoring.drills.Watchdog",)),
    "lab06.profile_steps": References("run torch.profiler with the schedule yourself", (
        f"{_LAB}lab06.reference_profile_steps",)),
    "lab06.gpu_busy_fraction": References("take the union of the kernel intervals yourself", (
        f"{_LAB}lab06.reference_gpu_busy_fraction", "lab_utils.profiling.trace.busy_fraction")),
    "lab06.make_loader": References("build the DataLoader yourself", (f"{_LAB}lab06.reference_make_loader",)),
    "lab06.train_loop": References("write the training loop yourself", (f"{_LAB}lab06.reference_train_loop",)),
    "lab07.preprocess": References("decode, resize and normalize the images yourself", (
        f"{_LAB}lab07.reference_preprocess",)),
    "lab07.find_capacity": References("write the bisection over the rate yourself", (
        f"{_LAB}lab07.reference_find_capacity",)),
    "lab07.servers_needed": References("work out the number of servers yourself", (
        f"{_LAB}lab07.reference_servers_needed",)),
    "lab07.ensemble": References("write the ensemble's configuration yourself", (
        f"{_LAB}lab07.reference_ensemble", "lab_utils.serving.ensemble.ensemble_config")),
    "lab07.upstream_block": References("write the upstream block yourself", (f"{_LAB}lab07.reference_upstream",)),
    "lab07.gpu_preprocess": References("decode the batch, resize and normalize it yourself", (
        f"{_LAB}lab07.reference_gpu_preprocess",)),
    "lab08.log_run": References("make the MLflow calls yourself", (
        f"{_LAB}lab08.reference_log_run", "lab_utils.mlops.tracking.log_run")),
    "lab08.canary_queries": References("write the PromQL yourself", (
        f"{_LAB}lab08.reference_canary_queries", "lab_utils.mlops.canary.render_queries")),
    "lab08.decide": References("write the canary's decision rules yourself", (
        f"{_LAB}lab08.reference_decide", "lab_utils.mlops.canary.decide")),
    "lab08.sample_size": References("compute the sample size from the z-test yourself", (
        f"{_LAB}lab08.reference_sample_size", "lab_utils.mlops.abtest.sample_size")),
    "lab08.psi": References("bin the values and sum the PSI terms yourself", (
        f"{_LAB}lab08.reference_psi", "lab_utils.mlops.drift.psi")),
    "lab08.ab_verdict": References("read the interval yourself", (f"{_LAB}lab08.reference_verdict",)),
}


class ReferenceCalled(BaseException):
    """Raised in the student's code when it calls a reference implementation while its check runs (a
    BaseException, so `except Exception` in the student's code cannot swallow it)."""


@dataclass
class _Refs:
    """One exercise's references as a check sees them: names, and the objects of the modules loaded so far."""

    fixes: dict[str, str]  # dotted name -> the fix
    objects: dict[int, tuple[str, Any]] = field(default_factory=dict)  # id -> (dotted name, the object)
    codes: dict[int, str] = field(default_factory=dict)  # id of a function's __code__ -> dotted name


def _static_attr(obj: Any, name: str) -> Any:
    """``obj.name`` without running the object's code (no property, no ``__getattr__``); None when unknown."""
    if isinstance(obj, types.ModuleType):
        found = obj.__dict__.get(name)
        return found if found is not None else sys.modules.get(f"{obj.__name__}.{name}")
    try:
        found = inspect.getattr_static(obj, name)
    except Exception:  # AttributeError, or an object too odd to inspect: unknown either way
        return None
    return found.__func__ if isinstance(found, (staticmethod, classmethod)) else found


def _resolve(dotted: str) -> Any:
    """The object a dotted name names, from the modules already imported (nothing is imported); None if unknown."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        obj = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        for name in parts[i:]:
            obj = _static_attr(obj, name)
            if obj is None:
                return None
        return obj
    return None


def _dotted(obj: Any) -> str | None:
    """Where a module, function or class is defined, as a dotted name (``lab_utils.mlops.canary.decide``)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, (types.FunctionType, type)):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str):
            return f"{module}.{qualname}"
    return None


def _references_of(lab: str, var: str) -> _Refs:
    """The references an answer to ``var`` of the lab module ``lab`` may not reach."""
    short = lab.rpartition(".")[2]
    row = REFERENCES.get(f"{short}.{var}")
    fixes = dict.fromkeys(row.targets, row.fix) if row else {}
    module = sys.modules.get(lab) if lab.startswith(_LAB) else None
    if module is not None:  # a public reference_* that no row names: refused in every code exercise of its lab
        named = {t for r in REFERENCES.values() for t in r.targets}
        for name in getattr(module, "__all__", ()):
            if name.startswith("reference_") and f"{lab}.{name}" not in named:
                fixes[f"{lab}.{name}"] = f"write `{var}` yourself"
    refs = _Refs(fixes)
    for name in fixes:
        obj = _resolve(name)
        if obj is None:
            continue
        # By identity too: a re-export (lab02.busbw_factor is bandwidth's, drift.psi drift_stats') is one object.
        refs.objects.setdefault(id(obj), (name, obj))
        if isinstance(obj, types.FunctionType):
            refs.codes[id(obj.__code__)] = name
    return refs


# --- the static walk: what the answer's code reaches, without running it

_STACK_OPS = ("SWAP", "POP_TOP", "COPY", "ROT_TWO")  # between an import's IMPORT_FROMs and STOREs


def _line_of(ins: dis.Instruction, last: int) -> int:
    pos = getattr(ins, "positions", None)
    if pos is not None and pos.lineno:
        return int(pos.lineno)
    start = ins.starts_line
    return start if isinstance(start, int) and not isinstance(start, bool) else last


def _name_chains(code: types.CodeType,
                 aliases: dict[str, str] | None = None) -> Iterator[tuple[str, str, tuple[str, ...], int, str]]:
    """(kind, root name, attributes, line, function) of every name a code object reads, followed by the attributes
    read off it (``ex.reference_x`` is ("global", "ex", ("reference_x",), ...)); nested code objects included.
    A name bound by an import inside the code is kind "import" with the module path as the root."""
    aliases = dict(aliases or {})
    consts: list[Any] = [None, None]  # the last two constants: an import's level and fromlist
    imp: dict[str, Any] | None = None
    chain: list[Any] | None = None
    line = code.co_firstlineno
    for ins in dis.get_instructions(code):
        line = _line_of(ins, line)
        op, arg = ins.opname, ins.argval
        if op in ("LOAD_CONST", "LOAD_SMALL_INT"):
            consts = [consts[1], arg]
        if op == "IMPORT_NAME":
            level, fromlist = consts
            from_form = isinstance(fromlist, tuple)
            base = arg if not level and isinstance(arg, str) and arg else None
            imp = {"base": base, "from": from_form, "cur": base if from_form or base is None else base.split(".")[0]}
            if base:
                yield "import", base, (), line, code.co_name
            chain = None
            continue
        if op == "IMPORT_FROM" and imp is not None and imp["base"]:
            imp["cur"] = f"{imp['base'] if imp['from'] else imp['cur']}.{arg}"
            if imp["from"]:
                yield "import", imp["cur"], (), line, code.co_name
            continue
        if op.startswith("STORE_") and imp is not None and imp["base"] and isinstance(arg, str):
            aliases[arg] = imp["cur"]
            if not imp["from"]:
                imp = None
            continue
        if op not in _STACK_OPS:
            imp = None
        if op in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF") or (
                op.startswith("LOAD_FAST") and isinstance(arg, str)):
            kind = "import" if arg in aliases else "global" if op in ("LOAD_GLOBAL", "LOAD_NAME") else \
                "deref" if "DEREF" in op else "fast"
            chain = [kind, aliases.get(arg, arg), []]
            yield kind, chain[1], (), line, code.co_name
        elif op in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None and isinstance(arg, str):
            chain[2].append(arg)
            yield chain[0], chain[1], tuple(chain[2]), line, code.co_name
        else:
            chain = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _name_chains(const, aliases)


def _worth_walking(obj: Any) -> bool:
    return callable(obj) or isinstance(obj, (list, tuple, set, frozenset, dict, staticmethod, classmethod))


def _some(items: Any) -> list[Any]:
    """The first items of a container worth walking: a table of functions is short, a data set is not one."""
    return [v for v in itertools.islice(items, 64) if _worth_walking(v)]


def _students_class(cls: type) -> bool:
    return any(isinstance(v, types.FunctionType) and _is_students(v.__code__.co_filename) for v in vars(cls).values())


def _where(line: int, function: str) -> str:
    return str(StudentLine("", line, function, ""))


class _Walk:
    """Everything an answer reaches without running it, until a reference implementation turns up."""

    def __init__(self, refs: _Refs):
        self.refs = refs
        self.seen: set[int] = set()
        self.kept: list[Any] = []  # what was seen stays alive, so that no id is reused during the walk
        self.todo: list[tuple[Any, str | None, str | None]] = []  # (object or None, dotted path, where)

    def hit(self, obj: Any, path: str | None) -> str | None:
        refs = self.refs
        if path in refs.fixes:  # the name the student wrote, where it is a registered one
            return path
        if obj is not None:
            own = _dotted(obj)
            if own in refs.fixes:
                return own
            if id(obj) in refs.objects:
                return refs.objects[id(obj)][0]
            if isinstance(obj, types.FunctionType) and id(obj.__code__) in refs.codes:
                return refs.codes[id(obj.__code__)]  # a copy of a reference (types.FunctionType(ref.__code__, ...))
        return None

    def find(self, value: Any) -> tuple[str, str | None, bool] | None:
        """(the reference's dotted name, where the student's code reaches it, whether it is the answer itself)."""
        name = self.hit(value, None)
        if name:
            return name, None, True
        self.todo.append((value, None, None))
        while self.todo:
            obj, path, where = self.todo.pop()
            name = self.hit(obj, path)
            if name:
                return name, where, False
            if obj is None or id(obj) in self.seen:
                continue
            self.seen.add(id(obj))
            self.kept.append(obj)
            kids = list(self.children(obj, where))  # walk_code queues onto self.todo itself
            self.todo.extend((child, None, at) for child, at in kids)
        return None

    def children(self, obj: Any, where: str | None) -> Iterator[tuple[Any, str | None]]:
        if isinstance(obj, functools.partial):
            yield from ((x, where) for x in (obj.func, *obj.args, *obj.keywords.values()) if _worth_walking(x))
        elif isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            yield obj.__func__, where
        elif isinstance(obj, types.FunctionType):
            wrapped = obj.__dict__.get("__wrapped__")
            if wrapped is not None:
                yield wrapped, where
            if _is_students(obj.__code__.co_filename):  # a library function is not walked into: it may use anything
                self.walk_code(obj)
        elif isinstance(obj, type):
            if _students_class(obj):
                yield from ((v, where) for v in vars(obj).values() if _worth_walking(v))
                yield from ((base, where) for base in obj.__bases__)
        elif isinstance(obj, dict):
            yield from ((v, where) for v in _some(obj.values()))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            yield from ((v, where) for v in _some(obj))
        elif callable(obj) and _students_class(type(obj)):  # a callable object of the student's own class
            yield type(obj), where
            state = getattr(obj, "__dict__", None)
            if isinstance(state, dict):
                yield from ((v, where) for v in _some(state.values()))

    def walk_code(self, fn: types.FunctionType) -> None:
        """Queue what a student's function reads: names and their attribute chains, defaults, closures."""
        glb = fn.__globals__
        builtins = glb.get("__builtins__", {})
        builtins = builtins if isinstance(builtins, dict) else vars(builtins)
        cells: dict[str, Any] = {}
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
            with contextlib.suppress(ValueError):  # an empty cell
                cells[name] = cell.cell_contents
        here = _where(fn.__code__.co_firstlineno, fn.__code__.co_name)
        defaults = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values(), *cells.values()]
        self.todo.extend((v, None, here) for v in defaults if _worth_walking(v))
        suffixes = list(self.refs.fixes)
        for kind, root, attrs, line, function in _name_chains(fn.__code__):
            at = _where(line, function)
            if kind == "import":
                obj, path = _resolve(root), root
            elif kind == "global" and root in glb:
                obj, path = glb[root], None
            elif kind == "deref" and root in cells:
                obj, path = cells[root], None
            elif kind == "global" and root not in builtins and attrs:
                # Unknown here (code that runs elsewhere, e.g. in Triton's python backend): match by the names only.
                text = ".".join((root, *attrs))
                match = next((s for s in suffixes if s.endswith("." + text)), None)
                if match:
                    self.todo.append((None, match, at))
                continue
            else:
                continue
            path = path or _dotted(obj)
            for name in attrs:
                obj = _static_attr(obj, name) if obj is not None else None
                path = f"{path}.{name}" if path else None
            if obj is not None and _worth_walking(obj) or path in self.refs.fixes:
                self.todo.append((obj, path, at))


def _delegation(value: Any, refs: _Refs) -> str | None:
    """The one-line refusal of an answer that is, or reaches, one of ``refs``; None when it reaches none."""
    if not refs.fixes:
        return None
    found = _Walk(refs).find(value)
    if found is None:
        return None
    name, where, itself = found
    fix = refs.fixes[name]
    if itself:
        return f"your answer is {name}: {fix}"
    return f"your answer calls {name}" + (f" ({where})" if where else "") + f": {fix}"


# --- the dynamic guard: references become traps for the student's code while its check runs

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep  # lab_utils/


@functools.lru_cache(maxsize=4096)
def _in_package(filename: str) -> bool:
    return not filename.startswith("<") and os.path.realpath(filename).startswith(_PACKAGE_DIR)


def _students_caller(frame: types.FrameType | None) -> StudentLine | None:
    """The student's line that called a reference, or None when this package's code did (a check, or a helper).
    Frames of the standard library and installed packages are looked through (``map``, ``functools``)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if _in_package(filename):
            return None
        if _is_students(filename):
            return StudentLine(filename, frame.f_lineno, frame.f_code.co_name, "")
        frame = frame.f_back
    return None


def _trap_body(*args: Any, **kwargs: Any) -> Any:
    # This code object becomes a reference's __code__ while a check runs, so it runs with that module's globals:
    # it reaches this module through the import system, not a name.
    return __import__("lab_utils.exercises.framework", None, None, ["_sprung"])._sprung(args, kwargs)


# id(trap code) -> (the trap code, the reference, a function running the reference's own code); made once per
# reference and kept, so that a call already inside a trap when its check ends still finds its entry
_TRAPS: dict[int, tuple[types.CodeType, types.FunctionType, Callable[..., Any]]] = {}
_TRAP_OF: dict[int, types.CodeType] = {}  # id(a reference function) -> its trap code
_GUARDS: list[_Guard] = []


def _sprung(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A trapped reference was called: refuse when the student's code called it, else run the real one."""
    trap = sys._getframe(1)
    _, _, original = _TRAPS[id(trap.f_code)]
    at = _students_caller(trap.f_back)
    if at is not None:
        owner = next((g for g in reversed(_GUARDS) if id(trap.f_code) in g.owned), None)
        if owner is not None:
            raise owner.refuse(owner.owned[id(trap.f_code)], at)
    return original(*args, **kwargs)


def _trap_for(fn: types.FunctionType) -> types.CodeType | None:
    """The trap code for a reference function (made once), or None where one cannot replace its code."""
    if fn.__closure__:  # the trap has no free variables, and a code object must match its function's closure
        return None
    if id(fn.__code__) in _TRAPS:  # already trapped by an enclosing check
        return None
    trap = _TRAP_OF.get(id(fn))
    if trap is None:
        original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        original.__kwdefaults__ = fn.__kwdefaults__
        original.__qualname__ = fn.__qualname__
        trap = _trap_body.__code__.replace(co_name=fn.__code__.co_name)
        _TRAP_OF[id(fn)] = trap
        _TRAPS[id(trap)] = (trap, fn, original)
    return trap


class _Guard:
    """While one check grades: its references' code is a trap for calls from the student's code."""

    def __init__(self, refs: _Refs):
        self.refs = refs
        self.refused: str | None = None
        self.owned: dict[int, str] = {}  # id of a trap code this guard put in place -> the reference's name
        self._undo: list[tuple[types.FunctionType, types.CodeType]] = []

    def __enter__(self) -> _Guard:
        _GUARDS.append(self)
        for name, obj in self.refs.objects.values():  # a class is trapped at its __init__
            fn = obj if isinstance(obj, types.FunctionType) else vars(obj).get("__init__") \
                if isinstance(obj, type) else None
            trap = _trap_for(fn) if isinstance(fn, types.FunctionType) else None
            if trap is None:
                continue
            self._undo.append((fn, fn.__code__))
            self.owned[id(trap)] = name
            fn.__code__ = trap
        return self

    def __exit__(self, *exc: Any) -> None:
        for fn, code in reversed(self._undo):
            fn.__code__ = code
        _GUARDS.remove(self)

    def refuse(self, name: str, at: StudentLine) -> ReferenceCalled:
        fix = self.refs.fixes.get(name) or next(iter(self.refs.fixes.values()), "write it yourself")
        message = f"your answer calls {name} ({_where(at.lineno, at.function)}): {fix}"
        self.refused = self.refused or message
        return ReferenceCalled(message)


# --- grading building blocks -------------------------------------------------------------------


@contextlib.contextmanager
def patched(*swaps: tuple[Any, str, Any]) -> Iterator[None]:
    """For each ``(owner, name, new)``, ``owner.name`` (``owner[name]`` of a dict) is ``new`` inside; then as before."""
    with contextlib.ExitStack() as stack:
        for owner, name, new in swaps:
            if isinstance(owner, dict):  # only this key: a namespace may gain other names meanwhile
                stack.callback(owner.__setitem__, name, owner[name])
                owner[name] = new
            else:
                stack.enter_context(unittest.mock.patch.object(owner, name, new))
        yield


@contextlib.contextmanager
def amended(fix: Callable[[str], str]) -> Iterator[None]:
    """``Wrong`` raised inside comes out with its message passed through ``fix`` (a hint added, colours removed)."""
    try:
        yield
    except Wrong as err:
        raise Wrong(fix(str(err))) from None


def source_as(fn: Callable[..., Any], name: str) -> str:
    """A reference function's source under the name the student defines, or under the header ``name`` when it
    holds the arguments (``"time_ms(fn, iters, warmup, sync)"``: no annotations): the solution is the reference."""
    source = textwrap.dedent(inspect.getsource(fn))
    if "(" not in name:
        return source.replace(f"def {fn.__name__}(", f"def {name}(", 1)
    body = ast.parse(source).body[0].body[0].lineno - 1  # type: ignore[attr-defined]
    return f"def {name}:\n" + "".join(source.splitlines(keepends=True)[body:])


def items(result: Any, n: int, call: str, expected: str) -> list[Any]:
    """``result`` as a list of ``n`` items (from a list or a tuple), or ``Wrong`` saying what came back instead."""
    if isinstance(result, (list, tuple)) and len(result) == n:
        return list(result)
    shown = f"a {type(result).__name__} of {len(result)}" if isinstance(result, (list, tuple)) else _short(result)
    raise Wrong(f"{call} returned {shown}; expected {expected}")


def number(value: Any, what: str = "the answer") -> float:
    """The value as a float, or ``Wrong`` saying a number was expected."""
    if isinstance(value, bool):
        raise Wrong(f"{what} should be a number, not a bool")
    if value is None:
        raise Wrong(f"{what} should be a number, got None (does the function end with `return ...`?)")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise Wrong(f"{what} should be a number, got {type(value).__name__}") from None
    if math.isnan(out):
        raise Wrong(f"{what} is NaN")
    return out


def integer(value: Any, what: str = "the answer") -> int:
    """The value as an int (``18`` or ``18.0``), or ``Wrong`` saying a whole number was expected."""
    got = number(value, what)
    if not got.is_integer():
        raise Wrong(f"{what} should be a whole number (a count), got {got:g}")
    return int(got)


# --- normalizers: one answer written several ways means one thing ------------------------------------------

_VERSION_TEXT = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.\d+)*$")


def version(value: Any, what: str = "the version") -> tuple[int, int]:
    """A CUDA-style version as (major, minor): ``"13.0"``, ``"13"``, ``"13.0.0"``, ``b"13.0"`` or NVML's
    integer ``13000`` (``12040`` is 12.4). A float is refused: ``12.10`` and ``12.1`` are one float."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1000:
        return value // 1000, value % 1000 // 10  # NVML's encoding: 1000 * major + 10 * minor
    if isinstance(value, bool) or not isinstance(value, str):
        if isinstance(value, (int, float)):
            raise Wrong(f"{what} is the number {value!r}: give the version as a string such as '13.0'. As a "
                        "number, '12.10' becomes 12.1 and sorts before 12.4")
        raise Wrong(f"{what} should be a version string such as '13.0', got {type(value).__name__}")
    match = _VERSION_TEXT.match(value.strip())
    if not match:
        raise Wrong(f"{what} is {value.strip()!r}: expected a version of the form major.minor, like '12.4'")
    return int(match[1]), int(match[2] or 0)


def fraction(value: Any, what: str = "the answer") -> float:
    """A share as a float: ``0.85``, ``"0.85"`` or the percentage text ``"85%"`` (0.85)."""
    if isinstance(value, str):
        text = value.strip()
        scale = 100.0 if text.endswith("%") else 1.0
        try:
            return number(float(text.removesuffix("%").strip()), what) / scale
        except ValueError:
            raise Wrong(f"{what} should be a number (a fraction such as 0.85, or '85%'), got {text!r}") from None
    return number(value, what)


def normal_text(value: str) -> str:
    """Lower case, no surrounding quotes or space, and ``-``, ``_`` and runs of spaces as one space."""
    return " ".join(re.sub(r"[-_\s]+", " ", value.strip().strip("'\"").lower()).split())


def choice(value: Any, choices: Sequence[str], synonyms: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """The element of ``choices`` that ``value`` names, or ``None``: a whole answer, not a word inside one.

    Case, ``-``/``_``/spaces and surrounding quotes are ignored; ``synonyms`` maps a choice to other whole
    answers that mean it (``{"memory": ["bandwidth-bound"]}``)."""
    if not isinstance(value, str):
        return None
    names = {normal_text(c): c for c in choices}
    for c, others in (synonyms or {}).items():
        names.update({normal_text(o): c for o in others})
    return names.get(normal_text(value))


def match_slip(ratio: float, slips: Mapping[float, str], rel: float) -> str | None:
    """The message of the first slip whose ratio (answer / expected) matches ``ratio`` within ``rel``."""
    return next((message for slip, message in slips.items() if math.isclose(ratio, slip, rel_tol=rel)), None)


def fastest_ratio(mine: Callable[[], float], reference: Callable[[], float], band: tuple[float, float],
                  tries: int = 6, first: float | None = None) -> float:
    """Fastest ``mine()`` / fastest ``reference()`` (times), both measured again up to ``tries`` times while outside
    ``band``: load only adds time, so noise cannot fail a right answer, and a wrong one stays out on every try."""
    mines, refs = [mine() if first is None else first], [reference()]
    for _ in range(tries - 1):
        if band[0] <= min(mines) / min(refs) <= band[1]:
            break
        refs.append(reference())
        mines.append(mine())
    return min(mines) / min(refs)


def per_call_wrong(where: str, mine_ms: float, ref_ms: float, iters: int, warmup: int, *,
                   reference: str = "the reference", tries: str = "", gpu_fix: str = "",
                   one_call: str = "one call") -> Wrong:
    """Why a time per call (ms), outside its band around the reference's, is wrong: a unit or loop slip, a clock read
    before the GPU finished (``gpu_fix`` says how to wait, where the work is queued), else far off."""
    ratio = mine_ms / ref_ms if ref_ms > 0 else math.inf
    head = f"{where}: {mine_ms:.3g} ms per call, {ratio:.2g}x {reference}'s {ref_ms:.3g} ms{tries}"
    slip = match_slip(ratio, {
        1e-3: "that looks like seconds: time in milliseconds (× 1000)",
        1e3: "that looks like microseconds: time in milliseconds (÷ 1000)",
        float(iters): f"that looks like the total of all {iters} calls: return the time per call (divide by iters)",
        (iters + warmup) / iters: "the warm-up calls are inside your timed region: run them, sync, and only then "
                                  "start the clock",
    }, 0.35)
    if slip:
        return Wrong(f"{head}: {slip}.")
    if ratio < 1 and gpu_fix:
        faster = f"{ref_ms / mine_ms:.0f}x" if mine_ms > 0 else "infinitely"
        return Wrong(f"{where}: {mine_ms:.3g} ms is {faster} faster than {reference}'s {ref_ms:.3g} ms{tries}: "
                     f"the clock stopped before the GPU finished. {gpu_fix}")
    side = "less" if ratio < 1 else "more"
    return Wrong(f"{head}: far {side} than {one_call} takes. Time `iters` calls after `warmup` untimed ones and "
                 "divide by iters.")


def close_to(
    expected: float,
    rel: float = 0.01,
    why: str = "",
    *,
    slips: Mapping[float, str] | None = None,
    reveal: bool = True,
) -> Callable[[Any], None]:
    """A grader accepting numbers within ``rel`` (relative) of ``expected``.

    ``slips`` maps a ratio (answer / expected) that a common mistake produces to the message for it,
    e.g. ``{0.5: "a multiply-add is 2 FLOPs"}``; a ratio matches within ``rel``. With ``reveal=False``
    a wrong answer is told too high or too low, not the expected value (so hints keep their worth).
    """

    def grade(value: Any) -> None:
        got = number(value)
        if math.isclose(got, expected, rel_tol=rel, abs_tol=0.0 if expected else rel):
            return
        ratio = got / expected if expected else float("inf")
        message = match_slip(ratio, slips or {}, rel)
        if message:
            raise Wrong(message)
        if reveal:
            raise Wrong(f"expected about {expected:.4g} (within {rel:.0%}); yours is {ratio:.3g}x that. "
                        f"{why}".strip())
        side = "high" if ratio > 1 else "low"
        raise Wrong(f"not within {rel:.0%} of the expected value: too {side}. {why}".strip())

    return grade


def one_of(expected: str, choices: Sequence[str], why: str = "",
           synonyms: Mapping[str, Sequence[str]] | None = None) -> Callable[[Any], None]:
    """A grader for a choice among ``choices`` (normalized by ``choice``; ``synonyms`` as there)."""

    def grade(value: Any) -> None:
        picked = choice(value, choices, synonyms)
        if picked is None:
            raise Wrong(f"answer with one of {list(choices)}")
        if picked != expected:
            raise Wrong(why or "not this one")

    return grade
