"""The order tests start in is computed: the longest groups first, from tests/durations.json, which
`pytest --store-durations` writes from a run (the root conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def root_conftest(monkeypatch, tmp_path):
    """The root conftest.py as a module of its own (``import conftest`` may give tests/conftest.py), its durations
    file in tmp_path."""
    spec = importlib.util.spec_from_file_location("nvlab_root_conftest_durations", ROOT / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "DURATIONS_FILE", tmp_path / "tests" / "durations.json")
    (tmp_path / "tests").mkdir()
    return mod


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n, get_closest_marker=lambda name: None) for n in nodeids]


def _config(**options) -> SimpleNamespace:
    return SimpleNamespace(getoption=lambda name: options.get(name, False), hook=None)


def test_the_committed_file_names_groups_that_exist(root_conftest):
    seconds = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert len(seconds) > 20 and all(isinstance(v, (int, float)) and v >= 0 for v in seconds.values())
    grouped = set(root_conftest.SHARED_GROUPS)  # run in their group: its seconds, not their own, order them
    gone = [g for g in seconds if g not in root_conftest.SHARED_GROUPS.values() and not (ROOT / g).is_file()
            or g in grouped]
    assert not gone, f"tests/durations.json names groups that no longer exist: {gone} (pytest --store-durations)"
    assert list(seconds.values()) == sorted(seconds.values(), reverse=True)


def test_the_longest_group_starts_first_and_a_new_one_after_the_known(root_conftest):
    root_conftest.DURATIONS_FILE.write_text(json.dumps({"tests/test_b.py": 50.0, "solutions/x.ipynb": 90.0,
                                                        "service": 70.0, "tests/test_a.py": 5.0}))
    items = _items("tests/test_a.py::t1", "tests/test_new.py::t", "tests/test_b.py::t1", "tests/test_service.py::s",
                   "solutions/x.ipynb::Cell 0", "tests/test_a.py::t2", "solutions/x.ipynb::Cell 1",
                   "tests/test_exercises_lab07.py::e", "tests/test_b.py::t2")
    root_conftest.pytest_collection_modifyitems(_config(), items)
    assert [i.nodeid for i in items] == [
        "solutions/x.ipynb::Cell 0", "solutions/x.ipynb::Cell 1",  # 90 s, its cells in their order
        "tests/test_service.py::s", "tests/test_exercises_lab07.py::e",  # the shared service's group: 70 s
        "tests/test_b.py::t1", "tests/test_b.py::t2", "tests/test_a.py::t1", "tests/test_a.py::t2",
        "tests/test_new.py::t"]  # not in the file: after every known group


def test_store_durations_sums_each_groups_phases_and_keeps_the_rest(root_conftest, tmp_path):
    (tmp_path / "tests" / "test_kept.py").write_text("")
    root_conftest.DURATIONS_FILE.write_text(json.dumps({"tests/test_kept.py": 3.0, "tests/test_gone.py": 9.0,
                                                        "tests/test_b.py": 1.0}))
    for nodeid, when, s in (("tests/test_b.py::t", "setup", 2.0), ("tests/test_b.py::t", "call", 10.0),
                            ("tests/test_b.py::t", "teardown", 0.5), ("tests/test_service.py::s", "call", 4.0),
                            ("tests/test_exercises_lab07.py::e", "call", 4.04)):
        root_conftest.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, when=when, duration=s,
                                                               user_properties=[]))
    root_conftest._store_durations()
    got = json.loads(root_conftest.DURATIONS_FILE.read_text())
    # test_b's phases summed (replacing 1.0), the service group's two files together, test_gone dropped
    assert got == {"tests/test_b.py": 12.5, "service": 8.0, "tests/test_kept.py": 3.0}
    assert list(got) == ["tests/test_b.py", "service", "tests/test_kept.py"]


class _Worker:
    """A stand-in for xdist's worker controller: records the tests it is sent (indexes into its collection)."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduled(root_conftest, collection: list[str], workers: int, **option) -> tuple[object, list[_Worker]]:
    """The course's scheduler over ``collection`` on stand-in workers gw0.. (``option``: xdist's config options),
    after its first distribution."""
    option = SimpleNamespace(**{"loadscopereorder": True, **option})  # xdist's default: reorder
    config = SimpleNamespace(option=option,
                             getvalue=lambda name: {"tx": ["popen"] * workers, "numprocesses": workers}[name])
    sched = root_conftest.pytest_xdist_make_scheduler(config, None)
    nodes = [_Worker(f"gw{i}") for i in range(workers)]
    for w in nodes:
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    return sched, nodes


def test_the_scheduler_hands_out_groups_in_the_items_order_not_by_their_number_of_tests(root_conftest):
    """xdist's own scope scheduling sorts groups by their number of tests (a file of 400 quick tests before a notebook
    of 30 slow cells) unless its reorder option is off; the course's scheduler keeps the order computed above."""
    collection = ["solutions/x.ipynb::Cell 0", "solutions/x.ipynb::Cell 1", "tests/test_service.py::s",
                  *[f"tests/test_many.py::t{i}" for i in range(40)], "tests/test_b.py::t"]
    _, workers = _scheduled(root_conftest, collection, 2)
    first = [collection[w.sent[0]] for w in workers]
    assert first == ["solutions/x.ipynb::Cell 0", "tests/test_service.py::s"], first


def _run_all(sched, workers: list[_Worker], collection: list[str]) -> dict[str, list[str]]:
    """Complete every worker's tests one at a time, round robin, as xdist reports them; the groups each ran."""
    ran: dict[str, list[str]] = {w.gateway.id: [] for w in workers}
    done = {w.gateway.id: 0 for w in workers}
    while any(done[w.gateway.id] < len(w.sent) for w in workers):
        for w in workers:
            if done[w.gateway.id] < len(w.sent):
                index = w.sent[done[w.gateway.id]]
                done[w.gateway.id] += 1
                group = collection[index].split("::")[0]
                if group not in ran[w.gateway.id]:
                    ran[w.gateway.id].append(group)
                sched.mark_test_complete(w, index)
    return ran


def test_the_low_priority_worker_runs_only_background_groups_and_the_others_run_the_rest_first(root_conftest):
    quiz, layout = "tests/test_quiz.py", "tests/test_layout.py"
    assert {quiz, layout} <= root_conftest.BACKGROUND_GROUPS
    collection = ["solutions/x.ipynb::Cell 0", "solutions/x.ipynb::Cell 1", *[f"{quiz}::q{i}" for i in range(6)],
                  "tests/test_service.py::s", f"{layout}::l", *[f"tests/test_b.py::t{i}" for i in range(4)],
                  "tests/test_c.py::t"]
    sched, workers = _scheduled(root_conftest, collection, 3, nvlab_background="gw2", nvlab_promote=False)
    assert collection[workers[2].sent[0]] == f"{quiz}::q0"  # the first background group, not the longest group
    ran = _run_all(sched, workers, collection)
    assert set(ran["gw2"]) <= root_conftest.BACKGROUND_GROUPS and ran["gw2"], ran
    assert not set(ran["gw0"] + ran["gw1"]) & set(ran["gw2"]), ran  # each group ran once
    assert sorted(sum(ran.values(), [])) == sorted({n.split("::")[0] for n in collection})
    assert sorted(sum((w.sent for w in workers), [])) == list(range(len(collection)))  # every test, once
    assert all(w.shutting_down for w in workers) and sched.tests_finished


def test_where_a_niceness_may_be_taken_back_the_low_priority_worker_runs_the_waiting_groups_after_its_own(
        root_conftest):
    """Root (CI) may raise a priority again: once no background group is left, the low-priority worker runs the
    waiting groups at normal priority, and never another group; the others take waiting groups last."""
    quiz, waiting = "tests/test_quiz.py", sorted(root_conftest.WAITING_GROUPS)
    assert len(waiting) >= 2 and not set(waiting) & root_conftest.BACKGROUND_GROUPS
    collection = ["solutions/x.ipynb::Cell 0", "solutions/x.ipynb::Cell 1", f"{waiting[0]}::w", f"{waiting[1]}::w",
                  f"{quiz}::q0", *[f"tests/test_{name}.py::t" for name in "bcdefgh"]]
    sched, workers = _scheduled(root_conftest, collection, 3, nvlab_background="gw2", nvlab_promote=True)
    assert collection[workers[2].sent[0]] == f"{quiz}::q0"  # its own kind first
    ran = _run_all(sched, workers, collection)
    assert ran["gw2"][0] == quiz and ran["gw2"][1:] and set(ran["gw2"][1:]) <= set(waiting), ran
    for w in ("gw0", "gw1"):  # no waiting group before another
        kinds = [g in root_conftest.WAITING_GROUPS for g in ran[w]]
        assert kinds == sorted(kinds), ran
    assert sorted(sum(ran.values(), [])) == sorted({n.split("::")[0] for n in collection})  # each group once
    assert sorted(sum((w.sent for w in workers), [])) == list(range(len(collection)))
    assert all(w.shutting_down for w in workers) and sched.tests_finished


def test_without_it_the_waiting_groups_run_as_any_other_in_their_order(root_conftest):
    waiting = sorted(root_conftest.WAITING_GROUPS)[0]
    collection = [f"{waiting}::w", "solutions/x.ipynb::Cell 0", "tests/test_quiz.py::q"]
    _, workers = _scheduled(root_conftest, collection, 2, nvlab_background="gw1", nvlab_promote=False)
    first = [collection[w.sent[0]] for w in workers]
    assert first == [f"{waiting}::w", "tests/test_quiz.py::q"], first


def test_the_low_priority_worker_takes_its_priority_back_for_a_waiting_groups_test(root_conftest, monkeypatch):
    """Its first test of a waiting group raises every thread's niceness back, once."""
    calls = []
    monkeypatch.setattr(root_conftest, "_set_niceness", calls.append)
    monkeypatch.setattr(root_conftest, "_NORMAL_NICE", [0])
    waiting = sorted(root_conftest.WAITING_GROUPS)
    for nodeid in ("tests/test_quiz.py::q", f"{waiting[0]}::w", f"{waiting[1]}::w"):
        root_conftest.pytest_runtest_protocol(SimpleNamespace(nodeid=nodeid), None)
    assert calls == [0] and root_conftest._NORMAL_NICE == []


def test_the_niceness_of_every_thread_is_lowered_and_taken_back_as_root(root_conftest):
    """In a forked child (a niceness lowered here would stay with this worker): every thread's niceness goes to 10,
    and back to where it was where the probe says that is permitted (root: always)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import threading

            threading.Thread(target=threading.Event().wait, args=(2,), daemon=True).start()
            before = os.getpriority(os.PRIO_PROCESS, 0)
            root_conftest._set_niceness(10)
            tids = [int(t) for t in os.listdir("/proc/self/task")]
            lowered = len(tids) > 1 and all(os.getpriority(os.PRIO_PROCESS, t) == 10 for t in tids)
            may = root_conftest._may_raise_priority()
            if may:
                root_conftest._set_niceness(before)
            back = all(os.getpriority(os.PRIO_PROCESS, t) == before for t in tids)
            code = 0 if lowered and may == back and (may or os.geteuid() != 0) else 1
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def test_the_others_take_the_background_groups_the_low_priority_worker_has_not(root_conftest):
    """Groups left only of the background kind: the normal workers take them too (no one waits on the slow one)."""
    quiz, layout = "tests/test_quiz.py", "tests/test_layout.py"
    collection = [f"{quiz}::q", f"{layout}::l", "tests/test_trt_engine.py::t", "tests/test_inference.py::i"]
    sched, workers = _scheduled(root_conftest, collection, 2, nvlab_background="gw1")
    assert workers[0].sent and workers[1].sent
    _run_all(sched, workers, collection)
    assert sorted(sum((w.sent for w in workers), [])) == [0, 1, 2, 3] and sched.tests_finished


@pytest.mark.parametrize(("cores", "cap", "workers", "low", "waiting"), [
    (2, 5, 5, "gw4", "gw3"), (8, 5, 5, "gw4", "gw3"), (2, 3, 3, "gw2", None), (1, None, 4, "gw3", "gw2")])
def test_auto_adds_a_waiting_and_a_low_priority_worker_within_the_cap(root_conftest, monkeypatch, cores, cap, workers,
                                                                       low, waiting):
    monkeypatch.setattr(root_conftest.os, "cpu_count", lambda: cores)
    config = SimpleNamespace(option=SimpleNamespace(maxprocesses=cap))
    assert root_conftest.pytest_xdist_auto_num_workers(config) == workers
    assert config.option.nvlab_background == low
    assert getattr(config.option, "nvlab_waiting", None) == waiting


def test_the_waiting_worker_runs_the_waiting_groups_from_the_start_and_nothing_else(root_conftest):
    """With a worker of their own (four or more in all), the waiting groups start at once there, whatever their
    place in the order; the low-priority worker keeps to its background groups, the others to the rest."""
    quiz, waiting = "tests/test_quiz.py", sorted(root_conftest.WAITING_GROUPS)
    collection = ["solutions/x.ipynb::Cell 0", "solutions/x.ipynb::Cell 1", *[f"tests/test_{n}.py::t" for n in "bcd"],
                  f"{quiz}::q0", *[f"{w}::w" for w in waiting], *[f"tests/test_{n}.py::t" for n in "efgh"]]
    sched, workers = _scheduled(root_conftest, collection, 4, nvlab_background="gw3", nvlab_waiting="gw2",
                                nvlab_promote=True)
    assert collection[workers[2].sent[0]] == f"{waiting[0]}::w" and collection[workers[3].sent[0]] == f"{quiz}::q0"
    ran = _run_all(sched, workers, collection)
    assert ran["gw2"] == waiting and ran["gw3"] == [quiz], ran
    assert not (set(ran["gw0"]) | set(ran["gw1"])) & (root_conftest.WAITING_GROUPS | {quiz}), ran
    assert sorted(sum((w.sent for w in workers), [])) == list(range(len(collection)))  # every test, once
    assert all(w.shutting_down for w in workers) and sched.tests_finished


def test_background_groups_exist_and_start_no_server(root_conftest, monkeypatch):
    """The low-priority worker may wait for the CPU: none of its groups may start a server or share one."""
    spec = importlib.util.spec_from_file_location("nvlab_tests_conftest_durations", ROOT / "tests" / "conftest.py")
    tests_conftest = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, tests_conftest)  # its dataclasses look their module up
    spec.loader.exec_module(tests_conftest)
    servers = (*tests_conftest._TRITON_WORDS, "shared_tracking", "PrometheusServer(", "TritonServer(", "Service(")
    for group in sorted(root_conftest.BACKGROUND_GROUPS):
        path = ROOT / group
        assert path.is_file() and group not in root_conftest.SHARED_GROUPS, group
        text = path.read_text() if path != Path(__file__) else ""  # this file names them
        assert not [w for w in servers if w in text], (group, [w for w in servers if w in text])


def test_the_controller_rewrites_the_test_modules_the_way_the_workers_import_them(root_conftest, tmp_path,
                                                                                  pytestconfig):
    """Before the workers start, the controller writes each test module's rewritten pyc: the one pytest's import
    finds valid (so no worker rewrites it again), with the asserts rewritten (a failing one explains its values)."""
    from _pytest.assertion import rewrite

    (tmp_path / "tests").mkdir(exist_ok=True)
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tmp_path / "tests" / name).write_text("def test_x():\n    x = 1\n    assert x + 1 == 3\n")
    config = SimpleNamespace(rootpath=tmp_path, getini=pytestconfig.getini)
    root_conftest._rewrite_test_modules(config)
    for name in ("test_a", "test_b", "test_c"):
        fn = tmp_path / "tests" / f"{name}.py"
        co = rewrite._read_pyc(fn, rewrite.get_cache_dir(fn) / (name + rewrite.PYC_TAIL), lambda *a: None)
        assert co is not None, name
        scope: dict[str, object] = {}
        exec(co, scope)
        with pytest.raises(AssertionError, match=r"assert \(1 \+ 1\) == 3"):
            scope["test_x"]()
