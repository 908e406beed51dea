"""Building blocks of graders: numbers and counts read forgivingly, versions, fractions and choices normalized,
tolerances with the usual slips named, timings compared fairly, and a reference's source as a solution.

Design notes: docs/internals.md#lab_utilsexercisesframeworkpy
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import re
import textwrap
import unittest.mock
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from lab_utils.exercises.outcomes import Wrong, _short


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
