"""The GitHub Actions workflows, validated against the GitHub workflow schema (every job with a timeout too), their
``run:`` steps by bash's parser, and the nvlab commands the GPU job runs by nvlab's. The guide's copies of the GPU
job's commands are tests/test_trainer_guide.py's."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nvlab import cli

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
CI = ROOT / ".github" / "workflows" / "ci.yml"


def check_jsonschema() -> str:
    found = Path(sys.executable).with_name("check-jsonschema")
    path = str(found) if found.exists() else shutil.which("check-jsonschema")
    if not path:
        pytest.fail("check-jsonschema is not installed: pip install -e '.[test]'")
    return path


@pytest.fixture(scope="module")
def ci() -> dict:
    return yaml.safe_load(CI.read_text())


# A workflow each schema must reject: one call validates the real files and shows the schema is really checking.
BROKEN = {
    "vendor.github-workflows": "on: push\njobs:\n  x:\n    runs-on: ubuntu-24.04\n    timeout-minutes: 5\n"
                               "    steps: oops\n",
    "custom.github-workflows-require-timeout": "on: push\njobs:\n  x:\n    runs-on: ubuntu-24.04\n    steps:\n"
                                              "      - run: 'true'\n",  # no timeout-minutes
}


@pytest.mark.parametrize("schema", sorted(BROKEN))
def test_workflows_validate_and_a_broken_one_does_not(schema, tmp_path):
    assert WORKFLOWS, "no workflow files"
    bad = tmp_path / "broken.yml"
    bad.write_text(BROKEN[schema])
    out = subprocess.run([check_jsonschema(), "--builtin-schema", schema, *map(str, WORKFLOWS), str(bad)],
                         capture_output=True, text=True, timeout=120)
    report = out.stdout + out.stderr
    assert out.returncode == 1 and f"{bad}::" in report, report
    assert not any(f"{w}::" in report for w in WORKFLOWS), report


def run_steps(workflow: dict) -> list[tuple[str, str]]:
    """(job/step, script) of every ``run:`` step, GitHub's ${{ ... }} expressions replaced by a plain word."""
    return [(f"{job}/{step.get('name', i)}", re.sub(r"\$\{\{.*?\}\}", "EXPR", step["run"]))
            for job, spec in workflow["jobs"].items() for i, step in enumerate(spec.get("steps", [])) if "run" in step]


def bash_syntax_errors(script: str) -> str:
    out = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=60)
    return out.stderr if out.returncode else ""


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_run_step_is_valid_bash(path):
    steps = run_steps(yaml.safe_load(path.read_text()))
    assert steps
    errors = {name: err for name, script in steps if (err := bash_syntax_errors(script))}
    assert not errors, errors


def test_bash_check_is_really_checking():
    assert bash_syntax_errors('if [ -n "$X" ]; then\n  docker run "$IMAGE"\n')  # no fi
    assert bash_syntax_errors("docker rm -f \"$CONTAINER\" || true") == ""


def test_nvlab_commands_of_the_gpu_job_parse(ci):
    """What the GPU job runs in the image (nvlab doctor, run, report) is accepted by nvlab's own parser."""
    script = "\n".join(s for _, s in run_steps(ci)).replace("\\\n", " ")
    commands = [shlex.split(c) for c in re.findall(r"(?<![\w-])nvlab [^|&;>'\n]*", script)]
    assert {c[1] for c in commands} >= {"doctor", "run", "report"}
    for argv in commands:
        try:
            cli.parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"the workflow runs `{shlex.join(argv)}`, which nvlab does not accept")


def test_gpu_job_runs_the_browser_test_and_keeps_its_screenshots(ci):
    """The browser test runs in the lab image too, required (not skipped), its screenshots in the uploaded folder."""
    steps = ci["jobs"]["gpu"]["steps"]
    runs = [s for s in steps if "tests/test_browser.py" in s.get("run", "")]
    assert len(runs) == 1, "the GPU job runs tests/test_browser.py once"
    script = runs[0]["run"]
    assert runs[0].get("if") == "always()", "the browser test runs even when a lab failed"
    assert "NVLAB_REQUIRE_BROWSER=1" in script and "NVLAB_SCREENSHOTS=/out/" in script
    assert '-v "$OUT:/out"' in script
    uploads = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact")]
    assert any(u["with"]["path"] == "${{ env.OUT }}" and u.get("if") == "always()" for u in uploads)
    # torch is the image's: the install is held by the image's pip constraint file
    assert "--constraint" in script and "torch" not in script
