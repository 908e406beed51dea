"""The version manifest and everything that must agree with it: Dockerfile, docker/.env, compose.yaml, ./course."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils.course import probe as env
from lab_utils.course import stack

ROOT = Path(__file__).resolve().parent.parent
SRC = stack.MANIFEST_NAME


def test_the_checkout_agrees_with_the_manifest():
    problems = stack.check(ROOT)
    assert problems == [], "\n".join(problems)


def test_docker_env_is_generated_from_the_manifest():
    assert (ROOT / "docker" / ".env").read_text() == stack.compose_env(), (
        "docker/.env differs from the manifest: python -m lab_utils.course.stack env > docker/.env")


def test_pinned_release_states_every_version_and_a_matching_client():
    rel = stack.pinned_release()
    for f in stack.PINNED_FIELDS:
        assert rel[f], f
    assert rel["tritonclient"] == rel["triton_server"]
    assert set(rel["images"]) == {"pytorch", "tritonserver"}


@pytest.fixture
def checkout(tmp_path):
    """A copy of the files the check reads, to break one at a time."""
    for rel in ("docker/Dockerfile", "docker/.env", "docker/compose.yaml", "course", "pyproject.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    assert stack.check(tmp_path) == []
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_dockerfile_mismatch_names_both_sides(checkout):
    tag = stack.pinned_release()["tag"]
    _edit(checkout / "docker" / "Dockerfile", f"ARG NGC_TAG={tag}", "ARG NGC_TAG=25.01")
    (msg,) = stack.check(checkout)
    assert "docker/Dockerfile" in msg and "NGC_TAG=25.01" in msg and SRC in msg and tag in msg


def test_env_file_mismatch_names_both_sides(checkout):
    tag = stack.pinned_release()["tag"]
    _edit(checkout / "docker" / ".env", f"NGC_TAG={tag}", "NGC_TAG=25.01")
    problems = stack.check(checkout)
    # .env disagrees, and through it the compose file's images and build arguments do too.
    assert any("docker/.env sets NGC_TAG=25.01" in p and SRC in p and tag in p for p in problems), problems
    assert any("tritonserver:25.01-py3" in p and f"tritonserver:{tag}-py3" in p for p in problems), problems


def test_hardcoded_compose_image_is_caught(checkout):
    _edit(checkout / "docker" / "compose.yaml", "prom/prometheus:${PROMETHEUS_VERSION}", "prom/prometheus:latest")
    (msg,) = stack.check(checkout)
    assert "service prometheus runs image prom/prometheus:latest" in msg
    assert stack.env_values()["PROMETHEUS_VERSION"] in msg and SRC in msg


def test_course_pin_mismatch_names_both_sides(checkout):
    pin = stack.manifest()["course"]["nvidia-pytriton"]
    _edit(checkout / "course", f"nvidia-pytriton=={pin}", "nvidia-pytriton==0.5.9")
    (msg,) = stack.check(checkout)
    assert "./course pins nvidia-pytriton==0.5.9" in msg and pin in msg and SRC in msg


def test_manifest_client_must_match_server(checkout):
    m = stack.manifest()
    tag = m["pinned"]
    broken = {**m, "ngc": {**m["ngc"], tag: {**m["ngc"][tag], "tritonclient": "2.50.0"}}}
    problems = stack.check(checkout, broken)
    assert any("Triton server 2.73.0 with tritonclient 2.50.0" in p for p in problems), problems
    # ...and the Dockerfile's and .env's TRITONCLIENT_VERSION now disagree with it, naming both values.
    assert any("docker/Dockerfile has ARG TRITONCLIENT_VERSION=2.73.0" in p and "2.50.0" in p for p in problems)


def test_interpolation_follows_compose():
    assert stack.interpolate("a:${X}-py3", {"X": "1"}) == "a:1-py3"
    assert stack.interpolate("${P:-8888}", {}) == "8888"
    with pytest.raises(KeyError, match="set JUPYTER_TOKEN"):
        stack.interpolate("${JUPYTER_TOKEN:?set JUPYTER_TOKEN please}", {})


def test_lab00_tables_read_the_manifest():
    rows = env.container_verdicts("13.0")
    images = {r["image"]: r["CUDA runtime"] for r in rows}
    for entry in stack.ngc_images():
        assert images[entry["image"]] == entry["cuda"]
    rel = stack.pinned_release()
    assert images[f"nvcr.io/nvidia/pytorch:{rel['tag']}-py3"] == rel["cuda"]
    table = env.stack_table(env.probe())
    column = f"course image (NGC {rel['tag']})"
    by_layer = {r["layer"]: r[column] for r in table}
    assert by_layer["framework: PyTorch"] == rel["torch"] and by_layer["CUDA-X: TensorRT"] == rel["tensorrt"]


def test_module_check_and_env_commands():
    out = subprocess.run([sys.executable, "-m", "lab_utils.course.stack", "check"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "lab_utils.course.stack", "env"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.stdout == stack.compose_env()
