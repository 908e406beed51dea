"""The order tests start in is computed: the longest groups first, from tests/durations.json, which
`pytest --store-durations` writes from a run (the root conftest.py)."""

from __future__ import annotations

import importlib.util
import json
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


def test_the_scheduler_hands_out_groups_in_the_items_order_not_by_their_number_of_tests(root_conftest):
    """xdist's own scope scheduling sorts groups by their number of tests (a file of 400 quick tests before a notebook
    of 30 slow cells) unless its reorder option is off; the course's scheduler keeps the order computed above."""
    collection = ["solutions/x.ipynb::Cell 0", "solutions/x.ipynb::Cell 1", "tests/test_service.py::s",
                  *[f"tests/test_many.py::t{i}" for i in range(40)], "tests/test_b.py::t"]
    option = SimpleNamespace(loadscopereorder=True)  # xdist's default
    config = SimpleNamespace(option=option, getvalue=lambda name: {"tx": ["popen"] * 2, "numprocesses": 2}[name])
    sched = root_conftest.pytest_xdist_make_scheduler(config, None)
    workers = [_Worker("gw0"), _Worker("gw1")]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    first = [collection[w.sent[0]] for w in workers]
    assert first == ["solutions/x.ipynb::Cell 0", "tests/test_service.py::s"], first
