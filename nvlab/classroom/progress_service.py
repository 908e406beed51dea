"""The trainer's page: a JupyterHub service at ``/services/progress/`` that shows, live, which student is stuck on
which exercise. Started and proxied by the hub (``hub_service_config``); the page, its table and its CSV are behind
the hub's OAuth (``HubOAuth``): the hub's admins have ``access:services`` and get them, students get 403.

What it shows: students x labs (exercises right out of each lab's; with ``hub_role()`` every student of the hub,
those without a check too), the exercise each student is stuck on (the
most wrong checks since that exercise's last right one, and how long since the first of them), the last activity,
a "stuck now" filter (``progress.STUCK_WRONG`` wrong checks or more, the latest within ``progress.STUCK_WINDOW_S``),
a table that refreshes itself every ``REFRESH_S`` without reloading the page, and ``progress.csv`` (one row per
student and exercise). A student's malformed records, or a file over the size limit, are said on that student's
row; the page for the others is the same.

Where the records come from, in all three deployments (the design choice): **each student's server reports its
records to this service over HTTP, with its own hub API token** (``POST api/records``; ``lab_utils.course.progress``
sends them from the kernel, in a background thread, right after writing them to the student's own file).

- Reading the students' files directly works only in local mode (the hub runs as root beside the homes). Under
  DockerSpawner each student's named volume is created when the student first starts, and a running service
  container cannot mount volumes that appear after it started (it would need the Docker socket, which is root on
  the host). On Kubernetes each student's volume is a ReadWriteOnce claim mounted by that student's pod only.
- Every spawned server can already reach the hub (``JUPYTERHUB_API_URL``) and holds a token of its own
  (``JUPYTERHUB_API_TOKEN``), in local mode, in a container and in a pod alike: the service asks the hub who owns
  the token, so a student can only ever write their own row, and no shared file system is needed anywhere.
- The student's file stays the source of truth: a kernel's first report re-sends the file's newest records (the
  service keeps each record id once), so records made while the service was down arrive with a later check. The
  service keeps what it received in its data folder (one JSON-lines file per student) and reads it back at start.

Spawned servers find the service at ``$NVLAB_PROGRESS_URL``: the hub configuration gives it to them
(``c.Spawner.environment.update(spawner_environment(port))``); without it nothing is sent (no guessed address
receives a token). Run by the hub as ``python -m
nvlab.classroom.progress_service --data DIR``; ``render_page``/``render_rows``/``render_csv`` are what the
benchmark times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import html
import io
import json
import os
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.course import progress

NAME = "progress"
REFRESH_S = 3
MAX_BODY = 2**20  # one report (bytes): a kernel sends at most progress.SYNC_TAIL_BYTES of records at once
MAX_RECORDS = 50_000  # kept per student (the newest); 70 exercises x 10 checks is 700
ID_CHARS = 64
LIST_S = 30  # how often the service asks the hub for the class's list (and at each page view)


def hub_service_config(port: int, host: str = "127.0.0.1", data_dir: str | None = None) -> dict[str, Any]:
    """The JupyterHub ``services`` entry: the hub starts this module (as the hub's user) listening on
    ``http://host:port``, and its proxy routes ``/services/progress/`` to it. ``host``: an address the students'
    servers reach too (a container's or pod's hub address under DockerSpawner or Kubernetes). ``data_dir`` keeps
    the received records (default ``progress-service`` in the hub's working directory, beside its database). No
    extra role: the hub's admin role already holds ``access:services``, and reports are identified by the sending
    server's own token. With ``hub_role()`` in ``c.JupyterHub.load_roles`` the page also lists students who have not
    checked anything yet."""
    data = data_dir or "progress-service"  # relative: the service runs in the hub's working directory
    return {
        "name": NAME,
        "url": f"http://{host}:{int(port)}",
        "command": [sys.executable, "-m", "nvlab.classroom.progress_service", "--data", data],
        "oauth_no_confirm": True,  # the trainer is not asked to authorize the hub's own page
        "display": True,  # listed in the hub's Services menu
        "info": {"description": "the class at a glance: who is stuck on which exercise"},
    }


def spawner_environment(port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """What ``c.Spawner.environment`` needs so students' kernels report to the service at ``host:port``."""
    return {progress.ENV_URL: f"http://{host}:{int(port)}/services/{NAME}/"}


# --- the records of every student --------------------------------------------------------------------------------


@dataclass
class Student:
    """What the service holds of one student: the records (by id), problems to show on the row, a cached summary."""

    name: str
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    _summary: progress.Summary | None = None

    def summary(self) -> progress.Summary:
        if self._summary is None:
            self._summary = progress.summarize(self.records.values())
        return self._summary

    def note(self, problem: str) -> None:
        """Say ``problem`` on the row (the newest 5 distinct ones)."""
        if problem not in self.problems:
            self.problems = (self.problems + [problem])[-5:]


class Store:
    """Every student's records, in memory and in ``data`` (``<quoted name>.jsonl`` each)."""

    def __init__(self, data: Path):
        self.data = data
        self.students: dict[str, Student] = {}
        data.mkdir(parents=True, exist_ok=True)
        for file in sorted(data.glob("*.jsonl")):
            name = urllib.parse.unquote(file.stem)
            student = self.students[name] = Student(name)
            loaded = progress.load(file)
            for problem in loaded.problems:
                student.note(problem)
            self._keep(student, loaded.records)

    def _keep(self, student: Student, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add records that carry a new id; returns them. Beyond ``MAX_RECORDS`` the oldest are dropped."""
        new = []
        for rec in records:
            rid = rec.get("id")
            if not isinstance(rid, str) or not 0 < len(rid) <= ID_CHARS:
                student.note("a record without a valid id skipped")
                continue
            if rid not in student.records:
                student.records[rid] = rec
                new.append(rec)
        if len(student.records) > MAX_RECORDS:
            newest = sorted(student.records.values(), key=lambda r: r["time"])[-MAX_RECORDS:]
            student.records = {r["id"]: r for r in newest}
            student.note(f"over {MAX_RECORDS} records: only the newest kept")
        if new:
            student._summary = None
        return new

    def student(self, name: str) -> Student:
        return self.students.setdefault(name, Student(name))

    def add(self, name: str, body: bytes) -> tuple[int, int]:
        """A report's records for student ``name``: (records added, malformed ones). Malformed ones are said on the
        row; the good ones are kept (and appended to the student's file)."""
        student = self.student(name)
        try:
            raw = json.loads(body)
            items = raw["records"] if isinstance(raw, dict) else None
            if not isinstance(items, list):
                raise ValueError("no 'records' list")
        except (ValueError, KeyError) as err:
            student.note(f"a report that is not JSON records refused ({str(err)[:60]})")
            return 0, 1
        problems: list[str] = []
        lines = b"\n".join(json.dumps(r).encode() for r in items)
        good = progress.parse_lines(lines, "a report", problems)
        for problem in problems:
            student.note(problem)
        new = self._keep(student, good)
        file = self.data / f"{urllib.parse.quote(name, safe='')}.jsonl"
        if new and file.exists() and file.stat().st_size >= progress.MAX_FILE_BYTES:
            # shown from memory until the service restarts; the hub's disk is not a student's to fill
            student.note(f"the service's copy is over {progress.MAX_FILE_BYTES // 2**20} MiB: new records not kept "
                         "on disk")
        elif new:
            with file.open("a") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in new)
        return len(new), len(items) - len(good)


# --- rendering ------------------------------------------------------------------------------------------------


def _row(student: Student, now: float) -> tuple[str, bool]:
    """One student's ``<tr>`` and whether the student is stuck now."""
    e = html.escape
    try:
        s = student.summary()
    except Exception as err:  # noqa: BLE001 - one student's bad data must not take the page down
        return (f'<tr class="broken"><td>{e(student.name)}</td><td colspan="{len(progress.catalog()) + 3}">cannot '
                f"summarize these records: {e(type(err).__name__)}: {e(str(err)[:200])}</td></tr>"), False
    cells = []
    for lab, names in progress.catalog().items():
        done = s.done(lab)
        tried = sum(1 for x in s.exercises.values() if x.lab == lab)
        cls = "full" if names and done == len(names) else "some" if tried else "none"
        cells.append(f'<td class="{cls}">{done}/{len(names)}</td>')
    stuck = s.stuck_on()
    stuck_now = bool(stuck and stuck.stuck(now))
    if stuck is None:
        stuck_cell = "<td>-</td>"
    else:
        stuck_cell = (f'<td class="stuck-on" title="{e(stuck.last_wrong)}"><b>{e(stuck.exercise)}</b>: '
                      f"{stuck.wrong_since_right} wrong in {progress.ago(now - stuck.streak_start)} "
                      f"(last {progress.ago(now - stuck.last_time)} ago)<br><small>{e(stuck.last_wrong)}</small></td>")
    last = f"{progress.ago(now - s.last_activity)} ago" if s.checks else "no checks yet"
    notes = "<br>".join(e(p) for p in student.problems)
    klass = "stuck" if stuck_now else ""
    return (f'<tr class="{klass}" data-student="{e(student.name)}"><td>{e(student.name)}</td>{"".join(cells)}'
            f'{stuck_cell}<td>{last}</td><td class="notes">{notes}</td></tr>'), stuck_now


def render_rows(store: Store, now: float | None = None) -> str:
    """The table's ``<tbody>`` content: one row per student, the stuck ones first, then by name."""
    now = time.time() if now is None else now
    rows = [(_row(st, now), st.name) for st in store.students.values()]
    rows.sort(key=lambda r: (not r[0][1], r[1]))
    body = "\n".join(r[0][0] for r in rows)
    return body or f'<tr><td colspan="{len(progress.catalog()) + 4}">no student has run a check yet</td></tr>'


_STYLE = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:.25em .5em;vertical-align:top}td.full{background:#d7f5d7}td.some{background:#fff6d0}tr.stuck{background:#fde0e0}
small{color:#555}td.notes{color:#a00}#bar{margin:.5em 0}"""

_SCRIPT = """
const body = document.getElementById('rows'), only = document.getElementById('stuck-only');
function filter() { for (const tr of body.rows) tr.hidden = only.checked && !tr.classList.contains('stuck'); }
async function refresh() {
  try {
    // a script's request with the hub's cookie must carry the xsrf token (JupyterHub >= 4.1), or it is a new login
    const reply = await fetch('table', {credentials: 'same-origin', cache: 'no-store',
                                        headers: {'X-XSRFToken': XSRF}});
    if (reply.ok) { body.innerHTML = await reply.text(); filter();
      document.getElementById('updated').textContent = new Date().toLocaleTimeString(); }
    else document.getElementById('updated').textContent = 'refresh failed: HTTP ' + reply.status;
  } catch (err) { document.getElementById('updated').textContent = 'refresh failed: ' + err; }
}
only.addEventListener('change', filter);
setInterval(refresh, REFRESH_MS);
filter();
"""


def render_page(store: Store, now: float | None = None, xsrf: str = "") -> str:
    """The whole page (the table's rows inside; the script fetches ``table`` every ``REFRESH_S``, sending ``xsrf``,
    the handler's xsrf token)."""
    labs = "".join(f"<th>{lab}</th>" for lab in progress.catalog())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>nvlab: the class at a glance</title>"
            f"<style>{_STYLE}</style></head><body><h1>The class at a glance</h1>"
            f"<div id='bar'><label><input type='checkbox' id='stuck-only'> stuck now only</label> "
            f"(stuck: {progress.STUCK_WRONG}+ wrong checks since the last right one, the latest within "
            f"{progress.STUCK_WINDOW_S // 60} min) · <a href='progress.csv' download>CSV</a> · updated "
            f"<span id='updated'>{time.strftime('%H:%M:%S')}</span></div>"
            f"<table><thead><tr><th>student</th>{labs}<th>stuck on</th><th>last activity</th><th>notes</th></tr>"
            f"</thead><tbody id='rows'>{render_rows(store, now)}</tbody></table>"
            f"<script>const REFRESH_MS = {REFRESH_S * 1000}, XSRF = {json.dumps(xsrf)};{_SCRIPT}</script>"
            "</body></html>")


CSV_COLUMNS = ["student", "lab", "exercise", "checks", "right", "last_outcome", "wrong_since_right", "stuck_now",
               "last_check_utc", "last_wrong_message", "notes"]


def _cell(text: str) -> str:
    """A text a student's records chose, safe in a spreadsheet: one starting like a formula gets a leading quote."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def render_csv(store: Store, now: float | None = None) -> str:
    """One row per student and exercise checked (a student with no valid record: one row, its notes)."""
    now = time.time() if now is None else now
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(CSV_COLUMNS)
    for name in sorted(store.students):
        st = store.students[name]
        notes = "; ".join(st.problems)
        try:
            states = sorted(st.summary().exercises.values(), key=lambda x: (x.lab, x.exercise))
        except Exception as err:  # noqa: BLE001 - as on the page
            states, notes = [], f"cannot summarize these records: {type(err).__name__}"
        if not states:
            w.writerow([_cell(name), "", "", 0, "", "", "", "", "", "", notes])
        for x in states:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(x.last_time))
            w.writerow([_cell(name), x.lab, _cell(x.exercise), x.attempts, x.right, x.last_outcome,
                        x.wrong_since_right, x.stuck(now), when, _cell(x.last_wrong), notes])
    return out.getvalue()


# --- the web service ------------------------------------------------------------------------------------------


def hub_role() -> dict[str, Any]:
    """The role that lets the service list the hub's users, so that a student who has not run a single check yet has
    a row too (``c.JupyterHub.load_roles``). Without it the page lists the students who have reported."""
    return {"name": "nvlab-progress", "description": "the progress page lists the class",
            "scopes": ["list:users", "read:users"], "services": [NAME]}


_LISTING: dict[str, Any] = {"said": False}


async def list_class(store: Store, auth: Any) -> bool:
    """Give every non-admin hub user a row (empty until they check something); False when the service may not
    list users (no ``hub_role()``: said once in the service's log)."""
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError

    client, offset = AsyncHTTPClient(), 0
    while True:
        try:
            reply = await client.fetch(f"{auth.api_url}/users?offset={offset}&limit=200", headers={
                "Authorization": f"token {auth.api_token}", "Accept": "application/jupyterhub-pagination+json"})
        except HTTPClientError as err:
            if err.code == 403 and not _LISTING["said"]:
                _LISTING["said"] = True
                print("progress_service: may not list the hub's users (add hub_role() to c.JupyterHub.load_roles): "
                      "students without a check have no row", file=sys.stderr, flush=True)
            return False
        page = json.loads(reply.body)
        for user in page["items"]:
            if not user.get("admin") and user.get("kind", "user") == "user":
                store.student(user["name"])
        following = (page.get("_pagination") or {}).get("next")
        if not following:
            return True
        offset = following["offset"]


def make_app(store: Store, prefix: str) -> Any:
    """The tornado application under ``prefix`` (``/services/progress/``)."""
    from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated
    from tornado import web

    auth = HubOAuth.instance()

    class Page(HubOAuthenticated, web.RequestHandler):
        @web.authenticated
        async def get(self) -> None:
            with contextlib.suppress(Exception):  # the list of the class as the hub has it now, where it may read it
                await asyncio.wait_for(list_class(store, auth), timeout=5)
            self.set_header("Cache-Control", "no-store")
            token = self.xsrf_token
            self.finish(render_page(store, xsrf=token.decode() if isinstance(token, bytes) else token))

    class Rows(HubOAuthenticated, web.RequestHandler):
        @web.authenticated
        def get(self) -> None:
            self.set_header("Cache-Control", "no-store")
            self.finish(render_rows(store))

    class Csv(HubOAuthenticated, web.RequestHandler):
        @web.authenticated
        def get(self) -> None:
            self.set_header("Content-Type", "text/csv; charset=utf-8")
            self.set_header("Content-Disposition", 'attachment; filename="progress.csv"')
            self.finish(render_csv(store))

    class Records(web.RequestHandler):
        """A student's server reports records; the token says whose they are (no cookie, so no xsrf check: the
        application has ``xsrf_cookies`` off)."""

        async def post(self) -> None:
            match = auth.auth_header_pat.match(self.request.headers.get("Authorization", ""))
            user = await auth.user_for_token(match[1], sync=False) if match else None
            if not user or user.get("kind", "user") != "user" or not user.get("name"):
                raise web.HTTPError(403, "a report needs the student's server's hub token")
            if len(self.request.body) > MAX_BODY:
                store.student(user["name"]).note(f"a report of {len(self.request.body) / 2**20:.1f} MiB refused "
                                                 f"(over {MAX_BODY // 2**20} MiB)")
                raise web.HTTPError(413, f"a report is at most {MAX_BODY} bytes")
            added, bad = store.add(user["name"], self.request.body)
            self.finish({"added": added, "malformed": bad})

    return web.Application([
        (prefix, Page), (prefix + "table", Rows), (prefix + "progress.csv", Csv),
        (prefix + "api/records", Records), (prefix + "oauth_callback", HubOAuthCallbackHandler),
    ], cookie_secret=os.urandom(32), xsrf_cookies=False)


def main(argv: list[str] | None = None) -> int:
    """Serve the page where the hub says (``JUPYTERHUB_SERVICE_URL``, ``JUPYTERHUB_SERVICE_PREFIX``)."""
    parser = argparse.ArgumentParser(prog="python -m nvlab.classroom.progress_service",
                                     description="the trainer's progress page, run by JupyterHub as a service")
    parser.add_argument("--data", required=True, type=Path, help="folder keeping the received records")
    args = parser.parse_args(argv)
    url = os.environ.get("JUPYTERHUB_SERVICE_URL")
    if not url:
        print("progress_service: JUPYTERHUB_SERVICE_URL is not set: this runs as a JupyterHub service (add "
              "hub_service_config(port) to c.JupyterHub.services)", file=sys.stderr)
        return 2
    from tornado.httpserver import HTTPServer

    bind = urllib.parse.urlsplit(url)
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{NAME}/")
    store = Store(args.data.resolve())

    async def serve() -> None:
        from jupyterhub.services.auth import HubOAuth

        server = HTTPServer(make_app(store, prefix), xheaders=True, max_body_size=8 * MAX_BODY)
        server.listen(bind.port or 80, bind.hostname or "127.0.0.1")
        print(f"progress_service: {len(store.students)} students' records from {args.data}; serving {prefix} on "
              f"{bind.hostname}:{bind.port}", file=sys.stderr, flush=True)
        while True:  # until the hub stops the service: the class's list, again every LIST_S
            with contextlib.suppress(Exception):  # the hub restarting: next time
                await list_class(store, HubOAuth.instance())
            await asyncio.sleep(LIST_S)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
