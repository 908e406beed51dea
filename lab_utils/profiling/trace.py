"""Reading a torch.profiler Chrome/Perfetto trace: events as a table, summaries, busy fraction, a timeline plot.

The trace is what ``prof.export_chrome_trace(path)`` writes: ``{"traceEvents": [...]}``, each complete event
(``"ph": "X"``) with a category (``cat``: ``kernel``, ``gpu_memcpy``, ``cuda_runtime``, ``cpu_op``,
``user_annotation`` …), a start ``ts`` and a duration ``dur`` in microseconds. Nothing here runs the profiler:
the lab's student writes that part."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from lab_utils.plotting import new_axes

__all__ = ["STEP_PREFIX", "load_trace", "events", "step_window", "kernel_intervals", "union_us", "busy_fraction",
           "summarize", "top_ops", "trim_trace", "plot_timeline"]

STEP_PREFIX = "ProfilerStep#"  # torch.profiler's annotation around each step of a schedule's active phase
# Categories of device work: kernels and copies/memsets the GPU executes.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Host calls that wait for the device (a sync point: the CPU cannot queue work ahead while in one).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cudaMemcpy")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
DATA_PREFIX = "enumerate(DataLoader)"  # torch.profiler's annotation around each `next()` of a DataLoader


def load_trace(path: str | Path) -> dict[str, Any]:
    """The trace at ``path`` (``.json`` or ``.json.gz``) as a dict with ``traceEvents``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"load_trace({str(path)!r}): no such file; export one with "
                                "prof.export_chrome_trace(path) inside or after the `with profile(...)` block")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        try:
            trace = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"load_trace({str(path)!r}): not JSON ({err}); was the export interrupted?") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"load_trace({str(path)!r}): no 'traceEvents' list: not a Chrome trace from torch.profiler")
    return trace


def _event_list(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if isinstance(trace, Mapping):
        ev = trace.get("traceEvents")
        if not isinstance(ev, list):
            raise ValueError("trace has no 'traceEvents' list: pass load_trace(path)")
        return ev
    return list(trace)


def events(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Complete events (``ph == "X"``) as a table: name, cat, ts_us, dur_us, end_us, pid, tid."""
    rows = [{"name": e.get("name", ""), "cat": e.get("cat", ""), "ts_us": float(e["ts"]), "dur_us": float(e["dur"]),
             "pid": e.get("pid"), "tid": e.get("tid")} for e in _event_list(trace)
            if e.get("ph") == "X" and "ts" in e and "dur" in e]
    df = pd.DataFrame(rows, columns=["name", "cat", "ts_us", "dur_us", "pid", "tid"])
    df["end_us"] = df["ts_us"] + df["dur_us"]
    return df.sort_values("ts_us", kind="stable").reset_index(drop=True)


def step_window(df: pd.DataFrame) -> tuple[float, float]:
    """The steps' wall time (µs): from the first ``ProfilerStep#`` start to the later of the last step's end
    and the last device event's end (GPU work can finish after the host has moved on)."""
    steps = df[(df["cat"] == "user_annotation") & df["name"].str.startswith(STEP_PREFIX)]
    if steps.empty:
        raise ValueError("the trace has no ProfilerStep# annotations: profile with a schedule and call prof.step() "
                         "after each step")
    t0, t1 = float(steps["ts_us"].min()), float(steps["end_us"].max())
    dev = df[df["cat"].isin(DEVICE_CATS) & (df["ts_us"] >= t0)]
    if not dev.empty:
        t1 = max(t1, float(dev["end_us"].max()))
    return t0, t1


def kernel_intervals(df: pd.DataFrame, cats: Iterable[str] = ("kernel",)) -> list[tuple[float, float]]:
    """(start, end) in µs of every event of ``cats`` (default: kernels), in start order."""
    sel = df[df["cat"].isin(tuple(cats))]
    return list(zip(sel["ts_us"].tolist(), sel["end_us"].tolist(), strict=True))


def union_us(intervals: Iterable[tuple[float, float]], window: tuple[float, float] | None = None) -> float:
    """Length (µs) of the union of intervals, clipped to ``window``: overlapping kernels count once."""
    lo_w, hi_w = window if window is not None else (float("-inf"), float("inf"))
    total, covered = 0.0, float("-inf")  # covered: the end of the union so far
    for s, e in sorted(intervals):  # by start: each adds only its part past what is covered
        s, e = max(s, lo_w, covered), min(e, hi_w)
        if e > s:
            total, covered = total + (e - s), e
    return total


def busy_fraction(trace: Mapping[str, Any] | pd.DataFrame, cats: Iterable[str] = ("kernel",)) -> float | None:
    """Fraction of the steps' wall time with at least one kernel running (None: the trace has no kernels)."""
    df = trace if isinstance(trace, pd.DataFrame) else events(trace)
    if not (iv := kernel_intervals(df, cats)):
        return None
    t0, t1 = step_window(df)
    return union_us(iv, (t0, t1)) / (t1 - t0)


def top_ops(df: pd.DataFrame, cat: str, n: int = 10) -> pd.DataFrame:
    """The ``n`` names of category ``cat`` with the most total time: calls, total and mean µs, share of the cat."""
    sel = df[df["cat"] == cat]
    if sel.empty:
        return pd.DataFrame(columns=["name", "calls", "total_us", "mean_us", "share"])
    g = sel.groupby("name")["dur_us"].agg(calls="count", total_us="sum", mean_us="mean").reset_index()
    g["share"] = g["total_us"] / g["total_us"].sum()
    g["name"] = g["name"].str.slice(0, 90)  # templated kernel names run to hundreds of characters
    return g.sort_values("total_us", ascending=False).head(n).reset_index(drop=True)


def summarize(trace: Mapping[str, Any] | pd.DataFrame) -> dict[str, Any]:
    """What a trace says about the steps it holds (times in ms per step, counts per step).

    ``gpu_busy``: kernel time union / wall time (None without kernels); ``data_wait``: the DataLoader's
    ``next()`` share of the wall time; ``syncs``: host calls that wait for the device (+ ``.item()``-like ops);
    ``launches``: kernel launches; ``kernel_us``: mean kernel duration."""
    df = trace if isinstance(trace, pd.DataFrame) else events(trace)
    t0, t1 = step_window(df)
    in_win = df[(df["ts_us"] >= t0) & (df["ts_us"] < t1)]
    steps = int(((df["cat"] == "user_annotation") & df["name"].str.startswith(STEP_PREFIX)).sum())
    wall = t1 - t0
    kernels = in_win[in_win["cat"] == "kernel"]
    data = in_win[in_win["name"].str.startswith(DATA_PREFIX)]
    runtime = in_win[in_win["cat"].isin(("cuda_runtime", "cuda_driver"))]
    syncs = int(runtime["name"].isin(SYNC_CALLS).sum()) if not runtime.empty else 0
    syncs += int(in_win["name"].isin(SYNC_OPS).sum()) if runtime.empty else 0  # CPU-only: count the ops
    busy = busy_fraction(df)
    names = " ".join(kernels["name"].unique().tolist()).lower()
    return {"steps": steps, "step_ms": wall / max(steps, 1) / 1e3, "gpu_busy": busy,
            "data_wait": union_us(zip(data["ts_us"], data["end_us"], strict=True), (t0, t1)) / wall,
            "syncs_per_step": syncs / max(steps, 1),
            "launches_per_step": int(runtime["name"].isin(LAUNCH_CALLS).sum()) / max(steps, 1),
            "kernels_per_step": len(kernels) / max(steps, 1),
            "kernel_us": float(kernels["dur_us"].mean()) if len(kernels) else None,
            "half_precision_kernels": any(k in names for k in ("bf16", "f16", "half", "h16", "bfloat"))}


def trim_trace(trace: Mapping[str, Any], keep_cats: Sequence[str] = (*DEVICE_CATS, "user_annotation",
                                                                     "gpu_user_annotation")) -> dict[str, Any]:
    """A smaller trace holding only the events of ``keep_cats`` (kernels and step annotations by default):
    enough for the busy fraction, small enough to commit."""
    keep = [{k: e[k] for k in ("ph", "cat", "name", "ts", "dur", "pid", "tid") if k in e} for e in _event_list(trace)
            if e.get("ph") == "X" and e.get("cat") in keep_cats]
    return {"traceEvents": keep}


def plot_timeline(trace: Mapping[str, Any] | pd.DataFrame, step: int | None = None, ax: Any = None,
                  title: str | None = None) -> Any:
    """Gantt view of one step (the second of the trace by default): host annotations and ops, CUDA runtime
    calls, and each GPU stream's kernels and copies, on one time axis in ms."""
    df = trace if isinstance(trace, pd.DataFrame) else events(trace)
    steps = df[(df["cat"] == "user_annotation") & df["name"].str.startswith(STEP_PREFIX)].reset_index(drop=True)
    if steps.empty:
        raise ValueError("plot_timeline: the trace has no ProfilerStep# annotations")
    i = (1 if len(steps) > 1 else 0) if step is None else step
    if not 0 <= i < len(steps):
        raise ValueError(f"plot_timeline(step={step}): the trace holds steps 0..{len(steps) - 1}")
    t0 = float(steps.loc[i, "ts_us"])
    t1 = float(steps.loc[i, "end_us"])
    dev_after = df[df["cat"].isin(DEVICE_CATS) & (df["ts_us"] >= t0) & (df["ts_us"] < t1)]
    t1 = max(t1, float(dev_after["end_us"].max())) if not dev_after.empty else t1
    win = df[(df["end_us"] > t0) & (df["ts_us"] < t1)]
    lanes: list[tuple[str, pd.DataFrame, str]] = []
    host = win[win["cat"].isin(("user_annotation", "cpu_op", "python_function"))]
    main_tid = steps.loc[i, "tid"]
    lanes.append(("host: annotations", host[(host["cat"] == "user_annotation") & (host["tid"] == main_tid)], "C0"))
    lanes.append(("host: ops", host[(host["cat"] == "cpu_op") & (host["tid"] == main_tid)], "C1"))
    others = host[host["tid"] != main_tid]
    if not others.empty:
        lanes.append(("host: other threads", others, "C7"))
    rt = win[win["cat"].isin(("cuda_runtime", "cuda_driver"))]
    if not rt.empty:
        lanes.append(("CUDA runtime", rt, "C2"))
    dev = win[win["cat"].isin(DEVICE_CATS)]
    for tid, g in dev.groupby("tid"):
        lanes.append((f"GPU stream {tid}", g, "C3"))
    _, ax = new_axes(ax, (11, 0.55 * len(lanes) + 1.2))
    for y, (_label, g, color) in enumerate(lanes):
        bars = [((s - t0) / 1e3, max(d, 0.5) / 1e3) for s, d in zip(g["ts_us"], g["dur_us"], strict=True)]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, edgecolor="none", alpha=0.8)
    ax.set_yticks(range(len(lanes)), [lane[0] for lane in lanes])
    ax.set(ylim=(len(lanes) - 0.5, -0.5), xlim=(0, (t1 - t0) / 1e3), xlabel="ms from the start of the step",
           title=title or f"{steps.loc[i, 'name']}: {(t1 - t0) / 1e3:.2f} ms")
    ax.grid(axis="x", alpha=0.3)
    return ax
