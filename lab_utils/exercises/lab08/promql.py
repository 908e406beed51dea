"""08.2, the canary's PromQL, on the metrics bench that q2 and q3 share: a real Prometheus scraping in-process
sources with Triton's and the feedback exporter's metric names, q2's history scripted, q3's live canary runs
following the weight."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from lab_utils.exercises.framework import CodeExercise, References, Wrong, run_student, source_as
from lab_utils.exercises.lab08.common import (
    _BOUND,
    DECOY_MODEL,
    Q2_WINDOW,
    SERVICE_MODEL,
    VARIANTS,
    _prometheus_missing,
)
from lab_utils.exercises.outcomes import _short
from lab_utils.mlops.feedback import FEEDBACK_CORRECT, FEEDBACK_TOTAL, MetricsServer
from lab_utils.monitoring.prometheus import PrometheusError, PrometheusServer

_SPLIT_S = 3.0  # q2's scripted history: an early phase of this length, then the recent one
_AT_S = 6.5  # q2's queries are evaluated at start + this: the window (3.5 s .. 6.5 s) holds only the recent phase
_SCRAPE_S = 0.5


def use_bench(bench: MetricsBench | None) -> None:
    """A started ``MetricsBench`` that q2 and q3 share (else each check starts its own and stops it); None unbinds."""
    if bench is None:
        _BOUND.pop("bench", None)
    else:
        _BOUND["bench"] = bench


def reference_canary_queries(window: str) -> dict[str, str]:
    """The canary's PromQL over ``window``: per scrape job (one Triton per variant), per ``variant`` for feedback."""
    model = 'model="digits_service"'
    ok = f"sum by (job) (rate(nv_inference_request_success{{{model}}}[{window}]))"
    # no failure yet: the failure counter does not exist; "or ... * 0" gives 0 where successes exist
    failed = f"(sum by (job) (rate(nv_inference_request_failure{{{model}}}[{window}])) or {ok} * 0)"
    return {
        "error_rate": f"{failed} / ({ok} + {failed})",
        "p95_ms": f'max by (job) (nv_inference_request_summary_us{{{model},quantile="0.95"}}) / 1000',
        "accuracy": (f"sum by (variant) (increase(nvlab_feedback_correct_total[{window}])) / "
                     f"sum by (variant) (increase(nvlab_feedback_total[{window}]))"),
    }


# --- the metrics bench (q2, q3): sources with Triton's and the feedback exporter's names, and a Prometheus ------

# q2's script, per scrape job: (model, version, successes/s early, late, failures/s early, late, p95 ms).
# Failures None: the series never exists (no failure yet); early 0: it appears with the first failure.
_Q2_TRITON = {
    "champion": [(SERVICE_MODEL, "1", 30.0, 30.0, None, None, 20.0),
                 (SERVICE_MODEL, "2", 10.0, 10.0, None, None, 24.0),
                 (DECOY_MODEL, "1", 100.0, 100.0, 50.0, 50.0, 80.0)],
    "challenger": [(SERVICE_MODEL, "1", 6.0, 6.0, None, None, 30.0),
                   (SERVICE_MODEL, "2", 2.0, 2.0, 0.0, 2.0, 45.0),
                   (DECOY_MODEL, "1", 100.0, 100.0, 50.0, 50.0, 80.0)],
}
# feedback, per exporter instance and variant: (labelled answers/s, accuracy early, accuracy late)
_Q2_FEEDBACK = [{"champion": (10.0, 0.80, 0.95), "challenger": (10.0, 1.00, 0.50)},
                {"champion": (30.0, 0.80, 0.95), "challenger": (30.0, 1.00, 0.70)}]

LIVE_RPS = 100.0
LIVE_FEEDBACK_RPS = 20.0


def _piecewise(t: float, early: float, late: float) -> float:
    return early * min(t, _SPLIT_S) + late * max(0.0, t - _SPLIT_S)


class _LiveVariant:
    """One variant of a live run: its success counter follows the rate set (as Triton's would); it never fails."""

    def __init__(self, accuracy: float):
        self.rps, self.accuracy = 0.0, accuracy
        self.success = self.labelled = 0.0
        self.t = self.t_start = time.monotonic()

    def advance(self) -> None:
        now = time.monotonic()
        self.success += self.rps * (now - self.t)
        self.t = now
        self.labelled = LIVE_FEEDBACK_RPS * (now - self.t_start)


class _LiveRun:
    """A champion and a challenger under their own model name (Triton) and feedback label, weight set by the loop."""

    def __init__(self, n: int, challenger_accuracy: float, lock: threading.Lock):
        self.model, self.label = f"canary_{n}", f"arm_{n}"
        self.variants = {"champion": _LiveVariant(0.97), "challenger": _LiveVariant(challenger_accuracy)}
        self.weights: list[int] = []
        self._lock = lock

    def set_weight(self, w: int) -> None:
        with self._lock:
            self.weights.append(int(w))
            for v, share in (("champion", 100 - w), ("challenger", w)):
                self.variants[v].advance()
                self.variants[v].rps = LIVE_RPS * share / 100


class _TritonSource:
    """Triton's metric names for one scrape job: q2's scripted series and the live runs' series."""

    def __init__(self, bench: MetricsBench, variant: str):
        self.bench, self.variant = bench, variant

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        s = GaugeMetricFamily("nv_inference_request_success", "successful requests", labels=["model", "version"])
        f = GaugeMetricFamily("nv_inference_request_failure", "failed requests", labels=["model", "version", "reason"])
        q = GaugeMetricFamily("nv_inference_request_summary_us", "request latency", labels=["model", "version",
                                                                                          "quantile"])
        d = GaugeMetricFamily("nv_inference_request_duration_us", "cumulative request time", labels=["model",
                                                                                                   "version"])
        t = self.bench.elapsed()
        for model, version, s1, s2, f1, f2, p95 in _Q2_TRITON[self.variant]:
            s.add_metric([model, version], _piecewise(t, s1, s2))
            if f1 is not None and (f1 > 0 or t >= _SPLIT_S):
                f.add_metric([model, version, "BACKEND"], _piecewise(t, f1, f2))
            q.add_metric([model, version, "0.95"], p95 * 1000)
        with self.bench._lock:
            for run in list(self.bench._runs):
                v = run.variants[self.variant]
                v.advance()
                s.add_metric([run.model, "1"], v.success)
                f.add_metric([run.model, "1", "BACKEND"], 0.0)
                q.add_metric([run.model, "1", "0.95"], 20_000.0)  # 20 ms: the live runs differ in accuracy only
                d.add_metric([run.model, "1"], v.success * 8_000.0)  # a mean of 8 ms per request
        yield from (s, f, q, d)


class _FeedbackSource:
    """``nvlab_feedback_total`` and ``nvlab_feedback_correct_total`` of one exporter instance."""

    def __init__(self, bench: MetricsBench, instance: int):
        self.bench, self.instance = bench, instance

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        t = self.bench.elapsed()
        total = GaugeMetricFamily(FEEDBACK_TOTAL, "labelled requests answered", labels=["variant"])
        right = GaugeMetricFamily(FEEDBACK_CORRECT, "labelled requests answered correctly", labels=["variant"])
        for variant, (rate, a1, a2) in _Q2_FEEDBACK[self.instance].items():
            total.add_metric([variant], rate * t)
            right.add_metric([variant], _piecewise(t, rate * a1, rate * a2))
        families = [total, right]
        if self.instance == 0:
            with self.bench._lock:
                for run in list(self.bench._runs):
                    lt = GaugeMetricFamily(FEEDBACK_TOTAL, "labelled", labels=[run.label])
                    lc = GaugeMetricFamily(FEEDBACK_CORRECT, "labelled, right", labels=[run.label])
                    for variant, v in run.variants.items():
                        v.advance()
                        lt.add_metric([variant], v.labelled)
                        lc.add_metric([variant], v.labelled * v.accuracy)
                    families += [lt, lc]
        yield from families


class MetricsBench:
    """A Prometheus (scrape every 0.5 s) over in-process sources: jobs ``champion`` and ``challenger`` with Triton's
    metric names (two versions of the service's model and another model each), and job ``feedback`` (two exporter
    instances) with the labelled-feedback counters. q2's history is scripted from the start; q3's live runs add
    series of their own. A context manager; ``stop()`` ends Prometheus and the sources (safe twice)."""

    def __init__(self) -> None:
        self.prom: Any = None
        self.t0: float | None = None
        self._servers: list[Any] = []
        self._runs: list[_LiveRun] = []
        self._lock = threading.Lock()
        self._count = 0

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else max(0.0, time.time() - self.t0)

    def start(self) -> MetricsBench:
        try:
            sources = [_TritonSource(self, v) for v in VARIANTS] + [_FeedbackSource(self, i) for i in range(2)]
            self._servers = [MetricsServer([s]).start() for s in sources]
            jobs = {"champion": [self._servers[0].address], "challenger": [self._servers[1].address],
                    "feedback": [self._servers[2].address, self._servers[3].address]}
            self.prom = PrometheusServer(jobs, scrape_interval_s=_SCRAPE_S, evaluation_interval_s=_SCRAPE_S).start()
            self.prom.wait_for("count(up == 1) == 4", timeout_s=30, poll_s=0.2)
            self.t0 = time.time()  # q2's history starts now: every source is being scraped
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self.prom is not None and self.prom.alive()

    def stop(self) -> None:
        if self.prom is not None:
            self.prom.stop()
            self.prom = None
        for s in self._servers:
            s.stop()
        self._servers = []

    def history_time(self) -> float:
        """When q2's queries are evaluated (unix s); waits until Prometheus has scraped past it."""
        assert self.t0 is not None
        at = self.t0 + _AT_S
        time.sleep(max(0.0, at + 2 * _SCRAPE_S + 0.2 - time.time()))
        return at

    def live(self, challenger_accuracy: float) -> _LiveRun:
        with self._lock:
            self._count += 1
            run = _LiveRun(self._count, challenger_accuracy, self._lock)
            self._runs.append(run)
        return run

    def drop(self, run: _LiveRun) -> None:
        with self._lock:
            if run in self._runs:
                self._runs.remove(run)

    def __enter__(self) -> MetricsBench:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextmanager
def _bench() -> Iterator[MetricsBench]:
    """The bound bench (started here by the first check that needs it), else one started for this check and
    stopped after it."""
    bound = _BOUND.get("bench")
    if bound is not None and bound.prom is None:  # bound, never started: a lab whose answers are blank never pays
        bound.start()
    if bound is not None and bound.alive():
        yield bound
        return
    with MetricsBench() as bench:
        yield bench


# --- q2: the canary's PromQL -------------------------------------------------------------------------------------

_LABEL = {"error_rate": "job", "p95_ms": "job", "accuracy": "variant"}


def _slip_queries(window: str) -> dict[str, list[tuple[str, str]]]:
    """Each key's known slips as PromQL, made from the reference's queries (so they change with it), and their
    messages."""
    ref = reference_canary_queries(window)
    model = f'model="{SERVICE_MODEL}"'
    failed, _, rest = ref["error_rate"].partition(" / (")  # "{failed} / ({ok} + {failed})"
    right, _, total = ref["accuracy"].partition(" / ")

    def totals(query: str) -> str:  # the counters' values since the start, not their rates over the window
        return query.replace("rate(", "(").replace("increase(", "(").replace(f"[{window}]", "")

    return {
        "error_rate": [
            (f"{failed} / {rest.partition(' + ')[0]}", "failures / successes is not the share of requests that "
                                                       "failed: divide by all requests, successes + failures"),
            (totals(ref["error_rate"]),
             "it reads the counters' totals since the servers started, not the last window: a canary judges what "
             "happens now; take rate(counter[window]) (or increase) of each counter"),
            (ref["error_rate"].replace(f"{{{model}}}", ""),
             f"it counts every model on the servers ({DECOY_MODEL}'s requests too): select the service's model, "
             f"{{{model}}}"),
        ],
        "p95_ms": [
            (ref["p95_ms"].replace("max by", "sum by"), "it adds the p95 of the two versions on a server: a sum of "
                                                        "latencies is no latency; the guard bounds the worst one, max "
                                                        "by (job)"),
            (ref["p95_ms"].replace("max by", "avg by"), "the mean of the versions' p95 hides the slow one: the guard "
                                                        "bounds the worst, max by (job)"),
            (ref["p95_ms"].replace(f"{model},", ""),
             f"it takes every model on the servers ({DECOY_MODEL}'s latency too): select {{{model}}}"),
        ],
        "accuracy": [
            (totals(ref["accuracy"]),
             "it reads the counters' totals since the start, not the last window: early answers hide what the "
             "challenger does now; increase(counter[window]) of both counters"),
            (f"{total} / {right}", "upside down: accuracy is right answers / labelled answers"),
        ],
    }


def _by_variant(df: Any, key: str) -> dict[str, list[float]]:
    label = _LABEL[key]
    if df.empty or label not in df.columns:
        return {v: [] for v in VARIANTS}
    return {v: [float(x) for k, x in zip(df[label], df["value"], strict=True) if k == v] for v in VARIANTS}


def _same(got: Mapping[str, list[float]], want: Mapping[str, list[float]]) -> bool:
    def close(a: float, b: float) -> bool:
        return math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=2e-3, abs_tol=1e-9)

    return all(len(got[v]) == 1 and len(want[v]) == 1 and close(got[v][0], want[v][0]) for v in VARIANTS)


def _grade_queries(fn: Any) -> str:
    queries = run_student(fn, Q2_WINDOW, what="canary_queries", call=f"canary_queries({Q2_WINDOW!r})",
                          timeout_s=10, returns=Mapping, returns_text="a dict {'error_rate': ..., 'p95_ms': ..., "
                                                                      "'accuracy': ...} of PromQL strings")
    missing = [k for k in _LABEL if k not in queries]
    if missing:
        raise Wrong(f"the dict has no {missing}: return the keys error_rate, p95_ms and accuracy")
    for key in _LABEL:
        if not isinstance(queries[key], str) or not queries[key].strip():
            raise Wrong(f"{key} is {_short(queries[key])}: a PromQL expression (a str)")
    for key in ("error_rate", "accuracy"):
        if f"[{Q2_WINDOW}]" not in queries[key].replace(" ", ""):
            raise Wrong(f"{key} does not use the window: canary_queries({Q2_WINDOW!r}) must take rates over "
                        f"[{Q2_WINDOW}] (an f-string: [{{window}}]); the canary chooses its window")
    with _bench() as bench:
        at = bench.history_time()
        prom = bench.prom
        ref = reference_canary_queries(Q2_WINDOW)
        slips = _slip_queries(Q2_WINDOW)
        notes = []
        for key, label in _LABEL.items():
            agg = "max" if key == "p95_ms" else "sum"
            try:
                df = prom.query(queries[key], at)
            except PrometheusError as err:
                raise Wrong(f"Prometheus refused {key}: {getattr(err, 'why', '') or err}") from None
            want = _by_variant(prom.query(ref[key], at), key)
            if df.empty:
                raise Wrong(f"{key} returns no series at all: check the metric names, the model label "
                            f'(model="{SERVICE_MODEL}") and that each side of an operator has matching labels (a '
                            f"failure counter carries a `reason` label the success counter lacks: aggregate both "
                            f"with sum by ({label}) first)")
            if label not in df.columns:
                labels = sorted(set(df.columns) - {"time", "value"})
                raise Wrong(f"{key}'s result has no `{label}` label (labels: {labels}):"
                            f" the canary tells the variants apart by it; aggregate with {agg} by ({label}) (...)")
            got = _by_variant(df, key)
            for v in VARIANTS:
                if len(got[v]) > 1:
                    extra = sorted(set(df.columns) - {"time", "value", label, "__name__"})
                    why = ("feedback comes from two exporter instances" if label == "variant" else
                           "each server runs two versions of the model")
                    raise Wrong(f"{key} gives {len(got[v])} series for {label}={v!r} (they differ by {extra}): {why}; "
                                f"aggregate them with {agg} by ({label}) (...)")
            for v in VARIANTS:
                if not got[v] and want[v]:
                    if key == "error_rate" and v == "champion":
                        raise Wrong("error_rate has no value for the champion: it has never failed, so Triton has no "
                                    "nv_inference_request_failure series for it yet, and `failures / ...` with "
                                    "failures missing is no result at all (the guard would never see 0 %). Add "
                                    "`or sum by (job) (rate(nv_inference_request_success{...}[window])) * 0` to the "
                                    "failures")
                    raise Wrong(f"{key} has no value for {label}={v!r}: check the metric names and labels")
            if _same(got, want):
                notes.append(f"{key} champion {want['champion'][0]:.3g}, challenger {want['challenger'][0]:.3g}")
                continue
            vals = {v: got[v][0] for v in VARIANTS if got[v]}
            if key == "p95_ms" and all(want[v] and math.isclose(vals.get(v, 0) / want[v][0], 1000, rel_tol=1e-2)
                                       for v in VARIANTS):
                raise Wrong("p95_ms is 1000 x too large: Triton's summary is in microseconds "
                            "(nv_inference_request_summary_us); divide by 1000 for ms")
            for expr, why in slips[key]:
                if _same(got, _by_variant(prom.query(expr, at), key)):
                    raise Wrong(f"{key}: {why}")
            shown = {v: round(x, 4) for v, x in vals.items()}
            expected = {v: round(want[v][0], 4) for v in VARIANTS if want[v]}
            raise Wrong(f"{key} gives {shown} where the window's true values are {expected}")
    return "on a real Prometheus: " + "; ".join(notes) + "."


q2 = CodeExercise(
    name="08.2 the canary's PromQL", var="canary_queries", grade=_grade_queries,
    references=References("write the PromQL yourself", "lab_utils.exercises.lab08.reference_canary_queries",
                           "lab_utils.mlops.canary.render_queries"),
    signature="canary_queries(window: str) -> dict[str, str]", applicable=_prometheus_missing,
    hints=(
        "Every number is over the last window: rate(counter[window]) (or increase) of Triton's counters "
        f"nv_inference_request_success and nv_inference_request_failure, filtered to {{model=\"{SERVICE_MODEL}\"}}, "
        "each summed by (job) (a server runs several versions); accuracy: increase of nvlab_feedback_correct_total "
        "/ increase of nvlab_feedback_total, summed by (variant).",
        "error_rate = failures / (successes + failures). A variant that never failed has no failure series: "
        "`(failures or successes * 0)` makes it 0.",
        "p95_ms: max by (job) of nv_inference_request_summary_us{model=..., quantile=\"0.95\"}, / 1000 "
        "(Triton reports microseconds).",
    ),
    solution_text=source_as(reference_canary_queries, "canary_queries"),
)
