"""The classroom hub for real: ``nvlab classroom up --local`` with a trainer and three students (system users made
by the hub's start, removed afterwards), the real JupyterHub 5.5 and configurable-http-proxy, NativeAuthenticator,
the idle culler, served over HTTPS (a self-signed pair made as the trainer guide says), driven through Playwright
and Debian's chromium as the students and the trainer would.

One hub for the module (its start, ~25 s on 2 cores, is most of the cost). Its idle culler stops a server idle for
40 s: the third student's server is started with the hub and the culler test, near the end, waits for it to go (a
test that needs the other students' servers starts them again where the culler has stopped them: ensure_running).
Test users are named ``nvlt<4 hex>-...`` (no real account has such a name); they and their homes go at the end.
Without root, JupyterHub's packages, the proxy, playwright or chromium the tests skip, unless
``NVLAB_REQUIRE_CLASSROOM=1`` (CI), where they fail."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _require import missing

from lab_utils.course.catalog import repo_root
from lab_utils.procs import free_port, pid_alive
from nvlab.classroom import manage

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("NVLAB_CHROMIUM", "/usr/bin/chromium")
REQUIRE_ENV = "NVLAB_REQUIRE_CLASSROOM"
IDLE_S, CULL_EVERY_S = 40, 5


def _nvlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "nvlab", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def remove_users(names: list[str]) -> None:
    for n in names:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(n)
            subprocess.run(["userdel", "-r", "-f", n], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def hub():
    """The class's hub, up; afterwards down, its users and their homes removed."""
    if os.geteuid() != 0:
        missing("the local classroom makes a system user per student: run as root", REQUIRE_ENV)
    try:
        import jupyterhub  # noqa: F401
        import jupyterhub_idle_culler  # noqa: F401
        import nativeauthenticator  # noqa: F401
        import playwright.sync_api  # noqa: F401
    except ImportError as err:
        missing(f"{err.name} is not installed (pip install -e '.[classroom,test]')", REQUIRE_ENV)
    if not any(Path(d, "configurable-http-proxy").is_file() for d in os.environ["PATH"].split(os.pathsep)):
        missing("configurable-http-proxy is not on the PATH (npm install -g configurable-http-proxy@5)", REQUIRE_ENV)
    if not os.access(CHROMIUM, os.X_OK):
        missing(f"no chromium at {CHROMIUM} (apt-get install chromium, or set NVLAB_CHROMIUM)", REQUIRE_ENV)
    prefix = f"nvlt{os.urandom(2).hex()}"
    trainer, students = f"{prefix}-trainer", [f"{prefix}-s{i}" for i in (1, 2, 3)]
    # not under the test session's private TMPDIR: the students' Python lives here, and they must reach it
    folder = Path(tempfile.mkdtemp(prefix=f"nvlab-classroom-test-{os.getpid()}-", dir="/tmp"))
    os.chmod(folder, 0o755)
    opened = _let_students_through()
    try:
        py = manage.students_python(folder / "py")
    except BaseException:
        for d, mode in opened:
            d.chmod(mode)
        raise
    roster = folder / "roster.csv"
    roster.write_text("username,email,role\n" + f"{trainer},trainer@example.org,trainer\n"
                      + "".join(f"{s},,\n" for s in students))
    state, passwords = folder / "state", folder / "passwords.csv"
    port = free_port()
    # HTTPS as in a class: the guide's self-signed pair, for this machine's loopback address
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-sha256", "-days", "1", "-nodes",
                    "-keyout", str(folder / "hub.key"), "-out", str(folder / "hub.crt"), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    try:
        up = _nvlab("classroom", "up", "--local", "--roster", str(roster), "--ip", "127.0.0.1", "--port", str(port),
                    "--state", str(state), "--passwords-out", str(passwords), "--python", py, "--gpus", "none",
                    "--idle-timeout", str(IDLE_S), "--cull-every", str(CULL_EVERY_S),
                    "--ssl-cert", str(folder / "hub.crt"), "--ssl-key", str(folder / "hub.key"))
        assert up.returncode == 0, up.stdout + up.stderr
        # the third student's server, started now, is left idle for the culler test
        manage.api(state, "POST", f"/users/{students[2]}/server", timeout_s=120)
        pw = dict(line.split(",", 1) for line in passwords.read_text().splitlines()[1:])
        yield {"base": f"https://127.0.0.1:{port}", "ca": folder / "hub.crt", "port": port, "state": state,
               "trainer": trainer, "students": students, "passwords": pw, "passwords_file": passwords, "up": up,
               "started": time.monotonic()}
    finally:
        _nvlab("classroom", "down", "--state", str(state))
        remove_users([trainer, *students])
        shutil.rmtree(folder, ignore_errors=True)
        for d, mode in opened:
            d.chmod(mode)


def _let_students_through() -> list[tuple[Path, int]]:
    """Search (x, never read) permission for others on the folders above the checkout and this environment, for
    the test's duration: a CI clone under a private home (/root is 0700) is otherwise out of the students' reach,
    as `nvlab classroom up` would say. Returns (folder, old mode) pairs to restore."""
    opened = []
    for top in {repo_root().resolve(), Path(sys.prefix).resolve()}:
        for d in reversed(top.parents):
            mode = d.stat().st_mode
            if not mode & stat.S_IXOTH:
                d.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
                opened.append((d, stat.S_IMODE(mode)))
    return opened


@pytest.fixture(scope="module")
def browser(hub):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: chromium's sandbox refuses to run as root (CI); the pages are the hub's own
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def login(browser, hub, user: str, landing: bool = False):
    """A browser context signed in as ``user`` through the hub's login form; (context, page). The page is a new one
    of that context unless ``landing`` (the page the sign-in landed on): the landing page's script (the
    spawn-pending redirect) can otherwise start a navigation while the test's own ``goto`` runs, and Playwright
    then returns no response for it (seen once: the progress page shown, ``goto`` gave None)."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, ignore_https_errors=True)  # self-signed
    pg = ctx.new_page()
    pg.goto(f"{hub['base']}/hub/login")
    pg.fill("#username_input", user)
    pg.fill("#password_input", hub["passwords"][user])
    pg.click("#login_submit")
    pg.wait_for_load_state()
    assert "/hub/login" not in pg.url, f"{user} could not sign in: {pg.locator('body').inner_text()[:300]}"
    if landing:
        return ctx, pg
    pg.close()
    return ctx, ctx.new_page()


def shot(pg, name: str) -> None:
    """A screenshot of the page into ``$NVLAB_SCREENSHOTS`` (CI keeps them), where that is set."""
    if folder := os.environ.get("NVLAB_SCREENSHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(Exception):
            pg.screenshot(path=str(Path(folder) / f"classroom-{name}.png"))


def server(hub, user: str) -> dict | None:
    return manage.api(hub["state"], "GET", f"/users/{user}")["servers"].get("")


def ensure_running(hub, user: str, timeout_s: float = 120) -> None:
    if not server(hub, user):
        with contextlib.suppress(Exception):  # 400 "already pending": the wait below decides
            manage.api(hub["state"], "POST", f"/users/{user}/server", timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    while not ((s := server(hub, user)) and s["ready"]):
        assert time.monotonic() < deadline, f"{user}'s server did not start in {timeout_s} s"
        time.sleep(0.5)


def test_a_student_signs_in_and_reaches_their_own_lab_with_their_copy_of_the_labs(hub, browser):
    s1 = hub["students"][0]
    ctx, pg = login(browser, hub, s1, landing=True)
    try:
        pg.wait_for_url(re.compile(rf"/user/{s1}/lab"), timeout=120_000)  # the hub starts the server, then redirects
        pg.locator(".jp-DirListing-item", has_text="labs").first.dblclick(timeout=60_000)
        pg.locator(".jp-DirListing-item", has_text="00_environment.ipynb").wait_for(timeout=30_000)
        shot(pg, "student-lab")
    except Exception:
        shot(pg, "student-lab-failed")
        raise
    finally:
        ctx.close()
    home = Path(pwd.getpwnam(s1).pw_dir)
    labs = sorted(p.name for p in (home / "labs").glob("*.ipynb"))
    assert labs == sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))
    uid = pwd.getpwnam(s1).pw_uid
    assert {p.stat().st_uid for p in (home / "labs").iterdir()} == {uid}, "the copy is the student's own"
    assert home.stat().st_mode & 0o777 == 0o700, "other students cannot read this home"


def test_a_students_request_to_another_students_server_is_refused(hub, browser):
    s1, s2 = hub["students"][:2]
    ensure_running(hub, s2)
    marker = "nvlab-private-" + os.urandom(4).hex()
    secret = Path(pwd.getpwnam(s2).pw_dir) / "labs" / "private.txt"
    secret.write_text(marker)
    os.chown(secret, pwd.getpwnam(s2).pw_uid, -1)
    ctx, pg = login(browser, hub, s1)
    try:
        for path in ("lab", "api/contents/labs", "files/labs/private.txt"):
            r = pg.goto(f"{hub['base']}/user/{s2}/{path}")
            body = pg.content()
            refused = r.status == 403 or "/hub/login" in pg.url or f"/user/{s1}/" in pg.url
            assert refused, f"{s1} reached {s2}'s {path}: {r.status} {pg.url}"
            assert marker not in body and "private.txt" not in body
    finally:
        ctx.close()
    # and without signing in at all: a redirect to the hub's login, never the content
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    try:
        tls = ssl.create_default_context(cafile=str(hub["ca"]))  # the hub's own certificate, verified
        opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPSHandler(context=tls))
        r = opener.open(f"{hub['base']}/user/{s2}/files/labs/private.txt", timeout=30)
        status, body = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read().decode(errors="replace")
    assert status in (302, 403) and marker not in body, status


def test_an_edited_lab_survives_stop_start_and_the_next_copy(hub):
    s1 = hub["students"][0]
    ensure_running(hub, s1)
    lab = Path(pwd.getpwnam(s1).pw_dir) / "labs" / "01_cuda_timing.ipynb"
    nb = json.loads(lab.read_text())
    nb["cells"][0]["source"] = "# my notes, kept\n" + "".join(nb["cells"][0]["source"])
    edited = json.dumps(nb)
    subprocess.run(["runuser", "-u", s1, "--", "tee", str(lab)], input=edited, text=True, capture_output=True,
                   check=True)
    manage.api(hub["state"], "DELETE", f"/users/{s1}/server", timeout_s=120)
    deadline = time.monotonic() + 60
    while server(hub, s1):
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.5)
    ensure_running(hub, s1)  # the start copies the labs again (seed): nothing of the student's is overwritten
    assert lab.read_text() == edited
    assert not list(lab.parent.glob("*.new-*")), "the course did not change: nothing new is offered"


def test_the_trainer_sees_every_students_server_in_the_admin_page(hub, browser):
    for user in hub["students"][:2]:  # the culler may have stopped one idle since the earlier tests
        ensure_running(hub, user)
    ctx, pg = login(browser, hub, hub["trainer"])
    try:
        pg.goto(f"{hub['base']}/hub/admin")
        for user in hub["students"]:  # each student's row, with their server's start or stop button
            row = pg.locator("tr", has_text=user).first
            row.wait_for(timeout=30_000)
            row.get_by_role("button", name=re.compile("(start|stop) server", re.I)).first.wait_for(timeout=10_000)
        for user in hub["students"][:2]:  # running (the third's may be going: the culler's)
            pg.locator("tr", has_text=user).first.get_by_role(
                "button", name=re.compile("stop server", re.I)).wait_for(timeout=10_000)
        shot(pg, "trainer-admin")
    finally:
        ctx.close()
    # a student is no admin: the admin page refuses them
    ctx, pg = login(browser, hub, hub["students"][1])
    try:
        r = pg.goto(f"{hub['base']}/hub/admin")
        assert r.status == 403 or "/hub/admin" not in pg.url
    finally:
        ctx.close()


def test_the_progress_page_is_the_trainers_and_lists_the_class(hub, browser):
    """The classroom's own configuration registers the trainer's progress page: the trainer (admin) gets it, with
    a row for every student (the page's role lists the class), and a student gets 403."""
    ctx, pg = login(browser, hub, hub["trainer"])
    try:
        r = pg.goto(f"{hub['base']}/services/progress/")
        assert r is not None and r.status == 200, (r and r.status, pg.content()[:500])
        for user in hub["students"]:
            pg.locator(f"#rows tr[data-student='{user}']").wait_for(timeout=30_000)
        shot(pg, "trainer-progress")
    finally:
        ctx.close()
    ctx, pg = login(browser, hub, hub["students"][0])
    try:
        r = pg.goto(f"{hub['base']}/services/progress/")
        assert r is not None and r.status == 403, (r and r.status, pg.content()[:500])
    finally:
        ctx.close()


def test_no_sign_up_where_accounts_are_system_users(hub, browser):
    ctx = browser.new_context(ignore_https_errors=True)
    try:
        r = ctx.new_page().goto(f"{hub['base']}/hub/signup")
        assert r.status == 404, "sign-up is off: a sign-up named root would get a server running as root"
    finally:
        ctx.close()


def test_passwords_only_in_their_0600_file_never_in_a_log(hub):
    assert hub["passwords_file"].stat().st_mode & 0o777 == 0o600
    assert set(hub["passwords"]) == {hub["trainer"], *hub["students"]}
    said = hub["up"].stdout + hub["up"].stderr + (hub["state"] / "hub.log").read_text()
    for user, password in hub["passwords"].items():
        assert password not in said, f"{user}'s password appears in the output or the hub's log"
    assert all(h.startswith("$2") for h in json.loads((hub["state"] / "accounts.json").read_text()).values())


def test_the_idle_culler_stops_an_idle_server(hub):
    s3 = hub["students"][2]
    deadline = hub["started"] + IDLE_S + 3 * CULL_EVERY_S + 60
    while server(hub, s3):
        assert time.monotonic() < deadline, f"{s3}'s server idle for {IDLE_S} s was not stopped"
        time.sleep(2)
    log = (hub["state"] / "hub.log").read_text()
    assert re.search(rf"DELETE /hub/api/users/{s3}/server \(idle-culler@", log), "stopped by the culler"


def test_down_stops_everything_and_keeps_the_students_work(hub):
    plan = json.loads((hub["state"] / "plan.json").read_text())
    hub_pid = int((hub["state"] / "hub.pid").read_text())
    proxy_pid = int((hub["state"] / "proxy.pid").read_text())
    out = _nvlab("classroom", "down", "--state", str(hub["state"]))
    assert out.returncode == 0, out.stderr
    assert "left these behind" not in out.stderr, out.stderr  # the hub stopped its servers and proxy itself
    assert not pid_alive(hub_pid) and not pid_alive(proxy_pid)
    uids = {pwd.getpwnam(u).pw_uid for u in [hub["trainer"], *hub["students"]]}
    import psutil

    left = [p.info for p in psutil.process_iter(["pid", "uids", "cmdline"]) if p.info["uids"].real in uids]
    assert not left, left
    assert not manage.our_processes(plan)
    for port in (hub["port"], plan["hub_port"], plan["proxy_api_port"]):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    labs = Path(pwd.getpwnam(hub["students"][0]).pw_dir) / "labs"
    assert "# my notes, kept" in (labs / "01_cuda_timing.ipynb").read_text()
