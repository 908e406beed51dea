"""Lab 07's exercise checks against a real service (two Triton servers behind nginx): each check with right answers
(written differently too), blanks, and plausible wrong answers told their symptom."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
from _exercise_harness import as_written, check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab07 as ex
from lab_utils.exercises.framework import Exercise, Status
from lab_utils.exercises.lab07 import capacity, service
from lab_utils.serving import nginx as nginx_mod

# the service is conftest.py's, shared with the other file of its group (SHARED_GROUPS)


@pytest.fixture(scope="module")
def svc(service_stack):
    ex.use_service(service_stack)
    yield service_stack
    service._BOUND.clear()


# --- q1: the ensemble ------------------------------------------------------------------------------------------


def _pbtxt(cfg):
    from google.protobuf import text_format

    from lab_utils.serving import repository as triton_repo

    return text_format.MessageToString(triton_repo.parse_config(cfg))


def _ens(**changes):
    cfg = as_written(ex.reference_ensemble())  # a student's own dict: the course's is refused as an answer
    for path, value in changes.items():
        target = cfg
        *head, last = path.split("__")
        for k in head:
            target = target[int(k)] if k.isdigit() else target[k]
        target[int(last) if last.isdigit() else last] = value
    return cfg


_swapped = as_written(ex.reference_ensemble())
_steps = _swapped["ensemble_scheduling"]["step"]
_steps[0], _steps[1] = _steps[1], _steps[0]
_reordered = {k: as_written(ex.reference_ensemble())[k] for k in reversed(list(ex.reference_ensemble()))}

Q1_RIGHT = [as_written(ex.reference_ensemble()), _pbtxt(ex.reference_ensemble()), _reordered]
Q1_WRONG = [
    _ens(name="digits_service"),  # the service's own name
    _ens(input__0__data_type="TYPE_FP32"),  # a tensor, not the encoded bytes: Triton refuses the load
    _swapped,  # the classifier before the decoding
    _ens(ensemble_scheduling__step__1__output_map={"LOGITS": "logits"}),  # the postprocess's name, not the model's
]


# --- q2: preprocessing ------------------------------------------------------------------------------------------


def _block_mean(items):
    """Right, written differently: decode, then the mean of each block by reshaping (sizes are multiples of 8)."""
    from PIL import Image

    mean, std = ex.pixel_stats()
    out = []
    for i, b in enumerate(items.reshape(-1)):
        try:
            img = Image.open(io.BytesIO(b)).convert("L")
        except Exception as err:
            raise ValueError(f"bad image at index {i}: {err}") from None
        w, h = img.size
        if w * h > ex.MAX_PIXELS:
            raise ValueError(f"image {i} too large ({w}x{h})")
        a = np.asarray(img, np.float64).reshape(8, h // 8, 8, w // 8).mean(axis=(1, 3))
        out.append(((a * 16 / 255 - mean) / std)[None])
    return np.array(out, dtype=np.float32)


def _variant(resample="BOX", normalize=True, channel=True, catch=True, limit=True, scale=True):
    def preprocess(items):
        from PIL import Image

        mean, std = ex.pixel_stats()
        out = []
        for i, b in enumerate(items.reshape(-1)):
            if catch:
                try:
                    img = Image.open(io.BytesIO(b))
                    img.load()
                except Exception:
                    raise ValueError(f"item {i}: not an image") from None
            else:
                img = Image.open(io.BytesIO(b))
            if limit and img.size[0] * img.size[1] > ex.MAX_PIXELS:
                raise ValueError(f"item {i}: too large")
            a = np.asarray(img.convert("L").resize((8, 8), getattr(Image.Resampling, resample)), np.float32)
            a = a * ex.PIXEL_SCALE if scale else a
            a = (a - mean) / std if normalize else a
            out.append(a[None] if channel else a)
        return np.stack(out).astype(np.float32)

    return preprocess


Q2_RIGHT = [ex.reference_preprocess, _block_mean]
Q2_WRONG = [_variant(normalize=False), _variant(resample="BILINEAR"), _variant(channel=False),
            _variant(catch=False), _variant(limit=False), _variant(scale=False)]


# --- q4: the capacity search ----------------------------------------------------------------------------------


def _capacity_while(probe, lo_rps, hi_rps, slo_ms, tolerance):
    """Right, written differently: one loop, the rule through r.percentile(95)."""
    def passes(rate):
        r = probe(rate)
        return not r.errors and r.stable and r.percentile(95) <= slo_ms

    if not passes(lo_rps):
        return 0
    good, bad = lo_rps, hi_rps
    if passes(bad):
        return bad
    while (bad - good) / bad > tolerance:
        mid = 0.5 * (good + bad)
        good, bad = (mid, bad) if passes(mid) else (good, mid)
    return good


def _capacity_rule(rule):
    def find_capacity(probe, lo_rps, hi_rps, slo_ms, tolerance):
        if not rule(probe(lo_rps), slo_ms):
            return 0.0
        if rule(probe(hi_rps), slo_ms):
            return hi_rps
        while hi_rps - lo_rps > tolerance * hi_rps:
            mid = (lo_rps + hi_rps) / 2
            if rule(probe(mid), slo_ms):
                lo_rps = mid
            else:
                hi_rps = mid
        return lo_rps

    return find_capacity


def _linear_scan(probe, lo_rps, hi_rps, slo_ms, tolerance):
    rate = lo_rps
    while rate < hi_rps and probe(rate + 10).p95_ms <= slo_ms:
        rate += 10
    return rate


def _returns_failing(probe, lo_rps, hi_rps, slo_ms, tolerance):
    ok = lambda r: r.errors == 0 and r.stable and r.p95_ms <= slo_ms  # noqa: E731
    while hi_rps - lo_rps > tolerance * hi_rps:
        mid = (lo_rps + hi_rps) / 2
        lo_rps, hi_rps = (mid, hi_rps) if ok(probe(mid)) else (lo_rps, mid)
    return hi_rps  # the lowest rate that failed


Q4_RIGHT = [ex.reference_find_capacity, _capacity_while]
Q4_WRONG = [
    _capacity_rule(lambda r, slo: r.errors == 0 and r.stable and r.p50_ms <= slo),  # p50 for p95
    _capacity_rule(lambda r, slo: r.errors == 0 and r.p95_ms <= slo),  # stability ignored
    _capacity_rule(lambda r, slo: r.stable and r.p95_ms <= slo),  # errors ignored
    _linear_scan,
    _returns_failing,
]


# --- q3: the upstream block -----------------------------------------------------------------------------------


def _upstreams(svc):
    http, grpc = svc.backends("http"), svc.backends("grpc")
    rights = [as_written(ex.reference_upstream(http)),
              "upstream lb {\n    least_conn;\n" + "".join(f"    server {b} weight=2;\n" for b in http)
              + "    keepalive 16;\n}"]
    wrongs = [f"upstream triton_http {{\n    server {http[0]};\n}}",  # one server only
              as_written(ex.reference_upstream(grpc)),  # the gRPC ports
              f"upstream triton_http {{\n    server {http[0]}\n    server {http[1]};\n}}",  # a missing ';'
              "upstream triton_http {\n    server 127.0.0.1;\n}",  # no port: nginx would use 80
              f"upstream triton_http {{\n    server {http[0]} weight=5;\n    server {http[1]};\n}}"]  # lopsided
    return rights, wrongs


# --- q6: the capacity plan ------------------------------------------------------------------------------------


def _plan_int_division(peak_rps, capacity_rps, headroom, spares):
    usable = capacity_rps * (1 - headroom)
    return int(-(-peak_rps // usable)) + spares


def _plan(kind):
    def servers_needed(peak_rps, capacity_rps, headroom, spares):
        if kind == "no_headroom":
            return math.ceil(peak_rps / capacity_rps) + spares
        if kind == "times":
            return math.ceil(peak_rps * (1 + headroom) / capacity_rps) + spares
        if kind == "no_spare":
            return math.ceil(peak_rps / (capacity_rps * (1 - headroom)))
        if kind == "round":
            return round(peak_rps / (capacity_rps * (1 - headroom))) + spares
        return peak_rps / (capacity_rps * (1 - headroom)) + spares  # a float: a fraction of a server

    return servers_needed


Q6_RIGHT = [ex.reference_servers_needed, _plan_int_division]
Q6_WRONG = [_plan("no_headroom"), _plan("times"), _plan("no_spare"), _plan("round"), _plan("float")]

# --- q5: the GPU decode step (on the CPU here, with the Pillow stand-in of decode_jpeg) ---------------------------


def _gpu_pre(kind):
    def gpu_preprocess(items, decode_jpeg, device, size=ex.Q5_SIZE):
        import torch
        import torch.nn.functional as F

        data = [torch.frombuffer(bytearray(bytes(i)), dtype=torch.uint8)
                for i in np.asarray(items, dtype=object).ravel()]
        images = [decode_jpeg([d], device=device)[0] for d in data] if kind == "one_by_one" else \
            decode_jpeg(data, device=device)
        x = torch.stack([F.interpolate(img[None].float() / 255, size=(size, size), mode="bilinear",
                                       antialias=kind != "no_antialias")[0] for img in images])
        mean = torch.tensor(ex.IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(ex.IMAGENET_STD).view(1, 3, 1, 1)
        if kind == "not_normalized":
            return x
        if kind == "not_scaled":
            return x * 255
        if kind == "float64":
            return ((x - mean) / std).double()
        return (x - mean) / std  # resized on the 0..1 scale: the same values, another order

    return gpu_preprocess


Q5_RIGHT = [_gpu_pre("right")]
Q5_WRONG = [_gpu_pre("one_by_one"), _gpu_pre("no_antialias"), _gpu_pre("not_normalized"), _gpu_pre("not_scaled"),
            _gpu_pre("float64")]


def _told(exercise, value) -> str:
    """The message of a wrong answer, with what every wrong answer's message has (standard_tests' wrong test: the
    wrong answers are graded here only, once each, as each check runs real work against the service)."""
    out = check(exercise, value)
    assert out.status is Status.INCORRECT, (value, out.message)
    assert f"`{exercise.var}`" in out.message and len(out.message) > len(exercise.var) + 20, out.message
    return out.message


def test_gpu_decode_slips_get_their_own_message():
    got = [_told(ex.q5, fn) for fn in Q5_WRONG]
    assert "called 6 times for 6 images" in got[0] and "antialias=True" in got[1]
    assert "0..1 scale, not normalized" in got[2] and "raw 0..255" in got[3] and "float64" in got[4]


OFFLINE_CASES = [(ex.q6, Q6_RIGHT, Q6_WRONG), (ex.q5, Q5_RIGHT, Q5_WRONG)]
SERVICE_CASES = [(ex.q1, Q1_RIGHT, Q1_WRONG), (ex.q2, Q2_RIGHT, Q2_WRONG)]
RECORDED_CASES = [(ex.q4, Q4_RIGHT, Q4_WRONG)]


@pytest.fixture
def recorded_service(monkeypatch):
    """The live capacity search's probes answered by a simulated service (capacity drawn in the real search's
    range): the verdict on a right answer (its answer equals what its own probes say) needs no live load, and
    each live search costs ~25 s. The live search itself runs once, in the solution's cell under nbval."""
    from lab_utils.serving import load

    sim = capacity.SimulatedService(7, capacity.Q4_LO_RPS, capacity.Q4_QUICK_HI_RPS, "none")  # tests run quick
    monkeypatch.setattr(load, "run_open_loop", lambda target, rate, *a, **k: sim.probe(rate))
    return sim


# the wrong answers: each graded once, by test_wrong_answers_are_told_their_symptom and test_gpu_decode_slips_...
(test_offline_right, _, test_offline_blank) = standard_tests(OFFLINE_CASES)
(test_service_right, _, test_service_blank) = (pytest.mark.usefixtures("svc")(t) for t in standard_tests(SERVICE_CASES))
(test_capacity_right, _, test_capacity_blank) = (
    pytest.mark.usefixtures("svc", "recorded_service")(t) for t in standard_tests(RECORDED_CASES))


def test_upstream_right_wrong_blank(svc):
    rights, wrongs = _upstreams(svc)
    for value in rights:
        out = check(ex.q3, value)
        assert out.status is Status.CORRECT, (value, out.message)
    messages = []
    for value in wrongs:
        out = check(ex.q3, value)
        assert out.status is Status.INCORRECT, (value, out.message)
        assert "`upstream_block`" in out.message
        messages.append(out.message)
    assert "got nothing" in messages[0] and "gRPC ports" in messages[1] and "nginx refuses it" in messages[2]
    assert "no port" in messages[3] and "equal weights" in messages[4]
    for blank in (None, ...):
        assert check(ex.q3, blank).status is Status.NOT_ATTEMPTED
    assert nginx_mod.NginxServer.running() in ([], [svc.lb])  # each check's nginx stopped


def test_wrong_answers_are_told_their_symptom(svc):
    words = {id(Q1_WRONG[0]): "call it 'digits_mine'", id(Q1_WRONG[1]): "Triton refused to load it",
             id(Q1_WRONG[2]): "decoded first", id(Q1_WRONG[3]): "'LOGITS' is not an output of digits_classifier"}
    for value in Q1_WRONG:
        assert words[id(value)] in _told(ex.q1, value)
    q2 = [_told(ex.q2, fn) for fn in Q2_WRONG]
    assert "raw 0..16" in q2[0] and "BOX" in q2[1] and "channel axis" in q2[2]
    assert "other than ValueError" in q2[3] and "returned an answer" in q2[4] and "0..255" in q2[5]
    q4 = [_told(ex.q4, fn) for fn in Q4_WRONG]
    assert "p95" in q4[0] and "not stable" in q4[1] and "had errors" in q4[2] and "probes" in q4[3]
    assert "capacity is" in q4[4]
    q6 = [_told(ex.q6, fn) for fn in Q6_WRONG]
    assert "headroom is missing" in q6[0] and "(1 + headroom)" in q6[1] and "spare is missing" in q6[2]
    assert "rounded down" in q6[3] and "whole number" in q6[4]
    assert not (svc.repo.path / ex.Q1_NAME).exists()  # the check's ensemble is removed after each check


def test_checks_without_a_service_are_not_applicable_or_offline(monkeypatch):
    monkeypatch.setattr(service, "_BOUND", [])
    assert check(ex.q1, as_written(ex.reference_ensemble())).status is Status.NOT_APPLICABLE
    assert check(ex.q3, "upstream a { server 127.0.0.1:1; }").status is Status.NOT_APPLICABLE
    out = check(ex.q2, ex.reference_preprocess)  # graded against the reference preprocessing instead
    assert out.correct and "reference preprocessing" in out.message
    out = check(ex.q4, ex.reference_find_capacity)
    assert out.correct and "real search is skipped" in out.message


def test_simulated_service_edges():
    for trap in ("none", "p95", "stable", "errors"):
        sim = capacity.SimulatedService(1, 20, 1000, trap)
        assert ex.reference_find_capacity(sim.probe, 20, 1000, 100, 0.01) == pytest.approx(sim.capacity, rel=0.02)
        below, above = sim.probe(sim.capacity * 0.99), sim.probe(sim.capacity * 1.01)
        assert not below.errors and below.stable and below.p95_ms <= 100, trap
        broken = {"p95": above.p95_ms > 100, "stable": not above.stable, "errors": above.errors > 0}
        assert [k for k, v in broken.items() if v] == [trap if trap != "none" else "p95"]  # the trap's edge alone


def test_cases_cover_every_exercise():
    covered = OFFLINE_CASES + SERVICE_CASES + RECORDED_CASES + [(ex.q3, [], [])]
    assert {id(e) for e, *_ in covered} == {id(e) for e in exercises_of(ex)}
    assert all(len(w) >= 2 for _, _, w in OFFLINE_CASES + SERVICE_CASES + RECORDED_CASES)


def test_at_least_half_of_the_exercises_run_code():
    code = [ex.q2, ex.q4, ex.q6, ex.q5]  # functions the checks call (q1 and q3 run in Triton and nginx)
    assert 2 * len(code) >= len(exercises_of(ex))


@pytest.mark.parametrize("exercise", exercises_of(ex), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise, svc, recorded_service):
    namespace = {k: getattr(ex, k) for k in ex.__all__} | {"ex": ex, "svc": svc, "np": np, "io": io, "math": math}
    exec(exercise.solution_text, namespace)
    out = check(exercise, namespace[exercise.var])
    assert out.correct, out.message
    if exercise is ex.q4:  # the check's live path ran (on the recorded service; the nbval cell runs it for real)
        assert "Against the running service through nginx" in out.message and recorded_service.calls, out.message
        # quick mode (CI) searches up to 800/s: a probe at 2,500/s on 2 cores cost seconds of client CPU for nothing
        assert max(recorded_service.calls) == capacity.Q4_QUICK_HI_RPS == 800, recorded_service.calls


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(ex)
    assert len(exercises) >= 5
    names = sorted(k for k, v in vars(ex).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for e in exercises:
        assert e.name.startswith("07.") and 2 <= len(e.hints) <= 3


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(ex))


def test_all_exports_exist():
    for name in ex.__all__:
        assert hasattr(ex, name), name
    assert copy.copy(ex.q1).var == "ensemble"
