"""Lab 02's exercise checks against a right, a wrong and a blank answer; the specific messages; hints and
solutions; the exported constants and the reference busbw factor."""

from __future__ import annotations

import ast
import copy

import pytest
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab02
from lab_utils.exercises.framework import Exercise, Status

# --- answers ---------------------------------------------------------------------------------------


def factor_right(collective, n):
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def factor_no_two(collective, n):
    return 1.0 if collective in ("broadcast", "reduce") else (n - 1) / n


def factor_two_everywhere(collective, n):
    return 1.0 if collective in ("broadcast", "reduce") else 2 * (n - 1) / n


def factor_no_over_n(collective, n):
    return 2 * (n - 1) if collective == "all_reduce" else (n - 1)


def factor_floor_division(collective, n):
    if collective == "all_reduce":
        return 2 * (n - 1) // n
    return (n - 1) // n if collective != "broadcast" and collective != "reduce" else 1


def factor_broadcast_wrong(collective, n):
    return factor_right(collective, n) if collective not in ("broadcast", "reduce") else (n - 1) / n


def factor_no_all_to_all(collective, n):
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}[collective]


_MS = lab02.Q2_PARAMS * lab02.Q2_BYTES_PER_PARAM * 2 * (lab02.Q2_RANKS - 1) / lab02.Q2_RANKS \
    / (lab02.Q2_BUSBW_GBPS * 1e9) * 1e3  # 3.603

# (exercise, right answers, wrong answers)
CASES = [
    (lab02.q1, [factor_right, lab02.reference_busbw_factor],
     [factor_no_two, factor_two_everywhere, factor_floor_division, factor_broadcast_wrong, 1.75]),
    (lab02.q2, [_MS, 3.6, 3.55, "3.6"], [_MS / 1.75, _MS * 2, _MS / 1e3, 10.0, "fast"]),
    (lab02.q3, ["set_epoch", "sampler.set_epoch(epoch)", " SET_EPOCH "],
     ["no_sync", "all_reduce the metric", "barrier", "zero_grad", "shuffle", 3]),
    (lab02.q4, [0.85, 10200 / 12000, 0.8503], [0.8175, 0.92, 3.27, 85, 10200, 0.5, "0.85%"]),
    (lab02.q5, ["NCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME=eth1", "export NCCL_SOCKET_IFNAME=eth1",
                "nccl_socket_ifname = 'eth1'", "NCCL_SOCKET_IFNAME==eth1"],
     ["NCCL_IB_HCA", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG=INFO", "NCCL_P2P_DISABLE=1",
      "NCCL_SOCKET_IFNAME=eth0", "NCCL_SOCKET_IFNAME=^eth0", "GLOO_SOCKET_IFNAME", 42]),
]


(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_placeholder_function_is_not_attempted():
    def busbw_factor(collective, n): ...

    def busbw_factor_pass(collective, n):
        pass

    assert check(lab02.q1, busbw_factor).status is Status.NOT_ATTEMPTED
    assert check(lab02.q1, busbw_factor_pass).status is Status.NOT_ATTEMPTED


def test_cases_cover_every_exercise():
    assert {id(ex) for ex, *_ in CASES} == {id(ex) for ex in exercises_of(lab02)}


# --- q1: busbw factor -------------------------------------------------------------------------------


def test_q1_reports_first_failing_case_with_expected_and_reason():
    message = check(lab02.q1, factor_no_two).message
    assert "busbw_factor('all_reduce', 8) returned 0.875, expected 1.75" in message
    assert "reduce-scatter" in message and "all-gather" in message and "twice" in message


def test_q1_two_only_for_all_reduce():
    message = check(lab02.q1, factor_two_everywhere).message
    assert "busbw_factor('all_gather', 8) returned 1.75, expected 0.875" in message
    assert "only all_reduce" in message


def test_q1_missing_over_n_and_floor_division():
    assert "/n is missing" in check(lab02.q1, factor_no_over_n).message
    message = check(lab02.q1, factor_floor_division).message
    assert "integer division" in message and "busbw_factor('all_reduce', 8) returned 1" in message


def test_q1_broadcast_and_one_rank():
    message = check(lab02.q1, factor_broadcast_wrong).message
    assert "busbw_factor('broadcast', 8) returned 0.875, expected 1" in message and "factor 1" in message

    def no_zero_for_one_rank(collective, n):
        return factor_right(collective, n) if n > 1 else 1.0

    message = check(lab02.q1, no_zero_for_one_rank).message
    assert "busbw_factor('all_reduce', 1) returned 1, expected 0" in message
    assert "nothing crosses a link" in message


def test_q1_wrong_kinds_and_raising():
    out = check(lab02.q1, 1.75)
    assert out.status is Status.INCORRECT and "function" in out.message
    out = check(lab02.q1, factor_no_all_to_all)
    assert out.status is Status.INCORRECT
    assert "busbw_factor('all_to_all', 4) raised KeyError" in out.message and "all_to_all" in out.message

    def forgot_return(collective, n):
        factor = 2 * (n - 1) / n  # noqa: F841 (the mistake under test)

    assert "returned None" in check(lab02.q1, forgot_return).message
    assert "number" in check(lab02.q1, lambda c, n: "1.75").message
    out = check(lab02.q1, lambda collective: 1.0)
    assert out.status is Status.INCORRECT and "raised TypeError" in out.message


def test_q1_accepts_numpy_and_int_results():
    np = pytest.importorskip("numpy")
    assert check(lab02.q1, lambda c, n: np.float64(factor_right(c, n))).correct
    assert check(lab02.q1, lambda c, n: 1 if c in ("broadcast", "reduce") else factor_right(c, n)).correct


def test_reference_busbw_factor_values_and_errors():
    f = lab02.reference_busbw_factor
    assert f("all_reduce", 8) == 1.75 and f("all_reduce", 2) == 1.0 and f("all_reduce", 1) == 0.0
    assert f("all_gather", 8) == f("reduce_scatter", 8) == f("all_to_all", 8) == 0.875
    assert f("broadcast", 8) == f("reduce", 4) == 1.0
    assert f("allreduce", 4) == f("All-Reduce", 4) == f("alltoall", 4) * 2 == 1.5
    with pytest.raises(ValueError, match="all_reduce, reduce_scatter, all_gather, all_to_all, broadcast"):
        f("all_sum", 8)
    for bad_n in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="ranks"):
            f("all_reduce", bad_n)
    assert set(lab02.COLLECTIVES) == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                      "broadcast", "reduce"}


# --- q2: all-reduce time -------------------------------------------------------------------------------


def test_q2_constants_and_expected_value():
    assert (lab02.Q2_PARAMS, lab02.Q2_BYTES_PER_PARAM, lab02.Q2_RANKS, lab02.Q2_BUSBW_GBPS) == (
        350_000_000, 2, 8, 340.0)
    assert _MS == pytest.approx(3.6029, rel=1e-4)
    assert check(lab02.q2, _MS * 1.019).correct and not check(lab02.q2, _MS * 1.03).correct


def test_q2_specific_messages():
    assert "factor is missing" in check(lab02.q2, _MS / 1.75).message
    assert "(n-1)/n, one phase" in check(lab02.q2, _MS / 2).message
    assert "fp32" in check(lab02.q2, _MS * 2).message
    assert "fp32" in check(lab02.q2, _MS * 2 / 1.75).message  # fp32 and no factor
    assert "seconds" in check(lab02.q2, _MS / 1e3).message
    assert "microseconds" in check(lab02.q2, _MS * 1e3).message
    assert "GiB" in check(lab02.q2, _MS * 1e9 / 2**30).message
    assert "GiB" in check(lab02.q2, _MS * 2**30 / 1e9).message
    assert "divided by the factor" in check(lab02.q2, _MS / 1.75**2).message
    assert "/n is missing" in check(lab02.q2, _MS * 8).message
    message = check(lab02.q2, 10.0).message
    assert "too high" in message and "3.6" not in message  # the answer is not given away
    assert "number" in check(lab02.q2, "fast").message


# --- q3: the bug in a DDP loop -----------------------------------------------------------------------------


def test_q3_loop_has_exactly_the_one_bug():
    tree = ast.parse(lab02.BUGGY_LOOP)  # valid Python
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert "set_epoch" not in calls
    assert {"zero_grad", "backward", "step", "all_reduce"} <= calls  # the other choices are not missing
    assert "DistributedSampler" in lab02.BUGGY_LOOP and "no_sync" not in lab02.BUGGY_LOOP
    fixed = lab02.BUGGY_LOOP.replace("        model.train()\n",
                                     "        sampler.set_epoch(epoch)\n        model.train()\n")
    assert fixed != lab02.BUGGY_LOOP
    ast.parse(fixed)
    assert set(lab02.Q3_CHOICES) == {"set_epoch", "no_sync", "all_reduce the metric", "barrier", "zero_grad"}


def test_q3_why_not_each_wrong_choice():
    assert "gradient accumulation" in check(lab02.q3, "no_sync").message
    assert "already reduced" in check(lab02.q3, "all_reduce the metric").message
    assert "already reduced" in check(lab02.q3, "dist.all_reduce(total)").message
    assert "keeps the ranks in step" in check(lab02.q3, "barrier").message
    assert "top of every step" in check(lab02.q3, "zero_grad").message
    messages = {check(lab02.q3, c).message for c in lab02.Q3_CHOICES if c != "set_epoch"}
    assert len(messages) == len(lab02.Q3_CHOICES) - 1  # a message of its own for each


def test_q3_unknown_and_several_choices():
    assert "one of" in check(lab02.q3, "shuffle").message
    assert "one of" in check(lab02.q3, 3).message
    out = check(lab02.q3, "set_epoch and zero_grad")
    assert out.status is Status.INCORRECT and "one fix" in out.message


# --- q4: un-averaged metrics ---------------------------------------------------------------------------------


def test_q4_data_has_unequal_counts_and_integral_correct():
    samples = [r["samples"] for r in lab02.Q4_RANK_ACCURACIES]
    assert len(set(samples)) > 1
    for r in lab02.Q4_RANK_ACCURACIES:
        assert (r["accuracy"] * r["samples"]) == pytest.approx(round(r["accuracy"] * r["samples"]))
    correct = sum(r["accuracy"] * r["samples"] for r in lab02.Q4_RANK_ACCURACIES)
    assert correct / sum(samples) == pytest.approx(0.85)


def test_q4_specific_messages():
    accs = [r["accuracy"] for r in lab02.Q4_RANK_ACCURACIES]
    assert "plain mean" in check(lab02.q4, sum(accs) / len(accs)).message
    assert "plain mean" in check(lab02.q4, 0.818).message  # rounded
    assert "rank 0" in check(lab02.q4, accs[0]).message
    assert "sum of the accuracies" in check(lab02.q4, sum(accs)).message
    assert "percentage" in check(lab02.q4, 85).message
    assert "correct predictions" in check(lab02.q4, 10200).message
    message = check(lab02.q4, 0.5).message
    assert "too low" in message and "0.85" not in message
    assert "number" in check(lab02.q4, "0.85%").message


def test_q4_grader_ignores_a_mutated_table():
    table = copy.deepcopy(lab02.Q4_RANK_ACCURACIES)
    try:
        lab02.Q4_RANK_ACCURACIES[0]["samples"] = 1  # a student's cell may change the shared dicts
        assert check(lab02.q4, 0.85).correct
    finally:
        for row, saved in zip(lab02.Q4_RANK_ACCURACIES, table, strict=True):
            row.update(saved)


# --- q5: NCCL variable ------------------------------------------------------------------------------------------


def test_q5_scenario_and_choices():
    assert "eth1" in lab02.Q5_SCENARIO and "eth0" in lab02.Q5_SCENARIO and "hang" in lab02.Q5_SCENARIO
    assert lab02.Q5_CHOICES == ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG",
                                "NCCL_P2P_DISABLE")


def test_q5_what_each_wrong_variable_does():
    assert "InfiniBand" in check(lab02.q5, "NCCL_IB_HCA").message
    assert "algorithm" in check(lab02.q5, "NCCL_ALGO=Ring").message
    assert "protocol" in check(lab02.q5, "NCCL_PROTO").message
    assert "logs" in check(lab02.q5, "NCCL_DEBUG=INFO").message
    assert "GPU-to-GPU" in check(lab02.q5, "NCCL_P2P_DISABLE=1").message
    messages = {check(lab02.q5, c).message for c in lab02.Q5_CHOICES[1:]}
    assert len(messages) == len(lab02.Q5_CHOICES) - 1


def test_q5_values_of_the_right_variable():
    assert "not the network" in check(lab02.q5, "NCCL_SOCKET_IFNAME=eth0").message
    assert "not the network" in check(lab02.q5, "NCCL_SOCKET_IFNAME=docker0").message
    assert "replaces" in check(lab02.q5, "NCCL_SOCKET_IFNAME=^eth0").message
    assert "prefix" in check(lab02.q5, "NCCL_SOCKET_IFNAME=eth").message
    assert "no interface" in check(lab02.q5, "NCCL_SOCKET_IFNAME=ens5").message
    assert "one of" in check(lab02.q5, "GLOO_SOCKET_IFNAME").message
    assert "one of" in check(lab02.q5, 42).message


# --- hints, solutions, completeness ----------------------------------------------------------------


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab02)
    assert len(exercises) >= 4
    names = sorted(k for k, v in vars(lab02).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for exercise in exercises:
        assert exercise.name.startswith("02.")
        assert 2 <= len(exercise.hints) <= 3, exercise.name
        assert all(h.strip() for h in exercise.hints), exercise.name
        assert exercise.solution_text.strip(), exercise.name


@pytest.mark.parametrize("exercise", exercises_of(lab02), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise):
    # Each solution is code a student could paste: run it beside the lab's constants, then check.
    namespace = {k: getattr(lab02, k) for k in lab02.__all__}
    exec(exercise.solution_text, namespace)
    assert check(exercise, namespace[exercise.var]).correct



test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab02))


def test_all_exports_exist():
    for name in lab02.__all__:
        assert hasattr(lab02, name), name
