"""The classroom before any hub runs: the roster's checks (through `nvlab classroom up`, which must stop before
starting anything), the GPU pool (whole GPUs, MIG instances, several students per GPU), the no-overwrite copy of
the labs, the hub's one configuration in both modes, and the Docker files (compose specification, hadolint)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nvlab.classroom import hub as hubconf
from nvlab.classroom import manage
from nvlab.classroom.roster import (
    RosterError,
    assign_gpus,
    gpu_pool,
    parse_roster,
    parse_smi_list,
    sharing_note,
)
from nvlab.classroom.seed import MANIFEST, seed_labs

ROOT = Path(__file__).resolve().parents[1]
CLASSROOM = ROOT / "docker" / "classroom"

# `nvidia-smi -L` of a two-H200 machine with the second GPU split into MIG instances: GPU 0's line as an H200
# printed it (driver 580, 2026-12-04), the MIG lines in the format of NVIDIA's MIG user guide (listed under their GPU)
SMI_L = """\
GPU 0: NVIDIA H200 (UUID: GPU-3f42670f-d9c8-e502-99f5-c43f8644bdff)
GPU 1: NVIDIA H200 (UUID: GPU-9a8b7c6d-5e4f-3a2b-1c0d-0e1f2a3b4c5d)
  MIG 3g.71gb     Device  0: (UUID: MIG-1f2e3d4c-5b6a-5978-8695-a4b3c2d1e0f9)
  MIG 1g.18gb     Device  1: (UUID: MIG-2a3b4c5d-6e7f-5081-92a3-b4c5d6e7f809)
  MIG 1g.18gb     Device  2: (UUID: MIG-3c4d5e6f-7a8b-5c9d-ae0f-1a2b3c4d5e6f)
"""


def _nvlab(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "nvlab", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


# --- the roster -----------------------------------------------------------------------------------------------

def test_a_good_roster_is_read_with_defaults():
    s = parse_roster("username,email,gpu,role\nada,ada@example.org,0,trainer\nbob,,,\ncy,,1,student\n")
    assert [(x.username, x.gpu, x.role, x.admin) for x in s] == [
        ("ada", "0", "trainer", True), ("bob", "", "student", False), ("cy", "1", "student", False)]
    assert parse_roster("\ufeffusername,role\nt,trainer\nu\n")[1].username == "u"  # a BOM and short lines


@pytest.mark.parametrize("text, said", [
    ("username,role\nt,trainer\nbob,\nbob,\n", "username 'bob' is already on line 3"),
    ("username,role\nt,trainer\nBob,\n", "'Bob': upper case letters"),
    ("username,role\nt,trainer\nbob smith,\n", "'bob smith': not a valid user name"),
    ("username,role\nt,trainer\n" + "a" * 33 + ",\n", "not a valid user name"),
    ("username,role\nt,trainer\nroot,\n", "system account"),
    ("username,role\nt,teacher\n", "role 'teacher'"),
    ("username,role\nbob,\n", "no trainer"),
    ("name,role\nbob,trainer\n", "has no `username` column"),
    ("username,team\nbob,\n", "unknown column(s) 'team'"),
    ("username,email,role\nt,not-an-address,trainer\n", "is not an e-mail address"),
    ("", "empty"),
])
def test_a_bad_roster_names_each_problem(text, said):
    with pytest.raises(RosterError) as err:
        parse_roster(text)
    assert said in str(err.value)


def test_every_problem_is_listed_at_once_with_its_line():
    with pytest.raises(RosterError) as err:
        parse_roster("username,role\nt,trainer\nBob,\nbob,x\nbob,\n")
    text = str(err.value)
    assert "line 3:" in text and "line 4: role 'x'" in text and "line 5: username 'bob' is already on line 4" in text


def _nobody_created(names: list[str], state: Path) -> None:
    for n in names:
        with pytest.raises(KeyError):
            pwd.getpwnam(n)
    assert not state.exists(), "nothing may be written before the checks pass"


@pytest.mark.parametrize("roster, extra, said", [
    ("username,role\nnvltx-t,trainer\nnvltx-a,\nnvltx-a,\n", [], "username 'nvltx-a' is already on line 3"),
    ("username,role\nnvltx-t,trainer\nNvltx-B,\n", [], "upper case letters"),
    ("username,gpu,role\nnvltx-t,,trainer\nnvltx-a,99,\n", [], "gpu '99' for nvltx-a does not exist"),
    ("username,role\nnvltx-t,trainer\n", ["--gpus", "7"], "GPU 7 does not exist"),
    ("username,role\nnvltx-t,trainer\n", ["--gpus", "mig"], "no MIG instance exists here"),
])
def test_up_refuses_a_bad_roster_before_starting_anything(tmp_path, roster, extra, said):
    (tmp_path / "r.csv").write_text(roster)
    state = tmp_path / "state"
    out = _nvlab("classroom", "up", "--local", "--roster", str(tmp_path / "r.csv"), "--state", str(state),
                 "--passwords-out", str(tmp_path / "pw.csv"), "--port", "1", *extra)
    assert out.returncode == 2, out.stdout + out.stderr
    assert said in out.stderr and out.stderr.startswith("nvlab classroom up: "), out.stderr
    assert out.stderr.rstrip().endswith("nothing was started"), out.stderr
    _nobody_created(["nvltx-t", "nvltx-a"], state)
    assert not (tmp_path / "pw.csv").exists()


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path):
    (tmp_path / "r.csv").write_text("username,role\nnvltx-t,trainer\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _nvlab("classroom", "up", "--local", "--roster", str(tmp_path / "r.csv"), "--ip", "127.0.0.1",
                     "--port", str(port), "--state", str(tmp_path / "state"), "--passwords-out",
                     str(tmp_path / "pw.csv"))
    assert out.returncode == 2 and f"port {port} is already in use" in out.stderr, out.stderr
    _nobody_created(["nvltx-t"], tmp_path / "state")


def test_up_wants_a_new_password_file_for_new_accounts(tmp_path):
    (tmp_path / "r.csv").write_text("username,role\nnvltx-t,trainer\n")
    base = ["classroom", "up", "--local", "--roster", str(tmp_path / "r.csv"), "--state", str(tmp_path / "state"),
            "--gpus", "none", "--port", "1"]
    out = _nvlab(*base)
    assert out.returncode == 2 and "need passwords: pass --passwords-out FILE" in out.stderr, out.stderr
    (tmp_path / "pw.csv").write_text("username,password\nold,secret\n")
    out = _nvlab(*base, "--passwords-out", str(tmp_path / "pw.csv"))
    assert out.returncode == 2 and "already exists: give a new file" in out.stderr, out.stderr
    assert (tmp_path / "pw.csv").read_text().endswith("old,secret\n")
    _nobody_created(["nvltx-t"], tmp_path / "state")


# --- the GPU pool ---------------------------------------------------------------------------------------------

def test_gpus_and_mig_instances_are_read_from_nvidia_smi():
    devices = parse_smi_list(SMI_L)
    assert [(d.kind, d.index, d.name) for d in devices] == [
        ("gpu", 0, "NVIDIA H200"), ("gpu", 1, "NVIDIA H200"), ("mig", 1, "3g.71gb"), ("mig", 1, "1g.18gb"),
        ("mig", 1, "1g.18gb")]
    # all: whole GPUs, and a GPU in MIG mode by its instances (never the split GPU itself)
    assert [d.uuid[:8] for d in gpu_pool("all", devices)] == ["GPU-3f42", "MIG-1f2e", "MIG-2a3b", "MIG-3c4d"]
    assert [d.kind for d in gpu_pool("mig", devices)] == ["mig"] * 3
    assert [d.index for d in gpu_pool("1,0", devices)] == [1, 0]
    assert gpu_pool("none", devices) == []


def test_students_get_the_rosters_gpu_else_the_pool_in_turn_and_sharing_is_said():
    devices = parse_smi_list(SMI_L)
    students = parse_roster("username,gpu,role\nt,none,trainer\na,MIG-2a3b4c5d-6e7f-5081-92a3-b4c5d6e7f809,\n"
                            "b,,\nc,,\nd,,\n")
    got = assign_gpus(students, gpu_pool("0,1", devices), devices)
    assert got["t"] is None and got["a"].name == "1g.18gb"
    assert [got[u].index for u in "bcd"] == [0, 1, 0]  # round-robin over the pool: GPU 0 has two students
    assert "shared by up to 2 students" in sharing_note(got) and "out of memory" in sharing_note(got)
    assert sharing_note(assign_gpus(students[:3], gpu_pool("0,1", devices), devices)) is None


# --- the labs' copy -------------------------------------------------------------------------------------------

def test_the_copy_never_overwrites_and_offers_a_new_course_version_beside(tmp_path):
    course, mine = tmp_path / "course", tmp_path / "home" / "labs"
    (course / "data").mkdir(parents=True)
    (course / "01_lab.ipynb").write_text("v1")
    (course / "02_lab.ipynb").write_text("v1")
    (course / "data" / "x.csv").write_text("1")
    (course / ".ipynb_checkpoints").mkdir()
    (course / ".ipynb_checkpoints" / "01_lab-checkpoint.ipynb").write_text("junk")
    assert sorted(seed_labs(course, mine)["copied"]) == ["01_lab.ipynb", "02_lab.ipynb", "data/x.csv"]
    assert not (mine / ".ipynb_checkpoints").exists()
    (mine / "01_lab.ipynb").write_text("v1 + my answers")
    (mine / "02_lab.ipynb").unlink()
    again = seed_labs(course, mine)  # the next server start: nothing changes
    assert again["copied"] == again["offered"] == [] and (mine / "01_lab.ipynb").read_text() == "v1 + my answers"
    assert not (mine / "02_lab.ipynb").exists(), "a lab the student deleted is not brought back"
    (course / "01_lab.ipynb").write_text("v2")  # a new course version
    (course / "03_lab.ipynb").write_text("v1")
    done = seed_labs(course, mine)
    offered = done["offered"]
    assert len(offered) == 1 and offered[0].startswith("01_lab.new-") and done["copied"] == ["03_lab.ipynb"]
    assert (mine / "01_lab.ipynb").read_text() == "v1 + my answers" and (mine / offered[0]).read_text() == "v2"
    assert seed_labs(course, mine)["offered"] == [], "offered once"
    assert (mine / MANIFEST).is_file()


# --- the hub's one configuration ------------------------------------------------------------------------------

def _plan(mode: str, tmp_path: Path) -> dict:
    (tmp_path / "api_token").write_text("t" * 64)
    plan = {"mode": mode, "ip": "127.0.0.1", "port": 8000, "hub_ip": "127.0.0.1", "hub_port": 8081,
            "proxy_api_port": 8001, "state": str(tmp_path), "python": "/usr/bin/python3",
            "students": [{"username": "t", "role": "trainer"}, {"username": "a", "role": "student"}],
            "gpus": {"t": "", "a": "MIG-2a3b4c5d-6e7f-5081-92a3-b4c5d6e7f809"}, "pool": ["GPU-5d6c"],
            "labs_src": "/course/labs", "labs_dest": "~/labs", "notebook_dir": "~", "idle_timeout_s": 600,
            "cull_every_s": 60, "mem_limit": "32G", "cpu_limit": 8, "system_users": True}
    if mode == "docker":
        plan["docker"] = {"image": "nvlab/classroom-singleuser:26.09", "network": "nvlab-classroom",
                          "work_dir": "/workspace/work"}
    return plan


class _Spawner:
    """What the pre-spawn hook reads and sets on a spawner: its user's name, environment, Docker host config."""

    def __init__(self, name: str):
        self.user = type("U", (), {"name": name})()
        self.environment: dict = {}
        self.extra_host_config: dict = {"shm_size": "2g"}


@pytest.mark.parametrize("mode", ["local", "docker"])
def test_one_configuration_for_both_modes(mode, tmp_path):
    pytest.importorskip("jupyterhub")
    from traitlets.config import Config

    c = Config()
    hubconf.configure(c, _plan(mode, tmp_path))
    assert c.Authenticator.admin_users == {"t"} and c.Authenticator.allowed_users == {"t", "a"}
    assert c.Authenticator.allow_all is True and c.NativeAuthenticator.open_signup is False
    assert c.Spawner.cmd[1:3] == ["-m", "nvlab.classroom.seed"] and c.Spawner.cmd[-2:] == ["-m",
                                                                                           "jupyterhub.singleuser"]
    names = [s["name"] for s in c.JupyterHub.services]
    assert names[:2] == ["idle-culler", "nvlab-classroom"]
    culler = c.JupyterHub.services[0]["command"]
    assert "--timeout=600" in culler and "--cull-every=60" in culler
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert set(hubconf.CULLER_SCOPES) <= set(roles["idle-culler"]["scopes"])
    assert ("pid_file" in c.JupyterHub) == (mode == "local"), "a container's pid file would name a host process"
    sp = _Spawner("a")
    c.Spawner.pre_spawn_hook(sp)
    if mode == "local":
        assert c.JupyterHub.spawner_class.endswith("LocalProcessSpawner")
        assert sp.environment["CUDA_VISIBLE_DEVICES"] == "MIG-2a3b4c5d-6e7f-5081-92a3-b4c5d6e7f809"
        none = _Spawner("t")
        c.Spawner.pre_spawn_hook(none)
        assert none.environment["CUDA_VISIBLE_DEVICES"] == "", "no GPU means none visible, not all of them"
    else:
        pytest.importorskip("docker")
        assert c.JupyterHub.spawner_class == "dockerspawner.DockerSpawner"
        assert c.DockerSpawner.volumes == {"nvlab-classroom-{username}": "/workspace/work"}
        assert c.Spawner.mem_limit == "32G" and c.Spawner.cpu_limit == 8.0
        (req,) = sp.extra_host_config["device_requests"]
        assert req["DeviceIDs"] == ["MIG-2a3b4c5d-6e7f-5081-92a3-b4c5d6e7f809"] and req["Capabilities"] == [["gpu"]]
        assert sp.extra_host_config["shm_size"] == "2g"
    # a sign-up the trainer approved (not on the roster) gets the pool's device
    assert hubconf.device_for(_plan(mode, tmp_path), "latecomer") == "GPU-5d6c"


@pytest.mark.parametrize(("mode", "host"), [("local", "127.0.0.1"), ("docker", "hub")])
def test_the_progress_page_is_served_where_students_servers_reach_it(mode, host, tmp_path):
    """Under Docker the students' containers post their records to the hub's container by its name, not to their
    own loopback; the page's role lets it list students who have not run a check yet."""
    pytest.importorskip("jupyterhub")
    from traitlets.config import Config

    plan = {**_plan(mode, tmp_path), "progress_port": 8090}
    if mode == "docker":
        plan["progress_host"] = "hub"
    c = Config()
    hubconf.configure(c, plan)
    (svc,) = [s for s in c.JupyterHub.services if s["name"] == "progress"]
    assert svc["url"] == f"http://{host}:8090"
    assert c.Spawner.environment["NVLAB_PROGRESS_URL"] == f"http://{host}:8090/services/progress/"
    assert any("progress" in r.get("services", []) for r in c.JupyterHub.load_roles)


# --- the Docker files -----------------------------------------------------------------------------------------

def _tool(name: str) -> str:
    found = Path(sys.executable).with_name(name)
    assert found.exists(), f"{name} is not installed: pip install -e '.[test]'"
    return str(found)


def test_the_classroom_compose_file_follows_the_compose_specification(tmp_path):
    bad = tmp_path / "compose.yaml"
    bad.write_text((CLASSROOM / "compose.yaml").read_text().replace("stop_grace_period: 2m",
                                                                    "stop_grace_period: [2m]"))
    out = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                          str(CLASSROOM / "compose.yaml"), str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"{bad}::" in out.stdout + out.stderr, out.stdout + out.stderr
    assert str(CLASSROOM / "compose.yaml") + "::" not in out.stdout + out.stderr


def test_the_compose_file_is_what_up_and_the_hubs_configuration_expect():
    compose = yaml.safe_load((CLASSROOM / "compose.yaml").read_text())
    hub = compose["services"]["hub"]
    assert f":{manage.CONTAINER_STATE}" in " ".join(hub["volumes"])
    assert "/var/run/docker.sock:/var/run/docker.sock" in hub["volumes"]
    assert hub["ports"] == ["${NVLAB_HUB_IP:-0.0.0.0}:${NVLAB_HUB_PORT:-443}:8000"]  # the plan's port 8000 inside
    assert compose["networks"]["classroom"]["name"] == "nvlab-classroom"  # the plan's DockerSpawner network
    assert compose["services"]["singleuser"]["image"] == manage.Options(roster=Path("r")).image
    assert compose["services"]["singleuser"]["profiles"] == ["image"]
    config = (CLASSROOM / "jupyterhub_config.py").read_text()
    assert f'configure(c, "{manage.CONTAINER_STATE}/plan.json")' in config
    assert "NVLAB_CLASSROOM_STATE:?" in hub["volumes"][1], "compose refuses to start without the state folder"


def test_the_hub_image_holds_what_the_hub_and_its_progress_page_read(tmp_path):
    """The hub image's files, laid out from Dockerfile.hub's COPY lines: the hub's configuration and the progress
    service import from them alone, and the progress page finds every lab's exercises (read as text)."""
    for line in (CLASSROOM / "Dockerfile.hub").read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, dest = line.split()[1:]
        target = tmp_path / dest.lstrip("/")
        for source in sources:
            if source.endswith("/"):
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
            else:
                to = target / Path(source).name if dest.endswith("/") else target
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, to)
    src = tmp_path / "srv" / "nvlab" / "src"
    # an editable install of this checkout would supply what the image lacks: its finder is left out
    code = ("import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(f).lower()]\n"
            "import json, lab_utils, nvlab.classroom.hub, nvlab.classroom.progress_service\n"
            "from lab_utils.course import progress\n"
            "print(lab_utils.__file__)\nprint(json.dumps(progress.catalog()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(src)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    where, catalog = out.stdout.splitlines()
    assert where.startswith(str(src)), where  # the image's copy, not this checkout
    from lab_utils.course import progress

    assert json.loads(catalog) == progress.catalog() and len(progress.catalog()) >= 10


def test_the_classroom_images_pass_hadolint():
    for f in ("Dockerfile.hub", "Dockerfile.singleuser"):
        out = subprocess.run([_tool("hadolint"), str(CLASSROOM / f)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    hub_pins = (CLASSROOM / "Dockerfile.hub").read_text()
    assert "jupyterhub:5.5.4" in hub_pins and "jupyterhub==5.5.4" in (CLASSROOM / "Dockerfile.singleuser").read_text()


@pytest.mark.parametrize("action", ["down", "check-gpus"])
def test_down_and_check_gpus_name_a_state_folder_without_a_classroom(action, tmp_path):
    out = _nvlab("classroom", action, "--state", str(tmp_path / "none"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"no classroom in {tmp_path / 'none'}" in out.stderr
    assert "--state that `nvlab classroom up` used" in out.stderr
