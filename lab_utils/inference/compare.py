"""Lab 03's one comparison: every backend x precision x batch the lab measures, in one table and one plot,
with what each cost in accuracy (against labels) or in fidelity (against the FP32 logits).

Units are in names: ``_ms`` milliseconds, ``images_per_s`` images per second of wall time at the p50
latency; accuracies and agreements are fractions in [0, 1], accuracy changes are percentage points.
numpy and pandas only: the ONNX, torch and TensorRT modules of this package feed it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from lab_utils.args import check_int
from lab_utils.plots import new_axes, require_columns
from lab_utils.timing import Timing

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COMPARISON_COLUMNS = ["model", "backend", "precision", "batch", "p50_ms", "p90_ms", "images_per_s",
                      "accuracy", "accuracy_delta_points", "top1_agreement", "rel_logit_error", "device", "note"]


# --------------------------------------------------------------------------------------------------
# What a precision or a backend cost


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


# --------------------------------------------------------------------------------------------------
# The table


class Comparison:
    """Rows of backend x precision x batch -> p50 latency, throughput and accuracy change against FP32.

    ``add`` one measurement at a time from any section of the lab; ``frame()`` is the table.
    """

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
        row = {"model": model, "backend": backend, "precision": precision, "batch": int(batch),
               "p50_ms": p50_ms, "p90_ms": p90_ms,
               "images_per_s": batch / (p50_ms / 1e3) if p50_ms else None,
               "accuracy": accuracy,
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

    Input: ``Comparison.frame()``. Log-log axes; rows without a latency are skipped.
    """
    require_columns(df, {"model", "backend", "precision", "batch", "images_per_s"}, "plot_comparison",
                    "Comparison.frame()")
    model = model or str(df["model"].iloc[0])
    rows = df[(df["model"] == model) & df["images_per_s"].notna()]
    fig, ax = new_axes(ax, (7.0, 4.5))
    for (backend, precision), group in rows.groupby(["backend", "precision"], sort=False):
        group = group.sort_values("batch")
        ax.plot(group["batch"], group["images_per_s"], marker="o", label=f"{backend} {precision}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted(rows["batch"].unique())
    if sizes:
        ax.set_xticks(sizes, [str(int(b)) for b in sizes])
        ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("images/s (at the p50 latency)")
    ax.set_title(title or f"{model}: throughput by backend and precision")
    ax.grid(True, which="both", alpha=0.3)
    if len(rows):
        ax.legend(fontsize="small")
    return fig


def largest_batch_within(latency_ms: dict[int, float], budget_ms: float) -> int | None:
    """The largest batch whose p50 latency fits ``budget_ms`` (None when even the smallest does not)."""
    fits = [b for b, ms in latency_ms.items() if ms <= budget_ms]
    return max(fits) if fits else None
