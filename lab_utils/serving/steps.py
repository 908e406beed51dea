"""Lab 04's steps as single calls: deploy a configuration, measure it, compare it with the step before, plot.

Each function takes the server (a ``TritonServer`` or ``ExternalServer``) and returns plain values or a
DataFrame, so a notebook cell is one call and one table.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.plotting import new_axes
from lab_utils.procs import wait_until
from lab_utils.serving import client as triton_client
from lab_utils.serving import load as triton_load
from lab_utils.serving import repository as triton_repo
from lab_utils.serving import server as triton_server
from lab_utils.serving.perf_analyzer import PerfAnalyzerResult

REPOSITORY_ENV = "NVLAB_MODEL_REPOSITORY"  # the model repository a running server (TRITON_URL) reads: /models


def model_repository(work: str | os.PathLike[str]) -> Path:
    """Where the lab writes its models: ``work/models`` for a server it starts itself; with ``TRITON_URL`` (the
    compose stack) the folder that server reads, ``$NVLAB_MODEL_REPOSITORY``, since it cannot see ``work``."""
    external = os.environ.get(triton_server.URL_ENV, "").strip()
    if not external:
        return Path(work) / "models"
    shared = os.environ.get(REPOSITORY_ENV, "").strip()
    if not shared:
        raise RuntimeError(
            f"{triton_server.URL_ENV}={external} is set but {REPOSITORY_ENV} is not: that server cannot see models "
            f"written here. Set {REPOSITORY_ENV} to the folder it serves (its --model-repository; /models in the "
            f"course's compose stack), or unset {triton_server.URL_ENV} to start a server of the lab's own.")
    path = Path(shared)
    if not path.is_dir() or not os.access(path, os.W_OK):
        raise RuntimeError(f"{REPOSITORY_ENV}={shared} is not a writable folder: mount the server's model "
                           f"repository there (the compose stack mounts the shared volume at /models)")
    return path


def serving_config(config: Mapping[str, Any], server: triton_server.Server) -> dict[str, Any]:
    """The configuration to deploy on ``server``: as given for a server the lab started; for an external (NGC)
    server, whose Python has neither ONNX Runtime nor torch for the python-backend model, the same model through
    Triton's ONNX Runtime backend (``platform: onnxruntime_onnx``, the ``model.onnx`` each version folder holds)."""
    values = dict(config)
    if getattr(server, "external", False) and values.get("backend") == "python":
        values.pop("backend")
        values.pop("parameters", None)  # the python model's own knobs (engine, threads, service time)
        values["platform"] = "onnxruntime_onnx"
    return values


@dataclass
class LoadSettings:
    """How long each measurement runs: windows until three agree within 10 % (perf_analyzer's rule).

    ``extensions``: when a measurement ends without three agreeing windows, it is repeated up to this many times
    with windows twice as long each time (longer windows average out what made them disagree), as one raises
    perf_analyzer's ``--measurement-interval``. Quick runs take none: they say "NOT stable" instead.
    """

    window_s: float = 2.0
    warmup_s: float = 1.0
    max_windows: int = 10
    processes: int | None = None
    extensions: int = 0
    extension_windows: int = 6  # at most this many (longer) windows per extension

    @classmethod
    def for_run(cls, quick: bool, gpu: bool) -> LoadSettings:
        if quick:
            return cls(window_s=0.5, warmup_s=0.3, max_windows=4, extensions=0)
        return cls(window_s=2.0 if gpu else 1.0, warmup_s=1.0, max_windows=10, extensions=1)


def inputs_maker(in_features: int, rows: int = 1, seed: int = 0) -> Callable[[], dict[str, np.ndarray]]:
    """``make_inputs`` for the lab model: one request of ``rows`` random rows of ``in_features`` float32."""
    rng = np.random.default_rng(seed)

    def make() -> dict[str, np.ndarray]:
        return {triton_repo.INPUT_NAME: rng.standard_normal((rows, in_features), dtype=np.float32)}

    return make


def deploy(server: triton_server.Server, repo: Path, config: Mapping[str, Any], *, gpus: int | None = None,
           timeout_s: float = 120) -> float:
    """Write ``config`` as the model's ``config.pbtxt`` (validated first) and (re)load it; seconds the load took.

    A local server in explicit mode re-reads the repository; an external server gets the configuration
    through the load request's override too, and its ONNX Runtime form (``serving_config``); its repository is
    the shared one (``model_repository``).
    """
    triton_server.require_serving(server)  # before anything is written: a stopped lab server says what to run
    config = serving_config(config, server)
    name = config["name"]
    triton_repo.write_config(Path(repo) / name, config, gpus=gpus)
    t0 = time.perf_counter()
    override = None
    if getattr(server, "external", False):
        from google.protobuf import json_format

        override = json.dumps(json_format.MessageToDict(triton_repo.parse_config(config)))
    triton_client.load_model(server.grpc_url, name, config=override)
    if not wait_until(lambda: triton_client.model_ready(server.grpc_url, name), timeout_s):
        raise TimeoutError(f"model {name!r} not ready {timeout_s:g} s after loading; server log:\n"
                           f"{server.log_tail(20)}")
    return time.perf_counter() - t0


def measure(server: triton_server.Server, model: str, make_inputs: Any, concurrency: int, settings: LoadSettings, *,
            protocol: str = "grpc", label: str = "") -> dict[str, Any]:
    """One closed-loop measurement; a row: the client numbers and the server's split.

    Not stable after ``settings.max_windows``: measured again with windows twice as long, up to
    ``settings.extensions`` times. The row says ``stable``, the window length that decided (``window_s``) and
    how many measurements it took (``attempts``); an unstable row is kept, marked, never silently averaged.
    """
    triton_server.require_serving(server)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    window_s, max_windows, attempts = settings.window_s, settings.max_windows, 0
    while True:
        attempts += 1
        r = triton_load.run_load(url, model, make_inputs, concurrency, protocol=protocol, window_s=window_s,
                                 warmup_s=settings.warmup_s, max_windows=max_windows,
                                 processes=settings.processes, stats_url=server.http_url)
        if r.stable or attempts > max(0, settings.extensions):
            break
        window_s, max_windows = window_s * 2, max(3, settings.extension_windows)
    return {"step": label or model, **r.to_row(), "window_s": window_s, "attempts": attempts}


def step_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The knob steps side by side, each against the one before: throughput and p95 change.

    A ratio is computed only between two stable measurements: next to an unstable row it is left empty (NaN),
    since a number that had not settled says nothing about the knob.
    """
    df = pd.DataFrame(rows)
    keep = ["step", "concurrency", "throughput_infer_s", "p50_ms", "p95_ms", "p99_ms", "errors", "stable",
            "server_batch_avg", "server_queue_us", "server_compute_infer_us"]
    df = df[[c for c in keep if c in df.columns]].copy()
    both = df["stable"].astype(bool) & df["stable"].shift(1, fill_value=False).astype(bool) \
        if "stable" in df.columns else pd.Series(True, index=df.index)
    df["x_prev_throughput"] = (df["throughput_infer_s"] / df["throughput_infer_s"].shift(1)).where(both)
    df["x_prev_p95"] = (df["p95_ms"] / df["p95_ms"].shift(1)).where(both)
    return df


@dataclass
class Headline:
    """A ratio between two measurements, or why there is none: ``ratio`` is None unless both were stable."""

    ratio: float | None
    text: str
    stable: bool

    def __str__(self) -> str:
        return self.text


def batching_headline(base: Mapping[str, Any], batched: Mapping[str, Any]) -> Headline:
    """Dynamic batching's throughput over none's, computed only when both measurements were stable.

    An unstable one gives no ratio: the text names which, after how many windows of how long, and what to do.
    """
    unstable = [r for r in (base, batched) if not r.get("stable")]
    if unstable:
        which = "; ".join(f"{r['step']}: {r.get('windows', '?')} windows of {r.get('window_s', float('nan')):g} s "
                          f"did not agree within 10 %" for r in unstable)
        extended = all(r.get("attempts", 1) > 1 for r in unstable)
        todo = ("even with longer windows: something else shares these cores (other processes?); rerun when the "
                "machine is quieter" if extended else
                "rerun with quick=False, which repeats an unsettled measurement with longer windows")
        tputs = f"{base['throughput_infer_s']:,.0f} and {batched['throughput_infer_s']:,.0f} infer/s"
        return Headline(None, f"no ratio: not stable ({which}). The throughputs measured, {tputs}, are in the "
                              "table, but a ratio of numbers that had not settled would be noise presented as a "
                              f"result: {todo}.", False)
    ratio = batched["throughput_infer_s"] / base["throughput_infer_s"]
    return Headline(ratio, f"dynamic batching: {ratio:.2f}x the throughput (both measurements stable), p95 "
                           f"{base['p95_ms']:.2f} -> {batched['p95_ms']:.2f} ms, "
                           f"{batched.get('server_batch_avg', float('nan')):.1f} requests per execution", True)


def perf_analyzer_table(ours: Mapping[str, Any], theirs: PerfAnalyzerResult) -> pd.DataFrame:
    """The course's generator and perf_analyzer on the same configuration: throughput, percentiles, the server's
    split, and theirs over ours."""
    keys = ["concurrency", "throughput_infer_s", "p50_ms", "p95_ms", "p99_ms", "server_queue_us",
            "server_compute_infer_us"]
    pa = theirs.to_row()
    df = pd.DataFrame([{"tool": "course generator (Python, asyncio)", **{k: ours.get(k) for k in keys}},
                       {"tool": "perf_analyzer (C++)", **{k: pa.get(k) for k in keys}}])
    ratio = {k: pa[k] / ours[k] if ours.get(k) and pa.get(k) is not None else float("nan") for k in keys[1:]}
    return pd.concat([df, pd.DataFrame([{"tool": "perf_analyzer / ours", **ratio}])], ignore_index=True)


def perf_analyzer_verdict(ours: Mapping[str, Any], theirs: PerfAnalyzerResult, tol: float = 0.10) -> str:
    """Whether the two tools agree within ``tol`` on throughput and p95, and where a difference comes from."""
    tput = theirs.throughput_infer_s / ours["throughput_infer_s"] - 1
    p95 = theirs.p95_ms / ours["p95_ms"] - 1
    head = f"throughput {tput:+.0%}, p95 {p95:+.0%} (perf_analyzer against the course's generator)"
    if abs(tput) <= tol and abs(p95) <= tol:
        return f"agree within {tol:.0%}: {head}."
    # Time outside the server, per request: the client's own work and the network (µs).
    ours_out = ours["mean_ms"] * 1e3 - (ours.get("server_request_us") or 0.0)
    theirs_out = theirs.client_send_us + theirs.network_server_us + theirs.client_recv_us
    why = (f"outside the server a request spends {ours_out:,.0f} µs with the course's Python clients and "
           f"{theirs_out:,.0f} µs with perf_analyzer's (client send + network/server send-recv + client recv).")
    if theirs_out < ours_out * (1 - tol) and tput > 0:
        why += (" perf_analyzer's C++ client costs less per request, so at the same concurrency more requests reach "
                "the server: the Python clients, not the server, limited the course's measurement.")
    elif not ours.get("stable"):
        why += " The course's measurement was not stable: compare again with longer windows."
    return f"differ by more than {tol:.0%}: {head}. {why}"


def split_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Where a request's time went on the server (µs per request): queue, compute input, infer, output."""
    return pd.DataFrame([{"step": r["step"], **{f"{k}_us": r.get(f"server_{k}_us") for k in triton_client.STAGES},
                          "server_request_us": r.get("server_request_us"), "client_mean_us": r["mean_ms"] * 1e3,
                          "batch_avg": r.get("server_batch_avg")} for r in rows])


def plot_latency_throughput(curves: Mapping[str, Any], ax: Any = None, title: str | None = None) -> Any:
    """p95 latency against throughput, one line per configuration, each point labelled with its concurrency."""
    _, ax = new_axes(ax)
    for label, df in curves.items():
        ax.plot(df["throughput_infer_s"], df["p95_ms"], marker="o", label=label)
        for _, r in df.iterrows():
            ax.annotate(f"c={int(r['concurrency'])}", (r["throughput_infer_s"], r["p95_ms"]), fontsize=8,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("throughput (infer/s)")
    ax.set_ylabel("p95 latency (ms)")
    ax.set_title(title or "Latency against throughput (closed loop, rising concurrency)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return ax


def version_outputs(server: triton_server.Server, model: str, x: np.ndarray, versions: Sequence[int]) -> dict[int, Any]:
    """The first output row of each version for the same input, or the server's refusal."""
    triton_server.require_serving(server)
    out: dict[int, Any] = {}
    for v in versions:
        try:
            y = triton_client.infer(server.grpc_url, model, {triton_repo.INPUT_NAME: x}, version=str(v))
            out[v] = np.round(y[triton_repo.OUTPUT_NAME][0, :3], 4).tolist()
        except triton_client.InferError as err:
            out[v] = f"refused: {err.server_message}"
    return out
