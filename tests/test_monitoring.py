"""lab_utils.monitoring.panels and .drills: the lab's rules copy, panels and dashboard (checked by promtool), the
watchdog and the failure drill with a stub server that nothing outlives (watched by a real Prometheus, and
without one), and the GPU cross-check on samples Prometheus serves.

Verdicts here never depend on how fast the machine is: waits poll for a state with a generous deadline, and
the watchdog's pause is synchronous (it returns once no check or restart is in progress)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _prometheus import require_prometheus

from lab_utils.monitoring import drills, panels, prometheus
from lab_utils.procs import free_port, popen_owned, stop_group, wait_http_ok

_need = require_prometheus  # skip without the binaries; fail under NVLAB_REQUIRE_PROMETHEUS=1 (CI installs them)


def _until(condition, timeout_s: float = 30.0, poll_s: float = 0.05) -> bool:
    """Poll ``condition()`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return bool(condition())
        threading.Event().wait(poll_s)
    return True


# --- rules, panels, dashboard ---------------------------------------------------------------------------


def test_lab_rules_copy(tmp_path):
    path = prometheus.lab_rules(tmp_path, for_s={"TritonServerDown": 1}, default_for_s=2, window="5s",
                                thresholds={"TritonHighP99Latency": 42.5, "GpuMemoryHigh": 0.5}, check=False)
    rules = {r["alert"]: r for g in json.loads(path.read_text())["groups"] for r in g["rules"]}
    assert rules["TritonServerDown"]["for"] == "1s" and rules["TritonQueueBacklog"]["for"] == "2s"
    assert rules["TritonHighP99Latency"]["expr"].endswith("> 42.5")
    assert "[5s]" in rules["TritonErrorRate"]["expr"] and "[1m]" not in rules["TritonErrorRate"]["expr"]
    assert rules["GpuMemoryHigh"]["expr"].count("> 0.5") == 2
    original = {r["alert"]: r for g in prometheus.load_rules()["groups"] for r in g["rules"]}
    assert original["TritonHighP99Latency"]["expr"].endswith("> 500")  # the file itself is untouched
    with pytest.raises(ValueError, match="unknown alerts"):
        prometheus.lab_rules(tmp_path, thresholds={"NoSuchAlert": 1})
    with pytest.raises(ValueError, match="no comparison"):
        prometheus.set_threshold("rate(x[1m])", 3)


def test_every_panel_expression_passes_promtool(tmp_path):
    """Prometheus' own parser reads every panel (as a recording rule), with the notebook's window and Grafana's."""
    _need("promtool")
    rules = [{"record": f"nvlab:{p.key}:{i}", "expr": p.expression(w)}
             for i, w in enumerate(("5s", "1m")) for p in panels.PANELS]
    rules += [{"record": f"nvlab:dashboard:{i}", "expr": expr}
              for i, (_, expr) in enumerate(panels.dashboard_expressions(window="30s"))]
    path = tmp_path / "panels.rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "panels", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in prometheus.check_rules(path)


def test_committed_dashboard_is_generated_from_the_panels():
    assert panels.DASHBOARD_FILE.read_text() == panels.dashboard_text(), \
        "regenerate: python -c 'from lab_utils.monitoring import panels as p; open(p.DASHBOARD_FILE, \"w\")" \
        ".write(p.dashboard_text())'"
    model = json.loads(panels.DASHBOARD_FILE.read_text())
    exprs = [t["expr"] for p in model["panels"] for t in p["targets"]]
    assert len(exprs) == len(panels.PANELS) and all("$__rate_interval" in e for e in exprs if "rate(" in e)
    assert {p["datasource"]["uid"] for p in model["panels"]} == {"${datasource}"}


def test_panels_by_tier():
    gpu = {p.key for p in panels.panels(gpu=True)}
    cpu = {p.key for p in panels.panels(gpu=False)}
    assert {"gpu_util", "gpu_memory", "gpu_power"} <= gpu and not {"host_cpu"} & gpu
    assert {"host_cpu", "host_memory"} <= cpu and not {"gpu_util"} & cpu
    # the DCGM profiling fields only where a dcgm-exporter is scraped (the course's NVML exporter has none)
    assert not {"sm_active", "tensor_active"} & gpu
    assert {"sm_active", "tensor_active"} <= {p.key for p in panels.panels(gpu=True, profiling=True)}
    assert not {"sm_active"} & {p.key for p in panels.panels(gpu=False, profiling=True)}
    assert {"qps", "batch", "latency", "queue_share", "p99", "pending"} <= gpu & cpu
    assert panels.panel("qps").expression("5s") == "sum by (model) (rate(nv_inference_request_success[5s]))"
    with pytest.raises(KeyError, match="the panels are"):
        panels.panel("nope")


def test_every_panel_says_what_it_measures_and_gpu_utilization_is_not_sm_activity():
    for p in panels.PANELS:
        assert len(p.description) > 30, p.key
    util = panels.panel("gpu_util")
    assert "any kernel" in util.description and "100 %" in util.description and "SM_ACTIVE" in util.description
    assert "busy" not in util.title.lower()  # the title says what it measures: time a kernel ran
    for key, field in (("sm_active", "DCGM_FI_PROF_SM_ACTIVE"), ("tensor_active", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")):
        p = panels.panel(key)
        assert p.profiling and p.needs_gpu and field in p.expr
        assert "dcgm-exporter" in p.description and "NVML exporter" in p.description
    model = json.loads(panels.DASHBOARD_FILE.read_text())
    described = {p["title"]: p.get("description", "") for p in model["panels"]}
    assert all(described.values())
    assert "dcgm profile" in described[panels.panel("sm_active").title]


class _FakeGpuTorch:
    """The torch calls gpu_utilization_demo makes, on a stand-in 'H200' with 132 SMs: what ran is remembered."""

    bfloat16 = "bf16"

    def __init__(self):
        self.ran: list[str] = []
        fake = self

        class Cuda:
            @staticmethod
            def get_device_properties(device):
                return SimpleNamespace(multi_processor_count=132, uuid="0001")

            @staticmethod
            def synchronize(device=None):
                threading.Event().wait(0.01)

            @staticmethod
            def _sleep(cycles):
                assert cycles > 1e6  # about 20 ms of spinning at the SM clock
                fake.ran.append("spin")

        self.cuda = Cuda

    def randn(self, *shape, device, dtype):
        assert device == "cuda:0" and dtype == "bf16"
        return SimpleNamespace(shape=shape)

    def empty(self, *shape, device, dtype):
        return SimpleNamespace(shape=shape)

    def mm(self, a, b, out):
        self.ran.append("matmul")


class _FakeGpmNvml:
    """pynvml's utilization, power and GPM calls: utilization reads 100 % under any load (what NVML measures),
    GPM's SM activity follows how many SMs the last load used."""

    NVML_CLOCK_SM, NVML_GPM_METRICS_GET_VERSION = 1, 1
    NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_ANY_TENSOR_UTIL = 2, 5

    def __init__(self, torch, gpm: bool = True):
        self.torch, self.gpm, self.inits, self.shutdowns, self.samples = torch, gpm, 0, 0, 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-000{h}"

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        assert h == 1  # matched by UUID, not by index
        return 1980

    def _last(self):
        return self.torch.ran[-1] if self.torch.ran else "idle"

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=0 if self._last() == "idle" else 100)

    def nvmlDeviceGetPowerUsage(self, h):
        return {"idle": 90_000, "spin": 120_000, "matmul": 650_000}[self._last()]

    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self):
        self.samples += 1
        return SimpleNamespace()

    def nvmlGpmSampleGet(self, h, sample):
        sample.last = self._last()

    def nvmlGpmSampleFree(self, sample):
        self.samples -= 1

    def c_nvmlGpmMetricsGet_t(self):
        return SimpleNamespace(metrics=[SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(2)])

    def nvmlGpmMetricsGet(self, get):
        sm = {"idle": 0.0, "spin": 100 / 132, "matmul": 98.0}[get.sample2.last]
        for m in get.metrics:
            m.value = sm if m.metricId == self.NVML_GPM_METRIC_SM_UTIL else (0.0 if sm < 50 else 80.0)


def test_gpu_utilization_demo_with_stand_ins():
    """GPU-only code, run here on stand-ins for torch and pynvml: the table it builds and its cleanup."""
    torch = _FakeGpuTorch()
    nvml = _FakeGpmNvml(torch)
    df, why = panels.gpu_utilization_demo(seconds=0.05, nvml=nvml, torch=torch)
    assert why == "" and nvml.inits == nvml.shutdowns == 1 and nvml.samples == 0
    assert list(df.index) == ["idle", "one thread block spinning on one SM", "bf16 matmul 8192x8192, back to back"]
    spin = df.loc["one thread block spinning on one SM"]
    assert spin["SMs it can occupy"] == "1 of 132" and spin["gpu_util_pct"] == 100 and spin["sm_active_pct"] < 1
    assert df.loc["bf16 matmul 8192x8192, back to back", "sm_active_pct"] > 90
    torch = _FakeGpuTorch()
    df, why = panels.gpu_utilization_demo(seconds=0.05, nvml=_FakeGpmNvml(torch, gpm=False), torch=torch)
    assert "Hopper" in why and df["sm_active_pct"].isna().all() and (df["gpu_util_pct"] >= 0).all()


def test_quantiles_of_parts_differ_from_the_pooled_one():
    q = panels.quantile_of_parts([[10.0] * 99 + [20.0], [100.0] * 100], 0.99)
    assert q["mean_of_parts"] != pytest.approx(q["pooled"])
    with pytest.raises(ValueError):
        panels.quantile_of_parts([[]])


def test_parse_exposition_keeps_the_exposed_counter_names():
    text = ("# TYPE nv_inference_count counter\nnv_inference_count{model=\"m\"} 5\n"
            "# TYPE http_requests_total counter\nhttp_requests_total 3\n# TYPE g gauge\ng 1.5\n")
    names = {lab["__name__"]: v for lab, v in prometheus.parse_exposition(text)}
    assert names == {"nv_inference_count": 5.0, "http_requests_total": 3.0, "g": 1.5}
    assert prometheus.metric_types(text)["nv_inference_count"] == "counter"


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
        assert wait_http_ok(self.metrics_url, self.proc, 60)
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


def _events(dog: drills.Watchdog) -> list[str]:
    return [e["event"] for e in dog.events]


def test_watchdog_restarts_with_backoff_and_gives_up(tmp_path):
    server = StubServer(tmp_path).start()
    restarted = []
    dog = drills.Watchdog(server, check_s=0.05, backoff_s=0.2, max_restarts=2, stable_s=600,
                          liveness=lambda s: f"{s.http_url}/v2/health/live", probe_timeout_s=30,
                          on_restart=restarted.append)
    try:
        with dog:
            first = server.pid
            drills.kill(server)
            assert _until(lambda: dog.restarts >= 1)
            assert dog.restarts == 1 and server.alive() and server.pid != first and restarted == [server]
            assert _events(dog)[:3] == ["watching", "down", "restarted"]
            server.fail_starts = 5  # now every start fails: backoff grows, then the watchdog gives up
            drills.kill(server)
            assert _until(lambda: dog.gave_up)
            downs = dog.timeline().query("event == 'down'")["backoff_s"].tolist()
            assert downs == [0.2, 0.4]  # 0.2 x 2^k while restarts fail in a row
            assert "restart failed" in _events(dog)
        assert not dog.alive()
    finally:
        server.stop()


def test_watchdog_pause_and_hung_server(tmp_path):
    """A server that answers its liveness URL with 404 looks hung and is restarted; after pause() a deliberate
    stop is never restarted. pause() returns once a check or restart under way has finished, so the count read
    after it is final however slow the machine (the flake this test once had: a restart already under way when
    pause() was called landed after the count was read)."""
    server = StubServer(tmp_path).start()
    dog = drills.Watchdog(server, check_s=0.05, backoff_s=0.1, max_backoff_s=0.5, failures=2, max_restarts=1000,
                          liveness=lambda s: f"{s.http_url}/v2/health/missing")  # 404: looks hung
    try:
        with dog:
            assert _until(lambda: dog.restarts >= 1)
            assert "liveness failed 2 times (HTTP 404)" in dog.timeline().query("event == 'down'")["reason"].iloc[0]
            dog.pause()
            n = dog.restarts
            server.stop()
            # many checks' worth of time (at check_s = 0.05 s) for the watchdog to react, which it must not
            threading.Event().wait(0.5)
            assert dog.restarts == n and not server.alive()  # a planned stop is not "restarted"
            dog.resume()  # watching again: the stopped server is found dead and restarted
            assert _until(lambda: dog.restarts > n)
    finally:
        dog.stop()
        server.stop()
    with pytest.raises(ValueError):
        drills.Watchdog(server, check_s=0)


def test_watchdog_pause_cuts_a_backoff_short(stub):
    dog = drills.Watchdog(stub, check_s=0.05, backoff_s=600)  # a backoff longer than any test
    with dog:
        drills.kill(stub)
        assert _until(lambda: "down" in _events(dog))
        t0 = time.monotonic()
        dog.pause()
        assert time.monotonic() - t0 < 30  # not the 600 s backoff
        assert _events(dog)[-1] == "not restarted" and dog.restarts == 0 and not stub.alive()


def _fake_load(calls):
    """Stands in for run_load: fails while nothing listens at url."""
    def load(url, concurrency, seconds):
        import urllib.request

        calls.append(url)
        threading.Event().wait(seconds)
        try:
            urllib.request.urlopen(f"http://{url}/metrics", timeout=5).read()
            return {"requests": 10, "errors": 0, "p99_ms": 1.0}
        except OSError:
            return {"requests": 0, "errors": 5, "p99_ms": math.nan}

    return load


def _drill(server, metrics, dog, calls):
    return drills.failure_drill(
        server, metrics, dog, lambda stop: drills.chunked_load(
            lambda: server.http_url.removeprefix("http://"), _fake_load(calls), 2, chunk_s=0.3, stop=stop),
        kill_after_s=0.5, after_recovery_s=1.0, timeout_s=60)


def test_failure_drill_with_prometheus_and_a_stub(tmp_path):
    _need("prometheus", "promtool")
    server = StubServer(tmp_path).start()
    rules = prometheus.lab_rules(tmp_path, for_s=0.3)
    metrics = prometheus.PrometheusServer(prometheus.scrape_jobs(server), rule_files=[rules],
                                          scrape_interval_s=0.2, evaluation_interval_s=0.2).start()
    dog = drills.Watchdog(server, check_s=0.05, backoff_s=1.0,
                          on_restart=lambda s: metrics.reload(jobs=prometheus.scrape_jobs(s)))
    calls: list[str] = []
    try:
        metrics.wait_for(f'up{{job="{prometheus.TRITON_JOB}"}} == 1', timeout_s=60)
        dog.start()
        # the load runs until 1 s after the recovery: the last chunks run against the restarted server
        drill = _drill(server, metrics, dog, calls)
    finally:
        dog.stop()
        metrics.stop()
        server.stop()
    steps = drill.table()["step"].tolist()
    assert steps[:4] == ["load started", "server killed", "up == 0 in Prometheus", "alert TritonServerDown firing"]
    assert "watchdog restarted the server" in steps and "up == 1 again" in steps
    assert "alert TritonServerDown resolved" in steps and steps[-1] == "load finished"
    chunks = drill.load
    assert chunks["errors"].sum() > 0 and chunks.iloc[-1]["requests"] > 0  # failures, then load resumes
    assert len(set(calls)) == 2  # the clients followed the server to its new address
    assert drills.plot_drill(drill).axes


def test_failure_drill_without_prometheus(tmp_path):
    """No Prometheus: the drill watches the server's liveness instead of up and the alert."""
    server = StubServer(tmp_path).start()
    dog = drills.Watchdog(server, check_s=0.05, backoff_s=0.5)
    calls: list[str] = []
    try:
        with dog:
            drill = _drill(server, None, dog, calls)
    finally:
        server.stop()
    steps = drill.table()["step"].tolist()
    assert steps[:2] == ["load started", "server killed"]
    assert "watchdog restarted the server" in steps and "live again" in steps and steps[-1] == "load finished"
    assert drill.load["errors"].sum() > 0 and drill.load.iloc[-1]["requests"] > 0
    assert drills.plot_drill(drill).axes


def test_health_probe(stub):
    health = drills.health(stub)
    assert health["live"] is True and health["live_http"] == "HTTP 200"


def test_run_phases_and_chunked_load_tables():
    phases = [drills.Phase("ramp", 1, 0.01), drills.Phase("overload", 8, 0.01)]
    df = drills.run_phases(phases, lambda c, s: {"requests": 10 * c, "errors": 0, "throughput_infer_s": 5.0 * c,
                                                 "p50_ms": 1.0, "p99_ms": 2.0})
    assert df["requests"].tolist() == [10, 80] and df["throughput_rps"].tolist() == [5.0, 40.0]
    assert (df["end"] >= df["start"]).all()

    def boom(url, c, s):
        raise ConnectionError("nothing there")

    chunks = drills.chunked_load(lambda: "127.0.0.1:1", boom, 3, 0.5, chunk_s=0.2)
    assert (chunks["errors"] == 3).all() and chunks["error"].str.contains("nothing there").all()
    with pytest.raises(ValueError, match="duration_s .* or stop"):
        drills.chunked_load(lambda: "127.0.0.1:1", boom, 3)
    assert drills.default_phases(True)[-1].name == "overload"


def test_gpu_sources_compared_by_uuid():
    """The notebook's GPU cross-check, on series shaped like Triton's (DCGM) and the exporter's (NVML), served by
    Prometheus from recorded samples."""
    _need("prometheus", "promtool")
    t0 = 1_700_000_000.0
    mib = 2**20
    samples = []
    for i in range(11):
        t = t0 + i
        for uuid, used_mib, power in (("GPU-a", 1000, 300.0), ("GPU-b", 2000, 500.0)):
            samples.append(({"__name__": "nv_gpu_memory_used_bytes", "gpu_uuid": uuid}, t, (used_mib + 500) * mib))
            samples.append(({"__name__": "nv_gpu_power_usage", "gpu_uuid": uuid}, t, power * 1.05))
            lab = {"gpu": uuid[-1], "UUID": uuid}
            samples.append(({"__name__": "DCGM_FI_DEV_FB_USED", **lab}, t, used_mib))
            samples.append(({"__name__": "DCGM_FI_DEV_FB_RESERVED", **lab}, t, 500))
            samples.append(({"__name__": "DCGM_FI_DEV_POWER_USAGE", **lab}, t, power))
    with prometheus.recorded_server(samples) as server:
        df = panels.compare_gpu_sources(server, at=t0 + 10, window_s=8)
        empty = panels.compare_gpu_sources(server, at=t0 + 3600, window_s=8)  # long after: no samples in the window
    got = {(r.metric, r.uuid): (round(r.ratio, 3), r.within) for r in df.itertuples()}
    assert got[("power_w", "GPU-a")] == (1.05, True)
    assert got[("memory_used_bytes", "GPU-a")] == (1.5, False)  # this "Triton" counts reserved memory as used
    assert got[("memory_used_plus_reserved_bytes", "GPU-b")] == (1.0, True)
    assert len(df) == 6 and empty.empty
