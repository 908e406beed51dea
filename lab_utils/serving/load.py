"""The course's one load engine: a closed loop and an open loop are two modes of one run.

Closed loop (``run_closed_loop``, and ``run_load`` for a Triton model): ``concurrency`` clients, each sending its next
request when its last one answered. Open loop (``run_open_loop``): requests sent at Poisson times of mean rate
``rate_rps`` whether or not the server keeps up, latency counted from each request's intended send time. Both give a
``LoadResult`` of the same measured windows and are judged by the same stability rule (``is_stable``). A failed
request is counted in ``errors``, never raised. Units are in names: ``_s`` seconds, ``_ms`` milliseconds, ``_rps``
requests/s. With ``stats_url`` the statistics API (``client.server_split``) gives the server's side of a run.
Design notes: docs/internals.md#lab_utilsservingloadpy
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue as queue_mod
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.args import check_int, check_positive
from lab_utils.serving.client import server_split, stats_snapshot
from lab_utils.serving.senders import _UP_S, ERROR_BACKOFF_S, Plan, Row, Sender, process_main
from lab_utils.serving.targets import PROTOCOLS, TritonTarget, Verify, as_target
from lab_utils.timing import cpu_cores

TOP_MESSAGES = 10  # distinct error messages kept in LoadResult.error_messages; the rest are summed
OTHER_MESSAGES = "(other messages)"
STABLE_WINDOWS = 3  # the stability rule looks at the last three windows, as perf_analyzer does
TREND_FACTOR = 2.0  # the last window's median latency may be this many times the first's...
TREND_SLACK_MS = 10.0  # ...plus this (ms): jitter at a few ms is not a queue
RPS_PER_PROCESS = 400  # requests/s one client process sends on time (an H200 run's single loop lagged at 750)
_START_S = 0.05  # s from every sender being ready to the run's start


# --- windows, the stability rule, the result ------------------------------------------------------------------


@dataclass
class Window:
    """One measurement window: the requests sent in it (by intended send time) and what they got."""

    index: int
    seconds: float
    requests: int  # answered among the requests sent in the window
    errors: int  # failed among them (timeouts included)
    throughput_infer_s: float  # successful answers completed in the window, per second, × batch
    mean_ms: float = float("nan")
    p50_ms: float = float("nan")
    p95_ms: float = float("nan")
    p99_ms: float = float("nan")
    sent: int = 0  # requests sent in the window
    offered_rps: float = 0.0  # sent per second
    achieved_rps: float = 0.0  # successful answers completed in the window, per second
    timeouts: int = 0
    error_messages: dict[str, int] = field(default_factory=dict)


def is_stable(windows: Sequence[Window], stability: float = 0.10, mode: str = "open") -> bool:
    """The stability rule of both modes, over the last ``STABLE_WINDOWS`` windows (three at least):

    1. the server kept up: it answered at least ``1 - stability`` of the requests sent in them (failures and timeouts
       count against it, so a run of fast errors is no steady state);
    2. no queue building: the last window's median latency <= ``TREND_FACTOR`` × the first's + ``TREND_SLACK_MS``;
    3. closed loop: their throughput and their mean latency each agree within ± ``stability`` of their mean
       (perf_analyzer's rule). In an open loop the schedule, not the server, sets the throughput: its Poisson noise
       is no instability, and 1. already checks that the answers kept pace with it.
    """
    ws = list(windows)[-STABLE_WINDOWS:]
    if len(ws) < STABLE_WINDOWS:
        return False
    sent, answered = sum(w.sent for w in ws), sum(w.requests for w in ws)
    if not sent or answered < (1 - stability) * sent:
        return False
    first, last = ws[0].p50_ms, ws[-1].p50_ms
    if not (math.isfinite(first) and math.isfinite(last)) or last > TREND_FACTOR * first + TREND_SLACK_MS:
        return False
    if mode == "closed":
        for key in ("throughput_infer_s", "mean_ms"):
            vals = [getattr(w, key) for w in ws]
            m = sum(vals) / len(vals)
            if not m or not all(math.isfinite(v) for v in vals) or (max(vals) - min(vals)) / m > stability:
                return False
    return True


@dataclass
class LoadResult:
    """One run, closed or open loop: numbers over the measured windows, after the warm-up."""

    mode: str  # "closed" or "open"
    target: str
    concurrency: int | None  # the clients (closed loop)
    rate_rps: float | None  # the schedule's mean rate (open loop)
    offered_rps: float  # requests sent per second (by intended send time)
    achieved_rps: float  # successful answers completed per second
    throughput_infer_s: float  # achieved_rps × batch
    p50_ms: float  # latency of answered requests, from the intended send time
    p90_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    requests: int  # answered requests measured
    errors: int  # failed requests measured (timeouts included)
    timeouts: int
    error_messages: dict[str, int]  # {message: count}, summing to errors_total
    windows: list[Window]  # every window measured (a closed loop without a duration: until the last three agree)
    stable: bool  # is_stable over the windows the numbers come from
    seconds: float  # measured time the numbers come from
    errors_total: int = 0  # warm-up included
    sent_total: int = 0  # every request, warm-up included
    send_lag_p99_ms: float = 0.0  # how late the client sent (open loop): large means the client, not the server, lags
    max_in_flight: int = 0
    batch: int = 1  # rows per request (the first dimension of the inputs)
    processes: int = 1  # client processes the load was dealt over
    server: dict[str, float] | None = None  # the statistics API's split over the measured windows (server_split)

    def percentile(self, q: int) -> float:
        """p50/p90/p95/p99 latency (ms) by number."""
        if q not in (50, 90, 95, 99):
            raise ValueError(f"percentile={q!r}: use 50, 90, 95 or 99")
        return float(getattr(self, f"p{q}_ms"))

    def to_row(self) -> dict[str, Any]:
        """A flat dict for a table: the client numbers, then the server split (``server_*``)."""
        row = {k: v for k, v in asdict(self).items() if k not in ("windows", "error_messages", "server")}
        return {**row, "windows": len(self.windows), **{f"server_{k}": v for k, v in (self.server or {}).items()}}

    def __str__(self) -> str:
        load = f"{self.rate_rps:g} req/s offered" if self.mode == "open" else f"c={self.concurrency}"
        s = (f"{self.target} {self.mode} loop {load}: {self.achieved_rps:,.1f} answered/s "
             f"({self.throughput_infer_s:,.0f} infer/s), p50 {self.p50_ms:.2f} ms, p95 {self.p95_ms:.2f} ms, p99 "
             f"{self.p99_ms:.2f} ms, {self.errors} errors ({self.timeouts} timeouts), "
             f"{'stable' if self.stable else 'NOT stable'} after {len(self.windows)} windows")
        if self.server:
            s += (f"; server: queue {self.server['queue_us']:.0f} µs, infer {self.server['compute_infer_us']:.0f} µs,"
                  f" batch {self.server['batch_avg']:.1f}")
        if self.send_lag_p99_ms > 5:
            more = ("spread it: processes=None" if self.processes == 1 else
                    f"{self.processes} client processes: give more, or run the client where cores are free")
            s += (f"; the client sent late (p99 {self.send_lag_p99_ms:.0f} ms): it, not only the server, is saturated "
                  f"({more})")
        return s


def _measured(rows: Sequence[Row], *percentiles: int) -> dict[str, Any]:
    """What ``rows`` got: ``requests`` answered, ``errors`` (``timeouts`` among them; ``error_messages``), and the
    answered ones' ``mean_ms`` and ``p{q}_ms`` latency from the intended send time for each of ``percentiles`` (NaN
    without any)."""
    lat = np.asarray([(r[2] - r[0]) * 1e3 for r in rows if r[3]])
    msgs = Counter(r[4] for r in rows if not r[3])
    timeouts = sum(n for m, n in msgs.items() if m.startswith(("TimeoutError", "CancelledError"))
                   or "DEADLINE_EXCEEDED" in m)
    values = [lat.mean(), *np.percentile(lat, percentiles)] if len(lat) else [float("nan")] * (1 + len(percentiles))
    return {"requests": len(lat), "errors": sum(msgs.values()), "timeouts": timeouts,
            "error_messages": _top_messages(msgs),
            **{k: float(v) for k, v in zip(["mean_ms", *(f"p{q}_ms" for q in percentiles)], values, strict=True)}}


def _top_messages(msgs: Counter[str], n: int = TOP_MESSAGES) -> dict[str, int]:
    """The ``n`` most frequent messages; the rest summed under ``OTHER_MESSAGES`` (the counts keep their total)."""
    top = dict(msgs.most_common(n))
    rest = sum(msgs.values()) - sum(top.values())
    if rest:
        top[OTHER_MESSAGES] = top.get(OTHER_MESSAGES, 0) + rest
    return top


class _Book:
    """The requests of a run by window of their intended send time (-1: the warm-up), as rows."""

    def __init__(self, warmup_s: float, window_s: float, n_windows: int, batch: int):
        self.warmup_s, self.window_s, self.n_windows, self.batch = warmup_s, window_s, n_windows, batch
        self.rows: dict[int, list[Row]] = {}
        self.ends: list[float] = []  # end times of the successful requests received so far

    def add(self, w: int, rows: Sequence[Row]) -> None:
        self.rows.setdefault(w, []).extend(rows)
        self.ends.extend(r[2] for r in rows if r[3])

    def span(self, first: int, last: int) -> tuple[list[Row], int, float]:
        """The rows of windows ``first..last``, the successful answers completed in their time, and that time (s)."""
        rows = [r for w in range(first, last + 1) for r in self.rows.get(w, [])]
        a, b = self.warmup_s + first * self.window_s, self.warmup_s + (last + 1) * self.window_s
        ends = np.asarray(self.ends)
        return rows, int(np.count_nonzero((ends >= a) & (ends < b))), b - a

    def window(self, w: int) -> Window:
        rows, done, seconds = self.span(w, w)
        return Window(index=w, seconds=seconds, throughput_infer_s=done * self.batch / seconds,
                      **_measured(rows, 50, 95, 99), sent=len(rows), offered_rps=len(rows) / seconds,
                      achieved_rps=done / seconds)


def _auto_processes(mode: str, load: float) -> int:
    """Client processes for a run: closed loop, one unless many clients meet many cores; open loop, one per
    ``RPS_PER_PROCESS`` of the rate, up to the cores less one."""
    if mode == "open":
        return max(1, min(math.ceil(load / RPS_PER_PROCESS), cpu_cores() - 1))
    cpus = os.cpu_count() or 1
    if cpus <= 8 or load < 8:
        return 1  # the clients share the cores with the server: one process wastes least
    return max(1, min(4, int(load) // 4, cpus // 4))


# --- the run: senders started together, their windows merged in the caller's thread ---------------------------


def _run(target: Any, plans: list[Plan], book: _Book, *, adaptive: bool, stability: float,
         on_window: Callable[[Window], None] | None, snapshot: Callable[[], Any] | None, where: str,
         **load: Any) -> LoadResult:
    """Run the senders (threads for one plan, spawned processes for more), merge their windows into ``book`` (the
    statistics snapshots by window, -1: the warm-up's end), and return the run's ``_result`` (``load``: its
    concurrency or rate)."""
    n, mode = len(plans), plans[0].mode
    if n == 1:
        out: Any = queue_mod.Queue()
        stop: Any = threading.Event()
        start: Any = threading.Event()
        t0_box: Any = SimpleNamespace(value=0.0)
        workers: list[Any] = [threading.Thread(target=Sender(target, plans[0], out, stop, start, t0_box).run,
                                               name="nvlab-load", daemon=True)]
    else:
        import pickle

        try:
            pickle.dumps(target)
        except Exception as err:
            raise TypeError(f"{where}(processes={n}): the target {target!r} does not pickle ({err}): use a "
                            "TritonTarget or HttpTarget, or processes=1") from None
        ctx = mp.get_context("spawn")  # not fork: a notebook's threads, event loops and gRPC state stay behind
        out, stop, start, t0_box = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
        workers = [ctx.Process(target=process_main, args=(target, p, out, stop, start, t0_box),
                               name=f"nvlab-load-{i}", daemon=True) for i, p in enumerate(plans)]
    for wk in workers:
        wk.start()

    def receive(by: float, what: str) -> tuple:
        while True:
            try:
                msg = out.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [wk for i, wk in enumerate(workers) if not wk.is_alive() and i not in finished]
                if dead or time.monotonic() > by:
                    codes = "".join(f"; {wk.name} exit code {getattr(wk, 'exitcode', None)}" for wk in dead)
                    raise RuntimeError(f"{where}: the load's senders {what}{codes}); from a script, run it under "
                                       "`if __name__ == '__main__':` (spawned processes re-import it), or pass "
                                       "processes=1") from None
                continue
            if msg[0] == "crash":
                raise RuntimeError(f"the load generator failed: {msg[2]}")
            return msg

    windows: list[Window] = []
    snaps: dict[int, Any] = {}
    parts: dict[int, list[list[Row]]] = {}
    finished: set[int] = set()
    in_flight, next_w = 0, -1
    try:
        ready = 0
        while ready < n:
            ready += receive(time.monotonic() + _UP_S, "did not start (within 120 s")[0] == "ready"
        t0_box.value = time.monotonic() + _START_S
        start.set()
        run_s = plans[0].warmup_s + plans[0].n_windows * plans[0].window_s
        while len(finished) < n:
            msg = receive(t0_box.value + run_s + plans[0].timeout_s + 30, "stopped answering (")
            if msg[0] == "done":
                finished.add(msg[1])
                in_flight += msg[2]
                continue
            parts.setdefault(msg[2], []).append(msg[3])
            while len(parts.get(next_w, [])) == n and (next_w == -1 or not stop.is_set()):
                for rows in parts.pop(next_w):
                    book.add(next_w, rows)
                snaps[next_w] = snapshot() if snapshot is not None else None
                if next_w >= 0:
                    win = book.window(next_w)
                    windows.append(win)
                    if on_window is not None:
                        on_window(win)
                    if adaptive and is_stable(windows, stability, mode):
                        stop.set()  # three windows agree: the measurement is done
                next_w += 1
    except BaseException:
        stop.set()  # an interrupt, a crash, or on_window raised: stop sending, let in-flight requests end
        start.set()  # a sender still waiting for the start sees the stop
        raise
    finally:
        for wk in workers:
            wk.join(timeout=plans[0].timeout_s + 10)
            if getattr(wk, "kill", None) is not None and wk.is_alive():
                wk.kill()
                wk.join()
    for w in sorted(parts):  # sent after the windows agreed: counted in the totals, in no window
        for rows in parts[w]:
            book.add(w, rows)
    return _result(book, mode, target, windows, snaps, stability, adaptive, n, in_flight, **load)


def _checks(where: str, target: Any, duration_s: Any, warmup_s: Any, window_s: Any, timeout_s: Any,
            stability: Any, max_windows: Any) -> tuple[_Book, float, float, bool]:
    """The run's book (its warm-up and windows), the checked timeout and stability, and whether the windows go on
    until they agree (no ``duration_s``)."""
    warmup = check_positive(warmup_s, "warmup_s", where, zero_ok=True, what="number of seconds")
    window = check_positive(window_s, "window_s", where, what="number of seconds")
    timeout = check_positive(timeout_s, "timeout_s", where, what="number of seconds")
    if not (isinstance(stability, (int, float)) and math.isfinite(stability) and 0 < stability < 1):
        raise ValueError(f"{where}(stability={stability!r}): a fraction between 0 and 1, e.g. 0.10")
    if duration_s is None:
        n_windows = check_int(max_windows, "max_windows", where, minimum=STABLE_WINDOWS)
    else:
        duration = check_positive(duration_s, "duration_s", where, what="number of seconds")
        # at least the windows the stability rule reads: a 1.5 s probe in windows of 1 s was two windows, never
        # stable, so a capacity search at that length found no rate (lab 07's quick ResNet-50 search, on a GPU)
        n_windows = max(STABLE_WINDOWS, round(duration / window))
        window = duration / n_windows
    book = _Book(warmup, window, n_windows, int(getattr(target, "batch", 1)))
    return book, timeout, float(stability), duration_s is None


def _result(book: _Book, mode: str, target: Any, windows: list[Window], snaps: dict[int, Any], stability: float,
            adaptive: bool, processes: int, in_flight: int, concurrency: int | None = None,
            rate: float | None = None) -> LoadResult:
    used = min(STABLE_WINDOWS, len(windows)) if adaptive else len(windows)
    first = windows[-used].index if used else 0
    last = windows[-1].index if used else -1
    rows, done, span = book.span(first, last) if used else ([], 0, 0.0)
    every = [r for w in sorted(book.rows) for r in book.rows[w]]
    all_msgs = Counter(r[4] for r in every if not r[3])
    lag = [(r[1] - r[0]) * 1e3 for r in every if r[0] >= 0] if mode == "open" else []
    before, after = snaps.get(first - 1), snaps.get(last)
    return LoadResult(
        mode=mode, target=repr(target), concurrency=concurrency, rate_rps=rate,
        offered_rps=len(rows) / span if span else float("nan"), achieved_rps=done / span if span else float("nan"),
        throughput_infer_s=done * book.batch / span if span else float("nan"),
        **{**_measured(rows, 50, 90, 95, 99), "error_messages": _top_messages(all_msgs)},
        windows=windows, stable=is_stable(windows[len(windows) - used:], stability, mode), seconds=span,
        errors_total=sum(all_msgs.values()), sent_total=len(every),
        send_lag_p99_ms=float(np.percentile(lag, 99)) if lag else 0.0, max_in_flight=in_flight, batch=book.batch,
        processes=processes, server=server_split(before, after) if before and after else None)


def _snapshot(target: Any, stats_url: str | None) -> Callable[[], Any] | None:
    """Statistics snapshots of the target's model at ``stats_url`` (None: none wanted)."""
    if stats_url and getattr(target, "model", None) is None:
        raise ValueError(f"stats_url={stats_url!r} reads a model's statistics: the target {target!r} names none")
    return (lambda: stats_snapshot(stats_url, target.model)) if stats_url else None


def run_closed_loop(target: Any, concurrency: int, duration_s: float | None = None, *, warmup_s: float = 0.5,
                    window_s: float = 1.0, max_windows: int = 10, timeout_s: float = 10.0, stability: float = 0.10,
                    processes: int | None = None, stats_url: str | None = None,
                    on_window: Callable[[Window], None] | None = None) -> LoadResult:
    """``concurrency`` clients, each sending its next request when its last one answered (a failed one after a
    ``ERROR_BACKOFF_S`` pause); latency from the send.

    ``duration_s``: measure that long after ``warmup_s``, in windows of about ``window_s`` (at least three, shorter
    where the duration is under three windows, so that the stability rule applies). None: windows of ``window_s``
    until the last three agree (``is_stable``), at most ``max_windows``; the numbers are then those three windows'.
    One request goes before the clock starts (a slow first request must not fall in a window; its failure counts
    in ``errors_total``).
    ``processes``: client processes sharing the clients (None: by the clients and the cores); the target must
    pickle. ``stats_url``: a Triton HTTP endpoint whose statistics API gives the server's split of the measured
    windows (``server``).
    """
    where = "run_closed_loop"
    target = as_target(target)
    concurrency = check_int(concurrency, "concurrency", where)
    book, timeout, stability, adaptive = _checks(where, target, duration_s, warmup_s, window_s, timeout_s,
                                                 stability, max_windows)
    n = _auto_processes("closed", concurrency) if processes is None else check_int(processes, "processes", where)
    n = min(n, concurrency)
    shares = [concurrency // n + (1 if i < concurrency % n else 0) for i in range(n)]
    plans = [Plan("closed", book.warmup_s, book.window_s, book.n_windows, timeout, concurrency=c,
                   first=sum(shares[:i]), index=i) for i, c in enumerate(shares)]
    return _run(target, plans, book, adaptive=adaptive, stability=stability, on_window=on_window,
                snapshot=_snapshot(target, stats_url), where=where, concurrency=concurrency)


def poisson_arrivals(rate_rps: float, duration_s: float, seed: int | None = 0) -> np.ndarray:
    """Intended send times (s from the start, ascending) of a Poisson process at ``rate_rps`` requests per second
    over ``duration_s``: exponential gaps of mean ``1 / rate_rps``; the same ``seed`` gives the same schedule."""
    rate = check_positive(rate_rps, "rate_rps", "poisson_arrivals")
    duration = check_positive(duration_s, "duration_s", "poisson_arrivals")
    rng = np.random.default_rng(seed)
    n = int(rate * duration + 6 * math.sqrt(rate * duration) + 16)  # enough gaps with near certainty
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    while t[-1] < duration:  # and if not, more
        t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / rate, n))])
    return t[t < duration]


def run_open_loop(target: Any, rate_rps: float, duration_s: float | None, *, warmup_s: float = 1.0,
                  window_s: float = 1.0, max_windows: int = 10, seed: int | None = 0, timeout_s: float = 10.0,
                  stability: float = 0.10, max_in_flight: int = 10_000, processes: int | None = 1,
                  stats_url: str | None = None, on_window: Callable[[Window], None] | None = None) -> LoadResult:
    """Send requests at Poisson times of mean rate ``rate_rps`` for ``warmup_s + duration_s`` seconds, whatever
    the server does, and measure each from its intended send time.

    The first ``warmup_s`` seconds are sent but not measured (their errors count in ``errors_total``). A request
    without an answer after ``timeout_s`` counts as a timeout; one due while ``max_in_flight`` are outstanding is
    counted as failed ("client limit") rather than sent. Every request is awaited before this returns.
    ``duration_s``: cut into windows as for ``run_closed_loop`` (at least three). ``duration_s=None``: until the
    last three windows are stable, at most ``max_windows``. ``processes``: the schedule dealt over that many client
    processes (None: one per ``RPS_PER_PROCESS`` of the rate, up to the cores less one), for rates one Python event
    loop cannot send on time (``send_lag_p99_ms`` says when); the target must pickle (``TritonTarget``,
    ``HttpTarget``). ``stats_url``: as for ``run_closed_loop``.
    """
    where = "run_open_loop"
    target = as_target(target)
    rate = check_positive(rate_rps, "rate_rps", where)
    book, timeout, stability, adaptive = _checks(where, target, duration_s, warmup_s, window_s, timeout_s,
                                                 stability, max_windows)
    cap = check_int(max_in_flight, "max_in_flight", where)
    n = _auto_processes("open", rate) if processes is None else check_int(processes, "processes", where)
    arrivals = poisson_arrivals(rate, book.warmup_s + book.n_windows * book.window_s, seed)
    # the schedule dealt round-robin over the senders: a superposition of Poisson streams is the same Poisson stream
    plans = [Plan("open", book.warmup_s, book.window_s, book.n_windows, timeout, dues=arrivals[i::n],
                   cap=max(1, cap // n), first=i, index=i) for i in range(n)]
    return _run(target, plans, book, adaptive=adaptive, stability=stability, on_window=on_window,
                snapshot=_snapshot(target, stats_url), where=where, rate=rate)


def run_load(url: str, model: str, make_inputs: Callable[[], Mapping[str, np.ndarray]] | Mapping[str, np.ndarray],
             concurrency: int, *, protocol: str = "grpc", duration_s: float | None = None, window_s: float = 1.0,
             warmup_s: float = 0.5, max_windows: int = 10, stability: float = 0.10, processes: int | None = None,
             outputs: Sequence[str] | None = None, stats_url: str | None = None,
             on_window: Callable[[Window], None] | None = None, timeout_s: float = 10.0,
             verify: Verify | None = None) -> LoadResult:
    """A closed loop of ``concurrency`` clients on a Triton model (``run_closed_loop`` on a ``TritonTarget``):
    ``make_inputs`` a function giving ``{input name: np.ndarray}`` (batch first) or such a dict; ``verify(inputs,
    outputs)`` raises on a wrong answer (counted as failed). Over HTTP the server's split is read from ``url``
    unless ``stats_url`` says where."""
    target = TritonTarget(url, model, make_inputs, protocol=protocol, outputs=outputs, verify=verify)
    return run_closed_loop(target, concurrency, duration_s, warmup_s=warmup_s, window_s=window_s,
                           max_windows=max_windows, timeout_s=timeout_s, stability=stability, processes=processes,
                           stats_url=stats_url or (url if protocol == "http" else None), on_window=on_window)


def sweep(url: str, model: str, make_inputs: Any, concurrencies: Sequence[int], **kw: Any) -> pd.DataFrame:
    """``run_load`` at each concurrency; a DataFrame with one row per concurrency (``LoadResult.to_row``)."""
    return pd.DataFrame([run_load(url, model, make_inputs, c, **kw).to_row() for c in concurrencies])


__all__ = ["run_closed_loop", "run_open_loop", "run_load", "sweep", "poisson_arrivals", "is_stable", "LoadResult",
           "Window", "ERROR_BACKOFF_S", "PROTOCOLS"]
