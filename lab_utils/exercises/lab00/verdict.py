"""Lab 00, exercise 00.5: the compatibility verdict of a CUDA runtime under a driver."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from lab_utils.exercises.framework import CodeExercise, References, Wrong, choice, run_student, version
from lab_utils.exercises.lab00.ceiling import LAB

VERDICTS = ("compatible", "minor-version compatibility", "forward compatibility needed", "incompatible")
_COMPATIBLE, _MINOR, _FORWARD, _INCOMPATIBLE = VERDICTS


def cuda_verdict(driver_ceiling: str, runtime: str, datacenter_gpu: bool) -> str:
    """Whether a CUDA ``runtime`` (e.g. ``torch.version.cuda``) runs under a driver whose ceiling (nvidia-smi's
    'CUDA Version') is ``driver_ceiling``; one of ``VERDICTS``.

    Drivers are backward compatible: a runtime up to the ceiling runs. A newer runtime of the *same major*
    version runs through CUDA minor-version compatibility (features that need the newer driver, such as PTX
    JIT of newer PTX, can fail). A newer *major* version needs the forward-compatibility libraries
    (``cuda-compat``, carried by NGC images), which work on data-centre GPUs only; elsewhere it cannot run.
    """
    ceiling, rt = version(driver_ceiling), version(runtime)
    if rt <= ceiling:
        return _COMPATIBLE
    if rt[0] == ceiling[0]:
        return _MINOR
    return _FORWARD if datacenter_gpu else _INCOMPATIBLE


# (driver_ceiling, runtime, datacenter_gpu, expected, why). The simple cases come first, so a function wrong
# everywhere hears about the simplest one. "12.10" is hypothetical but legal and catches comparing versions
# as strings ("12.10" < "12.4") or floats (12.10 == 12.1).
VERDICT_CASES: list[tuple[str, str, bool, str, str]] = [
    ("13.0", "12.8", True, _COMPATIBLE, "an older runtime runs on a newer driver (drivers are backward compatible)"),
    ("13.0", "13.0", False, _COMPATIBLE, "a runtime equal to the ceiling is supported"),
    ("13.0", "11.8", False, _COMPATIBLE, "an older major version runs on a newer driver too"),
    ("12.4", "12.8", False, _MINOR, "12.8 is newer than the ceiling 12.4 but of the same major version: CUDA "
                                    "minor-version compatibility runs it, on any GPU"),
    ("13.0", "13.1", True, _MINOR, "13.1 is newer than 13.0 within major version 13: minor-version compatibility"),
    ("12.4", "12.10", True, _MINOR, "12.10 is a newer release than 12.4 (minor 10 > minor 4), same major"),
    ("12.10", "12.9", False, _COMPATIBLE, "12.9 is an older release than 12.10 (minor 9 < minor 10)"),
    ("12.1", "12.10", False, _MINOR, "12.10 is a newer release than 12.1 (minor 10 > minor 1), same major"),
    ("12.4", "13.0", True, _FORWARD, "a newer major version needs the forward-compatibility libraries, which a "
                                     "data-centre GPU can use"),
    ("12.4", "13.0", False, _INCOMPATIBLE, "a newer major version on a GPU that is not a data-centre GPU: forward "
                                           "compatibility is not available there"),
    ("12.8", "13.2", False, _INCOMPATIBLE, "a newer major version, no data-centre GPU"),
    ("11.8", "12.1", True, _FORWARD, "a newer major version on a data-centre GPU: forward compatibility"),
]

_KEYS: dict[str, tuple[Callable[[str], Any], str]] = {
    "tuple": (version, ""),
    "string": (lambda v: v, "Compared as strings, '12.10' < '12.4' (character by character, '1' < '4'). "),
    "float": (float, "As floats, 12.10 == 12.1 (so it sorts before 12.4, and equals 12.1). "),
}


# rule -> (its verdict past the ceiling from (same major version, data-centre GPU), what is wrong with it)
_RULES: dict[str, tuple[Callable[[bool, bool], str], str]] = {
    "right": (lambda same_major, dc: _MINOR if same_major else (_FORWARD if dc else _INCOMPATIBLE), ""),
    "no minor-version": (lambda same_major, dc: _FORWARD if dc else _INCOMPATIBLE,
                         "A newer runtime of the same major version is not a case for forward compatibility: "
                         "CUDA minor-version compatibility runs it on the older driver (12.8 under a 12.4 "
                         "driver), only features that need the newer driver can fail."),
    "always forward": (lambda same_major, dc: _MINOR if same_major else _FORWARD,
                       "Forward compatibility (the cuda-compat libraries) works on data-centre GPUs only: on "
                       "another GPU a runtime of a newer major version is incompatible."),
    "never forward": (lambda same_major, dc: _MINOR if same_major else _INCOMPATIBLE,
                      "On a data-centre GPU a newer major version can run with the forward-compatibility "
                      "libraries (NGC images carry them): 'forward compatibility needed', not incompatible."),
    "minor everywhere": (lambda same_major, dc: _MINOR,
                         "Minor-version compatibility holds within one major version only: 13.0 under a 12.4 "
                         "driver needs forward compatibility (data-centre GPUs) or is incompatible."),
}


def _rule(past: Callable[[bool, bool], str], key: Callable[[str], Any]) -> Callable[[str, str, bool], str]:
    def verdict(ceiling: str, runtime: str, dc: bool) -> str:
        if key(runtime) <= key(ceiling):
            return _COMPATIBLE
        return past(runtime.split(".")[0] == ceiling.split(".")[0], dc)

    return verdict


_RANDOM_VERDICTS = 8


def _grade_random_verdicts(fn: Any, rng: random.Random) -> None:
    """Versions the student cannot predict, against ``cuda_verdict``: a table of answers cannot pass."""
    def pick() -> str:
        return f"{rng.randint(11, 14)}.{rng.choice([0, 1, 2, 4, 6, 8, 9, 10, 12])}"

    for _ in range(_RANDOM_VERDICTS):
        ceiling, runtime, dc = pick(), pick(), rng.random() < 0.5
        call = f"cuda_verdict({ceiling!r}, {runtime!r}, datacenter_gpu={dc})"
        result = run_student(fn, ceiling, runtime, dc, call=call, timeout_s=10)
        expected = cuda_verdict(ceiling, runtime, dc)
        if choice(result, VERDICTS) != expected:
            raise Wrong(f"{call} returned {result!r}, expected {expected!r}: every case of the table was right, but "
                        "this one (drawn at random) is not. Apply the rules to the versions given, not to a list "
                        "of known cases.")


def _grade_verdict(fn: Any) -> str:
    got = []
    for ceiling, runtime, dc, _, _ in VERDICT_CASES:
        call = f"cuda_verdict({ceiling!r}, {runtime!r}, datacenter_gpu={dc})"
        result = run_student(fn, ceiling, runtime, dc, call=call, timeout_s=10)
        verdict = choice(result, VERDICTS)
        if verdict is None:
            raise Wrong(f"{call} returned {result!r}: return one of {list(VERDICTS)} (the names in VERDICTS)")
        got.append(verdict)
    wrong = [(case, g) for case, g in zip(VERDICT_CASES, got, strict=True) if g != case[3]]
    if not wrong:
        _grade_random_verdicts(fn, random.Random())
        return f"All {len(VERDICT_CASES)} cases agree with the rules, and {_RANDOM_VERDICTS} more drawn at random."
    (ceiling, runtime, dc, expected, why), verdict = wrong[0]
    first = (f"cuda_verdict({ceiling!r}, {runtime!r}, datacenter_gpu={dc}) returned {verdict!r}, expected "
             f"{expected!r}: {why}.")
    cases = [(c, r, d) for c, r, d, _, _ in VERDICT_CASES]
    for key_name, (key, key_why) in _KEYS.items():
        for rule, (past, rule_why) in _RULES.items():
            if key_name == "tuple" and rule == "right":
                continue
            if [_rule(past, key)(*case) for case in cases] == got:
                fix = "Compare (major, minor) as integers: tuple(int(p) for p in v.split('.')[:2]). " \
                    if key_name != "tuple" else ""
                raise Wrong(f"{first} {key_why}{fix}{rule_why}".strip())
    raise Wrong(f"{first} ({len(wrong)} of {len(VERDICT_CASES)} cases differ.)")


q5 = CodeExercise(
    name="00.5 the compatibility verdict", var="cuda_verdict", grade=_grade_verdict,
    references=References("apply the compatibility rules yourself", f"{LAB}.cuda_verdict"),
    signature="cuda_verdict(driver_ceiling, runtime, datacenter_gpu) -> str",
    hints=[
        "Three questions in order: is the runtime at most the ceiling? If not, is it the same major version? If "
        "not, is this a data-centre GPU (where the forward-compatibility libraries work)?",
        "Compare versions as (major, minor) integer tuples: as strings '12.10' < '12.4', as floats 12.10 == 12.1. "
        "tuple(int(p) for p in v.split('.')[:2]).",
        "runtime <= ceiling: 'compatible'; same major: 'minor-version compatibility'; newer major: 'forward "
        "compatibility needed' on a data-centre GPU, else 'incompatible'.",
    ],
    solution_text=(
        "def cuda_verdict(driver_ceiling: str, runtime: str, datacenter_gpu: bool) -> str:\n"
        "    def key(v: str) -> tuple[int, int]:\n"
        "        major, minor = (v.split('.') + ['0'])[:2]\n"
        "        return int(major), int(minor)\n"
        "    ceiling, rt = key(driver_ceiling), key(runtime)\n"
        "    if rt <= ceiling:\n"
        "        return 'compatible'                      # drivers are backward compatible\n"
        "    if rt[0] == ceiling[0]:\n"
        "        return 'minor-version compatibility'     # runs; features needing a newer driver may fail\n"
        "    return 'forward compatibility needed' if datacenter_gpu else 'incompatible'"
    ),
)
