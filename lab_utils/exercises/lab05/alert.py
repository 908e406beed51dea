"""Lab 05's q4: an alerting rule, graded by ``promtool test rules`` over ``ALERT_SERIES`` (fourteen minutes of one
Triton server's counters: a calm model with a one-minute burst, and one overloaded from minute 6)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from lab_utils.exercises.framework import Wrong
from lab_utils.exercises.lab05.promql import LATENCY, PrometheusExercise, no_delta, per_request
from lab_utils.monitoring import prometheus
from lab_utils.procs import temporary_folder

# Fourteen minutes of one Triton server's counters, scraped every 15 s, for two models. bert is calm (requests
# wait about 30 ms in the queue) except for one burst: in the 15 s before 4m15s its requests waited 2.4 s. resnet50
# is calm until minute 6, then overloaded to the end: its queue time climbs from 200 to 400 ms. Each request also
# computes (bert 80 ms, resnet50 50 ms), so the whole request of a calm bert takes over 100 ms.
ALERT_STEP_S, ALERT_END_S = 15, 840
ALERT_BURST_S = 255  # bert's slow scrape interval ends here (4m15s)
ALERT_OVERLOAD_S = 360  # resnet50 overloaded from here (6m) to the end
ALERT_THRESHOLD_MS = 100
_ALERT_INSTANCE = {"job": "triton", "instance": "10.0.0.7:8002", "version": "1"}
_ALERT_MODELS: dict[str, dict[str, float]] = {
    "bert": {"qps": 40, "queue_ms": 30, "compute_ms": 80, "inferences": 2},
    "resnet50": {"qps": 120, "queue_ms": 25, "compute_ms": 50, "inferences": 4},
}


def _alert_queue_ms(model: str, step: int) -> float:
    """Queue time per request (ms) in the 15 s scrape interval that ends at ``step`` x 15 s."""
    t = step * ALERT_STEP_S
    j = list(_ALERT_MODELS).index(model)
    calm = _ALERT_MODELS[model]["queue_ms"] * (1 + 0.15 * math.sin(0.8 * step + 1.7 * j))
    if model == "bert" and t == ALERT_BURST_S:
        return 2400.0
    if model == "resnet50" and t > ALERT_OVERLOAD_S:
        return 200 + 200 * (t - ALERT_OVERLOAD_S) / (ALERT_END_S - ALERT_OVERLOAD_S) * (1 + 0.05 * math.sin(step))
    return calm


def _alert_counters() -> dict[str, dict[str, list[float]]]:
    """{model: {metric: [counter value at each scrape]}}: what the server exported, every 15 s from 0 to 14m."""
    out: dict[str, dict[str, list[float]]] = {}
    for j, (model, m) in enumerate(_ALERT_MODELS.items()):
        req, queue_us, compute_us, inferences = 1_000_000.0, 1e6 * 10_000, 1e6 * 40_000, 1e6 * m["inferences"]
        rows: dict[str, list[float]] = {}
        for step in range(ALERT_END_S // ALERT_STEP_S + 1):
            if step:
                n = round(m["qps"] * ALERT_STEP_S * (1 + 0.1 * math.sin(1.1 * step + j)))
                req += n
                inferences += n * m["inferences"]
                queue_us += round(n * _alert_queue_ms(model, step) * 1000)
                compute_us += round(n * m["compute_ms"] * 1000)
            for name, v in (("nv_inference_request_success", req), ("nv_inference_count", inferences),
                            ("nv_inference_queue_duration_us", queue_us),
                            ("nv_inference_compute_infer_duration_us", compute_us),
                            ("nv_inference_request_duration_us", queue_us + compute_us)):
                rows.setdefault(name, []).append(v)
        out[model] = rows
    return out


ALERT_SERIES = _alert_counters()


def alert_series_frame() -> pd.DataFrame:
    """``ALERT_SERIES`` per scrape interval: minute, model, queue and request time per request (ms) in the 15 s
    before it. (The alert itself averages over [1m]: four of these intervals.)"""
    rows = []
    for model, s in ALERT_SERIES.items():
        req, queue, whole = (s[k] for k in ("nv_inference_request_success", "nv_inference_queue_duration_us",
                                            "nv_inference_request_duration_us"))
        for i in range(1, len(req)):
            n = req[i] - req[i - 1]
            rows.append({"minute": i * ALERT_STEP_S / 60, "model": model,
                         "queue_ms": (queue[i] - queue[i - 1]) / n / 1000,
                         "request_ms": (whole[i] - whole[i - 1]) / n / 1000})
    return pd.DataFrame(rows)


def _input_series() -> list[dict[str, str]]:
    """``ALERT_SERIES`` as promtool's input_series."""
    labels = {model: ", ".join(f'{k}="{v}"' for k, v in {**_ALERT_INSTANCE, "model": model}.items())
              for model in ALERT_SERIES}
    return [{"series": f"{name}{{{labels[model]}}}", "values": " ".join(f"{v:.0f}" for v in values)}
            for model, metrics in ALERT_SERIES.items() for name, values in metrics.items()]


_ALERT_BASE = per_request("nv_inference_queue_duration_us")
_SEVERITIES = ("warning", "critical")


def _the_rule(value: Any) -> dict[str, Any]:
    """The one alerting rule in the answer: YAML text (a rule, a list of one, or a rules file) or a dict."""
    if isinstance(value, str):
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise Wrong(f"that is not valid YAML{at}: {getattr(err, 'problem', None) or err}. Indent the keys "
                        "under the rule and quote text that contains ': '") from None
    if isinstance(value, Mapping) and "groups" in value:
        value = [r for g in value.get("groups") or [] for r in (g.get("rules") or [])]
    if isinstance(value, list):
        rules = [r for r in value if isinstance(r, Mapping) and "alert" in r]
        if len(rules) != 1:
            raise Wrong(f"give one alerting rule (found {len(rules)} with an `alert:` key)")
        value = rules[0]
    if not isinstance(value, Mapping):
        raise Wrong("give the rule as YAML text (alert:, expr:, for:, labels:) or as a dict with those keys")
    if "record" in value and "alert" not in value:
        raise Wrong("that is a recording rule (record:): it stores a series and never fires. An alerting rule "
                    "starts with `alert: <name>`")
    missing = [k for k in ("alert", "expr") if not value.get(k)]
    if missing:
        raise Wrong(f"the rule has no {' and no '.join(missing)}: an alerting rule needs `alert: <name>` and "
                    "`expr: <PromQL that returns the series in trouble>`")
    if not isinstance(value["alert"], str) or not isinstance(value["expr"], str):
        raise Wrong("`alert:` and `expr:` should be text")
    return dict(value)


def _promtool_passes(rule_file: Path, probes: Mapping[str, Sequence[tuple[str, float, float]]]) -> dict[str, bool]:
    """For each probe (a list of (PromQL, eval time s, expected value) that must all hold), whether promtool's
    rule test passes: the rule evaluated every 15 s over ``ALERT_SERIES`` as Prometheus would. One promtool run
    for all of them (the series loaded and the rule evaluated once): each check's expression starts with a comment
    naming its probe, which promtool quotes for every check that fails."""
    checks = [{"expr": f"# probe {name}\n{expr}", "eval_time": f"{t:.0f}s",
               "exp_samples": [{"labels": "{}", "value": v}]} for name, probe in probes.items() for expr, t, v in probe]
    test = {"rule_files": [rule_file.name], "evaluation_interval": f"{ALERT_STEP_S}s",
            "tests": [{"interval": f"{ALERT_STEP_S}s", "input_series": _input_series(), "promql_expr_test": checks}]}
    path = rule_file.parent / "probes.yml"
    path.write_text(json.dumps(test))
    try:
        prometheus.promtool("test", "rules", str(path), what="the rule's probes", timeout_s=120)
        failed: set[str] = set()
    except prometheus.ConfigError as err:
        failed = set(re.findall(r'expr: "# probe (\w+)\\n', str(err)))
        if not failed:  # promtool failed before any check (no verdict): say what it said
            raise RuntimeError(f"promtool test rules failed on the check's own probes: {err}") from None
    return {name: name not in failed for name in probes}


def _firing(name: str, model: str, window_s: float) -> str:
    """1 when alert ``name`` was firing for ``model`` at some evaluation in the window, else 0."""
    sel = f'ALERTS{{alertname={json.dumps(name)}, alertstate="firing", model="{model}"}}'
    return f"max(max_over_time({sel}[{window_s:.0f}s])) or vector(0)"


def _matches(expr: str, candidate: str) -> list[tuple[str, float, float]]:
    """Checks that hold when every value the rule's expression returned from minute 5 on (once a 5m window is full)
    equals ``candidate``'s, for some evaluation at least: the rule computes ``candidate``."""
    ratio = f"abs(max by (model) ((\n{expr}\n)) / on (model) ({candidate}) - 1)"
    window = f"[{ALERT_END_S - 300}s:{ALERT_STEP_S}s]"
    return [(f"max_over_time((clamp_max(count({ratio} < 0.001), 1)){window}) or vector(0)", ALERT_END_S, 1),
            (f"max_over_time((clamp_max(count({ratio} >= 0.001), 1)){window}) or vector(0)", ALERT_END_S, 0)]


_ALERT_SLIPS = (
    (f"60 * ({_ALERT_BASE})",
     "increase() where the per-second rate() belongs: the queue time summed over the minute is 60x its rate, so "
     "the average came out 60x too high and the alert fires on calm bert (about 30 ms a request). Divide rate by "
     "rate, or increase by increase over the same window"),
    (f"1000 * ({_ALERT_BASE})",
     "your expression is in microseconds (Triton's *_duration_us) and the threshold in ms: calm bert's 30 ms is "
     "30000 µs > 100, so it fires all the time. Divide by 1000, or compare with 100000"),
    (LATENCY,
     "that is the whole request's time (nv_inference_request_duration_us: queue + compute), and calm bert "
     "computes 80 ms a request, so it fires without any queueing. The question is about queueing: "
     "nv_inference_queue_duration_us"),
    ("sum by (model) (rate(nv_inference_queue_duration_us[1m])) / 1000",
     "that is milliseconds of queueing per second (all requests together), not per request: divide by the "
     "request rate, sum by (model) (rate(nv_inference_request_success[1m]))"),
    (_ALERT_BASE.replace("[1m]", "[5m]"),
     "a 5m window keeps bert's burst in the average for five minutes, long enough to outlast `for:`, so it "
     "fires on a burst that was over minutes ago; the question asks for [1m]"),
)


def _same_times(expr: str) -> list[tuple[str, float, float]]:
    """A check that holds when ``expr`` returns a series for the same models at every evaluation as the queue time
    per request > the threshold does: its condition is the question's."""
    def models(e: str) -> str:
        return f"(count(count by (model) ((\n{e}\n))) or vector(0))"

    differs = f"{models(expr)} != bool {models(f'{_ALERT_BASE} > {ALERT_THRESHOLD_MS}')}"
    return [(f"max_over_time(({differs})[{ALERT_END_S}s:{ALERT_STEP_S}s])", ALERT_END_S, 0)]


def _behaviour(rule_file: Path, name: str, expr: str) -> dict[str, bool]:
    end, over, burst = ALERT_END_S, ALERT_OVERLOAD_S, ALERT_BURST_S
    return _promtool_passes(rule_file, {
        # the condition holds exactly when the question's does, and the values are the queue time (ms or µs)
        "same_times": _same_times(expr),
        "values_ms": _matches(expr, _ALERT_BASE),
        "values_us": _matches(expr, f"1000 * ({_ALERT_BASE})"),
        # firing in the overload's last five minutes (before, a rule that fires on low values may still fire)
        "fires_on_overload": [(_firing(name, "resnet50", 300), end, 1)],
        "calm_before_overload": [(_firing(name, "resnet50", over), over, 0)],
        "calm_on_bert": [(_firing(name, "bert", end), end, 0)],
        "fires_on_burst": [(_firing(name, "bert", 180), burst + 165, 1)],
        "calm_on_bert_but_burst": [(_firing(name, "bert", burst - 15), burst - 15, 0),
                                   (_firing(name, "bert", end - burst - 165), end, 0)],
        "fires_without_model": [(_firing(name, "", end), end, 1)],
        # a known slip's values (told apart only where the condition held on a calm series)
        **{f"slip{i}": _matches(expr, candidate) for i, (candidate, _) in enumerate(_ALERT_SLIPS)},
    })


def _grade_alert_rule(value: Any) -> str:
    rule = _the_rule(value)
    name = rule["alert"]
    picked = re.search(r'\bmodel\s*(=~|!~|!=|=)\s*"[^"]*"', rule["expr"])
    if picked:
        raise Wrong(f"the expression keeps only some models ({picked.group(0)}): the alert must watch every model "
                    "the server serves, including the ones deployed next week. Drop the matcher")
    no_delta(rule["expr"])
    for_text = str(rule.get("for", "0s"))
    try:
        for_s: float | None = prometheus.window_seconds(for_text.strip())  # a Prometheus duration ("1m30s")
    except ValueError:
        for_s = None
    labels = rule.get("labels") or {}
    with temporary_folder("alert") as tmp:
        rule_file = tmp / "student_rules.yml"
        rule_file.write_text(json.dumps({"groups": [{"name": "student", "rules": [rule]}]}, indent=2, default=str))
        try:
            prometheus.check_rules(rule_file)
        except prometheus.ConfigError as err:
            said = str(err).split("FAILED:", 1)[-1].strip()
            said = re.sub(r'^.*?group "student", rule \d+(, "[^"]*")?: ', "", said.splitlines()[0] if said else "")
            raise Wrong(f"promtool check rules refuses it: {said or err}") from None
        seen = _behaviour(rule_file, name, rule["expr"])
    calm = seen["calm_on_bert"] and seen["calm_before_overload"]
    fired_on_burst = seen["fires_on_burst"] and not seen["calm_on_bert"]
    if seen["fires_without_model"]:
        raise Wrong("its alerts carry no model label: `sum(...)` without `by (model)` adds the models together, so "
                    "the page cannot say which model is in trouble (and a calm model dilutes the overloaded one). "
                    "Keep the model: sum by (model) (...)")
    if for_s is None or for_s == 0:
        spike = (f" It fired on bert's burst at {ALERT_BURST_S // 60}m{ALERT_BURST_S % 60}s: a single slow scrape "
                 "interval, over within a minute, would have paged someone." if fired_on_burst else "")
        raise Wrong(f"no `for:`: the alert fires at the first evaluation where the condition holds.{spike} Add "
                    "`for: 2m` so that the condition must hold for two minutes")
    if not calm:  # the condition held on a calm series: is it a known slip? (its values tell)
        for i, (_, message) in enumerate(_ALERT_SLIPS):
            if seen[f"slip{i}"]:
                raise Wrong(message)
        if not seen["fires_on_overload"]:
            raise Wrong("the comparison points the wrong way: it fires while the queue time is low (calm bert, "
                        "resnet50 before minute 6) and never during the overload. An alert expression returns the "
                        "series that are in trouble: queue time > 100")
        if " bool " in f" {rule['expr']} ":
            raise Wrong("`bool` turns the comparison into 0 or 1 for every series, and an alert fires for every "
                        "series its expression returns, 0 included: drop `bool`")
        if seen["calm_on_bert_but_burst"] and seen["calm_before_overload"] and fired_on_burst:
            raise Wrong(f"`for: {rule['for']}` is too short: it fired on bert's burst at {ALERT_BURST_S // 60}m"
                        f"{ALERT_BURST_S % 60}s, which keeps the one-minute average above 100 ms for only about "
                        "30 s. A longer `for:` (2m) rides out a blip and still catches the overload")
        where = "calm bert" if not seen["calm_on_bert"] else "resnet50 before its overload (minute 6)"
        raise Wrong(f"it fires on {where}, whose requests wait about 30 ms in the queue: check the threshold "
                    f"({ALERT_THRESHOLD_MS} ms), its unit, and that the expression is the queue time per request "
                    "over [1m]")
    if not seen["fires_on_overload"]:
        lasts = ALERT_END_S - ALERT_OVERLOAD_S
        if for_s >= lasts - 90:
            raise Wrong(f"`for: {rule['for']}` is longer than the overload had lasted when the recording ends "
                        f"({lasts // 60} minutes, the queue time above 100 ms from about 6m30s): it never fired. A "
                        "page that comes after the incident is no page; 2m is enough to ride out a blip")
        raise Wrong("it never fires on resnet50's overload (from minute 6 its requests wait 200 to 400 ms in the "
                    "queue): check the metric (nv_inference_queue_duration_us over nv_inference_request_success), "
                    "the units (µs -> ms) and the threshold")
    values_right = seen["values_ms"] or seen["values_us"]
    if not values_right:
        raise Wrong("it fires at the right times on these series, but the values it returns are not the queue time "
                    "per request (in ms, or in µs against 100000): e.g. twice it, against a threshold twice 100. "
                    "The alert carries its expression's value ({{ $value }} on the page), and another load would "
                    "fire it at other times: the queue-time counter's rate over the requests' rate, each summed "
                    "by model, / 1000 > 100")
    if not seen["same_times"]:
        raise Wrong(f"the expression is the queue time per request, but its condition holds at other evaluations "
                    f"than queue time > {ALERT_THRESHOLD_MS} ms does (it fires here, but with another threshold "
                    f"than the question's): compare with {ALERT_THRESHOLD_MS} (ms), or 100000 in µs")
    if "severity" not in labels:
        raise Wrong("it fires at the right times, but has no severity label: Alertmanager routes, groups and "
                    "silences alerts by their labels, and the course's rules say how urgent each one is with "
                    "`labels: {severity: warning}` (or critical)")
    if str(labels["severity"]).lower() not in _SEVERITIES:
        raise Wrong(f"severity {labels['severity']!r}: the course's rules (and their routing) use "
                    f"{' or '.join(_SEVERITIES)}")
    return (f"promtool test rules: it fires during resnet50's overload and stays silent on bert, its burst at "
            f"{ALERT_BURST_S // 60}m{ALERT_BURST_S % 60}s included (for: {rule['for']}).")


q4 = PrometheusExercise(
    name="05.4 an alert rule, tested by promtool", var="alert_rule", grade=_grade_alert_rule,
    tools=("promtool",), graded_by="promtool grades this rule",
    hints=[
        "An alerting rule has `alert:` (its name), `expr:` (PromQL returning the series in trouble: a comparison "
        "keeps the series for which it holds), `for:` (how long it must hold before the alert fires) and "
        "`labels:` (severity, for routing).",
        "The queue time per request is the queue-time counter's rate over the requests' rate, each summed by "
        "model, in ms: the same shape as exercise 2 with nv_inference_queue_duration_us. Then `> 100`.",
        "A one-minute burst must not page: `for: 2m`. And `labels: {severity: warning}`.",
    ],
    solution_text=(
        'alert_rule = """\n'
        "alert: TritonQueueTimeHigh\n"
        "expr: >-\n"
        "  sum by (model) (rate(nv_inference_queue_duration_us[1m]))\n"
        "  / sum by (model) (rate(nv_inference_request_success[1m])) / 1000 > 100\n"
        "for: 2m\n"
        "labels:\n"
        "  severity: warning\n"
        "annotations:\n"
        '  summary: "requests to {{ $labels.model }} wait {{ $value }} ms in the queue"\n'
        '"""'
    ),
)
