"""Lab 07's monitoring: Prometheus scraping both Triton servers and nginx, the service's SLO alert rules, and its
dashboard (generated from one panel list, as lab 05's).

- ``NginxExporter(lb)``: nginx's numbers for Prometheus (``nvlab_nginx_*``), served from a thread of this process.
- ``SERVICE_RULES_FILE`` (the SLO alerts), ``SERVICE_RULES_TEST_FILE`` (their ``promtool test rules``),
  ``SERVICE_DASHBOARD_FILE`` (``dashboard_text()`` writes it), ``SERVICE_PANELS``.
- ``ServiceMonitoring(service)``: the exporter and a local Prometheus; ``start()``, ``stop()``.
  ``start_monitoring(service, ...)`` does both, or returns None where Prometheus is missing.

Design notes: docs/internals.md#lab_utilsmonitoringservice_monitoringpy"""

from __future__ import annotations

import itertools
import shutil
import threading
import urllib.error
from collections import Counter
from pathlib import Path
from typing import Any

from lab_utils.monitoring import panels, prometheus
from lab_utils.monitoring.gpu_exporter import MetricsServer
from lab_utils.monitoring.panels import Panel
from lab_utils.procs import owned_tempdir, release_at_exit, stop_at_exit
from lab_utils.serving import nginx as nginx_mod
from lab_utils.serving.nginxlog import access_rows

NGINX_JOB = "nginx"
SERVICE_RULES_FILE = prometheus.RULES_DIR / "service_rules.yml"
SERVICE_RULES_TEST_FILE = prometheus.RULES_DIR / "service_rules_test.yml"
SERVICE_DASHBOARD_FILE = prometheus.RULES_DIR / "service_dashboard.json"
BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # 0.1: the SLO's edge
SLO_MS = 100.0


class _Collector:
    """The access log read from where the last scrape stopped (counters that only grow, as Prometheus wants), and
    stub_status's connections: what a scrape of the nginx exporter gets."""

    def __init__(self, lb: nginx_mod.NginxServer):
        self.lb, self.offset = lb, 0
        self.requests: Counter[tuple[str, str]] = Counter()  # (listener, status)
        self.upstreams: Counter[str] = Counter()
        self.buckets: dict[str, list[int]] = {}  # listener -> count per bucket (not cumulative), +Inf last
        self.sums: Counter[str] = Counter()
        self.lock = threading.Lock()

    def update(self) -> None:
        try:
            with open(self.lb.access_log_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except (OSError, nginx_mod.NginxError):
            return
        end = data.rfind(b"\n") + 1  # a line being written now is read at the next scrape
        self.offset += end
        for row in access_rows(data[:end].decode(errors="replace")):
            listener, status = str(row.get("listener", "other")), str(row.get("status", "0"))
            self.requests[(listener, status)] += 1
            if row["upstream"]:
                self.upstreams[row["upstream"]] += 1
            t = float(row.get("request_time", 0.0))
            counts = self.buckets.setdefault(listener, [0] * (len(BUCKETS_S) + 1))
            counts[next((i for i, b in enumerate(BUCKETS_S) if t <= b), len(BUCKETS_S))] += 1
            self.sums[listener] += t

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self.lock:
            self.update()
            req = CounterMetricFamily("nvlab_nginx_requests", "Requests nginx answered (its access log), by "
                                      "listener (http, grpc) and HTTP status.", labels=["listener", "status"])
            for (listener, status), n in sorted(self.requests.items()):
                req.add_metric([listener, status], n)
            yield req
            up = CounterMetricFamily("nvlab_nginx_upstream_requests", "Requests a backend answered, by backend "
                                     "(host:port).", labels=["upstream"])
            for addr, n in sorted(self.upstreams.items()):
                up.add_metric([addr], n)
            yield up
            hist = HistogramMetricFamily("nvlab_nginx_request_duration_seconds", "nginx's request time (s): first "
                                         "byte read to last byte sent.", labels=["listener"])
            for listener, counts in sorted(self.buckets.items()):
                cumulative = zip([*map(str, BUCKETS_S), "+Inf"], itertools.accumulate(counts), strict=True)
                hist.add_metric([listener], list(cumulative), self.sums[listener])
            yield hist
        try:
            stub = self.lb.stub_status()
        except (OSError, ValueError, urllib.error.URLError):
            return
        yield GaugeMetricFamily("nvlab_nginx_connections_active", "Open client connections (stub_status).",
                                value=stub["active"])
        yield CounterMetricFamily("nvlab_nginx_connections_accepted", "Client connections accepted (stub_status).",
                                  value=stub["accepts"])
        yield CounterMetricFamily("nvlab_nginx_http_requests", "Client requests, every listener (stub_status).",
                                  value=stub["requests"])


class NginxExporter(MetricsServer):
    """nginx's metrics for Prometheus (see the module's docstring), served on a free loopback port by a thread (a
    busy ``port`` falls back to a free one)."""

    def __init__(self, lb: nginx_mod.NginxServer, host: str = "127.0.0.1", port: int | None = None):
        super().__init__([_Collector(lb)], port=port, host=host, fallback_port=True)
        self.lb = lb

    def __repr__(self) -> str:
        return f"NginxExporter({'serving ' + self.url if self.alive() else 'stopped'})"


# --- panels and the dashboard ------------------------------------------------------------------------------

_P95 = ("histogram_quantile(0.95, sum by (le) (rate(nvlab_nginx_request_duration_seconds_bucket[{w}]))) * 1000")
SERVICE_PANELS: tuple[Panel, ...] = (
    Panel("qps", "Requests through nginx (req/s), by status", "sum by (status) (rate(nvlab_nginx_requests_total[{w}]))",
          "req/s", "{{status}}", description="Every request nginx answered, by HTTP status: 200 served, 4xx refused "
                                             "(401 key, 413 size, 429 rate), 5xx failed."),
    Panel("p95", "p95 latency at nginx (ms) against the 100 ms SLO", _P95, "ms", "p95",
          description="The 95th percentile of nginx's request time, from its histogram (buckets up to 10 s; the "
                      "SLO's 100 ms is a bucket edge, so 'over the SLO' is exact)."),
    Panel("errors", "Share of requests failing (5xx)",
          'sum(rate(nvlab_nginx_requests_total{status=~"5.."}[{w}])) / sum(rate(nvlab_nginx_requests_total[{w}]))',
          "fraction", "5xx share", description="Server errors over all requests: the error budget's burn."),
    Panel("per_upstream", "Requests per Triton server (req/s)",
          "sum by (upstream) (rate(nvlab_nginx_upstream_requests_total[{w}]))", "req/s", "{{upstream}}",
          description="How nginx spreads the load: equal weights give equal shares."),
    Panel("per_version", "Classifier requests per version (req/s)",
          'sum by (version) (rate(nv_inference_request_success{model="digits_classifier"}[{w}]))', "req/s",
          "v{{version}}", description="Which classifier version answers: a hot update moves the traffic from v1 to "
                                      "v2 (cache hits count as answered requests)."),
    Panel("cache", "Response cache hit ratio",
          "sum(rate(nv_cache_num_hits_per_model[{w}])) / (sum(rate(nv_cache_num_hits_per_model[{w}])) + "
          "sum(rate(nv_cache_num_misses_per_model[{w}])))", "fraction", "hit ratio",
          description="Cache hits over lookups, both servers: repeated images are answered without the model."),
    Panel("triton_latency", "Triton's average request latency (ms), by model", panels.panel("latency").expr, "ms",
          description="Server-side time per request in each model of the ensemble (queue + compute)."),
    Panel("connections", "Open client connections at nginx", "nvlab_nginx_connections_active", "connections",
          "active", description="stub_status's active connections: clients connected now."),
    Panel("up", "Targets up (1) or down (0)", "up", "", "{{job}} {{instance}}",
          description="1 when Prometheus' last scrape of the target (each Triton, the nginx exporter) succeeded."))


def dashboard_text(window: str = "$__rate_interval") -> str:
    """The service's Grafana dashboard built from ``SERVICE_PANELS``: ``SERVICE_DASHBOARD_FILE``'s text (generated:
    ``python -c 'from lab_utils.monitoring import service_monitoring as m;
    m.SERVICE_DASHBOARD_FILE.write_text(m.dashboard_text())'``)."""
    return panels.grafana_dashboard(SERVICE_PANELS, "Image-classification service (nvlab lab 07)", "nvlab-service",
                                    ["nvlab", "nginx", "triton", "slo"], window)


def panel(key: str) -> Panel:
    return panels.panel(key, SERVICE_PANELS)


# --- Prometheus for the service ------------------------------------------------------------------------------


class ServiceMonitoring:
    """The nginx exporter and a local Prometheus scraping both Triton servers and it, with the SLO rules (a lab
    copy: ``for_s`` seconds instead of minutes, rate windows ``window``). ``metrics``: the ``PromAPI``."""

    def __init__(self, service: Any, *, for_s: float = 2.0, window: str = "10s", scrape_interval_s: float = 1.0):
        self.service, self.for_s, self.window, self.scrape_interval_s = service, for_s, window, scrape_interval_s
        self.exporter: NginxExporter | None = None
        self.metrics: Any = None
        self.rules_path: Path | None = None
        self.workdir: Path | None = None

    def jobs(self) -> dict[str, list[str]]:
        jobs = dict(self.service.scrape_jobs())
        if self.exporter is not None:
            jobs[NGINX_JOB] = [self.exporter.address]
        return jobs

    def start(self) -> ServiceMonitoring:
        stop_at_exit(self)
        try:
            if self.service.lb is not None:
                self.exporter = NginxExporter(self.service.lb).start()
            self.workdir = owned_tempdir("service-rules")
            self.rules_path = prometheus.lab_rules(self.workdir, for_s=self.for_s, window=self.window,
                                                   source=SERVICE_RULES_FILE)
            self.metrics = prometheus.start_metrics(self.jobs(), rule_files=[self.rules_path],
                                                    scrape_interval_s=self.scrape_interval_s,
                                                    evaluation_interval_s=self.scrape_interval_s, prefer="local")
            self.metrics.wait_for(f"sum(up) == {sum(len(v) for v in self.jobs().values())}", timeout_s=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop Prometheus and the exporter; safe twice."""
        if self.metrics is not None:  # a PromAPI of the compose stack's Prometheus: stop() does nothing
            self.metrics.stop()
        if self.exporter is not None:
            self.exporter.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        release_at_exit(self)

    def alive(self) -> bool:
        return bool(self.metrics is not None and getattr(self.metrics, "alive", lambda: True)())

    def __repr__(self) -> str:
        return f"ServiceMonitoring({'running' if self.alive() else 'stopped'}, jobs {sorted(self.jobs())})"


def start_monitoring(service: Any, **kwargs: Any) -> ServiceMonitoring | None:
    """``ServiceMonitoring(service, **kwargs)`` started and owned by the service; None (with how to install
    Prometheus printed) where Prometheus is missing."""
    if not prometheus.available(show=True):
        return None
    return service.own(ServiceMonitoring(service, **kwargs).start())

