"""Single source (solutions -> labs) and notebook execution."""

import ast
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from lab_utils.course.catalog import NOTEBOOK_GLOB, repo_root
from nvlab.ops import notebooks

ROOT = repo_root()
SOLUTIONS = sorted((ROOT / "solutions").glob(NOTEBOOK_GLOB))


def test_assignment_block_becomes_none_placeholder():
    src = "x = 1\n# BEGIN SOLUTION\nflops = 2 * m * n * k\na, b = 1, 2\n# END SOLUTION\ncheck(flops)"
    out = notebooks.strip_solution(src)
    assert "2 * m" not in out
    assert "flops = None  # YOUR CODE HERE" in out and "a = None" in out and "b = None" in out
    assert out.startswith("x = 1") and out.endswith("check(flops)")


def test_student_lines_replace_a_function_block():
    src = "# BEGIN SOLUTION\ndef f(x):\n    return 2 * x\n# STUDENT: def f(x):\n# STUDENT:     ...\n# END SOLUTION"
    assert notebooks.strip_solution(src) == "def f(x):\n    ..."


def test_bad_markers_are_named():
    with pytest.raises(notebooks.NotebookError, match="without '# END SOLUTION'"):
        notebooks.strip_solution("# BEGIN SOLUTION\nx = 1")
    with pytest.raises(notebooks.NotebookError, match="without '# BEGIN SOLUTION'"):
        notebooks.strip_solution("x = 1\n# END SOLUTION")
    with pytest.raises(notebooks.NotebookError, match="STUDENT"):
        notebooks.strip_solution("# BEGIN SOLUTION\ndef f():\n    return 1\n# END SOLUTION")


def _mini_course(tmp_path: Path) -> Path:
    (tmp_path / "solutions").mkdir()
    nb = new_notebook(cells=[
        new_markdown_cell("Q?\n<!-- BEGIN SOLUTION -->\nsecret\n<!-- END SOLUTION -->"),
        new_code_cell("# BEGIN SOLUTION\nanswer = 42\n# END SOLUTION\nprint(answer)"),
    ])
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="42\n")]
    nb.cells[1].execution_count = 3
    nbformat.write(nb, tmp_path / "solutions" / "00_environment.ipynb")
    return tmp_path


def test_build_writes_clean_labs_and_check_detects_drift(tmp_path):
    root = _mini_course(tmp_path)
    assert notebooks.build_labs(check=True, root=root) == ["00_environment.ipynb"]
    assert notebooks.build_labs(root=root) == ["00_environment.ipynb"]
    assert notebooks.build_labs(check=True, root=root) == []
    lab = nbformat.read(root / "labs" / "00_environment.ipynb", as_version=4)
    assert "secret" not in lab.cells[0].source and notebooks.MD_PLACEHOLDER in lab.cells[0].source
    assert lab.cells[1].outputs == [] and lab.cells[1].execution_count is None
    assert "answer = None" in lab.cells[1].source
    # a hand edit of a generated lab is drift
    p = root / "labs" / "00_environment.ipynb"
    p.write_text(p.read_text().replace("answer = None", "answer = 1"))
    assert notebooks.build_labs(check=True, root=root) == ["00_environment.ipynb"]
    # a lab without a solution is drift too
    shutil.copy(p, root / "labs" / "09_extra.ipynb")
    assert "09_extra.ipynb (no solution)" in notebooks.build_labs(check=True, root=root)


def test_committed_labs_match_solutions_and_carry_no_outputs():
    assert SOLUTIONS, "no solution notebooks found"
    assert notebooks.build_labs(check=True) == [], "run `nvlab build-labs` and commit labs/"
    for p in sorted((ROOT / "labs").glob("*.ipynb")):
        for c in nbformat.read(p, as_version=4).cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, p.name
                assert "BEGIN SOLUTION" not in c.source, p.name


def test_every_solution_has_parameters_and_checked_cells():
    for p in SOLUTIONS:
        nb = nbformat.read(p, as_version=4)
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), p.name
        checked = [c for c in nb.cells if notebooks.CHECK_MARKER in c.source]
        assert len(checked) >= 3 and all(c.outputs for c in checked), f"{p.name}: run --update-expected"


def test_failing_notebook_names_notebook_and_cell(tmp_path):
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("raise ValueError('boom')")])
    p = tmp_path / "99_broken.ipynb"
    nbformat.write(nb, p)
    res = notebooks.execute(p, tmp_path / "out", {})
    assert not res.ok
    assert "99_broken.ipynb" in res.error and "cell 1" in res.error and "boom" in res.error


def test_leftover_processes_are_found(monkeypatch):
    run_id = "test-leftover-probe"
    monkeypatch.setenv(notebooks.RUN_ID_ENV, run_id)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert any(line.startswith(f"{proc.pid} ") for line in notebooks.leftover_processes(run_id))
    finally:
        proc.kill()
        proc.wait()
    assert notebooks.leftover_processes(run_id) == []


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a block of code binds at the notebook's top level (defs, classes, imports, assignment targets)."""
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
        else:
            names |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def _reads(stmt: ast.stmt, names: set[str]) -> set[str]:
    """Which of ``names`` one statement reads, outside ``.check(...)``'s arguments (a check of a blank says "not
    attempted": the exercise harness proves that for every check) and not bound in the statement itself."""
    local = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for a in ast.walk(stmt) if isinstance(a, ast.arg)}
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check":
            return visit(node.func)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names - local:
            found.add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(stmt)
    return found


def student_name_reads(path: Path) -> list[tuple[int, str]]:
    """(cell, name) wherever a generated lab's code reads, after the exercise that binds it, a name the student
    writes (a top-level name bound between ``# BEGIN SOLUTION`` and ``# END SOLUTION``). Only such a lab can fail
    on a student's blank in a cell other than a check: CI runs it every time; the others run in the nightly set."""
    student: set[str] = set()
    reads = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        source = "\n".join(ln for ln in cell.source.split("\n") if not ln.lstrip().startswith(("%", "!")))
        lab = ast.parse(notebooks.strip_solution(source))
        for stmt in lab.body:
            reads += [(i, name) for name in sorted(_reads(stmt, student))]
            student -= _top_level_names(ast.Module(body=[stmt], type_ignores=[]))  # rebound by the lab itself
        blocks = re.findall(r"# BEGIN SOLUTION\n(.*?)# END SOLUTION", source, re.S)
        student |= set().union(*(_top_level_names(ast.parse(textwrap.dedent(b))) for b in blocks))
    return reads


# The generated labs whose later cells read a name the student writes: executed on every CI run. None does: a
# later cell reads what a check accepted (`ex.q1.accepted`), never the student's name, so every generated lab
# differs from its solution (executed by nbval on every run) only by blanks its checks answer "not attempted" to,
# and runs in the nightly set (`./course test --all`).
EVERY_RUN: set[str] = set()


def test_every_run_set_is_the_labs_that_read_a_students_name():
    found = {p.stem: reads for p in SOLUTIONS if (reads := student_name_reads(p))}
    assert set(found) == EVERY_RUN, (
        f"generated labs whose later cells read a student's name: {found}; EVERY_RUN lists {sorted(EVERY_RUN)}. "
        "Have the later cell read what the check accepted (`ex.qN.accepted`, None until correct), or add the lab "
        "to EVERY_RUN (its generated lab then runs in every CI run)")


def test_a_later_read_of_a_students_name_is_found(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("# BEGIN SOLUTION\ndef f(x):\n    return x\n# STUDENT: def f(x):\n# STUDENT:     ...\n"
                      "# END SOLUTION\nex.q1.check(f)"),
        new_code_cell("g = f(2)"), new_code_cell("f = reference\nh = f(3)")])
    nbformat.write(nb, tmp_path / "01_x.ipynb")
    assert student_name_reads(tmp_path / "01_x.ipynb") == [(1, "f")]


@pytest.mark.notebooks
@pytest.mark.parametrize("path", [pytest.param(p, marks=() if p.stem in EVERY_RUN else pytest.mark.nightly)
                                  for p in SOLUTIONS], ids=lambda p: p.stem)
def test_generated_lab_executes_with_quick_parameters(path, tmp_path, record_property):
    """Every generated lab runs top to bottom with its blanks and its optional sections skipped (a student's core
    path: tests/test_pacing.py); nothing it started survives it.

    The solutions themselves run once, every section included, under nbval (see conftest.py), not here."""
    nb_path = ROOT / "labs" / path.name
    run_id = f"pytest-labs-{path.stem}"
    # a cell still running after 10 min in quick mode is a hang: fail naming it, not hold CI for its 90 min
    res = notebooks.execute(nb_path, tmp_path, {"quick": True}, run_id=run_id, timeout_s=600, skip_optional=True)
    record_property("nvlab_wall_s", (f"labs/{path.stem}", res.seconds))  # printed in the run's summary
    assert res.ok, res.error
    assert notebooks.leftover_processes(run_id) == []
    executed = nbformat.read(res.output, as_version=4)
    checks = [c for c in executed.cells if c.cell_type == "code" and ".check(" in c.source]
    texts = ["".join(o.get("text", "") for o in c.outputs) for c in checks]
    assert texts and all(t.strip() for t in texts)
    # blanks (or the broken code a lab starts from) never break later cells
    assert all("not attempted" in t or "incorrect" in t or "not applicable on this tier" in t for t in texts), texts
    assert any("not attempted" in t for t in texts), texts
    results = sorted(tmp_path.glob("results_*.json"))
    assert results and json.loads(results[0].read_text()), "the lab recorded no measurement"


@pytest.mark.notebooks
def test_generated_lab_08_runs_where_mlflow_is_missing(tmp_path, monkeypatch):
    """Without MLflow lab 08 keeps its statistics only and records nothing; its last cell (the table beside the
    reference run) raised KeyError: 'lab' there (seen on one H200). A few seconds: every CI run."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["mlflow"] = None  # as if not installed\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")])))
    res = notebooks.execute(ROOT / "labs" / "08_mlops.ipynb", tmp_path / "run", {"quick": True},
                            run_id="pytest-labs-08-no-mlflow", timeout_s=300)
    assert res.ok, res.error
    assert notebooks.leftover_processes("pytest-labs-08-no-mlflow") == []
    printed = "".join(o.get("text", "") for c in nbformat.read(res.output, as_version=4).cells
                      for o in c.get("outputs", []))
    assert "missing: mlflow" in printed  # the tier table says why this lab runs its statistics only


RECORD = "from lab_utils.course import session\nsession.start_lab('00', show=False).record('x', 1.0, 'unit')"
# One nested nbval run over four probe notebooks (a pytest start costs seconds of CPU): each test reads its own.
PROBES = {
    "99_clean": (RECORD, "print('correct.')  # ex.check(...) stand-in"),
    "98_orphan": (RECORD, "import subprocess, sys\n"
                  "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
                  "                     start_new_session=True)\n"
                  "open('orphan.pid', 'w').write(str(p.pid))"),
    "97_incorrect": (RECORD, "print('incorrect: 2 != 3')  # ex.check(...) stand-in"),
    "96_nothing": ("x = 1",),
}


@pytest.fixture(scope="module")
def nbval_probes(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """Run nbval with the course's conftest hooks on the PROBES notebooks; its output, and each notebook's failure
    messages (empty: it passed) from the run's JUnit report."""
    import xml.etree.ElementTree as ET

    tmp_path = tmp_path_factory.mktemp("nbval-probes")
    for stem, sources in PROBES.items():
        nb = new_notebook(cells=[new_code_cell(s) for s in sources],
                          metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                   "language": "python"}})
        nbformat.write(nb, tmp_path / f"{stem}.ipynb")
    # its own TMPDIR, and no look at the machine-wide places: the other workers' servers are not its leftovers
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NVLAB_TEST_TMPDIR"}
    env.update(PYTHONPATH=str(ROOT), NVLAB_LEFTOVER_GRACE_S="1", TMPDIR=str(own_tmp), NVLAB_TMP_CHECK="own")
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "--nbval-lax", "-q", "-p",
                              "no:cacheprovider", "-n", "0", "--junitxml=report.xml", *(f"{s}.ipynb" for s in PROBES)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        pid_file = tmp_path / "orphan.pid"  # the orphan notebook's process, left on purpose: it goes now
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), 9)
    failures: dict[str, str] = {stem: "" for stem in PROBES}
    for case in ET.parse(tmp_path / "report.xml").iter("testcase"):
        where = f"{case.get('classname')} {case.get('name')}"  # the notebook's stem is in one of the two
        stem = next((s for s in PROBES if s in where), None)
        assert stem, f"a test case of no probe notebook ({where}): the nested run said\n{out.stdout[-3000:]}"
        for bad in [*case.iter("failure"), *case.iter("error")]:
            failures[stem] += (bad.get("message") or "") + (bad.text or "")
    return out.stdout + out.stderr, failures


def test_nbval_hooks_pass_a_clean_notebook_and_print_its_wall_time(nbval_probes):
    output, failures = nbval_probes
    assert failures["99_clean"] == "", failures["99_clean"]
    assert "notebook wall times" in output and "solutions/99_clean:" in output


def test_nbval_hooks_fail_a_notebook_that_leaves_a_process(nbval_probes):
    assert "left processes running after its kernel stopped" in nbval_probes[1]["98_orphan"], nbval_probes[0]


def test_nbval_hooks_fail_a_solution_check_that_is_not_correct(nbval_probes):
    assert "did not pass" in nbval_probes[1]["97_incorrect"], nbval_probes[0]


def test_nbval_hooks_fail_a_notebook_that_records_nothing(nbval_probes):
    failures = nbval_probes[1]
    assert "recorded no measurement" in failures["96_nothing"], nbval_probes[0]
    # each failure is its own notebook's: the clean one passed beside them
    assert all(failures[s] for s in ("98_orphan", "97_incorrect", "96_nothing")) and not failures["99_clean"]


def test_scrub_removes_ansi_machine_paths_and_papermill_paths(tmp_path):
    nb = new_notebook(cells=[new_code_cell("x")])
    nb.cells[0].outputs = [
        nbformat.v4.new_output("stream",
                               text="\x1b[1mNVIDIA H200\x1b[0m at /srv/ci/course/labs and /tmp/nvlab-abc12\n"),
        nbformat.v4.new_output("display_data", data={"text/plain": "\x1b[32mok\x1b[0m /srv/ci/out/results.json"}),
        nbformat.v4.new_output("stream", name="stderr",
                               text="/opt/py/.venv/lib/python3.12/site-packages/torch/x.py:83: UserWarning\n"),
    ]
    nb.metadata["papermill"] = {"input_path": "/srv/ci/course/solutions/00.ipynb",
                                "output_path": "/srv/ci/out/00.ipynb"}
    p = tmp_path / "00.ipynb"
    nbformat.write(nb, p)
    assert notebooks.scrub(p, {"/srv/ci/course": ".", "/srv/ci/out": "OUT"}) == 3
    text = p.read_text()
    assert "\\u001b" not in text and "/srv/ci" not in text and "nvlab-abc12" not in text
    out = nbformat.read(p, as_version=4).cells[0].outputs
    assert out[0].text == "NVIDIA H200 at ./labs and /tmp/...\n" and out[1].data["text/plain"] == "ok OUT/results.json"
    assert out[2].text == "site-packages/torch/x.py:83: UserWarning\n"


# --- scaffolding in the generated labs: hints, folded answers, the top of each lab --------------------------------


def _built(path: Path):
    return notebooks.build_lab(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_check_is_followed_by_one_line_on_hints_and_the_solution(path):
    lab = _built(path)
    seen = []
    for i, cell in enumerate(lab.cells):
        if cell.cell_type != "code":
            continue
        names = list(dict.fromkeys(notebooks.CHECK_CALL.findall(cell.source)))
        for below, name in zip(lab.cells[i + 1:i + 1 + len(names)], names, strict=True):  # right under the check
            seen.append(name)
            text = below.source
            assert below.cell_type == "markdown" and "\n" not in text, (path.name, name, text)
            assert f"`ex.{name}.hint()` gives the next of its " in text and "one per call" in text, text
            assert f"`ex.{name}.solution()` shows the worked solution once you have checked an attempt" in text, text
            assert "<details>" not in text, text  # no hint shown in the lab: they come one call at a time
    assert seen, f"{path.name}: no exercise checks"


def test_answers_are_folded_after_an_attempt_cell(tmp_path):
    nb = new_notebook(cells=[new_markdown_cell("## Check\n1. Q?\n<!-- BEGIN ANSWERS -->\n1. secret\n"
                                               "<!-- END ANSWERS -->\n\n## Summary\nDone.", id="cyu")])
    lab = notebooks.build_lab(nb)
    assert [c.source for c in lab.cells] == [
        "## Check\n1. Q?", notebooks.ATTEMPT_PLACEHOLDER,
        "<details><summary>Answers</summary>\n\n1. secret\n\n</details>", "## Summary\nDone."]
    assert [c.id for c in lab.cells] == ["cyu", "cyu-attempt", "cyu-answers", "cyu-after"]
    for broken in ("Q\n<!-- BEGIN ANSWERS -->\nsecret", "Q\n<!-- END ANSWERS -->\nsecret"):
        with pytest.raises(notebooks.NotebookError, match="do not pair up"):
            notebooks.build_lab(new_notebook(cells=[new_markdown_cell(broken)]))


def test_a_check_of_an_exercise_the_module_lacks_is_named():
    nb = new_notebook(cells=[new_code_cell("from lab_utils.exercises import lab01 as ex"),
                             new_code_cell("ex.q42.check(x)")])
    with pytest.raises(notebooks.NotebookError, match="cell 1: ex.q42.check.*lab01 has no q42"):
        notebooks.build_lab(nb)


def _understanding(nb) -> tuple[str, str]:
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and "## Check your understanding" in c.source)
    text = cell.source.split("## Check your understanding", 1)[1]
    questions, _, rest = text.partition("<!-- BEGIN ANSWERS -->")
    return questions, rest.partition("<!-- END ANSWERS -->")[0]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_understanding_question_has_its_answer_folded_in_the_lab(path):
    import re

    questions, answers = _understanding(nbformat.read(path, as_version=4))
    asked = re.findall(r"^(\d+)\. ", questions, re.M)
    assert asked, f"{path.name}: no numbered questions under 'Check your understanding'"
    assert answers, f"{path.name}: no <!-- BEGIN ANSWERS --> ... <!-- END ANSWERS --> block for its questions"
    assert re.findall(r"^(\d+)\. ", answers, re.M) == asked, f"{path.name}: one answer per question, in order"
    lab = _built(path)
    folded = next(c for c in lab.cells if c.source.startswith("<details><summary>Answers</summary>"))
    attempt = lab.cells[lab.cells.index(folded) - 1]
    assert attempt.source == notebooks.ATTEMPT_PLACEHOLDER, path.name


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_lab_states_prerequisites_time_and_hardware_at_its_top(path):
    top = nbformat.read(path, as_version=4).cells[0]
    assert top.cell_type == "markdown" and top.source.startswith("# Lab "), path.name
    for label in ("**Prerequisites:**", "**Time:**", "**Hardware:**"):
        assert label in top.source, f"{path.name}: the first cell has no {label} line"
