"""The trainer guide's commands are the ones the tests and the CI run: every nvlab command parses, the install and
docker commands are the workflow's and the wheelhouse's, the variables are the compose file's; the modules and
lab_utils/ paths it and docker/README.md name exist."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

from nvlab import cli
from nvlab.ops import wheelhouse

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "trainer_guide.md"


@pytest.fixture(scope="module")
def commands() -> list[str]:
    """The guide's shell commands: fenced bash blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    text = "\n".join(blocks).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


@pytest.fixture(scope="module")
def gpu_job() -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())["jobs"]["gpu"]


def test_every_nvlab_command_in_the_guide_parses(commands):
    text = GUIDE.read_text()
    inline = re.findall(r"`(nvlab [^`]+)`", text)
    nvlab = [c for c in commands if c.startswith("nvlab ")] + inline
    assert len(nvlab) > 10
    parser = cli.parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    for cmd in nvlab:
        argv = shlex.split(cmd)[1:]
        if len(argv) == 1 and cmd in inline:  # prose naming a command: it must exist
            assert argv[0] in subcommands, cmd
            continue
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"the guide's `{cmd}` is not a valid nvlab command")


def test_wheelhouse_commands_are_the_tested_ones(commands):
    for cmd in wheelhouse.install_commands("WHEELHOUSE", "lab"):
        assert cmd in commands, cmd
    # the wheelhouse test builds exactly this one
    assert 'nvlab wheelhouse WHEELHOUSE --extras ""' in commands
    assert any(c.startswith("nvlab wheelhouse WHEELHOUSE") and "--exclude-preinstalled" in c for c in commands)


def test_gpu_commands_are_the_workflows(commands, gpu_job):
    flags = " ".join(gpu_job["env"]["GPU_FLAGS"].split())
    runs = [c for c in commands if c.startswith("docker run") and "nvlab-ci" in c]
    assert len(runs) == 4
    for c in runs:
        assert f"--rm --init --no-healthcheck {flags}" in c, c
    script = " ".join(" ".join(s.get("run", "").replace("\\\n", " ").split()) for s in gpu_job["steps"])
    for inner in ("nvlab doctor --require-gpu", "nvlab run --all --solutions --out /out/run", "nvlab report /out/run"):
        assert inner in script and any(c.endswith(f"nvlab-ci {inner}") for c in runs), inner
    browser = next(c for c in runs if "tests/test_browser.py" in c)
    inner = browser.split("nvlab-ci ", 1)[1]
    assert " ".join(inner.split()) in script, "the guide's browser test command is the workflow's"
    build = next(c for c in commands if c.startswith("docker build"))
    assert build.replace("-t nvlab-ci", '-t "$IMAGE"') in script


def test_compose_commands_and_variables(commands):
    compose_text = (ROOT / "docker" / "compose.yaml").read_text()
    env_file = (ROOT / "docker" / ".env").read_text()
    required = {n for n in re.findall(r"\$\{([A-Z_]+):\?", compose_text) if f"{n}=" not in env_file}
    assert required == {"JUPYTER_TOKEN", "GRAFANA_ADMIN_PASSWORD", "NVLAB_API_KEY"}
    i = commands.index("cd docker")
    export = commands[i + 1]
    assert export.startswith("export ") and all(f"{n}=$(openssl rand -hex" in export for n in required)
    assert commands[i + 2] == "docker compose up -d --build"
    ports = set(re.findall(r"127\.0\.0\.1:\$\{([A-Z_]+):-\d+\}", compose_text))
    text = GUIDE.read_text()
    assert ports and all(f"`{p}`" in text for p in ports)
    assert "docker compose up -d --no-build" in commands
    assert "python -m nvlab.ops.stack env > docker/.env" in commands
    assert "python -m nvlab.ops.stack check" in commands


def resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute of one (lab_utils.course.probe.stack_table)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package: name an attribute of it
        module, _, attr = name.rpartition(".")
        return resolves(module) and hasattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("doc", [GUIDE, ROOT / "docker" / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_modules_and_paths_exist(doc):
    """Module names (``python -m lab_utils.course.stack``, ``lab_utils.serving.server``) import and ``lab_utils/``
    paths exist: a renamed module or moved file shows here, not in a trainer's terminal."""
    text = doc.read_text()
    modules = set(re.findall(r"python -m ([\w.]+)", text)) | set(re.findall(r"\b(lab_utils(?:\.\w+)+)", text))
    stale = sorted(m for m in modules if not resolves(m))
    paths = {p.rstrip(".,:;") for p in re.findall(r"\blab_utils/[\w./-]*", text)}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not stale and not missing, f"{doc.name} names modules that do not import {stale}, paths not there {missing}"
    assert modules and paths
    assert not resolves("lab_utils.stack") and resolves("lab_utils.course.probe.stack_table")  # the check
