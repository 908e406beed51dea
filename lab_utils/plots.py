"""Shared plot bits: axes, column checks, byte formatting. Each lab's plots live next to its helpers
(``lab_utils.gpu.plots`` for lab 01, ...); each takes a frame from a lab helper and returns a matplotlib Figure.

matplotlib is imported inside the functions, and no backend is forced: in a notebook the inline
backend shows the figure; tests select Agg themselves. Pass ``ax`` to draw into an existing axes.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def new_axes(ax: Any, figsize: tuple[float, float] = (7.0, 4.5)) -> tuple[Any, Any]:
    """(figure, axes): ``ax`` and its figure when given, else a new figure of ``figsize`` inches."""
    if ax is not None:
        return ax.figure, ax
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    return fig, ax


def require_columns(df: Any, columns: set[str], where: str, made_by: str) -> None:
    """Raise a ValueError naming ``where`` and ``made_by`` unless ``df`` is a frame with ``columns``."""
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"{where}(df=...): expected the frame {made_by} returns, not {type(df).__name__}")
    missing = columns - set(df.columns)
    if missing:
        raise ValueError(f"{where}(df=...): missing columns {sorted(missing)}; pass what {made_by} returns")


def is_finite(x: Any) -> bool:
    """True for a number that is neither None, NaN nor infinite."""
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def format_bytes(nbytes: float, _pos: Any = None) -> str:
    """1048576 -> '1 MiB' (also usable as a matplotlib tick formatter)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


def plot_busbw(
    df: pd.DataFrame,
    peak_gbps: float | None = None,
    reference: dict[int, float] | None = None,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Bus bandwidth (GB/s) against message size S (log scale), one line per collective.

    Input: ``collectives.collective_sweep``'s frame (rows with status 'ok' are drawn). ``peak_gbps`` (else the
    frame's ``peak_gbps`` column, when finite) is drawn dashed: the link's speed per direction.
    ``reference`` maps size in bytes to busbw GB/s, drawn as black crosses (e.g. the H200 all_reduce run,
    ``collectives.H200_ALLREDUCE_BUSBW_GBPS``).
    """
    made_by = "collectives.collective_sweep"
    require_columns(df, {"collective", "size_bytes", "busbw_gbps"}, "plot_busbw", made_by)
    fig, ax = new_axes(ax)
    ok = df[df["status"] == "ok"] if "status" in df else df
    for collective, group in ok.groupby("collective", sort=False):
        group = group.sort_values("size_bytes")
        ax.plot(group["size_bytes"], group["busbw_gbps"], marker="o", label=str(collective))
    if peak_gbps is None and "peak_gbps" in df:
        finite = [float(p) for p in df["peak_gbps"].dropna().unique() if is_finite(p)]
        peak_gbps = finite[0] if finite else None
    if is_finite(peak_gbps):
        ax.axhline(float(peak_gbps), color="gray", linestyle="--", linewidth=1,
                   label=f"link peak {float(peak_gbps):.4g} GB/s per direction")
    if reference:
        sizes = sorted(reference)
        ax.plot(sizes, [reference[s] for s in sizes], linestyle="none", marker="x", color="black",
                label="reference all_reduce")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    sizes = sorted(ok["size_bytes"].unique())
    if 0 < len(sizes) <= 12:
        ax.set_xticks(sizes)  # one tick per measured size, labelled in KiB/MiB/GiB
        ax.minorticks_off()
    ax.xaxis.set_major_formatter(FuncFormatter(format_bytes))
    ax.set_xlabel("message size S (nccl-tests definition)")
    ax.set_ylabel("busbw, GB/s (slowest rank's median)")
    if title is None:
        where = ""
        if len(ok) and {"backend", "n_ranks"} <= set(ok.columns):
            where = f" ({ok['backend'].iloc[0]}, {int(ok['n_ranks'].iloc[0])} ranks)"
        title = f"Collective bus bandwidth{where}"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if len(ok) or reference or is_finite(peak_gbps):
        ax.legend(fontsize="small")
    return fig
