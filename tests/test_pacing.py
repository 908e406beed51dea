"""Pacing: each lab's core path and optional sections, their stated minutes, and skipping the optional ones."""

import re

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from lab_utils.course.catalog import repo_root
from nvlab import cli
from nvlab.ops import notebooks, pacing

ROOT = repo_root()
SOLUTIONS = pacing.solution_paths()
LABS = {lab.stem: lab for lab in pacing.course()}
TAG = notebooks.OPTIONAL_TAG


def _opt(cell):
    cell.metadata["tags"] = [TAG]
    return cell


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_optional_section_is_tagged_and_headed_with_its_minutes(path):
    """pace() refuses a tagged cell no heading opens and an "Optional (N min)" heading without the tag; each section
    states the minutes the estimate gives, and a section heading inside it (above its own level) says optional."""
    lab = LABS[path.stem]
    assert lab.optional, (f"{path.name}: no optional section: tag a deep dive's cells {TAG!r}, head it "
                          "'### Optional (0 min): title', then run `python -m nvlab.ops.pacing`")
    for part in lab.optional:
        assert part.stated_min == pacing.rounded(part.minutes), (path.name, part.title, part.minutes)
    opener = None
    for cell in nbformat.read(path, as_version=4).cells:
        if TAG not in cell.metadata.get("tags", []):
            opener = None
            assert cell.cell_type != "markdown" or not re.search(r"^#+ .*\boptional\b", cell.source, re.M | re.I), \
                f"{path.name}: a heading says optional but its cell has no {TAG!r} tag: {cell.source[:80]!r}"
            continue
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.split("\n"):
            if (m := pacing.OPTIONAL_HEADING.match(line)) is not None:
                opener = len(m[1])
            elif (h := re.match(r"^(#+) ", line)) and opener and len(h[1]) < opener:
                assert "optional" in line.lower(), f"{path.name}: {line!r} sits in an optional section: say so"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_the_core_path_resumes_under_a_heading_or_says_so(path):
    """A student skipping a section sees where it ends: the next core cell opens with a heading or the words."""
    cells = nbformat.read(path, as_version=4).cells
    for before, cell in zip(cells, cells[1:], strict=False):
        if TAG in before.metadata.get("tags", []) and TAG not in cell.metadata.get("tags", []):
            assert cell.cell_type == "markdown" and (re.match(r"#+ ", cell.source) or cell.source.startswith(
                pacing.BACK_TO_CORE)), f"{path.name}: start {cell.source[:60]!r} with {pacing.BACK_TO_CORE!r}"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_lab_heading_states_the_core_and_optional_minutes_of_the_table(path):
    lab = LABS[path.stem]
    assert lab.stated == (lab.core_min, lab.optional_min), (
        f"{path.name} states {lab.stated}, the estimate is {(lab.core_min, lab.optional_min)}: "
        "run `python -m nvlab.ops.pacing`")
    table, readme = (ROOT / "docs" / "pacing.md").read_text(), (ROOT / "README.md").read_text()
    lab00_map = next(c.source for c in nbformat.read(ROOT / "labs" / "00_environment.ipynb", as_version=4).cells
                     if pacing.MAP_BEGIN in c.source)
    assert f"| {lab.number} | core | {lab.core_min} (" in table
    for text in (readme, table, lab00_map):
        assert f"| {lab.number} | [{lab.title}](" in text and f"| {lab.core_min} min | {lab.optional_min} min |" in text
    # each link leads to the lab from where the map stands: README.md, docs/, and lab 00 beside the others
    assert f"]({path.name})" in lab00_map and f"](labs/{path.name})" in readme and f"](../labs/{path.name})" in table


def test_the_stated_times_the_table_and_the_course_map_are_current():
    assert pacing.stale() == [], "run `python -m nvlab.ops.pacing` and commit the result"


def test_each_core_fits_an_hour_and_the_course_core_nine_hours():
    over = {lab.number: lab.core_min for lab in LABS.values() if lab.core_min > pacing.CORE_LIMIT_MIN}
    assert not over, f"labs whose core is over {pacing.CORE_LIMIT_MIN} min: {over}; mark deep dives optional"
    total = sum(lab.core_min for lab in LABS.values())
    assert total <= pacing.COURSE_CORE_LIMIT_MIN, f"the course's core is {total} min"
    # not by flattery: the whole course still takes what a reviewer walking through it as a student needed (16-20 h)
    assert total + sum(lab.optional_min for lab in LABS.values()) >= 16 * 60


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_later_cell_reads_a_name_only_an_optional_section_binds(path):
    assert pacing.unskippable(path) == [], "a later cell needs an optional section: keep that cell in the core"


def test_a_later_read_of_an_optional_name_is_found(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("import math\nbase = 2"),
        _opt(new_markdown_cell("## Optional (5 min): a deep dive")), _opt(new_code_cell("deep = math.pi * base")),
        _opt(new_markdown_cell("## 2. Optional (5 min): another")), _opt(new_code_cell("other = deep + 1")),
        new_code_cell("def f(x):\n    return x + base\nprint(f(deep))"),
        new_code_cell("deep = 3\nprint(deep)")])  # bound again by the core: fine from here on
    nbformat.write(nb, tmp_path / "05_x.ipynb")
    assert pacing.unskippable(tmp_path / "05_x.ipynb") == [(4, "deep", "a deep dive"), (5, "deep", "a deep dive")]


def test_a_tagged_cell_without_a_heading_and_a_heading_without_the_tag_are_named(tmp_path):
    top = new_markdown_cell("# Lab 05 — x\n\n**Time:** 5 min.")
    nbformat.write(new_notebook(cells=[top, _opt(new_code_cell("x = 1"))]), tmp_path / "05_x.ipynb")
    with pytest.raises(notebooks.NotebookError, match="cell 1: tagged 'optional' but no cell before it opens"):
        pacing.pace(tmp_path / "05_x.ipynb", root=tmp_path)
    nbformat.write(new_notebook(cells=[top, new_markdown_cell("### Optional (5 min): x")]), tmp_path / "05_x.ipynb")
    with pytest.raises(notebooks.NotebookError, match="cell 1: the heading .* has no 'optional' tag"):
        pacing.pace(tmp_path / "05_x.ipynb", root=tmp_path)


def test_lab_numbers_with_a_letter_are_paced_and_mapped(tmp_path):
    """A lab such as 01b sits between 01 and 02, with its prerequisites read from its top cell."""
    (tmp_path / "solutions").mkdir()
    for stem, prereq in (("01_cuda_timing", "lab 00"), ("01b_kernels", "lab 01 (the roofline) and lab 00"),
                         ("02_nccl_ddp", "labs 00–01b")):
        top = new_markdown_cell(f"# Lab {stem[:3].rstrip('_')} — {stem}: x\n\n**Prerequisites:** {prereq}.\n\n"
                                "**Time:** 10 minutes. **Hardware:** any.")
        nbformat.write(new_notebook(cells=[top, new_code_cell("# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n"
                                                              "ex.q1.check(x)")]),
                       tmp_path / "solutions" / f"{stem}.ipynb")
    labs = pacing.course(tmp_path)
    assert [(lab.number, lab.prerequisites) for lab in labs] == [("01", "00"), ("01b", "01, 00"), ("02", "00–01b")]
    assert all(lab.reference is False and lab.core.exercises == 1 for lab in labs)
    assert "| 01b | [01b_kernels](labs/01b_kernels.ipynb) | 5 min | 0 min | 01, 00 |" in pacing.course_map(labs)


def test_build_lab_tags_the_hints_of_an_optional_exercise():
    nb = new_notebook(cells=[new_code_cell("from lab_utils.exercises import lab00 as ex"),
                             _opt(new_markdown_cell("### Optional (5 min): x")), _opt(new_code_cell("ex.q1.check(1)")),
                             new_code_cell("ex.q2.check(2)")])
    lab = notebooks.build_lab(nb)
    hints = [c for c in lab.cells if "ex.q1.hint()" in c.source or "ex.q2.hint()" in c.source]
    assert [c.metadata.get("tags", []) for c in hints] == [[TAG], []]


@pytest.mark.notebooks
def test_skip_optional_leaves_the_tagged_code_unrun_and_the_rest_runs(tmp_path):
    """A real kernel through papermill: the optional cell would fail; skipped, the notebook passes and shows it."""
    nb = new_notebook(cells=[new_code_cell("x = 1"), _opt(new_markdown_cell("## Optional (5 min): boom")),
                             _opt(new_code_cell("raise RuntimeError('an optional cell ran')")),
                             new_code_cell("print(x + 1)")],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, path)
    assert not notebooks.execute(path, tmp_path / "all", {}).ok  # the cell does fail when it runs
    res = notebooks.execute(path, tmp_path / "core", {}, skip_optional=True)
    assert res.ok and res.skipped == 1, res.error
    out = nbformat.read(res.output, as_version=4).cells
    assert [c.cell_type for c in out] == ["code", "markdown", "raw", "code"]
    assert out[2].source == "raise RuntimeError('an optional cell ran')" and out[2].metadata["tags"] == [TAG]
    assert out[3].outputs[0]["text"] == "2\n"


def test_run_refuses_to_store_expected_outputs_with_optional_cells_skipped(capsys):
    assert cli.main(["run", "00", "--solutions", "--update-expected", "--skip-optional"]) == 2
    assert "leave out --skip-optional" in capsys.readouterr().err
