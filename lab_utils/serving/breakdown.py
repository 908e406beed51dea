"""Where a request's time goes in lab 07's service: Triton's statistics per step model (queue, compute input,
infer, output, batch size, summed over the servers) and the CPU each kind of process used, at a few offered rates,
beside what the client saw (p95, and how late it sent: a client that sends late measures itself, not the service).

``where_time_goes(svc, target, rates)`` runs the open loop at each rate between two ``snapshot``s, which ``split``
and ``cpu_cores`` turn into ms per request and cores; ``plot_split`` draws them. Units: ``_ms``, ``_s``, ``_rps``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import psutil

from lab_utils.plotting import new_axes
from lab_utils.serving import load
from lab_utils.serving.client import STAGES, model_stats, server_split, sum_stats

CPU_GROUPS = ("triton", "python stubs", "nginx", "client")  # what the CPU time is split into


@dataclass
class Snapshot:
    """The service's counters at one moment: statistics per model (summed over servers) and CPU seconds per
    process group."""

    t_s: float
    stats: dict[str, dict[str, Any]]
    cpu_s: dict[str, float] = field(default_factory=dict)


def _cpu_s(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        # gone since it was listed: its time is lost, not wrong
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _groups(svc: Any) -> dict[str, list[psutil.Process]]:
    """The service's processes by kind: each Triton server, its python-backend stubs (its children), nginx's
    master and workers, and this process (the client)."""
    groups: dict[str, list[psutil.Process]] = {g: [] for g in CPU_GROUPS}
    for s in svc.servers:
        if s.pid is None:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(s.pid)
            groups["triton"].append(root)
            groups["python stubs"] += root.children(recursive=True)
    if svc.lb is not None and svc.lb.pid is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            master = psutil.Process(svc.lb.pid)
            groups["nginx"] = [master, *master.children()]
    groups["client"] = [psutil.Process(os.getpid())]
    return groups


def snapshot(svc: Any, models: Sequence[str] | None = None) -> Snapshot:
    """The statistics API's counters of every model of ``svc.repo`` (or ``models``) on every server, and CPU
    seconds per group."""
    stats = {model: sum_stats([model_stats(s.http_url, model) for s in svc.servers])
             for model in (svc.repo.models if models is None else models)}
    return Snapshot(time.monotonic(), stats, {g: _cpu_s(p) for g, p in _groups(svc).items()})


def split(before: Snapshot, after: Snapshot) -> pd.DataFrame:
    """Per model, between two snapshots: requests, average batch, and milliseconds per request in each stage and
    in all (``request_ms``: Triton's whole time for the request, the ensemble's including its steps')."""
    splits = {model: server_split(before.stats[model], after.stats[model]) for model in after.stats}
    return pd.DataFrame([{"model": model, "requests": int(s["requests"]), "batch_avg": s["batch_avg"],
                          **{f"{k}_ms": s[f"{k}_us"] / 1e3 for k in STAGES}, "request_ms": s["request_us"] / 1e3}
                         for model, s in splits.items()]).set_index("model")


def cpu_cores(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU cores each process group used on average between two snapshots."""
    wall = max(after.t_s - before.t_s, 1e-9)
    return {g: (after.cpu_s.get(g, 0.0) - before.cpu_s.get(g, 0.0)) / wall for g in after.cpu_s}


def where_time_goes(svc: Any, target: Any, rates_rps: Sequence[float], *, duration_s: float = 5.0,
                    warmup_s: float = 1.0, timeout_s: float = 10.0, processes: int | None = 1,
                    models: Sequence[str] | None = None) -> pd.DataFrame:
    """The open loop at each offered rate through ``target``, between two snapshots: one row per (rate, model)
    with the stages in ms per request, the batch, the CPU cores per group, and the client's p95 and send lag.
    ``processes``: client processes (``load.run_open_loop``; their CPU is not in ``cpu_client_cores``);
    ``models``: the models to read (default ``svc.repo``'s; another service in the same servers: its ``models``)."""
    if not rates_rps or any(not (isinstance(r, (int, float)) and r > 0) for r in rates_rps):
        raise ValueError(f"rates_rps={rates_rps!r}: give one or more offered rates > 0 (requests/s)")
    rows = []
    for rate in rates_rps:
        if warmup_s > 0:  # the queues and batches of this rate, before the counters are read
            load.run_open_loop(target, rate, warmup_s, warmup_s=0.0, timeout_s=timeout_s, processes=processes)
        before = snapshot(svc, models)
        res = load.run_open_loop(target, rate, duration_s, warmup_s=0.0, timeout_s=timeout_s, processes=processes)
        after = snapshot(svc, models)
        cores = cpu_cores(before, after)
        for model, r in split(before, after).iterrows():
            rows.append({"offered_rps": rate, "model": model, **r.to_dict(),
                         **{f"cpu_{g.replace(' ', '_')}_cores": c for g, c in cores.items()},
                         "answered_rps": res.achieved_rps, "client_p95_ms": res.p95_ms,
                         "send_lag_p99_ms": res.send_lag_p99_ms, "errors": res.errors})
    return pd.DataFrame(rows)


def plot_split(df: pd.DataFrame, ax: Any = None, title: str | None = None) -> Any:
    """Stacked bars, one per (rate, model): milliseconds per request in each of Triton's stages (the ensemble's bar
    is its whole request, its steps' included)."""
    _, ax = new_axes(ax, (9, 3.5))
    steps = df[df["batch_avg"].notna()]
    labels = [f"{r:g}/s\n{m}" for r, m in zip(steps["offered_rps"], steps["model"], strict=True)]
    bottom = None
    for stage in STAGES:
        values = steps[f"{stage}_ms"].to_numpy()
        ax.bar(labels, values, bottom=bottom, label=stage.replace("_", " "))
        bottom = values if bottom is None else bottom + values
    ax.set_ylabel("ms per request")
    ax.set_title(title or "Where a request's time goes, per step model and offered rate")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    return ax
