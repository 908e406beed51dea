"""Lab 01's plots: matmul throughput by size and dtype, the roofline, copy bandwidth.

matplotlib is imported inside the functions and no backend is forced (a notebook shows the figure inline;
tests select Agg). Pass ``ax`` to draw into an existing axes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from lab_utils import plotting
from lab_utils.course.specs import ridge_point


def plot_matmul_sweep(df: pd.DataFrame, ax: Any = None, title: str | None = None) -> Any:
    """Achieved TFLOP/s against matrix size n (n×n×n), one line per dtype; the dtype's datasheet peak
    as a dashed line of the same colour when known. Input: ``gpu.bench.matmul_sweep``'s frame."""
    plotting.require_columns(df, {"dtype", "n", "tflops"}, "plot_matmul_sweep", "gpu.bench.matmul_sweep")
    _, ax = plotting.new_axes(ax)
    ok = df[df["status"] == "ok"] if "status" in df else df
    for dtype, group in ok.groupby("dtype", sort=False):
        group = group.sort_values("n")
        (line,) = ax.plot(group["n"], group["tflops"], marker="o", label=dtype)
        peaks = group["peak_tflops"].dropna() if "peak_tflops" in group else []
        if len(peaks):
            ax.axhline(float(peaks.iloc[0]), color=line.get_color(), linestyle="--", linewidth=1)
    plotting.log2_x(ax, sorted(ok["n"].unique()))
    ax.set(xlabel="matrix size n (n×n×n)", ylabel="achieved TFLOP/s (median)")
    if title is None:
        where = ok["device_name"].iloc[0] if "device_name" in ok and len(ok) else ""
        title = f"Matmul throughput{' on ' + where if where else ''} (dashed: datasheet peak)"
    ax.set_title(title)
    return plotting.finish(ax, title="dtype")


def plot_roofline(points_df: pd.DataFrame, peak_tflops: float | None, bw_tbps: float | None,
                  measured_peak_tflops: float | None = None, measured_bw_tbps: float | None = None, ax: Any = None,
                  title: str | None = None) -> Any:
    """Log-log roofline: attainable TFLOP/s = min(peak, bandwidth × intensity), the ridge point marked.

    Solid: datasheet roof (``peak_tflops``, ``bw_tbps``; pass None when unknown, e.g. on the CPU).
    Dotted: the measured roof, when given (``points_df.attrs`` from ``gpu.bench.roofline_points``
    holds both). Points: rows with positive intensity and TFLOP/s; copies (no FLOPs) only set the roof."""
    plotting.require_columns(points_df, {"intensity_flop_per_byte", "tflops"}, "plot_roofline",
                          "gpu.bench.roofline_points")
    roofs = []
    if plotting.is_finite(peak_tflops) or plotting.is_finite(bw_tbps):
        if not (plotting.is_finite(peak_tflops) and plotting.is_finite(bw_tbps)):
            raise ValueError(f"plot_roofline(peak_tflops={peak_tflops!r}, bw_tbps={bw_tbps!r}): give both or neither")
        roofs.append(("datasheet", float(peak_tflops), float(bw_tbps), "-"))
    if plotting.is_finite(measured_peak_tflops) and plotting.is_finite(measured_bw_tbps):
        roofs.append(("measured", float(measured_peak_tflops), float(measured_bw_tbps), ":"))
    if not roofs:
        raise ValueError("plot_roofline: no roof to draw: pass peak_tflops and bw_tbps (datasheet) or "
                         "measured_peak_tflops and measured_bw_tbps (e.g. points_df.attrs from roofline_points)")
    pts = points_df[(points_df["intensity_flop_per_byte"] > 0) & (points_df["tflops"] > 0)]
    ridges = [ridge_point(p, b) for _, p, b, _ in roofs]
    xs = list(pts["intensity_flop_per_byte"]) + ridges
    x_lo, x_hi = min(xs) / 4, max(xs) * 4
    _, ax = plotting.new_axes(ax)
    x = np.logspace(math.log10(x_lo), math.log10(x_hi), 200)
    for i, ((label, peak, bw, style), ridge) in enumerate(zip(roofs, ridges, strict=True)):
        ax.plot(x, np.minimum(peak, bw * x), linestyle=style, color="black",
                label=f"{label} roof: {peak:.4g} TFLOP/s, {bw:.3g} TB/s")
        ax.plot([ridge], [peak], marker="D", color="black", linestyle="none")
        # First label above its roof, second below, so two ridges close together stay readable.
        ax.annotate(f"{label} ridge {ridge:.3g} FLOP/B", (ridge, peak), textcoords="offset points",
                    xytext=(-20, 8) if i == 0 else (6, -14), fontsize="small")
    keys = [c for c in ("kind", "dtype") if c in pts.columns]
    groups = pts.groupby(keys, sort=False) if keys else [("measured", pts)]
    for key, group in groups:
        label = " ".join(str(k) for k in key if k) if isinstance(key, tuple) else str(key)
        ax.scatter(group["intensity_flop_per_byte"], group["tflops"], label=label, zorder=3)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="TFLOP/s",
           title=title or "Roofline")
    # the legend beside the axes, not in them: "best" still put it over points (a CPU's sit low, under it)
    return plotting.finish(ax, fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)


def plot_bandwidth(df: pd.DataFrame, ax: Any = None, title: str | None = None) -> Any:
    """Achieved GB/s against transfer size; one line per (direction, host memory) when those columns exist
    (``gpu.bench.host_device_bandwidth``), else one line (``gpu.bench.copy_bandwidth``). The
    ``peak_gbps`` column, when finite, is drawn dashed."""
    made_by = "gpu.bench.copy_bandwidth or host_device_bandwidth"
    plotting.require_columns(df, {"size_bytes", "gbps"}, "plot_bandwidth", made_by)
    _, ax = plotting.new_axes(ax)
    keys = [c for c in ("direction", "host_memory") if c in df.columns]
    groups = df.groupby(keys, sort=False) if keys else [("copy (read + write)", df)]
    for key, group in groups:
        group = group.sort_values("size_bytes")
        label = " ".join(key) if isinstance(key, tuple) else str(key)
        ax.plot(group["size_bytes"], group["gbps"], marker="o", label=label)
    peaks = df["peak_gbps"].dropna().unique() if "peak_gbps" in df else []
    for peak in peaks:
        ax.axhline(float(peak), color="gray", linestyle="--", linewidth=1, label=f"datasheet {peak:.4g} GB/s")
    plotting.log2_x(ax, in_bytes=True)
    ax.set(xlabel="transfer size", ylabel="GB/s (median)", title=title or "Bandwidth")
    return plotting.finish(ax, fontsize="small")
