"""08.4-08.6: the A/B test's sample size, its verdict and the population stability index."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import numpy as np

from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    NotApplicable,
    References,
    Wrong,
    choice,
    hands_out,
    integer,
    number,
    run_student,
    source_as,
)
from lab_utils.exercises.lab08.common import _BOUND
from lab_utils.exercises.outcomes import _short


def reference_sample_size(p_a: float, p_b: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Labelled requests per group to detect ``p_a`` vs ``p_b`` (two-sided z-test, pooled variance under H0)."""
    import math
    from statistics import NormalDist

    z_a = NormalDist().inv_cdf(1 - alpha / 2)  # two-sided
    z_b = NormalDist().inv_cdf(power)
    p = (p_a + p_b) / 2
    n = (z_a * math.sqrt(2 * p * (1 - p)) + z_b * math.sqrt(p_a * (1 - p_a) + p_b * (1 - p_b))) ** 2 \
        / (p_a - p_b) ** 2
    return math.ceil(n)


def reference_psi(reference: Any, current: Any, bins: int = 10) -> float:
    """Population stability index: sum over bins of (c - r) ln(c / r), bins at the reference's quantiles."""
    import numpy as np

    ref = np.asarray(reference, dtype=float).ravel()
    cur = np.asarray(current, dtype=float).ravel()
    edges = np.unique(np.quantile(ref, np.linspace(0, 1, bins + 1)[1:-1]))  # inner edges; outer bins open-ended

    def shares(x):
        counts = np.bincount(np.searchsorted(edges, x, side="right"), minlength=len(edges) + 1)
        return np.maximum(counts / counts.sum(), 1e-4)  # an empty bin would make the log infinite

    r, c = shares(ref), shares(cur)
    return float(np.sum((c - r) * np.log(c / r)))


@hands_out  # its result passes the check it answers: refused as an answer
def reference_verdict(result: Any) -> str:
    """``"real"`` when the 95 % interval of B - A excludes 0, else ``"not real"``."""
    return "not real" if result.boot_low <= 0 <= result.boot_high else "real"


# --- q4: the sample size -----------------------------------------------------------------------------------------

_Q4_FIXED = [(0.90, 0.92, 0.05, 0.8), (0.95, 0.96, 0.05, 0.8), (0.50, 0.55, 0.05, 0.8), (0.80, 0.85, 0.01, 0.9),
             (0.97, 0.95, 0.05, 0.8)]


def _n(p_a: float, p_b: float, alpha: float, power: float, *, pooled: bool = True, two_sided: bool = True,
       sqrt: bool = True, square: bool = True, power_z: str = "power") -> float:
    from statistics import NormalDist

    nd = NormalDist()
    z_a = nd.inv_cdf(1 - alpha / 2 if two_sided else 1 - alpha)
    z_b = nd.inv_cdf(power if power_z == "power" else 1 - power)
    var = p_a * (1 - p_a) + p_b * (1 - p_b)
    d2 = (p_a - p_b) ** 2
    if pooled:
        p = (p_a + p_b) / 2
        s0, s1 = (math.sqrt(2 * p * (1 - p)), math.sqrt(var)) if sqrt else (2 * p * (1 - p), var)
        return (z_a * s0 + z_b * s1) ** 2 / d2
    return (z_a + z_b) ** (2 if square else 1) * var / d2


def _grade_sample_size(fn: Any) -> str:
    rng = random.Random(random.randrange(10**6))
    cases = list(_Q4_FIXED)
    for _ in range(12):
        p_a = round(rng.uniform(0.6, 0.97), 3)
        p_b = round(min(0.995, p_a + rng.choice([-1, 1]) * rng.uniform(0.01, 0.06)), 3)
        cases.append((p_a, p_b, rng.choice([0.05, 0.01, 0.1]), rng.choice([0.8, 0.9])))
    got = []
    for p_a, p_b, alpha, power in cases:
        call = f"sample_size({p_a:g}, {p_b:g}, alpha={alpha:g}, power={power:g})"
        v = run_student(fn, p_a, p_b, alpha=alpha, power=power, what="sample_size", call=call, timeout_s=10)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise Wrong(f"{call} returned {_short(v)}: a number of requests per group (an int)")
        if isinstance(v, (float, np.floating)) and not math.isfinite(v):
            raise Wrong(f"{call} returned {float(v)}: a finite number of requests per group (is a proportion 0 or 1, "
                        "or the effect p_b - p_a zero?)")
        if isinstance(v, (float, np.floating)) and not float(v).is_integer():
            raise Wrong(f"{call} returned {float(v):g}: a count of requests is whole; round up (math.ceil): "
                        "{:g} requests are not enough for the power asked".format(math.floor(v)))
        got.append(integer(v, call))

    def ok(value: int, n: float) -> bool:
        return value in (math.ceil(n - 1e-6), math.ceil(n + 1e-6))

    for pooled, form in ((True, "pooled"), (False, "unpooled")):
        if all(ok(g_, _n(*c, pooled=pooled)) for g_, c in zip(got, cases, strict=True)):
            other = "unpooled (Chow, Shao & Wang)" if pooled else "pooled (Fleiss; ex.reference_sample_size)"
            return (f"the {form} formula, right on {len(cases)} cases (the {other} form differs by a few "
                    f"requests). sample_size(0.90, 0.92) = {got[0]} per group.")
    slips = [
        ("it is one-sided: a two-sided test splits alpha, z = Phi^-1(1 - alpha/2) (1.96 at 5 %), not "
         "Phi^-1(1 - alpha)", lambda c, p: math.ceil(_n(*c, pooled=p, two_sided=False) - 1e-6)),
        ("that is both groups together: the formula gives the requests in EACH group",
         lambda c, p: 2 * math.ceil(_n(*c, pooled=p) - 1e-6), lambda c, p: math.ceil(2 * _n(*c, pooled=p) - 1e-6)),
        ("rounded down (or to the nearest): fewer requests than the formula asks give less power than asked; "
         "round up, math.ceil", lambda c, p: math.floor(_n(*c, pooled=p)), lambda c, p: round(_n(*c, pooled=p))),
        ("a square root is missing: the standard deviations are sqrt(2 p (1 - p)) and sqrt(p_a q_a + p_b q_b)",
         lambda c, p: math.ceil(_n(*c, pooled=True, sqrt=False) - 1e-6)),
        ("(z_a + z_b) is not squared: n = (z_a + z_b)^2 (p_a q_a + p_b q_b) / (p_a - p_b)^2",
         lambda c, p: math.ceil(_n(*c, pooled=False, square=False) - 1e-6)),
        ("the power's z is Phi^-1(power) (0.84 for 80 %), not Phi^-1(1 - power): that one is negative and makes "
         "the sample far too small", lambda c, p: math.ceil(_n(*c, pooled=p, power_z="1-power") - 1e-6)),
    ]
    for why, *forms in slips:  # a slip's message, and the answers that make it
        for slip, pooled in itertools.product(forms, (True, False)):
            try:
                if all(g_ == slip(c, pooled) for g_, c in zip(got, cases, strict=True)):
                    raise Wrong(why)
            except (ValueError, ZeroDivisionError):
                continue
    i = next(k for k, (g_, c) in enumerate(zip(got, cases, strict=True)) if not ok(g_, _n(*c)))
    p_a, p_b, alpha, power = cases[i]
    raise Wrong(f"sample_size({p_a:g}, {p_b:g}, alpha={alpha:g}, power={power:g}) = {got[i]}, expected "
                f"{math.ceil(_n(*cases[i]) - 1e-6)} (pooled) or {math.ceil(_n(*cases[i], pooled=False) - 1e-6)} "
                "(unpooled): n = (z_a sqrt(2 p q) + z_b sqrt(p_a q_a + p_b q_b))^2 / (p_a - p_b)^2")


q4 = CodeExercise(
    name="08.4 the A/B test's sample size", var="sample_size", grade=_grade_sample_size,
    references=References("compute the sample size from the z-test yourself",
                           "lab_utils.exercises.lab08.reference_sample_size", "lab_utils.mlops.abtest.sample_size"),
    signature="sample_size(p_a, p_b, alpha=0.05, power=0.8) -> int",
    hints=(
        "Two quantiles of the standard normal: z_a at 1 - alpha/2 (the test is two-sided) and z_b at the power; "
        "statistics.NormalDist().inv_cdf gives both.",
        "Pooled under H0 with p = (p_a + p_b) / 2: n = (z_a sqrt(2 p (1 - p)) + z_b sqrt(p_a (1 - p_a) + p_b (1 - "
        "p_b)))^2 / (p_a - p_b)^2 per group; math.ceil it.",
    ),
    solution_text=source_as(reference_sample_size, "sample_size"),
)


# --- q6: PSI -----------------------------------------------------------------------------------------------------


def _psi(ref: np.ndarray, cur: np.ndarray, bins: int, *, edges_from: str = "ref", eps: float = 1e-4,
         shares: bool = True, form: str = "psi", closed: bool = False) -> float:
    base = ref if edges_from == "ref" else cur
    if closed:  # np.histogram over [min, max] of the reference: the current sample's values outside are dropped
        full = np.quantile(base, np.linspace(0, 1, bins + 1))
        rc, cc = np.histogram(ref, full)[0].astype(float), np.histogram(cur, full)[0].astype(float)
    else:
        edges = np.unique(np.quantile(base, np.linspace(0, 1, bins + 1)[1:-1]))
        rc = np.bincount(np.searchsorted(edges, ref, side="right"), minlength=len(edges) + 1).astype(float)
        cc = np.bincount(np.searchsorted(edges, cur, side="right"), minlength=len(edges) + 1).astype(float)
    r, c = (rc / rc.sum(), cc / cc.sum()) if shares else (rc, cc)
    r, c = np.maximum(r, eps), np.maximum(c, eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        if form == "kl":
            return float(np.sum(c * np.log(c / r)))
        if form == "kl_rev":
            return float(np.sum(r * np.log(r / c)))
        return float(np.sum((c - r) * np.log(c / r)))


def _psi_cases(seed: int) -> list[tuple[str, np.ndarray, np.ndarray, int, bool]]:
    """(what, reference, current, bins, has empty bins)."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(0, 1, 2000)
    return [
        ("a shifted and wider sample", ref, rng.normal(0.8, 1.5, 1200), 10, False),
        ("a skewed sample, bins=5", rng.exponential(1.0, 1500), rng.exponential(1.6, 900) + 0.1, 5, False),
        ("a sample from the same distribution", ref, rng.normal(0, 1, 2000), 10, False),
        ("a sample that leaves most bins empty", ref, rng.normal(0, 0.1, 500), 10, True),
    ]


def _grade_psi(fn: Any) -> str:
    seed = random.randrange(10**6)
    slips = [
        ({"edges_from": "cur"}, "the bins are at the current sample's quantiles: they must be the reference's (fixed "
                                "once, from the training data), so that every window is measured on the same bins"),
        ({"shares": False}, "it uses counts, not shares: divide each bin's count by its sample's size (the two "
                            "samples differ in size)"),
        ({"form": "kl"}, "that is KL(current || reference), one direction only: PSI is sum (c - r) ln(c / r), "
                         "symmetric in the two samples"),
        ({"form": "kl_rev"}, "that is KL(reference || current), one direction only: PSI is sum (c - r) ln(c / r)"),
        ({"closed": True}, "the outer bins are closed at the reference's min and max, so current values beyond them "
                           "are dropped: the first and last bins are open-ended (-inf, q1] and (q9, inf)"),
    ]
    results = []
    for what, ref, cur, bins, empty in _psi_cases(seed):
        call = f"psi(reference, current, bins={bins}) on {what}"
        got = run_student(fn, ref.copy(), cur.copy(), bins=bins, what="psi", call=call, timeout_s=20)
        if isinstance(got, (float, np.floating)) and not math.isfinite(got):
            shown, why = (("inf", "an empty bin has share 0, and ln(0) is infinite") if math.isinf(got) else
                          ("NaN", "an empty bin makes 0 * ln(0)"))
            raise Wrong(f"{call} is {shown}: {why}; floor the shares at a small epsilon (np.maximum(share, 1e-4))")
        got = number(got, call)
        want = _psi(ref, cur, bins)
        if got < -1e-9:
            raise Wrong(f"{call} is {got:.4g}, negative: each term (c - r) ln(c / r) is >= 0 (both factors have the "
                        "same sign); the factors are reversed somewhere")
        if empty:
            lo, hi = sorted((_psi(ref, cur, bins, eps=1e-2), _psi(ref, cur, bins, eps=1e-9)))
            if lo * 0.99 <= got <= hi * 1.01:
                results.append(got)
                continue
        elif math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-6):
            results.append(got)
            continue
        for kw, why in slips:
            if math.isclose(got, _psi(ref, cur, bins, **kw), rel_tol=1e-3, abs_tol=1e-6):
                raise Wrong(f"{call}: {why}")
        if math.isclose(got, -want, rel_tol=1e-3):
            raise Wrong(f"{call} is {got:.4g}, the negative of PSI: (c - r) ln(c / r), not (r - c) ln(c / r)")
        raise Wrong(f"{call} is {got:.4g}, expected {want:.4g}: inner edges at the reference's quantiles "
                    f"np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]), shares per bin, floored at 1e-4")
    return (f"right on four pairs of samples (PSI {results[0]:.3f} for a shifted one, {results[2]:.4f} for the same "
            "distribution, finite with empty bins).")


q6 = CodeExercise(
    name="08.6 the population stability index", var="psi", grade=_grade_psi,
    references=References("bin the values and sum the PSI terms yourself", "lab_utils.exercises.lab08.reference_psi",
                           "lab_utils.mlops.drift.psi"),
    signature="psi(reference, current, bins=10) -> float",
    hints=(
        "Bins from the reference: inner edges = np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]); the "
        "outer bins are open-ended. np.searchsorted(edges, x) gives each value's bin; np.bincount counts them.",
        "Shares, not counts (divide by the sample's size), floored at a small epsilon (np.maximum(share, 1e-4)); "
        "PSI = sum((c - r) * np.log(c / r)).",
    ),
    solution_text=source_as(reference_psi, "psi"),
)


# --- q5: the A/B verdict -----------------------------------------------------------------------------------------

_VERDICTS = ("real", "not real")
_VERDICT_SYNONYMS = {
    "real": ["yes", "true", "significant", "statistically significant", "real difference", "it is real",
             "the difference is real"],
    "not real": ["no", "false", "not significant", "noise", "chance", "no real difference", "not distinguishable",
                 "inconclusive", "it is not real", "the difference is not real", "unreal"],
}


def _grade_verdict(value: Any) -> str:
    res = _BOUND.get("ab")
    if res is None:
        raise NotApplicable("no A/B result to compare with yet: run the cell that compares the two groups (it calls "
                            "ex.use_ab(result)), then this one again.")
    picked = ("real" if value else "not real") if isinstance(value, bool) else \
        choice(value, _VERDICTS, _VERDICT_SYNONYMS)
    if picked is None:
        raise Wrong('answer "real" or "not real" (yes / no)')
    lo, hi = res.boot_low, res.boot_high
    real = reference_verdict(res) == "real"
    interval = f"the 95 % interval of B - A is [{lo:+.2%}, {hi:+.2%}] (p = {res.test.p_value:.3g})"
    if picked == "real" and not real:
        raise Wrong(f"{interval}: it contains 0, so no difference at all fits the data as well as the one measured; "
                    "at this sample size the difference is not distinguishable from chance")
    if picked == "not real" and real:
        raise Wrong(f"{interval}: it excludes 0, so a difference of 0 is implausible; the difference is real "
                    "(whether it matters is another question: compare it with the smallest difference worth acting on)")
    return f"{interval}."


q5 = Exercise(
    name="08.5 the A/B verdict", var="ab_verdict", grade=_grade_verdict,
    references=References("read the interval yourself", "lab_utils.exercises.lab08.reference_verdict"),
    hints=(
        "Read the 95 % interval of B - A (result.boot_low, result.boot_high) and the p-value (result.test.p_value).",
        "The difference is real when the interval excludes 0 (then p < 0.05 too): a 0 inside means 'no difference' "
        "explains the data as well.",
    ),
    solution_text="ab_verdict = \"real\" if not (result.boot_low <= 0 <= result.boot_high) else \"not real\"",
)
