"""Single source (solutions -> labs) and notebook execution with papermill.

Solutions mark exercise code with ``# BEGIN SOLUTION`` / ``# END SOLUTION`` (and ``# STUDENT: ...`` lines), and
markdown with ``<!-- BEGIN SOLUTION -->`` / ``<!-- END SOLUTION -->`` and ``<!-- BEGIN ANSWERS -->`` /
``<!-- END ANSWERS -->``. Generating a lab turns them into blanks, prompts and folded answers, strips every
output, and adds a line under each check cell saying how to get a hint and the solution.

Design notes: docs/internals.md#nvlabopsnotebookspy"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import os
import re
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import psutil
from nbformat.v4 import new_markdown_cell

from lab_utils.course.catalog import NOTEBOOK_GLOB, lab_by_number, repo_root
from lab_utils.procs import ENDED, OWNED_NAME, pid_alive

BEGIN, END, STUDENT = "# BEGIN SOLUTION", "# END SOLUTION", "# STUDENT:"
MD_BLOCK = re.compile(r"<!-- BEGIN SOLUTION -->.*?<!-- END SOLUTION -->", re.S)
MD_PLACEHOLDER = "*Your answer here.*"
MD_ANSWERS = re.compile(r"<!-- BEGIN ANSWERS -->(.*?)<!-- END ANSWERS -->", re.S)
ATTEMPT_PLACEHOLDER = "*Your answers here: double-click this cell to write them, then open the answers below.*"
EXERCISES_IMPORT = re.compile(r"^from lab_utils\.exercises import (lab\d\d[a-z]?) as ex$", re.M)
CHECK_CALL = re.compile(r"\bex\.(q\d+)\.check\(")
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"  # cells whose stored outputs nbval compares
RUN_ID_ENV = "NVLAB_RUN_ID"  # every process a run starts inherits it: how leftovers are found
OPTIONAL_TAG = "optional"  # on every cell of an optional section (heading "Optional (N min): ..."): skippable


class NotebookError(RuntimeError):
    """A notebook failed or could not be built; the message names the notebook and the cell."""


def _placeholder(block: list[str], where: str) -> list[str]:
    indent = block[0][: len(block[0]) - len(block[0].lstrip())]  # strip_solution never passes an empty block
    if student := [ln.split(STUDENT, 1)[1].removeprefix(" ") for ln in block if ln.strip().startswith(STUDENT)]:
        return [indent + s if s else s for s in student]
    try:
        tree = ast.parse(textwrap.dedent("\n".join(block)))
    except SyntaxError as err:
        raise NotebookError(f"{where}: the solution block does not parse ({err}); fix the solution cell") from None
    names: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.FunctionDef):
            raise NotebookError(
                f"{where}: a solution block defining a function needs '# STUDENT:' lines for the student's version"
            )
        for t in targets:
            for n in ast.walk(t) if t is not None else []:
                if isinstance(n, ast.Name) and n.id not in names:
                    names.append(n.id)
    if not names:
        raise NotebookError(f"{where}: the solution block assigns nothing; add '# STUDENT:' lines")
    return [f"{indent}{n} = None  # YOUR CODE HERE" for n in names]


def strip_solution(source: str, where: str = "cell") -> str:
    """The student's version of one code cell's source."""
    lines = source.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == BEGIN:
            try:
                j = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == END)
            except StopIteration:
                raise NotebookError(f"{where}: '{BEGIN}' without '{END}'") from None
            block = lines[i + 1 : j]
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            out.extend(_placeholder([indent + ln.lstrip() if not ln.strip() else ln for ln in block] or [indent],
                                    where))
            i = j + 1
        else:
            if lines[i].strip() == END:
                raise NotebookError(f"{where}: '{END}' without '{BEGIN}'")
            out.append(lines[i])
            i += 1
    return "\n".join(out)


def hint_markdown(name: str, exercise: Any) -> str:
    """The one line under an exercise's check: how to get help, a hint at a time, and when the solution comes."""
    n = len(getattr(exercise, "hints", ()) or ())
    hints = f"`ex.{name}.hint()` gives the next of its {n} hints, one per call" if n else "it has no hints"
    return (f"**Stuck?** {hints}; `ex.{name}.solution()` shows the worked solution once you have checked an "
            "attempt.")


def _exercise_module(nb: Any) -> Any:
    """The exercise module a notebook imports as ``ex``, or None (a notebook without exercises)."""
    found = next((m for c in nb.cells if c.cell_type == "code" for m in EXERCISES_IMPORT.finditer(c.source)), None)
    if found is None:
        return None
    try:
        return importlib.import_module(f"lab_utils.exercises.{found[1]}")
    except Exception as err:  # the hints come from the module: without it the lab cannot be written
        raise NotebookError(f"cannot import lab_utils.exercises.{found[1]} to write its hints ({err})") from None


def _hint_cells(cell: Any, module: Any, where: str) -> list[Any]:
    """The hints cell under each exercise a code cell checks; under an optional cell, optional too."""
    cells = []
    for name in dict.fromkeys(CHECK_CALL.findall(cell.source)):  # each exercise once, in the cell's order
        exercise = getattr(module, name, None) if module is not None else None
        if exercise is None:
            owner = module.__name__ if module is not None else "no exercise module (import one as `ex`)"
            raise NotebookError(f"{where}: ex.{name}.check(...) but {owner} has no {name}")
        hints = new_markdown_cell(hint_markdown(name, exercise), id=f"{cell.id}-hint-{name}"[:64])
        if OPTIONAL_TAG in cell.metadata.get("tags", []):
            hints.metadata["tags"] = [OPTIONAL_TAG]
        cells.append(hints)
    return cells


def _answer_cells(cell: Any, where: str) -> list[Any]:
    """A markdown cell with an answers block, as the lab shows it: the text before, an attempt cell, the answers
    folded, the text after."""
    out, rest, n = [], cell.source, 0
    while (m := MD_ANSWERS.search(rest)) is not None:
        before, rest = rest[: m.start()].strip("\n"), rest[m.end():]
        suffix = f"-{n}" if n else ""
        if before:
            out.append(new_markdown_cell(before, id=cell.id if not out else f"{cell.id}-text{suffix}"[:64]))
        out.append(new_markdown_cell(ATTEMPT_PLACEHOLDER, id=f"{cell.id}-attempt{suffix}"[:64]))
        answers = m[1].strip("\n")
        out.append(new_markdown_cell(f"<details><summary>Answers</summary>\n\n{answers}\n\n</details>",
                                     id=f"{cell.id}-answers{suffix}"[:64]))
        n += 1
    if "ANSWERS -->" in rest:
        raise NotebookError(f"{where}: '<!-- BEGIN ANSWERS -->' and '<!-- END ANSWERS -->' do not pair up")
    if rest.strip("\n"):
        out.append(new_markdown_cell(rest.strip("\n"), id=f"{cell.id}-after"[:64]))
    for c in out:
        c.metadata.update(cell.metadata)
    return out


def build_lab(solution: Any) -> Any:
    """The student notebook (an ``nbformat`` node) for a solution notebook: placeholders, no outputs, hints under
    each exercise's check and the understanding questions' answers folded after an attempt cell."""
    nb = copy.deepcopy(solution)
    module = _exercise_module(nb)
    cells = []
    for i, cell in enumerate(nb.cells):
        where = f"cell {i}"
        extra = []
        if cell.cell_type == "code":
            extra = _hint_cells(cell, module, where)
            source = strip_solution(cell.source, where)
            # nbval's marker matters only in solutions (labs are not compared): keep it out of students' way
            cell.source = "\n".join(ln for ln in source.split("\n") if ln.strip() != CHECK_MARKER)
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            cell.source = MD_BLOCK.sub(MD_PLACEHOLDER, cell.source)
        cell.metadata.pop("execution", None)
        if cell.cell_type == "markdown" and "ANSWERS -->" in cell.source:
            cells.extend(_answer_cells(cell, where))
        else:
            cells.append(cell)
        cells.extend(extra)
    nb.cells = cells
    nb.metadata.pop("papermill", None)
    nb.metadata.get("language_info", {}).pop("version", None)
    return nb


def notebook_text(nb: Any) -> str:
    return nbformat.writes(nb) + "\n"


def build_labs(check: bool = False, root: Path | None = None) -> list[str]:
    """Write ``labs/`` from ``solutions/``; with ``check`` write nothing and return the drifted files."""
    root = root or repo_root()
    src, dst = root / "solutions", root / "labs"
    changed = []
    if not (solutions := sorted(src.glob(NOTEBOOK_GLOB))):
        raise NotebookError(f"no solution notebooks in {src}")
    expected_names = {p.name for p in solutions}
    for p in solutions:
        try:
            nb = nbformat.read(p, as_version=4)
            text = notebook_text(build_lab(nb))
        except NotebookError as err:
            raise NotebookError(f"{p.name}: {err}") from None
        target = dst / p.name
        if not target.exists() or target.read_text() != text:
            changed.append(target.name)
            if not check:
                dst.mkdir(exist_ok=True)
                target.write_text(text)
    for extra in sorted(dst.glob(NOTEBOOK_GLOB)):
        if extra.name not in expected_names:
            changed.append(f"{extra.name} (no solution)")
            if not check:
                extra.unlink()
    return changed


def update_expected(solution: Path, executed: Path) -> int:
    """Copy the outputs of ``# NBVAL_CHECK_OUTPUT`` cells from an executed run into the solution.

    Those outputs are what nbval compares against; every other cell of the solution stays without
    outputs. Returns the number of cells that now carry expected output."""
    sol = nbformat.read(solution, as_version=4)
    ran = {c.get("id"): c for c in nbformat.read(executed, as_version=4).cells}
    kept = 0
    for cell in sol.cells:
        if cell.cell_type != "code":
            continue
        cell.execution_count = None
        cell.outputs = []
        if CHECK_MARKER in cell.source and cell.get("id") in ran:
            cell.outputs = ran[cell.id].outputs
            cell.execution_count = ran[cell.id].execution_count  # nbval skips cells it thinks unrun
            kept += 1
        cell.metadata.pop("execution", None)
        cell.metadata.pop("papermill", None)
    sol.metadata.pop("papermill", None)
    solution.write_text(notebook_text(sol))
    return kept


# --- execution ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    notebook: str
    output: Path
    seconds: float
    ok: bool
    error: str = ""
    skipped: int = 0  # optional code cells left unrun (skip_optional)


def select(names: Iterable[str], all_: bool, solutions: bool, root: Path | None = None) -> list[Path]:
    """Notebook paths for lab numbers (``"01"``, ``"1"``, ``"01_cuda_timing"``) or every lab."""
    root = root or repo_root()
    folder = root / ("solutions" if solutions else "labs")
    present = sorted(folder.glob(NOTEBOOK_GLOB))
    if all_:
        return present
    if not (names := list(names)):
        raise ValueError("name the labs to run (e.g. `nvlab run 00 01`) or pass --all")
    paths = []
    for n in names:
        lab = lab_by_number(n)
        p = folder / lab.filename
        if not p.exists():
            have = ", ".join(x.stem for x in present) or "none"
            raise ValueError(f"lab {lab.number} ({lab.slug}) has no notebook in {folder.name}/ yet; present: {have}")
        paths.append(p)
    return paths


TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def literal(text: str) -> Any:
    """A value as papermill takes it: a Python literal when it parses, else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def declared_parameters(path: Path) -> dict[str, Any]:
    """Name -> default (``...`` when not a literal) of each assignment in the ``parameters``-tagged cell."""
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises several kinds for a broken file
        raise NotebookError(f"{path}: cannot read the notebook ({err})") from None
    cell = next((c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])), None)
    if cell is None:
        return {}
    try:
        tree = ast.parse(cell.source)
    except SyntaxError as err:
        raise NotebookError(f"{path.name}: the parameters cell does not parse ({err})") from None
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        try:
            default = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError):
            default = ...
        found.update({t.id: default for t in targets if isinstance(t, ast.Name)})
    return found


def parse_parameter(name: str, text: str, default: Any) -> Any:
    """``-p NAME TEXT`` as the type of the declared ``default``; ValueError says what is allowed."""
    if isinstance(default, bool):
        if text.strip().lower() in TRUE:
            return True
        if text.strip().lower() in FALSE:
            return False
        raise ValueError(f"-p {name} {text!r}: {name} is true or false: give one of {', '.join(TRUE + FALSE)}")
    for kind, what in ((int, "a whole number"), (float, "a number")):
        if isinstance(default, kind):
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"-p {name} {text!r}: {name} is {what} (default {default})") from None
    if isinstance(default, str):
        value = literal(text)  # a quoted string stays a string; anything else is the text itself
        return value if isinstance(value, str) else text
    if isinstance(default, (list, tuple, dict)):
        value = literal(text)
        if not isinstance(value, type(default)):
            raise ValueError(f"-p {name} {text!r}: {name} is a {type(default).__name__}, e.g. {default!r}")
        return value
    value = literal(text)
    if default is None:  # "None: picked for the hardware" — every such parameter of the course is numeric
        numbers = isinstance(value, (int, float)) and not isinstance(value, bool)
        listed = isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        if not (value is None or numbers or listed):
            raise ValueError(f"-p {name} {text!r}: {name} takes a number or a list of numbers such as [1, 8, 32] "
                             "(its default, None, picks one for the hardware)")
    return value


def parameters_for(paths: list[Path], pairs: Iterable[tuple[str, str]]) -> dict[Path, dict[str, Any]]:
    """Each notebook's parameters from ``-p NAME VALUE`` pairs, typed by its parameters cell.

    A name no notebook declares is a ValueError listing the valid names; a name only some declare goes to those."""
    declared = {p: declared_parameters(p) for p in paths}
    params: dict[Path, dict[str, Any]] = {p: {} for p in paths}
    for name, text in pairs:
        if not (takers := [p for p in paths if name in declared[p]]):
            valid = sorted({n for d in declared.values() for n in d})
            which = f"{paths[0].stem} has" if len(paths) == 1 else "the selected notebooks have"
            raise ValueError(f"-p {name}: {which} no parameter {name!r}; valid names: {', '.join(valid) or 'none'}")
        for p in takers:
            params[p][name] = parse_parameter(name, text, declared[p][name])
    return params


def leftover_processes(run_id: str) -> list[str]:
    """Processes still alive that inherited ``NVLAB_RUN_ID=run_id``: anything a notebook failed to stop."""
    found = []
    for p in psutil.process_iter(["status"]):
        # a zombie has already ended; its parent just has not reaped it
        if p.pid == os.getpid() or p.info["status"] in ENDED:
            continue
        with contextlib.suppress(psutil.Error):  # gone, or another user's process
            if p.environ().get(RUN_ID_ENV) == run_id:
                found.append(f"{p.pid} {' '.join(p.cmdline())}".strip())
    return found


def orphaned_processes(root: Path | None = None) -> list[psutil.Process]:
    """Live processes whose program lies in a course folder (``nvlab-<what>-<pid>-<random>`` under ``root``, the
    temporary folder by default) of an owner that is gone: a python-backend stub whose kernel and server were killed
    (seen on a GPU: it catches SIGTERM, outlived its group, and kept 742 MiB of GPU memory)."""
    prefix = f"{Path(root or tempfile.gettempdir()).resolve()}/"
    found = []
    for p in psutil.process_iter(["exe", "cmdline", "status"]):
        if p.info["status"] in ENDED:
            continue
        # the folder may already be swept: a deleted program's exe reads "<path> (deleted)", its argv[0] stays
        for program in (p.info["exe"] or "", *(p.info["cmdline"] or [""])[:1]):
            folder = program[len(prefix):].split("/", 1)[0] if program.startswith(prefix) else ""
            if (m := OWNED_NAME.match(folder)) and not pid_alive(int(m.group(1))):
                found.append(p)
                break
    return found


def end_orphans(root: Path | None = None, grace_s: float = 2.0) -> list[str]:
    """End :func:`orphaned_processes` (SIGTERM, then SIGKILL for those alive ``grace_s`` seconds later); what was
    ended, one ``"PID program"`` each."""
    found = orphaned_processes(root)
    ended = []
    for p in found:
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile is not listed
            p.terminate()
            ended.append(f"{p.pid} {(p.info['cmdline'] or [p.info['exe'] or '?'])[0]}")
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return ended


def without_optional(nb: Any) -> tuple[Any, int]:
    """A copy of ``nb`` whose code cells tagged ``optional`` are raw cells (papermill and nbclient run only code
    cells: the optional sections stay visible in the executed notebook, unrun), and how many were skipped."""
    nb = copy.deepcopy(nb)
    skipped = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and OPTIONAL_TAG in cell.metadata.get("tags", []):
            raw = nbformat.v4.new_raw_cell(cell.source, metadata=cell.metadata)
            if "id" in cell:
                raw.id = cell.id
            nb.cells[i] = raw
            skipped += 1
    return nb, skipped


def execute(path: Path, out_dir: Path, parameters: dict[str, Any], run_id: str | None = None,
            timeout_s: int = 1800, skip_optional: bool = False) -> RunResult:
    """Execute one notebook with papermill into ``out_dir``; failures name the notebook and the cell.

    ``skip_optional``: the code cells tagged ``optional`` are not run (a student's core path)."""
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    run_id = run_id or uuid.uuid4().hex
    saved = {k: os.environ.get(k) for k in (RUN_ID_ENV, "NVLAB_RESULTS_DIR")}
    os.environ[RUN_ID_ENV] = run_id
    os.environ["NVLAB_RESULTS_DIR"] = str(out_dir.resolve())
    source: Any = str(path)
    skipped = 0
    if skip_optional:
        try:
            source, skipped = without_optional(nbformat.read(path, as_version=4))
        except Exception as err:  # nbformat raises several kinds for a broken file
            return RunResult(path.name, output, 0.0, False, f"{path.name}: cannot read the notebook ({err})")
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(source, str(output), parameters=parameters, kernel_name="python3",
                            progress_bar=sys.stderr.isatty(), cwd=str(path.parent), execution_timeout=timeout_s)
    except pm.PapermillExecutionError as err:
        cell = f"cell {err.cell_index} (execution count {err.exec_count})"
        msg = f"{path.name} failed in {cell}: {err.ename}: {err.evalue}; executed notebook: {output}"
        return RunResult(path.name, output, time.perf_counter() - t0, False, msg)
    except Exception as err:  # kernel died, timeout, bad parameter: still name the notebook
        return RunResult(path.name, output, time.perf_counter() - t0, False, f"{path.name} failed: {err}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return RunResult(path.name, output, time.perf_counter() - t0, True, skipped=skipped)


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TEMP_PATH = re.compile(r"/tmp/[A-Za-z0-9_.-]+")
SITE_PACKAGES = re.compile(r"/[^\s\"']*/site-packages/")  # an interpreter's install path in a warning


def scrub(path: Path, paths: dict[str, str]) -> int:
    """Make an executed notebook fit to commit: ANSI codes out of text outputs, papermill's input/output paths
    out of the metadata, each key of ``paths`` (a checkout, an output folder) replaced by its value, and temporary
    folders by ``/tmp/...`` and interpreter paths by ``site-packages/``. Returns how many outputs changed."""
    nb = nbformat.read(path, as_version=4)
    meta = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        meta.pop(key, None)
    ordered = sorted(paths.items(), key=lambda kv: -len(kv[0]))  # longest first: /a/b before /a

    def clean(text: str) -> str:
        text = ANSI.sub("", text)
        for old, new in ordered:
            text = text.replace(old, new)
        return SITE_PACKAGES.sub("site-packages/", TEMP_PATH.sub("/tmp/...", text))

    changed = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            before = repr(out)
            if "text" in out:
                out["text"] = clean(out["text"])
            for mime in ("text/plain", "text/html", "text/markdown"):
                if mime in out.get("data", {}):
                    out["data"][mime] = clean(out["data"][mime])
            if "traceback" in out:
                out["traceback"] = [clean(line) for line in out["traceback"]]
            changed += repr(out) != before
    nbformat.write(nb, path)
    return changed
