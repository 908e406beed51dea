"""Closed-loop load against a Triton server: throughput, latency percentiles, the server-side split.

Stable API (lab 04 and lab 05 build on it): ``run_load`` (``concurrency`` clients, each with one request in flight:
a ``LoadResult``), ``sweep`` (a row per concurrency), ``server_split`` (queue / compute µs per request from two
statistics snapshots), and the same with ``perf_analyzer``. A failed request is counted in ``errors``, never raised.
Design notes: docs/internals.md#lab_utilsservingloadpy
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import re
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.args import check_int
from lab_utils.compat import glibc
from lab_utils.course.probe import find_perf_analyzer
from lab_utils.procs import Background, die_with_parent, popen_owned, stop_group, temporary_folder
from lab_utils.serving.client import PROTOCOLS, _module, as_arrays, build_request, host_port, infer

ERROR_BACKOFF_S = 0.01
TOP_MESSAGES = 10  # distinct error messages kept in LoadResult.error_messages; the rest are summed
OTHER_MESSAGES = "(other messages)"
_N_PAYLOADS = 8  # distinct request payloads made up front, so make_inputs costs nothing in the timed loop


@dataclass
class Window:
    """One measurement window: what completed in it."""

    index: int
    seconds: float
    requests: int
    errors: int
    throughput_infer_s: float
    mean_ms: float
    p95_ms: float


@dataclass
class LoadResult:
    model: str
    protocol: str
    concurrency: int
    throughput_infer_s: float  # successful requests per second over the measured windows
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    requests: int  # successful requests measured
    errors: int  # failed requests measured (and during warm-up: see errors_total)
    error_messages: dict[str, int]  # {message: count}; the counts sum to errors_total
    windows: list[Window]
    stable: bool
    seconds: float  # measured time
    errors_total: int = 0  # including warm-up and unmeasured windows
    batch: int = 1  # rows per request (the first dimension of the inputs)
    server: dict[str, float] | None = None  # the statistics-API split, see server_split
    processes: int = 1

    def to_row(self) -> dict[str, Any]:
        """A flat dict for a table: the client numbers, then the server split."""
        row = {k: v for k, v in asdict(self).items() if k not in ("windows", "error_messages", "server")}
        row["windows"] = len(self.windows)
        for k, v in (self.server or {}).items():
            row[f"server_{k}"] = v
        return row

    def __str__(self) -> str:
        s = (f"{self.model} {self.protocol} c={self.concurrency}: {self.throughput_infer_s:,.0f} infer/s, "
             f"p50 {self.p50_ms:.2f} ms, p95 {self.p95_ms:.2f} ms, p99 {self.p99_ms:.2f} ms, "
             f"{self.errors} errors, {'stable' if self.stable else 'NOT stable'} after {len(self.windows)} windows")
        if self.server:
            s += (f"; server: queue {self.server['queue_us']:.0f} µs, infer {self.server['compute_infer_us']:.0f} µs,"
                  f" batch {self.server['batch_avg']:.1f}")
        return s


# --- statistics API --------------------------------------------------------------------------------------


def model_stats(http_url: str, model: str, version: str = "") -> dict[str, Any]:
    """``GET v2/models/{model}[/versions/{v}]/stats``: the statistics API's counters, summed over versions."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/stats"
    base = http_url if "://" in http_url else f"http://{http_url}"
    with urllib.request.urlopen(base.rstrip("/") + path, timeout=5) as r:
        data = json.loads(r.read())
    return sum_stats(data.get("model_stats", []))


def sum_stats(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Statistics-API entries (versions of a model, or one model on several servers) added up."""
    total: dict[str, Any] = {"inference_count": 0, "execution_count": 0, "inference_stats": {}}
    for e in entries:
        total["inference_count"] += int(e.get("inference_count", 0))
        total["execution_count"] += int(e.get("execution_count", 0))
        for k, v in e.get("inference_stats", {}).items():
            d = total["inference_stats"].setdefault(k, {"count": 0, "ns": 0})
            d["count"] += int(v.get("count", 0))
            d["ns"] += int(v.get("ns", 0))
    return total


def server_split(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, float]:
    """Average µs per successful request in queue / compute input / infer / output, and the average batch.

    From two ``model_stats`` snapshots (the statistics API's counters are cumulative). ``batch_avg`` is
    inferences per model execution: how many requests' rows the batcher put together.
    """
    def delta(key: str) -> tuple[int, int]:
        a, b = before["inference_stats"].get(key, {}), after["inference_stats"].get(key, {})
        return b.get("count", 0) - a.get("count", 0), b.get("ns", 0) - a.get("ns", 0)

    n_ok, ns_ok = delta("success")
    out: dict[str, float] = {"requests": float(n_ok)}
    per = max(n_ok, 1)
    out["request_us"] = ns_ok / per / 1e3
    for k in ("queue", "compute_input", "compute_infer", "compute_output"):
        out[f"{k}_us"] = delta(k)[1] / per / 1e3
    execs = after["execution_count"] - before["execution_count"]
    infers = after["inference_count"] - before["inference_count"]
    out["executions"] = float(execs)
    out["batch_avg"] = infers / execs if execs else float("nan")
    out["failures"] = float(delta("fail")[0])
    return out


# --- the clients -------------------------------------------------------------------------------------------


def _payloads(make_inputs: Callable[[], Mapping[str, np.ndarray]] | Mapping[str, np.ndarray]) -> list[dict]:
    if isinstance(make_inputs, Mapping):
        sets = [dict(make_inputs)]
    elif callable(make_inputs):
        sets = [dict(make_inputs()) for _ in range(_N_PAYLOADS)]
    else:
        raise TypeError("make_inputs: a function returning {input name: numpy array}, or such a dict")
    for s in sets:
        if not s or not all(isinstance(v, np.ndarray) for v in s.values()):
            raise TypeError(f"make_inputs must give {{input name: numpy array}}, got "
                            f"{ {k: type(v).__name__ for k, v in s.items()} }")
    return sets


class _Sink:
    """Per-request records of one client thread/process, bucketed by window on completion (thread-safe).

    A window's error count and its messages are taken together, so errors of a later window (a dead server fails
    fast) never lend their messages to an earlier one's count.
    """

    def __init__(self, t0: float, window_s: float):
        self.t0, self.window_s = t0, window_s
        self.lat: dict[int, list[float]] = {}
        self.msgs: dict[int, Counter[str]] = {}
        self.lock = threading.Lock()

    def add(self, t_start: float, t_end: float, ok: bool, msg: str = "") -> None:
        w = max(-1, math.floor((t_end - self.t0) / self.window_s))  # -1: warm-up
        with self.lock:
            if ok:
                self.lat.setdefault(w, []).append((t_end - t_start) * 1e3)
            else:
                self.msgs.setdefault(w, Counter())[_short_error(msg)] += 1

    def take(self, w: int) -> tuple[np.ndarray, int, dict[str, int]]:
        with self.lock:
            lat = np.asarray(self.lat.pop(w, []), dtype=np.float64)
            msgs = dict(self.msgs.pop(w, Counter()))
        return lat, sum(msgs.values()), msgs


def _top_messages(msgs: Counter[str], n: int = TOP_MESSAGES) -> dict[str, int]:
    """The ``n`` most frequent messages; the rest summed under ``OTHER_MESSAGES`` (the counts keep their total)."""
    top = dict(msgs.most_common(n))
    rest = sum(msgs.values()) - sum(top.values())
    if rest:
        top[OTHER_MESSAGES] = top.get(OTHER_MESSAGES, 0) + rest
    return top


def _positive(value: Any, arg: str, where: str, zero_ok: bool = False, what: str = "number") -> float:
    """``value`` as a finite ``what`` > 0 (>= 0 with ``zero_ok``), or a ValueError naming ``where(arg=...)``."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        raise ValueError(f"{where}({arg}={value!r}): must be a finite {what} {'>=' if zero_ok else '>'} 0")
    return float(value)


def _seconds(value: Any, arg: str, zero_ok: bool = False) -> float:
    return _positive(value, arg, "run_load", zero_ok, "number of seconds")


def _latency(lat: np.ndarray, *percentiles: int) -> dict[str, float]:
    """``mean_ms`` and ``p{q}_ms`` of the latencies ``lat`` (ms) for each of ``percentiles``: NaN without any."""
    values = [lat.mean(), *np.percentile(lat, percentiles)] if len(lat) else [float("nan")] * (1 + len(percentiles))
    return {k: float(v) for k, v in zip(["mean_ms", *(f"p{q}_ms" for q in percentiles)], values, strict=True)}


def _short_error(msg: str) -> str:
    return " ".join(str(msg).split())[:300]


async def _client_loop(protocol: str, url: str, model: str, payloads: list[dict], outputs: Sequence[str] | None,
                       sink: _Sink, stop: threading.Event | Any, timeout_s: float, offset: int,
                       verify: Verify | None = None) -> None:
    tc = _module(protocol, aio=True)
    client = (tc.InferenceServerClient(url) if protocol == "grpc" else
              tc.InferenceServerClient(url, conn_timeout=timeout_s))
    try:
        reqs = [build_request(tc, protocol, p, outputs, binary=True) for p in payloads]
        k = offset
        kw = {"client_timeout": timeout_s} if protocol == "grpc" else {}
        while not stop.is_set():
            i = k % len(reqs)
            ins, outs = reqs[i]
            k += 1
            t = time.perf_counter()
            try:
                result = await client.infer(model, ins, outputs=outs, **kw)
                t_done = time.perf_counter()  # checking the answer below is not the server's latency
                if verify is not None:
                    _verify(verify, payloads[i], result, outputs, protocol)
            except Exception as err:  # counted, never raised: the load goes on (a failure drill needs it)
                sink.add(t, time.perf_counter(), False, f"{type(err).__name__}: {err}")
                await asyncio.sleep(ERROR_BACKOFF_S)
            else:
                sink.add(t, t_done, True)
    finally:
        with contextlib.suppress(Exception):
            await client.close()


class WrongAnswer(Exception):
    """A response that ``verify`` refused: counted as a failed request, with the message ``wrong answer: ...``."""


Verify = Callable[[Mapping[str, np.ndarray], Mapping[str, np.ndarray]], None]


def _verify(verify: Verify, inputs: Mapping[str, np.ndarray], result: Any, outputs: Sequence[str] | None,
            protocol: str) -> None:
    got = as_arrays(result, protocol, outputs)  # an unreadable answer (an empty tensor) is no wrong answer: it raises
    try:
        verify(inputs, got)
    except Exception as err:
        raise WrongAnswer(f"wrong answer: {err}") from None


def _run_clients(protocol: str, url: str, model: str, payloads: list[dict], outputs: Sequence[str] | None,
                 n: int, sink: _Sink, stop: Any, timeout_s: float, first: int, verify: Verify | None = None) -> None:
    async def main() -> None:
        await asyncio.gather(*(_client_loop(protocol, url, model, payloads, outputs, sink, stop, timeout_s,
                                            first + i, verify) for i in range(n)))

    asyncio.run(main())


def _process_worker(protocol: str, url: str, model: str, payloads: list[dict], outputs: Sequence[str] | None,
                    n: int, t0_value: Any, start: Any, window_s: float, stop: Any, out_q: Any, timeout_s: float,
                    first: int, verify: Verify | None = None) -> None:
    """A client process: ``n`` closed-loop clients; hands each finished window to the parent.

    It reports "ready" once its imports are done and waits for the parent's start, so that the windows of
    every process begin at the same time (``t0``, on the system-wide monotonic clock).
    """
    die_with_parent()
    _module(protocol, aio=True)  # the slow imports, before the clock starts
    out_q.put(("ready", -1, None))
    if not start.wait(timeout=120):
        return
    t0 = t0_value.value
    sink = _Sink(t0, window_s)
    done = threading.Event()

    def flusher() -> None:
        w = -1
        while True:
            end = t0 + (w + 1) * window_s
            finished = done.wait(max(0.0, end - time.perf_counter()))
            out_q.put(("window", w, *sink.take(w)))
            w += 1
            if finished:
                out_q.put(("window", w, *sink.take(w)))
                return

    th = threading.Thread(target=flusher, daemon=True)
    th.start()
    try:
        _run_clients(protocol, url, model, payloads, outputs, n, sink, stop, timeout_s, first, verify)
    except BaseException as err:
        out_q.put(("crash", -1, f"{type(err).__name__}: {err}"))
    finally:
        done.set()
        th.join(timeout=5)
        out_q.put(("done", -1, None))


def _probe(protocol: str, url: str, model: str, payload: dict, outputs: Sequence[str] | None,
           timeout_s: float) -> list[str]:
    """One request before the clients start: a first request that is slow (a lazy import, a first allocation, a
    new connection) must not fall into a measured window. Returns its error, if any (counted, not raised)."""
    try:
        infer(url, model, payload, protocol=protocol, outputs=outputs, timeout_s=timeout_s)
    except Exception as err:  # InferError, or the server is unreachable
        return [_short_error(f"{type(err).__name__}: {err}".split("\n")[0])]
    return []


def _auto_processes(concurrency: int) -> int:
    cpus = os.cpu_count() or 1
    if cpus <= 8 or concurrency < 8:
        return 1  # the clients share the cores with the server: one process wastes least
    return max(1, min(4, concurrency // 4, cpus // 4))


def _stable(ws: list[Window], stability: float) -> bool:
    if len(ws) < 3:
        return False
    last = ws[-3:]
    for key in ("throughput_infer_s", "mean_ms"):
        vals = [getattr(w, key) for w in last]
        m = sum(vals) / 3
        if not m or not all(math.isfinite(v) for v in vals) or (max(vals) - min(vals)) / m > stability:
            return False
    return True


def run_load(
    url: str,
    model: str,
    make_inputs: Callable[[], Mapping[str, np.ndarray]] | Mapping[str, np.ndarray],
    concurrency: int,
    *,
    protocol: str = "grpc",
    duration_s: float | None = None,
    window_s: float = 1.0,
    warmup_s: float = 0.5,
    max_windows: int = 10,
    stability: float = 0.10,
    processes: int | None = None,
    outputs: Sequence[str] | None = None,
    stats_url: str | None = None,
    on_window: Callable[[Window], None] | None = None,
    timeout_s: float = 10.0,
    verify: Verify | None = None,
) -> LoadResult:
    """Closed-loop load at ``concurrency`` clients; see the module docstring for every argument."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}: use one of {PROTOCOLS}")
    concurrency = check_int(concurrency, "concurrency", "run_load")  # the number of clients
    window_s = _seconds(window_s, "window_s")
    warmup_s = _seconds(warmup_s, "warmup_s", zero_ok=True)
    timeout_s = _seconds(timeout_s, "timeout_s")
    max_windows = check_int(max_windows, "max_windows", "run_load", minimum=3)
    if processes is not None:
        processes = check_int(processes, "processes", "run_load")
    if duration_s is not None:  # None: the stability rule decides
        duration_s = _seconds(duration_s, "duration_s")
    if not (isinstance(stability, (int, float)) and math.isfinite(stability) and stability > 0):
        raise ValueError(f"run_load(stability={stability!r}): must be a finite fraction > 0, e.g. 0.10")
    payloads = _payloads(make_inputs)
    batch = int(next(iter(payloads[0].values())).shape[0]) if next(iter(payloads[0].values())).ndim else 1
    target = host_port(url)
    if stats_url is None and protocol == "http":
        stats_url = url
    n_windows = max(1, math.ceil(duration_s / window_s)) if duration_s is not None else max_windows
    if duration_s is not None:
        window_s = duration_s / n_windows
    probe_errors = _probe(protocol, target, model, payloads[0], outputs, timeout_s)
    nproc = processes if processes is not None else _auto_processes(concurrency)
    nproc = max(1, min(nproc, concurrency))
    t0 = time.perf_counter() + warmup_s + 0.05  # client processes: set again once they are ready
    shares = [concurrency // nproc + (1 if i < concurrency % nproc else 0) for i in range(nproc)]

    windows: list[Window] = []
    lat_by_w: list[np.ndarray] = []
    msgs: Counter[str] = Counter(probe_errors)
    errors_total = len(probe_errors)
    snaps: list[dict[str, Any] | None] = []

    def snapshot() -> dict[str, Any] | None:
        if not stats_url:
            return None
        try:
            return model_stats(stats_url, model)
        except Exception:  # the server may be gone (failure drill): no split, the load numbers stand
            return None

    if nproc == 1:
        stop: Any = threading.Event()
        sink = _Sink(t0, window_s)
        clients = Background(_run_clients, protocol, target, model, payloads, outputs, concurrency, sink, stop,
                             timeout_s, 0, verify, name="nvlab-load")
        th = clients.thread

        def take(w: int) -> tuple[np.ndarray, int, dict[str, int]]:
            end = t0 + (w + 1) * window_s
            while time.perf_counter() < end and th.is_alive():
                th.join(timeout=min(0.05, max(0.0, end - time.perf_counter())))
            if clients.error is not None:
                raise RuntimeError(f"the load clients failed: {clients.error}") from clients.error
            return sink.take(w)

        def finish(join_s: float = timeout_s + 5) -> None:
            stop.set()
            th.join(timeout=join_s)
    else:
        ctx = mp.get_context("spawn")  # fork would copy this process's gRPC state and threads
        stop = ctx.Event()
        start = ctx.Event()
        t0_value = ctx.Value("d", 0.0)
        out_q = ctx.Queue()
        procs = [ctx.Process(target=_process_worker, name=f"nvlab-load-{i}", daemon=True,
                             args=(protocol, target, model, payloads, outputs, shares[i], t0_value, start, window_s,
                                   stop, out_q, timeout_s, sum(shares[:i]), verify))
                 for i in range(nproc)]
        for p in procs:
            p.start()
        pending: dict[int, list[tuple[np.ndarray, int, dict[str, int]]]] = {}

        def finish(join_s: float = timeout_s + 5) -> None:
            stop.set()
            start.set()  # a process still waiting for the start sees the stop
            for p in procs:
                p.join(timeout=join_s)
                if p.is_alive():
                    p.kill()
                    p.join()

        def receive(by: float, what: str) -> tuple[str, int, list[Any]]:
            """The next message of the client processes; an error when one crashed, or died, or none came by ``by``."""
            while True:
                try:
                    kind, wi, *rest = out_q.get(timeout=0.2)
                except queue_mod.Empty:
                    dead = [p for p in procs if not p.is_alive()]
                    if dead or time.perf_counter() > by:
                        codes = "".join(f"; {p.name} exit code {p.exitcode}" for p in dead)
                        raise RuntimeError(f"load client processes {what}{codes}); from a script, call run_load under "
                                           "`if __name__ == '__main__':` (spawned processes re-import it), or pass "
                                           "processes=1") from None
                    continue
                if kind == "crash":
                    raise RuntimeError(f"a load client process failed: {rest[0]}")
                return kind, wi, rest

        ready, ready_by = 0, time.perf_counter() + 120
        try:
            while ready < nproc:
                ready += receive(ready_by, "did not start (within 120 s")[0] == "ready"
        except BaseException:
            finish(5.0)
            raise
        t0 = time.perf_counter() + warmup_s
        t0_value.value = t0
        start.set()

        def take(w: int) -> tuple[np.ndarray, int, dict[str, int]]:
            deadline = t0 + (w + 1) * window_s + timeout_s + 10
            while len(pending.get(w, [])) < nproc:
                kind, wi, rest = receive(deadline, f"stopped answering (window {w}")
                if kind == "window":
                    pending.setdefault(wi, []).append(tuple(rest))  # type: ignore[arg-type]
            parts = pending.pop(w)
            lat = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
            m: Counter[str] = sum((Counter(p[2]) for p in parts), Counter())
            return lat, sum(p[1] for p in parts), dict(m)

    try:
        _, e, m = take(-1)  # warm-up: dropped, but its errors count in errors_total
        errors_total += e
        msgs.update(m)
        snaps.append(snapshot())
        for w in range(n_windows):
            lat, e, m = take(w)
            snaps.append(snapshot())
            errors_total += e
            msgs.update(m)
            win = Window(w, window_s, len(lat), e, len(lat) * batch / window_s, **_latency(lat, 95))
            windows.append(win)
            lat_by_w.append(lat)
            if on_window is not None:
                on_window(win)
            if duration_s is None and _stable(windows, stability):
                break
    finally:
        finish()
    stable = _stable(windows, stability)
    use = len(windows) if duration_s is not None else min(3, len(windows))
    sel = lat_by_w[-use:]
    lat = np.concatenate(sel) if sel else np.zeros(0)
    measured_s = use * window_s
    errors = sum(w.errors for w in windows[-use:])
    first, last = snaps[len(snaps) - 1 - use] if len(snaps) > use else None, snaps[-1]
    split = server_split(first, last) if first is not None and last is not None else None
    return LoadResult(
        model=model, protocol=protocol, concurrency=concurrency,
        throughput_infer_s=len(lat) * batch / measured_s if measured_s else float("nan"),
        **_latency(lat, 50, 90, 95, 99), requests=int(len(lat)), errors=int(errors), error_messages=_top_messages(msgs),
        windows=windows, stable=stable, seconds=measured_s, errors_total=int(errors_total), batch=batch,
        server=split, processes=nproc,
    )


def sweep(url: str, model: str, make_inputs: Any, concurrencies: Sequence[int], **kw: Any) -> Any:
    """``run_load`` at each concurrency; a DataFrame with one row per concurrency (``LoadResult.to_row``)."""
    rows = [run_load(url, model, make_inputs, c, **kw).to_row() for c in concurrencies]
    return pd.DataFrame(rows)


# --- perf_analyzer, Triton's own load tool, beside this generator ----------------------------------------------

PERF_ANALYZER_INSTALL = "pip install perf-analyzer"
PERF_ANALYZER_IMAGE = "the NGC tritonserver:<yy.mm>-py3-sdk image"


def perf_analyzer_command(model: str, url: str, concurrencies: Sequence[int] = (), *, protocol: str = "grpc",
                          shape: str | None = None, window_ms: int = 5000, stability_pct: int = 10,
                          percentile: int | None = 95, max_trials: int | None = None,
                          csv_path: str | None = None, request_rate: float | None = None,
                          input_data: str | None = None, headers: Mapping[str, str] | None = None) -> str:
    """The ``perf_analyzer`` command measuring what ``sweep`` does (``-f csv_path`` writes its CSV report).

    ``percentile=None`` stabilises on the average latency, as ``run_load`` does; a percentile stabilises on it.
    ``request_rate`` (requests/s) measures an open loop instead, as ``openloop.run_open_loop`` does (Poisson
    arrivals); ``input_data`` is a JSON file from ``perf_analyzer_input_data``; ``headers`` go with every HTTP
    request (perf_analyzer sends none over gRPC, so nginx's API key needs ``protocol="http"``).
    """
    if request_rate is None and not concurrencies:
        raise ValueError("perf_analyzer_command needs concurrencies (a closed loop) or request_rate (an open loop)")
    if headers and protocol != "http":
        raise ValueError(f"perf_analyzer sends headers only over HTTP, not {protocol}: pass protocol='http'")
    common = (f"-m {model} -u {host_port(url)} -i {protocol} --measurement-interval {window_ms} "
              f"--stability-percentage {stability_pct}")
    optional = [("--percentile", percentile), ("--max-trials", max_trials), ("--shape", shape),
                ("--input-data", input_data), *(("-H", f"{k}:{v}") for k, v in (headers or {}).items()),
                ("-f", csv_path)]
    common += "".join(f" {flag} {value}" for flag, value in optional if value not in (None, ""))
    if request_rate is not None:  # async: a synchronous sender blocks per request and falls behind the schedule
        return (f"perf_analyzer {common} --request-rate-range {request_rate:g} --request-distribution poisson "
                "--async --max-threads 16")
    steps = sorted(set(concurrencies))
    diffs = {b - a for a, b in zip(steps, steps[1:], strict=False)}
    if len(diffs) <= 1:  # an arithmetic sweep is one range
        step = diffs.pop() if diffs else 1
        return f"perf_analyzer {common} --concurrency-range {steps[0]}:{steps[-1]}:{step}"
    return f"for c in {' '.join(map(str, steps))}; do perf_analyzer {common} --concurrency-range $c; done"


@dataclass(frozen=True)
class PerfAnalyzerStatus:
    """Whether ``perf_analyzer`` runs here: ``path`` (the binary found, or None), ``version``, and ``reason``
    (why it cannot run, with what to do; empty when it can)."""

    runnable: bool
    path: str | None
    version: str | None
    reason: str

    def __str__(self) -> str:
        if self.runnable:
            return f"perf_analyzer {self.version or ''} at {self.path}".replace("  ", " ")
        return f"perf_analyzer does not run here: {self.reason}"


def perf_analyzer_status(timeout_s: float = 30.0) -> PerfAnalyzerStatus:
    """Find ``perf_analyzer`` and run ``perf_analyzer --version``: runnable when it exits 0 and names itself.

    (``--help`` is no test: perf_analyzer has no such option and exits 99 after printing its usage.) Not found, not
    executable, or failing to start (``GLIBC_2.38' not found``): the reason says why, with the glibc version
    (``lab_utils.compat.glibc``).
    """
    path = find_perf_analyzer()
    if path is None:
        why = glibc.perf_analyzer_note(PERF_ANALYZER_INSTALL)
        return PerfAnalyzerStatus(False, None, None, f"not installed; {why}. It also ships in {PERF_ANALYZER_IMAGE}.")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout_s)
    except PermissionError:
        return PerfAnalyzerStatus(False, path, None, f"{path} is not executable (chmod +x it)")
    except (OSError, subprocess.TimeoutExpired) as err:
        return PerfAnalyzerStatus(False, path, None, f"{path} could not be run: {err}")
    text = (out.stdout or "") + (out.stderr or "")
    m = re.search(r"Perf Analyzer Version ([^\s]+)", text)
    if out.returncode == 0 and m:
        return PerfAnalyzerStatus(True, path, m.group(1), "")
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), f"exit code {out.returncode}")
    return PerfAnalyzerStatus(False, path, None, f"{path} --version failed: {first}{glibc.start_failure_note(text)}")


@dataclass
class PerfAnalyzerResult:
    """One concurrency (or, open loop, one request rate) measured by perf_analyzer (its CSV report; latencies
    converted from µs to ms)."""

    concurrency: int  # 0 in an open loop
    throughput_infer_s: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    avg_ms: float | None  # only with --verbose-csv and no --percentile
    client_send_us: float
    network_server_us: float  # "Network+Server Send/Recv": client wait not accounted for by the server
    server_queue_us: float | None
    server_compute_input_us: float | None
    server_compute_infer_us: float | None
    server_compute_output_us: float | None
    client_recv_us: float
    command: str = ""
    request_rate: float | None = None  # requests/s offered, open loop only

    def to_row(self) -> dict[str, Any]:
        """The same keys as ``LoadResult.to_row`` where they mean the same."""
        return {k: v for k, v in asdict(self).items() if k != "command"}


_PA_COLUMNS = {
    "Concurrency": "concurrency", "Inferences/Second": "throughput_infer_s", "Client Send": "client_send_us",
    "Network+Server Send/Recv": "network_server_us", "Server Queue": "server_queue_us",
    "Server Compute Input": "server_compute_input_us", "Server Compute Infer": "server_compute_infer_us",
    "Server Compute Output": "server_compute_output_us", "Client Recv": "client_recv_us",
}


def parse_perf_analyzer_csv(text: str, command: str = "") -> list[PerfAnalyzerResult]:
    """The rows of perf_analyzer's ``-f`` CSV report, by concurrency (the file sorts them by throughput).

    Columns, as perf_analyzer's report writer emits them: ``Concurrency`` (or ``Request Rate`` in an open loop),
    ``Inferences/Second``, ``Client Send``, then with server statistics
    ``Network+Server Send/Recv, Server Queue, Server Compute Input/Infer/Output`` (and ``Server Cache Hit/Miss``
    when the response cache is on), ``Client Recv``, ``p50/p90/p95/p99 latency``; with ``--verbose-csv`` also
    ``Avg latency`` (no ``--percentile``), ``request/response``, ``response wait`` and GPU metrics. Times are µs.
    """
    import csv
    import io

    reader = csv.DictReader(io.StringIO(text.strip()))
    fields = reader.fieldnames or []
    load = next((c for c in ("Concurrency", "Request Rate") if c in fields), None)
    if load is None:
        raise ValueError("not a perf_analyzer report: the first column should be Concurrency or Request Rate, got "
                         f"{fields[:1] or 'an empty file'}")
    missing = [c for c in ("Inferences/Second", "Client Send", "Client Recv", "p95 latency") if c not in fields]
    if missing:
        raise ValueError(f"perf_analyzer CSV without the columns {missing} (it has {fields})")
    rows = []
    for raw in reader:
        if not raw.get(load):
            continue
        values: dict[str, Any] = {key: float(raw[col]) if raw.get(col) not in (None, "") else None
                                  for col, key in _PA_COLUMNS.items()}
        values["concurrency"] = int(float(raw["Concurrency"])) if load == "Concurrency" else 0
        values["request_rate"] = float(raw[load]) if load == "Request Rate" else None
        for p in (50, 90, 95, 99):
            values[f"p{p}_ms"] = float(raw[f"p{p} latency"]) / 1e3 if raw.get(f"p{p} latency") else float("nan")
        values["avg_ms"] = float(raw["Avg latency"]) / 1e3 if raw.get("Avg latency") else None
        rows.append(PerfAnalyzerResult(command=command, **values))
    return sorted(rows, key=lambda r: (r.concurrency, r.request_rate or 0.0))


def perf_analyzer_input_data(path: str | os.PathLike[str], payloads: Sequence[Mapping[str, np.ndarray]]) -> str:
    """Write ``payloads`` (one request each, batch dimension first) as perf_analyzer's ``--input-data`` JSON, which
    it sends in turn. A BYTES tensor goes as base64 of its wire form (each element a 4-byte little-endian length,
    then its bytes); numbers as a flat list. Returns ``path``."""
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    def tensor(arr: np.ndarray) -> dict[str, Any]:
        shape = list(arr.shape[1:])  # perf_analyzer adds the batch dimension itself
        if np_to_triton_dtype(arr.dtype) == "BYTES":
            wire = serialize_byte_tensor(arr).item()  # one bytes object: the whole tensor on the wire
            return {"content": {"b64": base64.b64encode(wire).decode("ascii")}, "shape": shape}
        return {"content": arr.reshape(-1).tolist(), "shape": shape}

    if not payloads:
        raise ValueError("perf_analyzer_input_data needs at least one payload")
    data = [{name: tensor(np.asarray(arr)) for name, arr in p.items()} for p in payloads]
    with open(path, "w") as f:
        json.dump({"data": data}, f)
    return os.fspath(path)


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer ran but measured nothing usable; the message carries its own words."""


def run_perf_analyzer(model: str, url: str, concurrency: int | None = None, *, request_rate: float | None = None,
                      payloads: Sequence[Mapping[str, np.ndarray]] | None = None,
                      headers: Mapping[str, str] | None = None, protocol: str = "grpc", window_ms: int = 5000,
                      stability_pct: int = 10, max_trials: int = 10, shape: str | None = None,
                      timeout_s: float | None = None, binary: str | None = None, extensions: int = 0,
                      extension_trials: int = 6) -> PerfAnalyzerResult:
    """Run perf_analyzer at one concurrency (stabilising on the average latency, as ``run_load``), or open loop at
    one ``request_rate`` (requests/s), and parse its CSV. ``payloads``: the requests to send in turn (default:
    random data), e.g. an open-loop target's; ``headers``: HTTP only (nginx's API key).

    Without a stable measurement perf_analyzer writes no row; it is then run again with a measurement interval
    twice as long, up to ``extensions`` times (``extension_trials`` windows each), as ``steps.measure`` does.
    Raises ``PerfAnalyzerError`` with perf_analyzer's last lines when it fails or never stabilises. The process
    is owned: killed with its group on timeout.
    """
    binary = binary or find_perf_analyzer()
    if binary is None:
        raise PerfAnalyzerError(str(perf_analyzer_status()))
    with temporary_folder("perf-analyzer") as tmp:
        opts: dict[str, Any] = {"protocol": protocol, "shape": shape, "stability_pct": stability_pct,
                                "percentile": None, "request_rate": request_rate, "headers": headers,
                                "csv_path": str(tmp / "perf.csv"), "input_data": None if payloads is None else
                                perf_analyzer_input_data(tmp / "input.json", payloads)}
        steps = [] if concurrency is None else [concurrency]
        for attempt in range(1 + max(0, extensions)):
            command = perf_analyzer_command(model, url, steps, window_ms=window_ms, max_trials=max_trials, **opts)
            limit = timeout_s if timeout_s is not None else 60 + 3 * max_trials * window_ms / 1e3
            try:
                return _perf_analyzer_once([binary, *command.split()[1:]], command, limit, tmp)
            except _Unstable as err:
                if attempt == max(0, extensions):
                    raise PerfAnalyzerError(str(err)) from None
                window_ms, max_trials = 2 * window_ms, extension_trials
    raise AssertionError("unreachable")


class _Unstable(Exception):
    pass


def _perf_analyzer_once(argv: list[str], command: str, limit: float, tmp: Any) -> PerfAnalyzerResult:
    csv_path = str(tmp / "perf.csv")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(csv_path)  # an earlier, unstable attempt's report
    proc = popen_owned(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        stop_group(proc, grace_s=1.0)
        raise PerfAnalyzerError(f"perf_analyzer did not finish within {limit:g} s: {command}") from None
    last = "\n".join(output.strip().splitlines()[-8:])
    shown = command.replace(f" -f {csv_path}", " -f perf.csv").replace(f" --input-data {tmp}/", " --input-data ")
    rows = []
    if os.path.exists(csv_path):
        with open(csv_path) as f:
            rows = parse_perf_analyzer_csv(f.read(), shown)
    if rows:
        return rows[0]
    if "stable measurement" in output:
        raise _Unstable(f"perf_analyzer found no stable measurement (exit code {proc.returncode}; {shown}):\n{last}")
    raise PerfAnalyzerError(f"perf_analyzer exited with code {proc.returncode} and wrote no report ({shown}):\n{last}")


__all__ = ["run_load", "sweep", "LoadResult", "Window", "WrongAnswer", "model_stats", "server_split",
           "perf_analyzer_command", "perf_analyzer_status", "PerfAnalyzerStatus", "PerfAnalyzerResult",
           "PerfAnalyzerError", "parse_perf_analyzer_csv", "perf_analyzer_input_data", "run_perf_analyzer",
           "PROTOCOLS"]
