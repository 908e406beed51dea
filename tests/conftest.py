"""Servers the test files share, started once per test worker, and the stop grace every test server gets.

A real Prometheus (``lab05_recording``, through ``shared_recording``) serves lab 05's recordings to its PromQL checks.

A real Triton (``shared_triton``) serves the tests that only read from it: requests, load, statistics, metrics. A
test that loads or unloads a model, kills, crashes or restarts a server, or needs a configuration of its own starts
its own. Lab 07's service (``service_stack``) is shared by the files of the "service" group (the root conftest.py
schedules them onto one worker). Tests using a real Triton carry the ``triton`` marker (``-m triton``, ``-m "not
triton"``), given here from their source.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

# Tests stop servers many times, and Triton never ends by itself within its 1 s grace after SIGTERM (it is SIGKILLed
# after it): a short grace (what a stop leaves is tested, not its pace).
TEST_STOP_GRACE_S = 0.3


@pytest.fixture(scope="session", autouse=True)
def quick_stop():
    """Every TritonServer the tests create, module and session fixtures' included, gets ``TEST_STOP_GRACE_S``."""
    from lab_utils.serving.server import TritonServer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TritonServer, "stop_grace_default_s", TEST_STOP_GRACE_S)
        yield TEST_STOP_GRACE_S


@dataclass(frozen=True)
class SharedTriton:
    """The shared server and its repository: ``tiny`` (4 -> 3 MLP, dynamic batching) and lab 05's ``mm``."""

    server: object  # a running lab_utils.serving.server.TritonServer
    repo: Path

    @property
    def http_url(self) -> str:
        return self.server.http_url  # type: ignore[attr-defined]

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def shared_tracking():
    """One MLflow tracking server per worker, for lab 08's checks and the mlops tests (each makes experiments of its
    own): a start costs about 10 s of CPU, its SQLite store's migrations included. test_mlops.py's last test stops it:
    a file that needs it afterwards starts it again (``start()``)."""
    from lab_utils.mlops import tracking as tr

    if tr.mlflow_missing():
        pytest.skip(tr.mlflow_missing())
    with tr.TrackingServer() as server:
        yield server


@pytest.fixture(scope="session")
def shared_triton(tmp_path_factory) -> SharedTriton:
    """One real Triton per worker for the tests that only read from it; never stop, load or unload through it."""
    from _triton import TINY, require_server

    from lab_utils.monitoring import drills
    from lab_utils.serving import repository as triton_repo
    from lab_utils.serving.server import TritonServer

    require_server()
    repo = tmp_path_factory.mktemp("shared-triton") / "repo"
    triton_repo.build_mlp_model(repo, "tiny", preset=TINY, gpus=0, dynamic_batching=True)
    drills.write_model(repo, base_ms=0.5, per_item_ms=0.1)  # lab 05's model, with a short simulated service time
    with TritonServer(repo) as server:
        yield SharedTriton(server, repo)


@pytest.fixture(scope="session")
def lab05_recording():
    """One real Prometheus per worker serving lab 05's recordings: ``ex.RECORDED`` and a second recording drawn as
    each check draws its own. The PromQL checks only query it; each used to start one (a backfill and a start)."""
    from _prometheus import require_prometheus

    require_prometheus()
    from lab_utils.exercises.lab05 import promql
    from lab_utils.monitoring import prometheus

    with prometheus.recorded_server([*promql.RECORDED, *promql.hidden_samples(random.Random())]) as server:
        yield server


@pytest.fixture
def shared_recording(lab05_recording, monkeypatch):
    """Within a test: ``prometheus.recorded_server`` (what lab 05's PromQL checks call) hands out ``lab05_recording``
    instead of starting a Prometheus. Its samples are the same ``RECORDED`` (the second recording lies over an hour
    later, outside every query at ``RECORDED``'s times), so only samples of lab 05 may be asked for."""
    from lab_utils.monitoring import prometheus

    def recorded_server(samples, **kwargs):
        return contextlib.nullcontext(lab05_recording)

    monkeypatch.setattr(prometheus, "recorded_server", recorded_server)
    return lab05_recording


# What a test (or one of its fixtures) that uses a real Triton server says in its source.
_TRITON_WORDS = ("require_server(", "require_service(", "shared_triton", "service_stack")


def _source(fn: object) -> str:
    """A function's source lines, read from its file once (linecache) over its code's line range, nested functions
    included: ``inspect.getsource`` tokenizes the file again for each of the thousands of functions a collection
    meets (1.3 s of CPU per worker)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)  # type: ignore[arg-type]
    if code is None:
        return ""
    last, todo = code.co_firstlineno, [code]
    while todo:
        c = todo.pop()
        last = max([last, *(line for _, _, line in c.co_lines() if line)])
        todo += [k for k in c.co_consts if inspect.iscode(k)]
    return "".join(linecache.getlines(code.co_filename)[code.co_firstlineno - 1:last])


def _uses_triton(item: pytest.Item, seen: dict[object, bool]) -> bool:
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        funcs += [d.func for defs in info.name2fixturedefs.values() for d in defs]
    for fn in funcs:
        if fn not in seen:
            seen[fn] = any(word in _source(fn) for word in _TRITON_WORDS)
        if seen[fn]:
            return True
    return False


def pytest_collection_modifyitems(items):
    """Tests that start or use a real Triton server carry the ``triton`` marker (found in their source and their
    fixtures', so a new test gets it too)."""
    seen: dict[object, bool] = {}
    for item in items:
        if _uses_triton(item, seen):
            item.add_marker(pytest.mark.triton)


@pytest.fixture(scope="session")
def service_stack():
    """Lab 07's service (two Triton servers behind nginx), started once for the files of the "service" group
    (tests/test_service.py checks that every file using it is in the group)."""
    from _triton import require_service

    require_service()
    from lab_utils.serving.service import Service

    with Service(stop_grace_s=TEST_STOP_GRACE_S) as s:
        yield s
