"""A real Triton Inference Server as an owned object: found, started on free ports, ready, stopped.

Stable API (lab 04 and lab 05 build on it): ``find_server`` (``TRITON_URL``, else ``tritonserver`` on the PATH,
else the wheel's), ``TritonServer`` (owned: stopped on ``with`` exit, ``stop()`` and at exit; ``ServerStartError``),
``ExternalServer`` (the same attributes, not owned), ``connect_or_start``, ``running_servers``.
Design notes: docs/internals.md#lab_utilsservingserverpy
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lab_utils.course.probe import pytriton_server
from lab_utils.course.stack import pinned_image
from lab_utils.owned import HttpGrpcEndpoints, OwnedServer, StartStop
from lab_utils.procs import (
    PYTHON_ENV_OWNER,
    check_service,
    check_url,
    env_url,
    http_ok,
    owned_tempdir,
    pid_alive,
    python_env_unowned,
    tail,
    wait_http_ok,
)
from lab_utils.serving.repository import validate_repository

MODEL_CONTROL = ("none", "explicit", "poll")
URL_ENV = "TRITON_URL"  # http://host:8000 of a running server
# SIGTERM first: Triton finishes in-flight requests and unloads models, polling once a second; a python model
# takes seconds to unload. After this grace the group gets SIGKILL (nothing is lost: the shm regions are ours).
DEFAULT_STOP_GRACE_S = 1.0
GRPC_URL_ENV = "TRITON_GRPC_URL"  # host:8001 (default: TRITON_URL's host, port 8001)
METRICS_URL_ENV = "TRITON_METRICS_URL"  # http://host:8002/metrics (default: TRITON_URL's host)
# How long an external server may refuse connections before "nothing listens" (s): a server that answers, Triton
# or not, is told at once; the compose stack's Triton opens its ports only once its models are loaded.
IDENTIFY_S = 5.0


class EmptyRepositoryWarning(UserWarning):
    """A server started on a repository with no model folder: it comes up ready and serves nothing."""


THREE_WAYS = (
    "No Triton server is available. Three ways to get one:\n"
    "  1. a running server: export TRITON_URL=http://HOST:8000 (the course's compose stack starts one);\n"
    "  2. the NGC image, where `tritonserver` is on the PATH: docker run --gpus all -p8000-8002:8000-8002 "
    "{triton_image} ... (or run the lab inside it);\n"
    "  3. the server binary from PyPI (python backend only, no Docker): "
    "pip install --no-deps nvidia-pytriton==0.7.0"
)


class Server(Protocol):
    """What the labs need of a Triton server: its endpoints and liveness. ``TritonServer`` (owned by this
    process) and ``ExternalServer`` (``TRITON_URL``, owned by someone else) both satisfy it."""

    http_url: str
    grpc_url: str
    metrics_url: str

    def alive(self) -> bool: ...

    def log_tail(self, n: int = 40) -> str: ...

    def stop(self) -> int | None: ...


class ServerNotFound(RuntimeError):
    """No server binary and no TRITON_URL: the message lists the three ways to get one."""


GRPC_START_ABORT = "encountered epoll_wait error: Bad file descriptor"  # see TritonServer._failure


class ServerStartError(RuntimeError):
    """The server did not become ready; the message carries why, the failed models and the log tail."""

    def __init__(self, message: str, log_tail: str = "", failed_models: dict[str, str] | None = None):
        self.log_tail = log_tail
        self.failed_models = failed_models or {}
        super().__init__(message)


@dataclass(frozen=True)
class ServerSource:
    """Where the server comes from: kind "url" (running), "path" (NGC binary) or "wheel" (nvidia-pytriton)."""

    kind: str
    location: str  # the URL or the binary's path
    version: str | None = None
    note: str = ""

    def __str__(self) -> str:
        v = f" {self.version}" if self.version else ""
        return f"{self.kind}: {self.location}{v} ({self.note})"


def find_server(local: bool = False) -> ServerSource:
    """The Triton server to use here: ``TRITON_URL``, else ``tritonserver`` on the PATH, else the wheel's binary.

    ``local=True`` looks only for a binary this process can start. Raises ``ServerNotFound`` (the three ways).
    """
    url = os.environ.get(URL_ENV, "").strip()
    if url and not local:
        return ServerSource("url", str(env_url(URL_ENV, default_port=8000)), None,
                            "a running server given by TRITON_URL")
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerSource("path", on_path, os.environ.get("TRITON_SERVER_VERSION"),
                            "tritonserver on the PATH (NGC image): every backend it ships")
    wheel = pytriton_server()
    if wheel is not None:
        try:
            version = "nvidia-pytriton " + importlib.metadata.version("nvidia-pytriton")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return ServerSource("wheel", str(wheel), version, "Triton 2.51 from the nvidia-pytriton wheel: python backend")
    # The pinned release's server: a plan built by that release's TensorRT loads in no older one.
    ways = THREE_WAYS.format(triton_image=pinned_image("tritonserver"))
    raise ServerNotFound(ways + ("" if not local or not url else
                                 f"\n(TRITON_URL={url} is set, but this call needs a binary to start)"))


# --- the wheel's server: a backend folder with the stub for this Python ------------------------------------

_WHEEL_TREES: dict[Path, Path] = {}  # the wheel's tree -> its backend folder
_wheel_lock = threading.Lock()
_STUB_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # the stub's Python: this one


def wheel_layout(binary: Path) -> dict[str, Path]:
    """Folders of the nvidia-pytriton server: its tree, its shared libraries, and the stub for this Python."""
    tree = binary.parent.parent  # .../pytriton/tritonserver
    libs = tree.parent.parent / "nvidia_pytriton.libs"
    stub = tree / "python_backend_stubs" / _STUB_PYTHON / "triton_python_backend_stub"
    if not stub.exists():
        have = sorted(p.name for p in (tree / "python_backend_stubs").glob("3.*"))
        raise ServerNotFound(f"nvidia-pytriton has no python-backend stub for Python {_STUB_PYTHON} "
                             f"(it has {', '.join(have)}): run the lab with one of those Pythons, or use "
                             "TRITON_URL / the NGC image")
    return {"tree": tree, "libs": libs, "stub": stub}


def prepare_wheel_backends(binary: Path) -> Path:
    """A backend folder for the wheel's server, built once per process: the python backend plus this Python's stub.

    Links, not copies (a few files): ``backends/python/{libtriton_python.so, triton_python_backend_utils.py,
    triton_python_backend_stub}`` and ``caches``. Returns the folder holding ``backends`` and ``caches``.
    """
    lay = wheel_layout(binary)
    tree = lay["tree"]
    with _wheel_lock:
        if tree in _WHEEL_TREES and (_WHEEL_TREES[tree] / "backends" / "python").is_dir():
            return _WHEEL_TREES[tree]
        base = owned_tempdir("triton-backends")
        py = base / "backends" / "python"
        py.mkdir(parents=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            (py / name).symlink_to(tree / "backends" / "python" / name)
        (py / "triton_python_backend_stub").symlink_to(lay["stub"])
        (base / "caches").symlink_to(tree / "caches")
        _WHEEL_TREES[tree] = base
        return base


def server_env(source: ServerSource, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this one (NCCL_*, CUDA_VISIBLE_DEVICES, the run id...) plus what Triton needs.

    The python backend's stub embeds the Python whose version matches it; it finds its ``site-packages``
    (numpy, onnxruntime, torch) by looking up ``python3`` on the PATH, so this interpreter's folder goes
    first, and this process's import path goes into ``PYTHONPATH``.
    """
    env = {**os.environ, **(extra or {})}
    if source.kind == "wheel":
        libs = str(wheel_layout(Path(source.location))["libs"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libs, env.get("LD_LIBRARY_PATH", "")) if p)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH", "")) if p)
    site = [p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p) and Path(p).is_dir()]
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(old + site))
    return env


# --- the server ------------------------------------------------------------------------------------------

_LOAD_FAIL = re.compile(r"failed to load '([^']+)' version (\d+): (.*?)(?:\"$|$)")
_STUB_FAIL = re.compile(r"Failed to (?:pre)?initialize Python stub(?: for auto-complete)?: (.*)$", re.M)
# the server's own signal handler logs this, then may hang instead of exiting (the 2.51 wheel after a SIGSEGV)
_FATAL_SIGNAL = re.compile(r"^Signal \((\d+)\) received\.", re.M)
_PORT_BUSY = re.compile(r"(already in use|Address in use|failed to start .* service)", re.I)


def failed_models(log_text: str) -> dict[str, str]:
    """{"model:version": first line of the reason} for every model the log says failed to load."""
    out = {f"{m.group(1)}:{m.group(2)}": m.group(3).replace("\\n", "\n").split("\n")[0].strip()
           for m in _LOAD_FAIL.finditer(log_text)}
    for m in _STUB_FAIL.finditer(log_text):
        out.setdefault("python stub", m.group(1).strip())
    return out


# the error lines of a server log: Triton's ``E...`` lines, ``error:``, unrecognized options
_ERROR_LINE = re.compile(r"^(?:E\d{4} .*|error: .*|.*unrecognized option.*|.*[Uu]nexpected argument.*)$", re.M)


class TritonServer(OwnedServer, HttpGrpcEndpoints):
    """One ``tritonserver`` process (and its python-backend stubs) owned by this interpreter.

    >>> with TritonServer(repo, model_control="explicit") as server:   # doctest: +SKIP
    ...     client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    """

    external = False
    error = ServerStartError
    free_hint = "to let the server take a free one"
    log_lines = 400  # the failed models are read from them
    stop_grace_default_s = DEFAULT_STOP_GRACE_S
    # a killed owner's server dies by its parent-death signal, and its stubs notice, except where one did not (on a
    # GPU: it caught SIGTERM and kept 742 MiB of GPU memory): the watchdog ends the whole group
    watchdog_s = (1.0, 2.0)
    log_path: Path | None = None  # given, or a folder of its own at the first start (kept after a stop)

    def __init__(
        self,
        model_repository: str | os.PathLike[str],
        *,
        model_control: str = "none",
        metrics: bool = True,
        metrics_config: tuple[str, ...] | list[str] = ("summary_latencies=true",),
        extra_args: tuple[str, ...] | list[str] = (),
        startup_timeout_s: float = 60,
        log_path: str | os.PathLike[str] | None = None,
        load_models: tuple[str, ...] | list[str] = (),
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        env: dict[str, str] | None = None,
        validate: bool = True,
        source: ServerSource | None = None,
        stop_grace_s: float | None = None,
        keep_ports: bool = False,
    ):
        if model_control not in MODEL_CONTROL:
            raise ValueError(f"model_control={model_control!r}: use one of {MODEL_CONTROL}")
        if load_models and model_control != "explicit":
            raise ValueError("load_models needs model_control='explicit' (in 'none' and 'poll' modes the server "
                             "loads every model of the repository)")
        if isinstance(metrics_config, str):
            metrics_config = (metrics_config,)
        self.model_repository = Path(model_repository).resolve()
        self.model_control = model_control
        self.metrics = metrics
        self.metrics_config = tuple(metrics_config)
        self.extra_args = tuple(extra_args)
        self.load_models = tuple(load_models)
        ports = {"http_port": http_port, "grpc_port": grpc_port, "metrics_port": metrics_port}
        super().__init__(host=host, ports=ports, startup_timeout_s=startup_timeout_s, stop_grace_s=stop_grace_s)
        self.http_port = self.grpc_port = self.metrics_port = 0
        self.keep_ports = keep_ports  # free ports picked at the first start, kept by every restart
        self._env_extra = dict(env or {})
        self.validate = validate
        self.source = source
        self.log_path = Path(log_path) if log_path is not None else None
        self._shm_prefix = ""
        self._python_envs: set[Path] = set()
        self._envs_before: set[Path] = set()

    # urls ----------------------------------------------------------------------------------------------
    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def wait_exit(self, timeout_s: float = 30.0) -> int | None:
        """The exit code once the process is reaped (negative: the killing signal), None if it still runs after
        ``timeout_s``: a SIGKILLed server closes its sockets well before the kernel has torn it down."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self._proc.wait(timeout=timeout_s) if self._proc is not None else None
        return None

    def exit_status(self) -> str:
        """How the server process ended, in words: "running", "exit code 1", "killed by SIGKILL (signal 9)"."""
        if self._proc is None:
            return "not started"
        code = self._proc.poll()
        return "running" if code is None else describe_exit(code)

    def ready(self) -> bool:
        """True when ``/v2/health/ready`` answers 200 now (within 2 s)."""
        return http_ok(self._ready_url(), timeout_s=2.0)[0]

    def __repr__(self) -> str:
        return (f"TritonServer({str(self.model_repository)!r}, {self._state()}, http={self.http_url}, "
                f"grpc={self.grpc_url})")

    # lifecycle: see OwnedServer ---------------------------------------------------------------------------
    def _command(self) -> list[str]:
        source = self.source
        assert source is not None
        argv = [source.location,  # a binary: _check refused a running server's URL
                f"--model-repository={self.model_repository}",
                f"--model-control-mode={self.model_control}",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                f"--http-address={self.host}", f"--grpc-address={self.host}",
                "--exit-timeout-secs=5", "--log-verbose=0",
                # every model the course serves carries its whole config.pbtxt: auto-complete would only start one
                # more python-backend stub per model load (about 0.2 s of CPU each) to find nothing to add
                "--disable-auto-complete-config"]
        # A prefix of our own for the python backend's shared-memory regions: a killed server leaves them in
        # /dev/shm, and the prefix (with this process's pid) is how they are found and removed.
        argv += [f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}"]
        if source.kind == "wheel":
            base = prepare_wheel_backends(Path(source.location))
            argv += [f"--backend-directory={base / 'backends'}", f"--cache-directory={base / 'caches'}"]
        if self.metrics:
            argv += ["--allow-metrics=true", f"--metrics-port={self.metrics_port}",
                     f"--metrics-address={self.host}"]
            argv += [f"--metrics-config={c}" for c in self.metrics_config]
        else:
            argv += ["--allow-metrics=false"]
        argv += [f"--load-model={m}" for m in self.load_models]
        argv += list(self.extra_args)
        return argv

    def _check(self) -> None:
        """Validate the repository and find the binary: raises ``ConfigError`` (a bad ``config.pbtxt``: nothing
        started), ``ServerNotFound`` or ``ServerStartError``."""
        if not self.model_repository.is_dir():
            raise ServerStartError(f"model repository {self.model_repository} is not a folder: build one with "
                                   "lab_utils.serving.repository (or pass the right path)")
        warn_if_empty(self.model_repository, self.model_control)
        if self.validate:
            validate_repository(self.model_repository, models=self.load_models or None)
        source = self.source or find_server(local=True)
        if source.kind == "url":
            raise ServerStartError("TritonServer starts a local binary; for TRITON_URL use ExternalServer or "
                                   "connect_or_start()")
        self.source = source

    def _port_taken(self, err: Exception) -> bool:
        return bool(_PORT_BUSY.search(getattr(err, "log_tail", "") or ""))

    def _prepare(self) -> dict[str, Any]:
        if self.log_path is None:  # none given: one folder per server, restarts append to its log
            self.log_path = owned_tempdir("triton-log") / "tritonserver.log"
        assert self.log_path is not None and self.source is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_shm()
        self._shm_prefix = f"{SHM_PREFIX}{os.getpid()}x{next(_counter)}_"
        self._envs_before = _python_envs()
        if self.log_path.exists() and self.log_path.stat().st_size:  # a restart: keep the last run's log beside
            self.log_path.replace(self.log_path.with_suffix(".previous.log"))
        return {"env": server_env(self.source, self._env_extra), "cwd": str(self.model_repository.parent)}

    def _ready_url(self) -> str:
        return f"{self.http_url}/v2/health/ready"

    def _give_up(self) -> bool:  # a python stub that failed to start hangs the server
        return bool(_STUB_FAIL.search(tail(self.log_path, 200)))

    def _started(self) -> None:
        # the server's pid in its env folders: `nvlab doctor` removes them once it is gone (Triton's clean shutdown
        # deletes them; when several servers run, a folder's age cannot tell whose it is)
        self._python_envs = _python_envs() - self._envs_before
        for folder in self._python_envs:
            with contextlib.suppress(OSError):
                (folder / PYTHON_ENV_OWNER).write_text(str(self.pid))

    def _failure(self, timed_out: bool, code: int | None, text: str) -> Exception:
        failed = failed_models(text)
        last = self.log_tail(40)  # read once: the message and the error's log_tail
        if timed_out:
            return ServerStartError(
                f"Triton did not become ready within {self.startup_timeout_s:g} s (models still loading? raise "
                f"startup_timeout_s). Log {self.log_path}, last lines:\n{last}", last, failed)
        why = "".join(f"\n  model {k} failed to load: {v}" for k, v in failed.items())
        if not failed:
            errors = [m.group(0).strip() for m in _ERROR_LINE.finditer(tail(self.log_path, 2000))]
            why = "".join(f"\n  {line}" for line in errors[:5])
        how = f"exited with code {code}" if code is not None else "failed (stopped it)"
        err = ServerStartError(f"tritonserver {how} before it was ready.{why}\nLog {self.log_path}, last "
                               f"lines:\n{last}", last, failed)
        # gRPC's event engine in tritonserver can abort at start ("Epoll1Poller ... encountered epoll_wait error: Bad
        # file descriptor", SIGABRT; seen once in about 45 runs of the test suite, some 48 starts each): no fault of
        # the repository, so start() tries once more
        err.nvlab_transient = code == -signal.SIGABRT and GRPC_START_ABORT in text  # type: ignore[attr-defined]
        return err

    def _halt(self, proc: Any) -> int | None:
        code = super()._halt(proc)
        if self._shm_prefix:  # the python backend's shared-memory regions: what a killed server leaves
            for f in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
                with contextlib.suppress(OSError):
                    f.unlink()
        # a killed server's python backend leaves its empty env folder: the ones seen at the start, and those made
        # later (a python model loaded after ready, or a start beside another server's) that no live server marks
        late = {f for f in _python_envs() - self._envs_before if python_env_unowned(f)}
        for folder in self._python_envs | late:
            with contextlib.suppress(OSError):
                (folder / PYTHON_ENV_OWNER).unlink(missing_ok=True)
                folder.rmdir()
        return code

    def crashed(self) -> str | None:
        """Why this server is broken (its log shows a fatal signal: the process may live on, deaf, or have exited),
        else None."""
        m = _FATAL_SIGNAL.search(tail(self.log_path, 400)) if self._proc is not None else None
        return f"tritonserver logged signal {m.group(1)} and stopped answering" if m else None

    def restart(self) -> TritonServer:
        """Stop (if running) and start again (after a crash, say): on the fixed ports given (or, ``keep_ports``,
        those of its first start), else on new free ones (a killed server's ports can be taken by another process
        meanwhile)."""
        self.stop()
        return self.start()


running_servers = TritonServer.running  # the servers this process started and has not stopped yet


class ServerStopped(RuntimeError):
    """The lab's server takes no requests now; the message says what to run first. A notebook shows only that one
    line (IPython's ``_render_traceback_``): the library's stack says nothing more to a student."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def require_serving(server: Any) -> None:
    """Raise ``ServerStopped`` (one line: what to run first) unless ``server`` is running."""
    why = not_serving(server)
    if why:
        raise ServerStopped(why)


def not_serving(server: Any) -> str | None:
    """Why ``server`` takes no requests now, in one line that says what to run first; None while it runs."""
    if server.alive():
        return None
    if getattr(server, "external", False):
        return (f"The Triton server at {server.http_url} ({URL_ENV}) does not answer: start it again "
                "(`docker compose up -d triton`), then run this again.")
    why = ("stopped (the lab's last cell stops it)" if getattr(server, "stopped", False)
           else f"not running ({server.exit_status()})")
    return f"The lab's Triton server is {why}: run `server.restart()` in a cell first, then this again."


def describe_exit(code: int) -> str:
    """A ``Popen.returncode`` in words (negative: the signal that killed the process)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-code})"
    return f"exit code {code}"


SHM_PREFIX = "nvlab_triton_"
_counter = itertools.count()


def _python_envs() -> set[Path]:
    """The python backend's execution-environment folders (``/tmp/python_env_*``, a fixed path in Triton): the
    ones that appear while a server starts are its own, removed when it stops (a killed server cannot)."""
    return set(Path("/tmp").glob("python_env_*"))


def remove_stale_shm() -> list[str]:
    """Remove regions of servers whose owning interpreter is gone (a killed kernel), ``nvlab_triton_<pid>x<n>_...``;
    returns their names."""
    removed = []
    for f in Path("/dev/shm").glob(f"{SHM_PREFIX}*"):
        m = re.match(re.escape(SHM_PREFIX) + r"(\d+)x", f.name)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                f.unlink()
                removed.append(f.name)
    return removed


def warn_if_empty(repo: Path, model_control: str) -> None:
    """Warn (``EmptyRepositoryWarning``) when ``repo`` has no model folder: Triton starts ready all the same."""
    if any(d.is_dir() and not d.name.startswith(".") for d in repo.iterdir()):
        return
    then = ("load_model() finds nothing until a model folder is written there" if model_control == "explicit"
            else "the server will be ready and serve no model")
    warnings.warn(f"model repository {repo} has no model folders (expected {repo}/<model>/config.pbtxt): {then}. "
                  "Build one with lab_utils.serving.repository, or pass the right path.",
                  EmptyRepositoryWarning, stacklevel=3)


def _is_triton(body: bytes) -> bool:
    """Whether a ``GET /v2`` body is Triton's server metadata (``name``, ``version``, ``extensions``)."""
    meta = json.loads(body)
    return isinstance(meta, dict) and "version" in meta and isinstance(meta.get("extensions"), list)


class ExternalServer(StartStop):
    """A server this process does not own (``TRITON_URL``): same attributes as ``TritonServer``, no lifecycle."""

    external = True

    def __init__(self, http_url: str, grpc_url: str | None = None, metrics_url: str | None = None):
        # The URLs usually come from the environment: a bad one is an EnvError naming the variable.
        from urllib.parse import urlsplit

        self.http_url = check_url(http_url, URL_ENV, default_port=8000)
        parts = urlsplit(self.http_url)
        self.host, self.http_port = str(parts.hostname), int(parts.port or 8000)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.grpc_url = (check_url(grpc_url, GRPC_URL_ENV, default_port=8001, schemes=("grpc",), bare=True)
                         if grpc_url else f"{host}:8001")
        self.grpc_port = int(self.grpc_url.rsplit(":", 1)[1])
        self.metrics_url = (check_url(metrics_url, METRICS_URL_ENV, default_port=8002, path_ok=True)
                            if metrics_url else f"http://{host}:8002/metrics")
        self.source = ServerSource("url", self.http_url, None, "a running server given by TRITON_URL")
        self.log_path = self.pid = self.startup_s = None
        self.model_control = "unknown"

    @classmethod
    def from_env(cls) -> ExternalServer:
        url = env_url(URL_ENV, default_port=8000)
        if not url:
            raise ServerNotFound(f"{URL_ENV} is not set")
        return cls(url, os.environ.get(GRPC_URL_ENV, "").strip() or None,
                   os.environ.get(METRICS_URL_ENV, "").strip() or None)

    def alive(self) -> bool:
        """True when ``/v2/health/live`` answers 200 now (within 2 s)."""
        return http_ok(f"{self.http_url}/v2/health/live", timeout_s=2.0)[0]

    ready = alive

    def start(self, timeout_s: float = 30) -> ExternalServer:
        """Check that Triton answers at ``http_url`` and wait up to ``timeout_s`` s until it is ready (it is not
        started here). Nothing listening, or another HTTP server there, is a ``ServerStartError`` within
        ``IDENTIFY_S`` s, naming ``TRITON_URL``."""
        why = check_service(self.http_url, "/v2", _is_triton, "Triton", URL_ENV, wait_s=min(IDENTIFY_S, timeout_s),
                            hint=f"is the server up (`docker compose ps`)? Or unset {URL_ENV} to start one here")
        if why:
            raise ServerStartError(why)
        try:
            wait_http_ok(f"{self.http_url}/v2/health/ready", None, timeout_s)
        except TimeoutError:
            state = http_ok(f"{self.http_url}/v2/health/ready")[1]
            raise ServerStartError(f"Triton at {self.http_url} ({URL_ENV}) is not ready after {timeout_s:g} s "
                                   f"(GET /v2/health/ready: {state}): models still loading, or one failed? "
                                   "Its log says: `docker compose logs triton`") from None
        return self

    def stop(self) -> None:
        """Nothing: this process does not own the server."""

    def log_tail(self, n: int = 40) -> str:
        return f"(external server at {self.http_url}: its log is where it runs, e.g. `docker compose logs triton`)"

    def __repr__(self) -> str:
        return f"ExternalServer(http={self.http_url}, grpc={self.grpc_url})"


def connect_or_start(model_repository: str | os.PathLike[str], **kwargs: Any) -> TritonServer | ExternalServer:
    """An ``ExternalServer`` when ``TRITON_URL`` is set, else a started ``TritonServer(model_repository, **kwargs)``."""
    if env_url(URL_ENV, default_port=8000):
        return ExternalServer.from_env().start()
    return TritonServer(model_repository, **kwargs).start()
