"""A student's progress: every check recorded (a generated lab run with papermill), two processes writing at once
losing nothing, the off switches, no answer text in a record, a record failure never failing a check, the summary's
"stuck" logic, ``nvlab progress``, and the trainer page's rendering with one student's malformed and huge files.
The page in a real hub is tests/test_progress_hub.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from lab_utils.course import progress
from lab_utils.exercises.framework import Exercise, Wrong
from nvlab.classroom import progress_service as svc
from nvlab.ops import notebooks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def records(tmp_path, monkeypatch) -> Path:
    """This test's own record file (and no hub to report to)."""
    file = tmp_path / "home" / ".nvlab" / "progress.jsonl"
    monkeypatch.setenv(progress.ENV_FILE, str(file))
    for name in (progress.ENV_SWITCH, progress.ENV_URL, "JUPYTERHUB_API_URL", "JUPYTERHUB_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(progress, "_off_here", False)
    return file


def _wrong(value):
    raise Wrong("not that")


def _lines(file: Path) -> list[dict]:
    return [json.loads(x) for x in file.read_text().splitlines()]


def test_a_check_appends_one_record_without_the_answer(records):
    ex = Exercise(name="05.1 QPS in PromQL", var="qps_query", grade=_wrong)
    ex.check(None, quiet=True)
    ex.check("sum(rate(my_secret_metric_name[1m]))\n# and a second line", quiet=True)
    blank, wrong = _lines(records)
    assert (blank["lab"], blank["exercise"], blank["outcome"], blank["attempt"]) == ("05", ex.name, "blank", 1)
    assert (wrong["outcome"], wrong["attempt"]) == ("wrong", 2)
    assert wrong["message"] == "`qps_query`: not that"  # the answer's echo is cut: never the student's code
    assert "my_secret_metric_name" not in records.read_text()
    assert abs(wrong["time"] - time.time()) < 60 and len(wrong["id"]) == 32
    assert oct(records.stat().st_mode & 0o777) == "0o600"


WRITER = """
import sys, time
from lab_utils.course import progress
start, n, me = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
while time.time() < start:
    time.sleep(0.001)
for i in range(n):
    progress.record("01.4 shared exercise", "INCORRECT", "wrong " + me)
    progress.record("01.5 " + me, "CORRECT", "right")
"""


def test_two_processes_writing_at_once_lose_nothing(records):
    n = 300
    start = time.time() + 1.5  # both start writing at this moment (after their imports)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(start), str(n), me], env=env)
             for me in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = _lines(records)  # every line whole JSON
    assert len(lines) == 4 * n and len({r["id"] for r in lines}) == 4 * n
    shared = sorted(r["attempt"] for r in lines if r["exercise"] == "01.4 shared exercise")
    assert shared == list(range(1, 2 * n + 1))  # each attempt number once: counted under the lock
    mine = [r for r in lines if r["exercise"] == "01.5 a"]
    assert [r["attempt"] for r in mine] == list(range(1, n + 1))
    first_b = next(i for i, r in enumerate(lines) if r["message"] == "wrong b")
    assert any(r["message"] == "wrong a" for r in lines[first_b:]), "the writers did not overlap in time"


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_writer_waits_for_the_lock_another_holds(records):
    """The attempt count and the append happen under the file's lock: a writer waits while another process holds it
    (the race the concurrent test above can only hit by chance)."""
    import fcntl

    progress.record("01.4 shared exercise", "INCORRECT", "first")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with records.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, "0", "1", "w"], env=env)
        time.sleep(3)  # long enough for the writer to start and reach its append (an import takes < 1 s)
        assert writer.poll() is None and len(_lines(records)) == 1, "the writer did not wait for the lock"
        fcntl.flock(held, fcntl.LOCK_UN)
        assert writer.wait(timeout=60) == 0
    assert [r["attempt"] for r in _lines(records) if r["exercise"] == "01.4 shared exercise"] == [1, 2]


def test_recording_turns_off_by_env_by_call_and_for_every_kernel(records, monkeypatch):
    ex = Exercise(name="00.4 H200 memory in GiB", var="memory_gib", grade=_wrong)
    monkeypatch.setenv(progress.ENV_SWITCH, "0")
    ex.check(1, quiet=True)
    assert not records.exists()
    monkeypatch.delenv(progress.ENV_SWITCH)
    progress.disable()
    ex.check(1, quiet=True)
    assert not records.exists()
    progress.enable()
    ex.check(1, quiet=True)
    assert len(_lines(records)) == 1
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "nvlab", "progress"]
    out = subprocess.run([*cli, "--off"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "off for every kernel" in out.stdout, out
    assert not progress.enabled()
    ex.check(1, quiet=True)
    assert len(_lines(records)) == 1
    assert "recording is off" in subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60).stdout
    subprocess.run([*cli, "--on"], env=env, check=True, capture_output=True, timeout=60)
    ex.check(1, quiet=True)
    assert [r["attempt"] for r in _lines(records)] == [1, 2]


def test_a_record_that_cannot_be_written_never_fails_the_check(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(progress.ENV_FILE, str(blocker / "progress.jsonl"))  # its folder is a file
    monkeypatch.delenv(progress.ENV_SWITCH, raising=False)
    monkeypatch.setattr(progress, "_said", set())
    ex = Exercise(name="00.4 H200 memory in GiB", var="memory_gib", grade=lambda v: None)
    assert ex.check(140.4, quiet=True).correct
    assert ex.check(140.4, quiet=True).correct
    err = capsys.readouterr().err
    assert err.count("could not record this check") == 1 and str(blocker) in err, err


def _rec(exercise: str, outcome: str, t: float, message: str = "", n: int = 1) -> dict:
    return {"v": 1, "id": f"{exercise}-{t}", "lab": exercise[:2], "exercise": exercise, "outcome": outcome,
            "message": message, "attempt": n, "time": t}


def test_the_summary_finds_the_exercise_a_student_is_stuck_on():
    now = 10_000.0
    recs = [_rec("01.1 the timing loop", "wrong", now - 900, "too slow"),
            _rec("01.1 the timing loop", "right", now - 800),
            _rec("01.3 copy bandwidth", "wrong", now - 600, "first"), _rec("01.3 copy bandwidth", "wrong", now - 300),
            _rec("01.3 copy bandwidth", "wrong", now - 60, "read+write: count both"),
            _rec("01.4 arithmetic intensity of saxpy", "wrong", now - 30),
            _rec("01.2 TFLOP/s from your timing", "blank", now - 10)]
    s = progress.summarize(reversed(recs))  # any order
    stuck = s.stuck_on()
    assert stuck is not None and stuck.exercise == "01.3 copy bandwidth"
    assert (stuck.wrong_since_right, stuck.streak_start, stuck.last_wrong) == (3, now - 600, "read+write: count both")
    assert stuck.stuck(now) and not stuck.stuck(now + progress.STUCK_WINDOW_S + 61)
    assert s.done("01") == 1 and s.last_activity == now - 10 and s.checks == 7
    text = progress.table(recs, now=now)
    assert "01      1/7       7  6 left" in text and "01.3 copy bandwidth (3 wrong): read+write: count both" in text
    one = progress.table(recs, lab="01", now=now)
    assert "[ok] 01.1 the timing loop: right, 2 checks" in one and "[ ] 01.7 capture and replay a CUDA graph" in one


def test_the_catalog_lists_every_exercise_of_every_lab():
    labs = progress.catalog()
    assert list(labs) == ["00", "01", "01b"] + [f"{n:02d}" for n in range(2, 10)]
    assert sum(map(len, labs.values())) == 75 and labs["01b"][0] == "01b.1 the vector add kernel"
    assert labs["04"][0] == "04.1 config.pbtxt" and labs["09"][-1] == "09.9 an OpenAI-compatible chat request to a NIM"


def test_one_students_malformed_or_huge_file_shows_on_that_row_only(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "MAX_FILE_BYTES", 2**20)  # the limit's logic, on a smaller file
    data = tmp_path / "data"
    data.mkdir()
    now = time.time()
    good = [_rec("02.2 the all-reduce benchmark worker", "wrong", now - 120 + i, "busbw factor") for i in range(4)]
    (data / "alice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    (data / "bob.jsonl").write_text(json.dumps(good[0]) + "\n{not json\n" + json.dumps({"exercise": 3}) + "\n")
    (data / "dave.jsonl").write_bytes(os.urandom(4096))
    with (data / "carol.jsonl").open("w") as f:  # over the limit: only its newest part is read
        i = 0
        while f.tell() < progress.MAX_FILE_BYTES + 2**20:
            f.write("".join(json.dumps({**_rec("00.1 layers of the stack", "blank", now - 5), "id": f"{i + j}"}) + "\n"
                            for j in range(1000)))
            i += 1000
    store = svc.Store(data)
    page = svc.render_page(store, now)
    rows = {name: svc._row(store.students[name], now)[0] for name in store.students}
    assert "02.2 the all-reduce benchmark worker</b>: 4 wrong" in rows["alice"] and 'class="stuck"' in rows["alice"]
    assert "2 malformed lines skipped in bob.jsonl (line 2: not JSON)" in rows["bob"]
    # the file passes 2 MiB by up to one write of 1000 records, whose length varies with the clock's digits
    size = (data / "carol.jsonl").stat().st_size
    assert 2**21 <= size < 2**21 + 2**18
    assert f"carol.jsonl is {size / 2**20:.1f} MiB: only its newest 1.0 MiB read" in rows["carol"], rows["carol"]
    assert "0/6" in rows["carol"]
    assert "malformed lines skipped in dave.jsonl" in rows["dave"]
    assert all(r in page for r in rows.values())
    csv_rows = svc.render_csv(store, now).splitlines()
    assert csv_rows[0] == ",".join(svc.CSV_COLUMNS)
    assert any(r.startswith("alice,02,02.2 the all-reduce benchmark worker,4,False,wrong,4,True,") for r in csv_rows)
    assert any(r.startswith("dave,,,0,") and "malformed" in r for r in csv_rows)


def test_a_report_is_checked_record_by_record(tmp_path):
    store = svc.Store(tmp_path)
    now = time.time()
    body = json.dumps({"records": [_rec("03.1 export with a dynamic batch", "right", now), {"exercise": "x"},
                                   _rec("03.1 export with a dynamic batch", "right", now)]}).encode()
    assert store.add("erin", body) == (1, 1)  # the repeat of an id is not added again
    assert store.add("erin", b"[1, 2]") == (0, 1)
    assert any("malformed" in p for p in store.students["erin"].problems)
    assert any("not JSON records" in p for p in store.students["erin"].problems)
    again = svc.Store(tmp_path)  # what the service keeps is read back at its next start
    assert list(again.students["erin"].records) == [f"03.1 export with a dynamic batch-{now}"]


def test_hub_service_config_is_a_services_entry():
    entry = svc.hub_service_config(10542)
    assert entry["name"] == "progress" and entry["url"] == "http://127.0.0.1:10542"
    assert entry["command"][1:] == ["-m", "nvlab.classroom.progress_service", "--data", "progress-service"]
    assert svc.spawner_environment(10542) == {progress.ENV_URL: "http://127.0.0.1:10542/services/progress/"}


@pytest.mark.notebooks
def test_a_generated_lab_records_its_checks(tmp_path, monkeypatch):
    """Lab 00 as a student gets it, run with papermill: each check cell writes its record, the lab's last cell
    shows them."""
    file = tmp_path / "progress.jsonl"
    monkeypatch.setenv(progress.ENV_FILE, str(file))
    monkeypatch.delenv(progress.ENV_SWITCH, raising=False)
    res = notebooks.execute(ROOT / "labs" / "00_environment.ipynb", tmp_path / "run", {"quick": True},
                            run_id="pytest-progress-lab00", timeout_s=300)
    assert res.ok, res.error
    assert notebooks.leftover_processes("pytest-progress-lab00") == []
    recs = _lines(file)
    assert [r["exercise"] for r in recs] == progress.catalog()["00"]
    assert {r["outcome"] for r in recs} <= {"blank", "wrong", "not applicable"} and recs[0]["outcome"] == "blank"
    cell = next(c for c in nbformat.read(res.output, as_version=4).cells if "progress.show(" in c.source)
    shown = "".join(o.get("text", "") for o in cell.get("outputs", []))
    assert "00      0/6       6  6 left" in shown and "[ ] 00.1 layers of the stack: blank, 1 check" in shown, shown


def test_the_page_benchmark_runs(tmp_path):
    """benchmarks/progress_page.py, small: it writes its results file and the page is under the target."""
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "progress_page.py"), "--students", "2",
                          "--attempts", "2", "--repeat", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["records"] == 2 * 70 * 2 and result["page_under_target"]  # 70 exercises, as the target says


def test_records_go_to_no_guessed_address(records, monkeypatch):
    """Under a hub without ``NVLAB_PROGRESS_URL`` nothing is sent (the token opens the student's server); with it,
    the records go there."""
    monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "t")
    assert progress.service_url() is None
    monkeypatch.setenv(progress.ENV_URL, "http://hub:10542/services/progress")
    assert progress.service_url() == "http://hub:10542/services/progress/"


def test_the_csv_defuses_formulas_a_student_could_plant(tmp_path):
    store = svc.Store(tmp_path)
    planted = {**_rec("=HYPERLINK(\"x\")", "wrong", time.time(), "@SUM(A1)"), "id": "1", "lab": "01"}
    body = json.dumps({"records": [planted]})
    assert store.add("=mallory", body.encode()) == (1, 0)
    row = svc.render_csv(store).splitlines()[1]
    assert row.startswith("'=mallory,") and ",'@SUM(A1)," in row and "\"'=HYPERLINK(\"\"x\"\")\"" in row, row


def test_a_student_cannot_fill_the_services_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "MAX_FILE_BYTES", 4096)
    store = svc.Store(tmp_path)
    for i in range(100):
        body = json.dumps({"records": [{**_rec("00.1 layers of the stack", "wrong", time.time()), "id": f"r{i}"}]})
        assert store.add("frank", body.encode()) == (1, 0)
    assert (tmp_path / "frank.jsonl").stat().st_size < 4096 + 1024
    assert len(store.students["frank"].records) == 100  # the page still counts them all
    assert any("new records not kept on disk" in p for p in store.students["frank"].problems)
