"""The classroom hub's one configuration: ``configure(c, plan)`` from ``jupyterhub_config.py``.

The plan (JSON, written by ``nvlab classroom up``) says the mode; everything else is the same in both:
- local: JupyterHub's LocalProcessSpawner, each student a system user (run as root), or, without root,
  SimpleLocalProcessSpawner with one folder per student (no isolation between students: a trainer's trial only);
- docker: DockerSpawner, one container per student from the course's lab image, a named volume for their work, CPU
  and memory limits, their GPU as a device request.
Both: NativeAuthenticator (no open sign-up; the roster's accounts exist from the start, the trainer approves other
sign-ups), the trainer as admin, each student's GPU (``CUDA_VISIBLE_DEVICES`` locally), the labs copied by the
student's own process at each start (``nvlab.classroom.seed``), the idle culler as a hub service, HTTPS with the
trainer's certificate. JupyterHub and its plug-ins are imported here only, when the hub loads its configuration."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path
from typing import Any

CULLER_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]
# what `nvlab classroom` itself does through the hub's REST API (start, stop and list servers; benchmark; tests)
CLI_SCOPES = ["admin:users", "admin:servers", "list:users", "read:users", "read:servers", "access:servers"]


def device_for(plan: dict[str, Any], username: str) -> str | None:
    """The GPU (UUID, or '' for none) of ``username``: the plan's, else (a sign-up the trainer approved) the pool's
    device picked by the name's hash; None where the class has no GPUs."""
    if username in plan["gpus"]:
        return plan["gpus"][username]
    pool = plan.get("pool") or []
    return pool[zlib.crc32(username.encode()) % len(pool)] if pool else None


def _roster_authenticator() -> type:
    from nativeauthenticator import NativeAuthenticator
    from nativeauthenticator.orm import UserInfo
    from traitlets import Unicode

    class RosterNativeAuthenticator(NativeAuthenticator):
        """NativeAuthenticator whose roster accounts exist before anyone signs up: at hub start, each roster user
        without an account gets one, approved, with the bcrypt hash ``nvlab classroom up`` wrote (never a
        password: those went only to the trainer's --passwords-out file)."""

        accounts_file = Unicode("", config=True, help="JSON {username: bcrypt hash} of the accounts to create")

        def add_user(self, user: Any) -> Any:
            result = super().add_user(user)
            if self.accounts_file and Path(self.accounts_file).is_file():
                hashes = json.loads(Path(self.accounts_file).read_text())
                if user.name in hashes and not UserInfo.find(self.db, user.name):
                    self.db.add(UserInfo(username=user.name, password=hashes[user.name].encode(), is_authorized=True))
                    self.db.commit()
            return result

    return RosterNativeAuthenticator


def configure(c: Any, plan: dict[str, Any] | Path | str) -> None:
    """Fill JupyterHub's config object ``c`` from ``plan`` (a dict, or the path of its JSON file)."""
    if not isinstance(plan, dict):
        plan = json.loads(Path(plan).read_text())
    state = Path(plan["state"])
    students = plan["students"]
    c.JupyterHub.ip = plan["ip"]
    c.JupyterHub.port = plan["port"]
    c.JupyterHub.hub_ip = plan["hub_ip"]
    c.JupyterHub.hub_port = plan["hub_port"]
    if plan.get("hub_connect_ip"):
        c.JupyterHub.hub_connect_ip = plan["hub_connect_ip"]
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{plan['proxy_api_port']}"
    if plan["mode"] == "local":  # what `down` stops; in Docker the container's pids mean nothing to the host
        c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
        c.JupyterHub.pid_file = str(state / "hub.pid")
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.cleanup_servers = True  # the hub's stop (`nvlab classroom down`) stops every student's server
    c.JupyterHub.cleanup_proxy = True
    if plan.get("ssl_cert"):
        c.JupyterHub.ssl_cert = plan["ssl_cert"]
        c.JupyterHub.ssl_key = plan["ssl_key"]

    # accounts: NativeAuthenticator; JupyterHub >= 5 refuses everyone unless told, and NativeAuthenticator checks
    # each login's approval itself, so allow_all is safe with it (and lets approved sign-ups in)
    c.JupyterHub.authenticator_class = _roster_authenticator()
    c.RosterNativeAuthenticator.accounts_file = str(state / "accounts.json")
    c.Authenticator.allow_all = True
    c.Authenticator.admin_users = {s["username"] for s in students if s["role"] == "trainer"}
    c.Authenticator.allowed_users = {s["username"] for s in students}  # hub users from the start: the admin page
    c.NativeAuthenticator.open_signup = False
    c.NativeAuthenticator.enable_signup = plan.get("signup", True)
    c.NativeAuthenticator.minimum_password_length = 10

    # each student's server: the labs seeded by the student's own process, then the single-user server
    py = plan["python"]
    c.Spawner.cmd = [py, "-m", "nvlab.classroom.seed", "--labs", plan["labs_src"], "--dest", plan["labs_dest"],
                     "--", py, "-m", "jupyterhub.singleuser"]
    c.Spawner.default_url = "/lab"
    c.Spawner.notebook_dir = plan["notebook_dir"]
    # 20 servers starting at once on 2 cores were ready at p95 34 s: a wide margin before a start counts as failed
    c.Spawner.start_timeout = 300
    c.Spawner.http_timeout = 180
    if plan.get("mem_limit"):
        c.Spawner.mem_limit = plan["mem_limit"]
    if plan.get("cpu_limit"):
        c.Spawner.cpu_limit = float(plan["cpu_limit"])
    if plan["mode"] == "docker":
        d = plan["docker"]
        c.JupyterHub.spawner_class = "dockerspawner.DockerSpawner"
        c.DockerSpawner.image = d["image"]
        c.DockerSpawner.network_name = d["network"]  # the hub's network: servers reach the hub by its name
        c.DockerSpawner.remove = True  # a stopped server's container goes; its volume (the student's work) stays
        c.DockerSpawner.name_template = "nvlab-classroom-{username}"
        # one named volume per student, kept across servers, hub restarts and course versions
        c.DockerSpawner.volumes = {"nvlab-classroom-{username}": d["work_dir"]}
        c.DockerSpawner.extra_host_config = {"shm_size": "2g"}  # DataLoader workers use /dev/shm
    elif plan.get("system_users", True):
        c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
    else:
        c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
        c.SimpleLocalProcessSpawner.home_dir_template = str(Path(plan["homes"]) / "{username}")

    def gpu_hook(spawner: Any) -> None:
        """Hand the student's GPU to their server: CUDA_VISIBLE_DEVICES here, a device request in Docker."""
        device = device_for(plan, spawner.user.name)
        if plan["mode"] == "docker":
            if device:
                from docker.types import DeviceRequest

                spawner.extra_host_config = {**spawner.extra_host_config, "device_requests": [
                    DeviceRequest(device_ids=[device], capabilities=[["gpu"]])]}
            return
        # '' hides every GPU from a student without one: CUDA then sees none rather than all of them
        spawner.environment = {**spawner.environment, "CUDA_VISIBLE_DEVICES": device or "",
                               "NVLAB_CLASSROOM_GPU": device or "none"}

    c.Spawner.pre_spawn_hook = gpu_hook

    # hub services: the idle culler, the CLI's API token, the trainer's progress page where it exists
    services: list[dict[str, Any]] = [
        {"name": "idle-culler", "command": [sys.executable, "-m", "jupyterhub_idle_culler",
                                            f"--timeout={plan['idle_timeout_s']}",
                                            f"--cull-every={plan['cull_every_s']}"]},
        {"name": "nvlab-classroom", "api_token": Path(state / "api_token").read_text().strip()},
    ]
    roles: list[dict[str, Any]] = [
        {"name": "idle-culler", "scopes": CULLER_SCOPES, "services": ["idle-culler"]},
        {"name": "nvlab-classroom", "scopes": CLI_SCOPES, "services": ["nvlab-classroom"]},
    ]
    try:  # the trainer's progress page: its module gives the hub service entry and the students' environment
        from nvlab.classroom import progress_service as progress
    except ImportError as err:  # a hub that cannot import it: no page, and the hub's log says why
        print(f"nvlab classroom: no progress page ({err}): the hub's Python needs nvlab.classroom and "
              "lab_utils.course (docker/classroom/Dockerfile.hub copies both)", file=sys.stderr)
        progress = None
    if progress and plan.get("progress_port"):
        host = plan.get("progress_host", "127.0.0.1")  # the hub's container under Docker: students' servers post there
        services.append(progress.hub_service_config(plan["progress_port"], host=host))
        roles.append(progress.hub_role())  # lists students who have not checked anything yet too
        c.Spawner.environment = progress.spawner_environment(plan["progress_port"], host=host)
    c.JupyterHub.services = services
    c.JupyterHub.load_roles = roles
