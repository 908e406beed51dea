"""Lab 08's pure parts: A/B routing and statistics against known values (and scipy where installed), drift
statistics on shifted and unshifted digits, the canary's decision function, and the lifecycle map."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from lab_utils.mlops import abtest, drift, lifecycle
from lab_utils.mlops.canary import CanaryState, Guards, VariantMetrics, decide, render_queries, window_seconds
from lab_utils.mlops.tracking import digits_data

# --- A/B ------------------------------------------------------------------------------------------------------


def test_route_is_stable_balanced_and_checked():
    groups = [abtest.route(f"user-{i}") for i in range(20000)]
    assert groups == [abtest.route(f"user-{i}") for i in range(20000)]  # the same user, the same group
    assert abs(groups.count("B") / len(groups) - 0.5) < 0.015
    assert abs([abtest.route(i, 0.1) for i in range(20000)].count("B") / 20000 - 0.1) < 0.01
    assert {abtest.route(i, 0.0) for i in range(100)} == {"A"} and {abtest.route(i, 1.0) for i in range(100)} == {"B"}
    assert abtest.route("user-7", salt="exp2") in ("A", "B")
    assert abtest.route(42) == abtest.route(42)
    for bad, match in (("", "non-empty"), (None, "non-empty"), (1.5, "non-empty")):
        with pytest.raises(ValueError, match=match):
            abtest.route(bad)
    with pytest.raises(ValueError, match="between 0 and 1"):
        abtest.route("u", 50)


def test_ztest_known_values_and_scipy():
    # 45/100 vs 60/100: pooled p = 0.525, se = sqrt(.525*.475*.02) = 0.070623, z = 0.15/0.070623 = 2.1239
    t = abtest.two_proportion_ztest(45, 100, 60, 100)
    assert t.diff == pytest.approx(0.15) and t.z == pytest.approx(2.1239, abs=1e-4)
    assert t.p_value == pytest.approx(0.03367, abs=1e-4) and t.p_value < 0.05
    assert t.ci_low == pytest.approx(0.15 - 1.959964 * math.sqrt(.45 * .55 / 100 + .6 * .4 / 100), abs=1e-6)
    assert abtest.two_proportion_ztest(100, 100, 100, 100).p_value == 1.0
    scipy_stats = pytest.importorskip("scipy.stats")
    table = np.array([[45, 55], [60, 40]])
    chi2, p, _, _ = scipy_stats.chi2_contingency(table, correction=False)
    assert t.z ** 2 == pytest.approx(chi2) and t.p_value == pytest.approx(p)
    with pytest.raises(ValueError, match="correct answers, not a fraction"):
        abtest.two_proportion_ztest(0.45, 100, 60, 100)
    with pytest.raises(ValueError, match=r"n=0\): must be an integer >= 1"):
        abtest.two_proportion_ztest(0, 0, 60, 100)


def test_sample_size_textbook_values_and_power():
    # Chow, Shao & Wang, 2nd ed. 4.2: 65 % vs 85 %, alpha 0.05 two-sided, power 0.8, unpooled: n = 70 per group
    assert abtest.sample_size(0.65, 0.85, pooled=False) == 70
    # the pooled (Fleiss) form for 20 % -> 25 %: 1094 per group (by hand: 2.73433 / 0.0025 = 1093.7)
    assert abtest.sample_size(0.20, 0.25) == 1094
    assert abtest.sample_size(0.25, 0.20) == 1094  # symmetric
    n = abtest.sample_size(0.95, 0.97)
    # simulated: the z-test at that n rejects about 80 % of the time
    rng = np.random.default_rng(0)
    a, b = rng.binomial(n, 0.95, 4000), rng.binomial(n, 0.97, 4000)
    rejected = np.mean([abtest.two_proportion_ztest(int(x), n, int(y), n).p_value < 0.05
                        for x, y in zip(a, b, strict=True)])
    assert 0.77 < rejected < 0.83
    for kwargs, match in (({"p_a": 95, "p_b": 0.97}, "not 95"), ({"p_a": 0.9, "p_b": 0.9}, "no difference"),
                          ({"p_a": 0.9, "p_b": 0.95, "power": 80}, "not 80")):
        with pytest.raises(ValueError, match=match):
            abtest.sample_size(**kwargs)


def test_bootstrap_interval_covers_the_difference():
    rng = np.random.default_rng(1)
    a, b = rng.random(2000) < 0.90, rng.random(2000) < 0.94
    diff, low, high = abtest.bootstrap_diff_ci(a, b, n_boot=2000)
    t = abtest.two_proportion_ztest(int(a.sum()), 2000, int(b.sum()), 2000)
    assert diff == pytest.approx(t.diff) and low < diff < high
    assert low == pytest.approx(t.ci_low, abs=0.004) and high == pytest.approx(t.ci_high, abs=0.004)  # ~ Wald
    res = abtest.compare_groups(a, b, n_boot=2000)
    assert res.real and "the difference is real" in res.verdict()
    same = abtest.compare_groups(a[:300], (rng.random(300) < 0.90), n_boot=2000)
    assert not same.real and "not distinguishable" in same.verdict()
    with pytest.raises(ValueError, match="0/1 outcome"):
        abtest.compare_groups([0.9, 0.8], [1, 0])
    with pytest.raises(ValueError, match="at least 2"):
        abtest.bootstrap_diff_ci([1], [1, 0])


# --- drift ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return digits_data()


def test_psi_and_ks_known_values():
    assert drift.psi([1, 2, 3, 4] * 50, [1, 2, 3, 4] * 30) == pytest.approx(0.0)
    # two bins, shares 0.5/0.5 -> 0.9/0.1: 0.4 ln(1.8) + (-0.4) ln(0.2) = 0.2351 + 0.6438
    assert drift.psi([0] * 50 + [1] * 50, [0] * 90 + [1] * 10, edges=np.array([0.5])) == pytest.approx(0.87889, 1e-4)
    assert drift.ks_statistic([1, 2, 3], [1, 2, 3]) == 0.0 and drift.ks_statistic([0, 0], [1, 1]) == 1.0
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=500), rng.normal(0.4, 1.0, 300)
    scipy_stats = pytest.importorskip("scipy.stats")
    assert drift.ks_statistic(a, b) == pytest.approx(scipy_stats.ks_2samp(a, b).statistic)
    with pytest.raises(ValueError, match="NaN"):
        drift.psi([1.0, np.nan], [1.0])
    with pytest.raises(ValueError, match="no values"):
        drift.ks_statistic([], [1.0])


def test_drift_rises_on_shifted_digits_and_stays_low_on_held_out(digits):
    ref = drift.DriftReference.from_images(digits["x_train"])
    held = drift.drift_table(ref, digits["x_test"])
    assert (held["psi"] < 0.1).all() and (held["ks"] < 0.1).all() and not held[["psi_alert", "ks_alert"]].any().any()
    for kind in drift.SHIFTS:
        shifted = drift.drift_table(ref, drift.shift(digits["x_test"], kind))
        assert shifted["psi_alert"].any() and shifted["psi"].max() > 3 * held["psi"].max(), (kind, shifted)
    def mean_psi(sigma: float) -> float:
        table = drift.drift_table(ref, drift.noisy(digits["x_test"], sigma)).set_index("feature")
        return float(table.loc["mean_intensity", "psi"])

    stronger = [mean_psi(s) for s in (1, 3, 5)]
    assert stronger == sorted(stronger)  # more noise (clipped at 0: brighter images), more drift
    with pytest.raises(ValueError, match=r"\(N, 8, 8\)"):
        drift.image_features(np.zeros((3, 28, 28)))
    with pytest.raises(ValueError, match="zoom between"):
        drift.rescaled(digits["x_test"], 10)
    with pytest.raises(ValueError, match="one of"):
        drift.shift(digits["x_test"], "flipped")


def test_confidence_and_monitor_window(digits):
    logits = np.array([[10.0, 0, 0], [0, 0, 0]])
    assert drift.confidence(logits) == pytest.approx([1 / (1 + 2 * math.exp(-10)), 1 / 3])
    with pytest.raises(ValueError, match="shape"):
        drift.confidence([0.2, 0.8])
    ref = drift.DriftReference.from_images(digits["x_train"], confidences=np.full(300, 0.99))
    mon = drift.DriftMonitor(ref, window=100)
    assert mon.statistics() == {}
    mon.observe(digits["x_test"][:150], np.full(150, 0.99))
    assert mon.size() == 100 and mon.seen == 150 and mon.statistics()["confidence"]["ks"] == 0.0
    mon.observe(drift.noisy(digits["x_test"][:100], 4), np.full(100, 0.6))
    stats = mon.statistics()
    assert stats["confidence"]["ks"] == 1.0 and stats["ink_fraction"]["psi"] > drift.PSI_ALERT
    with pytest.raises(ValueError, match="one per image"):
        mon.observe(digits["x_test"][:3], [0.9])


# --- the canary's decision ------------------------------------------------------------------------------------------

GOOD = VariantMetrics(error_rate=0.0, p95_ms=20.0, accuracy=0.97, requests=100, feedback=50, mean_ms=8.0)


def both(challenger: VariantMetrics, champion: VariantMetrics = GOOD) -> dict[str, VariantMetrics]:
    return {"champion": champion, "challenger": challenger}


def test_a_healthy_challenger_is_promoted_step_by_step():
    g = Guards(checks_per_step=2)
    state, actions, weights = CanaryState(), [], []
    for _ in range(6):
        d = decide(state, both(GOOD), g)
        state = d.state
        actions.append(d.action)
        weights.append(d.weight)
    assert actions == ["hold", "promote", "hold", "promote", "done", "done"]
    assert weights == [10, 50, 50, 100, 100, 100] and state.status == "promoted"
    assert decide(CanaryState(steps=(100,)), both(GOOD), Guards(checks_per_step=1)).state.status == "promoted"


@pytest.mark.parametrize("chall, alert", [
    (replace(GOOD, error_rate=0.05), "CanaryErrors"),
    (replace(GOOD, error_rate=0.008), "CanaryErrors"),  # delta
    (replace(GOOD, p95_ms=150), "CanaryLatency"),  # SLO
    (replace(GOOD, mean_ms=16.5), "CanaryLatency"),  # 2 x the champion's mean over the window
    (replace(GOOD, p95_ms=150, mean_ms=math.nan), "CanaryLatency"),  # SLO, no comparison yet
    (replace(GOOD, accuracy=0.88), "CanaryAccuracy"),
])
def test_a_tripped_guard_rolls_back(chall, alert):
    state = CanaryState(step=1, healthy=1)
    d = decide(state, both(chall))
    assert (d.action, d.alert, d.weight, d.state.status) == ("rollback", alert, 0, "rolled_back")
    assert decide(d.state, both(GOOD)).action == "done"


def test_latency_against_the_champion_is_the_windows_mean_and_no_step_is_taken_without_it():
    # a p95 three times the champion's is not compared (a summary over each server's own last 60 s): the SLO only
    assert decide(CanaryState(), both(replace(GOOD, p95_ms=60))).action == "hold"
    assert decide(CanaryState(healthy=1), both(replace(GOOD, p95_ms=60))).action == "promote"
    # the mean: over max(1.5 x the champion's, the floor); a fast champion's 1.5 x is under the floor
    assert decide(CanaryState(), both(replace(GOOD, mean_ms=12.1))).alert == "CanaryLatency"
    assert decide(CanaryState(), both(replace(GOOD, mean_ms=11.9))).action == "hold"
    fast = replace(GOOD, mean_ms=2.0)
    assert decide(CanaryState(healthy=1), both(replace(GOOD, mean_ms=4.9), fast)).action == "promote"
    assert decide(CanaryState(), both(replace(GOOD, mean_ms=5.1), fast)).alert == "CanaryLatency"
    assert decide(CanaryState(), both(replace(GOOD, mean_ms=5.1), fast), Guards(latency_floor_ms=6)).action == "hold"
    # no comparison yet (a mean NaN: the window holds the last step's traffic): a hold that breaks the streak and is
    # no lack of evidence (idle back to 0, never CanaryNoTraffic)
    for chall, champ in ((replace(GOOD, mean_ms=math.nan), GOOD), (GOOD, replace(GOOD, mean_ms=math.nan))):
        d = decide(CanaryState(healthy=1, idle=3), both(chall, champ), Guards(max_idle_checks=4))
        assert (d.action, d.state.healthy, d.state.idle) == ("hold", 0, 0) and "no latency comparison" in d.reason
    with pytest.raises(ValueError, match="max_latency_ratio"):
        Guards(max_latency_ratio=0.5)


def test_short_evidence_holds_then_rolls_back_as_no_traffic():
    g = Guards(min_requests=20, max_idle_checks=3)
    few = VariantMetrics(error_rate=1.0, p95_ms=900, accuracy=0.0, requests=3, feedback=3)  # 3 requests: no verdict
    state = CanaryState()
    d1 = decide(state, both(few), g)
    assert d1.action == "hold" and "waiting for evidence" in d1.reason and d1.weight == 10
    d2 = decide(d1.state, both(few), g)
    d3 = decide(d2.state, both(few), g)
    assert (d3.action, d3.alert) == ("rollback", "CanaryNoTraffic")
    nan = VariantMetrics()
    assert decide(state, both(nan, nan), g).action == "hold"
    # accuracy counts only with enough labelled answers: 5 wrong ones decide nothing
    assert decide(state, both(VariantMetrics(0.0, 20, 0.0, 100, 5, 8.0)), Guards(min_feedback=20)).action == "hold"
    # a healthy check after an idle one starts counting again
    assert decide(d1.state, both(GOOD), Guards(checks_per_step=1)).action == "promote"


def test_decide_is_pure_and_checks_its_inputs():
    state = CanaryState()
    assert decide(state, both(GOOD)) == decide(state, both(GOOD)) and state == CanaryState()
    assert decide(state, {"champion": GOOD, "challenger": {"error_rate": 0.5, "requests": 100}}).alert == "CanaryErrors"
    with pytest.raises(ValueError, match="keys 'champion' and 'challenger'"):
        decide(state, {"a": GOOD, "b": GOOD})
    with pytest.raises(ValueError, match="increasing whole percentages ending at 100"):
        CanaryState(steps=(10, 50))
    with pytest.raises(ValueError, match="0.01 is 1 %"):
        Guards(max_error_rate=5)
    with pytest.raises(ValueError, match="PromQL duration"):
        render_queries(window="30")
    q = render_queries("1m", model="m", by="instance")
    assert 'nv_inference_request_failure{model="m"}[1m]' in q["error_rate"] and "by (instance)" in q["p95_ms"]
    assert 'rate(nv_inference_request_duration_us{model="m"}[1m])' in q["mean_ms"] and "by (instance)" in q["mean_ms"]
    assert window_seconds("500ms") == 0.5 and window_seconds("15s") == 15 and window_seconds("2m") == 120


def test_lifecycle_map_points_to_labs():
    df = lifecycle.lifecycle_map()
    assert list(df.columns) == list(lifecycle.COLUMNS) and len(df) >= 8
    assert {"data preparation", "training", "optimization", "deployment", "monitoring and operations"} <= set(df.stage)
    text = " ".join(df["NVIDIA at scale"])
    for tool in ("RAPIDS", "DALI", "NeMo Curator", "NeMo", "TensorRT", "Dynamo-Triton", "NIM", "DCGM", "Run:ai"):
        assert tool in text
    common = " ".join(df["common tool"])
    for tool in ("Spark", "Kubeflow", "KServe", "Weights & Biases"):
        assert tool in common
    assert df["lab"].str.fullmatch(r"\d\d(, \d\d)*").all()
