"""04.1, a ``config.pbtxt`` checked by Triton's schema, and 04.2, the deploy: ``load_model(config=...)`` and a poll
of ``is_model_ready`` with a deadline, on the lab's server."""

from __future__ import annotations

import copy
import json
import random
import time
from typing import Any

from lab_utils.exercises.framework import CodeExercise, Exercise, Wrong, amended, run_student
from lab_utils.exercises.lab04.server import _hint, _lab, _no_server
from lab_utils.serving import client as triton_client
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.repository import ConfigError, check_model_config, parse_config

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
        return self._real.is_model_ready(model_name, *args, **kwargs) and not self._still_loading  # asked either way

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
