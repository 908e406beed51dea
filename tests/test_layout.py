"""The packages' layout: every module imports, imports only go downward (``nvlab``, the command, sits above
``lab_utils``, the labs' library), no cycles, no torch where none is needed."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils.course.catalog import repo_root

PACKAGES = [repo_root() / "lab_utils", repo_root() / "nvlab"]

# Layers from the bottom up: a module may import its own package and anything on a lower layer, nothing above.
LAYERS = [
    # the argument checks, under everything: every module that takes a number from a user checks it there
    {"lab_utils", "lab_utils.args"},
    {"lab_utils.procs", "lab_utils.timing", "lab_utils.plotting"},
    # one owned server's lifecycle, on the process primitives: what every server class of the course is
    {"lab_utils.owned"},
    # course.probe is the one place that locates programs (find_<program>() -> str | None), below all that run them
    {"lab_utils.course"},
    # what exists only because of the course's environment (the pytriton wheel, Debian 12, tensorrt-stubs): above the
    # process primitives and the probes, below every module that uses the stack as it is meant to be used
    {"lab_utils.compat"},
    {"lab_utils.models"},
    {"lab_utils.gpu", "lab_utils.distributed", "lab_utils.inference", "lab_utils.profiling"},
    # serving builds what inference exports (lab 07's ensemble serves the ONNX classifier)
    {"lab_utils.serving"},
    {"lab_utils.monitoring"},
    # lab 08's lifecycle drives the service's servers and reads Prometheus: beside monitoring's users
    {"lab_utils.mlops"},
    {"lab_utils.exercises"},
    # interactive panels drive measurements, servers, Prometheus and the quiz: above all of them
    {"lab_utils.widgets"},
    # the course's command, its own package above the labs' library: maintainer tools, then the classroom hub (starts
    # servers of the course for a whole class, and the trainer's progress page), then the command line
    {"nvlab"},
    {"nvlab.ops"},
    {"nvlab.classroom"},
    {"nvlab.cli"},
    {"nvlab.__main__"},
]

# What a student without torch, a trainer and CI tooling import: none of it may pull torch in.
TORCH_FREE = ["lab_utils", "nvlab.cli", "lab_utils.course.session", "lab_utils.course.probe",
              "lab_utils.course.results", "lab_utils.course.stack", "nvlab.ops.stack", "nvlab.ops.notebooks",
              "nvlab.ops.pacing", "nvlab.ops.wheelhouse", "lab_utils.monitoring.gpu_exporter",
              "lab_utils.plotting", "lab_utils.timing", "lab_utils.procs", "lab_utils.compat.numpy1_env",
              "lab_utils.compat.glibc", "lab_utils.compat.tensorrt_stubs", "lab_utils.course.progress",
              "nvlab.classroom.progress_service"]


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(p for pkg in PACKAGES for p in pkg.rglob("*.py")):
        parts = p.relative_to(repo_root()).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _unit(module: str) -> str:
    """The layer unit a module belongs to: its subpackage (lab_utils.serving) or itself (lab_utils.timing)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _layer(module: str) -> int:
    unit = _unit(module)
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """lab_utils modules that ``path`` imports anywhere in it (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative (ruff forbids them; resolved anyway, so one cannot hide an upward import)
                package = path.relative_to(repo_root()).parts[:-1]  # a module's package, or __init__'s own
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_every_module_has_a_layer():
    missing = [m for m in _modules() if not any(_unit(m) in layer for layer in LAYERS)]
    assert not missing, f"add these to LAYERS in tests/test_layout.py: {missing}"


def test_imports_only_go_downward_and_have_no_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # Up a layer, or sideways between two subpackages of one layer (serving -> inference), is not allowed.
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
              if _layer(d) > _layer(m) or (_layer(d) == _layer(m) and _unit(d) not in (_unit(m), "lab_utils"))]
    assert not upward, "imports that go up or sideways between subpackages:\n" + "\n".join(sorted(upward))
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_module_imports_in_a_fresh_interpreter():
    # Triton python-backend models import only inside Triton's stub (triton_python_backend_utils, and the course's
    # nvlab_triton_model copied beside them in a repository): the ensemble tests load them in a real server.
    # Importing starts no work: no thread is running after every module has been imported.
    names = [m for m in _modules() if not m.endswith("__main__") and not m.startswith("lab_utils.serving.backend.")]
    code = ("import importlib, sys, threading, traceback\nbad = []\n"
            f"for name in {names!r}:\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception:\n        bad.append(name + ': ' + traceback.format_exc(limit=1))\n"
            "bad += [f'a thread runs after the imports: {t!r}' for t in threading.enumerate()\n"
            "        if t is not threading.main_thread()]\n"
            "print('\\n'.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root(), timeout=300)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_the_cli_and_course_machinery_import_without_torch():
    code = (f"import importlib, sys\nfor n in {TORCH_FREE!r}:\n    importlib.import_module(n)\n"
            "print(sorted(m for m in ('torch', 'tensorrt', 'tritonclient', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {TORCH_FREE} pulled in {out.stdout.strip()}"


MAX_MODULE_LINES = 600


def test_no_module_over_600_lines():
    # One concern per module: a module past this is split by concern (a lab's exercises into a package, one module
    # per exercise group), not allowed to grow
    long = {str(p.relative_to(repo_root())): n for p in sorted(_modules().values())
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_tree_passes_ruff_as_the_readme_says():
    """README: `ruff check .` passes, notebooks included (the generated labs too: a lint error in a solution reaches
    every student's copy)."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", ".", "--no-cache", "--output-format", "concise"],
                         capture_output=True, text=True, cwd=repo_root(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
