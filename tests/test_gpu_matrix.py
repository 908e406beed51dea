"""scripts/gpu_matrix.sh, the classroom check of generated labs and solutions within a time budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.nightly  # 30 s of doctor and one papermill run: the nightly set
@pytest.mark.notebooks
def test_matrix_runs_what_its_budget_covers_and_lists_the_rest(tmp_path):
    out = tmp_path / "m"
    # the script runs `python3`: this interpreter's, as in an activated environment, however pytest was started
    env = {**os.environ, "NVLAB_QUICK": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # the second entry is a lab that does not exist: whether the budget is spent by then or not, it is never "ok"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_matrix.sh"), str(out), "25", "solutions/00:quick",
                          "labs/99:full"], capture_output=True, text=True, env=env, timeout=300)
    rows = [line.split("\t") for line in (out / "matrix.tsv").read_text().splitlines()]
    assert rows[0] == ["notebook", "mode", "seconds", "result"], run.stdout + run.stderr
    assert rows[1][:2] == ["solutions/00", "quick"] and rows[1][3] == "ok", (rows, run.stderr)
    assert rows[2][:2] == ["labs/99", "full"] and rows[2][3] != "ok"  # no lab 99: failed or not run, never ok
    nb = out / "solutions-00-quick" / "00_environment.ipynb"
    assert nb.is_file() and str(tmp_path) not in nb.read_text()  # scrubbed: no path of this machine
    assert (out / "doctor.txt").is_file()
