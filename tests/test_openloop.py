"""The load engine's open loop (and the closed loop beside it) against real servers: a one-worker HTTP server with a
fixed service time (so the queueing math is known), Triton through the tritonclient asyncio clients, and a server that
is down. Poisson arrivals, latency from the intended send time, errors and timeouts counted, the capacity search."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
from _retry import tried

from lab_utils.procs import free_port, popen_owned, stop_group, wait_http_ok
from lab_utils.serving import capacity, load
from lab_utils.serving.capacity import compare_loops, find_capacity, meets_slo
from lab_utils.serving.load import LoadResult, Window, poisson_arrivals, run_closed_loop, run_open_loop
from lab_utils.serving.targets import HttpTarget, TritonTarget

# One worker: requests wait in FIFO order (asyncio.Lock is fair) for SERVICE_MS each, an M/D/1 queue. The service is
# a sleep, so the machine's two cores stay free for the client. /health skips the queue (readiness).
BACKEND = r"""
import asyncio, sys
from aiohttp import web
port, service_s, name = int(sys.argv[1]), float(sys.argv[2]) / 1e3, sys.argv[3]
lock = asyncio.Lock()
async def work(request):
    await request.read()
    if request.path != "/health" and service_s > 0:
        async with lock:
            await asyncio.sleep(service_s)
    return web.Response(text=name)
app = web.Application(client_max_size=64 * 2**20)
app.router.add_route("*", "/{tail:.*}", work)
web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, handle_signals=True)
"""

SERVICE_MS = 20.0


class Backend:
    """A real HTTP server in an owned process (stopped with its group)."""

    def __init__(self, service_ms: float = 0.0, name: str = "backend"):
        self.port = free_port()
        self.name = name
        self.proc = popen_owned([sys.executable, "-c", BACKEND, str(self.port), str(service_ms), name])
        if not wait_http_ok(f"{self.url}/health", self.proc, timeout_s=20):
            raise RuntimeError(f"test backend exited with code {self.proc.returncode}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_group(self.proc, grace_s=2.0)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="module")
def slow():
    with Backend(SERVICE_MS, "slow") as b:
        yield b


def test_poisson_arrivals_mean_gap_and_seed():
    t = poisson_arrivals(200.0, 20.0, seed=1)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert len(t) == pytest.approx(4000, rel=0.06)  # 4000 ± 4 sigma
    assert gaps.mean() == pytest.approx(1 / 200, rel=0.05)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.1)  # exponential: the spread equals the mean
    assert np.all(np.diff(t) > 0) and t[-1] < 20.0
    assert np.array_equal(t, poisson_arrivals(200.0, 20.0, seed=1))
    assert not np.array_equal(t[:50], poisson_arrivals(200.0, 20.0, seed=2)[:50])


def _twenty_per_s(slow, seen: list[Window], processes: int = 1) -> LoadResult:
    """2 s at 20 req/s in windows of 0.5 s (about ten requests each); ``seen`` gets this run's windows only."""
    seen.clear()
    return run_open_loop(HttpTarget(slow.url), 20.0, 2.0, warmup_s=0.5, window_s=0.5, seed=3, processes=processes,
                         on_window=seen.append)


def _steady(r: LoadResult) -> bool:
    # measured again when the other workers' load delayed the client or the backend: a window's median of ten
    # requests moved past twice the first's (a CI run: not stable with the two client processes' lag p99 at 37 ms)
    return r.stable and r.send_lag_p99_ms < 60


def _windows(r: LoadResult) -> str:
    return f"{r}; the windows' medians {[round(w.p50_ms) for w in r.windows]} ms, lag p99 {r.send_lag_p99_ms:.0f} ms"


def test_sends_follow_the_schedule_and_every_request_is_counted(slow):
    seen: list[Window] = []
    r = tried(lambda: _twenty_per_s(slow, seen), _steady, why=_windows)
    expected = len(poisson_arrivals(20.0, 2.5, seed=3))
    assert r.sent_total == expected and r.errors_total == 0  # nothing dropped, nothing added
    assert r.requests == sum(w.requests for w in r.windows) and len(r.windows) == 4 and seen == r.windows
    assert r.offered_rps == pytest.approx(20.0, rel=0.5) and r.achieved_rps == pytest.approx(r.offered_rps, rel=0.3)
    # rho = 0.4: a short queue. Bounds leave room for a busy CI machine (two test workers on two cores).
    assert SERVICE_MS <= r.p50_ms <= r.p95_ms <= r.p99_ms < 400
    assert r.send_lag_p99_ms < 60 and r.stable and meets_slo(r, 400)[0]
    assert "open loop 20 req/s offered" in str(r) and r.to_row()["mode"] == "open"


def test_the_schedule_dealt_over_client_processes_is_the_same_schedule(slow):
    """Two spawned client processes send one seeded Poisson schedule between them: every request counted once, the
    windows and latencies as from one process, and no client process left after the run."""
    import psutil

    seen: list[Window] = []
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    r = tried(lambda: _twenty_per_s(slow, seen, processes=2), _steady, why=_windows)
    assert r.sent_total == len(poisson_arrivals(20.0, 2.5, seed=3)) and r.errors_total == 0
    assert len(r.windows) == 4 and seen == r.windows and r.requests == sum(w.requests for w in r.windows)
    assert r.achieved_rps == pytest.approx(r.offered_rps, rel=0.3) and SERVICE_MS <= r.p50_ms <= r.p99_ms < 400
    assert r.send_lag_p99_ms < 60 and r.stable and r.processes == 2 and r.to_row()["processes"] == 2
    # multiprocessing's resource tracker stays until this interpreter exits (one per interpreter, not a client)
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in before and c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())]
    assert not left, left
    assert load._auto_processes("open", 10.0) == 1
    assert 1 <= load._auto_processes("open", 1e6) <= max(1, os.cpu_count() - 1)
    with pytest.raises(ValueError, match="processes"):
        run_open_loop(HttpTarget(slow.url), 20.0, 1.0, processes=0)

    async def local():
        pass

    with pytest.raises(TypeError, match="does not pickle.*processes=1"):
        run_open_loop(local, 20.0, 1.0, processes=2)


def test_open_loop_sees_the_queue_the_closed_loop_hides(slow):
    """One worker at 20 ms: closed loop with one client measures 20 ms and 50 req/s. Poisson arrivals at 90 % of
    that (M/D/1, rho = 0.9) wait on average rho / (2 mu (1 - rho)) = 90 ms before service: p95 several times
    higher. The closed loop never sees that queue."""
    # measured again when a burst of the other workers' load slowed the closed loop's one client (CI runs: p95 54 ms
    # against the bound of 50; p95 47 ms at 39 req/s, so 90 % of that rate loaded the 50 req/s worker to 70 %, not
    # 90 %, and the open loop's p95 of 104 ms fell short of 2.5x); three misses are a real fault
    cmp = tried(lambda: compare_loops(HttpTarget(slow.url), concurrency=1, rate_fraction=0.9, duration_s=2.5,
                                      warmup_s=0.3, window_s=0.5, seed=0),
                lambda c: c.closed.p95_ms < 2 * SERVICE_MS + 10 and c.open.p95_ms > 2.5 * c.closed.p95_ms,
                why=lambda c: f"closed: {c.closed}; open: {c.open}")
    closed, opened = cmp.closed, cmp.open
    # one client never beats one worker; a busy machine adds client time per request (36.8 req/s seen in CI)
    assert 0.5 * 1e3 / SERVICE_MS < closed.achieved_rps < 1.1 * 1e3 / SERVICE_MS
    assert closed.p95_ms < 2 * SERVICE_MS + 10
    assert cmp.rate_rps == pytest.approx(0.9 * closed.achieved_rps)
    assert opened.p95_ms > 2.5 * closed.p95_ms and cmp.understatement > 2.5
    assert closed.errors == opened.errors == 0
    table = cmp.table()
    assert list(table["mode"]) == ["closed", "open"] and "understat" not in table.columns
    assert "x the closed loop's" in str(cmp)


def test_overload_is_not_stable_and_timeouts_are_counted(slow):
    # 80 req/s offered to a 50 req/s server: the queue grows ~0.6 s per second; 0.4 s timeouts catch it
    r = run_open_loop(HttpTarget(slow.url), 80.0, 1.5, warmup_s=0.2, window_s=0.5, timeout_s=0.4, seed=5)
    assert r.timeouts > 0 and r.errors >= r.timeouts
    assert any(m.startswith("TimeoutError: no answer within 0.4 s") for m in r.error_messages)
    assert sum(r.error_messages.values()) == r.errors_total
    assert r.requests + r.errors == round(r.offered_rps * r.seconds)  # every measured request is accounted for
    ok, why = meets_slo(r, 100)
    assert not ok and "failed" in why
    capacity.drain(HttpTarget(slow.url), SERVICE_MS * 3, limit_s=5)  # leave the module's server idle


def test_errors_are_counted_when_the_server_is_down():
    down = f"http://127.0.0.1:{free_port()}/"
    r = run_open_loop(HttpTarget(down), 50.0, 1.0, warmup_s=0.2, window_s=0.5, seed=0)
    assert r.requests == 0 and r.errors == round(r.offered_rps * r.seconds) > 0
    assert r.errors_total == r.sent_total == len(poisson_arrivals(50.0, 1.2, seed=0))
    assert any("ClientConnectorError" in m or "Cannot connect" in m for m in r.error_messages)
    ok, why = meets_slo(r, 100)
    assert not r.stable and not ok and why.startswith("nothing answered at 50 req/s")
    closed = run_closed_loop(HttpTarget(down), 2, 0.5, warmup_s=0.1, window_s=0.25)
    assert closed.requests == 0 and closed.errors > 0  # backs off 10 ms per failure, does not spin


def test_a_lagging_open_loop_loses_no_request_to_a_window_handed_over_early():
    """A sender behind its schedule (a loaded machine) schedules its last requests after their window has ended;
    the ticker's flush may run before those tasks start. Each request is pending from the moment it is scheduled,
    so the window waits for it (once, under load: 53 of 54 requests counted)."""
    import asyncio
    import queue

    from lab_utils.serving.senders import Plan, Sender

    class Refused:
        async def send(self):
            raise ConnectionRefusedError("down")

    dues = np.linspace(0.0, 0.9, 10)
    out: queue.Queue = queue.Queue()
    sender = Sender(Refused(), Plan("open", 0.0, 0.5, 2, 1.0, dues=dues), out, threading.Event(), None, None)

    async def run():
        sender.t0 = time.monotonic() - 5.0  # 5 s behind: every due is past, its window over, nothing sleeps

        async def flusher():  # the ticker at its worst: a flush between the scheduling and the start of each task
            while True:
                sender._flush()
                await asyncio.sleep(0)

        f = asyncio.ensure_future(flusher())
        await asyncio.sleep(0)
        await sender._open()
        f.cancel()
        sender._flush(final=True)

    asyncio.run(run())
    rows = []
    while not out.empty():
        rows += out.get_nowait()[3]
    assert len(rows) == len(dues) and not any(ok for *_, ok, _ in rows), rows


def test_http_status_errors_and_a_plain_async_function(slow):
    calls = []

    async def send():
        calls.append(1)
        if len(calls) % 2:
            raise ValueError("odd request refused")

    r = run_open_loop(send, 40.0, 0.5, warmup_s=0.1, window_s=0.25, seed=1)
    assert r.errors_total == (len(calls) + 1) // 2 and r.error_messages == {"ValueError: odd request refused":
                                                                            r.errors_total}
    bad = run_open_loop(HttpTarget(slow.url, ok_status=(204,)), 10.0, 0.5, warmup_s=0.1, window_s=0.25)
    assert list(bad.error_messages) == ["HttpStatusError: HTTP 200: slow"]


def test_find_capacity_bisects_on_the_rate(slow):
    """The 20 ms server holds about 50 req/s; with a 150 ms p95 SLO the capacity lies around 35 to 45 req/s."""
    def search():
        steps.clear()
        # 1 s windows: at 10 req/s a shorter window holds a handful of requests, too few for the stability
        # rule's medians
        return find_capacity(HttpTarget(slow.url), 150.0, lo_rps=10.0, hi_rps=70.0, duration_s=3.0, warmup_s=0.3,
                             window_s=1.0, tolerance=0.3, on_step=steps.append)

    steps: list = []
    # A burst of load on the CI machine once slowed the one-worker server at 10 req/s (median 23 -> 59 ms: "a
    # queue"): the lowest rate failing is the machine, not the bisection, so the search gets three tries.
    cap = tried(search, lambda c: bool(c.steps) and c.steps[0]["passed"])
    assert cap.bounded and steps == cap.steps and steps[0]["rate_rps"] == 10.0 and steps[0]["passed"]
    assert steps[1]["rate_rps"] == 70.0 and not steps[1]["passed"]
    # about 40 on a quiet machine; a loaded CI machine slows the one-worker server, so only the bracket is fixed
    assert 10.0 <= cap.capacity_rps <= 55.0 and cap.best is not None and cap.best.p95_ms <= 150.0
    assert all(s["passed"] == (s["rate_rps"] <= cap.capacity_rps) for s in steps)
    assert "capacity" in str(cap) and len(cap.table()) == len(steps)


def test_bad_arguments():
    t = HttpTarget("http://127.0.0.1:1/")
    for kw, match in [({"rate_rps": 0}, "rate_rps=0"), ({"rate_rps": float("nan")}, "rate_rps=nan"),
                      ({"duration_s": -1}, "duration_s=-1"), ({"timeout_s": 0}, "timeout_s=0"),
                      ({"stability": 1.5}, "stability=1.5"), ({"max_in_flight": 0}, "max_in_flight=0")]:
        args = {"rate_rps": 10.0, "duration_s": 1.0, **kw}
        with pytest.raises(ValueError, match=rf"run_open_loop\({match}"):
            run_open_loop(t, **args)
    with pytest.raises(TypeError, match="async def send"):
        run_open_loop(lambda: None, 1.0, 1.0)
    with pytest.raises(ValueError, match="full URL"):
        HttpTarget("127.0.0.1:8000")
    with pytest.raises(ValueError, match="hi_rps must be above lo_rps"):
        find_capacity(t, 100, lo_rps=50, hi_rps=10)
    with pytest.raises(ValueError, match=r"run_closed_loop\(concurrency=0\)"):
        run_closed_loop(t, 0, 1.0)


def test_triton_target_http_and_grpc(shared_triton):
    def right(inputs, outputs):
        assert outputs["OUTPUT__0"].shape == (1, 3)

    def make():
        return {"INPUT__0": np.random.rand(1, 4).astype(np.float32)}

    before = {t.name for t in threading.enumerate()}
    server = shared_triton.server
    for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
        target = TritonTarget(url, "tiny", make, protocol=protocol, outputs=["OUTPUT__0"], verify=right)
        r = run_open_loop(target, 50.0, 0.6, warmup_s=0.2, window_s=0.3, seed=0)
        # Both protocols answer, verified; the latency bound only catches a pathology (a hung request), not
        # speed: beside other test workers the client itself sends 170 ms late at times.
        assert r.requests > 12 and r.errors_total == 0 and r.p95_ms < 1000, (protocol, r)
    wrong = TritonTarget(server.grpc_url, "tiny", {"INPUT__0": np.zeros((1, 5), np.float32)}, protocol="grpc")
    r = run_open_loop(wrong, 20.0, 0.5, warmup_s=0.1, window_s=0.25)
    assert r.requests == 0 and any("unexpected shape" in m for m in r.error_messages)
    assert "nvlab-load" not in {t.name for t in threading.enumerate()} - before


def test_compare_loops_advances_its_progress_hook_per_loop(monkeypatch, capsys):
    from types import SimpleNamespace

    from lab_utils import widgets

    ran = []
    monkeypatch.setattr(capacity, "run_closed_loop", lambda *a, **k: ran.append("closed") or SimpleNamespace(
        achieved_rps=50.0, p95_ms=2.0, errors=0, error_messages={}))
    monkeypatch.setattr(capacity, "run_open_loop", lambda *a, **k: ran.append("open") or SimpleNamespace(p95_ms=5.0))
    plain = compare_loops(object())
    assert capsys.readouterr().out == "" and ran == ["closed", "open"] and plain.understatement == 2.5
    compare_loops(object(), progress=widgets.progress)
    assert "closed then open loop: 2 steps in " in capsys.readouterr().out


def test_a_probe_shorter_than_three_windows_is_cut_into_three_and_can_hold_the_slo(slow):
    """A capacity probe of 1.5 s in windows of 1 s was two windows, which the stability rule (three) never calls
    stable: every rate missed the SLO and lab 07's quick ResNet-50 search found a capacity of 0 on a GPU."""
    # stability is measured: a busy machine once slowed the last window (median 22.5 ms, then 56.4 ms in CI)
    r = tried(lambda: run_open_loop(HttpTarget(slow.url), 20.0, 1.5, warmup_s=0.5, window_s=1.0, seed=4),
              lambda r: r.stable and meets_slo(r, 400)[0], why=lambda r: meets_slo(r, 400)[1])
    assert len(r.windows) == 3 and [w.seconds for w in r.windows] == pytest.approx([0.5] * 3)
    assert r.stable and meets_slo(r, 400)[0], meets_slo(r, 400)[1]
