"""The exercise framework: blanks, the code-exercise machinery (running the student's function, its own traceback
line, time limits, not applicable on this tier), outcomes, normalizers, and how hints and solutions are shown."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _exercise_harness import check

from lab_utils.exercises import framework, lab00, lab01, student
from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    NotApplicable,
    Status,
    Wrong,
    is_blank,
    run_student,
    student_frame,
)


def test_placeholder_functions_are_not_attempted():
    # What the generated lab leaves for a function exercise: a stub whose body is `...` or `pass`, perhaps
    # with a docstring and a comment.
    def cuda_verdict(driver_ceiling, runtime, datacenter_gpu): ...

    def matmul_tflops(n, device, timer):
        pass

    def cuda_ceiling(smi_text: str) -> str:
        """The newest CUDA this driver supports."""
        ...  # YOUR CODE HERE

    assert check(lab00.q5, cuda_verdict).status is Status.NOT_ATTEMPTED
    assert check(lab01.q2, matmul_tflops).status is Status.NOT_ATTEMPTED
    assert check(lab00.q2, cuda_ceiling).status is Status.NOT_ATTEMPTED
    assert check(lab00.q2, lambda text: None).status is Status.NOT_ATTEMPTED  # a lambda returning None is a stub too


# --- the framework's code-exercise machinery --------------------------------------------------------------


def test_run_student_returns_the_result_and_checks_its_kind():
    assert run_student(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(Wrong, match=r"f\(\) returned None \(NoneType\) \(does it end with `return \.\.\.`\?\); "
                                    "expected a number"):
        run_student(lambda: None, call="f()", returns=(int, float), returns_text="a number")
    with pytest.raises(Wrong, match="returned True"):
        run_student(lambda: True, call="f()", returns=(int, float), returns_text="a number")


def test_run_student_shows_the_students_line_not_ours():
    def students(x):
        y = x - x
        return x / y  # the line to show

    with pytest.raises(Wrong) as info:
        run_student(students, 1.0, what="ratio")
    message = str(info.value)
    assert message.startswith("ratio(1.0) raised ZeroDivisionError: float division by zero")
    assert "line" in message and "of `students`: `return x / y  # the line to show`" in message
    assert "lab_utils" not in message and "framework.py" not in message


def test_run_student_through_a_library_names_the_students_call():
    def students():
        return torch.ones(2) @ torch.ones(3)  # raises inside torch

    with pytest.raises(Wrong) as info:
        run_student(students, call="students()")
    assert "raised RuntimeError" in str(info.value) and "torch.ones(2) @ torch.ones(3)" in str(info.value)


def spin_forever():
    n = 0
    while True:
        n += 1


def test_run_student_time_limit_in_the_main_thread():
    t0 = time.perf_counter()
    with pytest.raises(Wrong) as info:
        run_student(spin_forever, call="spin_forever()", timeout_s=0.3)
    assert time.perf_counter() - t0 < 5
    message = str(info.value)
    assert "did not return within 0.3 s" in message and "of `spin_forever`" in message


def test_run_student_time_limit_restores_an_outer_timer():
    import signal

    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        assert run_student(lambda: 7, timeout_s=1) == 7
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25 < remaining <= 30 and signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_run_student_time_limit_in_another_thread():
    box = {}

    def grade():
        try:
            run_student(spin_forever, call="spin_forever()", timeout_s=0.3)
        except Wrong as why:
            box["why"] = str(why)

    t = threading.Thread(target=grade)
    t.start()
    t.join(10)
    assert "did not return within 0.3 s" in box["why"] and "spin_forever" in box["why"]
    deadline = time.monotonic() + 5
    while any(th.name.startswith("student") for th in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [th for th in threading.enumerate() if th.name.startswith("student")]  # interrupted, gone


def test_run_student_lets_the_graders_own_verdicts_through():
    def calls_back(report):
        report()

    def reject():
        raise Wrong("the grader's own message")

    with pytest.raises(Wrong, match="^the grader's own message$"):
        run_student(calls_back, reject)


def test_student_frame_reads_a_remote_traceback():
    # What lab_utils.distributed.spawn.WorkerError.remote_traceback carries from a rank.
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{lab01.__file__}", line 190, in _worker\n'
        "    result = fn(ctx, **kwargs)\n"
        '  File "/tmp/ipykernel_1234/2764.py", line 4, in allreduce_worker\n'
        "    dist.all_reduce(buf, op=dist.ReduceOp.SUM)\n"
        '  File "/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py", line 81, in wrapper\n'
        "    return func(*args, **kwargs)\n"
        "RuntimeError: Connection closed by peer\n"
    )
    frame = student_frame(text)
    assert frame is not None and frame.lineno == 4 and frame.function == "allreduce_worker"
    assert str(frame) == "line 4 of `allreduce_worker`: `dist.all_reduce(buf, op=dist.ReduceOp.SUM)`"
    assert student_frame("no traceback here") is None


def test_is_blank():
    def stub_with_doc(x):
        """Docstring."""
        ...

    def real(x):
        return x

    assert is_blank(None) and is_blank(...) and is_blank(stub_with_doc) and is_blank(lambda: None)
    assert not is_blank(real) and not is_blank(0) and not is_blank("") and not is_blank(print)


def test_not_applicable_from_a_grader_and_from_applicable():
    def grade(value):
        raise NotApplicable("needs two GPUs; this machine has one")

    out = Exercise("x.1", "answer", grade).check(5, quiet=True)
    assert out.status is Status.NOT_APPLICABLE and str(out) == (
        "[n/a] x.1: not applicable on this tier. needs two GPUs; this machine has one")
    ex = CodeExercise("x.2", "fn", lambda fn: fn(), signature="fn()", applicable=lambda: "no GPU here.")
    assert ex.check(lambda: 1, quiet=True).message == "no GPU here. Your `fn` was not run."
    ex = CodeExercise("x.3", "fn", lambda fn: None, signature="fn()", applicable=lambda: None)
    assert ex.check(lambda: 1, quiet=True).correct


def test_accepted_is_the_last_correct_answer_and_none_otherwise():
    def grade(v):
        if v != 3:
            raise Wrong("not 3")

    ex = Exercise("x.5", "v", grade)
    assert ex.accepted is None
    ex.check(None, quiet=True)  # blank
    assert ex.accepted is None
    ex.check(3, quiet=True)
    assert ex.accepted == 3
    ex.check(4, quiet=True)  # a later wrong answer withdraws it: a later cell must not run an answer now refused
    assert ex.accepted is None


def test_a_grader_note_is_added_to_correct():
    ex = Exercise("x.4", "v", lambda v: "measured 3 ms.")
    assert ex.check(1, quiet=True).message == "`v` = 1. measured 3 ms."


def test_normalizers():
    assert framework.version("13") == framework.version("v13.0") == (13, 0)
    with pytest.raises(Wrong, match="major.minor"):
        framework.version("thirteen")
    with pytest.raises(Wrong, match="string"):
        framework.version(True)
    assert framework.fraction("85%") == pytest.approx(0.85) and framework.fraction(" 85 % ") == pytest.approx(0.85)
    assert framework.fraction("0.85") == framework.fraction(0.85) == 0.85
    with pytest.raises(Wrong, match="fraction"):
        framework.fraction("most")
    assert framework.choice(" Memory_Bound ", ["memory bound", "compute"]) == "memory bound"
    assert framework.choice("bandwidth-bound", ["memory"], {"memory": ["bandwidth bound"]}) == "memory"
    assert framework.choice("it is memory bound", ["memory bound"]) is None  # a whole answer, not a word in one
    assert framework.choice(3, ["memory"]) is None


def test_students_frames_and_shipping_share_one_library_test():
    from lab_utils.distributed import ranks

    assert student.is_library_file is ranks.is_library_file
    assert not student._is_students(framework.__file__) and not student._is_students(threading.__file__)
    assert student._is_students("<ipython-input-3>") and not student._is_students("<frozen runpy>")
    assert student._is_students(__file__)


def test_check_prints_outcome(capsys):
    out = lab00.q6.check(18)
    assert out.correct
    assert "[ok]" in capsys.readouterr().out


def test_a_hint_or_solution_ending_a_cell_is_shown_once(capsys):
    # hint() prints and returns its text; IPython shows a cell's last value too, so a plain str came out twice.
    from IPython.core.formatters import DisplayFormatter

    ex = Exercise("00.9 demo", "answer", lambda v: None, hints=["the first step"], solution_text="answer = 1")
    for show in (ex.hint, ex.solution):
        shown = show()
        assert isinstance(shown, str) and capsys.readouterr().out == shown + "\n"  # printed once, still returned
        assert DisplayFormatter().format(shown) == ({}, {})  # and not shown again as the cell's value


@pytest.mark.parametrize(("text", "want"), [
    ("the model's output is named 'OUTPUT__0'.", "The model's output is named 'OUTPUT__0'."),
    ("is the client the one for this endpoint?", "Is the client the one for this endpoint?"),
    ("a step", "A step"),
    ("load_model's config= takes JSON text", "load_model's config= takes JSON text"),
    ("x is float32 and the model's INPUT__0 is TYPE_FP32", "x is float32 and the model's INPUT__0 is TYPE_FP32"),
    ("config= takes the configuration as JSON", "config= takes the configuration as JSON"),
    ("`logger = trt.Logger(...)`", "`logger = trt.Logger(...)`"),
])
def test_a_message_starting_with_a_code_name_keeps_its_case(text, want):
    assert framework.sentence(text) == want
