"""Lab 05's panels: one list of PromQL expressions for the notebook's plots and the Grafana dashboard, the
dashboard generated from it, range queries per panel, and two lessons about reading them (quantiles cannot be
averaged; Triton's GPU readings against the exporter's).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from lab_utils.monitoring.prometheus import RULES_DIR, PromAPI, pivot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DASHBOARD_FILE = RULES_DIR / "grafana_dashboard.json"


@dataclass(frozen=True)
class Panel:
    """One plot: a PromQL expression with ``{w}`` for the rate window, its unit and what it shows."""

    key: str
    title: str
    expr: str
    unit: str
    legend: str = "{{model}}"
    needs_gpu: bool = False
    host_only: bool = False  # the CPU tier's stand-in for a GPU panel

    def expression(self, window: str = "1m") -> str:
        """The expression with its rate window set (``"5s"``, ``"1m"``, Grafana's ``"$__rate_interval"``)."""
        return self.expr.replace("{w}", window)


PANELS: tuple[Panel, ...] = (
    Panel("qps", "Throughput (requests/s)", "sum by (model) (rate(nv_inference_request_success[{w}]))", "req/s"),
    Panel("batch", "Average batch size (inferences per execution)",
          "sum by (model) (rate(nv_inference_count[{w}])) / sum by (model) (rate(nv_inference_exec_count[{w}]))",
          "inferences"),
    Panel("latency", "Average request latency (ms)",
          "sum by (model) (rate(nv_inference_request_duration_us[{w}])) "
          "/ sum by (model) (rate(nv_inference_request_success[{w}])) / 1000", "ms"),
    Panel("queue_share", "Share of request time spent queued",
          "sum by (model) (rate(nv_inference_queue_duration_us[{w}])) "
          "/ sum by (model) (rate(nv_inference_request_duration_us[{w}]))", "fraction"),
    Panel("p99", "p99 latency from Triton's summary (ms)",
          'max by (model) (nv_inference_request_summary_us{quantile="0.99"}) / 1000', "ms"),
    Panel("pending", "Pending requests (queued, not yet executing)",
          "sum by (model) (nv_inference_pending_request_count)", "requests"),
    Panel("gpu_util", "GPU utilization (%)", "DCGM_FI_DEV_GPU_UTIL", "%", "GPU {{gpu}}", needs_gpu=True),
    Panel("gpu_memory", "GPU memory used (GiB)", "DCGM_FI_DEV_FB_USED / 1024", "GiB", "GPU {{gpu}}", needs_gpu=True),
    Panel("gpu_power", "GPU power (W)", "DCGM_FI_DEV_POWER_USAGE", "W", "GPU {{gpu}}", needs_gpu=True),
    Panel("host_cpu", "Host CPU busy (%)", "nvlab_host_cpu_utilization_percent", "%", "host", host_only=True),
    Panel("host_memory", "Host memory used (GiB)", "nvlab_host_memory_used_bytes / 2^30", "GiB", "host",
          host_only=True),
    Panel("up", "Targets up (1) or down (0)", "up", "", "{{job}}"),
)


def panels(gpu: bool) -> list[Panel]:
    """The notebook's panels: GPU panels with a GPU, the host's in their place without one."""
    return [p for p in PANELS if (p.needs_gpu and gpu) or (p.host_only and not gpu) or
            not (p.needs_gpu or p.host_only)]


def panel(key: str) -> Panel:
    """The panel named ``key`` ("qps", "p99", ...)."""
    found = next((p for p in PANELS if p.key == key), None)
    if found is None:
        raise KeyError(f"no panel {key!r}; the panels are {[p.key for p in PANELS]}")
    return found


# --- the Grafana dashboard -------------------------------------------------------------------------------


def dashboard(window: str = "$__rate_interval") -> dict[str, Any]:
    """The Grafana dashboard (JSON model) built from :data:`PANELS`: the same expressions as the notebook."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    out_panels = []
    for i, p in enumerate(PANELS):
        unit = {"req/s": "reqps", "ms": "ms", "fraction": "percentunit", "%": "percent", "GiB": "decgbytes",
                "W": "watt"}.get(p.unit, "short")
        out_panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "datasource": ds,
            "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": (i // 3) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": "A", "datasource": ds, "expr": p.expression(window), "legendFormat": p.legend}],
        })
    return {
        "title": "Triton and GPU (nvlab lab 05)",
        "uid": "nvlab-triton-gpu",
        "tags": ["nvlab", "triton", "gpu"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []},
        "panels": out_panels,
    }


def dashboard_text() -> str:
    """The dashboard file's text (``DASHBOARD_FILE`` holds it, generated)."""
    return json.dumps(dashboard(), indent=2) + "\n"


def dashboard_expressions(path: str | Path = DASHBOARD_FILE, window: str = "5s") -> list[tuple[str, str]]:
    """(title, expression) of every query in a dashboard file, Grafana's ``$__rate_interval`` set to ``window``."""
    model = json.loads(Path(path).read_text())
    out = []
    for p in model.get("panels", []):
        for t in p.get("targets", []):
            expr = re.sub(r"\$__rate_interval|\$__interval|\$\{__rate_interval\}", window, t["expr"])
            out.append((p.get("title", "?"), expr))
    return out


# --- panels over time ----------------------------------------------------------------------------------------


def panel_frames(metrics: PromAPI, panel_list: Sequence[Panel], start: float, end: float, window: str,
                 step_s: float = 1.0) -> dict[str, pd.DataFrame]:
    """Range-query every panel over [start, end] (unix seconds): {panel key: long frame}. A failing expression
    raises :class:`~lab_utils.monitoring.prometheus.QueryError` naming it."""
    return {p.key: metrics.query_range(p.expression(window), start, end, step_s) for p in panel_list}


_PHASE_COLORS = {"ramp": "#dbeafe", "steady": "#dcfce7", "overload": "#fee2e2"}


def plot_panels(frames: Mapping[str, pd.DataFrame], panel_list: Sequence[Panel], *, t0: float,
                phases: pd.DataFrame | None = None, ncols: int = 3, title: str = "") -> Figure:
    """A grid of the panels' range queries (seconds since ``t0`` on x), load phases (``start``, ``end``,
    ``phase`` columns) shaded."""
    import matplotlib.pyplot as plt

    n = len(panel_list)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.6 * nrows), squeeze=False)
    for ax, p in zip(axes.flat, panel_list, strict=False):
        df = frames.get(p.key)
        if phases is not None:
            for r in phases.itertuples():
                ax.axvspan(r.start - t0, r.end - t0, color=_PHASE_COLORS.get(r.phase, "#eeeeee"), lw=0)
        if df is not None and not df.empty:
            by = [c for c in ("model", "gpu", "job") if c in df.columns]
            wide = pivot(df, by[0] if by else None)
            for col in wide.columns:
                ax.plot(wide.index - t0, wide[col], label=str(col), lw=1.3)
            if len(wide.columns) > 1:
                ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(p.title, fontsize=9)
        ax.set_ylabel(p.unit, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# --- quantiles cannot be averaged ---------------------------------------------------------------------------


def quantile_of_parts(latencies_ms: Sequence[Sequence[float]], q: float = 0.99) -> dict[str, float]:
    """The q-quantile of all latencies together against the mean of each part's q-quantile (why a dashboard
    must not average p99s across instances or time windows). Values in the latencies' unit (ms)."""
    import numpy as np

    parts = [np.asarray(p, dtype=float) for p in latencies_ms if len(p)]
    if not parts:
        raise ValueError("no latencies given")
    pooled = float(np.quantile(np.concatenate(parts), q))
    mean_of = float(np.mean([np.quantile(p, q) for p in parts]))
    return {"pooled": pooled, "mean_of_parts": mean_of, "max_of_parts": float(max(np.quantile(p, q) for p in parts))}


# --- Triton's GPU readings (DCGM) against the exporter's (NVML) ---------------------------------------------

# (what, Triton's expression, the exporter's expression), each averaged over the window; the last row is a
# diagnostic: NVML's v1 "used" included driver-reserved memory, so if Triton's DCGM counts it, that row agrees.
SOURCE_PAIRS = (
    ("memory_used_bytes", "avg_over_time(nv_gpu_memory_used_bytes[{w}])",
     "avg_over_time(DCGM_FI_DEV_FB_USED[{w}]) * 1048576"),
    ("power_w", "avg_over_time(nv_gpu_power_usage[{w}])", "avg_over_time(DCGM_FI_DEV_POWER_USAGE[{w}])"),
    ("memory_used_plus_reserved_bytes", "avg_over_time(nv_gpu_memory_used_bytes[{w}])",
     "(avg_over_time(DCGM_FI_DEV_FB_USED[{w}]) + avg_over_time(DCGM_FI_DEV_FB_RESERVED[{w}])) * 1048576"),
)


def compare_gpu_sources(metrics: PromAPI, at: float, window_s: float, tolerance: float = 0.10) -> pd.DataFrame:
    """Triton's ``nv_gpu_*`` against the exporter's ``DCGM_FI_DEV_*`` per GPU (matched by UUID), averaged over
    the ``window_s`` seconds before ``at`` (unix seconds): one row per (metric, GPU) with both values, their
    ratio and whether it is within ``tolerance``. Empty when either source has no GPU series."""
    w = f"{max(2, int(round(window_s)))}s"
    rows = []
    for what, triton_expr, exporter_expr in SOURCE_PAIRS:
        a = metrics.query(triton_expr.format(w=w), at=at)
        b = metrics.query(exporter_expr.format(w=w), at=at)
        if a.empty or b.empty or "gpu_uuid" not in a or "UUID" not in b:
            continue
        both = a[["gpu_uuid", "value"]].rename(columns={"gpu_uuid": "uuid", "value": "triton"}).merge(
            b[["UUID", "value"]].rename(columns={"UUID": "uuid", "value": "exporter"}), on="uuid")
        for r in both.itertuples():
            ratio = r.triton / r.exporter if r.exporter else math.nan
            rows.append({"metric": what, "uuid": r.uuid, "triton": r.triton, "exporter": r.exporter, "ratio": ratio,
                         "within": bool(abs(ratio - 1) <= tolerance)})
    return pd.DataFrame(rows, columns=["metric", "uuid", "triton", "exporter", "ratio", "within"])
