"""The closed-loop load generator against a real server: counts, percentiles, the statistics-API split, the
stability rule, client processes, and a server killed mid-load (errors counted, never raised)."""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading

import numpy as np
import pytest
from _triton import quick_stop, require_server, tiny_repo  # noqa: F401 (an autouse fixture)

from lab_utils.compat.glibc import glibc_version
from lab_utils.serving import load as triton_load
from lab_utils.serving.load import Window, run_load, server_split
from lab_utils.serving.server import TritonServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_server()
    repo = tiny_repo(tmp_path_factory.mktemp("load"), dynamic_batching=True)
    with TritonServer(repo) as s:
        yield s


def make_inputs():
    return {"INPUT__0": np.random.rand(1, 4).astype(np.float32)}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_run_load_counts_and_percentiles(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    seen = []
    r = run_load(url, "tiny", make_inputs, 4, protocol=protocol, window_s=0.3, warmup_s=0.2, max_windows=4,
                 stats_url=server.http_url, on_window=seen.append)
    assert r.requests > 20 and r.errors == 0 and r.errors_total == 0 and r.error_messages == {}
    assert r.throughput_infer_s == pytest.approx(r.requests / r.seconds)
    assert 0 < r.p50_ms <= r.p90_ms <= r.p95_ms <= r.p99_ms
    assert 3 <= len(r.windows) <= 4 and seen == r.windows and isinstance(r.stable, bool)
    assert r.stable == triton_load._stable(r.windows, 0.10)
    s = r.server
    assert s is not None and s["requests"] > 0 and s["batch_avg"] >= 1.0
    assert s["compute_infer_us"] > 0 and s["queue_us"] >= 0 and s["request_us"] >= s["compute_infer_us"]
    row = r.to_row()
    assert row["concurrency"] == 4 and row["server_batch_avg"] == s["batch_avg"] and "p95_ms" in row
    assert "infer/s" in str(r)


def test_fixed_duration_and_batch_rows(server):
    batch4 = {"INPUT__0": np.random.rand(4, 4).astype(np.float32)}  # a dict: the same request every time
    r = run_load(server.grpc_url, "tiny", batch4, 2, duration_s=0.6, window_s=0.2, warmup_s=0.1,
                 stats_url=server.http_url)
    assert len(r.windows) == 3 and r.seconds == pytest.approx(0.6) and r.batch == 4
    assert r.throughput_infer_s == pytest.approx(4 * r.requests / r.seconds)  # inferences, not requests


def test_client_processes(server):
    r = run_load(server.grpc_url, "tiny", make_inputs, 2, window_s=0.3, warmup_s=0.2, max_windows=3, processes=2,
                 stats_url=server.http_url)
    assert r.processes == 2 and r.requests > 10 and r.errors == 0


def test_refused_requests_are_counted_with_their_message(server):
    wrong = {"INPUT__0": np.random.rand(1, 5).astype(np.float32)}
    r = run_load(server.grpc_url, "tiny", wrong, 1, window_s=0.2, warmup_s=0.1, max_windows=3)
    assert r.requests == 0 and r.errors > 0 and r.errors_total >= r.errors
    assert any("unexpected shape" in m for m in r.error_messages)


def test_server_killed_mid_load_is_counted_not_raised(tmp_path):
    require_server()
    repo = tiny_repo(tmp_path)
    with TritonServer(repo) as server:
        windows = []

        def kill_after_first(w):
            windows.append(w)
            if w.requests and server.alive():
                os.kill(server.pid, signal.SIGKILL)

        r = run_load(server.grpc_url, "tiny", make_inputs, 3, duration_s=1.5, window_s=0.3, warmup_s=0.5,
                     stats_url=server.http_url, on_window=kill_after_first)
        assert not server.alive()
        assert any(w.requests for w in r.windows)
        assert r.windows[-1].requests == 0 and r.windows[-1].errors > 0
        assert r.errors > 0 and any("UNAVAILABLE" in m or "unavailable" in m.lower() for m in r.error_messages)
        assert sum(r.error_messages.values()) == r.errors_total >= r.errors  # every error has its message
        assert r.server is None or r.server["requests"] >= 0  # the split needs the server; the load numbers stand


def test_stability_rule():
    def ws(*tputs, lat=1.0):
        return [Window(i, 1.0, int(t), 0, t, lat, lat) for i, t in enumerate(tputs)]

    assert triton_load._stable(ws(100, 105, 98), 0.10)
    assert not triton_load._stable(ws(100, 115, 98), 0.10)
    assert not triton_load._stable(ws(100, 100), 0.10)  # three windows are needed
    assert triton_load._stable(ws(50, 100, 105, 98), 0.10)  # the last three count
    assert not triton_load._stable(ws(0, 0, 0), 0.10)  # nothing served is not a stable measurement
    mixed = ws(100, 100, 100)
    mixed[1].mean_ms = 2.0
    assert not triton_load._stable(mixed, 0.10)  # latency must agree too


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
        with pytest.raises(ValueError, match=r"run_load\(concurrency=.*\): must be an integer >= 1"):
            run_load("x:1", "m", make_inputs, conc)
    bad_seconds = [("duration_s", nan), ("duration_s", 0), ("duration_s", -1.0), ("duration_s", float("inf")),
                   ("window_s", nan), ("window_s", 0), ("warmup_s", -0.1), ("warmup_s", nan), ("timeout_s", 0),
                   ("timeout_s", nan)]
    for arg, value in bad_seconds:  # before: NaN passed every check (NaN <= 0 is False) and failed later, unnamed
        with pytest.raises(ValueError, match=rf"run_load\({arg}=.*\): must be a finite number of seconds"):
            run_load("x:1", "m", make_inputs, 1, **{arg: value})
    with pytest.raises(ValueError, match=r"run_load\(processes=0\)"):
        run_load("x:1", "m", make_inputs, 1, processes=0)
    with pytest.raises(ValueError, match=r"run_load\(max_windows=2\): must be an integer >= 3"):
        run_load("x:1", "m", make_inputs, 1, max_windows=2)
    with pytest.raises(ValueError, match=r"run_load\(stability=nan\)"):
        run_load("x:1", "m", make_inputs, 1, stability=nan)
    with pytest.raises(TypeError, match="numpy"):
        run_load("x:1", "m", lambda: {"INPUT__0": [1, 2]}, 1)


def test_a_windows_errors_and_their_messages_are_taken_together():
    sink = triton_load._Sink(t0=100.0, window_s=1.0)
    sink.add(99.0, 99.5, False, "warm-up failure")  # window -1
    sink.add(100.0, 100.5, False, "refused")  # window 0
    sink.add(100.0, 100.6, True)
    for _ in range(3):  # a dead server fails fast: window 1 fills before window 0 is taken
        sink.add(101.0, 101.2, False, "unavailable")
    lat, errs, msgs = sink.take(0)
    assert len(lat) == 1 and errs == 1 and msgs == {"refused": 1}  # before: window 1's messages came along
    assert sink.take(1)[1:] == (3, {"unavailable": 3}) and sink.take(-1)[1:] == (1, {"warm-up failure": 1})
    assert sink.take(2)[1:] == (0, {})


def test_error_messages_past_the_top_ten_keep_their_count():
    from collections import Counter

    msgs = Counter({f"error {i}": i + 1 for i in range(12)})  # 12 distinct messages, 78 errors
    top = triton_load._top_messages(msgs)
    assert len(top) == 11 and top[triton_load.OTHER_MESSAGES] == 1 + 2 and sum(top.values()) == 78
    assert triton_load._top_messages(Counter({"a": 2})) == {"a": 2}


def test_perf_analyzer_command():
    cmd = triton_load.perf_analyzer_command("mlp", "http://127.0.0.1:8001", [4, 8, 12])
    assert cmd.startswith("perf_analyzer -m mlp -u 127.0.0.1:8001 -i grpc")
    assert cmd.endswith("--concurrency-range 4:12:4") and "--stability-percentage 10" in cmd
    loop = triton_load.perf_analyzer_command("mlp", "127.0.0.1:8000", [1, 4, 16], protocol="http", shape="INPUT__0:64")
    assert loop.startswith("for c in 1 4 16; do perf_analyzer") and "--concurrency-range $c; done" in loop
    assert "-i http" in loop and "--shape INPUT__0:64" in loop
    assert "--percentile 95" in cmd
    avg = triton_load.perf_analyzer_command("mlp", "h:1", [8], percentile=None, max_trials=6, csv_path="pa.csv")
    assert "--percentile" not in avg and "--max-trials 6" in avg and avg.endswith("-f pa.csv --concurrency-range 8:8:1")


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


# --- perf_analyzer beside the generator --------------------------------------------------------------------

# perf_analyzer's -f report as its report writer emits it (perf_analyzer 2.60, src/report_writer.cc): the concurrency,
# Inferences/Second, Client Send, the server statistics (Network+Server Send/Recv, Server Queue, Server Compute
# Input/Infer/Output), Client Recv, then p50/p90/p95/p99 latency; times in µs, rows sorted by throughput. This
# is a run of `--concurrency-range 8:16:8` against the lab's MLP (python backend, dynamic batching).
PA_CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,\
Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency
8,1380.2,19,1102,1203,35,3050,22,5,5725,6312,6593,7210
16,1794.6,21,1337,3561,38,3790,25,6,8803,9981,10433,11702
"""
# --verbose-csv without --percentile adds Avg latency, request/response and response wait; a decoupled model adds
# Response Throughput, the response cache Server Cache Hit/Miss.
PA_CSV_VERBOSE = """\
Concurrency,Inferences/Second,Response Throughput,Client Send,Network+Server Send/Recv,Server Queue,\
Server Compute Input,Server Compute Infer,Server Compute Output,Server Cache Hit,Server Cache Miss,Client Recv,\
p50 latency,p90 latency,p95 latency,p99 latency,Avg latency,request/response,response wait
4,912.4,912.4,17,980,402,33,2810,20,0,0,5,4310,4702,4866,5390,4381,22,4344
"""

# --request-rate-range 3000 --request-distribution poisson against an ensemble through nginx: the first column is the
# offered rate; the server columns stay empty (the ensemble's steps carry them).
PA_CSV_OPEN = """\
Request Rate,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,\
Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency
3000,2991.3,61,,,,,,9,12210,31502,52104,88311
"""


def test_parse_perf_analyzer_csv():
    rows = triton_load.parse_perf_analyzer_csv(PA_CSV, "perf_analyzer -m mlp")
    assert [r.concurrency for r in rows] == [8, 16]  # by concurrency, whatever the file's order
    r = rows[1]
    assert r.throughput_infer_s == pytest.approx(1794.6)
    assert (r.p50_ms, r.p90_ms, r.p95_ms, r.p99_ms) == pytest.approx((8.803, 9.981, 10.433, 11.702))
    assert r.server_queue_us == 3561 and r.server_compute_infer_us == 3790 and r.network_server_us == 1337
    assert r.client_send_us == 21 and r.client_recv_us == 6 and r.avg_ms is None and r.command == "perf_analyzer -m mlp"
    assert r.to_row()["p95_ms"] == pytest.approx(10.433) and "command" not in r.to_row()
    # Little's law holds in the sample: concurrency / throughput is about the average latency
    assert 16 / r.throughput_infer_s * 1e3 == pytest.approx(r.p50_ms, rel=0.05)
    (v,) = triton_load.parse_perf_analyzer_csv(PA_CSV_VERBOSE)
    assert v.concurrency == 4 and v.avg_ms == pytest.approx(4.381) and v.server_queue_us == 402
    header = PA_CSV.splitlines()[0]
    assert triton_load.parse_perf_analyzer_csv(header) == []  # nothing stable: perf_analyzer writes no row
    with pytest.raises(ValueError, match="Concurrency or Request Rate"):
        triton_load.parse_perf_analyzer_csv("Batch,Inferences/Second\n100,99.5\n")
    (o,) = triton_load.parse_perf_analyzer_csv(PA_CSV_OPEN)
    assert o.request_rate == 3000 and o.concurrency == 0 and o.throughput_infer_s == pytest.approx(2991.3)
    assert o.p95_ms == pytest.approx(52.104) and o.server_queue_us is None  # an ensemble: its steps hold the split
    with pytest.raises(ValueError, match="p95 latency"):
        triton_load.parse_perf_analyzer_csv("Concurrency,Inferences/Second,Client Send,Client Recv\n1,2,3,4\n")


def test_perf_analyzer_status_here_is_real():
    """No stand-in: what this machine says. Where it does not run, the reason names glibc and what to do."""
    status = triton_load.perf_analyzer_status()
    if status.runnable:  # the GPU runner, an NGC image
        assert status.path and status.version and not status.reason
        return
    assert not status.runnable and "perf_analyzer does not run here" in str(status)
    glibc = glibc_version()
    if status.path is None and glibc is not None and glibc < (2, 38):
        assert f"glibc {glibc[0]}.{glibc[1]}" in status.reason and "2.38" in status.reason
        assert "pip install perf-analyzer" in status.reason and "sdk image" in status.reason
    with pytest.raises(triton_load.PerfAnalyzerError, match="does not run here"):
        if status.path is None:
            triton_load.run_perf_analyzer("mlp", "127.0.0.1:1", 1)
        raise triton_load.PerfAnalyzerError(str(status))


def _fake_perf_analyzer(tmp_path, body, folder="bin"):
    fake = tmp_path / folder / "perf_analyzer"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\n{body}")
    fake.chmod(0o755)
    return fake


def test_a_perf_analyzer_that_cannot_start_is_reported_with_its_words(tmp_path, monkeypatch):
    # what the wheel's binary prints on Debian 12 (glibc 2.36), and its exit code
    _fake_perf_analyzer(tmp_path, "import sys\nsys.stderr.write(\"perf_analyzer: /lib/x86_64-linux-gnu/libc.so.6: "
                                  "version `GLIBC_2.38' not found (required by perf_analyzer)\\n\")\nsys.exit(1)\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(triton_load, "find_perf_analyzer", lambda: str(tmp_path / "bin" / "perf_analyzer"))
    status = triton_load.perf_analyzer_status()
    assert not status.runnable and "GLIBC_2.38' not found" in status.reason and "--version failed" in status.reason


def test_run_perf_analyzer_command_and_report(tmp_path, monkeypatch):
    """The argv perf_analyzer gets and its CSV read back (a stand-in that writes the recorded report)."""
    fake = _fake_perf_analyzer(tmp_path, f"""import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Perf Analyzer Version 2.60.0 (commit abc)"); sys.exit(0)
open(args[args.index("-f") + 1], "w").write({PA_CSV!r})
print("args:", " ".join(args))
""")
    monkeypatch.setattr(triton_load, "find_perf_analyzer", lambda: str(fake))
    status = triton_load.perf_analyzer_status()
    assert status.runnable and status.version == "2.60.0"
    r = triton_load.run_perf_analyzer("mlp", "127.0.0.1:8001", 8, window_ms=500, max_trials=4)
    assert r.concurrency == 8 and r.p95_ms == pytest.approx(6.593)
    assert r.command.startswith("perf_analyzer -m mlp -u 127.0.0.1:8001 -i grpc --measurement-interval 500 ")
    assert "--max-trials 4" in r.command and "--percentile" not in r.command  # the average, as run_load
    assert r.command.endswith("-f perf.csv --concurrency-range 8:8:1")
    nothing = _fake_perf_analyzer(tmp_path, "import sys\nprint(' '.join(sys.argv[1:]))\nprint('Failed to obtain "
                                            "stable measurement within 4 measurement windows for concurrency 8.')\n"
                                            "sys.exit(2)\n", "unstable")
    with pytest.raises(triton_load.PerfAnalyzerError, match="(?s)no stable measurement.*interval 1000 .*max-trials 3"):
        triton_load.run_perf_analyzer("mlp", "127.0.0.1:8001", 8, binary=str(nothing), window_ms=500, max_trials=4,
                                      extensions=1, extension_trials=3)  # tried again with windows twice as long
    broken = _fake_perf_analyzer(tmp_path, "import sys\nprint('error: failed to connect')\nsys.exit(99)\n", "broken")
    with pytest.raises(triton_load.PerfAnalyzerError, match="(?s)exited with code 99 and wrote no report.*connect"):
        triton_load.run_perf_analyzer("mlp", "127.0.0.1:8001", 8, binary=str(broken), extensions=2)


def test_perf_analyzer_in_an_open_loop_sends_the_targets_requests(tmp_path, monkeypatch):
    """Open loop through nginx: the rate, Poisson arrivals, the API key header over HTTP, and the payloads written as
    --input-data that Triton's own deserializer reads back byte for byte (a stand-in checks them; the GPU runner's
    lab 07 runs the real one)."""
    from tritonclient.utils import deserialize_bytes_tensor

    photos = [b"\xff\xd8jpeg-one\xff\xd9", b"\xff\xd8a longer jpeg two\x00\xff\xd9"]
    payloads = [{"IMAGE": np.array([[p]], dtype=object)} for p in photos]
    seen = tmp_path / "seen.json"
    fake = _fake_perf_analyzer(tmp_path, f"""import shutil, sys
args = sys.argv[1:]
shutil.copy(args[args.index("--input-data") + 1], {str(seen)!r})
open(args[args.index("-f") + 1], "w").write({PA_CSV_OPEN!r})
""")
    r = triton_load.run_perf_analyzer("svc", "http://127.0.0.1:8080", request_rate=3000, payloads=payloads,
                                      headers={"X-API-Key": "k1"}, protocol="http", binary=str(fake))
    assert r.request_rate == 3000 and r.p95_ms == pytest.approx(52.104)
    assert "-i http" in r.command and "-H X-API-Key:k1" in r.command and "--input-data input.json" in r.command
    assert r.command.endswith("--request-rate-range 3000 --request-distribution poisson --async --max-threads 16")
    data = json.loads(seen.read_text())["data"]
    got = [deserialize_bytes_tensor(base64.b64decode(d["IMAGE"]["content"]["b64"]))[0] for d in data]
    assert got == photos and all(d["IMAGE"]["shape"] == [1] for d in data)
    numbers = triton_load.perf_analyzer_input_data(tmp_path / "n.json", [{"X": np.arange(6.0).reshape(1, 2, 3)}])
    assert json.loads(open(numbers).read())["data"][0]["X"] == {"content": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
                                                                 "shape": [2, 3]}
    with pytest.raises(ValueError, match="only over HTTP"):
        triton_load.perf_analyzer_command("svc", "h:1", request_rate=10, headers={"X-API-Key": "k"})
    with pytest.raises(ValueError, match="concurrencies .* or request_rate"):
        triton_load.perf_analyzer_command("svc", "h:1")
