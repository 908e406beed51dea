"""The lab image and the compose stack, checked by the real validators (no Docker engine needed):
hadolint, the compose specification's JSON schema, promtool; plus the entrypoint's token check run with bash."""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab_utils.course import stack

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
RULES = ROOT / "lab_utils" / "data" / "monitoring" / "alert_rules.yml"
DASHBOARD = ROOT / "lab_utils" / "data" / "monitoring" / "grafana_dashboard.json"


def tool(name: str) -> str:
    """A validator installed with the test extra (beside this Python) or on the PATH; fails with the fix if not."""
    found = Path(sys.executable).with_name(name)
    path = str(found) if found.exists() else shutil.which(name)
    if not path:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return path


def run(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


# --- Dockerfile -----------------------------------------------------------------------------------


def test_hadolint_passes():
    out = run(tool("hadolint"), str(DOCKERFILE))
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_really_checking(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    out = run(tool("hadolint"), str(bad))
    assert out.returncode != 0 and "DL3006" in out.stdout


def test_dockerfile_keeps_the_images_torch_and_runs_as_a_user():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\$\{NGC_TAG\}-py3$", text, re.MULTILINE)
    assert '--constraint "${constraint}"' in text and "/etc/pip/constraint.txt" in text
    assert '-e ".[lab]"' in text and "torch]" not in text and ",torch" not in text  # never the torch extra
    assert "torch_before" in text and "torch_after" in text
    assert "jupyter lab --version | grep -q '^4\\.'" in text
    assert re.search(r"--no-deps \"nvidia-pytriton==\$\{PYTRITON_VERSION\}\"", text)
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users and users[-1] == "${NVLAB_UID}:${NVLAB_GID}"
    for arg in ("NVLAB_UID", "NVLAB_GID"):
        assert re.search(rf"^ARG {arg}=\d+$", text, re.MULTILINE)
    assert re.findall(r"^WORKDIR\s+(\S+)", text, re.MULTILINE)[-1] == "/workspace/course/labs"
    assert re.search(r"^HEALTHCHECK ", text, re.MULTILINE)
    for label in ("title", "description", "version", "licenses", "base.name"):
        assert f"org.opencontainers.image.{label}=" in text
    assert 'ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/usr/local/bin/nvlab-entrypoint"]' in text
    assert 'CMD ["nvlab", "lab", "--ip", "0.0.0.0", "--port", "8888"]' in text


def _ignored(path: str, patterns: list[str]) -> bool:
    hit = False
    for p in patterns:
        neg = p.startswith("!")
        p = p.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) or path.startswith(p + "/"):
            hit = not neg
    return hit


def test_dockerignore_keeps_what_the_image_copies():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    copied = re.findall(r"^COPY (?:--\S+ )*(\S+) ", DOCKERFILE.read_text(), re.MULTILINE)
    copied += ["pyproject.toml", "README.md"]
    for src in copied:
        assert not _ignored(src.rstrip("/"), patterns), f"{src} is copied by the Dockerfile but .dockerignore drops it"
    for heavy in (".git", ".venv", "runs", "docker/.env", "lab_utils/__pycache__"):
        assert _ignored(heavy, patterns), f".dockerignore should leave out {heavy}"


# --- entrypoint: no token, no notebook server --------------------------------------------------------


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH with stand-ins for nvlab and jupyter that only say how they were called."""
    for name in ("nvlab", "jupyter"):
        f = tmp_path / name
        f.write_text(f'#!/bin/sh\necho "{name} started: $*"\n')
        f.chmod(0o755)
    return tmp_path


def entrypoint(fake_bin, *argv: str, token: str | None) -> subprocess.CompletedProcess:
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin"}
    if token is not None:
        env["JUPYTER_TOKEN"] = token
    return run("bash", str(DOCKER / "entrypoint.sh"), *argv, env=env)


@pytest.mark.parametrize("argv", [("nvlab", "lab", "--ip", "0.0.0.0"), ("jupyter", "lab")])
def test_entrypoint_refuses_jupyter_without_a_token(fake_bin, argv):
    for token in (None, ""):
        out = entrypoint(fake_bin, *argv, token=token)
        assert out.returncode == 64 and "started" not in out.stdout
        assert "JUPYTER_TOKEN is not set" in out.stderr and "openssl rand -hex 24" in out.stderr
    out = entrypoint(fake_bin, *argv, token="short")
    assert out.returncode == 64 and "at least 16" in out.stderr


def test_entrypoint_starts_jupyter_with_a_token_and_other_commands_without(fake_bin):
    out = entrypoint(fake_bin, "nvlab", "lab", "--ip", "0.0.0.0", token="0123456789abcdef0123")
    assert out.returncode == 0 and out.stdout.strip() == "nvlab started: lab --ip 0.0.0.0"
    out = entrypoint(fake_bin, "nvlab", "run", "--all", "--solutions", token=None)
    assert out.returncode == 0 and "nvlab started: run --all --solutions" in out.stdout


def test_entrypoint_warns_about_an_unwritable_model_repository(fake_bin, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    repo = tmp_path / "models"
    repo.mkdir(mode=0o555)
    out = run("bash", str(DOCKER / "entrypoint.sh"), "nvlab", "doctor",
              env={"PATH": f"{fake_bin}:/usr/bin:/bin", "NVLAB_MODEL_REPOSITORY": str(repo)})
    assert out.returncode == 0 and "not writable" in out.stderr


# --- compose.yaml --------------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification():
    out = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_specification_check_is_really_checking(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  lab:\n    image: x\n    ulimits: {memlock: [1]}\n    ipc: 3\n")
    out = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad))
    assert out.returncode != 0


def _gpu_reservation(service: dict) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and d.get("count") == "all"
               for d in devices)


def test_lab_service(compose):
    lab = compose["services"]["lab"]
    assert _gpu_reservation(lab)
    assert lab.get("ipc") == "host" or lab.get("shm_size")
    assert lab["ulimits"] == {"memlock": -1, "stack": 67108864}
    assert lab["build"]["context"] == ".." and lab["build"]["dockerfile"] == "docker/Dockerfile"
    e = lab["environment"]
    assert e["TRITON_URL"] == "http://triton:8000" and e["PROMETHEUS_URL"] == "http://prometheus:9090"
    assert e["NVLAB_MODEL_REPOSITORY"] == "/models" and "model_repository:/models" in lab["volumes"]


def test_compose_refuses_a_lab_without_a_token(compose):
    value = compose["services"]["lab"]["environment"]["JUPYTER_TOKEN"]
    assert re.fullmatch(r"\$\{JUPYTER_TOKEN:\?[^}]+\}", value), value
    with pytest.raises(KeyError, match="set JUPYTER_TOKEN"):  # what compose does with ${VAR:?message}
        stack.interpolate(value, {})
    with pytest.raises(KeyError):
        stack.interpolate(value, {"JUPYTER_TOKEN": ""})


def test_every_port_is_published_on_loopback_only(compose):
    published = [(name, p) for name, s in compose["services"].items() for p in s.get("ports", [])]
    assert {"lab", "triton", "prometheus", "grafana"} <= {name for name, _ in published}
    for name, port in published:
        assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name} publishes {port!r} beyond loopback"


def test_triton_service(compose):
    triton = compose["services"]["triton"]
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:${NGC_TAG}-py3"
    flags = triton["command"]
    assert flags[0] == "tritonserver" and "--model-repository=/models" in flags
    assert "--model-control-mode=explicit" in flags and "--allow-metrics=true" in flags
    assert "--metrics-port=8002" in flags and "--allow-gpu-metrics=true" in flags
    assert _gpu_reservation(triton) and triton["ulimits"] == {"memlock": -1, "stack": 67108864}
    assert "model_repository:/models:ro" in triton["volumes"]
    ports = {p.rsplit(":", 1)[-1] for p in triton["ports"]}
    assert ports == {"8000", "8001", "8002"}


def test_gpu_exporter_and_dcgm_profile(compose):
    s = compose["services"]
    assert s["gpu-exporter"]["command"] == ["nvlab", "gpu-exporter", "--port", "9400", "--host", "0.0.0.0"]
    assert _gpu_reservation(s["gpu-exporter"]) and _gpu_reservation(s["dcgm-exporter"])
    assert s["dcgm-exporter"]["profiles"] == ["dcgm"]
    assert all("profiles" not in s[n] for n in ("lab", "triton", "prometheus", "grafana", "gpu-exporter"))


def test_grafana_service(compose):
    g = compose["services"]["grafana"]
    e = g["environment"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", e["GF_SECURITY_ADMIN_PASSWORD"])
    assert e["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and e["GF_USERS_ALLOW_SIGN_UP"] == "false"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in g["volumes"]}
    assert mounts["/etc/grafana/provisioning/datasources"] == "./grafana/provisioning/datasources"
    assert mounts["/etc/grafana/dashboards/nvlab/grafana_dashboard.json"] == (
        "../lab_utils/data/monitoring/grafana_dashboard.json")


def test_grafana_provisioning_points_at_the_stack(compose):
    ds = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"] == compose["services"]["lab"]["environment"]["PROMETHEUS_URL"]
    dash = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/nvlab.yml").read_text())
    (provider,) = dash["providers"]
    mounted = [v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]]
    assert any(Path(m).parent.as_posix() == provider["options"]["path"] for m in mounted)
    if DASHBOARD.exists():
        assert json.loads(DASHBOARD.read_text())["panels"]


def test_mounted_files_exist(compose):
    for name, service in compose["services"].items():
        for v in service.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).exists(), f"service {name} mounts {src}, which is missing"


# --- Prometheus configuration -----------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if not path:
        if os.environ.get("NVLAB_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("NVLAB_REQUIRE_PROMETHEUS=1 but promtool is missing: apt-get install prometheus")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


def prometheus_container_files(compose, root: Path) -> Path:
    """The files the prometheus container sees, laid out under ``root`` from the compose file's mounts."""
    for v in compose["services"]["prometheus"]["volumes"]:
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            target = root / dst.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(DOCKER / src, target)
    return root / "etc/prometheus/prometheus.yml"


def test_promtool_accepts_the_stack_configuration_and_lab05_rules(compose, tmp_path):
    tool = promtool()
    if not RULES.exists():
        pytest.skip(f"lab 05's {RULES.name} is not there yet: the configuration references it")
    config = prometheus_container_files(compose, tmp_path)
    out = run(tool, "check", "config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout and "SUCCESS" in out.stdout


def test_promtool_is_really_checking(compose, tmp_path):
    tool = promtool()
    config = tmp_path / "prometheus.yml"
    config.write_text("scrape_configs:\n  - job_name: x\n    scrape_interval: often\n")
    assert run(tool, "check", "config", str(config)).returncode != 0


def test_scrape_targets_match_the_services(compose):
    config = yaml.safe_load((DOCKER / "prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["triton"]["static_configs"][0]["targets"] == ["triton:8002"]
    exporter = compose["services"]["gpu-exporter"]["command"]
    port = exporter[exporter.index("--port") + 1]
    assert jobs["gpu_exporter"]["static_configs"][0]["targets"] == [f"gpu-exporter:{port}"]
    assert jobs["gpu_exporter"]["dns_sd_configs"][0]["names"] == ["dcgm-exporter"]
    mounts = {v.split(":")[1] for v in compose["services"]["prometheus"]["volumes"]}
    for rule_file in config["rule_files"]:
        assert f"/etc/prometheus/{rule_file}" in mounts
