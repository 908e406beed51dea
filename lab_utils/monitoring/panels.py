"""Lab 05's operations toolkit: the in-process scraper (the fallback for a missing Prometheus), the lab's
copy of the alert rules, the panels shared by the notebook and the Grafana dashboard, load phases, a
watchdog that restarts a dead server with backoff, and the failure drill.

Everything started here is an owned object (a thread or a process) that stops on ``stop()``, on context
exit and at interpreter exit.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.monitoring import promql
from lab_utils.monitoring.prometheus import (
    EXPORTER_JOB,
    RULES_DIR,
    TRITON_JOB,
    ConfigError,
    PromAPI,
    QueryError,
    find_binary,
)
from lab_utils.procs import release_at_exit, stop_at_exit

RULES_FILE = RULES_DIR / "alert_rules.yml"
RULES_TEST_FILE = RULES_DIR / "alert_rules_test.yml"
DASHBOARD_FILE = RULES_DIR / "grafana_dashboard.json"


# --- panels: one list of PromQL for the notebook's plots and the dashboard -------------------------------


@dataclass(frozen=True)
class Panel:
    """One plot: a PromQL expression with ``{w}`` for the rate window, its unit and what it shows."""

    key: str
    title: str
    expr: str
    unit: str
    legend: str = "{{model}}"
    needs_gpu: bool = False
    host_only: bool = False  # the CPU tier's stand-in for a GPU panel

    def promql(self, window: str = "1m") -> str:
        return self.expr.replace("{w}", window)


PANELS: tuple[Panel, ...] = (
    Panel("qps", "Throughput (requests/s)", "sum by (model) (rate(nv_inference_request_success[{w}]))", "req/s"),
    Panel("batch", "Average batch size (inferences per execution)",
          "sum by (model) (rate(nv_inference_count[{w}])) / sum by (model) (rate(nv_inference_exec_count[{w}]))",
          "inferences"),
    Panel("latency", "Average request latency (ms)",
          "sum by (model) (rate(nv_inference_request_duration_us[{w}])) "
          "/ sum by (model) (rate(nv_inference_request_success[{w}])) / 1000", "ms"),
    Panel("queue_share", "Share of request time spent queued",
          "sum by (model) (rate(nv_inference_queue_duration_us[{w}])) "
          "/ sum by (model) (rate(nv_inference_request_duration_us[{w}]))", "fraction"),
    Panel("p99", "p99 latency from Triton's summary (ms)",
          'max by (model) (nv_inference_request_summary_us{quantile="0.99"}) / 1000', "ms"),
    Panel("pending", "Pending requests (queued, not yet executing)",
          "sum by (model) (nv_inference_pending_request_count)", "requests"),
    Panel("gpu_util", "GPU utilization (%)", "DCGM_FI_DEV_GPU_UTIL", "%", "GPU {{gpu}}", needs_gpu=True),
    Panel("gpu_memory", "GPU memory used (GiB)", "DCGM_FI_DEV_FB_USED / 1024", "GiB", "GPU {{gpu}}", needs_gpu=True),
    Panel("gpu_power", "GPU power (W)", "DCGM_FI_DEV_POWER_USAGE", "W", "GPU {{gpu}}", needs_gpu=True),
    Panel("host_cpu", "Host CPU busy (%)", "nvlab_host_cpu_utilization_percent", "%", "host", host_only=True),
    Panel("host_memory", "Host memory used (GiB)", "nvlab_host_memory_used_bytes / 2^30", "GiB", "host",
          host_only=True),
    Panel("up", "Targets up (1) or down (0)", "up", "", "{{job}}"),
)


def panels(gpu: bool) -> list[Panel]:
    """The notebook's panels: GPU panels with a GPU, the host's in their place without one."""
    return [p for p in PANELS if (p.needs_gpu and gpu) or (p.host_only and not gpu) or
            not (p.needs_gpu or p.host_only)]


def dashboard(window: str = "$__rate_interval") -> dict[str, Any]:
    """The Grafana dashboard (JSON model) built from :data:`PANELS`: the same expressions as the notebook."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    out_panels = []
    for i, p in enumerate(PANELS):
        unit = {"req/s": "reqps", "ms": "ms", "fraction": "percentunit", "%": "percent", "GiB": "decgbytes",
                "W": "watt"}.get(p.unit, "short")
        out_panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "datasource": ds,
            "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": (i // 3) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": "A", "datasource": ds, "expr": p.promql(window), "legendFormat": p.legend}],
        })
    return {
        "title": "Triton and GPU (nvlab lab 05)",
        "uid": "nvlab-triton-gpu",
        "tags": ["nvlab", "triton", "gpu"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []},
        "panels": out_panels,
    }


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def dashboard_expressions(path: str | Path = DASHBOARD_FILE, window: str = "5s") -> list[tuple[str, str]]:
    """(title, expression) of every query in a dashboard file, Grafana's ``$__rate_interval`` set to ``window``."""
    model = json.loads(Path(path).read_text())
    out = []
    for p in model.get("panels", []):
        for t in p.get("targets", []):
            expr = re.sub(r"\$__rate_interval|\$__interval|\$\{__rate_interval\}", window, t["expr"])
            out.append((p.get("title", "?"), expr))
    return out


# --- rules: the lab's copy -----------------------------------------------------------------------------


def load_rules(path: str | Path = RULES_FILE) -> dict[str, Any]:
    """A rules file as data (YAML, or the JSON form the lab writes)."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"reading {path} needs PyYAML: pip install pyyaml") from None
    return yaml.safe_load(text)


_CMP_NUMBER = re.compile(r"(>=|<=|==|!=|>|<)(\s*)(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)")


def set_threshold(expr: str, value: float) -> str:
    """``expr`` with the number of every comparison replaced by ``value`` (``... > 500`` -> ``... > 120``)."""
    if not _CMP_NUMBER.search(expr):
        raise ValueError(f"no comparison with a number in {expr!r}: nothing to set")
    return _CMP_NUMBER.sub(lambda m: f"{m.group(1)}{m.group(2)}{value:g}", expr)


def lab_rules(out_dir: str | Path, *, for_s: float | Mapping[str, float] = 2.0, default_for_s: float | None = None,
              window: str | None = None, thresholds: Mapping[str, float] | None = None,
              source: str | Path = RULES_FILE, check: bool = True) -> Path:
    """Write the lab's copy of the rules: shorter ``for:`` (``for_s``; per alert if a mapping, the others
    ``default_for_s`` or as in the file), rate windows
    set to ``window``, and ``thresholds`` per alert name. promtool checks the copy when it is installed
    (:class:`ConfigError` carries its message). Returns the file's path.
    """
    rules = load_rules(source)
    names = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    unknown = (set(thresholds or {}) | set(for_s if isinstance(for_s, Mapping) else {})) - names
    if unknown:
        raise ValueError(f"thresholds for unknown alerts {sorted(unknown)}; the alerts are {sorted(names)}")
    for group in rules["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert")
            if name is None:
                continue
            f = for_s.get(name, default_for_s) if isinstance(for_s, Mapping) else for_s
            if isinstance(f, (int, float)):
                rule["for"] = f"{int(round(f * 1000))}ms" if f < 1 or f != int(f) else f"{int(f)}s"
            if window:
                rule["expr"] = re.sub(r"\[(\d+[smhd])\]", f"[{window}]", rule["expr"])
            if thresholds and name in thresholds:
                rule["expr"] = set_threshold(rule["expr"], thresholds[name])
            rule.setdefault("annotations", {})["lab_copy"] = "short durations for the lab"
    out = Path(out_dir) / "alert_rules.lab.yml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rules, indent=2) + "\n")
    if check and find_binary("promtool"):
        from lab_utils.monitoring.prometheus import check_rules

        check_rules(out)
    return out


# --- the in-process scraper ----------------------------------------------------------------------------

def parse_exposition(text: str) -> list[tuple[dict[str, str], float]]:
    """Samples of a Prometheus text exposition: ``({"__name__": ..., labels...}, value)``, with
    prometheus_client's parser (the one the Python client ships)."""
    from prometheus_client.parser import text_string_to_metric_families

    # The parser names counter samples "<family>_total" even where the text has no suffix (Triton's counters
    # have none); Prometheus keeps the exposed name, and so does this.
    exposed = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?=[{\s])", text, flags=re.M))
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name
            if name not in exposed and name.endswith("_total") and name[:-6] in exposed:
                name = name[:-6]
            out.append(({"__name__": name, **s.labels}, float(s.value)))
    return out


def metric_types(text: str) -> dict[str, str]:
    """{family: type} from a text exposition's ``# TYPE`` lines (counter, gauge, summary, histogram...)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


@dataclass
class _AlertState:
    labels: dict[str, str]
    active_at: float
    value: float
    state: str = "pending"


class InProcessScraper(PromAPI):
    """Stands in for Prometheus when no binary is installed: scrapes ``jobs`` every ``scrape_interval_s`` from a
    thread, keeps the samples in memory, answers PromQL with :mod:`lab_utils.monitoring.promql`, and evaluates the
    alerting rules of ``rule_files`` (pending -> firing after ``for:``), with the same calls as
    :class:`~lab_utils.monitoring.prometheus.PromAPI`. A failed scrape sets ``up`` to 0 and marks the target's series
    stale, as Prometheus does.
    """

    kind = "scraper"

    def __init__(self, jobs: Mapping[str, Sequence[str]], *, rule_files: Sequence[str | Path] = (),
                 scrape_interval_s: float = 1.0, evaluation_interval_s: float = 1.0, timeout_s: float | None = None):
        super().__init__("http://in-process")
        self.jobs = {k: list(v) for k, v in jobs.items()}
        self.scrape_interval_s, self.evaluation_interval_s = scrape_interval_s, evaluation_interval_s
        self.timeout_s = timeout_s or max(scrape_interval_s, 0.5)
        self.store = promql.SampleStore()
        self.rule_files = [Path(p) for p in rule_files]
        self._rules = self._load_rules()
        self._alerts: dict[tuple[str, tuple[tuple[str, str], ...]], _AlertState] = {}
        self._seen: dict[tuple[str, str], set[promql.Labels]] = {}
        self._health: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.notes = ["no prometheus binary here: an in-process scraper stands in (prometheus_client's text parser, "
                      "rates and alerts computed by lab_utils.monitoring.promql); install Debian's `prometheus` for the real one"]

    def describe(self) -> str:
        return f"in-process scraper (scrape every {self.scrape_interval_s:g} s), standing in for Prometheus"

    def _load_rules(self) -> list[dict[str, Any]]:
        rules = []
        for path in self.rule_files:
            for group in load_rules(path).get("groups", []):
                for r in group.get("rules", []):
                    if "alert" in r:
                        promql.parse(r["expr"])  # a rule the evaluator cannot read fails now, by name
                        rules.append({**r, "group": group["name"],
                                      "for_s": promql.parse_duration(str(r.get("for", "0s")))
                                      if r.get("for") else 0.0})
        return rules

    # lifecycle
    def start(self) -> InProcessScraper:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self.scrape_once()
            self._thread = threading.Thread(target=self._loop, name="nvlab-scraper", daemon=True)
            self._thread.start()
            stop_at_exit(self)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        release_at_exit(self)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def reload(self, jobs: Mapping[str, Sequence[str]] | None = None,
               rule_files: Sequence[str | Path] | None = None) -> None:
        with self._lock:
            if jobs is not None:
                new = {k: list(v) for k, v in jobs.items()}
                keep = {(j, i) for j, targets in new.items() for i in targets}
                t = time.time()
                for job, instance in [k for k in self._seen if k not in keep]:
                    # a target that left the configuration: its series end now (Prometheus writes stale markers)
                    for key in self._seen.pop((job, instance)):
                        self.store.mark_stale(key, t)
                    for name in ("up", "scrape_duration_seconds"):
                        self.store.mark_stale(promql.SampleStore.key({"__name__": name, "job": job,
                                                                      "instance": instance}), t)
                    self._health.pop((job, instance), None)
                self.jobs = new
            if rule_files is not None:
                self.rule_files = [Path(p) for p in rule_files]
                self._rules = self._load_rules()

    def _loop(self) -> None:
        next_eval = time.monotonic()
        while not self._stop.wait(max(0.0, self.scrape_interval_s - 0.0)):
            with contextlib.suppress(Exception):  # one bad round must not end monitoring
                self.scrape_once()
            if time.monotonic() >= next_eval:
                with contextlib.suppress(Exception):
                    self.evaluate_rules()
                next_eval = time.monotonic() + self.evaluation_interval_s

    def scrape_once(self) -> None:
        """Scrape every target now (what the thread does each interval)."""
        for job, targets in list(self.jobs.items()):
            for instance in targets:
                t0 = time.time()
                err = ""
                samples: list[tuple[dict[str, str], float]] = []
                try:
                    with urllib.request.urlopen(f"http://{instance}/metrics", timeout=self.timeout_s) as r:
                        samples = parse_exposition(r.read().decode("utf-8", errors="replace"))
                except (urllib.error.URLError, OSError, ValueError) as e:
                    err = str(getattr(e, "reason", e))
                dt = time.time() - t0
                self._ingest(job, instance, t0, samples, err, dt)

    def _ingest(self, job: str, instance: str, t: float, samples: list[tuple[dict[str, str], float]], err: str,
                duration_s: float) -> None:
        with self._lock:
            key = (job, instance)
            now_keys: set[promql.Labels] = set()
            for labels, v in samples:
                lab = {**labels, "job": job, "instance": instance}
                k = promql.SampleStore.key(lab)
                now_keys.add(k)
                self.store.add(k, t, v)
            for gone in self._seen.get(key, set()) - now_keys:
                self.store.mark_stale(gone, t)
            self._seen[key] = now_keys
            base = {"job": job, "instance": instance}
            self.store.add({"__name__": "up", **base}, t, 0.0 if err else 1.0)
            self.store.add({"__name__": "scrape_duration_seconds", **base}, t, duration_s)
            self._health[key] = {"job": job, "instance": instance, "health": "down" if err else "up",
                                 "lastError": err, "scrape_s": duration_s}

    def evaluate_rules(self, at: float | None = None) -> None:
        """Evaluate the alerting rules once: pending, firing after ``for:``, gone when the expression is empty."""
        t = time.time() if at is None else at
        with self._lock:
            for rule in self._rules:
                name = rule["alert"]
                try:
                    data = promql.instant(self.store, rule["expr"], t)
                except promql.PromQLError:
                    continue
                active = set()
                for r in data["result"] if data["resultType"] == "vector" else []:
                    labels = {k: v for k, v in r["metric"].items() if k != "__name__"}
                    labels.update({"alertname": name, **rule.get("labels", {})})
                    key = (name, tuple(sorted(labels.items())))
                    active.add(key)
                    st = self._alerts.get(key)
                    if st is None:
                        st = self._alerts[key] = _AlertState(labels, t, float(r["value"][1]))
                    st.value = float(r["value"][1])
                    if t - st.active_at >= rule["for_s"]:
                        st.state = "firing"
                for key in [k for k in self._alerts if k[0] == name and k not in active]:
                    del self._alerts[key]

    # the PromAPI calls, answered here
    def query_raw(self, expr: str, at: float | None = None) -> dict[str, Any]:
        with self._lock:
            try:
                return promql.instant(self.store, expr, time.time() if at is None else float(at))
            except promql.PromQLError as err:
                raise QueryError(f"query {expr!r} failed: {err}") from None

    def query_range_raw(self, expr: str, start: float, end: float, step_s: float = 1.0) -> dict[str, Any]:
        with self._lock:
            try:
                return promql.range_query(self.store, expr, float(start), float(end), float(step_s))
            except promql.PromQLError as err:
                raise QueryError(f"query {expr!r} failed: {err}") from None

    def alerts(self) -> Any:
        import pandas as pd

        rules = {r["alert"]: r for r in self._rules}
        with self._lock:
            rows = [{"alertname": st.labels["alertname"], "state": st.state, "severity": st.labels.get("severity"),
                     "activeAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.active_at)), "value": st.value,
                     "labels": {k: v for k, v in st.labels.items() if k not in ("alertname", "severity")},
                     "summary": _expand(rules[name].get("annotations", {}).get("summary", ""), st)}
                    for (name, _), st in self._alerts.items()]
        return pd.DataFrame(rows, columns=["alertname", "state", "severity", "activeAt", "value", "labels",
                                           "summary"])

    def rules(self) -> Any:
        import pandas as pd

        with self._lock:
            firing = {k[0]: st.state for k, st in self._alerts.items()}
            rows = [{"group": r["group"], "name": r["alert"], "type": "alerting",
                     "state": firing.get(r["alert"], "inactive"), "health": "ok", "for_s": r["for_s"],
                     "query": r["expr"]} for r in self._rules]
        return pd.DataFrame(rows, columns=["group", "name", "type", "state", "health", "for_s", "query"])

    def targets(self) -> Any:
        import pandas as pd

        with self._lock:
            rows = list(self._health.values())
        return pd.DataFrame(rows, columns=["job", "instance", "health", "lastError", "scrape_s"])

    def ready(self) -> bool:
        return self.alive()

    def __enter__(self) -> InProcessScraper:
        return self.start()


def _expand(template: str, st: _AlertState) -> str:
    """Enough of Prometheus' annotation templates for the lab's summaries ({{ $labels.x }}, {{ $value }})."""
    out = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: st.labels.get(m.group(1), ""), template)
    out = re.sub(r"\{\{\s*\$value\s*\|\s*humanizePercentage\s*\}\}", f"{st.value * 100:.4g}%", out)
    out = re.sub(r"\{\{\s*\$value[^}]*\}\}", f"{st.value:.0f}", out)
    return out


def scrape_jobs(server: Any, exporter: Any = None) -> dict[str, list[str]]:
    """The scrape jobs for a Triton server (its metrics port) and the GPU exporter: ``{job: [host:port]}``."""
    from urllib.parse import urlsplit

    parts = urlsplit(server.metrics_url)
    jobs = {TRITON_JOB: [f"{parts.hostname}:{parts.port}"]}
    if exporter is not None:
        jobs[EXPORTER_JOB] = [exporter.address]
    return jobs


# --- load phases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """A stretch of closed-loop load: ``concurrency`` clients for ``duration_s``."""

    name: str
    concurrency: int
    duration_s: float


def default_phases(quick: bool) -> list[Phase]:
    """Ramp, steady, overload. The overload runs many more clients than the model's instances can serve,
    so requests queue: the latency grows while the throughput stays flat."""
    if quick:
        return [Phase("ramp", 1, 3), Phase("ramp", 2, 3), Phase("steady", 4, 6), Phase("overload", 32, 8)]
    return [Phase("ramp", 1, 10), Phase("ramp", 2, 10), Phase("ramp", 4, 10), Phase("steady", 4, 30),
            Phase("overload", 64, 30)]


def _field(res: Any, *names: str, default: Any = math.nan) -> Any:
    for n in names:
        if isinstance(res, Mapping) and n in res:
            return res[n]
        if hasattr(res, n):
            return getattr(res, n)
    return default


def run_phases(phases: Sequence[Phase], load: Callable[[int, float], Any]) -> Any:
    """Run each phase with ``load(concurrency, duration_s)`` (lab 04's ``run_load``, bound to a model);
    a data frame with each phase's wall-clock start and end (for the PromQL range queries) and results."""
    import pandas as pd

    rows = []
    for ph in phases:
        start = time.time()
        res = load(ph.concurrency, ph.duration_s)
        end = time.time()
        rows.append({"phase": ph.name, "concurrency": ph.concurrency, "start": start, "end": end,
                     "requests": _field(res, "requests", "count", "ok"),
                     "errors": _field(res, "errors", "error_count", default=0),
                     "throughput_rps": _field(res, "throughput_infer_s", "throughput_rps", "throughput"),
                     "p50_ms": _field(res, "p50_ms"), "p99_ms": _field(res, "p99_ms"), "result": res})
    return pd.DataFrame(rows)


def chunked_load(target: Callable[[], str], load: Callable[[str, int, float], Any], concurrency: int,
                 duration_s: float, chunk_s: float = 1.0) -> Any:
    """Closed-loop load in chunks of ``chunk_s``, each aimed at ``target()`` (the server's current address, so
    the clients follow a restarted server as a service address would); one row per chunk: start, end,
    requests, errors, p99. ``load(url, concurrency, seconds)`` runs one chunk (lab 04's ``run_load``)."""
    import pandas as pd

    rows = []
    end = time.time() + duration_s
    while time.time() < end:
        t0 = time.time()
        seconds = max(0.2, min(chunk_s, end - t0))
        try:
            res = load(target(), concurrency, seconds)
            rows.append({"start": t0, "end": time.time(), "requests": _field(res, "requests", default=0),
                         "errors": _field(res, "errors_total", "errors", default=0),
                         "p99_ms": _field(res, "p99_ms"), "error": ""})
        except Exception as err:  # the clients could not even start (no server there): a failed chunk
            rows.append({"start": t0, "end": time.time(), "requests": 0, "errors": concurrency, "p99_ms": math.nan,
                         "error": f"{type(err).__name__}: {str(err)[:120]}"})
            threading.Event().wait(min(0.2, max(0.0, end - time.time())))
    return pd.DataFrame(rows, columns=["start", "end", "requests", "errors", "p99_ms", "error"])


def panel_frames(metrics: PromAPI, panel_list: Sequence[Panel], start: float, end: float, window: str,
                 step_s: float = 1.0) -> dict[str, Any]:
    """Range-query every panel over [start, end]: {panel key: long frame}. A failing expression raises
    :class:`QueryError` naming it."""
    return {p.key: metrics.query_range(p.promql(window), start, end, step_s) for p in panel_list}


# --- health and the watchdog -----------------------------------------------------------------------------


def probe(url: str, timeout_s: float = 1.0) -> tuple[bool, str]:
    """GET ``url``: (answered 200, what happened) — for ``/v2/health/live`` and ``/v2/health/ready``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200, f"HTTP {r.status}"
    except urllib.error.HTTPError as err:
        return False, f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, type(getattr(err, "reason", err)).__name__


def health(server: Any) -> dict[str, Any]:
    """Liveness (the process serves HTTP) and readiness (its models can take requests) of a Triton server."""
    live, live_why = probe(f"{server.http_url}/v2/health/live")
    ready, ready_why = probe(f"{server.http_url}/v2/health/ready")
    return {"live": live, "live_http": live_why, "ready": ready, "ready_http": ready_why}


class Watchdog:
    """Restarts a server that died or stopped answering, with exponential backoff: the shell loop
    ``while true; do tritonserver ...; sleep 1; done`` done properly.

    Every ``check_s`` it looks at the process (``server.alive()``) and, when given, a liveness URL
    (``liveness(server)`` -> URL; ``failures`` failed probes in a row count as hung). A dead or hung server is
    stopped (its whole process group), then restarted after ``backoff_s`` × 2^k (k = restarts in a row, capped
    at ``max_backoff_s``); a restart that stays up ``stable_s`` resets k. After ``max_restarts`` in a row it
    gives up (``gave_up``) instead of hammering a crash loop. ``on_restart(server)`` runs after each restart
    (the lab points Prometheus at the server's new address there). ``stop()`` ends the watchdog, never the
    server, and a deliberate ``server.stop()`` while it is paused is not "restarted".
    """

    def __init__(self, server: Any, *, check_s: float = 0.25, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 max_restarts: int = 5, stable_s: float = 30.0, failures: int = 3,
                 liveness: Callable[[Any], str] | None = None,
                 restart: Callable[[Any], Any] | None = None, on_restart: Callable[[Any], Any] | None = None):
        if check_s <= 0 or backoff_s < 0 or max_restarts < 1:
            raise ValueError("check_s > 0, backoff_s >= 0 and max_restarts >= 1 are needed")
        self.server = server
        self.check_s, self.backoff_s, self.max_backoff_s = check_s, backoff_s, max_backoff_s
        self.max_restarts, self.stable_s, self.failures = max_restarts, stable_s, failures
        self.liveness = liveness
        self._restart = restart or _default_restart
        self.on_restart = on_restart
        self.events: list[dict[str, Any]] = []
        self.restarts = 0
        self.gave_up = False
        self._streak = 0
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarted_at = 0.0

    def _event(self, what: str, **extra: Any) -> None:
        self.events.append({"time": time.time(), "event": what, **extra})

    def start(self) -> Watchdog:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="nvlab-watchdog", daemon=True)
            self._thread.start()
            stop_at_exit(self)
            self._event("watching", pid=getattr(self.server, "pid", None))
        return self

    def stop(self) -> None:
        """Stop watching (the server keeps running; stop it yourself). Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(30.0, self.max_backoff_s + 5))
            self._thread = None
        release_at_exit(self)

    def pause(self) -> None:
        """Stop restarting for now (a planned stop or upgrade)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _healthy(self) -> tuple[bool, str]:
        if not self.server.alive():
            return False, "process exited"
        if self.liveness is None:
            return True, ""
        bad = 0
        while True:
            ok, why = probe(self.liveness(self.server), timeout_s=max(self.check_s, 0.5))
            if ok:
                return True, ""
            bad += 1
            if bad >= self.failures or self._stop.is_set():
                return False, f"liveness failed {bad} times ({why})"
            if self._stop.wait(self.check_s):
                return True, ""

    def _loop(self) -> None:
        while not self._stop.wait(self.check_s):
            if self._paused.is_set():
                continue
            ok, why = self._healthy()
            if ok:
                if self._streak and time.time() - self._restarted_at > self.stable_s:
                    self._streak = 0  # stayed up: the next failure starts the backoff from the beginning
                continue
            if self._stop.is_set():
                break
            if self._streak >= self.max_restarts:
                if not self.gave_up:
                    self.gave_up = True
                    self._event("gave up", reason=f"{self._streak} restarts in a row did not stay up")
                continue
            delay = min(self.backoff_s * 2**self._streak, self.max_backoff_s)
            self._event("down", reason=why, exit_code=_exit_code(self.server), backoff_s=delay)
            with contextlib.suppress(Exception):
                self.server.stop()  # the whole process group: no stub or child keeps the ports
            if self._stop.wait(delay):
                break
            self._streak += 1
            try:
                t0 = time.time()
                self._restart(self.server)
                self.restarts += 1
                self._restarted_at = time.time()
                self._event("restarted", seconds=round(time.time() - t0, 2), pid=getattr(self.server, "pid", None))
                if self.on_restart is not None:
                    self.on_restart(self.server)
            except Exception as err:  # a failed start counts as a failure: the backoff grows
                self._event("restart failed", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")

    def timeline(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.events)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _exit_code(server: Any) -> Any:
    proc = getattr(server, "_proc", None) or getattr(server, "proc", None)
    return proc.poll() if proc is not None else None


def _default_restart(server: Any) -> Any:
    restart = getattr(server, "restart", None)
    if callable(restart):
        return restart()
    server.stop()
    return server.start()


def kill(server: Any) -> int:
    """SIGKILL the server's main process, as a crash would (its children follow: PR_SET_PDEATHSIG). The pid."""
    import os
    import signal

    pid = server.pid
    if pid is None:
        raise RuntimeError("the server has no process to kill (not started, or not owned here)")
    os.kill(pid, signal.SIGKILL)
    return pid


# --- the failure drill ------------------------------------------------------------------------------------


@dataclass
class DrillResult:
    """What the drill saw, each step with its wall-clock time (unix seconds)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    load: Any = None  # the load generator's result: requests, errors...
    watchdog_events: Any = None

    def step(self, what: str, t: float | None = None, **extra: Any) -> None:
        self.steps.append({"step": what, "time": time.time() if t is None else t, **extra})

    def time_of(self, what: str) -> float | None:
        return next((s["time"] for s in self.steps if s["step"] == what), None)

    def table(self) -> Any:
        import pandas as pd

        df = pd.DataFrame(self.steps)
        if not df.empty:
            df["after_kill_s"] = (df["time"] - (self.time_of("server killed") or df["time"].iloc[0])).round(2)
        return df


def failure_drill(server: Any, metrics: PromAPI, watchdog: Watchdog, load: Callable[[float], Any], *,
                  load_s: float, kill_after_s: float, alert: str = "TritonServerDown", timeout_s: float = 60.0,
                  up_expr: str = f'up{{job="{TRITON_JOB}"}}') -> DrillResult:
    """Kill the server under load and watch the recovery: client errors, ``up == 0`` in Prometheus, the alert
    firing, the watchdog's restart, ``up == 1`` again and requests succeeding again.

    ``load(duration_s)`` runs closed-loop load (in a thread here) and returns its result.
    """
    res = DrillResult()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = load(load_s)
        except BaseException as err:  # shown to the caller, not lost in the thread
            box["error"] = err

    t_load = time.time()
    thread = threading.Thread(target=run, name="nvlab-drill-load", daemon=True)
    thread.start()
    res.step("load started", t_load)
    pause = threading.Event()  # waits below are Event waits: interruptible, no bare sleeps
    try:
        pause.wait(kill_after_s)
        pid = kill(server)
        res.step("server killed", pid=pid)
        metrics.wait_for(f"{up_expr} == 0", timeout_s=timeout_s, poll_s=0.25)
        res.step("up == 0 in Prometheus")
        try:
            metrics.wait_for_alert(alert, "firing", timeout_s=timeout_s, poll_s=0.25)
            res.step(f"alert {alert} firing")
        except TimeoutError as err:
            res.step(f"alert {alert} did not fire", error=str(err))
        deadline = time.time() + timeout_s
        while watchdog.restarts == 0 and time.time() < deadline and not watchdog.gave_up:
            pause.wait(0.1)
        restarted = next((e for e in watchdog.events if e["event"] == "restarted"), None)
        if restarted:
            res.step("watchdog restarted the server", restarted["time"], pid=restarted.get("pid"))
        metrics.wait_for(f"{up_expr} == 1", timeout_s=timeout_s, poll_s=0.25)
        res.step("up == 1 again")
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            df = metrics.alerts()
            if df[df["alertname"] == alert].empty:
                res.step(f"alert {alert} resolved")
                break
            pause.wait(0.25)
    finally:
        thread.join(timeout=load_s + timeout_s)
    if "error" in box:
        raise box["error"]
    res.load = box.get("result")
    res.step("load finished")
    res.watchdog_events = watchdog.timeline()
    return res


# --- quantiles cannot be averaged ---------------------------------------------------------------------------


def quantile_of_parts(latencies_ms: Sequence[Sequence[float]], q: float = 0.99) -> dict[str, float]:
    """The q-quantile of all latencies together against the mean of each part's q-quantile (why a dashboard
    must not average p99s across instances or time windows)."""
    import numpy as np

    parts = [np.asarray(p, dtype=float) for p in latencies_ms if len(p)]
    if not parts:
        raise ValueError("no latencies given")
    pooled = float(np.quantile(np.concatenate(parts), q))
    mean_of = float(np.mean([np.quantile(p, q) for p in parts]))
    return {"pooled": pooled, "mean_of_parts": mean_of, "max_of_parts": float(max(np.quantile(p, q) for p in parts))}



# --- the lab's model ---------------------------------------------------------------------------------------

MODEL_NAME = "mm"

# Lab 04's model (``triton_model.py``: the MLP, requests crossing the python backend by DLPack), small, with
# an added service time so that queueing shows on any machine. One model file serves both labs.
MODEL_PRESET = {"in_features": 16, "width": 64, "depth": 2, "out_features": 16}


def write_model(repo: str | Path, *, gpu: bool = False, max_batch_size: int = 4, queue_delay_us: int = 500,
                base_ms: float = 4.0, per_item_ms: float = 1.0, gpu_matrix: int = 4096, gpu_reps: int = 1) -> Path:
    """Write the lab's model ``mm`` into ``repo`` (lab 04's python-backend MLP, dynamic batching, one instance);
    returns the repo.

    CPU instance: ONNX Runtime runs the MLP, then each execution waits ``base_ms + per_item_ms`` x batch (a
    simulated service time: a sleep leaves the machine's cores to the clients and Prometheus). GPU instance:
    torch runs the MLP, then ``gpu_reps`` x batch fp32 matmuls of ``gpu_matrix``^2, so the GPU metrics move.
    """
    from lab_utils.serving import repository as triton_repo

    repo = Path(repo)
    if gpu:
        service: dict[str, str | float] = {"gpu_matmul_n": gpu_matrix, "gpu_matmul_reps": gpu_reps}
    else:
        service = {"service_ms": float(base_ms), "service_per_item_ms": float(per_item_ms)}
    triton_repo.build_mlp_model(repo, MODEL_NAME, preset=MODEL_PRESET, gpus=1 if gpu else 0,
                                kind="KIND_GPU" if gpu else "KIND_CPU", max_batch_size=max_batch_size,
                                dynamic_batching={"max_queue_delay_microseconds": queue_delay_us},
                                parameters=service)
    return repo


def reference_output(repo: str | Path, x: Any) -> Any:
    """What ``mm`` must answer for ``x`` ([N, 16] float32), computed in NumPy from the deployed weights."""
    from lab_utils.serving import repository as triton_repo

    return triton_repo.reference_mlp(Path(repo) / MODEL_NAME / "1", x)


def make_inputs(features: int = MODEL_PRESET["in_features"]) -> Callable[[], dict[str, Any]]:
    """One request's inputs for ``mm``: a batch of one row of ``features`` floats."""
    import numpy as np

    from lab_utils.serving.repository import INPUT_NAME

    rng = np.random.default_rng(0)

    def make() -> dict[str, Any]:
        return {INPUT_NAME: rng.standard_normal((1, features)).astype(np.float32)}

    return make


# --- plots ---------------------------------------------------------------------------------------------------

_PHASE_COLORS = {"ramp": "#dbeafe", "steady": "#dcfce7", "overload": "#fee2e2"}


def plot_panels(frames: Mapping[str, Any], panel_list: Sequence[Panel], *, t0: float, phases: Any = None,
                ncols: int = 3, title: str = "") -> Any:
    """A grid of the panels' range queries (seconds since ``t0`` on x), load phases shaded."""
    import matplotlib.pyplot as plt

    from lab_utils.monitoring.prometheus import pivot

    n = len(panel_list)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.6 * nrows), squeeze=False)
    for ax, p in zip(axes.flat, panel_list, strict=False):
        df = frames.get(p.key)
        if phases is not None:
            for r in phases.itertuples():
                ax.axvspan(r.start - t0, r.end - t0, color=_PHASE_COLORS.get(r.phase, "#eeeeee"), lw=0)
        if df is not None and not df.empty:
            by = [c for c in ("model", "gpu", "job") if c in df.columns]
            wide = pivot(df, by[0] if by else None)
            for col in wide.columns:
                ax.plot(wide.index - t0, wide[col], label=str(col), lw=1.3)
            if len(wide.columns) > 1:
                ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(p.title, fontsize=9)
        ax.set_ylabel(p.unit, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_drill(drill: DrillResult, up: Any = None) -> Any:
    """The drill on one time axis: requests and client errors per load chunk, ``up`` as Prometheus saw it,
    and the steps (kill, alert, restart) as vertical lines."""
    import matplotlib.pyplot as plt

    t_kill = drill.time_of("server killed") or 0.0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 4.6), sharex=True)
    chunks = drill.load
    if chunks is not None and len(chunks):
        mid = (chunks["start"] + chunks["end"]) / 2 - t_kill
        secs = (chunks["end"] - chunks["start"]).clip(lower=1e-3)
        ax1.plot(mid, chunks["requests"] / secs, marker="o", label="successful requests/s (client)")
        ax1.plot(mid, chunks["errors"] / secs, marker="x", color="tab:red", label="failed requests/s (client)")
        ax1.legend(fontsize=8)
    ax1.set_ylabel("requests/s")
    if up is not None and not up.empty:
        for inst, g in up.groupby("instance"):
            ax2.step(g["time"] - t_kill, g["value"], where="post", label=f"up{{instance={inst}}}")
        ax2.legend(fontsize=8)
    ax2.set_ylim(-0.1, 1.2)
    ax2.set_ylabel("up")
    ax2.set_xlabel("seconds after the kill")
    for s in drill.steps:
        if s["step"] in ("load started", "load finished"):
            continue
        for ax in (ax1, ax2):
            ax.axvline(s["time"] - t_kill, color="gray", lw=0.8, ls="--")
        ax2.text(s["time"] - t_kill, 1.15, s["step"], rotation=90, fontsize=7, va="top", ha="right")
    fig.tight_layout()
    return fig


# --- Triton's GPU readings (DCGM) against the exporter's (NVML) ---------------------------------------------

# (what, Triton's expression, the exporter's expression), each averaged over the window; the last row is a
# diagnostic: NVML's v1 "used" included driver-reserved memory, so if Triton's DCGM counts it, that row agrees.
SOURCE_PAIRS = (
    ("memory_used_bytes", "avg_over_time(nv_gpu_memory_used_bytes[{w}])",
     "avg_over_time(DCGM_FI_DEV_FB_USED[{w}]) * 1048576"),
    ("power_w", "avg_over_time(nv_gpu_power_usage[{w}])", "avg_over_time(DCGM_FI_DEV_POWER_USAGE[{w}])"),
    ("memory_used_plus_reserved_bytes", "avg_over_time(nv_gpu_memory_used_bytes[{w}])",
     "(avg_over_time(DCGM_FI_DEV_FB_USED[{w}]) + avg_over_time(DCGM_FI_DEV_FB_RESERVED[{w}])) * 1048576"),
)


def compare_gpu_sources(metrics: PromAPI, at: float, window_s: float, tolerance: float = 0.10) -> Any:
    """Triton's ``nv_gpu_*`` against the exporter's ``DCGM_FI_DEV_*`` per GPU (matched by UUID), averaged over
    the ``window_s`` seconds before ``at``: one row per (metric, GPU) with both values, their ratio and whether
    it is within ``tolerance``. Empty when either source has no GPU series."""
    import pandas as pd

    w = f"{max(2, int(round(window_s)))}s"
    rows = []
    for what, triton_expr, exporter_expr in SOURCE_PAIRS:
        a = metrics.query(triton_expr.format(w=w), at=at)
        b = metrics.query(exporter_expr.format(w=w), at=at)
        if a.empty or b.empty or "gpu_uuid" not in a or "UUID" not in b:
            continue
        both = a[["gpu_uuid", "value"]].rename(columns={"gpu_uuid": "uuid", "value": "triton"}).merge(
            b[["UUID", "value"]].rename(columns={"UUID": "uuid", "value": "exporter"}), on="uuid")
        for r in both.itertuples():
            ratio = r.triton / r.exporter if r.exporter else math.nan
            rows.append({"metric": what, "uuid": r.uuid, "triton": r.triton, "exporter": r.exporter, "ratio": ratio,
                         "within": bool(abs(ratio - 1) <= tolerance)})
    return pd.DataFrame(rows, columns=["metric", "uuid", "triton", "exporter", "ratio", "within"])
