"""Lab 03's one comparison: every backend x precision x batch the lab measures, in one table and one plot,
with what each cost in accuracy (against labels) or in fidelity (against the FP32 logits).

Units are in names: ``_ms`` milliseconds, ``images_per_s`` images per second of wall time at the p50
latency; accuracies and agreements are fractions in [0, 1], accuracy changes are percentage points.
numpy and pandas only: the ONNX, torch and TensorRT modules of this package feed it."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from lab_utils.args import check_int
from lab_utils.plotting import finish, log2_x, new_axes, require_columns
from lab_utils.timing import Timing

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COMPARISON_COLUMNS = ["model", "backend", "precision", "batch", "p50_ms", "p90_ms", "images_per_s",
                      "accuracy", "accuracy_delta_points", "top1_agreement", "rel_logit_error", "device", "note"]


# --- What a precision or a backend cost -----------------------------------------------------------


def accuracy(logits: ArrayLike, labels: ArrayLike) -> float:
    """Top-1 accuracy (fraction) of ``logits`` (N, classes) against integer ``labels`` (N,)."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"accuracy: logits must be (N, classes) and labels (N,); got {logits.shape} and "
                         f"{labels.shape}")
    return float((logits.argmax(1) == labels).mean())


def agreement(logits: ArrayLike, reference: ArrayLike) -> float:
    """Fraction of samples whose top-1 class equals the reference's (for models without labels)."""
    return float((np.asarray(logits).argmax(1) == np.asarray(reference).argmax(1)).mean())


def logit_error(logits: ArrayLike, reference: ArrayLike) -> dict[str, float]:
    """How far ``logits`` are from ``reference`` (FP32): top-1 agreement, and the mean |difference| relative
    to the mean |reference| (the fairer measure for a random-weight model, whose top-1 is a near-tie)."""
    a, r = np.asarray(logits, dtype=np.float32), np.asarray(reference, dtype=np.float32)
    return {"top1_agreement": agreement(a, r),
            "rel_logit_error": float(np.abs(a - r).mean() / max(float(np.abs(r).mean()), 1e-12))}


# --- How sure: accuracy on a small test set -------------------------------------------------------


def wilson_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval for an accuracy of ``correct`` out of ``n`` (fractions in [0, 1]).

    Unlike the normal approximation p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and is honest near 100 %,
    where a lab's accuracies sit: 353/357 gives 0.972..0.996, not 0.978..1.000."""
    check_int(n, "n", "wilson_interval", 1)
    if not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: correct must lie in 0..n, got {correct} of {n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    z = NormalDist().inv_cdf((1 + confidence) / 2)  # the two-sided standard normal quantile: 0.95 -> 1.96
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo = 0.0 if correct == 0 else max(0.0, centre - half)  # exact at the ends, where rounding would leave 1e-17
    hi = 1.0 if correct == n else min(1.0, centre + half)
    return lo, hi


def mcnemar_p(fixed: int, broken: int) -> float:
    """Exact two-sided McNemar p-value: the chance of a split at least this uneven between the images a change
    fixed and the images it broke, if the change made no difference (each flip a fair coin)."""
    if (n := fixed + broken) == 0:
        return 1.0
    k = min(fixed, broken)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def accuracy_report(logits: dict[str, ArrayLike], labels: ArrayLike) -> pd.DataFrame:
    """Per precision: accuracy with its 95 % Wilson interval, the change against ``fp32`` counted in images, and
    the agreement with fp32's predictions (which images changed, fixed or broken, and McNemar's p).

    One row per key of ``logits`` ((N, classes) arrays, the same N images); ``labels`` (N,)."""
    if "fp32" not in logits:
        raise ValueError(f"accuracy_report: the reference 'fp32' is not among {list(logits)}")
    y = np.asarray(labels)
    ref_pred = np.asarray(logits["fp32"]).argmax(1)
    ref_right = ref_pred == y
    n = int(y.size)
    rows = []
    for name, out in logits.items():
        pred = np.asarray(out).argmax(1)
        right = pred == y
        lo, hi = wilson_interval(int(right.sum()), n)
        fixed, broken = int((right & ~ref_right).sum()), int((~right & ref_right).sum())
        rows.append({"precision": name, "correct": int(right.sum()), "images": n, "accuracy": float(right.mean()),
                     "ci95_low": lo, "ci95_high": hi, "delta_images": int(right.sum() - ref_right.sum()),
                     "delta_points": float(right.mean() - ref_right.mean()) * 100,
                     "agreement": float((pred == ref_pred).mean()), "changed": int((pred != ref_pred).sum()),
                     "fixed": fixed, "broken": broken, "mcnemar_p": mcnemar_p(fixed, broken)})
    return pd.DataFrame(rows)


# --- Where a GPU's time goes at small batches -----------------------------------------------------


def _images_per_s(values: dict[str, float], slug: str, backend: str, precision: str, batch: int) -> float | None:
    v = values.get(f"{slug}_torch-{backend}_{precision}_b{batch}_images_per_s")
    return float(v) if v is not None and v == v and v > 0 else None


def launch_overhead_notes(values: dict[str, float], slug: str = "resnet50", amp: str = "bf16",
                          small: int = 1, graph_batch: int = 32, large: int = 128) -> list[str]:
    """Sentences on launch overhead from recorded throughputs (``name -> images/s``, names as lab 03 records
    them): why autocast is slower than FP32 at batch ``small``, and how much of the CUDA graph's gain at
    ``graph_batch`` eager low precision reaches by batch ``large`` alone. Missing values leave a sentence out."""
    notes = []
    eager = _images_per_s(values, slug, "eager", "fp32", small)
    low = {s: _images_per_s(values, slug, s, amp, small) for s in ("autocast", "channels-last")}
    low_step = next((s for s in ("autocast", "channels-last") if low[s]), None)
    if eager and low_step:
        ms_eager, ms_low = small / eager * 1e3, small / low[low_step] * 1e3  # type: ignore[operator]
        verdict = "slower" if ms_low > ms_eager else "faster"
        notes.append(
            f"batch {small}: eager FP32 {ms_eager:.2f} ms, {low_step} {amp.upper()} {ms_low:.2f} ms ({verdict}). At "
            "this size each kernel is tiny and the GPU mostly waits for the CPU to launch the next one (a ResNet-50 "
            "is over 150 launches, each several µs of CPU time); autocast adds a cast kernel before each convolution "
            "(the weights are cast on every call), so it launches more and saves no time that was being spent.")
    for step in ("channels-last", "autocast"):
        mid, big = (_images_per_s(values, slug, step, amp, b) for b in (graph_batch, large))
        graph = _images_per_s(values, slug, "cuda-graph", amp, graph_batch)
        if mid and big:
            ms_mid, ms_big = graph_batch / mid * 1e3, large / big * 1e3
            line = (f"eager {step} {amp.upper()}: batch {graph_batch} takes {ms_mid:.2f} ms, batch {large} "
                    f"{ms_big:.2f} ms: {large // graph_batch}x the images in {ms_big / ms_mid:.1f}x the time, so at "
                    f"batch {graph_batch} the GPU is mostly waiting for launches.")
            if graph:
                line += (f" Eager at batch {large} reaches {big:,.0f} images/s, {big / graph:.0%} of the CUDA graph's "
                         f"{graph:,.0f} at batch {graph_batch}: most of the graph's gain at batch {graph_batch} is "
                         "launch overhead removed, not faster kernels.")
            notes.append(line)
            break
    return notes


# --- The table ------------------------------------------------------------------------------------


class Comparison:
    """Rows of backend x precision x batch -> p50 latency, throughput and accuracy change against FP32.

    ``add`` one measurement at a time from any section of the lab; ``frame()`` is the table."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._fp32_accuracy: dict[str, float] = {}

    def set_reference(self, model: str, fp32_accuracy: float) -> None:
        """The FP32 accuracy of ``model`` that accuracy changes are measured against."""
        self._fp32_accuracy[model] = float(fp32_accuracy)

    def add(self, model: str, backend: str, precision: str, batch: int, timing: Timing | None = None, *,
            p50_ms: float | None = None, p90_ms: float | None = None, accuracy: float | None = None,
            top1_agreement: float | None = None, rel_logit_error: float | None = None, device: str = "",
            note: str = "") -> dict[str, Any]:
        """One row; ``timing`` is a ``lab_utils.timing.Timing`` (or pass ``p50_ms`` directly)."""
        check_int(batch, "batch", "Comparison.add")
        if timing is not None:
            p50_ms, p90_ms, device = timing.median_ms, timing.p90_ms, device or timing.device
        ref = self._fp32_accuracy.get(model)
        row = {"model": model, "backend": backend, "precision": precision, "batch": int(batch), "p50_ms": p50_ms,
               "p90_ms": p90_ms, "images_per_s": batch / (p50_ms / 1e3) if p50_ms else None, "accuracy": accuracy,
               "accuracy_delta_points": (accuracy - ref) * 100 if accuracy is not None and ref is not None else None,
               "top1_agreement": top1_agreement, "rel_logit_error": rel_logit_error, "device": device, "note": note}
        self.rows.append(row)
        return row

    def frame(self) -> pd.DataFrame:
        """The table, one row per ``add``, columns ``COMPARISON_COLUMNS``."""
        df = pd.DataFrame(self.rows, columns=COMPARISON_COLUMNS)
        return df.astype({"batch": int}) if len(df) else df

    def throughput(self, model: str, backend: str, precision: str, batch: int) -> float:
        """images/s of one row (NaN when that row was not measured)."""
        df = self.frame()
        hit = df[(df["model"] == model) & (df["backend"] == backend) & (df["precision"] == precision)
                 & (df["batch"] == batch)]
        return float(hit["images_per_s"].iloc[-1]) if len(hit) else math.nan


def plot_comparison(df: pd.DataFrame, model: str | None = None, ax: Axes | None = None,
                    title: str | None = None) -> Figure:
    """Throughput (images/s) against batch size, one line per backend + precision, for one model.

    Input: ``Comparison.frame()``. Log-log axes; rows without a latency are skipped."""
    require_columns(df, {"model", "backend", "precision", "batch", "images_per_s"}, "plot_comparison",
                    "Comparison.frame()")
    model = model or str(df["model"].iloc[0])
    rows = df[(df["model"] == model) & df["images_per_s"].notna()]
    _, ax = new_axes(ax, (7.0, 4.5))
    for (backend, precision), group in rows.groupby(["backend", "precision"], sort=False):
        group = group.sort_values("batch")
        ax.plot(group["batch"], group["images_per_s"], marker="o", label=f"{backend} {precision}")
    log2_x(ax, sorted(rows["batch"].unique()))
    ax.set_yscale("log")
    ax.set(xlabel="batch size", ylabel="images/s (at the p50 latency)",
           title=title or f"{model}: throughput by backend and precision")
    return finish(ax, fontsize="small")
