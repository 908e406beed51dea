"""The GitHub Actions workflows, validated against the GitHub workflow schema, and what the GPU job must do."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
CI = ROOT / ".github" / "workflows" / "ci.yml"
# NVIDIA's recommended flags for its framework containers, and NVLink multicast off on shared runners.
GPU_DOCKER_FLAGS = ("--gpus all", "--ipc=host", "--ulimit memlock=-1", "--ulimit stack=67108864",
                    "-e NCCL_NVLS_ENABLE=0")


def check_jsonschema() -> str:
    found = Path(sys.executable).with_name("check-jsonschema")
    path = str(found) if found.exists() else shutil.which("check-jsonschema")
    if not path:
        pytest.fail("check-jsonschema is not installed: pip install -e '.[test]'")
    return path


@pytest.fixture(scope="module")
def ci() -> dict:
    return yaml.safe_load(CI.read_text())


def _on(workflow: dict) -> dict:
    return workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key `on` as True


@pytest.mark.parametrize("schema", ["vendor.github-workflows", "custom.github-workflows-require-timeout"])
def test_workflows_validate(schema):
    assert WORKFLOWS, "no workflow files"
    out = subprocess.run([check_jsonschema(), "--builtin-schema", schema, *map(str, WORKFLOWS)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_workflow_schema_check_is_really_checking(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  x:\n    runs-on: ubuntu-24.04\n    steps: oops\n")
    out = subprocess.run([check_jsonschema(), "--builtin-schema", "vendor.github-workflows", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


def test_least_privilege_concurrency_and_timeouts(ci):
    assert ci["permissions"] == {"contents": "read"}
    assert "group" in ci["concurrency"] and "github.ref" in ci["concurrency"]["group"]
    for name, job in ci["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), f"job {name} has no timeout"
    assert {"push", "pull_request"} <= set(_on(ci))


def test_cpu_job_is_what_ci_run_does(ci):
    cpu = ci["jobs"]["cpu"]
    runs = [s.get("run", "") for s in cpu["steps"]]
    assert "bash .ci/run" in runs


def test_gpu_job(ci):
    gpu = ci["jobs"]["gpu"]
    assert gpu["runs-on"] == ["self-hosted", "linux", "x64", "gpu"]
    # never for pull requests from forks
    assert gpu["if"] == ("github.event_name != 'pull_request' || "
                         "github.event.pull_request.head.repo.full_name == github.repository")
    flags = " ".join(gpu["env"]["GPU_FLAGS"].split())
    for flag in GPU_DOCKER_FLAGS:
        assert flag in flags, flag
    script = "\n".join(s.get("run", "") for s in gpu["steps"])
    assert "docker build" in script and "-f docker/Dockerfile" in script
    docker_runs = [ln for ln in script.splitlines() if ln.strip().startswith("docker run")]
    assert docker_runs and all("$GPU_FLAGS" in ln for ln in docker_runs)
    assert "nvlab doctor --require-gpu" in script
    assert re.search(r"nvlab run --all --solutions --out /out/run", script)
    assert "nvlab report /out/run" in script
    upload = next(s for s in gpu["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()" and upload["with"]["path"] == "${{ env.OUT }}"
    cleanup = gpu["steps"][-1]
    assert cleanup["if"] == "always()" and 'docker rm -f "$CONTAINER"' in cleanup["run"]
