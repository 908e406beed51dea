"""How long each lab takes: its core path and its optional sections, estimated from the notebooks themselves.

``python -m nvlab.ops.pacing`` writes the estimate everywhere it is stated (each solution's **Time:** line and
"Optional (N min)" headings, the course map in README.md and lab 00, ``docs/pacing.md``) and regenerates labs/;
``--check`` writes nothing and lists what is stale; ``--cpu-run DIR`` stores the per-cell times of a papermill run
of the generated labs (``nvlab run --all -p quick True --out DIR``) for the table's CPU column.

Design notes: docs/internals.md#nvlabopspacingpy"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from lab_utils.course.catalog import NOTEBOOK_GLOB, repo_root
from nvlab.ops.notebooks import CHECK_CALL, MD_ANSWERS, OPTIONAL_TAG, NotebookError, build_labs, notebook_text

# The model of a prepared student (knows Python and the lab's prerequisites), one term per activity:
READ_WPM = 200  # prose read per minute (markdown, the folded understanding answers left out)
CODE_LINES_PER_MIN = 10  # given code read and run per minute (non-blank, non-comment lines outside solutions)
EXERCISE_MIN = 3.0  # each exercise: read the task, run the check, read its message
SOLUTION_LINE_MIN = 0.5  # each line the student writes (the solution's non-blank, non-comment lines)
QUESTION_MIN = 2.0  # each "check your understanding" question: an attempt, then the folded answer
# plus the time the cells run on one GPU: the H200 reference run's per-cell papermill durations (full size)
CORE_LIMIT_MIN = 60  # a lab's core path, at most (about)
COURSE_CORE_LIMIT_MIN = 9 * 60  # the whole course's core, at most (about)

LAB_FILE = re.compile(r"^(\d\d[a-z]?)_(\w+)\.ipynb$")  # catalog.NOTEBOOK_GLOB's names, the number captured
# "### Optional (5 min): title", or with the section's number: "## 7. Optional (5 min): title"
OPTIONAL_HEADING = re.compile(r"^(#{2,4}) ((?:\d+\. )?)Optional \((\d+) min\): (.+)$", re.M)
TIME_LINE = re.compile(r"\*\*Time:\*\*.*?(?=\*\*Hardware:\*\*|\n\n|\Z)", re.S)
PREREQ_LINE = re.compile(r"\*\*Prerequisites:\*\*(.*?)(?=\*\*Time:\*\*|\n\n|\Z)", re.S)
PREREQ_LABS = re.compile(r"\blabs? (\d\d[a-z]?)(?:\s*[–-]\s*(\d\d[a-z]?))?")
BACK_TO_CORE = "*Back on the core path.*"  # opens a core cell after an optional section, where no heading does
MAP_BEGIN, MAP_END = "<!-- BEGIN COURSE MAP (python -m nvlab.ops.pacing) -->", "<!-- END COURSE MAP -->"
UNDERSTANDING = "## Check your understanding"
CPU_TIMES = "data/pacing/cpu_quick.json"  # under nvlab/: per-cell seconds of the generated labs, quick, CPU
REFERENCE = "reference_runs/h200"  # executed solutions at full size on one H200, per-cell durations kept


@dataclass
class Part:
    """A lab's core path, or one optional section: what a student reads, writes and waits for."""
    title: str
    cells: int = 0
    words: int = 0  # prose words
    code_lines: int = 0  # given code lines
    exercises: int = 0
    solution_lines: int = 0
    questions: int = 0
    gpu_s: float = 0.0  # seconds on one H200 (reference run, full size)
    cpu_s: float | None = None  # seconds on the CPU tier (generated lab, quick); None: not measured
    stated_min: int | None = None  # what an optional heading says

    @property
    def minutes(self) -> float:
        return (self.words / READ_WPM + self.code_lines / CODE_LINES_PER_MIN + self.exercises * EXERCISE_MIN
                + self.solution_lines * SOLUTION_LINE_MIN + self.questions * QUESTION_MIN + self.gpu_s / 60)


@dataclass
class LabPacing:
    number: str
    stem: str
    title: str  # the lab's heading, after "Lab NN — " and before any ":"
    prerequisites: str  # lab numbers ("00", "03, 04", "00–08") or "none"
    core: Part
    optional: list[Part] = field(default_factory=list)
    stated: tuple[int, int] | None = None  # (core, optional) minutes the lab's **Time:** line states
    reference: bool = True  # an H200 reference run exists

    @property
    def core_min(self) -> int:
        return rounded(self.core.minutes)

    @property
    def optional_min(self) -> int:
        return sum(rounded(p.minutes) for p in self.optional)


def rounded(minutes: float) -> int:
    """Minutes as a lab states them: to the nearest 5, at least 5."""
    return max(5, 5 * math.floor(minutes / 5 + 0.5))


def solution_paths(root: Path | None = None) -> list[Path]:
    root = root or repo_root()
    return sorted(p for p in (root / "solutions").glob(NOTEBOOK_GLOB) if LAB_FILE.match(p.name))


def _code_lines(text: str) -> int:
    return sum(1 for ln in text.split("\n") if ln.strip() and not ln.strip().startswith("#"))


def _solution_lines(source: str) -> int:
    blocks = re.findall(r"^[ \t]*# BEGIN SOLUTION\n(.*?)^[ \t]*# END SOLUTION", source, re.S | re.M)
    return sum(_code_lines("\n".join(ln for ln in b.split("\n") if not ln.strip().startswith("# STUDENT:")))
               for b in blocks)


def _questions(markdown: str) -> int:
    if UNDERSTANDING not in markdown:
        return 0
    asked = markdown.split(UNDERSTANDING, 1)[1].split("<!-- BEGIN ANSWERS -->", 1)[0]
    return len(re.findall(r"^\d+\. ", asked, re.M))


def _prerequisites(top: str) -> str:
    m = PREREQ_LINE.search(top)
    found: list[str] = []
    for a, b in PREREQ_LABS.findall(m[1] if m else ""):
        item = f"{a}–{b}" if b else a
        if not _span(item) <= set().union(*map(_span, found)):  # "lab 01's roofline" after "labs 00–08": said
            found.append(item)
    return ", ".join(found) or "none"


def _span(item: str) -> set[str]:
    """The lab numbers of "03" or "00–08" (a range holds the numbered labs only)."""
    if "–" not in item:
        return {item}
    a, b = item.split("–")
    return {f"{n:02d}" for n in range(int(a[:2]), int(b[:2]) + 1)}


def _prose(markdown: str) -> str:
    """What a student reads of a markdown cell: not the folded answers, the stated time or the course map (the
    estimate's own words: leaving them out makes writing it a fixed point)."""
    text = TIME_LINE.sub("", MD_ANSWERS.sub("", markdown))
    return re.sub(re.escape(MAP_BEGIN) + ".*?" + re.escape(MAP_END), "", text, flags=re.S)


def _durations(path: Path) -> dict[str, float]:
    """Cell id -> seconds papermill recorded in an executed notebook."""
    nb = nbformat.read(path, as_version=4)
    return {c.get("id", ""): float(c.metadata.get("papermill", {}).get("duration") or 0.0) for c in nb.cells}


def cpu_times(root: Path | None = None) -> dict[str, dict[str, float]]:
    path = (root or repo_root()) / "nvlab" / CPU_TIMES
    return json.loads(path.read_text()) if path.exists() else {}


def pace(path: Path, root: Path | None = None, cpu: dict[str, dict[str, float]] | None = None) -> LabPacing:
    """A solution notebook's core and optional parts, each with its estimated minutes."""
    root = root or repo_root()
    m = LAB_FILE.match(path.name)
    if m is None:
        raise NotebookError(f"{path.name}: not a lab notebook (NN_name.ipynb or NNx_name.ipynb)")
    nb = nbformat.read(path, as_version=4)
    ref = root / REFERENCE / path.name
    gpu = _durations(ref) if ref.exists() else {}
    cpu_cells = (cpu_times(root) if cpu is None else cpu).get(path.stem)
    core, optional, current = Part("core"), [], None
    for i, cell in enumerate(nb.cells):
        tagged = OPTIONAL_TAG in cell.metadata.get("tags", [])
        heading = OPTIONAL_HEADING.search(cell.source) if cell.cell_type == "markdown" else None
        if heading and not tagged:
            raise NotebookError(f"{path.name} cell {i}: the heading {heading[0]!r} opens an optional section, but the "
                                f"cell has no {OPTIONAL_TAG!r} tag: tag it and every cell of its section")
        if not tagged:
            current = None
        elif heading:
            current = Part(heading[2] + heading[4].strip(), stated_min=int(heading[3]))
            optional.append(current)
        elif current is None:
            raise NotebookError(f"{path.name} cell {i}: tagged {OPTIONAL_TAG!r} but no cell before it opens its "
                                "section: start the section with a markdown heading '## Optional (N min): title'")
        part = current or core
        part.cells += 1
        if cell.cell_type == "markdown":
            part.words += len(_prose(cell.source).split())
            part.questions += _questions(cell.source)
        elif cell.cell_type == "code":
            sol = _solution_lines(cell.source)
            part.solution_lines += sol
            part.code_lines += max(0, _code_lines(cell.source) - sol)
            part.exercises += len(set(CHECK_CALL.findall(cell.source)))
            part.gpu_s += gpu.get(cell.get("id", ""), 0.0)
            if cpu_cells is not None:
                part.cpu_s = (part.cpu_s or 0.0) + cpu_cells.get(cell.get("id", ""), 0.0)
    stated = None
    if (t := TIME_LINE.search(nb.cells[0].source)) and (s := re.search(r"core (\d+) min, optional (\d+) min", t[0])):
        stated = (int(s[1]), int(s[2]))
    top = nb.cells[0].source
    title = re.split(r"\s+[—-]\s+", top.split("\n", 1)[0], maxsplit=1)[-1].split(":", 1)[0].strip()
    return LabPacing(m[1], path.stem, title, _prerequisites(top), core, optional, stated, ref.exists())


def course(root: Path | None = None) -> list[LabPacing]:
    root = root or repo_root()
    cpu = cpu_times(root)
    return [pace(p, root, cpu) for p in solution_paths(root)]


def _bound_and_read(source: str) -> tuple[set[str], set[str]]:
    """Names a code cell binds anywhere (assignments, defs, imports, arguments: locals over-approximated) and the
    names it reads."""
    tree = ast.parse("\n".join(ln for ln in source.split("\n") if not ln.lstrip().startswith(("%", "!"))))
    bound: set[str] = set()
    read: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (read if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
    return bound, read


def unskippable(path: Path) -> list[tuple[int, str, str]]:
    """(cell, name, section) wherever a cell after an optional section reads a name only that section binds: where
    skipping the section (alone) would break a later cell. Empty for a lab whose optional sections can be skipped."""
    nb = nbformat.read(path, as_version=4)
    core: set[str] = set(dir(builtins)) | {"display", "get_ipython"}  # what the kernel provides
    sections: list[tuple[str, set[str]]] = []  # each optional section: title, the names it binds
    found = []
    for i, cell in enumerate(nb.cells):
        tagged = OPTIONAL_TAG in cell.metadata.get("tags", [])
        if tagged and cell.cell_type == "markdown" and (h := OPTIONAL_HEADING.search(cell.source)):
            sections.append((h[2] + h[4], set()))
        if cell.cell_type != "code":
            continue
        bound, read = _bound_and_read(cell.source)
        own = sections[-1] if tagged and sections else None
        for title, names in sections:
            if names is not (own[1] if own else None):
                found += [(i, name, title) for name in sorted((read - bound - core) & names)]
        if own is None:
            core |= bound
            for _, names in sections:
                names -= bound  # bound by the core path too: no longer the section's alone
        else:
            own[1].update(bound - core)
    return found


# --- what is written where ----------------------------------------------------------------------------------------


def time_line(lab: LabPacing) -> str:
    return (f"**Time:** core {lab.core_min} min, optional {lab.optional_min} min (the sections headed *Optional* can "
            "be skipped; how these are estimated: `docs/pacing.md`).\n")


def course_map(labs: list[LabPacing], link: str = "labs/") -> str:
    """The course map's table: each lab, its core and optional minutes and the labs it builds on."""
    rows = ["| # | lab | core | optional | prerequisites |", "|---|---|---|---|---|"]
    rows += [f"| {lab.number} | [{lab.title}]({link}{lab.stem}.ipynb) | {lab.core_min} min | {lab.optional_min} min | "
             f"{lab.prerequisites} |" for lab in labs]
    core, optional = sum(lab.core_min for lab in labs), sum(lab.optional_min for lab in labs)
    rows.append(f"| | **the course** | **{core} min ({core / 60:.1f} h)** | **{optional} min** | |")
    return "\n".join(rows)


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}"


def pacing_markdown(labs: list[LabPacing]) -> str:
    """docs/pacing.md: the method and every lab's numbers."""
    core = sum(lab.core_min for lab in labs)
    optional = sum(lab.optional_min for lab in labs)
    reviewed = sum(lab.core_min + lab.optional_min for lab in labs if lab.number.isdigit())  # the labs 00-09 walked
    out = [
        "# Pacing: how long each lab takes",
        "",
        "Generated by `python -m nvlab.ops.pacing` from the solution notebooks, the H200 reference run and a",
        "CPU run of the generated labs; never edit it by hand (`--check` fails when it, a lab's **Time:** line, an",
        "optional section's heading or the course map is stale).",
        "",
        f"The core of the course: **{core} min ({core / 60:.1f} h)**; the optional sections add {optional} min "
        f"({optional / 60:.1f} h).",
        "",
        "## How the minutes are estimated",
        "",
        "For a prepared student (Python, and the lab's prerequisites), each cell of a solution notebook counts:",
        "",
        f"- **reading**: its prose at {READ_WPM} words a minute (the folded answers of the understanding questions "
        "left out);",
        f"- **given code**: {CODE_LINES_PER_MIN} lines a minute to read and run (non-blank, non-comment lines outside "
        "the solution blocks);",
        f"- **exercises**: {EXERCISE_MIN:g} min each (read the task, run the check, read its message) plus "
        f"{SOLUTION_LINE_MIN:g} min per line the student writes (the solution block's non-blank, non-comment lines);",
        f"- **understanding questions**: {QUESTION_MIN:g} min each (an attempt, then the folded answer);",
        f"- **waiting**: the seconds the cell ran on one H200 at full size (the papermill durations of `{REFERENCE}/`,",
        "  matched by cell id; a cell added since that run counts 0 s).",
        "",
        "A part's minutes are the sum, rounded to the nearest 5 (at least 5). The CPU column is the generated lab",
        "run with CI's small parameters (`quick=True`) on a 2-core CPU machine shared with other work, every section",
        "included (`nvlab run --all -p quick True`, stored by `python -m nvlab.ops.pacing --cpu-run DIR`); it is",
        "shown, not counted:",
        "at its default sizes a CPU-tier lab runs longer. A reviewer who worked through labs 00-09 as a student needed",
        f"16-20 hours for them; this model gives those ten labs {reviewed / 60:.1f} h (core and optional), the whole",
        f"course {(core + optional) / 60:.1f} h.",
        "",
        f"Each lab's core is at most about {CORE_LIMIT_MIN} min and the course's core at most about "
        f"{COURSE_CORE_LIMIT_MIN // 60} h. An optional section is tagged `{OPTIONAL_TAG}` on every cell and opens "
        "with a heading `Optional (N min): title`; a",
        "student can skip it and every later cell and lab still works: `nvlab run --skip-optional` leaves its code",
        "cells unrun, and the nightly test runs every generated lab that way.",
        "",
        "## The labs",
        "",
        "| lab | part | minutes | cells | prose words | given code lines | exercises (lines written) | questions "
        "| H200 run s | CPU quick run s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lab in labs:
        parts = [("core", lab.core, lab.core_min)] + [(f"optional: {p.title}", p, rounded(p.minutes))
                                                    for p in lab.optional]
        for i, (name, p, minutes) in enumerate(parts):
            gpu = _s(p.gpu_s) if lab.reference else "no run"
            out.append(f"| {lab.number if i == 0 else ''} | {name} | {minutes} ({p.minutes:.1f}) | {p.cells} | "
                       f"{p.words} | {p.code_lines} | {p.exercises} ({p.solution_lines}) | {p.questions} | {gpu} | "
                       f"{_s(p.cpu_s)} |")
    out += ["", "## The course map", "", course_map(labs, "../labs/"), ""]
    return "\n".join(out)


def _with_map(text: str, table: str, where: str) -> str:
    if MAP_BEGIN not in text or MAP_END not in text:
        raise NotebookError(f"{where}: no course map between '{MAP_BEGIN}' and '{MAP_END}'")
    head, rest = text.split(MAP_BEGIN, 1)
    return f"{head}{MAP_BEGIN}\n{table}\n{MAP_END}{rest.split(MAP_END, 1)[1]}"


def stated_solution(path: Path, lab: LabPacing, labs: list[LabPacing]) -> str:
    """The solution's text with the estimate stated: its **Time:** line, its optional headings, lab 00's map."""
    nb = nbformat.read(path, as_version=4)
    top = nb.cells[0]
    if not TIME_LINE.search(top.source):
        raise NotebookError(f"{path.name}: the first cell has no **Time:** line")
    top.source = TIME_LINE.sub(lambda _m: time_line(lab), top.source, count=1)
    sections = iter(lab.optional)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and OPTIONAL_TAG in cell.metadata.get("tags", []):
            if OPTIONAL_HEADING.search(cell.source):
                part = next(sections)
                cell.source = OPTIONAL_HEADING.sub(lambda h, p=part: f"{h[1]} {h[2]}Optional ({rounded(p.minutes)} "
                                                   f"min): {h[4]}", cell.source, count=1)
        if cell.cell_type == "markdown" and MAP_BEGIN in cell.source:
            cell.source = _with_map(cell.source, course_map(labs, link=""), path.name)  # beside the other labs
    return notebook_text(nb)


def stale(root: Path | None = None, write: bool = False) -> list[str]:
    """The files whose stated times differ from the estimate (written anew with ``write``)."""
    root = root or repo_root()
    labs = course(root)
    targets = {path: stated_solution(path, lab, labs) for path, lab in zip(solution_paths(root), labs, strict=True)}
    readme = root / "README.md"
    targets[readme] = _with_map(readme.read_text(), course_map(labs), "README.md")
    targets[root / "docs" / "pacing.md"] = pacing_markdown(labs)
    changed = [str(p.relative_to(root)) for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if write:
        for p, text in targets.items():
            p.write_text(text)
        build_labs(root=root)
    return changed


def store_cpu_run(run_dir: Path, root: Path | None = None) -> Path:
    """Store per-cell seconds of the executed generated labs in ``run_dir`` (a ``nvlab run`` output folder)."""
    root = root or repo_root()
    found = {p.stem: _durations(p) for p in sorted(run_dir.glob(NOTEBOOK_GLOB)) if LAB_FILE.match(p.name)}
    if not found:
        raise NotebookError(f"{run_dir}: no executed lab notebooks; run `nvlab run --all -p quick True --out DIR`")
    path = root / "nvlab" / CPU_TIMES
    data = cpu_times(root)
    data.update({stem: {k: round(v, 2) for k, v in cells.items() if v} for stem, cells in found.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nvlab.ops.pacing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming what is stale")
    ap.add_argument("--cpu-run", type=Path, help="store the cell times of this `nvlab run` folder first")
    args = ap.parse_args(argv)
    try:
        if args.cpu_run:
            print(f"stored the CPU cell times in {store_cpu_run(args.cpu_run)}")
        changed = stale(write=not args.check)
    except NotebookError as err:
        print(f"pacing: {err}", file=sys.stderr)
        return 2
    if args.check and changed:
        print("stated times differ from the estimate in: " + ", ".join(changed)
              + "\nrun `python -m nvlab.ops.pacing` and commit the result", file=sys.stderr)
        return 1
    print(("stale: " if args.check else "wrote: ") + (", ".join(changed) or "nothing (all up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
