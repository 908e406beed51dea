"""An answer that hands its work to a reference implementation is refused, in one line naming it and the fix.

For every lab with code exercises (00-08) and every reference its exercises name: a wrapper that calls it,
and the reference itself, are refused before the check does anything expensive (no server, no rank, no grader
run); a call the static walk cannot see (a name built at run time) is refused while the check runs. The solution
notebooks' ``# BEGIN SOLUTION`` code is never refused, and where its check is cheap it still passes.
"""

from __future__ import annotations

import copy
import functools
import importlib
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
from _exercise_harness import as_written, solution_functions, student_function

from lab_utils.exercises.course_objects import _identifiable
from lab_utils.exercises.framework import CodeExercise, Exercise, Outcome, Status, lab_references

LABS = ("00", "01", "02", "03", "04", "05", "06", "07", "08")
MODULES = {lab: importlib.import_module(f"lab_utils.exercises.lab{lab}") for lab in LABS}
INVENTORY_PARTS = ("nvml_inventory", "smi_inventory")  # 00.3 grades one of two functions: InventoryExercise
# A refusal comes from reading the answer, not running it: well under the seconds a graded run takes. Generous, so
# that a loaded CI machine (four workers on two cores took 8.6 s for one) does not fail it; the message is the proof.
FAST_S = 10.0


# "labNN.var" -> the references its exercise names beside itself
REFERENCES = {f"lab{lab}.{var}": row for lab in LABS for var, row in lab_references(MODULES[lab]).items()}


def exercise_of(lab: str, var: str) -> Exercise | None:
    """The exercise of ``lab`` whose answer is ``var`` (00.3's two functions: q3)."""
    module = MODULES[lab]
    if var in INVENTORY_PARTS:
        return module.q3
    return next((e for k, e in vars(module).items() if isinstance(e, Exercise) and not k.startswith("_")
                 and e.var == var), None)


def is_code(lab: str, var: str) -> bool:
    return isinstance(exercise_of(lab, var), CodeExercise)


def check(lab: str, var: str, answer: Any) -> Outcome:
    if var in INVENTORY_PARTS:
        return MODULES[lab].q3.check(**{var: answer}, quiet=True)
    return exercise_of(lab, var).check(answer, quiet=True)


def must_not_run(*_: Any) -> None:
    raise AssertionError("the grader ran: the refusal should have come first")


def probe(lab: str, var: str) -> CodeExercise:
    """A code exercise with ``var``'s references whose grader and applicability must never be consulted."""
    part = CodeExercise(f"{lab} {var}", var, must_not_run, signature=f"{var}(...)", applicable=must_not_run,
                        references=REFERENCES.get(f"lab{lab}.{var}"))
    part.lab = MODULES[lab].__name__
    return part


ROWS = [(key, row) for key, row in REFERENCES.items()]
CODE_ROWS = [(key, row) for key, row in ROWS if is_code(key[3:5], key.partition(".")[2])]
TARGETS = [(key, target, row.fix) for key, row in CODE_ROWS for target in row.targets]


def split(target: str) -> tuple[types.ModuleType, list[str]]:
    """The module a dotted name lives in (imported) and the attributes after it."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ImportError:
            continue
    raise AssertionError(f"{target}: no importable module")


def resolve(target: str) -> Any:
    obj, attrs = split(target)
    for name in attrs:
        obj = getattr(obj, name)
    return obj


def wrapper(var: str, target: str) -> Callable[..., Any]:
    """``def var(*args, **kwargs): return module.attr(*args, **kwargs)``: the wrapper a student might write."""
    module, attrs = split(target)
    source = f"def {var}(*args, **kwargs):\n    return lib.{'.'.join(attrs)}(*args, **kwargs)\n"
    return student_function(source, var, {"lib": module})


def one_line_refusal(out: Outcome, target: str, fix: str, verb: str = "calls") -> None:
    text = str(out)
    assert out.status is Status.INCORRECT, text
    assert "\n" not in text, text
    assert f"your answer {verb} {target}" in out.message, text
    assert text.endswith(fix), text


# --- the registry -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lab", LABS)
def test_every_public_reference_is_registered_and_resolves(lab):
    module = MODULES[lab]
    named = {t for row in REFERENCES.values() for t in row.targets}
    public = [f"{module.__name__}.{n}" for n in module.__all__ if n.startswith("reference_")]
    assert set(public) <= named, set(public) - named
    for key, row in ROWS:
        if key.startswith(f"lab{lab}."):
            var = key.partition(".")[2]
            assert exercise_of(lab, var) is not None, f"{key}: no exercise answers {var!r}"
            assert row.fix and not row.fix.endswith("."), key
            for target in row.targets:
                assert callable(resolve(target)), target
    if lab == "00":  # a reference without the reference_ prefix, called by the lab's later cells
        assert f"{module.__name__}.cuda_verdict" in named


@pytest.mark.parametrize("lab", LABS)
def test_every_code_exercise_is_guarded(lab):
    """Each code exercise of the lab has its row (04.2 and 04.8 have no reference implementation to call)."""
    unguarded = {"deploy_model", "batch_and_queue"} if lab == "04" else set()
    module = MODULES[lab]
    for exercise in vars(module).values():
        if not isinstance(exercise, CodeExercise) or exercise.var in unguarded:
            continue
        answers = INVENTORY_PARTS if lab == "00" and exercise is module.q3 else (exercise.var,)
        for var in answers:
            assert f"lab{lab}.{var}" in REFERENCES, (lab, var)


@pytest.mark.parametrize("lab", LABS)
def test_every_code_exercise_belongs_to_its_lab_module(lab):
    """A lab split into a package (lab 02's ``training``, ``bench``...) is one lab: its exercises' siblings and
    unnamed ``reference_*`` are the package's, and a reference is named as the notebook reaches it."""
    module = MODULES[lab]
    for exercise in vars(module).values():
        if isinstance(exercise, CodeExercise):
            assert exercise.lab == module.__name__, (exercise.name, exercise.lab)
            targets = exercise.references.targets if exercise.references else ()
            # lab_utils.exercises.lab02.reference_train_ddp, never ....lab02.training.reference_train_ddp
            assert [t for t in targets if t.startswith(f"{module.__name__}.")
                    and t.count(".") != module.__name__.count(".") + 1] == [], targets


# --- refused, before anything runs --------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "target", "fix"), TARGETS, ids=[f"{k}:{t.rpartition('.')[2]}" for k, t, _ in TARGETS])
def test_a_wrapper_is_refused_at_once(key, target, fix):
    lab, var = key[3:5], key.partition(".")[2]
    answer = wrapper(var, target)
    t0 = time.perf_counter()
    out = check(lab, var, answer)
    assert time.perf_counter() - t0 < FAST_S
    one_line_refusal(out, target, fix)
    assert "(line 2 of `" in out.message  # where the answer makes the call
    # The refusal comes before the grader and before applicability (a server, ranks, a GPU): neither is consulted.
    one_line_refusal(probe(lab, var).check(answer, quiet=True), target, fix)


@pytest.mark.parametrize(("key", "target", "fix"), TARGETS, ids=[f"{k}:{t.rpartition('.')[2]}" for k, t, _ in TARGETS])
def test_the_reference_itself_is_refused(key, target, fix):
    lab, var = key[3:5], key.partition(".")[2]
    ref = resolve(target)
    # Named where it is defined when that name is registered too (ExerciseModel.execute is TritonPythonModel's).
    own = f"{ref.__module__}.{ref.__qualname__}"
    named = own if own in REFERENCES[key].targets else target
    one_line_refusal(check(lab, var, ref), named, fix, verb="is")
    one_line_refusal(probe(lab, var).check(functools.partial(ref), quiet=True), named, fix)


def answer_cell(source: str, name: str, **names: Any) -> Any:
    return student_function(source, name, dict(names))


def test_every_way_of_reaching_a_reference_is_seen_without_running_it():
    import lab_utils.exercises.lab00 as ex

    fix = REFERENCES["lab00.cuda_verdict"].fix
    target = "lab_utils.exercises.lab00.cuda_verdict"
    answers = {
        "an import inside": answer_cell(
            "def f(a, b, c):\n    from lab_utils.exercises.lab00 import cuda_verdict as v\n    return v(a, b, c)\n",
            "f"),
        "a module imported inside": answer_cell(
            "def f(a, b, c):\n    import lab_utils.exercises.lab00 as m\n    return m.cuda_verdict(a, b, c)\n", "f"),
        "a default": answer_cell("def f(a, b, c, rule=ex.cuda_verdict):\n    return rule(a, b, c)\n", "f", ex=ex),
        "a helper": answer_cell(
            "def helper(*a):\n    return ex.cuda_verdict(*a)\n\ndef f(*a):\n    return helper(*a)\n", "f", ex=ex),
        "a closure": answer_cell("def make(rule):\n    def f(*a):\n        return rule(*a)\n    return f\n",
                                 "make")(ex.cuda_verdict),
        "a lambda": answer_cell("f = lambda *a: ex.cuda_verdict(*a)\n", "f", ex=ex),
        "a comprehension": answer_cell("def f(*a):\n    return [ex.cuda_verdict(*a) for _ in range(1)][0]\n", "f",
                                       ex=ex),
        "a callable object": answer_cell(
            "class Rule:\n    def __call__(self, *a):\n        return ex.cuda_verdict(*a)\n\nf = Rule()\n", "f", ex=ex),
        "a subclass's method": answer_cell(
            "class Rule:\n    impl = staticmethod(ex.cuda_verdict)\n    def __call__(self, *a):\n"
            "        return self.impl(*a)\n\nf = Rule()\n", "f", ex=ex),
        "a table of functions": answer_cell("RULES = {'v': ex.cuda_verdict}\n\ndef f(*a):\n    return RULES['v'](*a)\n",
                                            "f", ex=ex),
        "a partial": functools.partial(ex.cuda_verdict),
        "a copy of its code": types.FunctionType(ex.cuda_verdict.__code__, ex.__dict__, "f"),
        "functools.wraps": functools.wraps(ex.cuda_verdict)(lambda *a: "compatible"),
    }
    for how, answer in answers.items():
        t0 = time.perf_counter()
        out = ex.q5.check(answer, quiet=True)
        assert time.perf_counter() - t0 < FAST_S, how
        assert out.status is Status.INCORRECT and target in out.message and out.message.endswith(fix), (how, str(out))


def test_code_for_the_triton_stub_is_read_by_its_names():
    # 04.6 runs in the server's python backend, where ExerciseModel is defined: the notebook has no such name.
    answer = answer_cell("def execute(self, requests):\n    return ExerciseModel.execute(self, requests)\n", "execute")
    out = MODULES["04"].q6.check(answer, quiet=True)
    one_line_refusal(out, "lab_utils.serving.backend.model.ExerciseModel.execute", REFERENCES["lab04.execute"].fix)


# --- refused while the check runs: what the static walk cannot see --------------------------------------------------

# Exercises whose grader calls the answer early and cheaply, and a reference function of each.
DYNAMIC = [
    ("lab00.cuda_ceiling", "lab_utils.exercises.lab00.reference_cuda_ceiling"),
    ("lab00.smi_inventory", "lab_utils.course.probe.parse_smi_csv"),
    ("lab00.cuda_verdict", "lab_utils.exercises.lab00.cuda_verdict"),
    ("lab01.time_ms", "lab_utils.exercises.lab01.reference_time_ms"),
    ("lab02.busbw_factor", "lab_utils.distributed.bandwidth.busbw_factor"),
    ("lab06.gpu_busy_fraction", "lab_utils.profiling.trace.busy_fraction"),
    ("lab06.train_loop", "lab_utils.exercises.lab06.reference_train_loop"),
    ("lab07.find_capacity", "lab_utils.exercises.lab07.reference_find_capacity"),
    ("lab07.servers_needed", "lab_utils.exercises.lab07.reference_servers_needed"),
    ("lab08.sample_size", "lab_utils.mlops.abtest.sample_size"),
    ("lab08.psi", "lab_utils.exercises.lab08.reference_psi"),
]

HIDDEN = '''\
import importlib


def {var}(*args, **kwargs):
    found = getattr(importlib.import_module("{module}"), "{head}" + "{tail}")  # a name no reader sees
    {body}
'''


@pytest.mark.parametrize(("key", "target"), DYNAMIC, ids=[k for k, _ in DYNAMIC])
def test_a_call_built_at_run_time_is_refused_while_the_check_runs(key, target):
    lab, var = key[3:5], key.partition(".")[2]
    fn = resolve(target)
    module, attrs = split(target)
    name = attrs[0]
    before = fn.__code__
    for body in ("return found(*args, **kwargs)",
                 # caught by the student's own code: still refused, the call itself is the verdict
                 "try:\n        return found(*args, **kwargs)\n    except BaseException:\n        return None"):
        source = HIDDEN.format(var=var, module=module.__name__, head=name[:3], tail=name[3:], body=body)
        answer = student_function(source, var, {})
        assert probe(lab, var).refusal(answer) is None  # the walk cannot see it
        t0 = time.perf_counter()
        out = check(lab, var, answer)
        assert time.perf_counter() - t0 < 2 * FAST_S
        one_line_refusal(out, target, REFERENCES[key].fix)
        assert f"of `{var}`)" in out.message  # the line of the call
    assert fn.__code__ is before  # the trap is gone after the check


def test_the_checks_own_calls_and_the_labs_calls_are_not_trapped():
    ex = MODULES["00"]
    before = ex.cuda_verdict.__code__
    right = solution_functions("00")["cuda_verdict"]
    out = ex.q5.check(right, quiet=True)  # the grader calls ex.cuda_verdict while the trap is set
    assert out.correct, str(out)
    assert ex.cuda_verdict.__code__ is before
    assert ex.cuda_verdict("12.4", "12.8", False) == "minor-version compatibility"  # a later cell, no check running


def test_another_exercises_reference_is_allowed():
    # 00.3's smi_inventory may use the CUDA ceiling of 00.2: that lesson is done. Only 00.3's own references count.
    ex = MODULES["00"]
    solution = solution_functions("00")["smi_inventory"]
    namespace = dict(solution.__globals__, cuda_ceiling=ex.reference_cuda_ceiling)
    answer = types.FunctionType(solution.__code__, namespace, "smi_inventory")
    assert probe("00", "smi_inventory").refusal(answer) is None
    if ex.nvml_unavailable():  # graded here: the smi part
        assert check("00", "smi_inventory", answer).correct


# --- the solutions' code is never refused, and passes where its check is cheap ----------------------------------


@pytest.mark.parametrize(("key", "row"), CODE_ROWS, ids=[k for k, _ in CODE_ROWS])
def test_the_solution_is_not_refused(key, row):
    lab, var = key[3:5], key.partition(".")[2]
    solution = solution_functions(lab).get(var)
    assert solution is not None, f"no `def {var}` in the solution notebook of lab {lab}"
    exercise = exercise_of(lab, var)
    assert (probe(lab, var) if var in INVENTORY_PARTS else exercise).refusal(solution) is None


# Checks that are cheap on a CPU with no server: the solution's code still passes them, traps set.
CHEAP = ["lab00.cuda_ceiling", "lab00.smi_inventory", "lab00.cuda_verdict", "lab02.busbw_factor",
         "lab04.batch_and_queue", "lab06.gpu_busy_fraction", "lab06.train_loop", "lab07.find_capacity",
         "lab07.servers_needed", "lab08.sample_size", "lab08.psi"]


@pytest.mark.parametrize("key", CHEAP)
def test_the_solution_still_passes(key):
    lab, var = key[3:5], key.partition(".")[2]
    if var == "smi_inventory" and not MODULES[lab].nvml_unavailable():
        pytest.skip("NVML works here: 00.3 grades nvml_inventory")
    out = check(lab, var, solution_functions(lab)[var])
    assert out.correct, str(out)


def test_a_code_exercise_belongs_to_its_labs_module_also_in_a_split_lab():
    # lab 08's graders live in lab08.tracking, lab08.promql, ...: the lab is still the package the notebook imports
    for lab, module in MODULES.items():
        labs = {e.lab for e in vars(module).values() if isinstance(e, CodeExercise)}
        assert labs <= {module.__name__}, (lab, labs)


def test_a_refused_check_leaves_the_exercise_as_it_was():
    ex = MODULES["00"]
    exercise = copy.copy(ex.q5)
    assert check("00", "cuda_verdict", ex.cuda_verdict).status is Status.INCORRECT
    assert exercise.lab == ex.q5.lab == ex.__name__
    assert check("00", "cuda_verdict", solution_functions("00")["cuda_verdict"]).correct


# --- the course's own objects are no answer: a public constant, what a public helper returned, a copy of either ----

ALL_LABS = (*LABS, "09")
MODULES["09"] = importlib.import_module("lab_utils.exercises.lab09")
LAB08_BOUND = importlib.import_module("lab_utils.exercises.lab08.common")._BOUND  # what every lab 08 check reads


def _verdict_of(result: Any) -> Any:
    LAB08_BOUND["ab"] = result  # the grader compares with it (use_ab without its print)
    return MODULES["08"].reference_verdict(result)


_AB = types.SimpleNamespace(boot_low=0.01, boot_high=0.03, test=types.SimpleNamespace(p_value=0.01, diff=0.02))
HANDED_OUT = [  # (lab, exercise, the answer, the course's name for it)
    ("06", "q3", lambda ex: ex.DIAGNOSIS_CASES, "lab_utils.exercises.lab06.DIAGNOSIS_CASES"),
    ("09", "q7", lambda ex: ex.H200_RIDGE, "lab_utils.exercises.lab09.H200_RIDGE"),
    ("09", "q9", lambda ex: ex.NIM_REQUEST, "lab_utils.exercises.lab09.NIM_REQUEST"),
    ("09", "q9", lambda ex: dict(ex.NIM_REQUEST), "a copy of lab_utils.exercises.lab09.NIM_REQUEST"),
    ("07", "q1", lambda ex: ex.reference_ensemble(),
     "what lab_utils.exercises.lab07.reference_ensemble(...) returned"),
    ("07", "q1", lambda ex: {**ex.reference_ensemble()},
     "a copy of what lab_utils.exercises.lab07.reference_ensemble"),
    ("07", "q3", lambda ex: ex.reference_upstream(["127.0.0.1:8000", "127.0.0.1:8001"]),
     "what lab_utils.exercises.lab07.reference_upstream(...) returned"),
    ("08", "q5", lambda ex: _verdict_of(_AB), "what lab_utils.exercises.lab08.reference_verdict(...) returned"),
]


@pytest.mark.parametrize(("lab", "q", "make", "named"), HANDED_OUT, ids=[f"{lab}.{q}:{n.split('.')[-1][:24]}"
                                                                          for lab, q, _, n in HANDED_OUT])
def test_the_courses_own_value_is_refused_before_grading(lab, q, make, named, monkeypatch):
    ex = MODULES[lab]
    if lab == "07":  # no service, no A/B result: nothing to grade with
        monkeypatch.setattr(importlib.import_module(f"{ex.__name__}.service"), "_BOUND", [])  # where the checks read it
    if lab == "08":
        monkeypatch.setitem(LAB08_BOUND, "ab", None)
    answer = make(ex)
    exercise = getattr(ex, q)
    out = exercise.check(answer, quiet=True)
    assert out.status is Status.INCORRECT and f"your answer is {named}" in out.message, str(out)
    assert out.message.endswith(f"Write `{exercise.var}` yourself") and "\n" not in str(out), str(out)
    probe_ = copy.copy(exercise)
    probe_.grade = must_not_run
    assert probe_.check(answer, quiet=True).status is Status.INCORRECT
    # The same answer written out by hand is graded (right, or not applicable here without a service).
    if lab == "08":
        monkeypatch.setitem(LAB08_BOUND, "ab", _AB)
    own = exercise.check(as_written(answer) if lab != "09" or q != "q7" else 989e12 / 4.8e12, quiet=True)
    assert "your answer is" not in own.message and own.status in (Status.CORRECT, Status.NOT_APPLICABLE), str(own)


def _identifiable_constants(module: types.ModuleType) -> dict[str, Any]:
    public = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    return {n: getattr(module, n) for n in public if _identifiable(getattr(module, n))}


@pytest.mark.parametrize("lab", ALL_LABS)
def test_no_public_constant_of_a_lab_passes_any_of_its_checks(lab):
    """Every exercise of every lab, against every public constant of the lab's module: refused, never graded."""
    module = MODULES[lab]
    constants = _identifiable_constants(module)
    assert constants, lab
    for exercise in (v for v in vars(module).values() if type(v) in (Exercise, CodeExercise)):  # 00.3: two answers
        probe_ = copy.copy(exercise)
        probe_.grade = must_not_run
        if isinstance(probe_, CodeExercise):
            probe_.applicable = None
        for name, value in constants.items():
            out = probe_.check(value, quiet=True)
            assert out.status is Status.INCORRECT, (exercise.name, name, str(out))
            if not isinstance(exercise, CodeExercise):  # a code exercise says first that it wants a function
                assert f"your answer is {module.__name__}.{name}" in out.message or \
                       "your answer is lab_utils." in out.message, (exercise.name, name, str(out))


@pytest.mark.parametrize("lab", ALL_LABS)
def test_every_value_exercises_reference_is_remembered(lab):
    """A value exercise's reference_* (a later cell's stand-in) is ``hands_out``: its result cannot be the answer."""
    module = MODULES[lab]
    for exercise in (v for v in vars(module).values() if isinstance(v, Exercise) and not isinstance(v, CodeExercise)):
        row = REFERENCES.get(f"lab{lab}.{exercise.var}")
        for target in row.targets if row else ():
            fn = resolve(target)
            if target.startswith("lab_utils.exercises."):
                assert getattr(fn, "__hands_out__", False), f"{target}: decorate it with @hands_out"
    helpers = [n for n in getattr(module, "__all__", ()) if n.startswith("reference_")]
    named = {t.rpartition(".")[2] for k, r in REFERENCES.items() if k.startswith(f"lab{lab}.") for t in r.targets}
    assert lab == "09" or set(helpers) <= named, set(helpers) - named
