"""Single source (solutions -> labs) and notebook execution."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from lab_utils.course.catalog import repo_root
from lab_utils.ops import notebooks

ROOT = repo_root()
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


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
        assert len(checked) >= 4 and all(c.outputs for c in checked), f"{p.name}: run --update-expected"


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


@pytest.mark.notebooks
@pytest.mark.parametrize("folder", ["solutions", "labs"])
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_notebook_executes_with_quick_parameters(folder, path, tmp_path, capsys):
    """Every solution and every generated lab runs top to bottom; nothing it started survives it."""
    nb_path = ROOT / folder / path.name
    run_id = f"pytest-{folder}-{path.stem}"
    res = notebooks.execute(nb_path, tmp_path, {"quick": True}, run_id=run_id)
    with capsys.disabled():
        print(f"\n  {folder}/{path.name}: {res.seconds:.1f} s wall")
    assert res.ok, res.error
    assert notebooks.leftover_processes(run_id) == []
    executed = nbformat.read(res.output, as_version=4)
    checks = [c for c in executed.cells if c.cell_type == "code" and ".check(" in c.source]
    texts = ["".join(o.get("text", "") for o in c.outputs) for c in checks]
    assert texts and all(t.strip() for t in texts)
    if folder == "solutions":
        assert all("correct." in t and "incorrect" not in t for t in texts), texts
    else:  # blanks (or the broken code a lab starts from) never break later cells
        assert all("not attempted" in t or "incorrect" in t for t in texts), texts
        assert any("not attempted" in t for t in texts), texts
    results = sorted(tmp_path.glob("results_*.json"))
    assert results and json.loads(results[0].read_text()), "the lab recorded no measurement"
