"""perf_analyzer beside the course's load engine: its command, its CSV report, whether it runs here (no stand-in),
and a stand-in binary for the arguments it gets and the report read back."""

from __future__ import annotations

import base64
import json
import os
import sys

import numpy as np
import pytest

from lab_utils.compat.glibc import glibc_version
from lab_utils.serving import perf_analyzer as pa


def test_perf_analyzer_command():
    cmd = pa.perf_analyzer_command("mlp", "http://127.0.0.1:8001", [4, 8, 12])
    assert cmd.startswith("perf_analyzer -m mlp -u 127.0.0.1:8001 -i grpc")
    assert cmd.endswith("--concurrency-range 4:12:4") and "--stability-percentage 10" in cmd
    loop = pa.perf_analyzer_command("mlp", "127.0.0.1:8000", [1, 4, 16], protocol="http", shape="INPUT__0:64")
    assert loop.startswith("for c in 1 4 16; do perf_analyzer") and "--concurrency-range $c; done" in loop
    assert "-i http" in loop and "--shape INPUT__0:64" in loop
    assert "--percentile 95" in cmd
    avg = pa.perf_analyzer_command("mlp", "h:1", [8], percentile=None, max_trials=6, csv_path="pa.csv")
    assert "--percentile" not in avg and "--max-trials 6" in avg and avg.endswith("-f pa.csv --concurrency-range 8:8:1")



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
    rows = pa.parse_perf_analyzer_csv(PA_CSV, "perf_analyzer -m mlp")
    assert [r.concurrency for r in rows] == [8, 16]  # by concurrency, whatever the file's order
    r = rows[1]
    assert r.throughput_infer_s == pytest.approx(1794.6)
    assert (r.p50_ms, r.p90_ms, r.p95_ms, r.p99_ms) == pytest.approx((8.803, 9.981, 10.433, 11.702))
    assert r.server_queue_us == 3561 and r.server_compute_infer_us == 3790 and r.network_server_us == 1337
    assert r.client_send_us == 21 and r.client_recv_us == 6 and r.avg_ms is None and r.command == "perf_analyzer -m mlp"
    assert r.to_row()["p95_ms"] == pytest.approx(10.433) and "command" not in r.to_row()
    # Little's law holds in the sample: concurrency / throughput is about the average latency
    assert 16 / r.throughput_infer_s * 1e3 == pytest.approx(r.p50_ms, rel=0.05)
    (v,) = pa.parse_perf_analyzer_csv(PA_CSV_VERBOSE)
    assert v.concurrency == 4 and v.avg_ms == pytest.approx(4.381) and v.server_queue_us == 402
    header = PA_CSV.splitlines()[0]
    assert pa.parse_perf_analyzer_csv(header) == []  # nothing stable: perf_analyzer writes no row
    with pytest.raises(ValueError, match="Concurrency or Request Rate"):
        pa.parse_perf_analyzer_csv("Batch,Inferences/Second\n100,99.5\n")
    (o,) = pa.parse_perf_analyzer_csv(PA_CSV_OPEN)
    assert o.request_rate == 3000 and o.concurrency == 0 and o.throughput_infer_s == pytest.approx(2991.3)
    assert o.p95_ms == pytest.approx(52.104) and o.server_queue_us is None  # an ensemble: its steps hold the split
    with pytest.raises(ValueError, match="p95 latency"):
        pa.parse_perf_analyzer_csv("Concurrency,Inferences/Second,Client Send,Client Recv\n1,2,3,4\n")


def test_perf_analyzer_status_here_is_real():
    """No stand-in: what this machine says. Where it does not run, the reason names glibc and what to do."""
    status = pa.perf_analyzer_status()
    if status.runnable:  # the GPU runner, an NGC image
        assert status.path and status.version and not status.reason
        return
    assert not status.runnable and "perf_analyzer does not run here" in str(status)
    glibc = glibc_version()
    if status.path is None and glibc is not None and glibc < (2, 38):
        assert f"glibc {glibc[0]}.{glibc[1]}" in status.reason and "2.38" in status.reason
        assert "pip install perf-analyzer" in status.reason and "sdk image" in status.reason
    with pytest.raises(pa.PerfAnalyzerError, match="does not run here"):
        if status.path is None:
            pa.run_perf_analyzer("mlp", "127.0.0.1:1", 1)
        raise pa.PerfAnalyzerError(str(status))


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
    monkeypatch.setattr(pa, "find_perf_analyzer", lambda: str(tmp_path / "bin" / "perf_analyzer"))
    status = pa.perf_analyzer_status()
    assert not status.runnable and "GLIBC_2.38' not found" in status.reason and "--version failed" in status.reason


def test_the_wheels_version_is_named_where_its_binary_says_0_0_0(tmp_path, monkeypatch):
    """The PyPI wheel's perf_analyzer prints "Perf Analyzer Version 0.0.0": the status names the package's release."""
    fake = _fake_perf_analyzer(tmp_path, 'print("Perf Analyzer Version 0.0.0 (commit unknown)")\n')
    monkeypatch.setattr(pa, "find_perf_analyzer", lambda: str(fake))
    monkeypatch.setattr(pa, "dist_version", lambda *names: "2.60.0" if names == ("perf-analyzer",) else None)
    assert pa.perf_analyzer_status().version == "2.60.0"
    monkeypatch.setattr(pa, "dist_version", lambda *names: None)  # a binary from elsewhere: its own words
    assert pa.perf_analyzer_status().version == "0.0.0"


def test_run_perf_analyzer_command_and_report(tmp_path, monkeypatch):
    """The argv perf_analyzer gets and its CSV read back (a stand-in that writes the recorded report)."""
    fake = _fake_perf_analyzer(tmp_path, f"""import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Perf Analyzer Version 2.60.0 (commit abc)"); sys.exit(0)
open(args[args.index("-f") + 1], "w").write({PA_CSV!r})
print("args:", " ".join(args))
""")
    monkeypatch.setattr(pa, "find_perf_analyzer", lambda: str(fake))
    status = pa.perf_analyzer_status()
    assert status.runnable and status.version == "2.60.0"
    r = pa.run_perf_analyzer("mlp", "127.0.0.1:8001", 8, window_ms=500, max_trials=4)
    assert r.concurrency == 8 and r.p95_ms == pytest.approx(6.593)
    assert r.command.startswith("perf_analyzer -m mlp -u 127.0.0.1:8001 -i grpc --measurement-interval 500 ")
    assert "--max-trials 4" in r.command and "--percentile" not in r.command  # the average, as the closed loop
    assert r.command.endswith("-f perf.csv --concurrency-range 8:8:1")
    nothing = _fake_perf_analyzer(tmp_path, "import sys\nprint(' '.join(sys.argv[1:]))\nprint('Failed to obtain "
                                            "stable measurement within 4 measurement windows for concurrency 8.')\n"
                                            "sys.exit(2)\n", "unstable")
    with pytest.raises(pa.PerfAnalyzerError, match="(?s)no stable measurement.*interval 1000 .*max-trials 3"):
        pa.run_perf_analyzer("mlp", "127.0.0.1:8001", 8, binary=str(nothing), window_ms=500, max_trials=4,
                                      extensions=1, extension_trials=3)  # tried again with windows twice as long
    broken = _fake_perf_analyzer(tmp_path, "import sys\nprint('error: failed to connect')\nsys.exit(99)\n", "broken")
    with pytest.raises(pa.PerfAnalyzerError, match="(?s)exited with code 99 and wrote no report.*connect"):
        pa.run_perf_analyzer("mlp", "127.0.0.1:8001", 8, binary=str(broken), extensions=2)


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
    r = pa.run_perf_analyzer("svc", "http://127.0.0.1:8080", request_rate=3000, payloads=payloads,
                                      headers={"X-API-Key": "k1"}, protocol="http", binary=str(fake))
    assert r.request_rate == 3000 and r.p95_ms == pytest.approx(52.104)
    assert "-i http" in r.command and "-H X-API-Key:k1" in r.command and "--input-data input.json" in r.command
    assert r.command.endswith("--request-rate-range 3000 --request-distribution poisson --async --max-threads 16")
    data = json.loads(seen.read_text())["data"]
    got = [deserialize_bytes_tensor(base64.b64decode(d["IMAGE"]["content"]["b64"]))[0] for d in data]
    assert got == photos and all(d["IMAGE"]["shape"] == [1] for d in data)
    numbers = pa.perf_analyzer_input_data(tmp_path / "n.json", [{"X": np.arange(6.0).reshape(1, 2, 3)}])
    assert json.loads(open(numbers).read())["data"][0]["X"] == {"content": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
                                                                 "shape": [2, 3]}
    with pytest.raises(ValueError, match="only over HTTP"):
        pa.perf_analyzer_command("svc", "h:1", request_rate=10, headers={"X-API-Key": "k"})
    with pytest.raises(ValueError, match="concurrencies .* or request_rate"):
        pa.perf_analyzer_command("svc", "h:1")
