"""The lab image and the compose stack, checked by the real validators (no Docker engine needed): hadolint, the
compose specification's JSON schema, promtool; and by behaviour: the entrypoint's token check run with bash, the
compose file's published ports and secrets as Compose reads them, its commands parsed by nvlab's own parser.
What the manifest decides (base image, image tags, build arguments) is tests/test_stack.py's."""

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab_utils.procs import env_flag
from nvlab import cli
from nvlab.ops import stack as stack_files

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


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.rglob("Dockerfile*")), ids=lambda p: str(p.relative_to(DOCKER)))
def test_hadolint_passes(dockerfile):
    out = run(tool("hadolint"), str(dockerfile))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("text, rule", [
    ("FROM ubuntu\nRUN apt-get install curl\n", "DL3006"),  # untagged base image
    ("FROM ubuntu:24.04\nUSER 1000:1000\nRUN true\nUSER root\n", "DL3002"),  # the image must not end as root
])
def test_hadolint_is_really_checking(tmp_path, text, rule):
    bad = tmp_path / "Dockerfile"
    bad.write_text(text)
    out = run(tool("hadolint"), "--no-color", str(bad))
    assert out.returncode != 0 and rule in out.stdout, out.stdout


def _ignored(path: str, patterns: list[str]) -> bool:
    hit = False
    for p in patterns:
        neg = p.startswith("!")
        p = p.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) or path.startswith(p + "/"):
            hit = not neg
    return hit


def test_the_image_installs_a_cjk_font_for_the_chinese_review():
    # Without one, lab 09's review in Chinese showed boxes wherever the container renders text itself.
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # RUN lines joined across their continuations
    installed = {w for line in text.splitlines() if "apt-get install" in line for w in line.split()}
    assert {"fonts-noto-cjk"} & installed, "the image's apt-get install names no Noto CJK font package"


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


def test_compose_file_follows_the_compose_specification_and_a_broken_one_does_not(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  lab:\n    image: x\n    ulimits: {memlock: [1]}\n    ipc: 3\n")
    out = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE), str(bad))
    report = out.stdout + out.stderr
    assert out.returncode == 1 and f"{bad}::" in report, report  # one call: the schema is really checking
    assert f"{COMPOSE}::" not in report, report


@pytest.fixture(scope="module")
def env_file() -> dict[str, str]:
    return stack_files.parse_env_file((DOCKER / ".env").read_text())


SECRETS = {"JUPYTER_TOKEN": "0123456789abcdef0123", "GRAFANA_ADMIN_PASSWORD": "0123456789abcdef",
           "NVLAB_API_KEY": "0123456789abcdef"}


def resolved(node, env: dict[str, str]):
    """The compose file as Compose reads it: every ${...} interpolated with ``env`` (KeyError where one is unset)."""
    if isinstance(node, dict):
        return {k: resolved(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolved(v, env) for v in node]
    return stack_files.interpolate(node, env) if isinstance(node, str) else node


def published(compose: dict) -> list[tuple[str, str, str]]:
    """(service, host address, port) of every port a service publishes; "0.0.0.0" where no address is given
    (Compose then binds every interface). Short syntax [HOST:][HOST_PORT:]CONTAINER_PORT[/PROTO] and long syntax."""
    out = []
    for name, service in compose["services"].items():
        if service.get("network_mode") == "host":  # every port the container opens is the host's
            out.append((name, "0.0.0.0", "(network_mode: host)"))
        for port in service.get("ports", []):
            if isinstance(port, dict):
                out.append((name, port.get("host_ip", "0.0.0.0"), str(port.get("published", port["target"]))))
                continue
            spec = str(port).split("/")[0]
            host = re.match(r"\[([^]]+)\]:(.*)", spec) or re.match(r"(\d+\.\d+\.\d+\.\d+):(.*)", spec)
            out.append((name, host.group(1), host.group(2)) if host else (name, "0.0.0.0", spec))
    return out


def test_every_port_is_published_on_loopback_only(compose, env_file):
    ports = published(resolved(compose, {**env_file, **SECRETS}))
    assert {"lab", "triton", "prometheus", "grafana"} <= {name for name, _, _ in ports}
    beyond = [f"{name} publishes {port} on {host}" for name, host, port in ports if host != "127.0.0.1"]
    assert not beyond, "every port must be published on 127.0.0.1 only:\n" + "\n".join(beyond)


def test_loopback_check_is_really_checking():
    bad = yaml.safe_load("""
services:
  a: {ports: ["8888:8888", "127.0.0.1:9090:9090"]}
  b: {ports: [{target: 3000, published: 3000}, {target: 22, host_ip: 127.0.0.1}]}
  c: {ports: ["[::]:8000:8000", "9400"]}
  d: {network_mode: host}
""")
    beyond = sorted((n, p) for n, h, p in published(bad) if h != "127.0.0.1")
    assert beyond == [("a", "8888:8888"), ("b", "3000"), ("c", "8000:8000"), ("c", "9400"),
                      ("d", "(network_mode: host)")]


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_compose_refuses_to_start_without_each_secret(compose, env_file, secret):
    resolved(compose, {**env_file, **SECRETS})  # with both set and docker/.env read, everything resolves
    for value in (None, ""):
        env = {**env_file, **SECRETS}
        if value is None:
            del env[secret]
        else:
            env[secret] = value
        with pytest.raises(KeyError, match=f"\\${{{secret}}} is not set: set {secret}"):
            resolved(compose, env)


def test_nvlab_commands_of_the_services_parse(compose):
    commands = [s["command"] for s in compose["services"].values() if s.get("command")]
    nvlab = [c if isinstance(c, list) else shlex.split(c) for c in commands]
    nvlab = [[str(a) for a in c] for c in nvlab if c[0] == "nvlab"]
    assert nvlab, "the stack runs the GPU exporter with nvlab"
    for argv in nvlab:
        try:
            cli.parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"compose.yaml runs `{shlex.join(argv)}`, which nvlab does not accept")


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
        if env_flag("NVLAB_REQUIRE_PROMETHEUS"):
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
    metrics_port = next(f.split("=")[1] for f in compose["services"]["triton"]["command"]
                        if f.startswith("--metrics-port="))
    assert jobs["triton"]["static_configs"][0]["targets"] == [f"triton:{metrics_port}"]
    exporter = compose["services"]["gpu-exporter"]["command"]
    port = exporter[exporter.index("--port") + 1]
    assert jobs["gpu_exporter"]["static_configs"][0]["targets"] == [f"gpu-exporter:{port}"]
    assert jobs["gpu_exporter"]["dns_sd_configs"][0]["names"] == ["dcgm-exporter"]
    mounts = {v.split(":")[1] for v in compose["services"]["prometheus"]["volumes"]}
    for rule_file in config["rule_files"]:
        assert f"/etc/prometheus/{rule_file}" in mounts


# --- lab 07's nginx -----------------------------------------------------------------------------------------


def test_compose_nginx_config_is_generated_and_nginx_accepts_it(compose):
    """docker/nginx/nginx.conf is the lab's generated config; with the key the container puts in (and the stack's
    hostname replaced by an address, which `nginx -t` resolves) nginx accepts it; the service mounts it where its
    command reads it, replaces the placeholder, and publishes the ports the config listens on (loopback only)."""
    from lab_utils.serving import nginx as nginx_mod
    from lab_utils.serving import service

    conf = DOCKER / "nginx" / "nginx.conf"
    assert conf.read_text() == service.compose_nginx_config(), \
        "regenerate: python scripts/render_nginx.py"
    svc = compose["services"]["nginx"]
    command = " ".join(svc["command"])
    assert f"s/{service.COMPOSE_KEY_PLACEHOLDER}/$${{NVLAB_API_KEY}}/" in command
    assert "./nginx/nginx.conf:/etc/nvlab/nginx.conf:ro" in svc["volumes"] and "/etc/nvlab/nginx.conf" in command
    published_ports = {str(p).rsplit(":", 1)[1] for p in svc["ports"]}
    assert published_ports == {str(service.COMPOSE_PORTS["http"]), str(service.COMPOSE_PORTS["grpc"])}
    if nginx_mod.missing():
        if env_flag(nginx_mod.REQUIRE_ENV):
            pytest.fail(f"{nginx_mod.REQUIRE_ENV}=1 but {nginx_mod.missing()}")
        pytest.skip(nginx_mod.missing())
    text = conf.read_text().replace(service.COMPOSE_KEY_PLACEHOLDER, SECRETS["NVLAB_API_KEY"])
    nginx_mod.check_nginx_config(text.replace("server triton:", "server 127.0.0.1:"))
    with pytest.raises(nginx_mod.NginxConfigError):  # really checking: a broken copy is refused
        nginx_mod.check_nginx_config(text.replace("server triton:8000;", "server 127.0.0.1:8000"))
