"""A real Prometheus: promtool on the rules, the lifecycle (ready, queries as frames, errors, stop with nothing
left), the fallback announced, and every dashboard expression evaluated against Prometheus scraping a real
Triton. With NVLAB_REQUIRE_PROMETHEUS=1 (CI) a missing binary fails these tests instead of skipping them;
NVLAB_REQUIRE_TRITON=1 does the same for the Triton server."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from lab_utils.monitoring import exporter as gpu_exporter
from lab_utils.monitoring import panels as monitoring
from lab_utils.monitoring import prometheus
from lab_utils.procs import group_members

DATA = Path(monitoring.__file__).parent / "data" / "monitoring"


def _required(var: str) -> bool:
    return os.environ.get(var, "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def promtool_bin():
    path = prometheus.find_binary("promtool")
    if path is None:
        if _required(prometheus.REQUIRE_ENV):
            pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


@pytest.fixture(scope="module")
def prometheus_bin():
    path = prometheus.find_binary("prometheus")
    if path is None:
        if _required(prometheus.REQUIRE_ENV):
            pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but the prometheus binary is not installed")
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus)")
    return path


@pytest.fixture(scope="module")
def exporter():
    with gpu_exporter.GpuExporter(use_nvml=False) as exp:
        yield exp


# --- promtool --------------------------------------------------------------------------------------------


def test_rules_pass_promtool_check(promtool_bin):
    out = prometheus.check_rules(DATA / "alert_rules.yml")
    assert "SUCCESS: 5 rules found" in out


def test_rules_pass_their_unit_tests(promtool_bin):
    assert "SUCCESS" in prometheus.test_rules(DATA / "alert_rules_test.yml")


def test_rules_cover_the_five_alerts():
    names = {r["alert"] for g in monitoring.load_rules()["groups"] for r in g["rules"]}
    assert names == {"TritonServerDown", "TritonHighP99Latency", "TritonQueueBacklog", "TritonErrorRate",
                     "GpuMemoryHigh"}
    tested = (DATA / "alert_rules_test.yml").read_text()
    for name in names:
        assert f"alertname: {name}" in tested, f"no promtool unit test for {name}"


def test_a_broken_rule_shows_promtools_message(promtool_bin, tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: g\n    rules:\n      - alert: X\n        expr: rate(up)\n")
    with pytest.raises(prometheus.ConfigError) as err:
        prometheus.check_rules(bad)
    assert "bad.yml" in str(err.value) and "expected type range vector" in str(err.value)


def test_a_configuration_error_shows_promtools_message(promtool_bin, prometheus_bin, tmp_path):
    server = prometheus.PrometheusServer({"x": ["127.0.0.1:1"]})
    server.config["global"]["scrape_interval"] = "1 second"  # what a hand edit could do
    with pytest.raises(prometheus.ConfigError, match='not a valid duration string: "1 second"'):
        server.start()
    assert server.workdir is None and not server.alive()


def test_lab_copy_of_the_rules_passes_promtool(promtool_bin, tmp_path):
    path = monitoring.lab_rules(tmp_path, for_s=1, window="5s", thresholds={"TritonQueueBacklog": 3})
    assert "SUCCESS: 5 rules found" in prometheus.check_rules(path)


def test_scrape_config_refuses_bad_values():
    with pytest.raises(ValueError, match="host:port"):
        prometheus.scrape_config({"triton": ["http://127.0.0.1:8002/metrics"]})
    with pytest.raises(ValueError, match="list"):
        prometheus.scrape_config({"triton": "127.0.0.1:8002"})
    with pytest.raises(ValueError, match="seconds"):
        prometheus.scrape_config({"triton": ["127.0.0.1:8002"]}, scrape_interval_s=0)
    cfg = prometheus.scrape_config({"triton": ["127.0.0.1:8002"]}, scrape_interval_s=1.5)
    assert cfg["global"]["scrape_interval"] == "1500ms"


def test_prometheus_3_gets_the_text_format_as_fallback(prometheus_bin):
    server = prometheus.PrometheusServer({"triton": ["127.0.0.1:8002"]})
    assert "fallback_scrape_protocol" not in server.config["scrape_configs"][0]  # 2.x refuses the key
    server._version = "3.5.0"  # the lab image's Prometheus
    server.reload()  # not started: only the configuration is rebuilt
    assert server.config["scrape_configs"][0]["fallback_scrape_protocol"] == "PrometheusText0.0.4"


# --- the server's lifecycle -------------------------------------------------------------------------------


def test_server_scrapes_queries_and_leaves_nothing(prometheus_bin, exporter, tmp_path):
    rules = monitoring.lab_rules(tmp_path, for_s=0.5, check=False)
    server = prometheus.PrometheusServer({prometheus.EXPORTER_JOB: [exporter.address],
                                          prometheus.TRITON_JOB: ["127.0.0.1:1"]}, rule_files=[rules])
    with server:
        assert server.ready() and server.alive() and server.kind == "prometheus"
        assert server.version().startswith("2.")
        workdir, pid = server.workdir, server.pid
        server.wait_for("count(up) == 2", timeout_s=20)  # both targets scraped at least once
        df = server.wait_for(f'up{{job="{prometheus.EXPORTER_JOB}"}} == 1', timeout_s=20)
        assert list(df.columns) == ["__name__", "instance", "job", "time", "value"]
        assert df["instance"].iloc[0] == exporter.address
        assert server.value("nvlab_host_cpu_count") == os.cpu_count()
        rng = server.query_range("up", time.time() - 3, time.time(), 1)
        assert set(rng["job"]) == {prometheus.EXPORTER_JOB, prometheus.TRITON_JOB} and len(rng) >= 2
        assert set(prometheus.pivot(rng, "job").columns) == {prometheus.EXPORTER_JOB, prometheus.TRITON_JOB}
        with pytest.raises(prometheus.QueryError, match=r"query 'rate\(up\)' failed: bad_data"):
            server.query("rate(up)")
        with pytest.raises(prometheus.QueryError, match="one number"):
            server.value("up")
        alert = server.wait_for_alert("TritonServerDown", "firing", timeout_s=20)  # nothing at 127.0.0.1:1
        assert alert["summary"].iloc[0] == "Triton at 127.0.0.1:1 does not answer scrapes"
        assert set(server.rules()["name"]) >= {"TritonServerDown", "GpuMemoryHigh"}
        targets = server.targets()
        assert set(targets["health"]) == {"up", "down"}
        server.reload(jobs={prometheus.EXPORTER_JOB: [exporter.address]})  # the down target leaves
        deadline = time.time() + 20
        while len(server.targets()) != 1 and time.time() < deadline:
            threading.Event().wait(0.2)
        assert server.targets()["job"].tolist() == [prometheus.EXPORTER_JOB]
        with pytest.raises(TimeoutError, match="did not return a series"):
            server.wait_for('up{job="nothing"}', timeout_s=0.5)
    assert not server.alive() and not workdir.exists() and group_members(pid) == []
    server.stop()  # twice is fine


def test_busy_port_is_avoided(prometheus_bin, exporter):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with prometheus.PrometheusServer({prometheus.EXPORTER_JOB: [exporter.address]}, port=busy) as server:
            assert server.port != busy and server.ready()
            assert any("busy" in n for n in server.notes)


def test_start_metrics_backends(prometheus_bin, exporter, monkeypatch, capsys):
    jobs = {prometheus.EXPORTER_JOB: [exporter.address]}
    monkeypatch.delenv(prometheus.URL_ENV, raising=False)
    with prometheus.start_metrics(jobs) as own:
        assert own.kind == "prometheus"
        # the compose stack's case: PROMETHEUS_URL names a running server, which is used as it is
        monkeypatch.setenv(prometheus.URL_ENV, own.url)
        with prometheus.start_metrics(jobs) as ext:
            assert ext.kind == "external" and ext.url == own.url
            ext.wait_for(f'up{{job="{prometheus.EXPORTER_JOB}"}} == 1', timeout_s=20)
            ext.stop()
        assert own.ready()  # an external server is never stopped from here
    monkeypatch.setenv(prometheus.URL_ENV, "http://127.0.0.1:1")
    with pytest.raises(prometheus.PrometheusError, match="compose stack"):
        prometheus.start_metrics(jobs)
    monkeypatch.delenv(prometheus.URL_ENV)
    with prometheus.start_metrics(jobs, prefer="scraper") as fallback:
        assert fallback.kind == "scraper"
    assert "in-process scraper stands in" in capsys.readouterr().out


def test_missing_binary_falls_back_or_fails_when_required(monkeypatch, capsys, exporter):
    monkeypatch.delenv(prometheus.URL_ENV, raising=False)
    monkeypatch.setattr(prometheus, "find_binary", lambda name="prometheus": None)
    monkeypatch.setenv(prometheus.REQUIRE_ENV, "0")
    with prometheus.start_metrics({prometheus.EXPORTER_JOB: [exporter.address]}) as m:
        assert m.kind == "scraper"
    out = capsys.readouterr().out
    assert "no prometheus binary here" in out and "in-process scraper" in out
    monkeypatch.setenv(prometheus.REQUIRE_ENV, "1")
    with pytest.raises(prometheus.PrometheusError, match="NVLAB_REQUIRE_PROMETHEUS=1"):
        prometheus.start_metrics({prometheus.EXPORTER_JOB: [exporter.address]})
    with pytest.raises(prometheus.PrometheusError, match="apt-get install prometheus"):
        prometheus.PrometheusServer({"x": ["127.0.0.1:1"]})


# --- every dashboard expression against Prometheus scraping a real Triton -----------------------------------


@pytest.fixture(scope="module")
def triton():
    from lab_utils.serving import server as triton_server

    try:
        triton_server.find_server(local=True)
    except triton_server.ServerNotFound as err:
        if _required("NVLAB_REQUIRE_TRITON"):
            pytest.fail(f"NVLAB_REQUIRE_TRITON=1 but no Triton server: {err}")
        pytest.skip("no Triton server binary (pip install --no-deps nvidia-pytriton)")
    repo = monitoring.write_model(Path(tempfile.mkdtemp(prefix="nvlab-test-repo-")) / "repo")
    with triton_server.TritonServer(repo) as server:
        yield server


def test_every_dashboard_expression_evaluates_against_triton(prometheus_bin, triton, exporter):
    from lab_utils.serving import load as triton_load

    jobs = monitoring.scrape_jobs(triton, exporter)
    with prometheus.PrometheusServer(jobs) as server:
        server.wait_for("sum(up) == 2", timeout_s=20)
        res = triton_load.run_load(triton.grpc_url, monitoring.MODEL_NAME, monitoring.make_inputs(), 4,
                                   duration_s=3, warmup_s=0, processes=1)
        assert res.requests > 0 and res.errors == 0
        server.wait_for('sum(rate(nv_inference_request_success[5s])) > 0', timeout_s=20)
        t = time.time()
        got = {}
        for title, expr in monitoring.dashboard_expressions(window="5s"):
            got[title] = server.query(expr, at=t)  # a failing expression raises QueryError naming it
        for p in monitoring.PANELS:
            if not (p.needs_gpu or p.host_only and exporter.source == "nvml"):
                assert not got[p.title].empty, f"{p.title}: {p.promql('5s')} returned no series"
        assert got["Throughput (requests/s)"]["value"].iloc[0] > 0
        assert 1 <= got["Average batch size (inferences per execution)"]["value"].iloc[0] <= 4
        # the fallback evaluator gives the same answers on what it scrapes itself
        with monitoring.InProcessScraper(jobs, scrape_interval_s=0.5) as scraper:
            scraper.wait_for("sum(up) == 2", timeout_s=10)
            for _, expr in monitoring.dashboard_expressions(window="5s"):
                scraper.query(expr)
