"""Shared plot bits: axes, column checks, byte formatting. Each lab's plots live next to its helpers
(``lab_utils.gpu.bench_plots`` for lab 01, ...); each takes a frame from a lab helper and returns a matplotlib Figure.

matplotlib is imported inside the functions, and no backend is forced: in a notebook the inline
backend shows the figure; tests select Agg themselves. Pass ``ax`` to draw into an existing axes."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def new_axes(ax: Any, figsize: tuple[float, float] = (7.0, 4.5)) -> tuple[Any, Any]:
    """(figure, axes): ``ax`` and its figure when given, else a new figure of ``figsize`` inches."""
    if ax is not None:
        return ax.figure, ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def finish(ax: Any, **legend: Any) -> Any:
    """Grid lines at both tick levels and a legend (``legend``: its options) when something on ``ax`` has a label
    (no legend, and no warning, on an empty plot); returns the axes' figure."""
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**legend)
    return ax.figure


def require_columns(df: Any, columns: set[str], where: str, made_by: str) -> None:
    """Raise a ValueError naming ``where`` and ``made_by`` unless ``df`` is a frame with ``columns``."""
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"{where}(df=...): expected the frame {made_by} returns, not {type(df).__name__}")
    if missing := columns - set(df.columns):
        raise ValueError(f"{where}(df=...): missing columns {sorted(missing)}; pass what {made_by} returns")


def is_finite(x: Any) -> bool:
    """True for a number that is neither None, NaN nor infinite."""
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def log2_x(ax: Any, ticks: Any = (), in_bytes: bool = False) -> None:
    """x on a log2 scale, a tick at each of ``ticks``: whole numbers, or sizes in KiB/MiB/GiB with ``in_bytes``."""
    ax.set_xscale("log", base=2)
    if len(ticks):
        ax.set_xticks(list(ticks), None if in_bytes else [str(int(t)) for t in ticks])
        ax.minorticks_off()
    if in_bytes:
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(format_bytes))


def format_bytes(nbytes: float, _pos: Any = None) -> str:
    """1048576 -> '1 MiB' (also usable as a matplotlib tick formatter)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"
