"""The load engine against a real Triton server, in both modes: counts, percentiles, the statistics-API split,
client processes, refused and wrong answers, and a server killed mid-load (errors counted, never raised)."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from _triton import require_server, tiny_repo

from lab_utils.serving import load as triton_load
from lab_utils.serving.client import server_split
from lab_utils.serving.load import Window, is_stable, run_closed_loop, run_load, run_open_loop
from lab_utils.serving.senders import Plan, Sender
from lab_utils.serving.server import TritonServer
from lab_utils.serving.targets import TritonTarget


@pytest.fixture(scope="module")
def server(shared_triton):
    return shared_triton.server  # `tiny`, dynamic batching on


def make_inputs():
    return {"INPUT__0": np.random.rand(1, 4).astype(np.float32)}


def run_mode(mode, url, inputs=make_inputs, *, protocol="grpc", **kw):
    """The same Triton load in either mode: 4 clients (closed) or 100 requests/s (open)."""
    target = TritonTarget(url, "tiny", inputs, protocol=protocol, outputs=kw.pop("outputs", None),
                          verify=kw.pop("verify", None))
    if mode == "closed":
        return run_closed_loop(target, kw.pop("concurrency", 4), kw.pop("duration_s", None), **kw)
    return run_open_loop(target, kw.pop("rate_rps", 100.0), kw.pop("duration_s", 0.9), **kw)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_run_load_counts_and_percentiles(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    seen = []
    r = run_load(url, "tiny", make_inputs, 4, protocol=protocol, window_s=0.3, warmup_s=0.2, max_windows=4,
                 stats_url=server.http_url, on_window=seen.append)
    assert r.mode == "closed" and r.requests > 20 and r.errors == 0 and r.errors_total == 0 and r.error_messages == {}
    assert r.throughput_infer_s == pytest.approx(r.requests / r.seconds, rel=0.2)
    assert 0 < r.p50_ms <= r.p90_ms <= r.p95_ms <= r.p99_ms
    assert 3 <= len(r.windows) <= 4 and seen == r.windows and isinstance(r.stable, bool)
    assert r.stable == is_stable(r.windows[-3:], 0.10, "closed") and r.seconds == pytest.approx(0.9)
    s = r.server
    assert s is not None and s["requests"] > 0 and s["batch_avg"] >= 1.0
    assert s["compute_infer_us"] > 0 and s["queue_us"] >= 0 and s["request_us"] >= s["compute_infer_us"]
    row = r.to_row()
    assert row["concurrency"] == 4 and row["server_batch_avg"] == s["batch_avg"] and "p95_ms" in row
    assert "infer/s" in str(r)


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_both_modes_count_every_request_and_read_the_servers_split(server, mode):
    """Each window's requests add up to the run's; the statistics API's count over the measured windows is the
    client's (it is read at the windows' edges); the open loop sends at the rate asked."""
    seen = []
    r = run_mode(mode, server.grpc_url, duration_s=0.9, window_s=0.3, warmup_s=0.2, stats_url=server.http_url,
                 on_window=seen.append)
    assert r.mode == mode and len(r.windows) == 3 and seen == r.windows and r.errors_total == 0
    assert r.requests == sum(w.requests for w in r.windows) > 20 and r.requests + r.errors == sum(
        w.sent for w in r.windows)
    assert r.sent_total >= r.requests and r.max_in_flight >= 1
    assert r.server is not None and r.server["requests"] == pytest.approx(r.requests, rel=0.5)
    if mode == "open":
        assert r.rate_rps == 100.0 and r.offered_rps == pytest.approx(100.0, rel=0.4)
        assert r.achieved_rps == pytest.approx(r.offered_rps, rel=0.3) and r.concurrency is None
    else:
        assert r.concurrency == 4 and r.rate_rps is None and r.send_lag_p99_ms == 0.0


def test_fixed_duration_and_batch_rows(server):
    batch4 = {"INPUT__0": np.random.rand(4, 4).astype(np.float32)}  # a dict: the same request every time
    r = run_load(server.grpc_url, "tiny", batch4, 2, duration_s=0.6, window_s=0.2, warmup_s=0.1,
                 stats_url=server.http_url)
    assert len(r.windows) == 3 and r.seconds == pytest.approx(0.6) and r.batch == 4
    assert r.throughput_infer_s == pytest.approx(4 * r.achieved_rps)  # inferences, not requests


def test_client_processes(server):
    """Two spawned client processes share the clients (the open loop's schedule over processes: test_openloop.py)."""
    r = run_mode("closed", server.grpc_url, duration_s=0.9, window_s=0.3, warmup_s=0.2, processes=2,
                 stats_url=server.http_url)
    assert r.processes == 2 and r.requests > 10 and r.errors_total == 0 and len(r.windows) == 3
    assert r.server is not None and r.server["requests"] > 10


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_refused_requests_are_counted_with_their_message(server, mode):
    wrong = {"INPUT__0": np.random.rand(1, 5).astype(np.float32)}
    r = run_mode(mode, server.grpc_url, wrong, duration_s=0.6, window_s=0.2, warmup_s=0.1)
    assert r.requests == 0 and r.errors > 0 and r.errors_total >= r.errors and not r.stable
    assert any("unexpected shape" in m for m in r.error_messages)


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_server_killed_mid_load_is_counted_not_raised(tmp_path, mode):
    require_server()
    repo = tiny_repo(tmp_path)
    with TritonServer(repo) as server:
        windows = []

        def kill_after_first(w):
            windows.append(w)
            if w.requests and server.alive():
                os.kill(server.pid, signal.SIGKILL)

        r = run_mode(mode, server.grpc_url, duration_s=1.5, window_s=0.3, warmup_s=0.5, stats_url=server.http_url,
                     on_window=kill_after_first)
        assert not server.alive()
        assert any(w.requests for w in r.windows)
        assert r.windows[-1].requests == 0 and r.windows[-1].errors > 0 and not r.stable
        assert r.errors > 0 and any("UNAVAILABLE" in m or "unavailable" in m.lower() for m in r.error_messages)
        assert sum(r.error_messages.values()) == r.errors_total >= r.errors  # every error has its message
        assert r.server is None  # the split needs the server at the last window's edge; the load numbers stand


def test_stability_rule():
    """One rule, both modes: three windows; answered >= 90 % of what was sent; no queue building; and in a closed
    loop, throughput and mean latency agreeing within 10 % (perf_analyzer's rule)."""
    def ws(*tputs, p50=1.0, sent=None, answered=None):
        return [Window(i, 1.0, int(t if answered is None else answered), 0, t, mean_ms=p50, p50_ms=p50,
                       sent=int(t if sent is None else sent)) for i, t in enumerate(tputs)]

    for mode in ("closed", "open"):
        assert is_stable(ws(100, 105, 98), 0.10, mode)
        assert not is_stable(ws(100, 100), 0.10, mode)  # three windows are needed
        assert is_stable(ws(50, 100, 105, 98), 0.10, mode)  # the last three count
        assert not is_stable(ws(0, 0, 0), 0.10, mode)  # nothing served is not a stable measurement
        assert not is_stable(ws(100, 100, 100, sent=120, answered=100), 0.10, mode)  # fell behind, or failed
        queue = ws(100, 100, 100)
        queue[0].p50_ms, queue[1].p50_ms, queue[2].p50_ms = 20.0, 40.0, 80.0
        assert not is_stable(queue, 0.10, mode)  # a queue building up
        jitter = ws(100, 100, 100)
        jitter[2].p50_ms = 9.0
        assert is_stable(jitter, 0.10, "open")  # a few ms of jitter is not a queue (the mean agrees in a closed loop)
    # the throughput and the mean latency must agree in a closed loop; an open loop's rate is its schedule's
    assert not is_stable(ws(100, 115, 98), 0.10, "closed") and is_stable(ws(100, 115, 98), 0.10, "open")
    mixed = ws(100, 100, 100)
    mixed[1].mean_ms = 2.0
    assert not is_stable(mixed, 0.10, "closed") and is_stable(mixed, 0.10, "open")


def test_server_split_arithmetic():
    def snap(n, ns, q, infer, execs):
        return {"inference_count": n, "execution_count": execs, "inference_stats": {
            "success": {"count": n, "ns": ns}, "queue": {"count": n, "ns": q},
            "compute_input": {"count": execs, "ns": 0}, "compute_infer": {"count": execs, "ns": infer},
            "compute_output": {"count": execs, "ns": 0}}}

    s = server_split(snap(10, 1_000_000, 0, 0, 10), snap(110, 11_000_000, 2_000_000, 5_000_000, 35))
    assert s["requests"] == 100 and s["request_us"] == pytest.approx(100)
    assert s["queue_us"] == pytest.approx(20) and s["compute_infer_us"] == pytest.approx(50)
    assert s["batch_avg"] == pytest.approx(4.0) and s["executions"] == 25


def test_bad_arguments():
    with pytest.raises(ValueError, match="protocol"):
        run_load("x:1", "m", make_inputs, 1, protocol="udp")
    with pytest.raises(ValueError, match="concurrency"):
        run_load("x:1", "m", make_inputs, 0)
    nan = float("nan")
    for conc in (-2, 1.5, nan, True):
        with pytest.raises(ValueError, match=r"run_closed_loop\(concurrency=.*\): must be an integer >= 1"):
            run_load("x:1", "m", make_inputs, conc)
    bad_seconds = [("duration_s", nan), ("duration_s", 0), ("duration_s", -1.0), ("duration_s", float("inf")),
                   ("window_s", nan), ("window_s", 0), ("warmup_s", -0.1), ("warmup_s", nan), ("timeout_s", 0),
                   ("timeout_s", nan)]
    for arg, value in bad_seconds:  # before: NaN passed every check (NaN <= 0 is False) and failed later, unnamed
        with pytest.raises(ValueError, match=rf"run_closed_loop\({arg}=.*\): must be a finite number of seconds"):
            run_load("x:1", "m", make_inputs, 1, **{arg: value})
    with pytest.raises(ValueError, match=r"run_closed_loop\(processes=0\)"):
        run_load("x:1", "m", make_inputs, 1, processes=0)
    with pytest.raises(ValueError, match=r"run_closed_loop\(max_windows=2\): must be an integer >= 3"):
        run_load("x:1", "m", make_inputs, 1, max_windows=2)
    with pytest.raises(ValueError, match=r"run_closed_loop\(stability=nan\)"):
        run_load("x:1", "m", make_inputs, 1, stability=nan)
    with pytest.raises(TypeError, match="numpy"):
        run_load("x:1", "m", lambda: {"INPUT__0": [1, 2]}, 1)


def test_a_windows_errors_and_their_messages_are_taken_together():
    """A request belongs to the window of its send time: a dead server failing fast fills window 1 before window 0
    is read, and window 0 keeps its own count and messages."""
    sender = Sender(None, Plan("open", warmup_s=0.5, window_s=1.0, n_windows=3, timeout_s=1.0), None, None, None, None)
    assert [sender.window_of(t) for t in (0.0, 0.49, 0.5, 1.49, 1.5, 9.0)] == [-1, -1, 0, 0, 1, 2]
    book = triton_load._Book(warmup_s=0.5, window_s=1.0, n_windows=3, batch=1)
    book.add(-1, [(0.1, 0.1, 0.2, False, "warm-up failure")])
    book.add(0, [(0.6, 0.6, 0.7, False, "refused"), (0.7, 0.7, 0.8, True, "")])
    book.add(1, [(1.6, 1.6, 1.7, False, "unavailable")] * 3)
    w0, w1 = book.window(0), book.window(1)
    assert (w0.sent, w0.requests, w0.errors, w0.error_messages) == (2, 1, 1, {"refused": 1})
    assert (w1.sent, w1.requests, w1.errors, w1.error_messages) == (3, 0, 3, {"unavailable": 3})
    assert w0.p50_ms == pytest.approx(100.0) and w0.achieved_rps == 1.0 and book.window(2).sent == 0


def test_error_messages_past_the_top_ten_keep_their_count():
    from collections import Counter

    msgs = Counter({f"error {i}": i + 1 for i in range(12)})  # 12 distinct messages, 78 errors
    top = triton_load._top_messages(msgs)
    assert len(top) == 11 and top[triton_load.OTHER_MESSAGES] == 1 + 2 and sum(top.values()) == 78
    assert triton_load._top_messages(Counter({"a": 2})) == {"a": 2}


def test_no_thread_left_behind(server):
    before = {t.name for t in threading.enumerate()}
    run_load(server.grpc_url, "tiny", make_inputs, 2, window_s=0.2, warmup_s=0.1, max_windows=3)
    assert "nvlab-load" not in {t.name for t in threading.enumerate()} - before


def test_verify_counts_wrong_answers_and_passes_right_ones(server):
    def right(inputs, outputs):
        assert outputs["OUTPUT__0"].shape == (1, 3)

    def wrong(inputs, outputs):
        raise ValueError("rows of another request")

    ok = run_load(server.grpc_url, "tiny", make_inputs, 2, duration_s=0.4, window_s=0.2, warmup_s=0.1, verify=right,
                  outputs=["OUTPUT__0"])
    assert ok.requests > 0 and ok.errors_total == 0
    bad = run_load(server.grpc_url, "tiny", make_inputs, 2, duration_s=0.4, window_s=0.2, warmup_s=0.1, verify=wrong)
    assert bad.requests == 0 and bad.errors > 0
    assert list(bad.error_messages) == ["WrongAnswer: wrong answer: rows of another request"]
