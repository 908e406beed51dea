"""``nvlab classroom up/down/check-gpus``: start the class's hub from a roster, stop it, check each student's GPU.

``prepare`` checks everything (roster, GPUs, programs, the Python the students run, the password file) and raises
``ClassroomError`` before anything starts; ``start`` then creates the accounts (and, as root in local mode, the system
users), writes the hub's state folder (mode 0700: its database, cookie secret, API token, plan and log) and starts
JupyterHub in the background; ``stop`` ends the hub, its proxy and every server it started, and keeps the students'
work. Passwords go only to the ``--passwords-out`` file (mode 0600); the hub gets bcrypt hashes."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import pwd
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from lab_utils.course.catalog import repo_root
from lab_utils.procs import free_port, pid_alive, tail, wait_until
from nvlab.classroom import DEFAULT_STATE
from nvlab.classroom.roster import (
    RosterError,
    assign_gpus,
    gpu_inventory,
    gpu_pool,
    read_roster,
    sharing_note,
)

HUB_PACKAGES = {"jupyterhub": "jupyterhub", "nativeauthenticator": "jupyterhub-nativeauthenticator",
                "jupyterhub_idle_culler": "jupyterhub-idle-culler"}
# what a student's server imports: the single-user server, JupyterLab and the course
STUDENT_IMPORTS = "import jupyterhub.singleuser, jupyterlab, lab_utils"
COMPOSE = repo_root() / "docker" / "classroom" / "compose.yaml"
CONTAINER_STATE = "/srv/nvlab/state"


class ClassroomError(RuntimeError):
    """Why the classroom cannot start or stop; the message says what to do."""


@dataclass
class Options:
    """What ``nvlab classroom up`` was asked for."""

    roster: Path
    local: bool = False
    gpus: str | None = None  # None: 'all' where GPUs exist, else 'none'
    ip: str = "0.0.0.0"
    port: int = 8000
    state: Path = DEFAULT_STATE
    passwords_out: Path | None = None
    idle_timeout_s: int = 3600
    cull_every_s: int = 60
    ssl_cert: Path | None = None
    ssl_key: Path | None = None
    python: str = sys.executable
    mem_limit: str | None = None
    cpu_limit: float | None = None
    image: str = "nvlab/classroom-singleuser:26.09"
    extra_config: Path | None = None
    notes: list[str] = field(default_factory=list)


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise ClassroomError(why)


def running_hub(state: Path, name: str = "hub.pid") -> int | None:
    """The pid in this state folder's ``name`` (the hub's, or ``proxy.pid``) while that process runs."""
    try:
        pid = int((state / name).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def existing_accounts(state: Path) -> set[str]:
    """Accounts NativeAuthenticator already holds in this state folder's database (read only)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{state / 'jupyterhub.sqlite'}?mode=ro", uri=True)) as con:
            return {r[0] for r in con.execute("SELECT username FROM users_info")}
    except sqlite3.Error:  # no database yet (read-only mode creates none), or none of NativeAuthenticator's tables
        return set()


@functools.cache  # a few seconds each: asked by students_python and again by prepare
def _runs_as_nobody(python: str) -> str | None:
    """Why ``python`` cannot run a student's server as an unprivileged user (None when it can); as root only."""
    runuser = shutil.which("runuser")
    if not runuser:
        return None
    out = subprocess.run([runuser, "-u", "nobody", "--", python, "-c", STUDENT_IMPORTS], capture_output=True,
                         text=True, env=course_env(), cwd="/", timeout=120)
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["exit " + str(out.returncode)])[-1]


def students_python(folder: Path) -> str:
    """A Python every user can run with this environment's packages: this one when an unprivileged user can (root
    only checks that), else a virtual environment in ``folder`` (made world-readable) of the system's python3 of the
    same version, seeing this environment's site-packages. For a trainer whose environment lives in a private home,
    and for the tests."""
    if os.geteuid() != 0 or _runs_as_nobody(sys.executable) is None:
        return sys.executable
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.is_file():
        raise ClassroomError(f"students cannot run {sys.executable} and there is no {system} to build a readable "
                             "environment from: make the course's virtual environment from a system Python")
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    pth = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "course.pth"
    pth.write_text(f"import site; site.addsitedir({site!r})\n")  # and that folder's own .pth files
    for sub in ("etc/jupyter", "share/jupyter"):  # Jupyter's extensions and JupyterLab's app live under the prefix
        if (Path(sys.prefix) / sub).is_dir():
            (folder / sub).parent.mkdir(parents=True, exist_ok=True)
            (folder / sub).symlink_to(Path(sys.prefix) / sub)
    for d in (folder, *folder.rglob("*")):
        if not d.is_symlink():  # bin/python points at the system's interpreter: left as it is
            d.chmod(d.stat().st_mode | (0o555 if d.is_dir() else 0o444))
    return str(folder / "bin" / "python")


def course_env() -> dict[str, str]:
    """The hub's environment: the course's checkout first on the path (the servers inherit it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root()), *filter(None, [env.get("PYTHONPATH")])])
    return env


def prepare(opts: Options) -> dict[str, Any]:
    """Everything checked, nothing started: the plan the hub's configuration reads. Raises ``ClassroomError`` or
    ``RosterError`` naming each problem and its fix."""
    students = read_roster(opts.roster)
    devices, why = gpu_inventory()
    spec = opts.gpus or ("all" if devices else "none")
    pool = gpu_pool(spec, devices, why)
    assigned = assign_gpus(students, pool, devices, why)
    if note := sharing_note(assigned):
        opts.notes.append(note)
    state = opts.state.resolve()
    if pid := running_hub(state):
        raise ClassroomError(f"a classroom hub already runs from {state} (pid {pid}): `nvlab classroom down "
                             f"--state {opts.state}` first, or give another --state")
    new = [s.username for s in students if s.username not in existing_accounts(state)]
    if new and not opts.passwords_out:
        raise ClassroomError(f"{len(new)} new account(s) ({', '.join(new[:5])}{' ...' if len(new) > 5 else ''}) "
                             "need passwords: pass --passwords-out FILE (written with mode 0600; passwords are "
                             "never printed)")
    if new and opts.passwords_out and opts.passwords_out.exists():
        raise ClassroomError(f"--passwords-out {opts.passwords_out} already exists: give a new file (this one may "
                             "hold passwords handed out earlier)")
    if (opts.ssl_cert is None) != (opts.ssl_key is None):
        raise ClassroomError("give both --ssl-cert and --ssl-key (the certificate and its private key)")
    for f in (opts.ssl_cert, opts.ssl_key, opts.extra_config):
        _need(f is None or f.is_file(), f"{f} does not exist")
    plan: dict[str, Any] = {
        "mode": "local" if opts.local else "docker",
        "ip": opts.ip, "port": opts.port,
        "students": [{"username": s.username, "email": s.email, "role": s.role} for s in students],
        "gpus": {u: (d.uuid if d else "") for u, d in assigned.items()},
        "gpu_names": {u: (f"{d.kind} {d.index} {d.name} {d.uuid}" if d else "none") for u, d in assigned.items()},
        "pool": [d.uuid for d in pool],
        "idle_timeout_s": opts.idle_timeout_s, "cull_every_s": opts.cull_every_s,
        "mem_limit": opts.mem_limit, "cpu_limit": opts.cpu_limit,
    }
    if opts.local:
        missing = [pip for mod, pip in HUB_PACKAGES.items() if importlib.util.find_spec(mod) is None]
        _need(not missing, f"{', '.join(missing)} not installed for {sys.executable}: pip install -e '.[classroom]'")
        _need(shutil.which("configurable-http-proxy") is not None,
              "configurable-http-proxy is not on the PATH (JupyterHub's proxy, an npm package): "
              "npm install -g configurable-http-proxy@5")
        root = os.geteuid() == 0
        if root and (why_not := _runs_as_nobody(opts.python)):
            raise ClassroomError(f"students cannot run {opts.python} with the course ({why_not}): each student's "
                                 "server runs as that student, so the Python environment and the course checkout "
                                 "must be readable by every user (an interpreter under /root is not); make the "
                                 "virtual environment from a system Python (/usr/bin/python3 -m venv) in a readable "
                                 "folder, or pass --python")
        plan.update({
            "state": str(state), "hub_ip": "127.0.0.1", "hub_port": free_port(), "proxy_api_port": free_port(),
            "progress_port": free_port(),  # the trainer's progress page
            "python": opts.python, "labs_src": str(repo_root() / "labs"), "labs_dest": "~/labs",
            "notebook_dir": "~", "system_users": root, "homes": str(state / "homes"),
            # no sign-up where a hub account is a system account: an approved sign-up named after an existing user
            # (root, a service account) would get a server running as that user
            "signup": not root,
            "ssl_cert": str(opts.ssl_cert.resolve()) if opts.ssl_cert else None,
            "ssl_key": str(opts.ssl_key.resolve()) if opts.ssl_key else None,
        })
        if not root:
            opts.notes.append("not root: every student's server runs as you, in a folder of its own under "
                              f"{state / 'homes'}, with no isolation between students (a trial only; run as root "
                              "for one system user per student)")
    else:
        _need(shutil.which("docker") is not None, "docker is not on the PATH: install Docker with the Compose plugin "
              "and the NVIDIA Container Toolkit, or run the hub without containers with --local")
        _need(opts.ssl_cert is not None, "the Docker hub serves HTTPS: pass --ssl-cert and --ssl-key (the trainer "
              "guide says how to make a self-signed pair with openssl)")
        plan.update({
            "state": CONTAINER_STATE, "ip": "0.0.0.0", "port": 8000, "hub_ip": "0.0.0.0", "hub_port": 8081,
            "hub_connect_ip": "hub", "proxy_api_port": 8001, "python": "python",
            "labs_src": "/workspace/course/labs", "labs_dest": "/workspace/work/labs",
            "notebook_dir": "/workspace/work",
            "ssl_cert": f"{CONTAINER_STATE}/hub.crt", "ssl_key": f"{CONTAINER_STATE}/hub.key",
            "docker": {"image": opts.image, "network": "nvlab-classroom", "work_dir": "/workspace/work"},
            # the trainer's progress page inside the hub's container, on an address students' containers reach
            "progress_port": 8090, "progress_host": "hub",
        })
    plan["new_accounts"] = new
    return plan


def _private_write(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (mode 0600 from its creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def _system_users(students: list[dict[str, Any]]) -> list[str]:
    """Create the roster's missing system users (home 0700: students cannot read each other's work)."""
    made = []
    for s in students:
        try:
            pwd.getpwnam(s["username"])
            continue
        except KeyError:
            pass
        out = subprocess.run(["useradd", "-m", "-s", "/bin/bash", s["username"]], capture_output=True, text=True,
                             timeout=60)
        if out.returncode:
            raise ClassroomError(f"useradd {s['username']} failed: {out.stderr.strip()}")
        os.chmod(pwd.getpwnam(s["username"]).pw_dir, 0o700)
        made.append(s["username"])
    return made


def hub_config_text(plan_path: str, extra: str | None) -> str:
    """The ``jupyterhub_config.py`` of a classroom: the one configuration, read from the plan."""
    lines = ["# written by nvlab classroom up: the hub's one configuration, nvlab/classroom/hub.py",
             "from nvlab.classroom.hub import configure", "",
             f"configure(c, {plan_path!r})  # noqa: F821 (c is JupyterHub's config object)"]
    if extra:
        lines.append(f"load_subconfig({extra!r})  # noqa: F821 (the trainer's own settings, e.g. OAuthenticator)")
    return "\n".join(lines) + "\n"


def start(opts: Options, plan: dict[str, Any]) -> dict[str, Any]:
    """Create what the plan needs and start the hub; returns a summary (url, pid, accounts made, users created)."""
    import bcrypt  # NativeAuthenticator's own hashing (installed with it)

    state = opts.state.resolve()
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    new = plan.pop("new_accounts")
    passwords = {u: secrets.token_urlsafe(12) for u in new}
    hashes = {}
    accounts = state / "accounts.json"
    with contextlib.suppress(OSError, ValueError):
        hashes = json.loads(accounts.read_text())
    hashes.update({u: bcrypt.hashpw(p.encode(), bcrypt.gensalt()).decode() for u, p in passwords.items()})
    _private_write(accounts, json.dumps(hashes))
    if not (state / "api_token").is_file():
        _private_write(state / "api_token", secrets.token_hex(32))
    plan_path = state / "plan.json"
    _private_write(plan_path, json.dumps(plan, indent=1))
    if passwords:
        _private_write(opts.passwords_out, "username,password\n" + "".join(f"{u},{p}\n" for u, p in passwords.items()))
    made = _system_users(plan["students"]) if plan["mode"] == "local" and plan["system_users"] else []
    if plan["mode"] == "docker":
        return _start_docker(opts, state, list(passwords))
    config = state / "jupyterhub_config.py"
    config.write_text(hub_config_text(str(plan_path), str(opts.extra_config.resolve()) if opts.extra_config else None))
    with (state / "hub.log").open("ab") as out:
        hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(config)],
                               cwd=state, env=course_env(), stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)  # outlives `up`
    (state / "hub.pid").write_text(f"{hub.pid}\n")  # at once: the hub writes the same pid once it has started
    url = f"{'https' if plan['ssl_cert'] else 'http'}://{'127.0.0.1' if plan['ip'] in ('0.0.0.0', '') else plan['ip']}"
    url += f":{plan['port']}"
    ready = wait_until(lambda: hub.poll() is not None or api_ok(url), timeout_s=180, poll_s=0.5)
    if not ready or hub.poll() is not None:  # no answer in time, or the hub exited
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hub.pid, signal.SIGTERM)
        raise ClassroomError(f"the hub did not start (exit {hub.poll()}); its log, {state / 'hub.log'}:\n"
                             + tail(state / "hub.log", 30))
    return {"url": url, "pid": hub.pid, "new_accounts": list(passwords), "system_users": made}


def _start_docker(opts: Options, state: Path, new: list[str]) -> dict[str, Any]:
    shutil.copyfile(opts.ssl_cert, state / "hub.crt")
    shutil.copyfile(opts.ssl_key, state / "hub.key")
    os.chmod(state / "hub.key", 0o600)
    if opts.extra_config:
        shutil.copyfile(opts.extra_config, state / "extra_config.py")
    env = dict(os.environ, NVLAB_CLASSROOM_STATE=str(state), NVLAB_HUB_PORT=str(opts.port),
               NVLAB_HUB_IP=opts.ip)
    compose = ["docker", "compose", "-f", str(COMPOSE)]
    # the students' image first (a profile of its own: built, never run as a service), then the hub
    for argv in ([*compose, "--profile", "image", "build"], [*compose, "up", "-d", "--build", "hub"]):
        out = subprocess.run(argv, env=env, timeout=3600)
        if out.returncode:
            raise ClassroomError(f"{' '.join(argv[:2])} {' '.join(argv[4:])} failed (exit {out.returncode}); see "
                                 "its output above")
    url = f"https://{opts.ip if opts.ip != '0.0.0.0' else '127.0.0.1'}:{opts.port}"
    if not wait_until(lambda: api_ok(url), timeout_s=300, poll_s=1):  # up when the hub answers through its proxy
        raise ClassroomError(f"the hub's container does not answer at {url} after 300 s: see `docker compose -f "
                             f"{COMPOSE} logs hub`")
    return {"url": url, "pid": None, "new_accounts": new, "system_users": []}


def api_ok(url: str) -> bool:
    """Whether the hub answers its REST API's root through the proxy (readiness)."""
    import ssl

    ctx = ssl._create_unverified_context() if url.startswith("https") else None  # our own, possibly self-signed
    try:
        with urllib.request.urlopen(f"{url}/hub/api/", timeout=3, context=ctx) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def api(state: Path, method: str, path: str, body: Any = None, timeout_s: float = 30) -> Any:
    """The hub's REST API as ``nvlab classroom`` (its service token), straight to the hub (not the proxy)."""
    plan = json.loads((state / "plan.json").read_text())
    token = (state / "api_token").read_text().strip()
    req = urllib.request.Request(f"http://127.0.0.1:{plan['hub_port']}/hub/api{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        data = r.read()
    return json.loads(data) if data else None


def read_plan(state: Path) -> dict[str, Any]:
    """The plan ``up`` wrote into ``state``; ``ClassroomError`` naming the fix where there is none."""
    try:
        return json.loads((state.resolve() / "plan.json").read_text())
    except (OSError, ValueError):
        raise ClassroomError(f"no classroom in {state} (no readable plan.json): give the --state that `nvlab "
                             "classroom up` used") from None


def our_processes(plan: dict[str, Any]) -> list[psutil.Process]:
    """Processes of this hub: the single-user servers (and their kernels) that talk to its port, its services."""
    needle = f"127.0.0.1:{plan['hub_port']}/hub/api"
    out = []
    for p in psutil.process_iter():
        try:
            if needle in p.environ().get("JUPYTERHUB_API_URL", ""):
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def stop(state: Path, grace_s: float = 120) -> list[str]:
    """Stop the hub of ``state``: SIGTERM (it stops every student's server and its proxy), then whatever is left.
    Returns what had to be killed (empty when the hub stopped everything itself)."""
    state = state.resolve()
    plan = read_plan(state)
    if plan["mode"] == "docker":
        subprocess.run(["docker", "compose", "-f", str(COMPOSE), "down"], check=False, timeout=600,
                       env=dict(os.environ, NVLAB_CLASSROOM_STATE=str(state)))
        return []
    hub, proxy = running_hub(state), running_hub(state, "proxy.pid")
    if hub:
        os.kill(hub, signal.SIGTERM)
        psutil.wait_procs([psutil.Process(hub)], timeout=grace_s)
    left = [p for p in our_processes(plan) if p.is_running()]
    left += [psutil.Process(pid) for pid in (hub, proxy) if pid and pid_alive(pid)]
    killed = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            killed.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return killed


GPU_PROBE = ("import json, os, torch\n"
             "n = torch.cuda.device_count()\n"
             "print(json.dumps({'visible': os.environ.get('CUDA_VISIBLE_DEVICES'), 'count': n,\n"
             "  'uuids': [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)],\n"
             "  'names': [torch.cuda.get_device_name(i) for i in range(n)]}))\n")


def check_gpus(state: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Run, as each student with the environment their server gets, what their kernel would see of the GPUs
    (torch): one row per student, and the problems (a student who sees no GPU or several, two who share one
    where the pool had enough for each)."""
    plan = read_plan(state)
    rows, problems = [], []
    for s in plan["students"]:
        device = plan["gpus"].get(s["username"], "")
        env = dict(course_env(), CUDA_VISIBLE_DEVICES=device or "")
        argv = [plan["python"], "-c", GPU_PROBE]
        if plan.get("system_users") and os.geteuid() == 0:
            argv = ["runuser", "-u", s["username"], "--", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", timeout=300)
        try:
            seen = json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            seen = {"count": None, "uuids": [], "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
        rows.append({"username": s["username"], "assigned": plan["gpu_names"].get(s["username"], "none"), **seen})
        if device and seen.get("count") != 1:
            problems.append(f"{s['username']} was given {device} but sees {seen.get('count')} GPU(s)"
                            + (f": {seen['error']}" if seen.get("error") else ""))
    by_uuid: dict[str, list[str]] = {}
    for r in rows:
        for u in r.get("uuids") or []:
            by_uuid.setdefault(u, []).append(r["username"])
    if len(set(plan["gpus"].values()) - {""}) >= len([u for u in plan["gpus"].values() if u]):  # one each
        problems += [f"{', '.join(us)} see the same GPU {u}" for u, us in by_uuid.items() if len(us) > 1]
    return rows, problems


def summary_lines(plan: dict[str, Any], started: dict[str, Any], opts: Options) -> list[str]:
    """What `up` says when the hub is up: the address, accounts, GPUs, notes; never a password."""
    where = (f"pid {started['pid']}; its log {opts.state.resolve() / 'hub.log'}" if started["pid"]
             else f"its log: docker compose -f {COMPOSE} logs hub")
    lines = [f"nvlab classroom: the hub is up at {started['url']} ({where}); the trainer signs in and opens "
             f"{started['url']}/hub/admin"]
    if started["new_accounts"]:
        lines.append(f"nvlab classroom: {len(started['new_accounts'])} new account(s); their passwords are in "
                     f"{opts.passwords_out} (mode 0600): hand each student their line")
    if started["system_users"]:
        lines.append(f"nvlab classroom: created system users {', '.join(started['system_users'])} (homes mode 0700)")
    lines += [f"  {u}: {g}" for u, g in plan["gpu_names"].items()]
    lines += [f"nvlab classroom: note: {n}" for n in opts.notes]
    return lines


__all__ = ["ClassroomError", "Options", "RosterError", "api", "check_gpus", "prepare", "start", "stop"]
