"""Lab 04 exercises: the code a serving engineer writes, run against the lab's Triton server
(``use_server(server, repo)``), and the numbers read off it. tritonclient is imported when a check runs.

Design notes: docs/internals.md#lab_utilsexerciseslab04py
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import json
import math
import random
import re
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lab_utils.exercises.framework import (
    CodeExercise,
    Exercise,
    NotApplicable,
    NotNow,
    References,
    StudentLine,
    Wrong,
    amended,
    close_to,
    integer,
    items,
    number,
    run_student,
    sentence,
)
from lab_utils.procs import EnvError
from lab_utils.serving import client as triton_client
from lab_utils.serving import load as triton_load
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.backend import model as triton_model
from lab_utils.serving.backend.model import NUMPY2  # the wheel's stub runs this interpreter's NumPy
from lab_utils.serving.client import host_port
from lab_utils.serving.repository import ConfigError, check_model_config, parse_config
from lab_utils.serving.server import ServerNotFound, find_server, not_serving

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8",
    "use_server",
    "Q1_REQUIREMENTS", "Q1_MODEL_SHAPES",
    "DEPLOY_MODEL", "DEPLOY_DISK_CONFIG", "DEPLOY_CONFIG",
    "Q5_CONCURRENCY", "Q5_THROUGHPUT_INFER_S",
    "EXECUTE_MODEL", "EXECUTE_ROWS",
    "Q7_P95_TARGET_MS", "Q7_MEASURED",
    "Q8_STATS",
]

# --------------------------------------------------------------------------------------------------
# The server the code checks run against


@dataclass
class _Lab:
    server: Any  # a TritonServer or ExternalServer (lab_utils.serving.server.Server)
    repo: Path  # the model repository it reads, in explicit model-control mode
    model: str  # the lab's model, for the client checks


_BOUND: list[_Lab] = []


def use_server(server: Any, repo: str | Path, model: str = "mlp") -> None:
    """The running server the code checks call (explicit model control), the repository it reads (the checks write
    their own models there: ``q_deploy``, ``q_execute``), and the lab's model the client checks query."""
    _BOUND[:] = [_Lab(server, Path(repo), model)]
    print(f"code checks run against {server.grpc_url} (gRPC) and {server.http_url} (HTTP); "
          f"model {model!r}; repository {repo}")


def _no_server() -> str | None:
    """Why this machine cannot run the code checks (the outcome is then *not applicable*), or None; ``NotNow`` with
    what to run first when it can but the lab's server is not running yet, or no longer."""
    if not _BOUND:
        try:
            find_server()
        except ServerNotFound:
            return "no Triton server on this machine, so nothing to run your code against."
        except EnvError as err:  # a TRITON_URL that is not a URL: its message names the variable
            return f"{err}, so there is no server to run your code against."
        raise NotNow("no server to check against yet: run the cell that starts the server first (it calls "
                     "ex.use_server(server, repo)), then this check again.")
    stopped = not_serving(_BOUND[0].server)
    if stopped:  # the lab runs here: the check can run once the server does (not a tier's limit)
        raise NotNow(stopped)
    return None


def _lab() -> _Lab:
    reason = _no_server()
    if reason:
        raise NotApplicable(reason)
    # A server that crashed (its process alive, hung in its signal handler) is restarted before a check: a hang in
    # the check would look like the student's fault.
    server = _BOUND[0].server
    why = getattr(server, "crashed", lambda: None)()
    if why:
        print(f"the lab's server is broken ({why}): restarting it for this check; your code is not the cause")
        server.restart()
    return _BOUND[0]


def _hint(message: str, hints: dict[str, str]) -> str:
    """The first hint whose pattern (a regular expression, case-insensitive) the message matches."""
    for pattern, hint in hints.items():
        if re.search(pattern, message, re.I):
            return f" {sentence(hint)}"
    return ""


def _close(got: np.ndarray, want: np.ndarray) -> tuple[bool, float]:
    """Served against NumPy's answer: within 1e-3 of the output's scale."""
    diff = float(np.abs(np.asarray(got, np.float64) - want).max()) if want.size else 0.0
    return diff <= 1e-3 * max(1.0, float(np.abs(want).max())), diff


# --- q1: a config.pbtxt for stated requirements --------------------------------------------------------

Q1_REQUIREMENTS = """\
Serve the digits classifier exported to ONNX (model.onnx; input INPUT__0 of shape [batch, 64], float32;
output OUTPUT__0 of shape [batch, 10], float32) with Triton's ONNX Runtime backend, as model "digits_onnx":
  - requests may carry up to 32 rows; let Triton batch requests together;
  - prefer batches of 8 and 16, and never hold a request back more than 100 microseconds to form one;
  - two instances of the model, on the CPU."""
# what model.onnx declares (the batch axis is dynamic)
Q1_MODEL_SHAPES: dict[str, list[int | str | None]] = {"INPUT__0": ["batch", 64]}


def _grade_config(text: Any) -> str | None:
    if not isinstance(text, str):
        raise Wrong(f"expected the text of a config.pbtxt (a str), got a {type(text).__name__}")
    try:
        cfg = parse_config(text)
    except ConfigError as err:
        raise Wrong(f"Triton's schema refuses it: {err.problems[0][1]}") from None
    named = copy.deepcopy(cfg)
    named.name = named.name or "digits_onnx"  # no name: Triton takes the folder's, digits_onnx
    problems = check_model_config(named, gpus=0, model_shapes=Q1_MODEL_SHAPES)
    if problems:
        f, why = problems[0]
        raise Wrong(f"{f}: {why}")
    if cfg.name and cfg.name != "digits_onnx":
        raise Wrong(f'name is {cfg.name!r}: the model is called "digits_onnx" (and so must its folder be)')
    if cfg.platform != "onnxruntime_onnx" and cfg.backend != "onnxruntime":
        got = cfg.platform or cfg.backend
        raise Wrong(f'{got!r} does not run model.onnx: use platform: "onnxruntime_onnx" (or backend: "onnxruntime")')
    if cfg.max_batch_size != 32:
        raise Wrong(f"max_batch_size is {cfg.max_batch_size}: requests carry up to 32 rows, so 32")
    from tritonclient.grpc import model_config_pb2 as pb

    for group, want, dims, tensors in (("input", "INPUT__0", [64], cfg.input),
                                       ("output", "OUTPUT__0", [10], cfg.output)):
        table = {t.name: t for t in tensors}
        if want not in table:
            raise Wrong(f"no {group} named {want}: names must match the ONNX model's (it has {want})")
        t = table[want]
        if t.data_type != pb.TYPE_FP32:
            raise Wrong(f"{want} is {pb.DataType.Name(t.data_type)}: the model takes float32, TYPE_FP32")
        if list(t.dims) != dims:
            raise Wrong(f"{want} dims {list(t.dims)}: with max_batch_size > 0 leave the batch dimension out: {dims}")
    if not cfg.HasField("dynamic_batching"):
        raise Wrong("requests are not batched together: add a dynamic_batching { ... } block")
    db = cfg.dynamic_batching
    if sorted(db.preferred_batch_size) != [8, 16]:
        raise Wrong(f"preferred_batch_size {list(db.preferred_batch_size)}: the requirement prefers 8 and 16")
    if db.max_queue_delay_microseconds != 100:
        raise Wrong(f"max_queue_delay_microseconds {db.max_queue_delay_microseconds}: at most 100 µs "
                    "(the field is in microseconds)")
    count = sum(max(g.count, 1) for g in cfg.instance_group)
    kinds = {pb.ModelInstanceGroup.Kind.Name(g.kind) for g in cfg.instance_group}
    if not cfg.instance_group or count != 2:
        raise Wrong(f"{count if cfg.instance_group else 'no'} instance(s): instance_group [{{ count: 2 kind: "
                    "KIND_CPU }] gives two")
    if not kinds <= {"KIND_CPU", "KIND_AUTO"}:
        raise Wrong(f"instance kind {sorted(kinds)}: the instances run on the CPU, KIND_CPU")
    if "KIND_AUTO" in kinds:  # no kind: KIND_AUTO, the CPU on this GPU-less model, but a GPU where there is one
        return ("Without `kind` a group is KIND_AUTO: the CPU here, but a GPU on a machine with one; KIND_CPU says "
                "what the requirement means.")
    return None


q1 = Exercise(
    "04.1 config.pbtxt", "config_pbtxt", _grade_config,
    hints=(
        "Start from the fields: name, platform, max_batch_size, input [...], output [...], dynamic_batching "
        "{...}, instance_group [...]. Names and types must match the ONNX model.",
        "With max_batch_size > 0 Triton adds the batch dimension itself: dims are the shape of ONE row ([64]).",
        "dynamic_batching holds preferred_batch_size (a list: 8 and 16) and max_queue_delay_microseconds (100); "
        "instance_group is a list of groups, each with a count (2) and a kind (KIND_CPU).",
    ),
    solution_text='''config_pbtxt = """
name: "digits_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [64] }]
output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [10] }]
dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 100 }
instance_group [{ count: 2 kind: KIND_CPU }]
"""''',
)

# --------------------------------------------------------------------------------------------------
# 04.2 the deploy: load_model(config=...) and a poll of is_model_ready with a deadline

DEPLOY_MODEL = "q_deploy"
_DEPLOY_SIZES = {"in_features": 4, "width": 8, "depth": 1, "out_features": 3}
_PYTHON_MODEL: dict[str, Any] = {  # the lab's python model on its NumPy engine: no ONNX Runtime to import
    "backend": "python", "instance_group": [{"kind": "KIND_CPU", "count": 1}],
    "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [_DEPLOY_SIZES["in_features"]]}],
    "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [_DEPLOY_SIZES["out_features"]]}],
    "parameters": {"engine": {"string_value": "numpy"}},
}
# What q_deploy's config.pbtxt on disk says, and the configuration the deploy must put in force instead.
DEPLOY_DISK_CONFIG: dict[str, Any] = {"name": DEPLOY_MODEL, "max_batch_size": 8, **_PYTHON_MODEL}
DEPLOY_CONFIG: dict[str, Any] = {"name": DEPLOY_MODEL, "max_batch_size": 16, **_PYTHON_MODEL,
                                 "dynamic_batching": {"max_queue_delay_microseconds": 100}}
_DEPLOY_TIMEOUT_S = 0.5  # the deadline given while the model stays not ready


def _deploy_config(rng: random.Random) -> dict[str, Any]:
    """``DEPLOY_CONFIG`` with its batch size and queue delay drawn here: a deploy that sends a configuration of its
    own instead of the `config` argument (``ex.DEPLOY_CONFIG`` itself, say) serves the wrong one."""
    while True:
        cfg = copy.deepcopy(DEPLOY_CONFIG)
        cfg["max_batch_size"] = rng.choice((12, 16, 24, 32))
        cfg["dynamic_batching"] = {"max_queue_delay_microseconds": rng.choice((100, 200, 500))}
        if cfg != DEPLOY_CONFIG:
            return cfg
_DEPLOY_MAX_POLLS_PER_S = 100  # more is a busy loop against the server


class _Client:
    """The real gRPC client handed to the student's function, recording ``load_model`` and ``is_model_ready``.

    ``still_loading=True`` answers ``is_model_ready`` with False (after asking the server) as a server does while a
    model loads in the background (poll mode, a big engine, another process's load). ``close`` is left to the check.
    """

    def __init__(self, real: Any, still_loading: bool = False):
        self._real, self._still_loading = real, still_loading
        self.loads: list[tuple[str, Any]] = []
        self.polls = 0
        self.loaded_at: float | None = None  # when the last load request returned (the wait starts there)

    def load_model(self, model_name: str, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[1] if len(args) > 1 else None)
        self.loads.append((model_name, config))
        try:
            return self._real.load_model(model_name, *args, **kwargs)
        finally:
            self.loaded_at = time.perf_counter()

    def is_model_ready(self, model_name: str, *args: Any, **kwargs: Any) -> bool:
        self.polls += 1
        ready = self._real.is_model_ready(model_name, *args, **kwargs)
        return False if self._still_loading else ready

    def close(self) -> None:
        """The check closes the client (it is shared with the next call)."""

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


_DEPLOY_HINTS = {
    r"bad argument type|must be str|not JSON serializable|expected str": "load_model's config= takes JSON text: "
    "config=json.dumps(config), not the dict itself.",
    r"failed to poll from model repository|parse|json": "config= takes the configuration as JSON "
    "(json.dumps(config)), not config.pbtxt text.",
    r"not found|unknown model|no model": "load the model named `name`: it is in the server's repository.",
}


def _grade_deploy(fn: Any) -> str:
    from google.protobuf import json_format

    lab = _lab()
    # ``q_deploy`` on disk (config.pbtxt without batching), written once: a rewrite would make Triton reload it
    model_dir = lab.repo / DEPLOY_MODEL
    if not (model_dir / "1" / "weights.npz").exists() or not (model_dir / "config.pbtxt").exists():
        triton_repo.write_python_model(lab.repo, DEPLOY_DISK_CONFIG, sizes=_DEPLOY_SIZES, seed=4)
    config = _deploy_config(random.Random())
    with triton_client.client(lab.server.grpc_url) as real:
        # 1. The real deploy: the configuration given must be what the server serves afterwards.
        client = _Client(real)
        t0 = time.perf_counter()
        with amended(lambda m: f"{m}.{_hint(m, _DEPLOY_HINTS)}"):
            run_student(fn, client, DEPLOY_MODEL, copy.deepcopy(config), 30.0, timeout_s=90,
                        call=f"deploy_model(client, {DEPLOY_MODEL!r}, config, timeout_s=30)")
        took = time.perf_counter() - t0
        if not client.loads:
            raise Wrong("it never called client.load_model: in explicit model-control mode nothing is served until "
                        "a load request names the model.")
        name, given = client.loads[-1]
        if name != DEPLOY_MODEL:
            raise Wrong(f"it loaded {name!r}; the model to deploy is the `name` argument, {DEPLOY_MODEL!r}.")
        if given is None:
            raise Wrong("load_model was called without config=: the server read config.pbtxt from disk "
                        f"(max_batch_size {DEPLOY_DISK_CONFIG['max_batch_size']}, no dynamic batching) instead of "
                        "the configuration you were given. Pass config=json.dumps(config).")
        try:
            sent = parse_config(json.loads(given))
        except Exception:  # not JSON, or not a ModelConfig
            raise Wrong(f"config= was {str(given)[:60]!r}...: Triton wants the ModelConfig as JSON text, "
                        "json.dumps(config).") from None
        if sent != parse_config(config):
            raise Wrong("config= carried another configuration than the `config` argument: send it unchanged, "
                        "json.dumps(config).")
        served = json_format.ParseDict(real.get_model_config(DEPLOY_MODEL, as_json=True)["config"],
                                       type(sent)(), ignore_unknown_fields=True)
        delay = served.dynamic_batching.max_queue_delay_microseconds
        if (served.max_batch_size != config["max_batch_size"] or not served.HasField("dynamic_batching")
                or delay != config["dynamic_batching"]["max_queue_delay_microseconds"]):
            raise Wrong(f"after your deploy the server serves max_batch_size {served.max_batch_size}, dynamic "
                        f"batching {'on' if served.HasField('dynamic_batching') else 'off'}: not the configuration "
                        "given. Pass it to load_model as config=json.dumps(config).")
        if client.polls == 0:
            raise Wrong("it never asked client.is_model_ready(name): a deploy is done when the server says the "
                        "model is ready, not when the load request returns (a server in poll mode, or one "
                        "restarting, loads in the background).")
        # 2. A model that stays not ready: the poll must end at the deadline, with an exception, without a storm.
        slow = _Client(real, still_loading=True)

        def deploy_while_loading() -> BaseException | None:
            try:
                fn(slow, DEPLOY_MODEL, copy.deepcopy(config), _DEPLOY_TIMEOUT_S)
            except (TimeoutError, RuntimeError) as err:
                return err
            return None

        t1 = time.perf_counter()
        with amended(lambda m: m + (" Poll until a deadline: deadline = time.monotonic() + timeout_s, and raise "
                                    "TimeoutError once it has passed." if "did not return within" in m else "")):
            raised = run_student(deploy_while_loading, timeout_s=_DEPLOY_TIMEOUT_S + 3,
                                 call=f"deploy_model(client, {DEPLOY_MODEL!r}, config, timeout_s="
                                      f"{_DEPLOY_TIMEOUT_S:g}) with a model that stays not ready")
        waited = time.perf_counter() - (slow.loaded_at or t1)
    if raised is None:
        raise Wrong(f"with a model that never became ready (is_model_ready answered False {slow.polls} time(s)) it "
                    f"returned after {waited:.2f} s as if deployed: raise TimeoutError when timeout_s has passed, so "
                    "that the caller does not send traffic to a model that is not there.")
    if waited < 0.8 * _DEPLOY_TIMEOUT_S:
        raise Wrong(f"it gave up after {waited:.2f} s ({slow.polls} poll(s)), before timeout_s={_DEPLOY_TIMEOUT_S:g} "
                    "s: keep polling until the deadline, a model can take a while to load.")
    rate = slow.polls / max(waited, 1e-3)
    if rate > _DEPLOY_MAX_POLLS_PER_S:
        raise Wrong(f"it asked is_model_ready {slow.polls} times in {waited:.2f} s ({rate:,.0f} per second): every "
                    "poll is a request the server must answer. Pause between polls (time.sleep(0.1)).")
    return (f"the server serves {DEPLOY_MODEL} as given (max_batch_size {config['max_batch_size']}, dynamic batching "
            f"with a {config['dynamic_batching']['max_queue_delay_microseconds']} µs queue delay) after your deploy "
            f"({took:.2f} s); with a model that stayed not ready you polled {slow.polls} time(s) and raised "
            f"{type(raised).__name__} after {waited:.2f} s.")


q2 = CodeExercise(
    name="04.2 deploy and wait until ready", var="deploy_model", grade=_grade_deploy,
    signature="deploy_model(client, name, config, timeout_s) -> None", applicable=_no_server,
    hints=(
        "Two steps: a load request carrying the configuration (explicit model-control mode serves nothing until "
        "asked), then asking the server whether the model is ready until it is, or until a deadline.",
        "client.load_model takes the name and config=, the configuration as JSON text (json.dumps; it then "
        "overrides config.pbtxt). client.is_model_ready(name) answers True or False.",
        "A deadline: time.monotonic() plus timeout_s. Loop while the model is not ready: past the deadline raise "
        "TimeoutError naming the model, else sleep a little (0.1 s) and ask again.",
    ),
    solution_text=(
        "def deploy_model(client, name, config, timeout_s=60.0):\n"
        "    client.load_model(name, config=json.dumps(config))  # the JSON overrides config.pbtxt on disk\n"
        "    deadline = time.monotonic() + timeout_s\n"
        "    while not client.is_model_ready(name):\n"
        "        if time.monotonic() > deadline:\n"
        "            raise TimeoutError(f'{name} not ready after {timeout_s} s')\n"
        "        time.sleep(0.1)  # a poll is a request: not in a tight loop"
    ),
)

# --------------------------------------------------------------------------------------------------
# 04.3 / 04.4 a request by hand, gRPC and HTTP

_CLIENT_ROWS = (1, 3)  # the batches the client checks send
_CLIENT_HINTS = {
    r"data-?type|datatype|FP64|float64": "x is float32 and the model's INPUT__0 is TYPE_FP32: "
    "InferInput('INPUT__0', list(x.shape), 'FP32') and set_data_from_numpy(x) as it is.",
    r"shape": "InferInput takes the whole shape of x, batch dimension included: list(x.shape), e.g. [3, 64].",
    r"unexpected inference output|unknown output|output '": "the model's output is named 'OUTPUT__0'.",
    r"unexpected inference input|unknown input|input '": "the model's input is named 'INPUT__0'.",
    r"unavailable|connect|socket|refused|ssl|http/2|protocol|closed|parse|RTSP|deadline": "is the client the one "
    "for this endpoint? "
    "tritonclient.grpc for the gRPC URL, tritonclient.http for the HTTP one; pass `url` as given (host:port).",
}


def _served_version(lab: _Lab) -> tuple[str, dict[str, Any]]:
    """The version a request without a version reaches (the highest that is ready, loaded first if need be), and
    the model's metadata."""
    with triton_client.client(lab.server.grpc_url) as client:
        if not client.is_model_ready(lab.model):
            client.load_model(lab.model)
        meta = client.get_model_metadata(lab.model, as_json=True)
    return str(max(int(v) for v in meta.get("versions", []))), meta


def _grade_client(fn: Any, protocol: str) -> str:
    lab = _lab()
    url = host_port(lab.server.grpc_url if protocol == "grpc" else lab.server.http_url)
    version, meta = _served_version(lab)
    features = int(meta["inputs"][0]["shape"][-1])
    reference = functools.partial(triton_repo.reference_mlp, lab.repo / lab.model / version)  # NumPy
    rng = np.random.default_rng()  # inputs drawn afresh at every check: no answer can be prepared for them
    name = getattr(fn, "__name__", f"{protocol}_infer")
    worst = 0.0
    for rows in _CLIENT_ROWS:
        x = rng.standard_normal((rows, features), dtype=np.float32)
        call = f"{name}(url, {lab.model!r}, x)  # x: float32 {list(x.shape)}"
        with amended(lambda m: f"{m}.{_hint(m, _CLIENT_HINTS)}"):
            y = run_student(fn, url, lab.model, x.copy(), call=call, timeout_s=30)
        if type(y).__name__ == "InferResult":
            raise Wrong(f"{call} returned the InferResult itself: take the array out with "
                        "result.as_numpy('OUTPUT__0').")
        if isinstance(y, dict):
            raise Wrong(f"{call} returned a dict: return the array, result.as_numpy('OUTPUT__0').")
        if y is None:
            raise Wrong(f"{call} returned None: does it end with `return result.as_numpy('OUTPUT__0')` (as_numpy "
                        "returns None for an output name the response does not hold)?")
        if not isinstance(y, np.ndarray):
            raise Wrong(f"{call} returned a {type(y).__name__}; expected the output as a NumPy array")
        want = reference(x)
        if y.shape != want.shape:
            what = " (the input itself?)" if y.shape == x.shape else ""
            raise Wrong(f"{call} returned shape {list(y.shape)}{what}; the model answers {list(want.shape)} for "
                        f"{rows} row(s).")
        ok, diff = _close(y, want)
        if not ok:
            raise Wrong(f"{call}: the answer differs from the model computed in NumPy by {diff:.3g}: did the request "
                        "carry x (set_data_from_numpy(x)) and is OUTPUT__0 what comes back?")
        worst = max(worst, diff)
    return (f"over {protocol} the server answered batches of {' and '.join(map(str, _CLIENT_ROWS))} rows as the "
            f"model computed in NumPy does (version {version}, max |difference| {worst:.1e}).")


q3 = CodeExercise(
    name="04.3 a gRPC request by hand", var="grpc_infer", grade=lambda fn: _grade_client(fn, "grpc"),
    references=References("send the request with tritonclient.grpc yourself",
                           "lab_utils.serving.client.infer", "lab_utils.serving.repository.reference_mlp"),
    signature="grpc_infer(url, model, x) -> np.ndarray", applicable=_no_server,
    hints=(
        "tritonclient.grpc: a client for the URL, one InferInput per input (name, shape, datatype) filled from the "
        "array, the outputs you want, then client.infer(model, inputs, outputs=...).",
        "One grpcclient.InferInput for 'INPUT__0', with x's shape as a list and the datatype 'FP32', filled by its "
        "set_data_from_numpy; one grpcclient.InferRequestedOutput for 'OUTPUT__0'.",
        "client.infer(model, inputs, outputs=...) returns a result; its as_numpy('OUTPUT__0') is the array to "
        "return.",
    ),
    solution_text=(
        "def grpc_infer(url, model, x):\n"
        "    client = grpcclient.InferenceServerClient(url)  # url: host:port of the gRPC endpoint\n"
        "    inp = grpcclient.InferInput('INPUT__0', list(x.shape), 'FP32')  # shape with the batch dimension\n"
        "    inp.set_data_from_numpy(x)\n"
        "    out = grpcclient.InferRequestedOutput('OUTPUT__0')\n"
        "    result = client.infer(model, [inp], outputs=[out])\n"
        "    return result.as_numpy('OUTPUT__0')"
    ),
)

q4 = CodeExercise(
    name="04.4 an HTTP request by hand", var="http_infer", grade=lambda fn: _grade_client(fn, "http"),
    references=References("send the request with tritonclient.http yourself",
                           "lab_utils.serving.client.infer", "lab_utils.serving.repository.reference_mlp"),
    signature="http_infer(url, model, x) -> np.ndarray", applicable=_no_server,
    hints=(
        "tritonclient.http has the same classes as tritonclient.grpc; the URL is the HTTP endpoint's host:port.",
        "Over HTTP tritonclient sends and asks for tensors as raw bytes by default (binary_data=True is the default of "
        "set_data_from_numpy and InferRequestedOutput); binary_data=False would send them as JSON numbers.",
        "The client is an httpclient.InferenceServerClient for the URL; the rest is your gRPC function with "
        "httpclient's classes.",
    ),
    solution_text=(
        "def http_infer(url, model, x):\n"
        "    client = httpclient.InferenceServerClient(url)  # url: host:port of the HTTP endpoint\n"
        "    inp = httpclient.InferInput('INPUT__0', list(x.shape), 'FP32')\n"
        "    inp.set_data_from_numpy(x)  # binary_data=True by default: raw bytes, not JSON numbers\n"
        "    out = httpclient.InferRequestedOutput('OUTPUT__0')  # binary too, by default\n"
        "    result = client.infer(model, [inp], outputs=[out])\n"
        "    return result.as_numpy('OUTPUT__0')"
    ),
)

# --------------------------------------------------------------------------------------------------
# 04.5 Little's law

Q5_CONCURRENCY = 16  # closed-loop clients, each with one request in flight
Q5_THROUGHPUT_INFER_S = 2387.0  # measured (the H200 reference run, python backend with dynamic batching)
_Q5_MS = Q5_CONCURRENCY / Q5_THROUGHPUT_INFER_S * 1e3  # 6.703 ms

q5 = Exercise(
    "04.5 Little's law", "latency_ms",
    close_to(_Q5_MS, 0.02, "Little's law: requests in flight = throughput × latency.", slips={
        Q5_THROUGHPUT_INFER_S / Q5_CONCURRENCY / _Q5_MS: "that is throughput / concurrency (infer/s per "
        "client), not a time: latency = concurrency / throughput",
        1e-3: "that is in seconds: the answer is asked in milliseconds",
        1e3: "that is in microseconds: the answer is asked in milliseconds",
        1 / Q5_CONCURRENCY: "that is the time between completions (1 / throughput); each client waits for its own "
        "request: multiply by the concurrency",
    }, reveal=False),
    hints=(
        "In a closed loop every client has exactly one request in flight: N requests are in the system.",
        "Little's law: N = X × W (requests in the system = throughput × time each spends there). Solve for W.",
    ),
    solution_text="latency_ms = Q5_CONCURRENCY / Q5_THROUGHPUT_INFER_S * 1e3",
)

# --------------------------------------------------------------------------------------------------
# 04.6 the python backend's execute for a dynamic batch

EXECUTE_MODEL = "q_execute"
EXECUTE_ROWS = (1, 2, 3)  # rows per request the check sends: a split that assumes one row each shows
_EXECUTE_SIZES = {"in_features": 8, "width": 16, "depth": 2, "out_features": 3}
_EXECUTE_CONFIG: dict[str, Any] = {
    **_PYTHON_MODEL, "name": EXECUTE_MODEL, "max_batch_size": 16,
    "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [_EXECUTE_SIZES["in_features"]]}],
    "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [_EXECUTE_SIZES["out_features"]]}],
    # a queue delay long enough that requests wait for each other even on a busy laptop: batches form
    "dynamic_batching": {"max_queue_delay_microseconds": 2000},
}
_EXECUTE_CONCURRENCY = 8
_EXECUTE_SECONDS = 0.6
_APPENDED = "# --- appended by lab 04's check 04.6: your execute, from the notebook ---"
_STUB_FRAME = re.compile(r"model\.py\((\d+)\): (\w+)")


def _execute_source(fn: Any) -> tuple[str, str, int]:
    """The student's function as text, its name and its first line (in its cell), or ``Wrong``."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        first = fn.__code__.co_firstlineno
    except (OSError, TypeError, AttributeError):
        raise Wrong("the check could not read its source: define it with `def execute(self, requests):` in a "
                    "notebook cell (it is written into the model's model.py from there)") from None
    tree = ast.parse(source)
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef) or node.decorator_list:
        raise Wrong("expected a plain function `def execute(self, requests):` (no lambda, no decorator)")
    params = [a.arg for a in node.args.args]
    if len(params) != 2 or node.args.vararg or node.args.kwonlyargs:
        raise Wrong(f"it takes ({', '.join(params)}); the python backend calls execute(self, requests): `self` is "
                    "the model (self.model, self.input_name, self.output_name), `requests` the list of requests of "
                    "one batch")
    return source, node.name, first


def _model_source(source: str, name: str) -> tuple[str, int]:
    """model.py: the course's model file, the student's function, and the class that serves it; and the line
    (1-based) where the student's function starts in it."""
    head = triton_model.source().rstrip("\n") + "\n\n\n" + _APPENDED + "\n"
    start = head.count("\n") + 1
    tail = (f"\n\nclass TritonPythonModel(ExerciseModel):  # the class the python backend serves\n"
            f"    def execute(self, requests):\n"
            f"        return self.checked_execute(requests, {name})\n")
    return head + source.rstrip("\n") + "\n" + tail, start


def _student_line(message: str, source: str, start: int, first: int, name: str) -> str:
    """' at line N of `execute`: `code`' for the innermost frame of the student's code in a stub's error."""
    lines = source.rstrip("\n").splitlines()
    for m in _STUB_FRAME.finditer(message):
        k = int(m.group(1)) - start
        if 0 <= k < len(lines):
            return f", at {StudentLine('<cell>', first + k, name, lines[k].strip())}"
    return ""


_NO_NOTEBOOK_NAMES = ("model.py runs in the server's python stub, not in this notebook: it has np, to_numpy, "
                      "to_tensor and what your function imports itself (import triton_python_backend_utils as "
                      "pb_utils), not the notebook's variables.")


def _execute_failure(messages: dict[str, int], total: int, source: str, start: int, first: int,
                     name: str) -> Wrong:
    """The message for the failed requests of the check's load, by what went wrong."""
    failed = sum(messages.values())
    top = max(messages, key=lambda m: messages[m])
    wrong = {m: n for m, n in messages.items() if "wrong answer" in m}
    as_numpy = ".as_numpy(" in source
    numpy_note = (" Your execute reads inputs with .as_numpy(): Triton 2.51's stub was built against NumPy 1 and "
                  f"this server's Python has NumPy {np.__version__}, where as_numpy() returns wrong data. Use "
                  "to_numpy(tensor), which crosses by DLPack." if as_numpy and NUMPY2 else "")
    if wrong:
        n_wrong = sum(wrong.values())
        example = max(wrong, key=lambda m: wrong[m]).split("wrong answer: ", 1)[-1]
        if numpy_note:
            return Wrong(f"{n_wrong} of {total} requests got wrong answers (e.g. {example}).{numpy_note}")
        return Wrong(f"{n_wrong} of {total} requests got back rows that are not the answers to their own inputs "
                     f"(e.g. {example}). Split the batch's output in the order of `requests`, each request its own "
                     "number of rows (here 1 to 3): y[start:start + n], start advancing by n.")
    if re.search(r"size 0|empty", top):
        return Wrong("the answers arrived empty: pb_utils.Tensor(name, array) hands an empty tensor to the server "
                     f"when the stub's Python has NumPy 2 (here {np.__version__}). Build the output with "
                     "to_tensor('OUTPUT__0', rows), which crosses by DLPack.")
    m = re.search(r"message: (.*?)(?: At: |$)", top)  # the load generator's messages are one line
    if "execute returned" in top and m:
        return Wrong(m.group(1).strip().rstrip(".") + ".")
    if "Failed to process the request" in top and m:
        where = _student_line(top, source, start, first, name)
        extra = f" {_NO_NOTEBOOK_NAMES}" if "NameError" in m.group(1) else ""
        return Wrong(f"in the server your execute raised {m.group(1).strip()}{where}.{extra}{numpy_note}")
    if re.search(r"deadline|timed? ?out", top, re.I):
        return Wrong("requests got no answer within 5 s: does execute return its list of responses, and not loop "
                     "forever?")
    return Wrong(f"{failed} of {total} requests failed; the first error: {top[:300]}")


def _grade_execute(fn: Any) -> str:
    lab = _lab()
    source, name, first = _execute_source(fn)
    text, start = _model_source(source, name)
    model_dir = lab.repo / EXECUTE_MODEL
    vdir = model_dir / "1"
    if not (vdir / "weights.npz").exists():
        triton_repo.write_python_model(lab.repo, _EXECUTE_CONFIG, sizes=_EXECUTE_SIZES, source=text, seed=6)
    else:
        triton_repo.write_model_py(vdir, text)  # a changed model.py: the load below reloads the model
    log = vdir / triton_model.EXECUTE_LOG
    log.unlink(missing_ok=True)
    try:
        triton_client.load_model(lab.server.grpc_url, EXECUTE_MODEL)
    except RuntimeError as err:
        raise Wrong(f"the server could not load a model.py holding your execute: {err}") from None
    reference = functools.partial(triton_repo.reference_mlp, vdir)
    rng = np.random.default_rng()  # inputs drawn afresh at every check
    sizes = iter(EXECUTE_ROWS * 3)

    def make_inputs() -> dict[str, np.ndarray]:
        rows = next(sizes)
        return {"INPUT__0": rng.standard_normal((rows, _EXECUTE_SIZES["in_features"]), dtype=np.float32)}

    def verify(inputs: Any, outputs: Any) -> None:
        x, y = inputs["INPUT__0"], outputs.get("OUTPUT__0")
        if y is None:
            raise ValueError("a response without OUTPUT__0")
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"a request of {x.shape[0]} row(s) got {y.shape[0]} row(s) back")
        if not _close(y, reference(x))[0]:
            raise ValueError(f"a request of {x.shape[0]} row(s) got rows computed from another request's input")

    try:
        r = triton_load.run_load(lab.server.grpc_url, EXECUTE_MODEL, make_inputs, _EXECUTE_CONCURRENCY,
                                 duration_s=_EXECUTE_SECONDS, window_s=_EXECUTE_SECONDS / 2, warmup_s=0.2,
                                 processes=1, outputs=["OUTPUT__0"], stats_url=lab.server.http_url,
                                 timeout_s=5.0, verify=verify)
        runs = [tuple(map(int, line.split())) for line in log.read_text().splitlines()] if log.exists() else []
    finally:  # the server may be gone: nothing to unload
        with triton_client.client(lab.server.grpc_url) as real, contextlib.suppress(Exception):
            real.unload_model(EXECUTE_MODEL)  # in the background: its stub process goes
    total = r.requests + r.errors_total
    if r.errors_total:
        raise _execute_failure(r.error_messages, total, source, start, first, name)
    batches = [(k, n) for k, n in runs if k > 1]
    if not batches:
        raise Wrong(f"the server never handed execute more than one request at once ({len(runs)} executions, "
                    f"batch {r.server['batch_avg'] if r.server else float('nan'):.2f}): the check could not test "
                    "batching here; run it again.")
    per_request = [(k, n) for k, n in batches if n == k]
    if len(per_request) == len(batches):
        k, n = max(batches)
        raise Wrong(f"every client got its own rows back, but your execute ran the model once per request ({k} "
                    f"requests in one batch, {n} runs): batching then saves nothing. Concatenate the requests' rows "
                    "(np.concatenate), run self.model once for the batch, and split the answer.")
    others = [(k, n) for k, n in batches if n != 1]
    if others:
        k, n = others[0]
        raise Wrong(f"your execute ran the model {n} times for a batch of {k} requests: once per batch is the point.")
    batch_avg = r.server["batch_avg"] if r.server else total / max(len(runs), 1)
    return (f"{r.requests} requests of 1 to 3 rows from {_EXECUTE_CONCURRENCY} clients each got their own rows back; "
            f"the server put {batch_avg:.1f} requests in an execution on average and your execute ran the model once "
            f"per batch.")


q6 = CodeExercise(
    name="04.6 execute for a dynamic batch", var="execute", grade=_grade_execute,
    references=References("gather the requests, run self.model once and split its answer yourself",
                           "lab_utils.serving.backend.model.TritonPythonModel.execute",
                           "lab_utils.serving.backend.model.ExerciseModel.execute"),
    signature="execute(self, requests) -> list of pb_utils.InferenceResponse", applicable=_no_server,
    hints=(
        "`requests` holds every request of one batch; each carries its own number of rows. Gather their inputs, run "
        "self.model ONCE on all rows, then give each request its own slice, in order.",
        "Per request r: its input is pb_utils.get_input_tensor_by_name(r, 'INPUT__0'), as numpy through to_numpy. "
        "Run self.model once on all of them joined by np.concatenate; keep each request's row count.",
        "Walk the requests in order with a running start row: each gets a pb_utils.InferenceResponse with one "
        "tensor, to_tensor('OUTPUT__0', ...) of its own rows of the output, start to start + n. One response per "
        "request, in order.",
    ),
    solution_text=(
        "def execute(self, requests):\n"
        "    import triton_python_backend_utils as pb_utils\n"
        "    # to_numpy(t) is t.as_numpy() and to_tensor(name, a) is pb_utils.Tensor(name, a), both crossing by\n"
        "    # DLPack under NumPy 2 (where the plain calls return wrong data); on the NGC image the plain calls work\n"
        "    xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, 'INPUT__0')) for r in requests]  # each [n_i, F]\n"
        "    rows = [len(x) for x in xs]\n"
        "    y = self.model(np.concatenate(xs))  # ONE run for the batch: [sum n_i, 3]\n"
        "    responses, start = [], 0\n"
        "    for n in rows:  # in the order of `requests`: response i answers request i\n"
        "        responses.append(pb_utils.InferenceResponse([to_tensor('OUTPUT__0', y[start:start + n])]))\n"
        "        start += n\n"
        "    return responses"
    ),
)

# --------------------------------------------------------------------------------------------------
# 04.7 the queue delay for a p95 target

Q7_P95_TARGET_MS = 8.0
# max_queue_delay_microseconds -> what a sweep at concurrency 16 measured (throughput infer/s, p95 ms)
Q7_MEASURED: dict[int, dict[str, float]] = {
    0: {"throughput_infer_s": 1890.0, "p95_ms": 6.1},
    100: {"throughput_infer_s": 2150.0, "p95_ms": 6.8},
    200: {"throughput_infer_s": 2387.0, "p95_ms": 7.6},
    500: {"throughput_infer_s": 2520.0, "p95_ms": 9.4},
    1000: {"throughput_infer_s": 2560.0, "p95_ms": 12.9},
}


def _grade_delay(value: Any) -> None:
    table = _Q7_TABLE  # read only
    d = integer(value, "the delay")
    if d not in table:
        raise Wrong(f"{d} µs was not measured: choose one of {sorted(table)}")
    row = table[d]
    if row["p95_ms"] > Q7_P95_TARGET_MS:
        raise Wrong(f"at {d} µs p95 is {row['p95_ms']} ms, over the {Q7_P95_TARGET_MS} ms target: more "
                    "throughput, but the target comes first")
    best = max((k for k, r in table.items() if r["p95_ms"] <= Q7_P95_TARGET_MS),
               key=lambda k: table[k]["throughput_infer_s"])
    if d != best:
        raise Wrong(f"{d} µs meets the target, but a longer delay that still meets it gives more throughput "
                    f"({row['throughput_infer_s']:.0f} infer/s here)")


_Q7_TABLE = copy.deepcopy(Q7_MEASURED)  # the grader's own copy: a student's cell may change the shared one

q7 = Exercise(
    "04.7 queue delay", "queue_delay_us", _grade_delay,
    hints=(
        "A longer max_queue_delay_microseconds lets the batcher wait for fuller batches: throughput rises, "
        "and so does the tail latency.",
        "Keep the delays whose p95 is within the target; of those, take the one with the highest throughput.",
    ),
    solution_text=("queue_delay_us = max((d for d, r in Q7_MEASURED.items() if r['p95_ms'] <= Q7_P95_TARGET_MS),\n"
                   "                     key=lambda d: Q7_MEASURED[d]['throughput_infer_s'])"),
)

# --------------------------------------------------------------------------------------------------
# 04.8 the statistics API: average batch and queue time, from a fixed response and from the server's

def _stats_response(last_inference: int, success_ns: int, stage_ns: dict[str, int], sizes: list[int],
                    counts: list[int]) -> dict[str, Any]:
    """Triton's statistics response for mlp version 1: ``counts[i]`` executions at batch size ``sizes[i]``, every
    stage counted once per inference and taking ``stage_ns`` (no failure, no cache). batch_stats says how many
    executions ran at each size (the times are not used here)."""
    inferences, zero = sum(b * n for b, n in zip(sizes, counts, strict=True)), {"count": 0, "ns": 0}
    stages = ("compute_input", "compute_infer", "compute_output")
    return {"model_stats": [{
        "name": "mlp", "version": "1", "last_inference": last_inference,
        "inference_count": inferences, "execution_count": sum(counts),
        "inference_stats": {"success": {"count": inferences, "ns": success_ns}, "fail": dict(zero),
                            **{k: {"count": inferences, "ns": v} for k, v in stage_ns.items()},
                            "cache_hit": dict(zero), "cache_miss": dict(zero)},
        "batch_stats": [{"batch_size": b, **{k: {"count": n, "ns": 0} for k in stages}}
                        for b, n in zip(sizes, counts, strict=True)],
    }]}


# GET v2/models/mlp/stats after a load test (Triton's statistics extension)
Q8_STATS: dict[str, Any] = _stats_response(
    1764460800000, 44_160_000_000, {"queue": 19_840_000_000, "compute_input": 1_280_000_000,
                                    "compute_infer": 21_120_000_000, "compute_output": 960_000_000},
    [6, 8, 16], [20, 75, 355])


def _batch_slip(got: float, batch: float) -> str | None:
    if math.isclose(got, 1.0, rel_tol=0.01) and not math.isclose(batch, 1.0, rel_tol=0.01):
        return ("avg_batch: inference_stats counts requests in every stage (compute_infer.count = success.count): "
                "the executions are execution_count")
    if math.isclose(got, 1 / batch, rel_tol=0.01) and batch != 1:
        return "avg_batch: that is executions per inference: invert it"
    return None


def _queue_slip(got: float, queue_us: float, per_execution_us: float, request_us: float) -> str | None:
    if math.isclose(got, queue_us * 1e3, rel_tol=0.01):
        return "queue_us: that is nanoseconds (the statistics are in ns): the answer is asked in µs"
    if math.isclose(got, queue_us / 1e3, rel_tol=0.01):
        return "queue_us: that is milliseconds: the answer is asked in µs"
    if math.isclose(got, per_execution_us, rel_tol=0.01) and per_execution_us != queue_us:
        return "queue_us: queue.ns is summed over requests (queue.count), not over executions"
    if math.isclose(got, request_us, rel_tol=0.01):
        return "queue_us: that is the whole request (success.ns): the queue is only one part of it"
    return None


def _expected_split(stats: dict[str, Any]) -> tuple[float, float, float, float]:
    s = stats["model_stats"][0]
    st = s["inference_stats"]
    batch = int(s["inference_count"]) / int(s["execution_count"])
    queue = int(st["queue"]["ns"]) / int(st["queue"]["count"]) / 1e3
    per_exec = int(st["queue"]["ns"]) / int(s["execution_count"]) / 1e3
    request = int(st["success"]["ns"]) / int(st["success"]["count"]) / 1e3
    return batch, queue, per_exec, request


def _random_stats(rng: random.Random) -> dict[str, Any]:
    """A statistics response shaped like ``Q8_STATS`` with numbers drawn at random: a function that returns the
    fixed answer, or reads ``ex.Q8_STATS`` instead of its argument, fails on it."""
    fixed_batch, fixed_queue, _, _ = _expected_split(Q8_STATS)
    while True:
        sizes = sorted(rng.sample(range(2, 33), 3))
        counts = [rng.randint(20, 400) for _ in sizes]
        inferences, executions = sum(b * n for b, n in zip(sizes, counts, strict=True)), sum(counts)
        batch = inferences / executions
        queue_us = rng.uniform(300.0, 20_000.0)
        slips = [max(sizes), sum(sizes) / len(sizes)]  # the unweighted answers _grade_response names
        far = [fixed_batch, *slips, 1.0]
        # the fixed answer must not pass for an unweighted one either (sizes 7, 14, 22 average 14.33: the fixed
        # 14.22 then read as "weight them" instead of "compute it from the argument")
        if all(abs(batch / v - 1) > 0.05 for v in far) and abs(queue_us / fixed_queue - 1) > 0.05 and \
                all(abs(fixed_batch / v - 1) > 0.05 for v in slips):
            break
    stages = {"queue": queue_us, "compute_input": rng.uniform(50, 400), "compute_infer": rng.uniform(500, 5000),
              "compute_output": rng.uniform(50, 300)}
    ns = {k: round(v * 1e3 * inferences) for k, v in stages.items()}
    last = 1764460800000 + rng.randint(0, 10**9)
    return _stats_response(last, sum(ns.values()) + rng.randint(0, 10**9), ns, sizes, counts)


def _grade_response(fn: Any, stats: dict[str, Any], call: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """The student's (avg_batch, queue_us) for ``stats`` and the expected ones, or ``Wrong`` naming the slip."""
    result = run_student(fn, copy.deepcopy(stats), call=call, timeout_s=30)
    if isinstance(result, dict):
        raise Wrong(f"{call} returned a dict; return the two numbers as a tuple: (avg_batch, queue_us)")
    got_batch, got_queue = items(result, 2, call, "two numbers: (avg_batch, queue_us)")
    got_batch, got_queue = number(got_batch, "avg_batch"), number(got_queue, "queue_us")
    batch, queue, per_exec, request = _expected_split(stats)
    for slip in (_batch_slip(got_batch, batch), _queue_slip(got_queue, queue, per_exec, request)):
        if slip:
            raise Wrong(f"{call}: {slip}")
    sizes = [int(b["batch_size"]) for b in stats["model_stats"][0].get("batch_stats", [])]
    unweighted = (max(sizes), sum(sizes) / len(sizes)) if sizes else ()
    if not math.isclose(got_batch, batch, rel_tol=0.01) and any(math.isclose(got_batch, v, rel_tol=0.01)
                                                                 for v in unweighted):
        raise Wrong(f"{call}: avg_batch: batch_stats lists sizes with how many executions ran at each: weight them, "
                    "or use inference_count / execution_count")
    return (got_batch, got_queue), (batch, queue)


def _grade_stats(fn: Any) -> str:
    import urllib.request

    call = "batch_and_queue(ex.Q8_STATS)"
    (got_batch, got_queue), (batch, queue) = _grade_response(fn, Q8_STATS, call)
    for what, got, want in (("avg_batch", got_batch, batch), ("queue_us", got_queue, queue)):
        if not math.isclose(got, want, rel_tol=0.01):
            side = "high" if got > want else "low"
            raise Wrong(f"{call}: {what} {got:.4g} is too {side}: avg_batch = inferences per execution, queue_us = "
                        "queue time per queued request, in µs")
    # A second response with numbers drawn here: the answer must be computed from the argument.
    call = "batch_and_queue(<another response, its numbers drawn at random>)"
    got, want = _grade_response(fn, _random_stats(random.Random()), call)
    if not all(math.isclose(g, w, rel_tol=0.01) for g, w in zip(got, want, strict=True)):
        same = all(math.isclose(g, f, rel_tol=0.01) for g, f in zip(got, (batch, queue), strict=True))
        why = ("the answer to ex.Q8_STATS again: compute it from the `stats` argument, not from fixed numbers" if same
               else "avg_batch = inference_count / execution_count, queue_us = queue.ns / queue.count / 1000")
        raise Wrong(f"{call} gave ({got[0]:.4g}, {got[1]:.4g}); that response says ({want[0]:.4g}, {want[1]:.4g}): "
                    f"{why}")
    graded = f"on the fixed response (avg_batch {got_batch:.2f}, queue {got_queue:,.0f} µs) and on one with numbers " \
        "drawn at random"
    if not _BOUND or not _BOUND[0].server.alive():
        return f"{graded}."
    lab = _BOUND[0]
    version, _ = _served_version(lab)
    url = f"{lab.server.http_url.rstrip('/')}/v2/models/{lab.model}/versions/{version}/stats"
    with urllib.request.urlopen(url, timeout=10) as resp:
        live = json.loads(resp.read())
    if not live.get("model_stats") or not int(live["model_stats"][0].get("execution_count", 0)):
        return f"{graded} (the server's own {lab.model} has served nothing yet)."
    call = f"batch_and_queue(<GET v2/models/{lab.model}/versions/{version}/stats>)"
    (got_batch, got_queue), (batch, queue) = _grade_response(fn, live, call)
    if not (math.isclose(got_batch, batch, rel_tol=1e-6) and math.isclose(got_queue, queue, rel_tol=1e-6)):
        raise Wrong(f"{call} gave ({got_batch:.4g}, {got_queue:.4g}); the server's response says ({batch:.4g}, "
                    f"{queue:.4g}): read the counts as numbers (the JSON has them as integers)")
    return (f"on the fixed response, on one with numbers drawn at random, and on the server's own ({lab.model} "
            f"version {version}: avg_batch {batch:.2f}, queue {queue:,.0f} µs per request).")


q8 = CodeExercise(
    name="04.8 average batch and queue time", var="batch_and_queue", grade=_grade_stats,
    signature="batch_and_queue(stats) -> (avg_batch, queue_us)",
    hints=(
        "stats['model_stats'][0] holds inference_count (rows served), execution_count (runs of the model) and "
        "inference_stats: per stage a count and a total time in nanoseconds.",
        "avg_batch = inference_count / execution_count (batch_stats gives the same by weighting each size by its "
        "count); queue_us = queue.ns / queue.count / 1000.",
    ),
    solution_text=(
        "def batch_and_queue(stats):\n"
        "    s = stats['model_stats'][0]\n"
        "    q = s['inference_stats']['queue']\n"
        "    return int(s['inference_count']) / int(s['execution_count']), int(q['ns']) / int(q['count']) / 1e3"
    ),
)
