"""Open-loop load: requests arrive on a schedule (Poisson, seeded) whether or not the server keeps up.

Stable API (lab 07 builds on it): ``__all__``; latency counts from each request's intended send time. Units are in
names: ``_s`` seconds, ``_ms`` milliseconds, ``_rps`` requests/s.
Design notes: docs/internals.md#lab_utilsservingopenlooppy
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import queue as queue_mod
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd

from lab_utils.args import check_int
from lab_utils.procs import Background
from lab_utils.serving.client import _module, build_request, host_port
from lab_utils.serving.load import (
    ERROR_BACKOFF_S,
    PROTOCOLS,
    Verify,
    Window,
    _latency,
    _payloads,
    _positive,
    _short_error,
    _top_messages,
    _verify,
)
from lab_utils.timing import cpu_cores

TREND_FACTOR = 2.0  # the last window's median may be this many times the first's...
TREND_SLACK_MS = 10.0  # ...plus this (ms): jitter at a few ms is not a queue
DEFAULT_MAX_CONNECTIONS = 1000


# --- targets: what one request is --------------------------------------------------------------------------


class Target(Protocol):
    """One kind of request. ``open()`` and ``close()`` run in the load's event loop, around the run."""

    batch: int

    async def open(self) -> None: ...

    async def send(self) -> None: ...  # one request; raises when it failed

    async def close(self) -> None: ...


class HttpStatusError(Exception):
    """An HTTP answer with a status the target does not accept (401 from nginx, 429, 503...)."""


async def _close(target: Any, attr: str) -> None:
    """Close the target's client (a failing close does not fail the run) and forget it."""
    conn = getattr(target, attr)
    setattr(target, attr, None)
    if conn is not None:
        with contextlib.suppress(Exception):
            await conn.close()


class TritonTarget:
    """An inference request to Triton (directly, or through nginx: pass its API key in ``headers``).

    ``url``: ``host:port`` of the protocol's endpoint (``http://`` accepted); ``make_inputs``: as for
    ``load.run_load`` (a function giving ``{name: np.ndarray}``, or such a dict); ``verify(inputs, outputs)``
    raises on a wrong answer, which then counts as a failed request (``wrong answer: ...``).
    """

    def __init__(self, url: str, model: str, make_inputs: Callable[[], Mapping[str, np.ndarray]] |
                 Mapping[str, np.ndarray], *, protocol: str = "http", headers: Mapping[str, str] | None = None,
                 outputs: Sequence[str] | None = None, verify: Verify | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if protocol not in PROTOCOLS:
            raise ValueError(f"TritonTarget(protocol={protocol!r}): use one of {PROTOCOLS}")
        self.url, self.model, self.protocol = host_port(url), model, protocol
        self.payloads = _payloads(make_inputs)
        first = next(iter(self.payloads[0].values()))
        self.batch = int(first.shape[0]) if first.ndim else 1
        # gRPC metadata keys are lowercase; HTTP headers are case-insensitive anyway
        self.headers = {(k.lower() if protocol == "grpc" else k): v for k, v in (headers or {}).items()} or None
        self.outputs, self.verify = outputs, verify
        self.max_connections = check_int(max_connections, "max_connections", "TritonTarget")
        self._client: Any = None
        self._reqs: list[Any] = []
        self._k = 0

    async def open(self) -> None:
        tc = _module(self.protocol, aio=True)
        self._client = (tc.InferenceServerClient(self.url, conn_limit=self.max_connections)
                        if self.protocol == "http" else tc.InferenceServerClient(self.url))
        self._reqs = [build_request(tc, self.protocol, p, self.outputs, binary=True) for p in self.payloads]
        self._k = 0

    async def send(self) -> None:
        i = self._k % len(self._reqs)
        self._k += 1
        ins, outs = self._reqs[i]
        result = await self._client.infer(self.model, ins, outputs=outs, headers=self.headers)
        if self.verify is not None:
            _verify(self.verify, self.payloads[i], result, self.outputs, self.protocol)

    async def close(self) -> None:
        await _close(self, "_client")

    def __repr__(self) -> str:
        return f"TritonTarget({self.protocol}://{self.url}, model={self.model!r})"


class HttpTarget:
    """A plain HTTP request (aiohttp): ``method`` (POST with a ``body``, else GET) to ``url`` with ``headers``; an
    answer whose status is not in ``ok_status`` counts as failed, with the status and the body's start."""

    batch = 1

    def __init__(self, url: str, *, body: bytes | str | None = None, method: str | None = None,
                 headers: Mapping[str, str] | None = None, ok_status: Sequence[int] = (200,),
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpTarget(url={url!r}): give the full URL, e.g. http://127.0.0.1:8080/v2/health/ready")
        self.url = url
        self.body = body.encode() if isinstance(body, str) else body
        self.method = (method or ("POST" if body is not None else "GET")).upper()
        self.headers = dict(headers or {})
        self.ok_status = tuple(ok_status)
        self.max_connections = check_int(max_connections, "max_connections", "HttpTarget")
        self._session: Any = None

    async def open(self) -> None:
        try:
            import aiohttp
        except ImportError:
            raise ImportError("HttpTarget needs aiohttp: pip install aiohttp") from None
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections),
                                              timeout=aiohttp.ClientTimeout(total=None))

    async def send(self) -> None:
        async with self._session.request(self.method, self.url, data=self.body, headers=self.headers) as r:
            data = await r.read()
            if r.status not in self.ok_status:
                text = data[:80].decode(errors="replace").strip()
                raise HttpStatusError(f"HTTP {r.status}" + (f": {text}" if text else ""))

    async def close(self) -> None:
        await _close(self, "_session")

    def __repr__(self) -> str:
        return f"HttpTarget({self.method} {self.url})"


class FunctionTarget:
    """Any ``async def send()``: one request, raising when it failed."""

    batch = 1

    def __init__(self, fn: Callable[[], Awaitable[Any]]):
        self.fn = fn

    async def open(self) -> None:
        pass

    async def send(self) -> None:
        await self.fn()

    async def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"FunctionTarget({getattr(self.fn, '__name__', self.fn)!r})"


def as_target(target: Any) -> Any:
    """``target`` as a Target: one already, or an ``async def`` of no arguments."""
    if all(callable(getattr(target, m, None)) for m in ("open", "send", "close")):
        return target
    if inspect.iscoroutinefunction(target):
        return FunctionTarget(target)
    raise TypeError(f"target={target!r}: give a TritonTarget, an HttpTarget, or an `async def send()` of no arguments "
                    "that raises when the request failed")


# --- arrivals and argument checks --------------------------------------------------------------------------


def poisson_arrivals(rate_rps: float, duration_s: float, seed: int | None = 0) -> np.ndarray:
    """Intended send times (s from the start, ascending) of a Poisson process at ``rate_rps`` requests per second
    over ``duration_s``: exponential gaps of mean ``1 / rate_rps``; the same ``seed`` gives the same schedule."""
    rate = _positive(rate_rps, "rate_rps", "poisson_arrivals")
    duration = _positive(duration_s, "duration_s", "poisson_arrivals")
    rng = np.random.default_rng(seed)
    n = int(rate * duration + 6 * math.sqrt(rate * duration) + 16)  # enough gaps with near certainty
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    while t[-1] < duration:  # and if not, more
        t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / rate, n))])
    return t[t < duration]


# --- records and windows -------------------------------------------------------------------------------------


@dataclass
class OpenLoopWindow(Window):
    """One window of requests, by intended send time: ``requests`` answered and ``errors`` among them;
    ``throughput_infer_s`` = answers completed in the window (any window's requests) per second × batch."""

    offered_rps: float = 0.0  # requests whose send time fell in the window, per second
    achieved_rps: float = 0.0  # answers completed in the window, per second
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    timeouts: int = 0
    error_messages: dict[str, int] = field(default_factory=dict)


class _Records:
    """Every request of one run: intended (or actual, closed loop) send time, end, outcome; times relative to t0."""

    def __init__(self, warmup_s: float, window_s: float, n_windows: int, batch: int):
        self.warmup_s, self.window_s, self.n_windows, self.batch = warmup_s, window_s, n_windows, batch
        self.due: list[float] = []
        self.sent: list[float] = []
        self.end: list[float] = []
        self.ok: list[bool] = []
        self.msg: list[str] = []
        self.pending: Counter[int] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0

    def window_of(self, t: float) -> int:
        """-1: warm-up; n_windows: after the measured span."""
        w = math.floor((t - self.warmup_s) / self.window_s)
        return max(-1, min(w, self.n_windows))

    def begin(self, due: float) -> None:
        self.pending[self.window_of(due)] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def finish(self, due: float, sent: float, end: float, ok: bool, msg: str = "") -> None:
        self.due.append(due)
        self.sent.append(sent)
        self.end.append(end)
        self.ok.append(ok)
        self.msg.append(_short_error(msg) if not ok else "")
        self.pending[self.window_of(due)] -= 1
        self.in_flight -= 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(self.due, float), np.asarray(self.sent, float), np.asarray(self.end, float),
                np.asarray(self.ok, bool))

    def span(self, a: float, b: float) -> tuple[int, np.ndarray, int, Counter[str]]:
        """Of the requests due in [a, b): how many, the answered ones' latency (ms), answers completed in [a, b),
        and the failures' messages."""
        due, _, end, ok = self.arrays()
        mine = (due >= a) & (due < b)
        lat = (end[mine & ok] - due[mine & ok]) * 1e3
        msgs = Counter(m for m, sel in zip(self.msg, mine & ~ok, strict=True) if sel)
        return int(np.count_nonzero(mine)), lat, int(np.count_nonzero(ok & (end >= a) & (end < b))), msgs

    def window(self, w: int) -> OpenLoopWindow:
        a = self.warmup_s + w * self.window_s
        offered, lat, done, msgs = self.span(a, a + self.window_s)
        return OpenLoopWindow(
            index=w, seconds=self.window_s, requests=int(len(lat)), errors=int(sum(msgs.values())),
            throughput_infer_s=done * self.batch / self.window_s, **_latency(lat, 50, 95, 99),
            offered_rps=offered / self.window_s, achieved_rps=done / self.window_s,
            timeouts=sum(n for m, n in msgs.items() if _is_timeout(m)), error_messages=_top_messages(msgs))


def _is_timeout(msg: str) -> bool:
    return msg.startswith(("TimeoutError", "CancelledError")) or "DEADLINE_EXCEEDED" in msg


def is_stable(windows: Sequence[OpenLoopWindow], stability: float = 0.10) -> bool:
    """The stability rule: at least two windows; answered >= ``1 - stability`` of what was offered over them; the last
    window's median latency <= ``TREND_FACTOR`` × the first's + ``TREND_SLACK_MS`` (no queue building up)."""
    if len(windows) < 2:
        return False
    offered = sum(w.offered_rps for w in windows)
    achieved = sum(w.achieved_rps for w in windows)
    if not offered or achieved < (1 - stability) * offered:
        return False
    first, last = windows[0].p50_ms, windows[-1].p50_ms
    if not (math.isfinite(first) and math.isfinite(last)):
        return False
    return last <= TREND_FACTOR * first + TREND_SLACK_MS


@dataclass
class OpenLoopResult:
    """One open-loop (or closed-loop) run: numbers over the measured windows, after the warm-up."""

    mode: str  # "open" or "closed"
    target: str
    rate_rps: float | None  # the target rate (open loop)
    concurrency: int | None  # the clients (closed loop)
    offered_rps: float  # requests sent per second (by intended send time)
    achieved_rps: float  # successful answers completed per second
    throughput_infer_s: float  # achieved_rps × batch
    p50_ms: float  # latency from the intended send time (open loop), of answered requests
    p90_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    requests: int  # answered requests measured
    errors: int  # failed requests measured (timeouts included)
    timeouts: int
    error_messages: dict[str, int]  # {message: count}, summing to errors_total
    windows: list[OpenLoopWindow]
    stable: bool
    seconds: float  # measured time
    errors_total: int = 0  # warm-up included
    sent_total: int = 0  # every request, warm-up included
    send_lag_p99_ms: float = 0.0  # how late the client sent (open loop): large means the client, not the server, lags
    max_in_flight: int = 0
    batch: int = 1
    processes: int = 1  # client processes the schedule was dealt over (open loop)

    def percentile(self, q: int) -> float:
        """p50/p90/p95/p99 latency (ms) by number."""
        if q not in (50, 90, 95, 99):
            raise ValueError(f"percentile={q!r}: use 50, 90, 95 or 99")
        return float(getattr(self, f"p{q}_ms"))

    def to_row(self) -> dict[str, Any]:
        """A flat dict for a table."""
        row = {k: v for k, v in asdict(self).items() if k not in ("windows", "error_messages")}
        row["windows"] = len(self.windows)
        return row

    def __str__(self) -> str:
        load = f"{self.rate_rps:g} req/s offered" if self.mode == "open" else f"c={self.concurrency}"
        s = (f"{self.mode} loop {load}: {self.achieved_rps:,.1f} answered/s, p50 {self.p50_ms:.1f} ms, p95 "
             f"{self.p95_ms:.1f} ms, p99 {self.p99_ms:.1f} ms, {self.errors} errors ({self.timeouts} timeouts), "
             f"{'stable' if self.stable else 'NOT stable'}")
        if self.send_lag_p99_ms > 5:
            more = ("spread it: processes=None" if self.processes == 1 else
                    f"{self.processes} client processes: give more, or run the client where cores are free")
            s += (f"; the client sent late (p99 {self.send_lag_p99_ms:.0f} ms): it, not only the server, is saturated "
                  f"({more})")
        return s


def _result(rec: _Records, mode: str, target: str, rate: float | None, concurrency: int | None,
            windows: list[OpenLoopWindow], stability: float, processes: int = 1) -> OpenLoopResult:
    due, sent, _, ok = rec.arrays()
    span = rec.n_windows * rec.window_s
    offered, lat, done, measured = rec.span(rec.warmup_s, rec.warmup_s + span)
    all_msgs = Counter(m for m, good in zip(rec.msg, ok, strict=True) if not good)
    lag = (sent - due) * 1e3 if mode == "open" and len(due) else np.zeros(1)
    return OpenLoopResult(
        mode=mode, target=target, rate_rps=rate, concurrency=concurrency,
        offered_rps=offered / span, achieved_rps=done / span,
        throughput_infer_s=done * rec.batch / span,
        **_latency(lat, 50, 90, 95, 99), requests=int(len(lat)),
        errors=int(sum(measured.values())), timeouts=sum(n for m, n in measured.items() if _is_timeout(m)),
        error_messages=_top_messages(all_msgs), windows=windows, stable=is_stable(windows, stability),
        seconds=span, errors_total=int(sum(all_msgs.values())), sent_total=len(due),
        send_lag_p99_ms=float(np.percentile(lag, 99)), max_in_flight=rec.max_in_flight, batch=rec.batch,
        processes=processes)


# --- the runs ----------------------------------------------------------------------------------------------


async def _one(target: Any, rec: _Records, t0: float, due: float, timeout_s: float,
               clock: Callable[[], float] = time.perf_counter) -> None:
    """One request, recorded; ``clock``: ``time.monotonic`` where several client processes share a start."""
    sent = clock() - t0
    try:
        await asyncio.wait_for(target.send(), timeout_s)
    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
        rec.finish(due, sent, clock() - t0, False, f"TimeoutError: no answer within {timeout_s:g} s")
    except Exception as err:  # counted, never raised: the load goes on
        rec.finish(due, sent, clock() - t0, False, f"{type(err).__name__}: {err}")
    else:
        rec.finish(due, sent, clock() - t0, True)


async def _send_at(target: Any, rec: _Records, dues: np.ndarray, t0: float, timeout_s: float, cap: int,
                   clock: Callable[[], float], stop: threading.Event | None = None) -> None:
    """Send a request at each ``t0 + due`` (``clock``'s seconds) and await them all; one due while ``cap`` are in
    flight fails as "client limit" unsent."""
    tasks = set()
    for due in dues:
        if stop is not None and stop.is_set():
            break
        delay = t0 + due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        rec.begin(due)
        if rec.in_flight > cap:
            now = clock() - t0
            rec.finish(due, now, now, False, f"client limit: {cap} requests in flight (raise max_in_flight)")
            continue
        task = asyncio.ensure_future(_one(target, rec, t0, float(due), timeout_s, clock))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


class _Runner:
    """The event loop of one run, in a thread of its own (a notebook's loop is busy); finished windows are handed
    to the caller's thread through a queue, so ``on_window`` runs there, as in ``load.run_load``."""

    def __init__(self, rec: _Records, target: Any):
        self.rec, self.target = rec, target
        self.out: queue_mod.Queue[tuple[str, Any]] = queue_mod.Queue()
        self.stop = threading.Event()
        self.next_w = 0
        self.t0 = 0.0

    def _emit_ready(self, final: bool = False) -> None:
        now = time.perf_counter() - self.t0
        while self.next_w < self.rec.n_windows:
            w = self.next_w
            end_w = self.rec.warmup_s + (w + 1) * self.rec.window_s
            if not final and (now < end_w or self.rec.pending[w] > 0):
                return
            self.out.put(("window", self.rec.window(w)))
            self.next_w += 1

    async def _ticker(self) -> None:
        while True:
            self._emit_ready()
            await asyncio.sleep(min(0.05, self.rec.window_s / 5))

    async def main(self, body: Callable[[], Awaitable[None]]) -> None:
        await self.target.open()
        ticker = asyncio.ensure_future(self._ticker())
        try:
            await body()
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            await self.target.close()
        self._emit_ready(final=True)

    def run(self, body: Callable[[], Awaitable[None]], on_window: Callable[[OpenLoopWindow], None] | None,
            join_s: float) -> list[OpenLoopWindow]:
        def thread_main() -> None:
            try:
                asyncio.run(self.main(body))
            except BaseException as err:  # handed to the caller's thread
                self.out.put(("crash", err))
            finally:
                self.out.put(("done", None))

        th = threading.Thread(target=thread_main, name="nvlab-openloop", daemon=True)
        windows: list[OpenLoopWindow] = []
        th.start()
        try:
            while True:
                kind, value = self.out.get()
                if kind == "window":
                    windows.append(value)
                    if on_window is not None:
                        on_window(value)
                elif kind == "crash":
                    raise RuntimeError(f"the load generator failed: {type(value).__name__}: {value}") from value
                else:
                    break
        except BaseException:
            self.stop.set()  # an interrupt (or on_window raised): stop sending, let in-flight requests end
            th.join(timeout=join_s)
            raise
        th.join(timeout=join_s)
        return windows


def _checks(where: str, target: Any, duration_s: Any, warmup_s: Any, window_s: Any, timeout_s: Any, stability: Any
            ) -> tuple[_Records, float, float, float]:
    """The run's records (its warm-up and windows) for ``target``, and the checked duration, timeout and stability."""
    duration = _positive(duration_s, "duration_s", where)
    warmup = _positive(warmup_s, "warmup_s", where, zero_ok=True)
    window = _positive(window_s, "window_s", where)
    timeout = _positive(timeout_s, "timeout_s", where)
    if not (isinstance(stability, (int, float)) and math.isfinite(stability) and 0 < stability < 1):
        raise ValueError(f"{where}(stability={stability!r}): a fraction between 0 and 1, e.g. 0.10")
    n_windows = max(1, round(duration / window))
    rec = _Records(warmup, duration / n_windows, n_windows, int(getattr(target, "batch", 1)))
    return rec, duration, timeout, float(stability)


def run_open_loop(target: Any, rate_rps: float, duration_s: float, *, warmup_s: float = 1.0,
                  window_s: float = 1.0, seed: int | None = 0, timeout_s: float = 10.0, stability: float = 0.10,
                  max_in_flight: int = 10_000, processes: int | None = 1,
                  on_window: Callable[[OpenLoopWindow], None] | None = None) -> OpenLoopResult:
    """Send requests at Poisson times of mean rate ``rate_rps`` for ``warmup_s + duration_s`` seconds, whatever
    the server does, and measure each from its intended send time.

    The first ``warmup_s`` seconds are sent but not measured (their errors count in ``errors_total``). A request
    without an answer after ``timeout_s`` counts as a timeout; one due while ``max_in_flight`` are outstanding is
    counted as failed ("client limit") rather than sent. Every request is awaited before this returns.
    ``processes``: the schedule dealt over that many client processes (None: one per ``RPS_PER_PROCESS`` of the
    rate, up to the cores less one), for rates one Python event loop cannot send on time (its ``send_lag_p99_ms``
    says when); the target must pickle (``TritonTarget``, ``HttpTarget``) and ``on_window`` sees the windows at
    the end.
    """
    where = "run_open_loop"
    target = as_target(target)
    rate = _positive(rate_rps, "rate_rps", where)
    rec, duration, timeout, stability = _checks(where, target, duration_s, warmup_s, window_s, timeout_s, stability)
    cap = check_int(max_in_flight, "max_in_flight", where)
    arrivals = poisson_arrivals(rate, rec.warmup_s + duration, seed)
    n_proc = client_processes(rate, processes)
    if n_proc > 1:
        windows = _run_spread(target, rec, arrivals, n_proc, timeout, max(1, cap // n_proc))
        for w in windows if on_window is not None else ():
            on_window(w)
        return _result(rec, "open", repr(target), rate, None, windows, stability, n_proc)
    runner = _Runner(rec, target)

    async def body() -> None:
        runner.t0 = time.perf_counter() + 0.01
        await _send_at(target, rec, arrivals, runner.t0, timeout, cap, time.perf_counter, runner.stop)

    return _result(rec, "open", repr(target), rate, None, runner.run(body, on_window, timeout + 10), stability)


RPS_PER_PROCESS = 400  # requests/s one client process sends on time (an H200 run's single loop lagged at 750)
_SPREAD_START_S = 0.1  # s from the clients' meeting (all targets open) to the first send
_SPREAD_UP_S = 120.0  # s for the client processes to start (spawned: each imports the clients anew)


def client_processes(rate_rps: float, processes: int | None) -> int:
    """How many client processes send ``rate_rps``: ``processes`` as given, or (None) one per ``RPS_PER_PROCESS``
    up to this machine's cores less one."""
    if processes is None:
        return max(1, min(math.ceil(rate_rps / RPS_PER_PROCESS), cpu_cores() - 1))
    return check_int(processes, "processes", "run_open_loop")


def _send_schedule(target: Any, dues: np.ndarray, timeout_s: float, cap: int) -> tuple[list, ...]:
    """One client process's share of an open loop: open the target, wait until every client has (the barrier
    ``_client_up`` left), then send at ``t0 + due`` and return (due, sent, end, ok, message) lists, relative to
    this process's ``t0`` (the clients leave the barrier within milliseconds of each other)."""
    rec = _Records(0.0, 1.0, 1, 1)

    async def body() -> None:
        await target.open()  # imports and connections before the clock starts
        try:
            assert _BARRIER is not None, "a client process starts through _client_up"
            _BARRIER.wait(timeout=_SPREAD_UP_S)
            await _send_at(target, rec, dues, time.monotonic() + _SPREAD_START_S, timeout_s, cap, time.monotonic)
        finally:
            await target.close()

    asyncio.run(body())
    return rec.due, rec.sent, rec.end, rec.ok, rec.msg


_BARRIER: Any = None  # in a client process: where its clients meet before the first send


def _client_up(barrier: Any) -> None:
    """A client process's start: keep the barrier every client meets at once its target is open."""
    global _BARRIER
    _BARRIER = barrier


def _run_spread(target: Any, rec: _Records, arrivals: np.ndarray, n: int, timeout_s: float,
                cap: int) -> list[OpenLoopWindow]:
    """The schedule dealt round-robin over ``n`` spawned processes (a superposition of Poisson streams is the
    same Poisson stream), started together once every one has opened its target; their records merged into
    ``rec``."""
    import multiprocessing
    import pickle

    try:
        pickle.dumps(target)
    except Exception as err:
        raise TypeError(f"run_open_loop(processes={n}): the target {target!r} does not pickle ({err}): use a "
                        "TritonTarget or HttpTarget, or processes=1") from None
    ctx = multiprocessing.get_context("spawn")  # not fork: a notebook's threads and event loops stay behind
    pool = ctx.Pool(n, initializer=_client_up, initargs=(ctx.Barrier(n),))
    try:
        jobs = [pool.apply_async(_send_schedule, (target, arrivals[i::n], timeout_s, cap)) for i in range(n)]
        # every answer in by then: the clients' start, the schedule, the last request's timeout, and slack
        deadline = time.monotonic() + _SPREAD_UP_S + float(arrivals[-1] if len(arrivals) else 0.0) + timeout_s + 30
        try:
            parts = [j.get(timeout=max(1.0, deadline - time.monotonic())) for j in jobs]
        except threading.BrokenBarrierError:
            raise RuntimeError(f"run_open_loop(processes={n}): the client processes did not all start within "
                               f"{_SPREAD_UP_S:g} s: use fewer processes, or processes=1") from None
    finally:
        pool.terminate()  # an interrupt or a timeout leaves no client process sending
        pool.join()
    for due, sent, end, ok, msg in parts:
        for row in zip(due, sent, end, ok, msg, strict=True):
            rec.begin(row[0])
            rec.finish(*row[:4], row[4])
    return [rec.window(w) for w in range(rec.n_windows)]


def run_closed_loop(target: Any, concurrency: int, duration_s: float, *, warmup_s: float = 1.0,
                    window_s: float = 1.0, timeout_s: float = 10.0, stability: float = 0.10,
                    on_window: Callable[[OpenLoopWindow], None] | None = None) -> OpenLoopResult:
    """``concurrency`` clients, each sending its next request when its last one answered (a failed one after a 10 ms
    pause, as ``load.run_load``), for ``warmup_s + duration_s``; latency from the actual send. The same target and
    result as ``run_open_loop``, so only the arrival process differs between the two."""
    where = "run_closed_loop"
    target = as_target(target)
    concurrency = check_int(concurrency, "concurrency", where)
    rec, duration, timeout, stability = _checks(where, target, duration_s, warmup_s, window_s, timeout_s, stability)
    runner = _Runner(rec, target)
    end_s = rec.warmup_s + duration

    async def client(t0: float) -> None:
        while not runner.stop.is_set():
            due = time.perf_counter() - t0
            if due >= end_s:
                return
            rec.begin(due)
            await _one(target, rec, t0, due, timeout)
            if not rec.ok[-1]:
                await asyncio.sleep(ERROR_BACKOFF_S)  # a dead server is not spun against

    async def body() -> None:
        runner.t0 = t0 = time.perf_counter()
        await asyncio.gather(*(client(t0) for _ in range(concurrency)))

    windows = runner.run(body, on_window, join_s=timeout + 10)
    return _result(rec, "closed", repr(target), None, concurrency, windows, stability)


# --- closed against open -------------------------------------------------------------------------------------


@dataclass
class LoopComparison:
    """The same server measured closed-loop, then open-loop at ``rate_rps`` (a fraction of the closed loop's
    throughput): ``understatement`` = open p95 / closed p95, how far the closed loop hides the queue."""

    closed: OpenLoopResult
    open: OpenLoopResult
    rate_rps: float
    understatement: float

    def table(self) -> pd.DataFrame:
        cols = ["mode", "concurrency", "rate_rps", "offered_rps", "achieved_rps", "p50_ms", "p95_ms", "p99_ms",
                "errors", "stable"]
        return pd.DataFrame([{c: r.to_row()[c] for c in cols} for r in (self.closed, self.open)])

    def __str__(self) -> str:
        return (f"closed loop (c={self.closed.concurrency}): {self.closed.achieved_rps:.1f} req/s, p95 "
                f"{self.closed.p95_ms:.1f} ms; open loop at {self.rate_rps:.1f} req/s: p95 {self.open.p95_ms:.1f} ms "
                f"({self.understatement:.1f}x the closed loop's)")


def compare_loops(target: Any, *, concurrency: int = 1, rate_rps: float | None = None, rate_fraction: float = 0.9,
                  duration_s: float = 5.0, warmup_s: float = 1.0, window_s: float = 1.0, seed: int | None = 0,
                  timeout_s: float = 10.0, progress: Callable[..., Any] | None = None) -> LoopComparison:
    """Closed loop at ``concurrency``, then open loop at ``rate_rps`` (default: ``rate_fraction`` of the closed
    loop's throughput: the same load, arriving as users do) against the same target. ``progress``: a hook such as
    ``lab_utils.widgets.progress``, advanced once per loop run (None: no display)."""
    if not (isinstance(rate_fraction, (int, float)) and 0 < rate_fraction <= 2):
        raise ValueError(f"compare_loops(rate_fraction={rate_fraction!r}): a fraction of the closed loop's "
                         "throughput, e.g. 0.9")
    kw = {"duration_s": duration_s, "warmup_s": warmup_s, "window_s": window_s, "timeout_s": timeout_s}
    phases = ("closed loop", "open loop")
    ticks = iter(progress(phases, total=len(phases), desc="closed then open loop") if progress is not None
                 else phases)
    next(ticks)
    closed = run_closed_loop(target, concurrency, **kw)  # type: ignore[arg-type]
    rate = rate_rps if rate_rps is not None else rate_fraction * closed.achieved_rps
    if not rate or not math.isfinite(rate):
        raise RuntimeError(f"the closed loop got no answer ({closed.errors} errors: {closed.error_messages}): "
                           "is the server up?")
    next(ticks)
    opened = run_open_loop(target, rate, seed=seed, **kw)  # type: ignore[arg-type]
    next(ticks, None)  # the hook's loop ends: its display closes
    ratio = opened.p95_ms / closed.p95_ms if closed.p95_ms else float("nan")
    return LoopComparison(closed, opened, float(rate), float(ratio))


# --- the SLO and capacity ------------------------------------------------------------------------------------


def meets_slo(result: OpenLoopResult, slo_ms: float, percentile: int = 95,
              stability: float = 0.10) -> tuple[bool, str]:
    """Whether an open-loop run holds the SLO: something answered, no request failed (timeouts included), the run is
    stable (``is_stable``: the server kept up, no queue building), and the ``percentile`` latency <= ``slo_ms``.
    Returns (passed, why in words)."""
    q = result.percentile(percentile)
    at = f"at {result.rate_rps:g} req/s" if result.rate_rps is not None else ""
    if result.requests == 0:
        return False, f"nothing answered {at} ({result.errors} errors)"
    if result.errors:
        top = next(iter(result.error_messages), "")
        return False, f"{result.errors} requests failed {at} (e.g. {top})"
    if not is_stable(result.windows, stability):
        first, last = result.windows[0].p50_ms, result.windows[-1].p50_ms
        return False, (f"not stable {at}: answered {result.achieved_rps:.1f} of {result.offered_rps:.1f} req/s "
                       f"offered, median {first:.1f} ms in the first window and {last:.1f} ms in the last")
    if not q <= slo_ms:
        return False, f"p{percentile} {q:.1f} ms > SLO {slo_ms:g} ms {at}"
    return True, f"p{percentile} {q:.1f} ms <= SLO {slo_ms:g} ms {at}, no errors, stable"


@dataclass
class CapacityResult:
    """The highest rate found to meet the SLO (``capacity_rps``; 0 when even ``lo_rps`` fails), every rate tried
    (``steps``), and whether the answer lies inside the range searched (``bounded``: ``hi_rps`` failed)."""

    capacity_rps: float
    slo_ms: float
    percentile: int
    bounded: bool
    steps: list[dict[str, Any]]
    best: OpenLoopResult | None = None

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.steps)

    def __str__(self) -> str:
        if not self.capacity_rps:
            return f"no rate tried meets p{self.percentile} <= {self.slo_ms:g} ms: {self.steps[0]['why']}"
        more = "" if self.bounded else " (the highest rate tried: raise hi_rps to find the limit)"
        return (f"capacity {self.capacity_rps:.1f} req/s at p{self.percentile} <= {self.slo_ms:g} ms after "
                f"{len(self.steps)} runs{more}")


def find_capacity(target: Any, slo_ms: float = 100.0, *, lo_rps: float, hi_rps: float, duration_s: float = 5.0,
                  warmup_s: float = 1.0, window_s: float = 1.0, percentile: int = 95, tolerance: float = 0.05,
                  max_steps: int = 10, seed: int | None = 0, timeout_s: float | None = None, stability: float = 0.10,
                  on_step: Callable[[dict[str, Any]], None] | None = None,
                  progress: Callable[..., Any] | None = None, processes: int | None = 1) -> CapacityResult:
    """The highest open-loop rate whose ``percentile`` latency stays under ``slo_ms`` (``meets_slo``), by bisection.

    ``lo_rps`` is tried first (fails: capacity 0), then ``hi_rps`` (passes: capacity ``hi_rps``, unbounded); then the
    middle of the range, halving it until it is narrower than ``tolerance`` × its top, or ``max_steps`` runs.
    ``timeout_s`` defaults to 20 × the SLO (at least 2 s): a request that late has failed the SLO anyway. After a
    failed rate the server's queue is drained (one request at a time until one answers within the SLO) before the
    next run, so a backlog does not count against the next rate. ``progress``: a hook such as
    ``lab_utils.widgets.progress`` (``progress(iterable, total=, desc=)``), advanced once per rate tried (None:
    no display). ``processes``: client processes per probe, as for ``run_open_loop`` (None: by the rate).
    """
    where = "find_capacity"
    slo = _positive(slo_ms, "slo_ms", where)
    lo = _positive(lo_rps, "lo_rps", where)
    hi = _positive(hi_rps, "hi_rps", where)
    if hi <= lo:
        raise ValueError(f"find_capacity(lo_rps={lo_rps!r}, hi_rps={hi_rps!r}): hi_rps must be above lo_rps")
    if percentile not in (50, 90, 95, 99):
        raise ValueError(f"find_capacity(percentile={percentile!r}): use 50, 90, 95 or 99")
    tol = _positive(tolerance, "tolerance", where)
    steps_max = check_int(max_steps, "max_steps", where, minimum=2)
    timeout = timeout_s if timeout_s is not None else max(2.0, 20 * slo / 1e3)
    target = as_target(target)
    steps: list[dict[str, Any]] = []
    results: dict[float, OpenLoopResult] = {}

    def probe(rate: float) -> bool:
        r = run_open_loop(target, rate, duration_s, warmup_s=warmup_s, window_s=window_s,
                          seed=None if seed is None else seed + len(steps), timeout_s=timeout, stability=stability,
                          processes=processes)
        ok, why = meets_slo(r, slo, percentile, stability)
        step = {"step": len(steps) + 1, "rate_rps": rate, "passed": ok, "achieved_rps": r.achieved_rps,
                "p50_ms": r.p50_ms, "p95_ms": r.p95_ms, "p99_ms": r.p99_ms, "errors": r.errors, "stable": r.stable,
                "why": why}
        steps.append(step)
        results[rate] = r
        if on_step is not None:
            on_step(step)
        if not ok:
            drain(target, slo, limit_s=timeout + 5)
        return ok

    # lo_rps, then hi_rps, then bisection: one probe per pass of this loop (at most max_steps), each pass deciding
    # first whether the last probe ended the search, so that a progress hook counts every rate tried
    tries = range(steps_max)
    tries_iter = iter(progress(tries, total=steps_max, desc="capacity search") if progress is not None else tries)
    passed: list[bool] = []
    try:
        for i in tries_iter:
            if (i == 1 and not passed[0]) or (i == 2 and passed[1]) or (i >= 2 and not hi - lo > tol * hi):
                break
            rate = lo if i == 0 else hi if i == 1 else (lo + hi) / 2
            passed.append(probe(rate))
            if i >= 2:
                if passed[-1]:
                    lo = rate
                else:
                    hi = rate
    finally:  # the hook's bar or line ends with the search, however it ends
        close = getattr(tries_iter, "close", None)
        if close is not None:
            close()
    if not passed[0]:
        return CapacityResult(0.0, slo, percentile, True, steps, None)
    if passed[1]:
        return CapacityResult(hi, slo, percentile, False, steps, results[hi])
    return CapacityResult(lo, slo, percentile, True, steps, results[lo])


def drain(target: Any, slo_ms: float, limit_s: float = 10.0) -> bool:
    """Send one request at a time until one answers within ``slo_ms`` (the server's queue is empty again), at most
    ``limit_s`` seconds; whether one did."""
    target = as_target(target)

    async def main() -> bool:
        await target.open()
        try:
            end = time.perf_counter() + limit_s
            while time.perf_counter() < end:
                t = time.perf_counter()
                try:
                    await asyncio.wait_for(target.send(), max(0.01, end - t))
                except Exception:  # a failing server: pause, as the closed loop does
                    await asyncio.sleep(ERROR_BACKOFF_S)
                    continue
                if (time.perf_counter() - t) * 1e3 <= slo_ms:
                    return True
            return False
        finally:
            await target.close()

    sender = Background(lambda: asyncio.run(main()), name="nvlab-openloop-drain")
    sender.thread.join(limit_s + 10)
    return bool(sender.result)


__all__ = ["poisson_arrivals", "run_open_loop", "run_closed_loop", "compare_loops", "meets_slo", "find_capacity",
           "drain", "is_stable", "OpenLoopResult", "OpenLoopWindow", "LoopComparison", "CapacityResult",
           "TritonTarget", "HttpTarget", "FunctionTarget", "HttpStatusError", "Target", "as_target"]
