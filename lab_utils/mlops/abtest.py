"""A/B testing: users routed by a hash of their id (the same user always sees the same model), accuracy compared
with a two-proportion z-test and a bootstrap confidence interval, and the sample size needed beforehand.

Closed forms with the standard library only (``statistics.NormalDist``); scipy, where installed, agrees (the tests
compare). Accuracies are fractions 0..1; differences are B - A."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from lab_utils.args import check_int

_N = NormalDist()


def route(user_id: str | int, split: float = 0.5, salt: str = "ab") -> str:
    """``"B"`` for a share ``split`` of users (0..1), ``"A"`` for the rest: sha256 of ``salt:user_id`` read as a
    uniform number in [0, 1). Stable across processes and runs (not Python's ``hash``, which is salted per
    process); a new ``salt`` draws a new, independent split for the next experiment."""
    if isinstance(user_id, bool) or not isinstance(user_id, (str, int)) or user_id == "":
        raise ValueError(f"user_id={user_id!r}: a non-empty string or an integer (the id the client sends)")
    if not (isinstance(split, (int, float)) and 0 <= split <= 1):
        raise ValueError(f"split={split!r}: the share of users routed to B, between 0 and 1 (0.5 = half)")
    u = int.from_bytes(hashlib.sha256(f"{salt}:{user_id}".encode()).digest()[:8], "big") / 2**64
    return "B" if u < split else "A"


@dataclass(frozen=True)
class ZTest:
    """Two-proportion z-test (pooled standard error under H0: p_A = p_B), two-sided."""

    p_a: float
    p_b: float
    n_a: int
    n_b: int
    diff: float  # p_b - p_a
    z: float
    p_value: float
    ci_low: float  # Wald interval of the difference (unpooled standard error), at ``confidence``
    ci_high: float
    confidence: float


def _count(successes: int, n: int, name: str) -> None:
    n = check_int(n, "n", name, what="the number of labelled requests")
    check_int(successes, "successes", name, 0, n, what="correct answers, not a fraction")


def two_proportion_ztest(successes_a: int, n_a: int, successes_b: int, n_b: int, confidence: float = 0.95) -> ZTest:
    """z = (p_B - p_A) / sqrt(p(1-p)(1/n_A + 1/n_B)) with p the pooled proportion; p-value two-sided."""
    _count(successes_a, n_a, "group A")
    _count(successes_b, n_b, "group B")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: a fraction such as 0.95")
    pa, pb = successes_a / n_a, successes_b / n_b
    pooled = (successes_a + successes_b) / (n_a + n_b)
    se0 = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    diff = pb - pa
    if se0 == 0:  # every answer right (or every one wrong) in both groups: no difference to see
        z, p = 0.0, 1.0
    else:
        z = diff / se0
        p = math.erfc(abs(z) / math.sqrt(2))  # = 2 (1 - Phi(|z|))
    se1 = math.sqrt(pa * (1 - pa) / n_a + pb * (1 - pb) / n_b)
    zc = _N.inv_cdf(0.5 + confidence / 2)
    return ZTest(pa, pb, int(n_a), int(n_b), diff, z, p, diff - zc * se1, diff + zc * se1, confidence)


def bootstrap_diff_ci(correct_a: Sequence[float] | np.ndarray, correct_b: Sequence[float] | np.ndarray, *,
                      n_boot: int = 5000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(difference of means B - A, low, high): the percentile bootstrap interval, each group resampled with
    replacement on its own. ``correct_*``: one 0/1 (or score) per labelled request."""
    a, b = np.asarray(correct_a, dtype=float), np.asarray(correct_b, dtype=float)
    for arr, g in ((a, "A"), (b, "B")):
        if arr.ndim != 1 or len(arr) < 2:
            raise ValueError(f"group {g}: one value per request (1 = correct, 0 = wrong), at least 2; got shape "
                             f"{arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"group {g}: NaN or infinite values; drop requests without a label first")
    check_int(n_boot, "n_boot", "bootstrap_diff_ci", minimum=100, what="resamples; 5000 gives a stable 95 % interval")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r}: a fraction such as 0.95")
    rng = np.random.default_rng(seed)
    diffs = np.empty(n_boot)
    chunk = max(1, 2_000_000 // (len(a) + len(b)))  # bounded memory: a chunk of resamples at a time
    for start in range(0, n_boot, chunk):
        k = min(chunk, n_boot - start)
        ma = a[rng.integers(0, len(a), (k, len(a)))].mean(axis=1)
        mb = b[rng.integers(0, len(b), (k, len(b)))].mean(axis=1)
        diffs[start:start + k] = mb - ma
    tail = (1 - confidence) / 2
    low, high = np.quantile(diffs, [tail, 1 - tail])
    return float(b.mean() - a.mean()), float(low), float(high)


def sample_size(p_a: float, p_b: float, *, alpha: float = 0.05, power: float = 0.8, two_sided: bool = True,
                pooled: bool = True) -> int:
    """Labelled requests needed in EACH group to detect accuracy ``p_a`` vs ``p_b`` with a two-proportion z-test.

    ``pooled`` (default; Fleiss): n = (z_a sqrt(2 p(1-p)) + z_b sqrt(p_a q_a + p_b q_b))^2 / (p_a - p_b)^2 with
    p = (p_a + p_b)/2; else the unpooled form n = (z_a + z_b)^2 (p_a q_a + p_b q_b) / (p_a - p_b)^2 (Chow, Shao &
    Wang). z_a = Phi^-1(1 - alpha/2) two-sided, z_b = Phi^-1(power). Rounded up."""
    for v, name in ((p_a, "p_a"), (p_b, "p_b")):
        if not (isinstance(v, (int, float)) and 0 < v < 1):
            raise ValueError(f"{name}={v!r}: an accuracy strictly between 0 and 1 (0.95, not 95)")
    if p_a == p_b:
        raise ValueError(f"p_a = p_b = {p_a}: no difference to detect; state the smallest difference that matters")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha!r}: the false-positive rate, e.g. 0.05")
    if not 0.5 <= power < 1:
        raise ValueError(f"power={power!r}: the chance to detect a real difference, e.g. 0.8 (not 80)")
    z_a = _N.inv_cdf(1 - alpha / 2 if two_sided else 1 - alpha)
    z_b = _N.inv_cdf(power)
    var = p_a * (1 - p_a) + p_b * (1 - p_b)
    delta2 = (p_a - p_b) ** 2
    if pooled:
        p = (p_a + p_b) / 2
        n = (z_a * math.sqrt(2 * p * (1 - p)) + z_b * math.sqrt(var)) ** 2 / delta2
    else:
        n = (z_a + z_b) ** 2 * var / delta2
    return math.ceil(n - 1e-9)  # a float a hair above an integer is that integer


@dataclass(frozen=True)
class AbResult:
    """The A/B verdict: the test, the bootstrap interval, and the sentence to read."""

    test: ZTest
    boot_diff: float
    boot_low: float
    boot_high: float
    alpha: float

    @property
    def real(self) -> bool:
        """True when the z-test rejects equal accuracy and the bootstrap interval excludes 0."""
        return self.test.p_value < self.alpha and not (self.boot_low <= 0 <= self.boot_high)

    def verdict(self) -> str:
        t = self.test
        head = (f"B - A = {t.diff:+.2%} (A {t.p_a:.2%} of {t.n_a}, B {t.p_b:.2%} of {t.n_b}); z = {t.z:.2f}, "
                f"p = {t.p_value:.3g}; bootstrap {t.confidence:.0%} CI [{self.boot_low:+.2%}, {self.boot_high:+.2%}]")
        if self.real:
            return f"{head}: the difference is real (p < {self.alpha:g}, the interval excludes 0)"
        return f"{head}: not distinguishable from no difference at this sample size"


def compare_groups(correct_a: Sequence[float] | np.ndarray, correct_b: Sequence[float] | np.ndarray, *,
                   alpha: float = 0.05, n_boot: int = 5000, seed: int = 0) -> AbResult:
    """The z-test and the bootstrap interval on two groups' 0/1 outcomes (one per labelled request)."""
    a, b = np.asarray(correct_a), np.asarray(correct_b)
    for arr, g in ((a, "A"), (b, "B")):
        if arr.ndim != 1 or not np.isin(arr, (0, 1)).all():
            raise ValueError(f"group {g}: one 0/1 outcome per labelled request (1 = correct)")
    test = two_proportion_ztest(int(a.sum()), len(a), int(b.sum()), len(b), confidence=1 - alpha)
    diff, low, high = bootstrap_diff_ci(a, b, n_boot=n_boot, confidence=1 - alpha, seed=seed)
    return AbResult(test, diff, low, high, alpha)
