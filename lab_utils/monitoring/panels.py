"""Lab 05's panels: one list of PromQL expressions for the notebook's plots and the Grafana dashboard, the
dashboard generated from it (each panel with a description of what it measures), range queries per panel, and
lessons about reading them: quantiles cannot be averaged; Triton's GPU readings against the exporter's; and GPU
utilization is not SM activity (:func:`gpu_utilization_demo`).

``PANELS`` / ``panels(gpu)`` are the list; ``dashboard_text()`` writes ``DASHBOARD_FILE``; ``panel_frames`` and
``plot_panels`` query and draw them; ``quantile_of_parts`` and ``compare_gpu_sources`` are the lessons' numbers.

Design notes: docs/internals.md#lab_utilsmonitoringpanelspy"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from lab_utils.course.probe import nvml_text
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
    profiling: bool = False  # a DCGM profiling field: only dcgm-exporter serves it, not the course's NVML exporter
    description: str = ""  # what the panel measures (Grafana shows it in the panel's tooltip)

    def expression(self, window: str = "1m") -> str:
        """The expression with its rate window set (``"5s"``, ``"1m"``, Grafana's ``"$__rate_interval"``)."""
        return self.expr.replace("{w}", window)


PANELS: tuple[Panel, ...] = (
    Panel("qps", "Throughput (requests/s)", "sum by (model) (rate(nv_inference_request_success[{w}]))", "req/s",
          description="Successful requests per second of each model, summed over servers and versions."),
    Panel("batch", "Average batch size (inferences per execution)",
          "sum by (model) (rate(nv_inference_count[{w}])) / sum by (model) (rate(nv_inference_exec_count[{w}]))",
          "inferences", description="Inferences (batch items) per model execution: how full the dynamic batcher's "
                                    "batches are."),
    Panel("latency", "Average request latency (ms)",
          "sum by (model) (rate(nv_inference_request_duration_us[{w}])) "
          "/ sum by (model) (rate(nv_inference_request_success[{w}])) / 1000", "ms",
          description="Server-side time per request (queue + compute), averaged over the window; Triton counts it "
                      "in microseconds."),
    Panel("queue_share", "Share of request time spent queued",
          "sum by (model) (rate(nv_inference_queue_duration_us[{w}])) "
          "/ sum by (model) (rate(nv_inference_request_duration_us[{w}]))", "fraction",
          description="Queue time over request time: near 1, requests wait for a free instance rather than compute."),
    Panel("p99", "p99 latency from Triton's summary (ms)",
          'max by (model) (nv_inference_request_summary_us{quantile="0.99"}) / 1000', "ms",
          description="Triton's own p99 over its recent requests (a summary: the worst server is shown, because "
                      "quantiles cannot be averaged)."),
    Panel("pending", "Pending requests (queued, not yet executing)",
          "sum by (model) (nv_inference_pending_request_count)", "requests",
          description="Requests waiting in the server's queues now (a gauge)."),
    Panel("gpu_util", "GPU utilization: time a kernel ran (%)", "DCGM_FI_DEV_GPU_UTIL", "%", "GPU {{gpu}}",
          needs_gpu=True, description=(
              "DCGM_FI_DEV_GPU_UTIL (nvidia-smi's utilization): the share of the last sample period in which any "
              "kernel was running. It is not how busy the SMs are: one small kernel always running on one SM reads "
              "100 %. For that, see SM activity (DCGM_FI_PROF_SM_ACTIVE).")),
    Panel("sm_active", "SM activity (%)", "DCGM_FI_PROF_SM_ACTIVE * 100", "%", "GPU {{gpu}}", needs_gpu=True,
          profiling=True, description=(
              "DCGM_FI_PROF_SM_ACTIVE: the share of cycles in which an SM had at least one warp resident, averaged "
              "over all SMs. A profiling field: NVIDIA's dcgm-exporter serves it (the compose stack's dcgm profile, "
              "with a counters file that lists it); the course's NVML exporter does not, so without dcgm-exporter "
              "this panel is empty.")),
    Panel("tensor_active", "Tensor-core pipes busy (%)", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE * 100", "%",
          "GPU {{gpu}}", needs_gpu=True, profiling=True, description=(
              "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE: the share of cycles the tensor-core pipes were busy. Low while the "
              "SMs are busy means the math is not on the tensor cores (FP32, or shapes they do not take). A "
              "profiling field: dcgm-exporter only (the compose stack's dcgm profile), not the course's NVML "
              "exporter.")),
    Panel("gpu_memory", "GPU memory used (GiB)", "DCGM_FI_DEV_FB_USED / 1024", "GiB", "GPU {{gpu}}", needs_gpu=True,
          description="Device memory allocated (DCGM_FI_DEV_FB_USED is in MiB; driver-reserved memory excluded)."),
    Panel("gpu_power", "GPU power (W)", "DCGM_FI_DEV_POWER_USAGE", "W", "GPU {{gpu}}", needs_gpu=True,
          description="Power drawn. With GPU utilization at 100 %, a draw near idle says the GPU is doing little."),
    Panel("host_cpu", "Host CPU busy (%)", "nvlab_host_cpu_utilization_percent", "%", "host", host_only=True,
          description="All CPUs of the host, busy share since the previous scrape (the CPU tier's stand-in)."),
    Panel("host_memory", "Host memory used (GiB)", "nvlab_host_memory_used_bytes / 2^30", "GiB", "host",
          host_only=True, description="MemTotal - MemAvailable, as `free` counts used memory."),
    Panel("up", "Targets up (1) or down (0)", "up", "", "{{job}}",
          description="1 when Prometheus' last scrape of the target succeeded, 0 when it failed."))


def panels(gpu: bool, profiling: bool = False) -> list[Panel]:
    """The notebook's panels: GPU panels with a GPU, the host's in their place without one; the DCGM profiling
    panels only when ``profiling`` (a dcgm-exporter is scraped: the course's NVML exporter has no such field)."""
    return [p for p in PANELS if ((p.needs_gpu and gpu) or (p.host_only and not gpu) or
                                  not (p.needs_gpu or p.host_only)) and (profiling or not p.profiling)]


def panel(key: str, among: Sequence[Panel] = PANELS) -> Panel:
    """The panel named ``key`` ("qps", "p99", ...) of ``among``."""
    if (found := next((p for p in among if p.key == key), None)) is None:
        raise KeyError(f"no panel {key!r}; the panels are {[p.key for p in among]}")
    return found


# --- the Grafana dashboard -------------------------------------------------------------------------------

GRAFANA_UNITS = {"req/s": "reqps", "ms": "ms", "fraction": "percentunit", "%": "percent", "GiB": "decgbytes",
                 "W": "watt"}


def grafana_dashboard(panel_list: Sequence[Panel], title: str, uid: str, tags: list[str],
                      window: str = "$__rate_interval") -> str:
    """A Grafana dashboard file's text (JSON model) of ``panel_list``, three panels a row, the notebook's queries."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    out = [{"id": i + 1, "type": "timeseries", "title": p.title, "datasource": ds,
            **({"description": p.description} if p.description else {}),
            "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": (i // 3) * 8},
            "fieldConfig": {"defaults": {"unit": GRAFANA_UNITS.get(p.unit, "short")}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": "A", "datasource": ds, "expr": p.expression(window), "legendFormat": p.legend}]}
           for i, p in enumerate(panel_list)]
    return json.dumps({"title": title, "uid": uid, "tags": tags, "timezone": "browser", "schemaVersion": 39,
                       "version": 1, "refresh": "5s", "time": {"from": "now-15m", "to": "now"},
                       "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                                "label": "Prometheus", "current": {}, "hide": 0}]},
                       "annotations": {"list": []}, "panels": out}, indent=2) + "\n"


def dashboard_text(window: str = "$__rate_interval") -> str:
    """The Grafana dashboard built from :data:`PANELS`, as the dashboard file's text (``DASHBOARD_FILE`` holds it,
    generated)."""
    return grafana_dashboard(PANELS, "Triton and GPU (nvlab lab 05)", "nvlab-triton-gpu", ["nvlab", "triton", "gpu"],
                             window)


def dashboard_expressions(path: str | Path = DASHBOARD_FILE, window: str = "5s") -> list[tuple[str, str]]:
    """(title, expression) of every query in a dashboard file, Grafana's ``$__rate_interval`` set to ``window``."""
    return [(p.get("title", "?"), re.sub(r"\$__rate_interval|\$__interval|\$\{__rate_interval\}", window, t["expr"]))
            for p in json.loads(Path(path).read_text()).get("panels", []) for t in p.get("targets", [])]


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
    if not (parts := [np.asarray(p, dtype=float) for p in latencies_ms if len(p)]):
        raise ValueError("no latencies given")
    per_part = [np.quantile(p, q) for p in parts]
    return {"pooled": float(np.quantile(np.concatenate(parts), q)), "mean_of_parts": float(np.mean(per_part)),
            "max_of_parts": float(max(per_part))}


# --- Triton's GPU readings (DCGM) against the exporter's (NVML) ---------------------------------------------

# (what, Triton's expression, the exporter's expression), each averaged over the window; the last row is a
# diagnostic: NVML's v1 "used" included driver-reserved memory, so if Triton's DCGM counts it, that row agrees.
SOURCE_PAIRS = (("memory_used_bytes", "avg_over_time(nv_gpu_memory_used_bytes[{w}])",
                 "avg_over_time(DCGM_FI_DEV_FB_USED[{w}]) * 1048576"),
                ("power_w", "avg_over_time(nv_gpu_power_usage[{w}])", "avg_over_time(DCGM_FI_DEV_POWER_USAGE[{w}])"),
                ("memory_used_plus_reserved_bytes", "avg_over_time(nv_gpu_memory_used_bytes[{w}])",
                 "(avg_over_time(DCGM_FI_DEV_FB_USED[{w}]) + avg_over_time(DCGM_FI_DEV_FB_RESERVED[{w}])) * 1048576"))


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


# --- GPU utilization is not SM activity -----------------------------------------------------------------------

DEMO_SECONDS = 1.5  # each load runs this long: longer than NVML's utilization sample period (at most 1 s)


def _nvml_handle(nvml: Any, torch: Any, device: int) -> Any:
    """The NVML handle of torch's ``cuda:device`` (matched by UUID where torch tells it; CUDA_VISIBLE_DEVICES may
    renumber the GPUs)."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        theirs = nvml_text(nvml.nvmlDeviceGetUUID(h))
        if uuid and theirs.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            return h
    return nvml.nvmlDeviceGetHandleByIndex(device)


class _Gpm:
    """NVML's GPU Performance Monitoring (Hopper and newer): SM and tensor activity between two samples, the
    counterparts of DCGM_FI_PROF_SM_ACTIVE and DCGM_FI_PROF_PIPE_TENSOR_ACTIVE. ``why`` says why not, where not."""

    def __init__(self, nvml: Any, handle: Any):
        self.nvml, self.handle, self.why, self._first = nvml, handle, "", None
        try:
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                self.why = "this GPU has no GPM (NVML's GPM metrics start with Hopper)"
        except Exception as err:  # an older driver or nvidia-ml-py: no GPM
            self.why = f"NVML GPM not available ({type(err).__name__}: {err})"

    def start(self) -> None:
        if self.why:
            return
        try:
            self._first = self.nvml.nvmlGpmSampleAlloc()
            self.nvml.nvmlGpmSampleGet(self.handle, self._first)
        except Exception as err:
            self.why, self._first = f"NVML GPM sample failed ({type(err).__name__}: {err})", None

    def read(self) -> dict[str, float]:
        """{"sm_active_pct", "tensor_active_pct"} since ``start()``; NaN where GPM is not available."""
        out = {"sm_active_pct": math.nan, "tensor_active_pct": math.nan}
        if self.why or self._first is None:
            return out
        nvml, second = self.nvml, None
        try:
            second = nvml.nvmlGpmSampleAlloc()
            nvml.nvmlGpmSampleGet(self.handle, second)
            get = nvml.c_nvmlGpmMetricsGet_t()
            get.version = nvml.NVML_GPM_METRICS_GET_VERSION
            get.numMetrics = 2
            get.sample1, get.sample2 = self._first, second
            get.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
            get.metrics[1].metricId = nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
            nvml.nvmlGpmMetricsGet(get)
            for i, key in enumerate(("sm_active_pct", "tensor_active_pct")):
                if get.metrics[i].nvmlReturn == 0:
                    out[key] = float(get.metrics[i].value)
        except Exception as err:
            self.why = f"NVML GPM read failed ({type(err).__name__}: {err})"
        finally:
            for sample in (self._first, second):
                if sample is not None:
                    with contextlib.suppress(Exception):
                        nvml.nvmlGpmSampleFree(sample)
            self._first = None
        return out


def gpu_utilization_demo(seconds: float = DEMO_SECONDS, device: int = 0, *, nvml: Any = None,
                         torch: Any = None) -> tuple[pd.DataFrame, str]:
    """GPU only. Three loads on ``cuda:device``, ``seconds`` each, and what NVML reads for each: idle; one thread
    block spinning on one SM (``torch.cuda._sleep``, back to back); 8192² bf16 matmuls back to back on every SM.

    Columns: the SMs the load can occupy, ``gpu_util_pct`` (NVML's utilization.gpu, which the exporter serves as
    DCGM_FI_DEV_GPU_UTIL), ``power_w``, and where NVML has GPM (Hopper and newer) ``sm_active_pct`` and
    ``tensor_active_pct`` over the same seconds (NaN elsewhere). Returns the frame and a note on GPM (empty when
    it was read). ``nvml`` and ``torch`` are the modules (``pynvml``, ``torch``) unless given."""
    if nvml is None:
        import pynvml as nvml
    if torch is None:
        import torch
    nvml.nvmlInit()
    try:
        handle = _nvml_handle(nvml, torch, device)
        sms = int(torch.cuda.get_device_properties(device).multi_processor_count)
        clock_hz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6
        spin_cycles = int(0.02 * clock_hz)  # one spin kernel lasts about 20 ms
        gpm = _Gpm(nvml, handle)
        dev = f"cuda:{device}"
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)  # random inputs: zeros run unrealistically
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        c = torch.empty(8192, 8192, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize(device)
        pause = threading.Event()
        loads = (("idle", 0, lambda: pause.wait(0.05)),
                 ("one thread block spinning on one SM", 1, lambda: torch.cuda._sleep(spin_cycles)),
                 ("bf16 matmul 8192x8192, back to back", sms, lambda: torch.mm(a, b, out=c)))
        rows = []
        for name, used, step in loads:
            gpm.start()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                step()
                torch.cuda.synchronize(device)  # a short gap between kernels: the GPU is never left idle long
            util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu  # the last sample period: all of it this load
            power_w = nvml.nvmlDeviceGetPowerUsage(handle) / 1000
            rows.append({"load": name, "SMs it can occupy": f"{used} of {sms}", "gpu_util_pct": float(util),
                         "power_w": round(power_w, 1), **gpm.read()})
        return pd.DataFrame(rows).set_index("load"), gpm.why
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
