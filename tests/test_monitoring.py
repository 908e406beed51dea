"""lab_utils.monitoring.panels and lab_utils.monitoring.promql: the PromQL evaluator, the in-process scraper and its alerts, the
lab's rules copy, panels and dashboard, the watchdog and the failure drill (with a stub server that nothing
outlives)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lab_utils.monitoring import panels as monitoring
from lab_utils.monitoring import promql
from lab_utils.monitoring.prometheus import QueryError, find_binary, free_port
from lab_utils.procs import popen_owned, stop_group, wait_http_ok

# --- the PromQL evaluator ------------------------------------------------------------------------------


def _store(rate_per_s=10.0, n=61, reset_at=None):
    s = promql.SampleStore()
    value = 0.0
    for i in range(n):
        if reset_at is not None and i == reset_at:
            value = 0.0
        s.add({"__name__": "req", "model": "a", "job": "triton", "instance": "x"}, float(i), value)
        s.add({"__name__": "req", "model": "b", "job": "triton", "instance": "x"}, float(i), 2 * i * rate_per_s)
        s.add({"__name__": "pending", "model": "a", "job": "triton", "instance": "x"}, float(i), float(i % 5))
        s.add({"__name__": "up", "job": "triton", "instance": "x"}, float(i), 1.0)
        value += rate_per_s
    return s


def _value(store, expr, t=60.0):
    data = promql.instant(store, expr, t)
    if data["resultType"] == "scalar":
        return float(data["result"][1])
    return {tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")): float(r["value"][1])
            for r in data["result"]}


def test_rate_of_a_steady_counter_and_a_reset():
    s = _store()
    assert _value(s, 'rate(req{model="a"}[30s])') == {(("instance", "x"), ("job", "triton"), ("model", "a")): 10.0}
    assert _value(s, "sum(rate(req[30s]))") == {(): 30.0}
    assert _value(s, 'increase(req{model="a"}[20s])')[(("instance", "x"), ("job", "triton"), ("model", "a"))] \
        == pytest.approx(200.0)
    reset = _store(reset_at=40)
    # the drop to 0 at t=40 is a restart, not a negative rate
    assert _value(reset, 'rate(req{model="a"}[30s])')[(("instance", "x"), ("job", "triton"), ("model", "a"))] \
        == pytest.approx(10.0, rel=0.05)


def test_extrapolation_matches_prometheus_rules():
    s = promql.SampleStore()
    for t, v in ((5.0, 100.0), (15.0, 200.0), (25.0, 300.0)):  # the window [0, 30] is only partly covered
        s.add({"__name__": "c"}, t, v)
    # sampled 20 s, 10 s between samples: 5 s on each side are within 1.1x of it, so extrapolate to both
    # edges; the counter would reach 0 at t=-5, beyond the start, so the start stays at the window's edge.
    assert _value(s, "increase(c[30s])", 30.0)[()] == pytest.approx(200 * 30 / 20)
    assert _value(s, "rate(c[30s])", 30.0)[()] == pytest.approx(10.0)
    assert _value(s, "delta(c[30s])", 30.0)[()] == pytest.approx(300.0)


def test_aggregations_binary_ops_and_matching():
    s = _store()
    assert _value(s, "sum by (model) (rate(req[30s]))") == {(("model", "a"),): 10.0, (("model", "b"),): 20.0}
    ratio = _value(s, 'rate(req{model="b"}[30s]) / ignoring(model) rate(req{model="a"}[30s])')
    assert list(ratio.values()) == [2.0]
    assert _value(s, 'sum(rate(req[30s])) / sum(rate(req{model="a"}[30s]))') == {(): 3.0}
    assert _value(s, "1 - avg(up)") == {(): 0.0}
    assert _value(s, "max_over_time(pending[1m])")[(("instance", "x"), ("job", "triton"), ("model", "a"))] == 4.0
    assert _value(s, "pending > 10") == {}
    assert _value(s, "pending > bool 10") == {(("instance", "x"), ("job", "triton"), ("model", "a")): 0.0}
    assert _value(s, "count(req) by (job)") == {(("job", "triton"),): 2.0}
    assert _value(s, "up == 1 or absent(nothing)") and _value(s, 'absent(nothing{job="t"})') == {(("job", "t"),): 1.0}
    assert _value(s, "2 ^ 3 ^ 2") == 512.0  # right-associative, as in PromQL


def test_staleness_ends_a_series():
    s = promql.SampleStore()
    key = promql.SampleStore.key({"__name__": "up", "job": "t"})
    s.add(key, 0.0, 1.0)
    assert _value(s, "up", 10.0) == {(("job", "t"),): 1.0}
    s.mark_stale(key, 20.0)
    assert _value(s, "up", 30.0) == {}
    assert _value(s, "up", 400.0) == {}  # and beyond the 5-minute lookback anyway


@pytest.mark.parametrize(("expr", "words"), [
    ("rate(req)", "range vector"),
    ("sum(rate(req[1m])", "expected )"),
    ("histogram_quantile(0.9, x)", "not supported"),
    ("req[1m] + 1", "range vector"),
    ("req / req{model='a'} + on() req", "many-to-many"),
    ("", "empty"),
    ("req{model=}", "position"),
])
def test_errors_name_the_expression(expr, words):
    with pytest.raises(promql.PromQLError) as err:
        promql.instant(_store(), expr, 60.0)
    assert words in str(err.value)
    if expr:
        assert repr(expr) in str(err.value)


def test_range_query_shape():
    data = promql.range_query(_store(), 'rate(req{model="a"}[10s])', 30, 40, 5)
    assert data["resultType"] == "matrix" and len(data["result"]) == 1
    assert [v for _, v in data["result"][0]["values"]] == ["10", "10", "10"]


@pytest.mark.skipif(not find_binary("promtool"), reason="promtool is not installed")
def test_evaluator_agrees_with_prometheus(tmp_path):
    """The fallback's numbers are Prometheus' numbers: promtool evaluates the same expressions on the same series."""
    series = [('req{model="a", job="t"}', "0+10x12"), ('req{model="b", job="t"}', "0+25x5 0+25x6"),
              ('pending{model="a", job="t"}', "3 5 2 8 1 0 4 4 9 2 3 1 7")]
    store = promql.SampleStore()
    for name_labels, values in series:
        name, labels = name_labels.split("{")
        lab = dict(kv.split("=") for kv in labels.rstrip("}").replace('"', "").replace(" ", "").split(","))
        vals = []
        for part in values.split():
            if "+" in part:
                start, rest = part.split("+")
                step, count = rest.split("x")
                vals += [float(start) + float(step) * i for i in range(int(count) + 1)]
            else:
                vals.append(float(part))
        for i, v in enumerate(vals):
            store.add({"__name__": name, **lab}, 15.0 * i, v)
    exprs = ["sum by (model) (rate(req[1m]))", 'increase(req{model="b"}[2m])', "avg_over_time(pending[1m])",
             # a ratio may differ in the last bit between two correct engines: compare it rounded
             "round(rate(req[45s]) / ignoring(model) group_left sum(rate(req[45s])) without (model), 1e-9)",
             "max_over_time(pending[90s]) > bool 5", "irate(req[1m])"]
    tests = []
    for expr in exprs:
        data = promql.instant(store, expr, 165.0)
        exp = [{"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(r["metric"].items()) if k != "__name__")
                + "}" if not r["metric"].get("__name__") else r["metric"]["__name__"] + "{" + ", ".join(
                    f'{k}="{v}"' for k, v in sorted(r["metric"].items()) if k != "__name__") + "}",
                "value": float(r["value"][1])} for r in data["result"]]
        tests.append({"expr": expr, "eval_time": "165s", "exp_samples": exp})
    spec = {"rule_files": [], "evaluation_interval": "15s",
            "tests": [{"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in series],
                       "promql_expr_test": tests}]}
    path = tmp_path / "cross_test.yml"
    path.write_text(json.dumps(spec))
    out = subprocess.run([find_binary("promtool"), "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- rules, panels, dashboard ---------------------------------------------------------------------------


def test_lab_rules_copy(tmp_path):
    path = monitoring.lab_rules(tmp_path, for_s={"TritonServerDown": 1}, default_for_s=2, window="5s",
                                thresholds={"TritonHighP99Latency": 42.5, "GpuMemoryHigh": 0.5})
    rules = {r["alert"]: r for g in json.loads(path.read_text())["groups"] for r in g["rules"]}
    assert rules["TritonServerDown"]["for"] == "1s" and rules["TritonQueueBacklog"]["for"] == "2s"
    assert rules["TritonHighP99Latency"]["expr"].endswith("> 42.5")
    assert "[5s]" in rules["TritonErrorRate"]["expr"] and "[1m]" not in rules["TritonErrorRate"]["expr"]
    assert rules["GpuMemoryHigh"]["expr"].count("> 0.5") == 2
    original = {r["alert"]: r for g in monitoring.load_rules()["groups"] for r in g["rules"]}
    assert original["TritonHighP99Latency"]["expr"].endswith("> 500")  # the file itself is untouched
    with pytest.raises(ValueError, match="unknown alerts"):
        monitoring.lab_rules(tmp_path, thresholds={"NoSuchAlert": 1})
    with pytest.raises(ValueError, match="no comparison"):
        monitoring.set_threshold("rate(x[1m])", 3)


def test_every_rule_and_panel_parses_in_the_fallback_evaluator():
    for group in monitoring.load_rules()["groups"]:
        for rule in group["rules"]:
            promql.parse(rule["expr"])
    for _, expr in monitoring.dashboard_expressions():
        promql.parse(expr)


def test_committed_dashboard_is_generated_from_the_panels():
    assert monitoring.DASHBOARD_FILE.read_text() == monitoring.dashboard_text(), \
        "regenerate: python -c 'from lab_utils.monitoring import panels as m; open(m.DASHBOARD_FILE, \"w\")" \
        ".write(m.dashboard_text())'"
    model = json.loads(monitoring.DASHBOARD_FILE.read_text())
    exprs = [t["expr"] for p in model["panels"] for t in p["targets"]]
    assert len(exprs) == len(monitoring.PANELS) and all("$__rate_interval" in e for e in exprs if "rate(" in e)
    assert {p["datasource"]["uid"] for p in model["panels"]} == {"${datasource}"}


def test_panels_by_tier():
    gpu = {p.key for p in monitoring.panels(gpu=True)}
    cpu = {p.key for p in monitoring.panels(gpu=False)}
    assert {"gpu_util", "gpu_memory", "gpu_power"} <= gpu and not {"host_cpu"} & gpu
    assert {"host_cpu", "host_memory"} <= cpu and not {"gpu_util"} & cpu
    assert {"qps", "batch", "latency", "queue_share", "p99", "pending"} <= gpu & cpu


def test_quantiles_of_parts_differ_from_the_pooled_one():
    q = monitoring.quantile_of_parts([[10.0] * 99 + [20.0], [100.0] * 100], 0.99)
    assert q["mean_of_parts"] != pytest.approx(q["pooled"])
    with pytest.raises(ValueError):
        monitoring.quantile_of_parts([[]])


def test_parse_exposition_keeps_the_exposed_counter_names():
    text = ("# TYPE nv_inference_count counter\nnv_inference_count{model=\"m\"} 5\n"
            "# TYPE http_requests_total counter\nhttp_requests_total 3\n# TYPE g gauge\ng 1.5\n")
    names = {lab["__name__"]: v for lab, v in monitoring.parse_exposition(text)}
    assert names == {"nv_inference_count": 5.0, "http_requests_total": 3.0, "g": 1.5}
    assert monitoring.metric_types(text)["nv_inference_count"] == "counter"


# --- a stub server: /metrics from a file, started as an owned process --------------------------------------


class StubServer:
    """A python http.server serving ``<dir>/metrics``: alive(), pid, http_url, metrics_url, start/stop/restart."""

    def __init__(self, folder: Path, fail_starts: int = 0):
        self.folder, self.fail_starts, self.proc, self.port = folder, fail_starts, None, 0
        (folder / "v2" / "health").mkdir(parents=True, exist_ok=True)
        (folder / "v2" / "health" / "live").write_text("")
        (folder / "metrics").write_text('# TYPE nv_inference_request_success counter\n'
                                        'nv_inference_request_success{model="m",version="1"} 7\n')

    @property
    def http_url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self):
        return f"{self.http_url}/metrics"

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def start(self):
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("stub refuses to start")
        self.port = free_port()
        self.proc = popen_owned([sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
                                 "--directory", str(self.folder)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        assert wait_http_ok(self.metrics_url, self.proc, 15)
        return self

    def stop(self):
        if self.proc is not None:
            stop_group(self.proc)

    def restart(self):
        self.stop()
        return self.start()


@pytest.fixture
def stub(tmp_path):
    server = StubServer(tmp_path).start()
    yield server
    server.stop()
    assert not server.alive()


def test_scraper_rates_up_alerts_and_reload(stub, tmp_path):
    rules = monitoring.lab_rules(tmp_path, for_s=0.5, check=False)
    jobs = monitoring.scrape_jobs(stub)
    with monitoring.InProcessScraper(jobs, rule_files=[rules], scrape_interval_s=0.2,
                                     evaluation_interval_s=0.2) as scraper:
        assert scraper.kind == "scraper" and "in-process scraper" in scraper.notes[0]
        df = scraper.wait_for('up{job="triton"} == 1', timeout_s=5)
        assert df["instance"].iloc[0] == jobs["triton"][0]
        assert scraper.value("sum(nv_inference_request_success)") == 7.0
        with pytest.raises(QueryError, match="rate\\(up\\)"):
            scraper.query("rate(up)")
        stub.stop()  # the target goes down: up == 0, its series stale, the alert fires after for:
        scraper.wait_for('up{job="triton"} == 0', timeout_s=5)
        assert scraper.query("nv_inference_request_success").empty
        hit = scraper.wait_for_alert("TritonServerDown", "firing", timeout_s=5)
        assert "does not answer scrapes" in hit["summary"].iloc[0]
        assert scraper.targets()["health"].tolist() == ["down"]
        stub.start()  # back on a new port: point the scraper there; the old target's series end
        scraper.reload(jobs=monitoring.scrape_jobs(stub))
        scraper.wait_for('up{job="triton"} == 1', timeout_s=5)
        scraper.wait_for('up{job="triton"} == 0', timeout_s=5, predicate=lambda d: d.empty)
        deadline = time.time() + 5
        while not scraper.alerts().empty and time.time() < deadline:
            threading.Event().wait(0.1)
        assert scraper.alerts().empty, "the alert resolves once the down target is gone"
    assert not scraper.alive()


def test_watchdog_restarts_with_backoff_and_gives_up(tmp_path):
    server = StubServer(tmp_path).start()
    restarted = []
    dog = monitoring.Watchdog(server, check_s=0.05, backoff_s=0.2, max_restarts=2, stable_s=60,
                              liveness=lambda s: f"{s.http_url}/v2/health/live", on_restart=restarted.append)
    try:
        with dog:
            first = server.pid
            monitoring.kill(server)
            deadline = time.time() + 10
            while dog.restarts < 1 and time.time() < deadline:
                threading.Event().wait(0.05)
            assert dog.restarts == 1 and server.alive() and server.pid != first and restarted == [server]
            events = dog.timeline()["event"].tolist()
            assert events[:3] == ["watching", "down", "restarted"]
            server.fail_starts = 5  # now every start fails: backoff grows, then the watchdog gives up
            monitoring.kill(server)
            deadline = time.time() + 10
            while not dog.gave_up and time.time() < deadline:
                threading.Event().wait(0.05)
            assert dog.gave_up
            downs = dog.timeline().query("event == 'down'")["backoff_s"].tolist()
            assert downs == [0.2, 0.4]  # 0.2 x 2^k while restarts fail in a row
            assert "restart failed" in dog.timeline()["event"].tolist()
        assert not dog.alive()
    finally:
        server.stop()


def test_watchdog_pause_and_hung_server(tmp_path):
    server = StubServer(tmp_path).start()
    dog = monitoring.Watchdog(server, check_s=0.05, backoff_s=0.1, failures=2,
                              liveness=lambda s: f"{s.http_url}/v2/health/missing")  # 404: looks hung
    try:
        with dog:
            deadline = time.time() + 10
            while dog.restarts < 1 and time.time() < deadline:
                threading.Event().wait(0.05)
            assert dog.restarts >= 1
            assert "liveness failed 2 times (HTTP 404)" in dog.timeline().query("event == 'down'")["reason"].iloc[0]
            dog.pause()
            n = dog.restarts
            threading.Event().wait(0.3)
            server.stop()
            threading.Event().wait(0.5)
            assert dog.restarts == n and not server.alive()  # a planned stop is not "restarted"
    finally:
        server.stop()
    with pytest.raises(ValueError):
        monitoring.Watchdog(server, check_s=0)


def test_failure_drill_with_a_stub(tmp_path):
    server = StubServer(tmp_path).start()
    rules = monitoring.lab_rules(tmp_path, for_s=0.3, check=False)
    scraper = monitoring.InProcessScraper(monitoring.scrape_jobs(server), rule_files=[rules],
                                          scrape_interval_s=0.2, evaluation_interval_s=0.2).start()
    dog = monitoring.Watchdog(server, check_s=0.05, backoff_s=1.0,
                              on_restart=lambda s: scraper.reload(jobs=monitoring.scrape_jobs(s)))
    calls = []

    def fake_load(url, concurrency, seconds):  # stands in for run_load: fails while nothing listens at url
        import urllib.request

        calls.append(url)
        threading.Event().wait(seconds)
        try:
            urllib.request.urlopen(f"http://{url}/metrics", timeout=1).read()
            return {"requests": 10, "errors": 0, "p99_ms": 1.0}
        except OSError:
            return {"requests": 0, "errors": 5, "p99_ms": math.nan}

    try:
        dog.start()
        drill = monitoring.failure_drill(
            server, scraper, dog, lambda s: monitoring.chunked_load(
                lambda: server.http_url.removeprefix("http://"), fake_load, 2, s, chunk_s=0.3),
            load_s=4.0, kill_after_s=0.5, timeout_s=10)
    finally:
        dog.stop()
        scraper.stop()
        server.stop()
    steps = drill.table()["step"].tolist()
    assert steps[:4] == ["load started", "server killed", "up == 0 in Prometheus", "alert TritonServerDown firing"]
    assert "watchdog restarted the server" in steps and "up == 1 again" in steps
    assert "alert TritonServerDown resolved" in steps and steps[-1] == "load finished"
    chunks = drill.load
    assert chunks["errors"].sum() > 0 and chunks.iloc[-1]["requests"] > 0  # failures, then load resumes
    assert len(set(calls)) == 2  # the clients followed the server to its new address
    fig = monitoring.plot_drill(drill)
    assert fig.axes


def test_health_probe(stub):
    assert monitoring.probe(f"{stub.http_url}/v2/health/live") == (True, "HTTP 200")
    ok, why = monitoring.probe(f"{stub.http_url}/nope")
    assert not ok and why == "HTTP 404"
    ok, why = monitoring.probe(f"http://127.0.0.1:{free_port()}/v2/health/live")
    assert not ok and why


def test_run_phases_and_chunked_load_tables():
    phases = [monitoring.Phase("ramp", 1, 0.01), monitoring.Phase("overload", 8, 0.01)]
    df = monitoring.run_phases(phases, lambda c, s: {"requests": 10 * c, "errors": 0, "throughput_infer_s": 5.0 * c,
                                                      "p50_ms": 1.0, "p99_ms": 2.0})
    assert df["requests"].tolist() == [10, 80] and df["throughput_rps"].tolist() == [5.0, 40.0]
    assert (df["end"] >= df["start"]).all()

    def boom(url, c, s):
        raise ConnectionError("nothing there")

    chunks = monitoring.chunked_load(lambda: "127.0.0.1:1", boom, 3, 0.5, chunk_s=0.2)
    assert (chunks["errors"] == 3).all() and chunks["error"].str.contains("nothing there").all()
    assert monitoring.default_phases(True)[-1].name == "overload"


def test_gpu_sources_compared_by_uuid():
    """The GPU cross-check of the notebook, on series shaped like Triton's (DCGM) and the exporter's (NVML)."""
    scraper = monitoring.InProcessScraper({"x": ["127.0.0.1:1"]})
    mib = 2**20
    for i in range(11):
        t = 100.0 + i
        for uuid, used_mib, power in (("GPU-a", 1000, 300.0), ("GPU-b", 2000, 500.0)):
            scraper.store.add({"__name__": "nv_gpu_memory_used_bytes", "gpu_uuid": uuid}, t, (used_mib + 500) * mib)
            scraper.store.add({"__name__": "nv_gpu_power_usage", "gpu_uuid": uuid}, t, power * 1.05)
            lab = {"gpu": uuid[-1], "UUID": uuid}
            scraper.store.add({"__name__": "DCGM_FI_DEV_FB_USED", **lab}, t, used_mib)
            scraper.store.add({"__name__": "DCGM_FI_DEV_FB_RESERVED", **lab}, t, 500)
            scraper.store.add({"__name__": "DCGM_FI_DEV_POWER_USAGE", **lab}, t, power)
    df = monitoring.compare_gpu_sources(scraper, at=110.0, window_s=8)
    got = {(r.metric, r.uuid): (round(r.ratio, 3), r.within) for r in df.itertuples()}
    assert got[("power_w", "GPU-a")] == (1.05, True)
    assert got[("memory_used_bytes", "GPU-a")] == (1.5, False)  # this "Triton" counts reserved memory as used
    assert got[("memory_used_plus_reserved_bytes", "GPU-b")] == (1.0, True)
    assert len(df) == 6
    assert monitoring.compare_gpu_sources(monitoring.InProcessScraper({"x": ["127.0.0.1:1"]}), 110.0, 8).empty
