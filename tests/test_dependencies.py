"""Every third-party package the course imports is declared in pyproject.toml, in the extra that needs it: deptry
over lab_utils, scripts and the solutions (its settings: pyproject.toml's [tool.deptry])."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lab_utils.course.catalog import repo_root


def deptry(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        import deptry  # noqa: F401
    except ImportError:
        pytest.fail("deptry is not installed: pip install -e '.[test]' (the test extra declares it)")
    return subprocess.run([sys.executable, "-m", "deptry", *args, "--no-ansi"], capture_output=True, text=True,
                          cwd=repo_root(), timeout=300)


def test_every_import_is_declared():
    out = deptry(".")
    assert out.returncode == 0, (
        f"an import no extra of pyproject.toml declares (declare it in the extra that needs it):\n"
        f"{out.stdout}{out.stderr}")


def test_an_undeclared_import_is_caught(tmp_path):
    """The check can fail: multidict is installed (aiohttp needs it) but declared nowhere, so importing it is an
    undeclared dependency; the declared aiohttp beside it is not."""
    (tmp_path / "planted.py").write_text("import multidict\nimport aiohttp\n")
    out = deptry(str(tmp_path), "--config", str(repo_root() / "pyproject.toml"))
    said = out.stdout + out.stderr
    assert out.returncode == 1 and "DEP003 'multidict'" in said and "'aiohttp'" not in said, said
