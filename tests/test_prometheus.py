"""A real Prometheus: promtool on the rules and their unit tests, the lifecycle (ready, queries as frames,
errors, stop with nothing left), a server on recorded samples, what a machine without Prometheus is told (the
install line, in the lab and in the probe), and every dashboard expression evaluated against Prometheus
scraping a real Triton. With NVLAB_REQUIRE_PROMETHEUS=1 (CI) a missing binary fails these tests instead of
skipping them; NVLAB_REQUIRE_TRITON=1 does the same for the Triton server."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from lab_utils.course import probe
from lab_utils.monitoring import drills, gpu_exporter, panels, prometheus
from lab_utils.procs import env_flag, group_members


def _required(var: str) -> bool:
    return env_flag(var)


@pytest.fixture(scope="module")
def promtool_bin():
    path = probe.find_prometheus("promtool")
    if path is None:
        if _required(prometheus.REQUIRE_ENV):
            pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but promtool is not installed (apt-get install prometheus)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


@pytest.fixture(scope="module")
def prometheus_bin():
    path = probe.find_prometheus("prometheus")
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
    assert "SUCCESS" in prometheus.check_rules(prometheus.RULES_FILE)


def test_rules_pass_their_unit_tests_and_each_alert_has_one(promtool_bin):
    assert "SUCCESS" in prometheus.test_rules(prometheus.RULES_TEST_FILE)
    # what promtool does not check: that no alert of the rules file goes untested
    alerts = {r["alert"] for g in prometheus.load_rules()["groups"] for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for case in prometheus.load_rules(prometheus.RULES_TEST_FILE)["tests"]
              for t in case.get("alert_rule_test", [])}
    assert alerts and alerts <= tested, f"no promtool unit test for {sorted(alerts - tested)}"


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
    assert server.folder is None and not server.alive()


def test_lab_copy_of_the_rules_passes_promtool(promtool_bin, tmp_path):
    path = prometheus.lab_rules(tmp_path, for_s=1, window="5s", thresholds={"TritonQueueBacklog": 3})
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
    rules = prometheus.lab_rules(tmp_path, for_s=0.5, check=False)
    server = prometheus.PrometheusServer({prometheus.EXPORTER_JOB: [exporter.address],
                                          prometheus.TRITON_JOB: ["127.0.0.1:1"]}, rule_files=[rules])
    with server:
        assert server.ready() and server.alive() and server.kind == "prometheus"
        assert server.version().startswith("2.")
        workdir, pid = server.folder, server.pid
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
        # an alert that does not fire: the timeout says how Prometheus evaluates its rule, threshold included
        with pytest.raises(TimeoutError, match=r"TritonHighP99Latency was not firing within 0\.5 s \(active alerts: "
                                               r"TritonServerDown=firing; its rule `max by \(model\) .* > 500` is "
                                               r"inactive, health (ok|unknown)\)"):
            server.wait_for_alert("TritonHighP99Latency", timeout_s=0.5)
        with pytest.raises(TimeoutError, match="no rule of that name is loaded"):
            server.wait_for_alert("NoSuchAlert", timeout_s=0.2)
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


def test_start_metrics_backends(prometheus_bin, exporter, monkeypatch):
    jobs = {prometheus.EXPORTER_JOB: [exporter.address]}
    monkeypatch.delenv(prometheus.URL_ENV, raising=False)
    with prometheus.start_metrics(jobs) as own:
        assert own.kind == "prometheus"
        # the compose stack's case: PROMETHEUS_URL names a running server, which is used as it is (a real
        # Prometheus passes the /api/v1/status/buildinfo identification that test_env_vars' look-alikes fail)
        monkeypatch.setenv(prometheus.URL_ENV, own.url)
        with prometheus.start_metrics(jobs) as ext:
            assert ext.kind == "external" and ext.url == own.url
            ext.wait_for(f'up{{job="{prometheus.EXPORTER_JOB}"}} == 1', timeout_s=30)
            ext.stop()
        assert own.ready()  # an external server is never stopped from here
        with prometheus.start_metrics(jobs, prefer="local") as local:  # the lab's own, PROMETHEUS_URL or not
            assert local.kind == "prometheus" and local.url != own.url
    monkeypatch.setenv(prometheus.URL_ENV, "http://127.0.0.1:1")
    monkeypatch.setattr(prometheus, "IDENTIFY_S", 0.5)  # how long a refused connection is retried
    with pytest.raises(prometheus.PrometheusError, match=r"nothing listens at 127.0.0.1:1 \(PROMETHEUS_URL\): is the "
                                                         "compose stack up"):
        prometheus.start_metrics(jobs)
    with pytest.raises(ValueError, match="use auto or local"):
        prometheus.start_metrics(jobs, prefer="anything")


def test_without_prometheus_the_lab_is_told_how_to_install_it(monkeypatch, capsys):
    """NVLAB_PROMETHEUS=none hides the binaries, as on a machine without them: every way in says how to
    install Prometheus (Debian/Ubuntu, macOS, the container) instead of failing obscurely."""
    monkeypatch.delenv(prometheus.URL_ENV, raising=False)
    monkeypatch.delenv(prometheus.REQUIRE_ENV, raising=False)
    monkeypatch.setenv(prometheus.BINARY_ENV, "none")
    install = ("sudo apt-get install prometheus", "brew install prometheus", "compose stack")
    assert probe.find_prometheus("prometheus") is None and probe.find_prometheus("promtool") is None
    assert all(w in prometheus.missing() for w in install)
    assert prometheus.available() is False
    out = capsys.readouterr().out
    assert all(w in out for w in install) and "skipped" in out
    for call in (lambda: prometheus.start_metrics({"x": ["127.0.0.1:1"]}),
                 lambda: prometheus.PrometheusServer({"x": ["127.0.0.1:1"]}),
                 lambda: prometheus.check_rules(prometheus.RULES_FILE),
                 lambda: prometheus.recorded_server([({"__name__": "x"}, 0.0, 1.0)])):
        with pytest.raises(prometheus.PrometheusMissing) as err:
            call()
        assert "sudo apt-get install prometheus" in str(err.value)
    monkeypatch.setenv(prometheus.REQUIRE_ENV, "1")  # CI: a missing binary is an error
    with pytest.raises(prometheus.PrometheusMissing, match="NVLAB_REQUIRE_PROMETHEUS=1"):
        prometheus.available()
    with pytest.raises(prometheus.PrometheusMissing, match="NVLAB_REQUIRE_PROMETHEUS=1"):
        prometheus.start_metrics({"x": ["127.0.0.1:1"]})
    # the tier table and `nvlab doctor` (which prints the probe's notes) say the same
    report = probe.probe()
    comp = report.components["prometheus"]
    assert not comp.present and all(w in comp.note for w in install)
    lab05 = next(t for t in report.tiers if t.lab == "05")
    assert lab05.tier != "full" and "sudo apt-get install prometheus" in lab05.substitutes


def test_binary_named_by_the_environment(monkeypatch, prometheus_bin, promtool_bin):
    monkeypatch.setenv(prometheus.BINARY_ENV, prometheus_bin)
    assert probe.find_prometheus("prometheus") == prometheus_bin
    assert probe.find_prometheus("promtool") == str(Path(prometheus_bin).with_name("promtool"))
    monkeypatch.setenv(prometheus.BINARY_ENV, "/nowhere/prometheus")
    assert probe.find_prometheus("prometheus") is None and "/nowhere/prometheus" in prometheus.missing()


# --- Prometheus on recorded samples -------------------------------------------------------------------------


def test_recorded_server_serves_the_samples_and_leaves_nothing(prometheus_bin, promtool_bin):
    t0 = 1_700_000_000.0
    samples = [({"__name__": "req", "model": 'a "quoted" name'}, t0 + 15 * i, 1000.0 + 150.0 * i) for i in range(9)]
    samples += [({"__name__": "up"}, t0 + 15 * i, 1.0) for i in range(9)]
    with prometheus.recorded_server(samples) as server:
        assert server.jobs == {} and server.targets().empty  # it scrapes nothing
        workdir, pid = server.folder, server.pid
        df = server.query_range("rate(req[1m])", t0 + 60, t0 + 120, 60)
        assert df["model"].tolist() == ['a "quoted" name'] * 2 and df["value"].tolist() == [10.0, 10.0]
        assert server.value("sum(up)", at=t0 + 30) == 1.0
        assert server.query("up", at=t0 + 3600).empty  # beyond the samples and the 5-minute lookback
    assert not server.alive() and not workdir.exists() and group_members(pid) == []
    text = prometheus.openmetrics_text(samples[:1])
    assert text == 'req{model="a \\"quoted\\" name"} 1000.0 1700000000.000\n# EOF\n'
    with pytest.raises(ValueError, match="__name__"):
        prometheus.openmetrics_text([({"model": "a"}, t0, 1.0)])


# --- every dashboard expression against Prometheus scraping a real Triton -----------------------------------


@pytest.fixture(scope="module")
def triton(shared_triton):
    return shared_triton.server  # with lab 05's model


def test_every_dashboard_expression_evaluates_against_triton(prometheus_bin, triton, exporter):
    from lab_utils.serving import load as triton_load

    jobs = prometheus.scrape_jobs(triton, exporter)
    with prometheus.PrometheusServer(jobs) as server:
        server.wait_for("sum(up) == 2", timeout_s=20)
        res = triton_load.run_load(triton.grpc_url, drills.MODEL_NAME, drills.make_inputs(), 4,
                                   duration_s=3, warmup_s=0, processes=1)
        assert res.requests > 0 and res.errors == 0
        server.wait_for('sum(rate(nv_inference_request_success[5s])) > 0', timeout_s=20)
        t = time.time()
        got = {}
        for title, expr in panels.dashboard_expressions(window="5s"):
            got[title] = server.query(expr, at=t)  # a failing expression raises QueryError naming it
        for p in panels.PANELS:
            if not (p.needs_gpu or p.host_only and exporter.source == "nvml"):
                assert not got[p.title].empty, f"{p.title}: {p.expression('5s')} returned no series"
        assert got["Throughput (requests/s)"]["value"].iloc[0] > 0
        assert 1 <= got["Average batch size (inferences per execution)"]["value"].iloc[0] <= 4
