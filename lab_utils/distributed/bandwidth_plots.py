"""Lab 02's plot: bus bandwidth against message size, one line per collective, against the link's peak.

matplotlib is imported inside the function and no backend is forced (a notebook shows the figure inline;
tests select Agg). Pass ``ax`` to draw into an existing axes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from lab_utils import plotting

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_busbw(df: pd.DataFrame, peak_gbps: float | None = None, reference: dict[int, float] | None = None,
               ax: Axes | None = None, title: str | None = None) -> Figure:
    """Bus bandwidth (GB/s) against message size S (log scale), one line per collective.

    Input: ``collectives.collective_sweep``'s frame (rows with status 'ok' are drawn). ``peak_gbps`` (else the frame's
    ``peak_gbps`` column, when finite) is drawn dashed: the link's speed per direction. ``reference`` maps size in bytes
    to busbw GB/s, drawn as black crosses (e.g. the H200 all_reduce run, ``bandwidth.H200_ALLREDUCE_BUSBW_GBPS``)."""
    made_by = "distributed.collectives.collective_sweep"
    plotting.require_columns(df, {"collective", "size_bytes", "busbw_gbps"}, "plot_busbw", made_by)
    _, ax = plotting.new_axes(ax)
    ok = df[df["status"] == "ok"] if "status" in df else df
    for collective, group in ok.groupby("collective", sort=False):
        group = group.sort_values("size_bytes")
        ax.plot(group["size_bytes"], group["busbw_gbps"], marker="o", label=str(collective))
    if peak_gbps is None and "peak_gbps" in df:
        finite = [float(p) for p in df["peak_gbps"].dropna().unique() if plotting.is_finite(p)]
        peak_gbps = finite[0] if finite else None
    if plotting.is_finite(peak_gbps):
        ax.axhline(float(peak_gbps), color="gray", linestyle="--", linewidth=1,
                   label=f"link peak {float(peak_gbps):.4g} GB/s per direction")
    if reference:
        sizes = sorted(reference)
        ax.plot(sizes, [reference[s] for s in sizes], linestyle="none", marker="x", color="black",
                label="reference all_reduce")
    sizes = sorted(ok["size_bytes"].unique())
    plotting.log2_x(ax, sizes if len(sizes) <= 12 else (), in_bytes=True)  # one tick per measured size, if few
    ax.set(xlabel="message size S (nccl-tests definition)", ylabel="busbw, GB/s (slowest rank's median)")
    if title is None:
        where = ""
        if len(ok) and {"backend", "n_ranks"} <= set(ok.columns):
            where = f" ({ok['backend'].iloc[0]}, {int(ok['n_ranks'].iloc[0])} ranks)"
        title = f"Collective bus bandwidth{where}"
    ax.set_title(title)
    return plotting.finish(ax, fontsize="small")
