"""The version manifest and everything that must agree with it: Dockerfile, docker/.env, compose.yaml, ./course,
the Triton image the server module suggests; versions as pip reports them in an NGC image."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils.course import probe as env
from lab_utils.course import stack
from nvlab.ops import stack as stack_files

ROOT = Path(__file__).resolve().parent.parent
SRC = stack.MANIFEST_NAME


def test_the_checkout_agrees_with_the_manifest():
    problems = stack_files.check(ROOT)
    assert problems == [], "\n".join(problems)


def test_docker_env_is_generated_from_the_manifest():
    assert (ROOT / "docker" / ".env").read_text() == stack_files.compose_env(), (
        "docker/.env differs from the manifest: python -m nvlab.ops.stack env > docker/.env")


@pytest.fixture
def checkout(tmp_path):
    """A copy of the files the check reads, to break one at a time."""
    for rel in ("docker/Dockerfile", "docker/.env", "docker/compose.yaml", "course", "pyproject.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    assert stack_files.check(tmp_path) == []
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_dockerfile_mismatch_names_both_sides(checkout):
    tag = stack.pinned_release()["tag"]
    _edit(checkout / "docker" / "Dockerfile", f"ARG NGC_TAG={tag}", "ARG NGC_TAG=25.01")
    (msg,) = stack_files.check(checkout)
    assert "docker/Dockerfile" in msg and "NGC_TAG=25.01" in msg and SRC in msg and tag in msg


def test_env_file_mismatch_names_both_sides(checkout):
    tag = stack.pinned_release()["tag"]
    _edit(checkout / "docker" / ".env", f"NGC_TAG={tag}", "NGC_TAG=25.01")
    problems = stack_files.check(checkout)
    # .env disagrees, and through it the compose file's images and build arguments do too.
    assert any("docker/.env sets NGC_TAG=25.01" in p and SRC in p and tag in p for p in problems), problems
    assert any("tritonserver:25.01-py3" in p and f"tritonserver:{tag}-py3" in p for p in problems), problems


def test_hardcoded_compose_image_is_caught(checkout):
    _edit(checkout / "docker" / "compose.yaml", "prom/prometheus:${PROMETHEUS_VERSION}", "prom/prometheus:latest")
    (msg,) = stack_files.check(checkout)
    assert "service prometheus runs image prom/prometheus:latest" in msg
    assert stack_files.env_values()["PROMETHEUS_VERSION"] in msg and SRC in msg


def test_course_pin_mismatch_names_both_sides(checkout):
    pin = stack.manifest()["course"]["nvidia-pytriton"]
    _edit(checkout / "course", f"nvidia-pytriton=={pin}", "nvidia-pytriton==0.5.9")
    (msg,) = stack_files.check(checkout)
    assert "./course pins nvidia-pytriton==0.5.9" in msg and pin in msg and SRC in msg


def test_manifest_client_must_match_server(checkout):
    m = stack.manifest()
    tag = m["pinned"]
    broken = {**m, "ngc": {**m["ngc"], tag: {**m["ngc"][tag], "tritonclient": "2.50.0"}}}
    problems = stack_files.check(checkout, broken)
    assert any("Triton server 2.73.0 with tritonclient 2.50.0" in p for p in problems), problems
    # ...and the Dockerfile's and .env's TRITONCLIENT_VERSION now disagree with it, naming both values.
    assert any("docker/Dockerfile has ARG TRITONCLIENT_VERSION=2.73.0" in p and "2.50.0" in p for p in problems)


def test_preinstalled_must_agree_with_the_release(checkout):
    m = copy.deepcopy(stack.manifest())
    rel = m["ngc"][m["pinned"]]
    rel["preinstalled"]["torch"] = "2.13.0"
    rel["pip_prerelease"] = ["torch", "tensorrt-llm"]
    problems = stack_files.check(checkout, m)
    assert any(f"has torch {rel['torch']} but lists torch 2.13.0 as preinstalled" in p for p in problems), problems
    assert any("tensorrt-llm under pip_prerelease but not under preinstalled" in p for p in problems), problems


def test_interpolation_follows_compose():
    assert stack_files.interpolate("a:${X}-py3", {"X": "1"}) == "a:1-py3"
    assert stack_files.interpolate("${P:-8888}", {}) == "8888"
    with pytest.raises(KeyError, match="set JUPYTER_TOKEN"):
        stack_files.interpolate("${JUPYTER_TOKEN:?set JUPYTER_TOKEN please}", {})


def test_lab00_tables_read_the_manifest():
    images = {r["image"]: r["cuda"] for r in stack.ngc_images()}  # lab 00's container table, image by image
    rel = stack.pinned_release()
    assert images[f"nvcr.io/nvidia/pytorch:{rel['tag']}-py3"] == rel["cuda"]
    table = env.stack_table(env.probe())
    column = f"course image (NGC {rel['tag']})"
    by_layer = {r["layer"]: r[column] for r in table}
    assert by_layer["framework: PyTorch"] == rel["torch"] and by_layer["CUDA-X: TensorRT"] == rel["tensorrt"]


def test_module_check_and_env_commands():
    out = subprocess.run([sys.executable, "-m", "nvlab.ops.stack", "check"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "nvlab.ops.stack", "env"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.stdout == stack_files.compose_env()


# --- versions as pip reports them in an NGC image ---------------------------------------------------


@pytest.mark.parametrize("recorded, reported", [
    ("2.14.0", "2.14.0a0+5fa4b7e"),  # NGC's torch: a pre-release built from a commit, below 2.14.0 in PEP 440
    ("2.8.0", "2.8.0a0+5228986c39.nv25.6"),  # NGC 25.06's torch, as pip lists it
    ("2.14", "2.14.0a0+5fa4b7e"),  # the release's own field, coarser
    ("2.14.0", "2.14.0"),  # PyPI's release
    ("10.13.3", "10.13.3.9"),  # TensorRT: a fourth number, the build
    ("10.13", "10.13.3.9"),
    ("11.3.0", "11.3.0.36"),
    ("11.3.0", "11.3"),  # missing numbers are 0, as in PEP 440
])
def test_a_reported_version_is_the_images(recorded, reported):
    assert stack_files.same_release(recorded, reported)


@pytest.mark.parametrize("recorded, reported", [
    ("2.14.0", "2.13.0a0+5fa4b7e"),  # the previous release's build
    ("2.14.0", "2.15.0a0+5fa4b7e"),  # the next one's
    ("2.8.0", "2.8.1a0+5228986c39.nv25.6"),
    ("2.14.0", "2.1.4"),  # digits of a hash or a short release must not line up
    ("10.13.3", "10.13.2.6"),
    ("11.3.0", "11.30.0.1"),
    ("11.3.0", "1.13.0"),
])
def test_a_reported_version_of_another_release_is_not(recorded, reported):
    assert not stack_files.same_release(recorded, reported)


def test_release_reads_pep440_and_refuses_the_rest():
    assert stack.release("2.8.0a0+5228986c39.nv25.6") == (2, 8, 0)
    assert stack.release("10.13.3.9") == (10, 13, 3, 9) and stack.release("26.09") == (26, 9)
    with pytest.raises(ValueError, match="not a version"):
        stack.release("nightly")


def test_pip_version_is_what_pip_reports_in_the_image():
    rel = stack.pinned_release()
    torch, trt = rel["preinstalled"]["torch"], rel["preinstalled"]["tensorrt"]
    assert "torch" in rel["pip_prerelease"] and "tensorrt" not in rel["pip_prerelease"]
    assert stack_files.pip_version("torch") == f"{torch}a0" and stack_files.pip_version("tensorrt") == trt
    # none preinstalled: the release's own field
    assert stack_files.recorded_version("torch", "25.12") == stack.manifest()["ngc"]["25.12"]["torch"]
    with pytest.raises(KeyError, match="records no torch version"):
        stack_files.recorded_version("torch", "24.10")
    with pytest.raises(KeyError, match="'25.01' has no entry"):
        stack_files.recorded_version("torch", "25.01")


@pytest.fixture
def fake_dists(tmp_path):
    """A folder of bare .dist-info entries, first on PYTHONPATH: what pip (importlib.metadata) reports there."""
    def make(**versions: str) -> dict[str, str]:
        folder = tmp_path / "site"
        shutil.rmtree(folder, ignore_errors=True)
        for name, version in versions.items():
            info = folder / f"{name}-{version}.dist-info"
            info.mkdir(parents=True)
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        return {**os.environ, "PYTHONPATH": str(folder)}
    return make


def installed(env: dict[str, str], tag: str, name: str) -> subprocess.CompletedProcess:
    """The Dockerfile's torch guard: python -m nvlab.ops.stack installed NGC_TAG NAME."""
    return subprocess.run([sys.executable, "-m", "nvlab.ops.stack", "installed", tag, name],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


def test_torch_guard_accepts_the_images_builds_and_names_both_sides_otherwise(fake_dists):
    tag = stack.pinned_release()["tag"]
    want = stack_files.recorded_version("torch")
    env = fake_dists(torch=f"{want}a0+5fa4b7e", tensorrt=f"{stack_files.recorded_version('tensorrt')}.36")
    out = installed(env, tag, "torch")
    assert out.returncode == 0 and out.stdout.strip() == f"{want}a0+5fa4b7e", out.stderr  # printed as pip reports it
    assert installed(env, tag, "tensorrt").returncode == 0

    out = installed(fake_dists(torch="2.13.0a0+5fa4b7e"), tag, "torch")
    assert out.returncode == 1 and out.stdout == ""
    assert "torch is 2.13.0a0+5fa4b7e" in out.stderr and f"NGC {tag} image carries torch {want}" in out.stderr
    assert SRC in out.stderr

    out = installed(fake_dists(torch="2.8.0a0+5228986c39.nv25.6"), "25.01", "torch")  # a release not in the manifest
    assert out.returncode == 1 and "'25.01' has no entry under 'ngc'" in out.stderr


def test_server_suggests_the_pinned_releases_tritonserver(monkeypatch, tmp_path):
    """A plan built by the pinned release's TensorRT loads in no older server: the hint names the pinned tag."""
    from lab_utils.serving import server

    monkeypatch.delenv(server.URL_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no tritonserver
    monkeypatch.setattr(server, "pytriton_server", lambda: None)

    def message() -> str:
        with pytest.raises(server.ServerNotFound) as err:
            server.find_server()
        return str(err.value)

    tag = stack.pinned_release()["tag"]
    assert f"docker run --gpus all -p8000-8002:8000-8002 nvcr.io/nvidia/tritonserver:{tag}-py3 " in message()

    m = copy.deepcopy(stack.manifest())
    m["ngc"]["27.03"] = m["ngc"][tag]
    m["pinned"] = "27.03"
    path = tmp_path / "versions.json"
    path.write_text(json.dumps(m))
    monkeypatch.setattr(stack, "MANIFEST_PATH", path)
    stack.manifest.cache_clear()
    try:
        text = message()
        assert "nvcr.io/nvidia/tritonserver:27.03-py3" in text and f":{tag}-py3" not in text
        m["ngc"]["27.03"] = {**m["ngc"]["27.03"], "images": ["pytorch"]}
        path.write_text(json.dumps(m))
        stack.manifest.cache_clear()
        with pytest.raises(KeyError, match="pinned release 27.03 lists no tritonserver image"):
            server.find_server()
    finally:
        monkeypatch.undo()
        stack.manifest.cache_clear()
