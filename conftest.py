"""Test-wide settings and the notebook checks nbval does not make itself.

nbval executes every solution once (``--nbval-lax``: cells marked ``# NBVAL_CHECK_OUTPUT`` are compared). Around
each notebook these hooks add what the course promises besides: every exercise check in a solution says
"correct.", the notebook recorded measurements, nothing it started is still running after its kernel stopped,
and its wall time is printed at the end of the run. The run as a whole must leave ``/tmp`` and ``/dev/shm`` as
it found them (the course's folders and the python backend's ``python_env_*``).
"""

import json
import multiprocessing.util
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

# nbval cannot pass papermill parameters: the labs read NVLAB_QUICK for CI's small sizes.
os.environ.setdefault("NVLAB_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# One OpenMP thread per process (workers, the notebooks' kernels, what they start): the suite runs several processes
# per core, and torch's OpenMP threads then wait on each other's descheduled threads. Lab 06's quick solution beside
# two busy loops on 2 cores took 50.6 s of CPU in 53.7 s with torch's default threads, 12.8 s in 16.7 s with one
# (alone: 14.6 and 12.3 s). Tests that measure threading set their own counts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A stopped kernel's children may take a moment to be reaped.
LEFTOVER_GRACE_S = float(os.environ.get("NVLAB_LEFTOVER_GRACE_S", "10"))
_WALL_S: list[tuple[str, float]] = []
# The session's own TMPDIR (made by the controller, inherited by the workers and everything they start): what the
# course leaves there is this session's. Triton's python backend and shared memory use fixed places, checked as a
# before/after difference, unless NVLAB_TMP_CHECK=own (a session nested in a test, beside other workers).
_TMP_ENV = "NVLAB_TEST_TMPDIR"
_OWN_PATTERNS = ["nvlab-*", "torchelastic_*"]
_SHARED_PATTERNS = [(Path("/tmp"), "python_env_*"), (Path("/dev/shm"), "nvlab_triton_*")]
_BEFORE: set[Path] = set()
# Longest first, so that no worker starts a long group at the end: each group's seconds (setup, call and teardown
# summed) in a whole run, written by `pytest --store-durations` (only their order matters: a loaded machine's are all
# larger). A group not in the file (a new test file) starts after those that are, in file order.
DURATIONS_FILE = Path(__file__).resolve().parent / "tests" / "durations.json"
_RAN_S: dict[str, float] = {}


def _stored_durations() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS_FILE.read_text()).items()}
    except FileNotFoundError:
        return {}
    except (ValueError, AttributeError) as err:
        raise pytest.UsageError(f"{DURATIONS_FILE} is not a JSON object of group -> seconds ({err}): write it "
                                "again with `pytest --store-durations`") from None


def _course_leftovers() -> set[Path]:
    own = Path(os.environ[_TMP_ENV]) if _TMP_ENV in os.environ else Path(tempfile.gettempdir())
    found = {p for pattern in _OWN_PATTERNS for p in own.glob(pattern)}
    if os.environ.get("NVLAB_TMP_CHECK") != "own":
        found |= {p for root, pattern in _SHARED_PATTERNS for p in root.glob(pattern)}
    return found


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", dest="nvlab_all",
                     help="also the nightly set (tests marked nightly: every generated lab, the PyPI wheelhouse)")
    parser.addoption("--store-durations", action="store_true", dest="nvlab_store_durations",
                     help="write each test group's seconds in this run to tests/durations.json (the groups that ran "
                          "replace their entries; groups whose file is gone are dropped): the order tests start in")


def pytest_configure(config):
    """The controller gives the session a TMPDIR of its own before the workers start (they inherit it)."""
    if hasattr(config, "workerinput") or _TMP_ENV in os.environ:
        return
    root = tempfile.mkdtemp(prefix="pytest-nvlab-")
    os.environ["TMPDIR"] = os.environ[_TMP_ENV] = root
    # the checks the tests run are recorded here, not in the progress file of the person running them
    os.environ.setdefault("NVLAB_PROGRESS_FILE", os.path.join(root, "progress.jsonl"))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # removed at exit after multiprocessing's own folder in it (pymp-*, made by a run without workers), which its exit
    # handler removes: a removal at the session's end left that handler a folder already gone, and a traceback
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(root,), kwargs={"ignore_errors": True}, exitpriority=-200)
    if getattr(config.option, "numprocesses", None):
        _rewrite_test_modules(config)


def _rewrite_test_modules(config: pytest.Config) -> None:
    """Rewrite the test modules' asserts here, once, before the workers start: each worker would otherwise do it
    for every module while collecting, all at once (4 s of CPU each on a fresh checkout, with four workers on the CI
    machine's 2 cores). Forked children share the files; each writes what pytest's import would (a hash-checked pyc
    in __pycache__), with pytest's own rewriting functions. Should those change, the workers rewrite as before."""
    if sys.dont_write_bytecode or not hasattr(os, "fork"):
        return
    files = sorted((config.rootpath / "tests").glob("test_*.py"))
    n = min(4, os.cpu_count() or 1)
    children = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:  # a child: its share, then out without running anything of the parent's at exit
            try:
                from _pytest.assertion import rewrite

                for fn in files[i::n]:
                    pyc = rewrite.get_cache_dir(fn) / (fn.name[:-3] + rewrite.PYC_TAIL)
                    if rewrite._read_pyc(fn, pyc, lambda *a: None) is None and rewrite.try_makedirs(pyc.parent):
                        source_hash, co = rewrite._rewrite_test(fn, config)
                        rewrite._write_pyc(SimpleNamespace(trace=lambda *a: None), co, source_hash, pyc)
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


# Servers several test files share, started once per session (the fixtures below): the files of a group run on one
# worker, so the server starts once. Every other file is a group of its own (a notebook's cells and a module's
# fixtures stay on one worker, in order).
SHARED_GROUPS = {"tests/test_service.py": "service", "tests/test_exercises_lab07.py": "service",
                 # one MLflow tracking server (tests/conftest.py's shared_tracking): about 10 s of CPU per start
                 "tests/test_mlops.py": "mlflow", "tests/test_exercises_lab08.py": "mlflow"}


def _group(nodeid: str) -> str:
    file = nodeid.split("::", 1)[0]
    return SHARED_GROUPS.get(file, file)


# CPU work with no clock of its own: no server, no measured latency or duration, no wall-clock limit under minutes.
# These groups go to the low-priority worker (below); the others never do.
BACKGROUND_GROUPS = frozenset({
    "tests/test_quiz.py", "tests/test_exercises_lab03.py", "tests/test_kernels_lab.py",
    "solutions/09_exam_review.ipynb", "tests/test_inference.py", "tests/test_classroom_kubernetes.py",
    "tests/test_layout.py", "tests/test_lab09.py", "tests/test_trt_engine.py", "tests/test_mlops_stats.py",
    "tests/test_quiz_bank.py", "tests/test_exercises_all_labs.py", "tests/test_exercises_framework.py",
    "tests/test_specs.py", "tests/test_facts.py", "tests/test_docker.py", "tests/test_durations.py",
    "solutions/03_tensorrt.ipynb", "solutions/00_environment.ipynb", "solutions/01b_gpu_kernels.ipynb",
    "tests/test_no_delegation.py", "tests/test_exercises_lab00.py", "tests/test_pacing.py", "tests/test_quantize.py",
    "tests/test_lab02_plan.py", "tests/test_env.py", "tests/test_stack.py", "tests/test_perf_analyzer.py",
    "tests/test_triton_repo.py", "tests/test_cuda_bench.py", "tests/test_trainer_guide.py", "tests/test_workflows.py",
    "tests/test_dependencies.py", "tests/test_classroom_setup.py", "tests/test_notebooks.py"})
# The low-priority worker's niceness: under contention it gets about a tenth of a core's share (weight 110 against
# 1024), so the servers whose latency the other workers' tests measure keep their CPU, and a background test still
# advances (a subprocess limit of a minute holds).
BACKGROUND_NICE = 10
# Groups that mostly wait (a watchdog's grading windows, canaries and alert rules over real Prometheus windows) and
# use little CPU: 160 s of a CI run's wall time and 16 s of its CPU. A worker of their own runs them from the
# start, at normal priority, and nothing else: on the low-priority worker, after its background groups, they ended
# the run 12-25 s after every other worker, with the CPU idle. Taking other groups afterwards made it a fourth
# normal worker: a run of 415 s failed two timing checks (a gloo all-reduce at 4.6 x the reference, torch's
# benchmark against ours). Where auto gives fewer than four workers, the
# low-priority worker runs them once its background groups are done, at normal priority where the user may take a
# niceness back (root); the other workers take them only once nothing else is left. No notebook and no latency
# check goes there: a fourth worker running the others' groups slowed the notebooks (a run of 498 s).
WAITING_GROUPS = frozenset({"tests/test_exercises_lab05.py", "tests/test_mlops_prometheus.py",
                            "tests/test_monitoring.py", "tests/test_prometheus.py"})


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores (at most 4), a worker for WAITING_GROUPS and a low-priority one
    for BACKGROUND_GROUPS, within ``--maxprocesses``. Much of the suite waits (servers starting, loads of a fixed
    duration, ranks meeting): with two workers on the 2-core CI machine the run used 851 s of CPU in 777 s, 1.1 of
    its 2 cores; with three, 80 % of both cores. A fourth worker at normal priority running any group made the
    latency checks fail (a canary's p95 of 143 ms against its 100 ms SLO); at low priority it runs only on what the
    others leave idle, and the waiting groups' worker uses little CPU. The waiting worker needs two others beside
    the low-priority one (four in all); with fewer, the low-priority worker runs the waiting groups last."""
    n = min(4, (os.cpu_count() or 1) + 1) + 2
    if config.option.maxprocesses:
        n = min(n, config.option.maxprocesses)
    if n > 1:
        config.option.nvlab_background = f"gw{n - 1}"  # the last worker
    if n >= 4:
        config.option.nvlab_waiting = f"gw{n - 2}"  # the one before it
    return n


def pytest_configure_node(node):
    """The controller tells the low-priority worker what it is (its workerinput)."""
    node.workerinput["nvlab_background"] = node.gateway.id == getattr(node.config.option, "nvlab_background", None)


def _set_niceness(nice: int) -> None:
    """This process's niceness, every thread's: Linux keeps one per thread (torch's pool threads started at import);
    the threads and processes started later inherit it."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():  # not Linux: the process's niceness
        os.nice(nice - os.getpriority(os.PRIO_PROCESS, 0))
        return
    for task in tasks.iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _may_raise_priority() -> bool:
    """Whether this user may take a niceness back (root, or CAP_SYS_NICE): a thread's, lowered and raised again."""
    done: list[bool] = []

    def probe() -> None:
        tid, nice = threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice + 1)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            done.append(True)
        except OSError:  # not permitted
            pass

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return bool(done)


_NORMAL_NICE: list[int] = []  # the low-priority worker's niceness before it lowered it (empty: not lowered)


def pytest_collection_finish(session):
    """The low-priority worker lowers its priority once it has collected (the controller waits for every worker's
    collection before any test starts)."""
    if getattr(session.config, "workerinput", {}).get("nvlab_background"):
        _NORMAL_NICE.append(os.getpriority(os.PRIO_PROCESS, 0))
        _set_niceness(max(BACKGROUND_NICE, _NORMAL_NICE[0]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """The low-priority worker takes its priority back before the first test of a waiting group (the scheduler hands
    it one only where that is permitted)."""
    if _NORMAL_NICE and _group(item.nodeid) in WAITING_GROUPS:
        _set_niceness(_NORMAL_NICE.pop())


def pytest_xdist_make_scheduler(config, log):
    """xdist's file scheduling, with the shared-server groups above as one unit each, handed out in the order of the
    items (the longest groups first)."""
    from xdist.scheduler import LoadScopeScheduling

    # xdist 3.6+ sorts the groups by their number of tests unless told not to: a notebook of 30 cells and 140 s then
    # starts after files of many quick tests, and ends the run alone (seen: the longest groups starting 70-270 s in)
    config.option.loadscopereorder = False

    background = getattr(config.option, "nvlab_background", None)
    waiting = getattr(config.option, "nvlab_waiting", None)
    choice = getattr(config.option, "nvlab_promote", None)  # the scheduler's tests choose; None: may this user
    promote = background is not None and waiting is None and (_may_raise_priority() if choice is None else choice)

    def kind(scope: str) -> str:  # where no worker runs waiting groups apart, they are others (the longest first)
        return "background" if scope in BACKGROUND_GROUPS else \
            "waiting" if (promote or waiting is not None) and scope in WAITING_GROUPS else "other"

    class _Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

        def _assign_work_unit(self, node) -> None:
            """The waiting groups' worker takes the first waiting group left and stops when none is; the
            low-priority worker likewise with background groups, then (``promote``) waiting groups; the others take
            the first other group, then waiting groups, then background groups."""
            low, apart = node.gateway.id == background, node.gateway.id == waiting
            order = ("waiting",) if apart else \
                (("background", "waiting") if promote else ("background",)) if low else \
                ("other", "waiting", "background")
            scope = next((s for k in order for s in self.workqueue if kind(s) == k), None)
            if scope is None and (low or apart or not self.workqueue):
                node.shutdown()  # it finishes what it holds
                return
            if scope is not None:
                self.workqueue.move_to_end(scope, last=False)  # xdist's own assignment takes the first group
            super()._assign_work_unit(node)

    return _Groups(config, log)


def pytest_collection_modifyitems(config, items):
    """Leave out the nightly set unless --all; the longest groups first (the scheduler above hands them out in this
    order)."""
    if not config.getoption("nvlab_all"):
        nightly = [i for i in items if i.get_closest_marker("nightly")]
        if nightly:
            config.hook.pytest_deselected(items=nightly)
            items[:] = [i for i in items if not i.get_closest_marker("nightly")]
    seconds = _stored_durations()
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_group(item.nodeid), i)
    items.sort(key=lambda it: (-seconds.get(_group(it.nodeid), 0.0), first_seen[_group(it.nodeid)]))


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist) takes stock
        _BEFORE.update(_course_leftovers())


def _store_durations() -> None:
    """Merge this run's group seconds into DURATIONS_FILE (one decimal, longest first)."""
    root = DURATIONS_FILE.parent.parent
    kept = {g: s for g, s in _stored_durations().items()
            if g in SHARED_GROUPS.values() or (root / g).is_file()}
    kept.update({g: round(s, 1) for g, s in _RAN_S.items()})
    ordered = dict(sorted(kept.items(), key=lambda kv: (-kv[1], kv[0])))
    DURATIONS_FILE.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_sessionfinish(session, exitstatus):
    """Fail a passing run that left course folders or shared memory behind (workers' exit handlers get 15 s)."""
    if hasattr(session.config, "workerinput"):
        return
    if session.config.getoption("nvlab_store_durations") and _RAN_S:
        _store_durations()
    if os.environ.get("NVLAB_TMP_CHECK") == "0":
        return
    if not getattr(session.config.option, "numprocesses", None):
        # no workers (-n 0): the tests ran here, and this process's exit cleanup (its servers stopped, its folders
        # removed: a stopped server's log is kept until then) has not run yet, as a worker's has by now
        from lab_utils import procs

        procs.exit_cleanup()
    deadline = time.monotonic() + 15
    while (left := _course_leftovers() - _BEFORE) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        names = ", ".join(sorted(str(p) for p in left))
        session.config.stash[_LEFT_KEY] = names
        if session.exitstatus == 0:
            session.exitstatus = 1


def _nbval_cell(item: pytest.Item) -> bool:
    return type(item).__name__ == "IPyNbCell"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    """Before a notebook's kernel starts: a run id every process it starts inherits, and a results folder."""
    if not _nbval_cell(item) or hasattr(item.parent, "nvlab_run"):
        return (yield)
    from lab_utils.course.results import RESULTS_ENV
    from nvlab.ops.notebooks import RUN_ID_ENV

    stem = Path(str(item.parent.fspath)).stem
    run = {"run_id": f"nbval-{stem}-{os.getpid()}", "t0": time.perf_counter(), "name": f"solutions/{stem}",
           "results": Path(tempfile.mkdtemp(prefix=f"nvlab-nbval-{stem}-"))}
    item.parent.nvlab_run = run
    saved = {k: os.environ.get(k) for k in (RUN_ID_ENV, RESULTS_ENV)}
    os.environ[RUN_ID_ENV], os.environ[RESULTS_ENV] = run["run_id"], str(run["results"])
    try:
        return (yield)  # the parent's setup starts the kernel here, with this environment
    finally:  # the kernel has its copy: the rest of the test session keeps its own
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A solution's exercise checks must all say "correct." or, where the tier lacks the hardware, "not applicable"
    (nbval only compares the marked cells)."""
    result = yield
    if _nbval_cell(item) and ".check(" in item.cell.source:
        text = "".join(o.get("text", "") for o in (item.test_outputs or []))
        # "not applicable on this tier" is a pass for a check that needs hardware this machine lacks
        judged = "correct." in text or "not applicable on this tier." in text
        if not judged or "incorrect" in text or "not attempted" in text:
            raise AssertionError(f"an exercise check in a solution did not pass; it printed:\n{text}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a notebook's last cell (its kernel stopped): wall time, leftovers, recorded results."""
    result = yield
    run = getattr(item.parent, "nvlab_run", None) if _nbval_cell(item) else None
    if run is None or (nextitem is not None and nextitem.parent is item.parent):
        return result
    from nvlab.ops.notebooks import leftover_processes

    item.user_properties.append(("nvlab_wall_s", (run["name"], time.perf_counter() - run["t0"])))
    try:
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while (left := leftover_processes(run["run_id"])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"{run['name']} left processes running after its kernel stopped:\n" + "\n".join(left)
        assert list(run["results"].glob("results_*.json")), f"{run['name']} recorded no measurement"
    finally:
        shutil.rmtree(run["results"], ignore_errors=True)
    return result


def pytest_runtest_logreport(report):
    """Collect notebook wall times where the summary is written (under xdist: the controller, from workers' reports),
    and each group's seconds."""
    group = _group(report.nodeid)
    _RAN_S[group] = _RAN_S.get(group, 0.0) + report.duration
    if report.when == "teardown":  # its report carries every property the test recorded
        _WALL_S.extend(tuple(v) for k, v in report.user_properties if k == "nvlab_wall_s")


_LEFT_KEY = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter):
    left = terminalreporter.config.stash.get(_LEFT_KEY, "")
    if left:
        terminalreporter.section("left behind")
        terminalreporter.write_line(f"the test run left these behind (set NVLAB_TMP_CHECK=0 when other course "
                                    f"processes share the machine): {left}", red=True)
    if _WALL_S:
        terminalreporter.section("notebook wall times")
        for name, seconds in _WALL_S:
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
