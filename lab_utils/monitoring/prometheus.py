"""Prometheus for the labs: a server the lab owns (or the compose stack's), its configuration and rules checked
by promtool, queries returned as data frames, and a server loaded with recorded samples.

``start_metrics(jobs, rule_files=...)`` uses the server at ``$PROMETHEUS_URL`` or starts a local ``prometheus``;
without either it raises :class:`PrometheusMissing` (check :func:`available` first). Both answer ``query``,
``query_range``, ``value``, ``alerts``, ``rules``, ``targets``, ``wait_for``, ``wait_for_alert``.
:func:`recorded_server` serves fixed samples, so that Prometheus itself evaluates a query at fixed times.

Design notes: docs/internals.md#lab_utilsmonitoringprometheuspy"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lab_utils import DATA_DIR
from lab_utils.course.probe import PROMETHEUS_ENV, PROMETHEUS_INSTALL, find_prometheus
from lab_utils.monitoring.promapi import URL_ENV, PromAPI, PrometheusError, QueryError, pivot  # noqa: F401
from lab_utils.owned import OwnedServer, usable
from lab_utils.procs import check_service, env_flag, env_url, http_ok, owned_tempdir
from lab_utils.serving.metrics import metric_types, parse_exposition  # noqa: F401  (re-exported)

IDENTIFY_S = 5.0  # how long $PROMETHEUS_URL may refuse connections before "nothing listens" (s)
REQUIRE_ENV = "NVLAB_REQUIRE_PROMETHEUS"
BINARY_ENV = PROMETHEUS_ENV  # a prometheus binary off the PATH, or "none" to try the no-Prometheus path

# Job names the lab, the rules file and the compose stack's configuration agree on.
TRITON_JOB = "triton"
EXPORTER_JOB = "gpu_exporter"

RULES_DIR = DATA_DIR / "monitoring"
RULES_FILE = RULES_DIR / "alert_rules.yml"
RULES_TEST_FILE = RULES_DIR / "alert_rules_test.yml"


class PrometheusMissing(PrometheusError):
    """No Prometheus to use here: no ``$PROMETHEUS_URL`` and no binary. The message says how to install one."""


class ConfigError(PrometheusError):
    """promtool rejected a configuration or rules file; the message carries promtool's own words."""


def required() -> bool:
    """True when ``NVLAB_REQUIRE_PROMETHEUS`` is 1/true/yes: a missing binary is an error, not a skipped section.
    Another value than those and 0/false/no is an ``EnvError``."""
    return env_flag(REQUIRE_ENV)


def missing(*names: str) -> str | None:
    """Why the binaries ``names`` (default: prometheus and promtool) cannot be used here, with the install line;
    None when they can."""
    if not (lacking := [n for n in names or ("prometheus", "promtool") if find_prometheus(n) is None]):
        return None
    where = (f"${BINARY_ENV}={os.environ[BINARY_ENV]}" if os.environ.get(BINARY_ENV) else "the PATH")
    if os.environ.get(BINARY_ENV, "").lower() not in ("", "none"):
        where += " (expected the path of an executable prometheus, promtool beside it; or none)"
    return f"{' and '.join(lacking)} not found (looked at {where}). {PROMETHEUS_INSTALL}"


def available(show: bool = True) -> bool:
    """True when this machine can run Prometheus for a lab (both binaries). When not, prints how to install it
    (``show``) and returns False, or raises :class:`PrometheusMissing` under ``NVLAB_REQUIRE_PROMETHEUS=1``."""
    return usable(missing(), name="Prometheus", require_env=REQUIRE_ENV, required=required(), error=PrometheusMissing,
                  skipped="The sections that need it are skipped, each saying so; the rest of the lab runs.", show=show)


def skipped(what: str) -> None:
    """Say that ``what`` needs Prometheus and is skipped (a lab cell's whole output where it is missing)."""
    print(f"skipped: {what} needs Prometheus, which is not installed here (how to install it: top of the lab)")


# --- promtool ----------------------------------------------------------------------------------


def promtool(*args: str, what: str, timeout_s: float = 60) -> str:
    """Run ``promtool args``; its output on success, :class:`ConfigError` with promtool's message if not."""
    if (tool := find_prometheus("promtool")) is None:
        raise PrometheusMissing(f"{what}: not checked: promtool is not installed here. {PROMETHEUS_INSTALL}")
    try:
        out = subprocess.run([tool, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{what}: promtool {' '.join(args)} did not finish in {timeout_s:g} s") from None
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0:
        raise ConfigError(f"{what}: promtool {args[0]} {args[1] if len(args) > 1 else ''} failed:\n{text}")
    return text


def check_prometheus_config(path: str | Path) -> str:
    """``promtool check config``: also checks the rule files the configuration names."""
    return promtool("check", "config", str(path), what=f"Prometheus configuration {Path(path).name}")


def check_rules(*paths: str | Path) -> str:
    """``promtool check rules``: syntax, PromQL and templates of alerting/recording rules."""
    return promtool("check", "rules", *map(str, paths), what="rules " + ", ".join(Path(p).name for p in paths))


def test_rules(*paths: str | Path) -> str:
    """``promtool test rules``: the rules' unit tests (input series, expected alerts)."""
    return promtool("test", "rules", *map(str, paths), what="rule tests " + ", ".join(Path(p).name for p in paths))


# --- configuration -----------------------------------------------------------------------------


_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}
_PART = r"(\d+)(ms|s|m|h|d|w|y)"


def window_seconds(window: str) -> float:
    """A Prometheus duration (``"15s"``, ``"500ms"``, ``"1m30s"``: a range's window, a rule's ``for``) in seconds."""
    if not (isinstance(window, str) and re.fullmatch(f"(?:{_PART})+", window)):
        raise ValueError(f"window={window!r}: a PromQL duration such as '30s' or '1m'")
    return sum(int(n) * _UNIT_S[unit] for n, unit in re.findall(_PART, window))


def _duration(seconds: float) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def scrape_config(jobs: Mapping[str, Sequence[str]], *, scrape_interval_s: float = 1.0,
                  evaluation_interval_s: float = 1.0, rule_files: Sequence[str | Path] = (),
                  major_version: int = 2) -> dict[str, Any]:
    """A Prometheus configuration: one scrape job per entry of ``jobs`` (``{"triton": ["127.0.0.1:8002"]}``;
    ``{}`` for a server that only serves stored samples).

    The scrape timeout follows the interval (it may not exceed it); rules are evaluated every
    ``evaluation_interval_s``. For Prometheus 3 (``major_version=3``) each job names the text format as the
    fallback protocol: 3.x refuses a scrape whose Content-Type it cannot read unless told (2.x rejects the key)."""
    for name, targets in jobs.items():
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name):
            raise ValueError(f"job name {name!r}: use letters, digits and _")
        if isinstance(targets, str):
            raise ValueError(f"job {name!r}: give a list of host:port targets, not the string {targets!r}")
        for t in targets:
            if not re.fullmatch(r"[^\s/:]+:\d+", t):
                raise ValueError(f"job {name!r}: target {t!r} should be host:port, e.g. 127.0.0.1:8002")
    for v, what in ((scrape_interval_s, "scrape_interval_s"), (evaluation_interval_s, "evaluation_interval_s")):
        if not (isinstance(v, (int, float)) and 0.1 <= v <= 600):
            raise ValueError(f"{what}={v!r}: give seconds between 0.1 and 600 (the lab uses 1)")
    interval = _duration(scrape_interval_s)
    return {"global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": _duration(evaluation_interval_s)},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": name, "metrics_path": "/metrics",
                                "static_configs": [{"targets": list(targets)}],
                                **({"fallback_scrape_protocol": "PrometheusText0.0.4"} if major_version >= 3 else {})}
                               for name, targets in jobs.items()]}


def write_config(config: Mapping[str, Any], path: str | Path, check: Callable[[Path], Any] | None = None) -> Path:
    """Write ``config`` (a configuration, rules, rule tests) as YAML (in JSON form, which YAML includes: no YAML
    library needed), its folder made if needed; then ``check(path)`` (e.g. :func:`check_rules`: promtool's message is
    the error) when promtool is installed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    if check is not None and find_prometheus("promtool"):
        check(path)
    return path


def scrape_jobs(server: Any, exporter: Any = None) -> dict[str, list[str]]:
    """The scrape jobs for a Triton server (its metrics port) and the GPU exporter: ``{job: [host:port]}``."""
    parts = urllib.parse.urlsplit(server.metrics_url)
    jobs = {TRITON_JOB: [f"{parts.hostname}:{parts.port}"]}
    if exporter is not None:
        jobs[EXPORTER_JOB] = [exporter.address]
    return jobs


# --- rules: the course's file and the lab's copy ----------------------------------------------------------


def load_rules(path: str | Path = RULES_FILE) -> dict[str, Any]:
    """A rules file as data (YAML, or the JSON form the lab writes)."""
    text = Path(path).read_text()
    with contextlib.suppress(ValueError):
        return json.loads(text)
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
    """Write the lab's copy of the rules: shorter ``for:`` (``for_s`` seconds; per alert if a mapping, the
    others ``default_for_s`` or as in the file), rate windows set to ``window``, and ``thresholds`` per alert
    name. promtool checks the copy when installed (:class:`ConfigError` carries its message). Returns its path."""
    rules = load_rules(source)
    names = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    if unknown := (set(thresholds or {}) | set(for_s if isinstance(for_s, Mapping) else {})) - names:
        raise ValueError(f"thresholds for unknown alerts {sorted(unknown)}; the alerts are {sorted(names)}")
    for group in rules["groups"]:
        for rule in group["rules"]:
            if (name := rule.get("alert")) is None:
                continue
            f = for_s.get(name, default_for_s) if isinstance(for_s, Mapping) else for_s
            if isinstance(f, (int, float)):
                rule["for"] = _duration(f)
            if window:
                rule["expr"] = re.sub(r"\[(\d+[smhd])\]", f"[{window}]", rule["expr"])
            if thresholds and name in thresholds:
                rule["expr"] = set_threshold(rule["expr"], thresholds[name])
            rule.setdefault("annotations", {})["lab_copy"] = "short durations for the lab"
    return write_config(rules, Path(out_dir) / "alert_rules.lab.yml", check_rules if check else None)


def _is_prometheus(body: bytes) -> bool:
    """Whether a ``GET /api/v1/status/buildinfo`` body is Prometheus' (``status`` success, ``data.version``)."""
    answer = json.loads(body)
    return isinstance(answer, dict) and answer.get("status") == "success" and \
        isinstance(answer.get("data"), dict) and "version" in answer["data"]


# --- a server the lab owns ---------------------------------------------------------------------------

class PrometheusServer(OwnedServer, PromAPI):
    """A ``prometheus`` process scraping ``jobs`` (``{"triton": ["127.0.0.1:8002"], ...}``), owned by the lab.

    ``start()`` writes the configuration into a temporary folder, has promtool check it (its message is the error),
    starts the server on a free loopback port with ``--web.enable-lifecycle``, and waits for ``/-/ready``. ``stop()``
    ends the process group and removes the folder (data included); it is safe to call twice and runs at interpreter
    exit. With ``samples`` it first writes them into its storage (:func:`backfill`), to serve them."""

    kind = "prometheus"
    name = "Prometheus"  # in a failed start's message
    error = PrometheusError
    fallback_port = True
    busy_note = "port {port} is busy: Prometheus listens on a free port instead"
    registered = False  # a server nobody holds is stopped when collected (``__del__``)
    log_mode = "ab"  # one log over the start's tries
    log_lines = 30

    def __init__(self, jobs: Mapping[str, Sequence[str]], *, rule_files: Sequence[str | Path] = (),
                 scrape_interval_s: float = 1.0, evaluation_interval_s: float = 1.0, host: str = "127.0.0.1",
                 port: int | None = None, startup_timeout_s: float = 30.0, samples: Iterable[Sample] | None = None):
        self.binary = find_prometheus("prometheus")
        if self.binary is None:
            raise PrometheusMissing(f"the prometheus binary is not installed here. {PROMETHEUS_INSTALL}")
        self.scrape_interval_s, self.evaluation_interval_s = scrape_interval_s, evaluation_interval_s
        self._version: str | None = None
        OwnedServer.__init__(self, host=host, ports={"port": port}, startup_timeout_s=startup_timeout_s)
        PromAPI.__init__(self, f"http://{host}:0")
        self.reload(jobs, rule_files)  # not started yet: only builds the configuration
        self.samples = list(samples) if samples is not None else None
        self.port: int | None = None

    def describe(self) -> str:
        return f"Prometheus {self.version()} started here at {self.url} (scrape every {self.scrape_interval_s:g} s)"

    def version(self) -> str:
        """The binary's version, e.g. "2.42.0+ds" (asked once)."""
        if self._version is None:
            out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, check=False,
                                 timeout=30)
            m = re.search(r"version\s+([\w.\-+~]+)", out.stdout + out.stderr)
            self._version = m.group(1) if m else "?"
        return self._version

    def _config(self) -> dict[str, Any]:
        major = int(m.group(1)) if (m := re.match(r"(\d+)\.", self.version())) else 2
        return scrape_config(self.jobs, scrape_interval_s=self.scrape_interval_s,
                             evaluation_interval_s=self.evaluation_interval_s, rule_files=self.rule_files,
                             major_version=major)

    @property
    def log_path(self) -> Path | None:
        return self.folder / "prometheus.log" if self.folder else None

    @property
    def config_path(self) -> Path | None:
        return self.folder / "prometheus.yml" if self.folder else None

    # lifecycle: see OwnedServer ---------------------------------------------------------------------------
    def _prepare(self) -> dict[str, Any]:
        self.folder = owned_tempdir("prometheus")
        self._write_config()
        if self.samples is not None:
            backfill(self.samples, self.folder / "data")
        self.url = f"http://{self.host}:{self.port}"
        return {"cwd": self.folder}

    def _command(self) -> list[str]:
        return [str(self.binary), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.folder}/data",
                f"--web.listen-address={self.host}:{self.port}", "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1d", "--log.level=info"]

    def _ready_url(self) -> str:
        return f"{self.url}/-/ready"

    def reload(self, jobs: Mapping[str, Sequence[str]] | None = None,
               rule_files: Sequence[str | Path] | None = None) -> None:
        """Rewrite the configuration (new targets or rule files), have promtool check it, and reload."""
        if jobs is not None:
            self.jobs = {k: list(v) for k, v in jobs.items()}
        if rule_files is not None:
            self.rule_files = [Path(p) for p in rule_files]
        self.config = self._config()
        if self.alive():
            self._write_config()
            self._get("/-/reload", method="POST")

    def _write_config(self) -> None:
        """Write the configuration into the folder; promtool, where installed, checks it (its message is the error)."""
        write_config(self.config, self.config_path, check_prometheus_config)  # type: ignore[arg-type]

    def stop(self) -> None:  # type: ignore[override]
        """Stop the whole process group and remove the temporary folder; safe to call twice."""
        super().stop()
        self.folder = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()


# --- recorded samples, served by Prometheus -----------------------------------------------------------------

# (labels with "__name__", unix seconds, value): one sample of one series.
Sample = tuple[Mapping[str, str], float, float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def openmetrics_text(samples: Iterable[Sample]) -> str:
    """``samples`` in the OpenMetrics text format with timestamps (what promtool's backfill reads), one series
    after another, each in time order. No ``# TYPE`` lines: the names stay as given (Triton's counters have no
    ``_total``, which OpenMetrics would demand of a counter)."""
    series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for labels, t, v in samples:
        if "__name__" not in labels:
            raise ValueError(f"sample {dict(labels)} at {t}: the labels need a __name__")
        series.setdefault(tuple(sorted(labels.items())), []).append((float(t), float(v)))
    lines = []
    for key in sorted(series, key=lambda k: dict(k)["__name__"]):
        labels = dict(key)
        name = labels.pop("__name__")
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        sel = f"{name}{{{body}}}" if body else name
        lines += [f"{sel} {v!r} {t:.3f}" for t, v in sorted(series[key])]
    return "\n".join(lines) + "\n# EOF\n"


def backfill(samples: Iterable[Sample], data_dir: str | Path) -> Path:
    """Write ``samples`` as TSDB blocks into ``data_dir`` (``promtool tsdb create-blocks-from openmetrics``), for
    a Prometheus started on that folder to serve. Returns the folder."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    source = data_dir.parent / f"{data_dir.name}.om"
    source.write_text(openmetrics_text(samples))
    try:
        promtool("tsdb", "create-blocks-from", "openmetrics", str(source), str(data_dir),
                 what=f"backfilling {source.name}")
    finally:
        source.unlink(missing_ok=True)
    return data_dir


def recorded_server(samples: Iterable[Sample], **kwargs: Any) -> PrometheusServer:
    """A started Prometheus that serves ``samples`` and scrapes nothing: a query evaluated on it at the samples'
    times gives Prometheus' own answer. Stop it (or use it as a context manager); its files go with it.
    :class:`PrometheusMissing` when prometheus or promtool is not installed."""
    if why := missing():
        raise PrometheusMissing(why)
    return PrometheusServer({}, samples=samples, **kwargs).start()


# --- the lab's metrics backend ---------------------------------------------------------------------------


def start_metrics(jobs: Mapping[str, Sequence[str]], *, rule_files: Sequence[str | Path] = (),
                  scrape_interval_s: float = 1.0, evaluation_interval_s: float = 1.0,
                  prefer: str = "auto", show: bool = True) -> PromAPI:
    """A started Prometheus for ``jobs``: the one at ``$PROMETHEUS_URL``, else a ``prometheus`` binary started here
    (``prefer="local"`` skips ``$PROMETHEUS_URL``, for targets only this process can reach). Prints which.
    :class:`PrometheusMissing`, saying how to install it, when there is none."""
    if prefer not in ("auto", "local"):
        raise ValueError(f"prefer={prefer!r}: use auto or local")
    url = env_url(URL_ENV, default_port=9090, path_ok=True) if prefer != "local" else None
    backend: PromAPI
    if url:
        if why := check_service(url, "/api/v1/status/buildinfo", _is_prometheus, "Prometheus", URL_ENV,
                                wait_s=IDENTIFY_S, hint="is the compose stack up (`docker compose ps`)?"):
            raise PrometheusError(why)
        backend = PromAPI(url)
        ok, state = http_ok(f"{url}/-/ready", timeout_s=5.0)
        if not ok:
            raise PrometheusError(f"Prometheus at {url} ({URL_ENV}) is not ready (GET /-/ready: {state}): is the "
                                  "compose stack up (`docker compose ps`)?")
        backend.notes.append(f"the compose stack's Prometheus scrapes its own targets (jobs {TRITON_JOB!r} and "
                             f"{EXPORTER_JOB!r}) and loads its own copy of the rules")
    else:
        if why := missing("prometheus"):
            raise PrometheusMissing(f"{REQUIRE_ENV}=1 but {why}" if required() else why)
        backend = PrometheusServer(jobs, rule_files=rule_files, scrape_interval_s=scrape_interval_s,
                                   evaluation_interval_s=evaluation_interval_s).start()
    if show:
        print(backend.describe())
        for note in backend.notes:
            print("note:", note)
    return backend
