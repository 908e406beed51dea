"""The trainer's progress page in a real JupyterHub 5.5 (local processes, the real configurable-http-proxy), opened in
Debian's chromium through Playwright: a student's check, run in a kernel of the student's own hub-spawned server,
shows on the page within 10 s without reloading it; a student gets 403 on the page; the CSV has the check's row; a
malformed report is said on that student's row while the page keeps working; a record made before the service knew
the student arrives with the kernel's first report; a student who has not checked anything has a row too.

The hub here is the smallest configuration that has what the page needs (``DummyAuthenticator``, the
``SimpleLocalProcessSpawner``, the service from ``hub_service_config``, one test service with a token to drive the
REST API): the classroom's own hub configuration registers the same service entry. Every process it starts carries
``MARKER`` in its environment and is checked gone at the end. Without jupyterhub, configurable-http-proxy, playwright
or chromium the tests skip, unless ``NVLAB_REQUIRE_CLASSROOM=1`` (the hub and its proxy) or ``NVLAB_REQUIRE_BROWSER=1``
(playwright and chromium) are set (CI), where they fail.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from _require import marked, missing

from lab_utils.procs import free_port, popen_owned, stop_group
from nvlab.classroom.progress_service import REFRESH_S

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("NVLAB_CHROMIUM", "/usr/bin/chromium")
REQUIRE_BROWSER = "NVLAB_REQUIRE_BROWSER"
REQUIRE_HUB = "NVLAB_REQUIRE_CLASSROOM"
MARKER = "NVLAB_PROGRESS_HUB_TEST"
PASSWORD = "pw-" + os.urandom(8).hex()
API_TOKEN = os.urandom(24).hex()
TRAINER, STUDENT, OTHER, IDLE = "nvlab-t-trainer", "nvlab-t-student1", "nvlab-t-student2", "nvlab-t-student3"


def _api(base: str, method: str, path: str, body: dict | None = None, token: str = API_TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(f"{base}/hub/api{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            text = reply.read()
            return reply.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode(errors="replace")[:500]}


def _answers(base: str) -> bool:
    try:
        return _api(base, "GET", "/")[0] == 200
    except (urllib.error.URLError, OSError):
        return False


HUB_CONFIG = """
import json, sys
from nvlab.classroom.progress_service import hub_role, hub_service_config, spawner_environment
s = json.loads({settings!r})
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = s["port"]
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = s["hub_port"]
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:%d" % s["proxy_api_port"]
c.ConfigurableHTTPProxy.pid_file = s["dir"] + "/proxy.pid"
c.JupyterHub.db_url = "sqlite:///" + s["dir"] + "/hub.sqlite"
c.JupyterHub.cookie_secret_file = s["dir"] + "/cookie_secret"
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = s["password"]
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {{s["trainer"]}}
c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = s["dir"] + "/home/{{username}}"
c.Spawner.cmd = [s["singleuser"]]
c.Spawner.args = ["--allow-root"]  # CI runs as root; the test's students are folders, not system users
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.environment = {{**spawner_environment(s["service_port"]), s["marker"]: s["run"],
                          "PYTHONPATH": s["root"], "IPYTHONDIR": s["dir"] + "/ipython"}}
service = hub_service_config(s["service_port"], data_dir=s["dir"] + "/progress-data")
service["environment"] = {{s["marker"]: s["run"], "PYTHONPATH": s["root"]}}
c.JupyterHub.services = [service, {{"name": "nvlab-test", "api_token": s["api_token"]}}]
c.JupyterHub.load_roles = [hub_role(), {{"name": "nvlab-test", "services": ["nvlab-test"],
                                        "scopes": ["admin:users", "admin:servers", "tokens", "access:servers"]}}]
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        missing("jupyterhub is not installed (pip install -e '.[classroom]')", REQUIRE_HUB)
    if not shutil.which("configurable-http-proxy"):
        missing("configurable-http-proxy is not on the PATH (npm install -g configurable-http-proxy)", REQUIRE_HUB)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing("playwright is not installed (pip install -e '.[test]')", REQUIRE_BROWSER)
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        missing(f"no chromium at {CHROMIUM} (apt-get install chromium, or set NVLAB_CHROMIUM)", REQUIRE_BROWSER)
    singleuser = Path(sys.executable).parent / "jupyterhub-singleuser"
    work = tmp_path_factory.mktemp("hub")
    run = f"{os.getpid()}-{time.monotonic_ns()}"
    settings = {"port": free_port(), "hub_port": free_port(), "proxy_api_port": free_port(),
                "service_port": free_port(), "dir": str(work), "password": PASSWORD, "trainer": TRAINER,
                "singleuser": str(singleuser), "marker": MARKER, "run": run, "root": str(ROOT),
                "api_token": API_TOKEN}
    (work / "jupyterhub_config.py").write_text(HUB_CONFIG.format(settings=json.dumps(settings)))
    env = {**os.environ, MARKER: run, "PYTHONPATH": str(ROOT)}
    log = (work / "hub.log").open("w")
    proc = popen_owned([sys.executable, "-m", "jupyterhub", "-f", str(work / "jupyterhub_config.py")],
                       env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    base = f"http://127.0.0.1:{settings['port']}"
    try:
        deadline = time.monotonic() + 90
        while not _answers(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the hub did not start:\n{(work / 'hub.log').read_text()[-4000:]}")
            time.sleep(0.5)
        yield {"base": base, "work": work, "log": work / "hub.log", "run": run}
    finally:
        stop_group(proc, grace_s=30)  # SIGTERM: the hub stops the servers, its services and the proxy
        log.close()
        deadline = time.monotonic() + 15
        while (left := marked(MARKER, run)) and time.monotonic() < deadline:
            time.sleep(0.3)
        for line in left:
            with contextlib.suppress(OSError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        assert not left, "left running after the hub stopped:\n" + "\n".join(left)


def _start_server(base: str, user: str) -> None:
    _api(base, "POST", "/users", {"usernames": [user]})
    code, out = _api(base, "POST", f"/users/{user}/server")
    assert code in (201, 202), (code, out)
    deadline = time.monotonic() + 150
    while not (_api(base, "GET", f"/users/{user}")[1].get("servers", {}).get("", {}).get("ready")):
        assert time.monotonic() < deadline, f"{user}'s server did not become ready"
        time.sleep(0.5)


async def _execute(base: str, user: str, code: str, timeout_s: float = 120) -> str:
    """Run ``code`` in a new kernel of ``user``'s server (Jupyter's kernel websocket protocol); its output text."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    headers = {"Authorization": f"token {API_TOKEN}"}
    req = urllib.request.Request(f"{base}/user/{user}/api/kernels", data=b"{}", method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=60) as reply:
        kernel = json.loads(reply.read())["id"]
    ws_url = f"{base.replace('http', 'ws', 1)}/user/{user}/api/kernels/{kernel}/channels"
    ws = await websocket_connect(HTTPRequest(ws_url, headers=headers))
    msg_id, out = uuid.uuid4().hex, []
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "username": user, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                   "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = await asyncio.wait_for(ws.read_message(), timeout=deadline - time.monotonic())
        if raw is None:
            break
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            out.append("\n".join(content["traceback"]))
        elif kind == "execute_reply":
            break
    ws.close()
    return "".join(out)


def _login(browser, base: str, user: str):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    page.goto(f"{base}/hub/login")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", PASSWORD)
    page.click("[type=submit]")
    page.wait_for_url(lambda url: "/hub/login" not in url, timeout=60_000)
    return ctx, page


def _open(ctx, page, url: str) -> int:
    """Open ``url`` in ``page``; its HTTP status. Playwright's goto can give no response (None) although the page
    shows ``url`` (seen once in a CI run on a loaded machine, straight after the login's redirects): the status is
    then read again with the context's cookies."""
    reply = page.goto(url)
    return reply.status if reply is not None else ctx.request.get(url).status


def test_a_students_check_reaches_the_trainers_page(hub, tmp_path):
    from playwright.sync_api import sync_playwright

    base = hub["base"]
    for user in (TRAINER, STUDENT, OTHER, IDLE):
        _api(base, "POST", "/users", {"usernames": [user]})
    # a check from before the service knew the student (the service down, or no hub yet): the kernel's first
    # report sends it along
    mine = hub["work"] / "home" / STUDENT / ".nvlab" / "progress.jsonl"
    mine.parent.mkdir(parents=True)
    mine.write_text(json.dumps({"v": 1, "id": "earlier", "lab": "00", "exercise": "00.1 layers of the stack",
                                "outcome": "right", "message": "", "attempt": 1, "time": time.time() - 3600}) + "\n")
    _start_server(base, STUDENT)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"],
                                    env={**os.environ, MARKER: hub["run"]})
        try:
            # a student is refused the page
            ctx, page = _login(browser, base, OTHER)
            status = _open(ctx, page, f"{base}/services/progress/")
            assert status == 403, (status, page.content()[:500])
            ctx.close()
            # the trainer opens the page before the student checks: the row must arrive without a reload
            ctx, page = _login(browser, base, TRAINER)
            status = _open(ctx, page, f"{base}/services/progress/")
            assert status == 200, (status, page.content()[:500])
            page.wait_for_selector("#rows")
            assert "00.4" not in page.inner_text("#rows")
            # every student has a row from the start (hub_role() lets the service list them), the trainer none
            idle = page.locator(f"#rows tr[data-student='{IDLE}']")
            assert "no checks yet" in idle.inner_text()
            assert page.locator(f"#rows tr[data-student='{TRAINER}']").count() == 0
            code = "from lab_utils.exercises import lab00 as ex\nfor _ in range(3):\n    ex.q4.check(1.0)\n"
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # playwright's loop runs in this thread
                out = pool.submit(asyncio.run, _execute(base, STUDENT, code)).result()
            assert out.count("incorrect") == 3, out
            checked = time.monotonic()
            row = page.locator(f"#rows tr[data-student='{STUDENT}']")
            try:
                row.filter(has_text="00.4 H200 memory in GiB").wait_for(timeout=10_000)
            except Exception as err:  # playwright's TimeoutError: say what the hub and the service logged
                raise AssertionError(f"{err}\nthe kernel said: {out}\nthe hub's log:\n"
                                     f"{hub['log'].read_text()[-3000:]}") from None
            seen_s = time.monotonic() - checked
            text = row.inner_text()
            assert "3 wrong" in text and "1/6" in text, text  # 00.1 right: the earlier record arrived too
            assert "stuck" in (row.get_attribute("class") or ""), "3 wrong checks just now are 'stuck now'"
            page.screenshot(path=str(tmp_path / "progress-page.png"))
            # the CSV, downloaded with the trainer's session
            csv_text = page.request.get(f"{base}/services/progress/progress.csv").text()
            assert f"{STUDENT},00,00.4 H200 memory in GiB,3,False,wrong,3,True," in csv_text, csv_text
            # a malformed report with the student's own token: said on that row, the page still answers
            code, tok = _api(base, "POST", f"/users/{OTHER}/tokens", {"note": "test", "expires_in": 600})
            assert code == 201, tok
            bad = urllib.request.Request(f"{base}/services/progress/api/records", method="POST",
                                         data=json.dumps({"records": [{"exercise": 7}]}).encode(),
                                         headers={"Authorization": f"token {tok['token']}"})
            with urllib.request.urlopen(bad, timeout=30) as reply:
                assert json.loads(reply.read()) == {"added": 0, "malformed": 1}
            other = page.locator(f"#rows tr[data-student='{OTHER}']")
            other.filter(has_text="malformed").wait_for(timeout=10_000)
            # "stuck now" shows the stuck student only, and stays so across the table's refreshes
            page.check("#stuck-only")
            assert row.is_visible() and not other.is_visible()
            time.sleep(REFRESH_S + 0.5)  # after a refresh of the table
            assert row.is_visible() and not other.is_visible()
            page.uncheck("#stuck-only")
            assert row.is_visible() and other.is_visible()
            ctx.close()
        finally:
            browser.close()
    # the student's own file has the three checks, numbered
    assert [json.loads(x)["attempt"] for x in mine.read_text().splitlines()] == [1, 1, 2, 3]
    print(f"the check showed on the trainer's page {seen_s:.1f} s after it ran")
    assert seen_s < 10
