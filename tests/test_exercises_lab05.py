"""Lab 05's exercise checks against right, wrong and blank answers; the specific messages; the PromQL checks
graded by a real Prometheus on the recorded samples, the alert rule by promtool test rules, the watchdog against a
real Triton server (and what they say where there is none); hints and solutions."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests
from _prometheus import require_prometheus
from _standin import StandInServer
from _triton import require_server

from lab_utils.exercises import lab05
from lab_utils.exercises.framework import CodeExercise, Exercise, Status
from lab_utils.exercises.lab05 import promql, watchdog
from lab_utils.monitoring import prometheus
from lab_utils.serving import server as triton_server

QPS = "sum by (model) (rate(nv_inference_request_success[1m]))"
LAT = ("sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
       "sum by (model) (rate(nv_inference_request_success[1m])) / 1000")
GOOD_SNAPSHOT = {"qps": 240.0, "avg_batch": 8.0, "avg_queue_ms": 12.5}
GOOD_BOTTLENECK = {"detector": "queue", "ranker": "compute", "embedder": "outside"}

Q1_WRONG = {
    "increase": "sum by (model) (increase(nv_inference_request_success[1m]))",
    "no sum": "rate(nv_inference_request_success[1m])",
    "sum without by": "sum(rate(nv_inference_request_success[1m]))",
    "inferences": "sum by (model) (rate(nv_inference_count[1m]))",
    "executions": "sum by (model) (rate(nv_inference_exec_count[1m]))",
    "counter total": "sum by (model) (nv_inference_request_success)",
    "irate": "sum by (model) (irate(nv_inference_request_success[1m]))",
    "window": "sum by (model) (rate(nv_inference_request_success[5m]))",
    "constant": "120",
    "no range": "rate(nv_inference_request_success)",
    "range vector": "nv_inference_request_success[1m]",
    "one model": 'sum by (model) (rate(nv_inference_request_success{model="bert"}[1m]))',
    "no such metric": "sum by (model) (rate(nv_inference_requests[1m]))",
    "twice": "2 * sum by (model) (rate(nv_inference_request_success[1m]))",
    "increase, no sum": "increase(nv_inference_request_success[1m])",
    "delta": "sum by (model) (delta(nv_inference_request_success[1m])) / 60",
    # right on RECORDED only: two servers per model, two requests per execution
    "twice the average": "2 * avg by (model) (rate(nv_inference_request_success[1m]))",
    "twice the executions": "2 * sum by (model) (rate(nv_inference_exec_count[1m]))",
}
Q2_WRONG = {
    "microseconds": "sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
                    "sum by (model) (rate(nv_inference_request_success[1m]))",
    "since start": "sum by (model) (nv_inference_request_duration_us) / sum by (model) (nv_inference_request_success) "
                   "/ 1000",
    "queue": "sum by (model) (rate(nv_inference_queue_duration_us[1m])) / "
             "sum by (model) (rate(nv_inference_request_success[1m])) / 1000",
    "compute": "sum by (model) (rate(nv_inference_compute_infer_duration_us[1m])) / "
               "sum by (model) (rate(nv_inference_request_success[1m])) / 1000",
    "inferences": "sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
                  "sum by (model) (rate(nv_inference_count[1m])) / 1000",
    "executions": "sum by (model) (rate(nv_inference_request_duration_us[1m])) / "
                  "sum by (model) (rate(nv_inference_exec_count[1m])) / 1000",
    "average of averages": "avg by (model) (rate(nv_inference_request_duration_us[1m]) / "
                           "rate(nv_inference_request_success[1m])) / 1000",
    "no sum": "rate(nv_inference_request_duration_us[1m]) / rate(nv_inference_request_success[1m]) / 1000",
    "constant": "25",
    "delta": "sum by (model) (delta(nv_inference_request_duration_us[1m])) / "
             "sum by (model) (delta(nv_inference_request_success[1m])) / 1000",
    "half per execution": "sum by (model) (rate(nv_inference_request_duration_us[1m])) / "  # right on RECORDED only
                          "sum by (model) (rate(nv_inference_exec_count[1m])) / 2000",
}

PROMQL_CASES = [
    (lab05.q1, [QPS, "sum(rate(nv_inference_request_success[1m])) by (model)",
                "sum by (model) (increase(nv_inference_request_success[1m])) / 60",
                'sum by (model, job) (rate(nv_inference_request_success{job="triton"}[60s]))',
                "sum by (model) (sum by (model, instance, version) (rate(nv_inference_request_success[1m])))"],
     [*Q1_WRONG.values(), 42]),
    (lab05.q2, [LAT, "sum(rate(nv_inference_request_duration_us[1m])) by (model) / "
                     "sum(rate(nv_inference_request_success[1m])) by (model) / 1e3",
                "sum by (model) (increase(nv_inference_request_duration_us[1m])) * 0.001 / "
                "sum by (model) (increase(nv_inference_request_success[1m]))",
                "(sum without (instance, job, version) (rate(nv_inference_request_duration_us[1m])) / 1000) "
                "/ on (model) sum by (model) (rate(nv_inference_request_success[1m]))"],
     list(Q2_WRONG.values())),
]
OTHER_CASES = [
    (lab05.q3, [{"p99_ms": 76.5, "pending": 15}, {"p99_ms": 61.2, "pending": 12}, {"p99_ms": 150.0, "pending": 39},
                {"p99_ms": "80", "pending": 14.5}],
     [{"p99_ms": 50, "pending": 15}, {"p99_ms": 76.5, "pending": 10}, {"p99_ms": 200, "pending": 15},
      {"p99_ms": 52, "pending": 11}, {"p99_ms": 52, "pending": 15}, {"p99_ms": 76.5, "pending": 11},
      {"p99_ms": 76.5, "pending": 45}, {"p99_ms": 76.5}, [76.5, 15], {"p99_ms": "high", "pending": 15}]),
    (lab05.q6, [GOOD_SNAPSHOT, {"qps": 240, "avg_batch": 8, "avg_queue_ms": 12.49}],
     [{**GOOD_SNAPSHOT, "qps": 2400}, {**GOOD_SNAPSHOT, "qps": 480}, {**GOOD_SNAPSHOT, "avg_batch": 4},
      {**GOOD_SNAPSHOT, "avg_queue_ms": 12500}, {**GOOD_SNAPSHOT, "avg_queue_ms": 6.25},
      {**GOOD_SNAPSHOT, "avg_queue_ms": 3.05}, {"qps": 240}, 240]),
    (lab05.q7, [GOOD_BOTTLENECK, {"detector": " Queue", "ranker": "COMPUTE", "embedder": "outside"}],
     [{**GOOD_BOTTLENECK, "detector": "compute"}, {**GOOD_BOTTLENECK, "ranker": "queue"},
      {**GOOD_BOTTLENECK, "embedder": "compute"}, {**GOOD_BOTTLENECK, "embedder": "network"},
      {"detector": "queue"}, "queue"]),
]


# --- q4: the alert rule -----------------------------------------------------------------------------------

QUEUE_MS = ("sum by (model) (rate(nv_inference_queue_duration_us[1m])) "
            "/ sum by (model) (rate(nv_inference_request_success[1m])) / 1000")
ALERT_RULE = f"""
alert: TritonQueueTimeHigh
expr: {QUEUE_MS} > 100
for: 2m
labels:
  severity: warning
annotations:
  summary: "{{{{ $labels.model }}}} requests wait {{{{ $value }}}} ms in the queue"
"""


def _rule(expr: str = f"{QUEUE_MS} > 100", for_: str | None = "2m", labels=None, **extra) -> dict:
    rule = {"alert": "QueueTimeHigh", "expr": expr, "labels": {"severity": "warning"} if labels is None else labels}
    if for_ is not None:
        rule["for"] = for_
    return {**rule, **extra}


ALERT_RIGHT = [
    ALERT_RULE,
    # a dict; increase over increase (the same ratio); the threshold in µs, written first; 120s; critical; more labels
    _rule("1e5 < sum by (model) (increase(nv_inference_queue_duration_us[1m])) "
          "/ sum by (model) (increase(nv_inference_request_success[1m]))", "120s",
          {"severity": "critical", "team": "serving"}),
    # a whole rules file; sum without the other labels; 3m
    "groups:\n- name: serving\n  rules:\n  - alert: QueueTimeHigh\n    expr: >-\n"
    "      sum without (instance, job, version) (rate(nv_inference_queue_duration_us[1m]))\n"
    "      / sum without (instance, job, version) (rate(nv_inference_request_success[1m])) > 100 * 1000\n"
    "    for: 3m\n    labels: {severity: warning}\n",
    # a list of one rule; no aggregation (one server here); 1m is still longer than the burst
    "- alert: QueueTimeHigh\n  expr: rate(nv_inference_queue_duration_us[1m]) / rate(nv_inference_request_success[1m]) "
    "/ 1e3 > 100\n  for: 1m\n  labels:\n    severity: warning\n",
]
ALERT_WRONG = {
    "no for": _rule(for_=None),
    "for too short": _rule(for_="30s"),
    "for too long": _rule(for_="10m"),
    "reversed": _rule(f"{QUEUE_MS} < 100"),
    "reversed, written the other way": _rule(f"100 > {QUEUE_MS}"),
    "increase for rate": _rule(QUEUE_MS.replace("rate(nv_inference_queue", "increase(nv_inference_queue") + " > 100"),
    "microseconds": _rule(QUEUE_MS.removesuffix(" / 1000") + " > 100"),
    "no severity": _rule(labels={}),
    "severity made up": _rule(labels={"severity": "high"}),
    "request time": _rule(QUEUE_MS.replace("queue_duration", "request_duration") + " > 100"),
    "per second": _rule("sum by (model) (rate(nv_inference_queue_duration_us[1m])) / 1000 > 100"),
    "5m window": _rule(QUEUE_MS.replace("[1m]", "[5m]") + " > 100"),
    "no model": _rule("sum(rate(nv_inference_queue_duration_us[1m])) / sum(rate(nv_inference_request_success[1m])) "
                      "/ 1000 > 100"),
    "bool": _rule(f"{QUEUE_MS} > bool 100"),
    "one model": _rule(QUEUE_MS.replace("success[1m]", 'success{model="resnet50"}[1m]') + " > 100"),
    "not yaml": "alert: QueueTimeHigh\nexpr: up == 0\n for: 2m",
    "recording rule": "record: queue_ms\nexpr: up",
    "no expr": {"alert": "QueueTimeHigh", "for": "2m"},
    "bad PromQL syntax": _rule("sum by (model) (rate(nv_inference_queue_duration_us[1m]) > "),
    "two rules": [_rule(), _rule()],
    "delta": _rule("sum by (model) (delta(nv_inference_queue_duration_us[1m])) "
                   "/ sum by (model) (delta(nv_inference_request_success[1m])) / 1000 > 100"),
    # these fire at the right times on ALERT_SERIES, with values or a threshold that are not the question's
    "twice, against 200": _rule(f"2 * {QUEUE_MS} > 200"),
    "threshold 150": _rule(f"{QUEUE_MS} > 150"),
    "threshold 60": _rule(f"{QUEUE_MS} > 60"),
}
ALERT_CASES = [(lab05.q4, ALERT_RIGHT, list(ALERT_WRONG.values()))]

# --- q5: the watchdog ---------------------------------------------------------------------------------------


def _ready(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def watchdog_right(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    bad, delay = 0, backoff_s
    while not stop.is_set():
        if _ready(server.http_url, timeout_s):
            bad, delay = 0, backoff_s
        else:
            bad += 1
        if bad >= failures:
            try:
                server.restart()
            except Exception:
                pass
            bad = 0
            stop.wait(delay)
            delay = min(2 * delay, max_backoff_s)
        else:
            stop.wait(poll_s)


def watchdog_written_differently(server, stop, **settings):
    """http.client instead of urllib; the last polls kept in a list; the backoff from the restarts in a row."""
    import http.client
    import urllib.parse

    s = settings
    recent: list[bool] = []
    restarts_in_a_row = 0
    while not stop.wait(s["poll_s"]):
        parts = urllib.parse.urlsplit(server.http_url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=s["timeout_s"])
        try:
            conn.request("GET", "/v2/health/ready")
            ok = conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            ok = False
        finally:
            conn.close()
        recent = [*recent, ok][-s["failures"]:]
        if ok:
            restarts_in_a_row = 0
        elif len(recent) == s["failures"] and not any(recent):
            try:
                server.restart()
            except Exception:
                pass  # a failed start: the next wait is longer
            recent = []
            stop.wait(min(s["backoff_s"] * 2**restarts_in_a_row, s["max_backoff_s"]))
            restarts_in_a_row += 1


def watchdog_no_timeout(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    bad, delay = 0, backoff_s
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"{server.http_url}/v2/health/ready") as r:
                ready = r.status == 200
        except OSError:
            ready = False
        bad, delay = (0, backoff_s) if ready else (bad + 1, delay)
        if bad >= failures:
            try:
                server.restart()
            except Exception:
                pass
            bad = 0
            stop.wait(delay)
            delay = min(2 * delay, max_backoff_s)
        else:
            stop.wait(poll_s)


def watchdog_no_backoff(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    bad = 0
    while not stop.is_set():
        bad = 0 if _ready(server.http_url, timeout_s) else bad + 1
        if bad >= failures:
            try:
                server.restart()
            except Exception:
                pass
            bad = 0
        stop.wait(poll_s)


def watchdog_restart_unguarded(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0,
                               max_backoff_s=30.0):
    bad, delay = 0, backoff_s
    while not stop.is_set():
        bad, delay = (0, backoff_s) if _ready(server.http_url, timeout_s) else (bad + 1, delay)
        if bad >= failures:
            server.restart()  # a failed start ends the watchdog
            bad = 0
            stop.wait(delay)
            delay = min(2 * delay, max_backoff_s)
        else:
            stop.wait(poll_s)


def watchdog_old_path(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    bad, delay = 0, backoff_s
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"{server.http_url}/api/health/ready", timeout=timeout_s) as r:
                ready = r.status == 200
        except OSError:
            ready = False
        bad, delay = (0, backoff_s) if ready else (bad + 1, delay)
        if bad >= failures:
            try:
                server.restart()
            except Exception:
                pass
            bad = 0
            stop.wait(delay)
            delay = min(2 * delay, max_backoff_s)
        else:
            stop.wait(poll_s)


def watchdog_urlerror_only(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    bad, delay = 0, backoff_s
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=timeout_s) as r:
                ready = r.status == 200
        except urllib.error.URLError:  # a timeout while reading the answer is not a URLError
            ready = False
        bad, delay = (0, backoff_s) if ready else (bad + 1, delay)
        if bad >= failures:
            try:
                server.restart()
            except Exception:
                pass
            bad = 0
            stop.wait(delay)
            delay = min(2 * delay, max_backoff_s)
        else:
            stop.wait(poll_s)


def watchdog_ignores_stop(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    import time

    bad, delay = 0, backoff_s
    while True:
        bad, delay = (0, backoff_s) if _ready(server.http_url, timeout_s) else (bad + 1, delay)
        if bad >= failures:
            try:
                server.restart()
            except Exception:
                pass
            bad = 0
            time.sleep(delay)
            delay = min(2 * delay, max_backoff_s)
        else:
            time.sleep(poll_s)


def watchdog_returns(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    if not _ready(server.http_url, timeout_s):
        server.restart()


def watchdog_blank(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):
    """Until stop is set: poll, restart after `failures` failed polls, back off."""
    ...  # YOUR CODE HERE


WATCHDOG_WRONG = {
    "no timeout": (watchdog_no_timeout, ["hung", "did not restart it within", "timeout=timeout_s",
                                         "urlopen(f\"{server.http_url}/v2/health/ready\")"]),
    "no backoff": (watchdog_no_backoff, ["restart storm", "every restart failed", "double the wait"]),
    "restart error not caught": (watchdog_restart_unguarded, ["raised ServerStartError", "server.restart()",
                                                              "catch the error, back off"]),
    "the v1 path": (watchdog_old_path, ["restarted a healthy server", "/api/health/ready"]),
    # a timeout while reading the answer (the hung server), or a connection the killed server closed: both escape
    "URLError only": (watchdog_urlerror_only, ["raised", "catch OSError", "urlopen raises URLError only"]),
    "ignores stop": (watchdog_ignores_stop, ["did not return within", "after `stop` was set", "stop.wait",
                                             "(it was at line"]),
    "no loop": (watchdog_returns, ["returned after", "loop until `stop` is set"]),
}
WATCHDOG_CASES = [(lab05.q5, [watchdog_right, watchdog_written_differently], [])]

@pytest.fixture
def prometheus_here(shared_recording):
    """The PromQL checks need prometheus and promtool (skip without, fail under NVLAB_REQUIRE_PROMETHEUS=1); they
    query one Prometheus per worker serving the lab's recordings (tests/conftest.py)."""
    require_prometheus()


(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(OTHER_CASES)

# the wrong queries: each graded once, by test_q1_messages, test_q2_messages and test_a_constant_that_matches_once
(
    test_right_queries_are_correct,
    _,
    test_blank_queries_are_not_attempted,
) = (pytest.mark.usefixtures("prometheus_here")(t) for t in standard_tests(PROMQL_CASES))


def test_cases_cover_every_exercise():
    covered = PROMQL_CASES + OTHER_CASES + ALERT_CASES + WATCHDOG_CASES
    assert {id(ex) for ex, *_ in covered} == {id(ex) for ex in exercises_of(lab05)}


def test_at_least_half_of_the_exercises_run_code_against_the_real_component():
    executed = [lab05.q1, lab05.q2, lab05.q4, lab05.q5]  # Prometheus, Prometheus, promtool, a Triton server
    assert {type(e) for e in executed} == {promql.PrometheusExercise, CodeExercise}
    assert 2 * len(executed) >= len(exercises_of(lab05))


# --- the recorded data behind q1 and q2, as Prometheus serves it --------------------------------------------


def _reference(expr: str) -> dict[str, list[float]]:
    """{model: [value at each grading time]} of ``expr`` on the recorded samples."""
    with prometheus.recorded_server(lab05.RECORDED) as server:
        df = server.query_range(expr, lab05.GRADING_TIMES[0], lab05.GRADING_TIMES[-1], 180)
    return {m: g.sort_values("time")["value"].tolist() for m, g in df.groupby("model")}


@pytest.mark.usefixtures("prometheus_here")
def test_recorded_data_is_what_the_questions_say():
    qps, latency = _reference(QPS), _reference(LAT)
    # the phases' loads (each 1-minute window wobbles around them) and the two servers' weighted latency (ms)
    for got, want in ((qps["resnet50"], [80, 120, 200, 150]), (qps["bert"], [30, 45, 20, 60]),
                      (latency["resnet50"], [21.8, 25.8, 45.2, 31.8]), (latency["bert"], [9.2, 10.3, 10.5, 15.9])):
        assert got == pytest.approx(want, rel=0.25)
    for values in (*qps.values(), *latency.values()):
        assert len(set(values)) == len(lab05.GRADING_TIMES)  # the reference changes at every grading time
    batch = _reference("sum by (model) (rate(nv_inference_count[1m])) "
                       "/ sum by (model) (rate(nv_inference_exec_count[1m]))")
    assert batch == {"bert": pytest.approx([4.0] * 4), "resnet50": pytest.approx([8.0] * 4)}
    labels = [lab for lab, _, _ in lab05.RECORDED]
    assert {lab["model"] for lab in labels if "model" in lab} == {"resnet50", "bert"}
    assert {lab["instance"] for lab in labels} == {"10.0.0.7:8002", "10.0.0.8:8002"}
    assert max(t for _, t, _ in lab05.RECORDED) == lab05.GRADING_TIMES[-1]


# --- specific messages -----------------------------------------------------------------------------------


def _msg(exercise: Exercise, value) -> str:
    """The message of a wrong answer, with what every wrong answer's message has (standard_tests' wrong test: the
    wrong PromQL and rules are graded here only, once each, as each check is real Prometheus or promtool work)."""
    out = check(exercise, value)
    assert out.status is Status.INCORRECT, (value, out.message)
    assert f"`{exercise.var}`" in out.message and len(out.message) > len(exercise.var) + 20, out.message
    return out.message


@pytest.mark.usefixtures("prometheus_here")
@pytest.mark.parametrize(("case", "words"), [
    ("increase", ["increase instead of rate", "60x the reference"]),
    ("no sum", ["missing sum by (model)", "4 series for 2 models"]),
    ("sum without by", ["missing sum by (model)", "no model label"]),
    ("inferences", ["counts inferences"]),
    ("executions", ["counts executions"]),
    ("counter total", ["since the server started"]),
    ("irate", ["irate()", "last two samples"]),
    ("window", ["5m window", "[1m]"]),
    ("constant", ["this query is a constant"]),
    ("no range", ["Prometheus refuses it", "expected type range vector"]),
    ("range vector", ["range vector", "rate()"]),
    ("one model", ["drop the label matcher"]),
    ("no such metric", ["no series"]),
    ("twice", ["2x the reference"]),
    ("increase, no sum", ["missing sum by (model)", "increase instead of rate"]),  # two slips, both named
    ("delta", ["delta() is for gauges", "resets", "use rate()"]),
    ("twice the average", ["on ex.RECORDED, but not on a second recording", "into the second recording"]),
    ("twice the executions", ["on ex.RECORDED, but not on a second recording"]),
])
def test_q1_messages(case, words):
    msg = _msg(lab05.q1, Q1_WRONG[case])
    assert all(w in msg for w in words), msg


@pytest.mark.usefixtures("prometheus_here")
@pytest.mark.parametrize(("case", "words"), [
    ("microseconds", ["microseconds", "1000x"]),
    ("since start", ["since the server started"]),
    ("queue", ["queue"]),
    ("compute", ["compute"]),
    ("inferences", ["divides by inferences"]),
    ("executions", ["per execution"]),
    ("average of averages", ["averages the servers' averages"]),
    ("no sum", ["missing sum by (model)"]),
    ("constant", ["this query is a constant"]),
    ("delta", ["delta() is for gauges"]),
    ("half per execution", ["on ex.RECORDED, but not on a second recording"]),
])
def test_q2_messages(case, words):
    msg = _msg(lab05.q2, Q2_WRONG[case])
    assert all(w in msg for w in words), msg


@pytest.mark.usefixtures("prometheus_here")
def test_a_constant_that_matches_once_is_not_accepted():
    first = {m: v[0] for m, v in _reference(QPS).items()}  # the reference's values at the first grading time
    constant = " or ".join(f'label_replace(vector({v!r}), "model", "{m}", "", "")' for m, v in first.items())
    assert "this query is a constant" in _msg(lab05.q1, constant)
    assert "as a string" in _msg(lab05.q1, 42)


def test_without_prometheus_the_check_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv(prometheus.BINARY_ENV, "none")  # as on a machine without prometheus and promtool
    for exercise, answer in ((lab05.q1, QPS), (lab05.q2, "nonsense"), (lab05.q4, ALERT_RULE)):
        out = check(exercise, answer)
        assert out.status is Status.NOT_ATTEMPTED  # not graded, so neither right nor wrong
        assert all(w in out.message for w in ("not checked", "sudo apt-get install prometheus",
                                              "brew install prometheus", "compose stack")), out.message
    assert check(lab05.q1, None).status is Status.NOT_ATTEMPTED and "Set `qps_query`" in check(lab05.q1, None).message
    assert check(lab05.q7, GOOD_BOTTLENECK).correct  # the other checks need no Prometheus


@pytest.mark.usefixtures("prometheus_here")
def test_the_second_recording_is_drawn_afresh_and_differs_from_the_first():
    import random

    draws = [promql.hidden_samples(random.Random(seed)) for seed in (1, 2)]
    assert draws[0] != draws[1]
    for samples in draws:
        assert min(t for _, t, _ in samples) > max(t for _, t, _ in lab05.RECORDED) + 3600
        success = [(lab["instance"], lab["model"], lab["version"], t, v) for lab, t, v in samples
                   if lab["__name__"] == "nv_inference_request_success"]
        assert len({i for i, *_ in success}) == 3 and {v for _, m, v, *_ in success if m == "bert"} == {"1", "2"}
        resets = 0
        for key in {(i, m, v) for i, m, v, *_ in success}:
            values = [v for *k, t, v in sorted(success, key=lambda r: r[3]) if tuple(k) == key]
            resets += sum(b < a for a, b in zip(values, values[1:], strict=False))
        assert resets == 3  # one server restarted: each of its three series (two models, bert in two versions)
    # a slip recognised on RECORDED keeps its message (both recordings in one Prometheus)
    assert "increase instead of rate" in _msg(lab05.q1, Q1_WRONG["increase"])


def test_q3_headroom():
    assert lab05.HEADROOM == 0.2
    msg = check(lab05.q3, {"p99_ms": 52, "pending": 15}).message
    assert "only 2.0 % above the healthy hour's peak (51ms)" in msg and "at least 20 % headroom" in msg, msg
    assert "p99_ms >= 61.2ms" in msg
    msg = check(lab05.q3, {"p99_ms": 76.5, "pending": 11}).message
    assert "pending = 11 is only 10.0 % above" in msg and "pending >= 12" in msg, msg
    assert check(lab05.q3, {"p99_ms": 61.2, "pending": 12}).correct  # exactly 20 % above both peaks


def test_q3_messages_and_data():
    assert max(lab05.BASELINE_P99_MS) < min(lab05.INCIDENT_P99_MS[20:])
    assert max(lab05.BASELINE_PENDING) < min(lab05.INCIDENT_PENDING[20:])
    assert lab05.INCIDENT_P99_MS[:20] == lab05.BASELINE_P99_MS[:20]
    msg = check(lab05.q3, {"p99_ms": 50, "pending": 15}).message
    assert "false alarms" in msg and "1 of its 60 minutes" in msg
    assert "sleep through the incident" in check(lab05.q3, {"p99_ms": 200, "pending": 15}).message
    assert "pending" in check(lab05.q3, {"p99_ms": 76.5, "pending": 10}).message
    assert "two keys" in check(lab05.q3, [76.5, 15]).message


def test_q6_messages_and_snapshot_text():
    assert "divide by the seconds" in check(lab05.q6, {**GOOD_SNAPSHOT, "qps": 2400}).message
    assert "inferences" in check(lab05.q6, {**GOOD_SNAPSHOT, "qps": 480}).message
    assert "requests per execution" in check(lab05.q6, {**GOOD_SNAPSHOT, "avg_batch": 4}).message
    assert "microseconds" in check(lab05.q6, {**GOOD_SNAPSHOT, "avg_queue_ms": 12500}).message
    assert "divides by inferences" in check(lab05.q6, {**GOOD_SNAPSHOT, "avg_queue_ms": 6.25}).message
    assert "since the server started" in check(lab05.q6, {**GOOD_SNAPSHOT, "avg_queue_ms": 3.05}).message
    types = prometheus.metric_types(lab05.SNAPSHOT_AFTER)
    assert types["nv_inference_request_success"] == "counter"
    assert types["nv_inference_pending_request_count"] == "gauge"


def test_q7_each_model_explained_with_what_gpu_utilization_measures():
    msgs = {m: check(lab05.q7, {**GOOD_BOTTLENECK, m: "compute" if m != "ranker" else "queue"}).message
            for m in GOOD_BOTTLENECK}
    assert "instances" in msgs["detector"] and "SM activity" in msgs["ranker"] and "network" in msgs["embedder"]
    # the embedder's GPU utilization reads 100 % while its SMs are active 3 %: the lesson is in the message
    assert "100 %" in msgs["embedder"] and "SMs are active 3 %" in msgs["embedder"]
    assert "tensor pipes" in msgs["ranker"]
    models = lab05.BOTTLENECK_MODELS
    assert models["embedder"]["gpu_util_pct"] == 100 and models["embedder"]["sm_active_pct"] < 5
    assert "one of" in check(lab05.q7, {**GOOD_BOTTLENECK, "embedder": "network"}).message


@pytest.mark.parametrize("exercise", exercises_of(lab05), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise, request):
    if isinstance(exercise, promql.PrometheusExercise):
        request.getfixturevalue("prometheus_here")
    if exercise is lab05.q5:
        require_server()
    namespace = {k: getattr(lab05, k) for k in lab05.__all__}
    exec(exercise.solution_text, namespace)
    assert check(exercise, namespace[exercise.var]).correct


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab05)
    assert len(exercises) >= 7
    names = sorted(k for k, v in vars(lab05).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for exercise in exercises:
        assert exercise.name.startswith("05.") and 2 <= len(exercise.hints) <= 3


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab05))


def test_all_exports_exist():
    for name in lab05.__all__:
        assert hasattr(lab05, name), name


# --- q4: the alert rule, graded by promtool -------------------------------------------------------------------


@pytest.fixture
def promtool_here():
    """The rule check needs promtool: skip without, fail under NVLAB_REQUIRE_PROMETHEUS=1."""
    why = prometheus.missing("promtool")
    if why is None:
        return
    if prometheus.required():
        pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but {why}")
    pytest.skip(why)


# the wrong rules: each graded once, by test_q4_messages
(
    test_right_rules_are_correct,
    _,
    test_blank_rules_are_not_attempted,
) = (pytest.mark.usefixtures("promtool_here")(t) for t in standard_tests(ALERT_CASES))


@pytest.mark.usefixtures("promtool_here")
@pytest.mark.parametrize(("case", "words"), [
    ("no for", ["no `for:`", "fired on bert's burst at 4m15s", "for: 2m"]),
    ("for too short", ["`for: 30s` is too short", "burst"]),
    ("for too long", ["`for: 10m` is longer than the overload", "never fired"]),
    ("reversed", ["points the wrong way", "queue time > 100"]),
    ("reversed, written the other way", ["points the wrong way"]),
    ("increase for rate", ["increase()", "60x"]),
    ("microseconds", ["microseconds", "100000"]),
    ("no severity", ["no severity label", "severity: warning"]),
    ("severity made up", ["severity 'high'", "warning or critical"]),
    ("request time", ["whole request's time", "nv_inference_queue_duration_us"]),
    ("per second", ["per second", "not per request"]),
    ("5m window", ["5m window", "[1m]"]),
    ("no model", ["no model label", "sum by (model)"]),
    ("bool", ["`bool`"]),
    ("one model", ["keeps only some models", 'model="resnet50"']),
    ("not yaml", ["not valid YAML", "line 3"]),
    ("recording rule", ["recording rule"]),
    ("no expr", ["no expr"]),
    ("bad PromQL syntax", ["promtool check rules refuses it", "unclosed left parenthesis"]),
    ("two rules", ["one alerting rule", "found 2"]),
    ("delta", ["delta() is for gauges", "resets"]),
    ("twice, against 200", ["not the queue time per request", "$value"]),
    ("threshold 150", ["other evaluations than queue time > 100 ms", "compare with 100"]),
    ("threshold 60", ["other evaluations than queue time > 100 ms"]),
])
def test_q4_messages(case, words):
    msg = _msg(lab05.q4, ALERT_WRONG[case])
    assert all(w in msg for w in words), msg


@pytest.mark.usefixtures("promtool_here")
@pytest.mark.parametrize("answer", [ALERT_RULE, ALERT_WRONG["increase for rate"]], ids=["right", "a slip"])
def test_q4_runs_promtool_twice_per_answer(answer, monkeypatch):
    """check rules, then one test rules for every probe and slip at once: each promtool run loads the series and
    evaluates the rule again, and the checks of the wrong rules ran a dozen each."""
    import subprocess

    runs = []

    class Counted(subprocess.Popen):  # the real process, counted
        def __init__(self, args, *rest, **kwargs):
            runs.append(list(args)[:3])
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Counted)
    check(lab05.q4, answer)
    assert [r[1:] for r in runs] == [["check", "rules"], ["test", "rules"]], runs


@pytest.mark.usefixtures("promtool_here")
def test_q4_recorded_series_are_what_the_question_says():
    frame = lab05.alert_series_frame()
    bert, resnet = frame[frame["model"] == "bert"], frame[frame["model"] == "resnet50"]
    burst = bert["minute"] == lab05.ALERT_BURST_S / 60
    assert bert.loc[burst, "queue_ms"].item() == pytest.approx(2400)
    assert bert.loc[~burst, "queue_ms"].between(20, 40).all()
    assert (bert["request_ms"] > 100).all()  # a rule on the whole request time fires on calm bert
    calm = resnet["minute"] <= lab05.ALERT_OVERLOAD_S / 60
    assert resnet.loc[calm, "queue_ms"].between(15, 35).all() and resnet.loc[~calm, "queue_ms"].between(190, 420).all()
    # the burst's [1m] average is above anything the overload reaches: no threshold alone separates them
    burst_avg = (2 * 30 + 2400) / 3
    assert burst_avg > resnet["queue_ms"].max()
    out = check(lab05.q4, ALERT_RULE)
    assert out.correct and "promtool test rules" in out.message


# --- q5: the watchdog, graded against a real Triton server ---------------------------------------------------


@pytest.fixture
def stand_in(monkeypatch):
    """The check's server is a small HTTP process (tests/_standin.py): the wrong answers' symptoms (a restart storm,
    no timeout on a hung server...) do not depend on what answers the health path, and each real Triton start costs
    seconds. The solution's watchdog still meets the real server (test_solution_code_passes_its_check[05.5])."""
    monkeypatch.setattr(watchdog, "watched_server", StandInServer)
    monkeypatch.setattr(watchdog, "_server_unavailable", lambda: None)
    assert isinstance(watchdog._Rig().server, StandInServer)  # patched where the check looks it up (no process yet)


def _servers_now() -> set[int]:
    return set(map(id, triton_server.running_servers()))


def _nothing_left(before: set[int]):
    # only the check's own servers must be gone: a session-scoped service may share this worker
    assert not [s for s in triton_server.running_servers() if id(s) not in before]
    assert not [t for t in threading.enumerate() if t.name == "student watchdog" and t.is_alive()]


@pytest.mark.usefixtures("stand_in")
@pytest.mark.parametrize("fn", [watchdog_written_differently], ids=lambda f: f.__name__)
def test_right_watchdogs_are_correct(fn):
    """The solution's own watchdog meets the real Triton (test_solution_code_passes_its_check[05.5])."""
    before = _servers_now()
    out = check(lab05.q5, fn)
    assert out.correct, out.message
    assert "restarted once" in out.message and "backing off" in out.message
    _nothing_left(before)


@pytest.mark.usefixtures("stand_in")
@pytest.mark.parametrize("blank", [None, ..., watchdog_blank], ids=["None", "Ellipsis", "body ..."])
def test_blank_watchdog_is_not_attempted(blank):
    out = check(lab05.q5, blank)
    assert out.status is Status.NOT_ATTEMPTED and "watchdog" in out.message


@pytest.mark.usefixtures("stand_in")
@pytest.mark.parametrize(("fn", "words"), list(WATCHDOG_WRONG.values()), ids=list(WATCHDOG_WRONG))
def test_wrong_watchdogs_are_told_their_symptom(fn, words):
    before = _servers_now()
    out = check(lab05.q5, fn)
    assert out.status is Status.INCORRECT, out.message
    assert "`watchdog`" in out.message and all(w in out.message for w in words), out.message
    _nothing_left(before)


def test_watchdog_not_applicable_without_a_server(monkeypatch):
    from lab_utils.serving.server import ServerNotFound

    def no_server(local=False):
        raise ServerNotFound("No Triton server is available. Three ways to get one: ...")

    monkeypatch.setattr(triton_server, "find_server", no_server)
    out = check(lab05.q5, watchdog_right)
    assert out.status is Status.NOT_APPLICABLE and "real Triton server" in out.message
    assert "was not run" in out.message
