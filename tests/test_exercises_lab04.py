"""Lab 04's exercise checks. The code exercises run against one real Triton server for the module (the lab's model,
the checks' own models deployed and reloaded on it) with right implementations written two ways, blanks, and the
plausible wrong ones, each told its own symptom. The fixed-data exercises against right, wrong and blank answers;
hints, solutions, and that at least half of the exercises run code."""

from __future__ import annotations

import copy
import importlib.util
import json
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from _exercise_harness import check, exercises_of, hint_and_solution_tests, standard_tests
from _triton import require_server
from tritonclient.utils import np_to_triton_dtype

from lab_utils.exercises import lab04
from lab_utils.exercises.framework import CodeExercise, Exercise, Status
from lab_utils.exercises.lab04 import config, numbers, server
from lab_utils.exercises.lab04 import execute as execute_checks
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.backend.model import NUMPY2, to_numpy, to_tensor
from lab_utils.serving.server import TritonServer

LAB_SIZES = {"in_features": 8, "width": 16, "depth": 2, "out_features": 4}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The lab's server as the notebook has it: explicit model control, the lab's model `mlp` loaded, bound."""
    require_server()
    repo = tmp_path_factory.mktemp("lab04") / "models"
    cfg = triton_repo.mlp_config("mlp", in_features=8, out_features=4, max_batch_size=8)
    cfg["parameters"]["engine"] = {"string_value": "numpy"}
    triton_repo.write_python_model(repo, cfg, sizes=LAB_SIZES, seed=3)
    with TritonServer(repo, model_control="explicit", load_models=("mlp",)) as triton:
        lab04.use_server(triton, repo)
        yield triton
    server._BOUND.clear()


@pytest.fixture
def unbound():
    """No server bound during the test (the binding lives in ``server``, which every check module reads)."""
    saved = list(server._BOUND)
    server._BOUND.clear()
    yield
    server._BOUND[:] = saved


def outcome(exercise, value):
    out = check(exercise, value)
    return out.status, out.message


def assert_wrong(exercise, fn, *expected):
    status, message = outcome(exercise, fn)
    assert status is Status.INCORRECT, message
    assert f"`{exercise.var}`" in message
    for text in expected:
        assert text in message, (text, message)
    return message


# ==================================================================================================
# 04.2 the deploy


def deploy_model(client, name, config, timeout_s=60.0):
    client.load_model(name, config=json.dumps(config))
    deadline = time.monotonic() + timeout_s
    while not client.is_model_ready(name):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not ready after {timeout_s} s")
        time.sleep(0.1)


def deploy_model_differently(client, name, config, timeout_s):
    from google.protobuf import json_format

    body = json_format.MessageToJson(triton_repo.parse_config(config))  # camelCase JSON: the same configuration
    client.load_model(name, None, body)  # headers, then config, positionally
    start = time.time()
    while True:
        if client.is_model_ready(name):
            return
        if time.time() - start >= timeout_s:
            raise RuntimeError(f"gave up on {name}")
        time.sleep(0.05)


def deploy_without_config(client, name, config, timeout_s):
    client.load_model(name)
    while not client.is_model_ready(name):
        time.sleep(0.1)


def deploy_dict_config(client, name, config, timeout_s):
    client.load_model(name, config=config)


def deploy_pbtxt_config(client, name, config, timeout_s):
    client.load_model(name, config=triton_repo.config_text(config))


def deploy_no_deadline(client, name, config, timeout_s):
    client.load_model(name, config=json.dumps(config))
    while not client.is_model_ready(name):
        time.sleep(0.1)


def deploy_busy_poll(client, name, config, timeout_s):
    client.load_model(name, config=json.dumps(config))
    deadline = time.monotonic() + timeout_s
    while not client.is_model_ready(name):
        if time.monotonic() > deadline:
            raise TimeoutError(name)


def deploy_returns_false(client, name, config, timeout_s):
    client.load_model(name, config=json.dumps(config))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.is_model_ready(name):
            return True
        time.sleep(0.1)
    return False


def deploy_no_poll(client, name, config, timeout_s):
    client.load_model(name, config=json.dumps(config))


def deploy_asks_once(client, name, config, timeout_s):
    client.load_model(name, config=json.dumps(config))
    if not client.is_model_ready(name):
        raise TimeoutError(name)


def deploy_the_example(client, name, config, timeout_s):
    client.load_model(lab04.DEPLOY_MODEL, config=json.dumps(lab04.DEPLOY_CONFIG))  # not the `config` it is given
    deadline = time.monotonic() + timeout_s
    while not client.is_model_ready(name):
        if time.monotonic() > deadline:
            raise TimeoutError(name)
        time.sleep(0.1)


def deploy_blank(client, name, config, timeout_s):
    """Load `name` with `config` and wait until it is ready."""
    ...  # YOUR CODE HERE


def test_deploy_right_blank_and_wrong(lab):
    # the configuration on disk differs from the one to deploy: a deploy without config= is seen
    assert lab04.DEPLOY_DISK_CONFIG["max_batch_size"] != lab04.DEPLOY_CONFIG["max_batch_size"]
    for fn in (deploy_model, deploy_model_differently):
        status, message = outcome(lab04.q2, fn)
        assert status is Status.CORRECT, message
        assert "dynamic batching" in message and "raised" in message
    for blank in (None, ..., deploy_blank):
        assert outcome(lab04.q2, blank)[0] is Status.NOT_ATTEMPTED
    assert_wrong(lab04.q2, deploy_no_poll, "never asked client.is_model_ready")
    assert_wrong(lab04.q2, deploy_asks_once, "gave up after", "before timeout_s")
    assert_wrong(lab04.q2, deploy_dict_config, "TypeError", "json.dumps(config)", "line")
    assert_wrong(lab04.q2, deploy_pbtxt_config, "JSON")
    assert_wrong(lab04.q2, deploy_no_deadline, "did not return within", "stays not ready", "Poll until a deadline")
    assert_wrong(lab04.q2, deploy_busy_poll, "per second", "time.sleep")
    assert_wrong(lab04.q2, deploy_returns_false, "returned after", "raise TimeoutError")
    assert_wrong(lab04.q2, deploy_the_example, "another configuration than the `config` argument")
    assert_wrong(lab04.q2, deploy_without_config, "without config=", "config.pbtxt from disk")  # reloads from disk
    assert outcome(lab04.q2, deploy_model)[0] is Status.CORRECT  # and back


# ==================================================================================================
# 04.3, 04.4 the requests by hand


def grpc_infer(url, model, x):
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = grpcclient.InferRequestedOutput("OUTPUT__0")
    result = client.infer(model, [inp], outputs=[out])
    return result.as_numpy("OUTPUT__0")


def grpc_infer_differently(url, model, x):
    with grpcclient.InferenceServerClient(url=url) as client:  # every output, datatype from the array
        inputs = [grpcclient.InferInput("INPUT__0", x.shape, np_to_triton_dtype(x.dtype))]
        inputs[0].set_data_from_numpy(x)
        return client.infer(model_name=model, inputs=inputs).as_numpy("OUTPUT__0")


def grpc_float64(url, model, x):
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("INPUT__0", list(x.shape), "FP64")
    inp.set_data_from_numpy(x.astype(np.float64))
    return client.infer(model, [inp]).as_numpy("OUTPUT__0")


def grpc_no_batch_dim(url, model, x):
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("INPUT__0", [x.shape[1]], "FP32")
    inp.set_data_from_numpy(x[0])
    return client.infer(model, [inp]).as_numpy("OUTPUT__0")


def grpc_returns_result(url, model, x):
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp])


def grpc_wrong_output_name(url, model, x):
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("OUTPUT")


def grpc_http_client(url, model, x):
    client = httpclient.InferenceServerClient(url, connection_timeout=5, network_timeout=5)
    inp = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("OUTPUT__0")


def grpc_blank(url, model, x):
    """One request: the model's answer to x."""
    ...  # YOUR CODE HERE


def test_grpc_request_right_blank_and_wrong(lab):
    for fn in (grpc_infer, grpc_infer_differently):
        status, message = outcome(lab04.q3, fn)
        assert status is Status.CORRECT, message
        assert "over grpc" in message and "1 and 3 rows" in message
    for blank in (None, grpc_blank):
        assert outcome(lab04.q3, blank)[0] is Status.NOT_ATTEMPTED
    assert_wrong(lab04.q3, grpc_float64, "FP64", "TYPE_FP32", "line")
    assert_wrong(lab04.q3, grpc_no_batch_dim, "batch dimension included")
    assert_wrong(lab04.q3, grpc_returns_result, "InferResult", "as_numpy")
    assert_wrong(lab04.q3, grpc_wrong_output_name, "returned None")
    assert_wrong(lab04.q3, grpc_http_client, "tritonclient.grpc for the gRPC URL")
    assert_wrong(lab04.q3, lambda url, model, x: x, "the input itself")


def http_infer(url, model, x):
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = httpclient.InferRequestedOutput("OUTPUT__0", binary_data=True)
    return client.infer(model, [inp], outputs=[out]).as_numpy("OUTPUT__0")


def http_infer_json(url, model, x):
    client = httpclient.InferenceServerClient(url=url)  # tensors as JSON numbers: slower, the same answer
    inp = httpclient.InferInput("INPUT__0", x.shape, "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    return client.infer(model, inputs=[inp]).as_numpy("OUTPUT__0")


def http_grpc_client(url, model, x):
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], client_timeout=5).as_numpy("OUTPUT__0")


def http_no_batch_dim(url, model, x):
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("INPUT__0", [x.shape[1]], "FP32")
    inp.set_data_from_numpy(x[0])
    return client.infer(model, [inp]).as_numpy("OUTPUT__0")


def http_returns_dict(url, model, x):
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return {"OUTPUT__0": client.infer(model, [inp]).as_numpy("OUTPUT__0")}


def http_blank(url, model, x):
    """One request over HTTP: the model's answer to x."""
    ...  # YOUR CODE HERE


def test_http_request_right_blank_and_wrong(lab):
    for fn in (http_infer, http_infer_json):
        status, message = outcome(lab04.q4, fn)
        assert status is Status.CORRECT, message
        assert "over http" in message
    for blank in (None, http_blank):
        assert outcome(lab04.q4, blank)[0] is Status.NOT_ATTEMPTED
    assert_wrong(lab04.q4, http_grpc_client, "tritonclient.http for the HTTP one")
    assert_wrong(lab04.q4, http_returns_dict, "returned a dict")
    assert_wrong(lab04.q4, http_no_batch_dim, "batch dimension included")


# ==================================================================================================
# 04.6 execute for a dynamic batch (each check deploys a model.py with the function and drives it with load)


def execute(self, requests):
    import triton_python_backend_utils as pb_utils

    xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT__0")) for r in requests]
    rows = [len(x) for x in xs]
    y = self.model(np.concatenate(xs))
    responses, start = [], 0
    for n in rows:
        responses.append(pb_utils.InferenceResponse([to_tensor("OUTPUT__0", y[start:start + n])]))
        start += n
    return responses


def execute_split(self, requests):
    import triton_python_backend_utils as pb_utils

    batch = [to_numpy(pb_utils.get_input_tensor_by_name(request, self.input_name)) for request in requests]
    bounds = np.cumsum([len(b) for b in batch])[:-1]
    parts = np.split(self.model(np.vstack(batch)), bounds)
    return [pb_utils.InferenceResponse(output_tensors=[to_tensor(self.output_name, p)]) for p in parts]


def execute_per_request(self, requests):
    import triton_python_backend_utils as pb_utils

    out = []
    for r in requests:
        x = to_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT__0"))
        out.append(pb_utils.InferenceResponse([to_tensor("OUTPUT__0", self.model(x))]))
    return out


def execute_reversed(self, requests):
    import triton_python_backend_utils as pb_utils

    xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT__0")) for r in requests]
    y, start, out = self.model(np.concatenate(xs)), 0, []
    for x in reversed(xs):  # rows handed out from the wrong end
        out.append(pb_utils.InferenceResponse([to_tensor("OUTPUT__0", y[start:start + len(x)])]))
        start += len(x)
    return out[::-1]


def execute_one_row_each(self, requests):
    import triton_python_backend_utils as pb_utils

    xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT__0")) for r in requests]
    y = self.model(np.concatenate(xs))
    return [pb_utils.InferenceResponse([to_tensor("OUTPUT__0", y[i:i + 1])]) for i in range(len(requests))]


def execute_returns_nothing(self, requests):
    import triton_python_backend_utils as pb_utils

    xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT__0")) for r in requests]
    self.model(np.concatenate(xs))


def execute_as_numpy(self, requests):
    import triton_python_backend_utils as pb_utils

    xs = [pb_utils.get_input_tensor_by_name(r, "INPUT__0").as_numpy() for r in requests]
    rows = [len(x) for x in xs]
    y = self.model(np.concatenate(xs))
    return [pb_utils.InferenceResponse([to_tensor("OUTPUT__0", part)])
            for part in np.split(y, np.cumsum(rows)[:-1])]


def execute_tensor_constructor(self, requests):
    import triton_python_backend_utils as pb_utils

    xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT__0")) for r in requests]
    rows = [len(x) for x in xs]
    y = self.model(np.concatenate(xs))
    return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT__0", part)])
            for part in np.split(y, np.cumsum(rows)[:-1])]


SCALE = 2.0


def execute_notebook_variable(self, requests):
    import triton_python_backend_utils as pb_utils

    xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, "INPUT__0")) for r in requests]
    y = self.model(np.concatenate(xs) * SCALE_IN_THE_NOTEBOOK)  # noqa: F821 (a notebook variable the stub lacks)
    return [pb_utils.InferenceResponse([to_tensor("OUTPUT__0", y)])]


def execute_no_self(requests):
    return requests


def execute_blank(self, requests):
    """Run the model once for the batch; one response per request."""
    ...  # YOUR CODE HERE


@pytest.mark.parametrize("fn", [execute, execute_split], ids=lambda f: f.__name__)
def test_execute_right(lab, fn):
    status, message = outcome(lab04.q6, fn)
    assert status is Status.CORRECT, message
    assert "got their own rows back" in message and "once per batch" in message


def test_execute_blank_and_static_mistakes(lab):
    for blank in (None, ..., execute_blank):
        assert outcome(lab04.q6, blank)[0] is Status.NOT_ATTEMPTED
    assert_wrong(lab04.q6, execute_no_self, "execute(self, requests)")
    assert_wrong(lab04.q6, lambda self, requests: requests, "no lambda")


@pytest.mark.parametrize(("fn", "expected"), [
    (execute_per_request, ["once per request", "np.concatenate"]),
    (execute_reversed, ["not the answers to their own inputs", "in the order of `requests`"]),
    (execute_one_row_each, ["got 1 row(s) back", "each request its own number of rows"]),
    (execute_returns_nothing, ["execute returned NoneType, not a list"]),
    (execute_as_numpy, ["as_numpy", "to_numpy(tensor)"]),
    (execute_tensor_constructor, ["arrived empty", "to_tensor("]),
    (execute_notebook_variable, ["NameError", "SCALE_IN_THE_NOTEBOOK", "line", "not the notebook's variables"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_execute_wrong_versions_get_their_own_message(lab, fn, expected):
    if fn in (execute_as_numpy, execute_tensor_constructor) and not NUMPY2:
        pytest.skip("with NumPy 1 in the stub as_numpy() and pb_utils.Tensor(name, array) work")
    assert_wrong(lab04.q6, fn, *expected)


def test_execute_failure_shows_a_row_count_mismatch_before_rows_of_another_input():
    """Which wrong answer is most common depends on how the server batched the load: the example shown must not."""
    messages = {"wrong answer: a request of 1 row(s) got rows computed from another request's input": 150,
                "wrong answer: a request of 2 row(s) got 1 row(s) back": 130,
                "wrong answer: a request of 3 row(s) got 1 row(s) back": 120}
    wrong = execute_checks._execute_failure(messages, 400, "", 1, 1, "execute")
    assert "400 of 400 requests" in str(wrong) and "got 1 row(s) back" in str(wrong)


def test_execute_model_file_is_the_course_model_plus_the_function():
    text, start = execute_checks._model_source("def execute(self, requests):\n    return []\n", "execute")
    lines = text.splitlines()
    assert lines[start - 1] == "def execute(self, requests):"
    assert text.rstrip().endswith("return self.checked_execute(requests, execute)")
    compile(text, "model.py", "exec")


# ==================================================================================================
# 04.8 the statistics API


def batch_and_queue(stats):
    s = stats["model_stats"][0]
    q = s["inference_stats"]["queue"]
    return int(s["inference_count"]) / int(s["execution_count"]), int(q["ns"]) / int(q["count"]) / 1e3


def batch_and_queue_weighted(stats):
    s = stats["model_stats"][0]
    executions = sum(int(b["compute_infer"]["count"]) for b in s["batch_stats"])
    rows = sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in s["batch_stats"])
    queue = s["inference_stats"]["queue"]
    return [rows / executions, float(queue["ns"]) / float(queue["count"]) * 1e-3]


def _stats_fn(batch, queue):
    def batch_and_queue(stats):
        s = stats["model_stats"][0]
        st = s["inference_stats"]
        values = {"batch": int(s["inference_count"]) / int(s["execution_count"]),
                  "ones": int(st["compute_infer"]["count"]) / int(st["success"]["count"]),
                  "inverted": int(s["execution_count"]) / int(s["inference_count"]),
                  "largest": 16.0,
                  "queue": int(st["queue"]["ns"]) / int(st["queue"]["count"]) / 1e3,
                  "ns": int(st["queue"]["ns"]) / int(st["queue"]["count"]),
                  "ms": int(st["queue"]["ns"]) / int(st["queue"]["count"]) / 1e6,
                  "per_execution": int(st["queue"]["ns"]) / int(s["execution_count"]) / 1e3,
                  "request": int(st["success"]["ns"]) / int(st["success"]["count"]) / 1e3}
        return values[batch], values[queue]

    return batch_and_queue


def test_stats_right_blank_and_wrong_on_the_fixed_and_the_live_response(lab):
    lab04.q3.check(grpc_infer, quiet=True)  # mlp has served requests: the live part runs
    for fn in (batch_and_queue, batch_and_queue_weighted):
        status, message = outcome(lab04.q8, fn)
        assert status is Status.CORRECT, message
        assert "the server's own (mlp version 1" in message
    assert outcome(lab04.q8, None)[0] is Status.NOT_ATTEMPTED
    for (b, q), expected in {("ones", "queue"): "execution_count", ("inverted", "queue"): "invert",
                             ("largest", "queue"): "weight them", ("batch", "ns"): "nanoseconds",
                             ("batch", "ms"): "milliseconds", ("batch", "per_execution"): "queue.count",
                             ("batch", "request"): "whole request"}.items():
        assert_wrong(lab04.q8, _stats_fn(b, q), expected)
    assert_wrong(lab04.q8, lambda stats: {"avg_batch": 1, "queue_us": 2}, "returned a dict")
    assert_wrong(lab04.q8, lambda stats: 14.2, "expected two numbers")


def test_stats_without_a_server_grades_the_fixed_response(unbound):
    for fn in (batch_and_queue, batch_and_queue_weighted):
        status, message = outcome(lab04.q8, fn)
        assert status is Status.CORRECT and "on the fixed response" in message and "drawn at random" in message


def batch_and_queue_from_the_example(stats):
    s = lab04.Q8_STATS["model_stats"][0]  # the fixed example, whatever it is given
    q = s["inference_stats"]["queue"]
    return s["inference_count"] / s["execution_count"], q["ns"] / q["count"] / 1e3


def test_stats_constants_and_the_example_fail_on_the_random_response(unbound):
    # no server: only the fixed and the random response
    assert_wrong(lab04.q8, lambda s: (14.2222222, 3100.0), "drawn at random", "from the `stats` argument")
    assert_wrong(lab04.q8, batch_and_queue_from_the_example, "drawn at random", "from the `stats` argument")
    assert_wrong(lab04.q8, _stats_fn("largest", "queue"), "weight them")
    assert outcome(lab04.q8, batch_and_queue_blank)[0] is Status.NOT_ATTEMPTED


def batch_and_queue_blank(stats):
    """(average batch, average queue time in µs) from a statistics response."""
    ...  # YOUR CODE HERE


def test_stats_random_responses_are_consistent_and_differ():
    import random

    seen = set()
    for seed in range(50):
        stats = numbers._random_stats(random.Random(seed))
        s = stats["model_stats"][0]
        assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in s["batch_stats"]) == s["inference_count"]
        assert sum(b["compute_infer"]["count"] for b in s["batch_stats"]) == s["execution_count"]
        assert json.loads(json.dumps(stats)) == stats  # what a server's JSON could hold
        batch, queue = batch_and_queue(stats)
        assert abs(batch / 14.2222 - 1) > 0.05 and abs(queue / 3100 - 1) > 0.05
        seen.add(round(batch, 6))
    assert len(seen) > 40


# ==================================================================================================
# Not applicable without a server; the fixed-data exercises; hints, solutions


def test_deploy_configs_are_drawn_and_differ_from_the_example():
    import random

    configs = [config._deploy_config(random.Random(seed)) for seed in range(30)]
    assert all(c != lab04.DEPLOY_CONFIG for c in configs)
    assert len({(c["max_batch_size"], c["dynamic_batching"]["max_queue_delay_microseconds"]) for c in configs}) > 5
    assert all(c["max_batch_size"] != lab04.DEPLOY_DISK_CONFIG["max_batch_size"] for c in configs)


def test_code_checks_without_a_server_are_not_applicable_or_not_yet(unbound, monkeypatch):
    """No Triton on the machine: not applicable on this tier. A server binary but the lab's server not started yet:
    not checked now, naming the cell to run first."""
    from lab_utils.serving.server import ServerNotFound

    cases = ((lab04.q2, deploy_model), (lab04.q3, grpc_infer), (lab04.q4, http_infer), (lab04.q6, execute))
    for exercise, fn in cases:
        status, message = outcome(exercise, fn)
        assert status is Status.NOT_NOW and "use_server" in message, message

    def no_binary():
        raise ServerNotFound("no tritonserver")

    monkeypatch.setattr(server, "find_server", no_binary)
    for exercise, fn in cases:
        status, message = outcome(exercise, fn)
        assert status is Status.NOT_APPLICABLE and "no Triton server" in message, message


RIGHT_CONFIG = """
name: "digits_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [64] }]
output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [10] }]
dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 100 }
instance_group [{ count: 2 kind: KIND_CPU }]
"""
# the same with the backend named instead of the platform, the preferred sizes reversed, two groups of one
RIGHT_CONFIG_2 = (RIGHT_CONFIG.replace('platform: "onnxruntime_onnx"', 'backend: "onnxruntime"')
                  .replace("[8, 16]", "[16, 8]")
                  .replace("instance_group [{ count: 2 kind: KIND_CPU }]",
                           "instance_group [{ count: 1 kind: KIND_CPU }, { kind: KIND_CPU }]"))

# no name (Triton takes the folder's, digits_onnx), an instance group without kind (KIND_AUTO: the CPU here)
RIGHT_CONFIG_3 = (RIGHT_CONFIG.replace('name: "digits_onnx"\n', "")
                  .replace("instance_group [{ count: 2 kind: KIND_CPU }]", "instance_group [{ count: 2 }]"))


def cfg(old: str, new: str) -> str:
    assert old in RIGHT_CONFIG
    return RIGHT_CONFIG.replace(old, new)


WRONG_CONFIGS = {
    "misspelled field": (cfg("max_batch_size", "max_batch"), "schema"),
    "batch dim in dims": (cfg("dims: [64]", "dims: [-1, 64]"), "includes the batch dimension"),
    "preferred over max": (cfg("max_batch_size: 32", "max_batch_size: 12"), "max_batch_size 12"),
    "gpu instances": (cfg("KIND_CPU", "KIND_GPU"), "KIND_GPU"),
    "python backend": (cfg('platform: "onnxruntime_onnx"', 'backend: "python"'), "does not run model.onnx"),
    "wrong name": (cfg('name: "digits_onnx"', 'name: "digits"'), "digits_onnx"),
    "no batching": (cfg("dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 100 }",
                        ""), "dynamic_batching"),
    "delay in ms": (cfg("max_queue_delay_microseconds: 100", "max_queue_delay_microseconds: 100000"),
                    "microseconds"),
    "one instance": (cfg("count: 2", "count: 1"), "count: 2"),
    "fp16": (cfg("data_type: TYPE_FP32 dims: [64]", "data_type: TYPE_FP16 dims: [64]"), "TYPE_FP32"),
    "input name": (cfg('name: "INPUT__0"', 'name: "x"'), "not an input of the model"),
    "max 64": (cfg("max_batch_size: 32", "max_batch_size: 64"), "32 rows"),
    "only 8": (cfg("[8, 16]", "[8]"), "8 and 16"),
}

_MS = lab04.Q5_CONCURRENCY / lab04.Q5_THROUGHPUT_INFER_S * 1e3

CASES = [
    (lab04.q1, [RIGHT_CONFIG, RIGHT_CONFIG_2, RIGHT_CONFIG_3],
     [c for c, _ in WRONG_CONFIGS.values()] + [42, {"name": "x"}]),
    (lab04.q5, [_MS, 6.7, "6.703"], [_MS / 1e3, _MS * 1e3, lab04.Q5_THROUGHPUT_INFER_S / 16, _MS / 16, 20.0, "fast"]),
    (lab04.q7, [200, 200.0, "200"], [500, 1000, 0, 100, 300, "fast", 2.5]),
]

(
    test_right_answers_are_correct,
    test_wrong_answers_are_incorrect_and_show_the_value,
    test_blank_answers_are_not_attempted,
) = standard_tests(CASES)


def test_cases_cover_every_exercise():
    code = {id(e) for e in (lab04.q2, lab04.q3, lab04.q4, lab04.q6, lab04.q8)}  # tested above, on the server
    assert {id(ex) for ex, *_ in CASES} | code == {id(ex) for ex in exercises_of(lab04)}


def test_at_least_half_of_the_exercises_run_code():
    exercises = exercises_of(lab04)
    code = [e for e in exercises if isinstance(e, CodeExercise)]
    assert 2 * len(code) >= len(exercises), [e.name for e in code]


@pytest.mark.parametrize("case", sorted(WRONG_CONFIGS), ids=str)
def test_q1_names_the_problem(case):
    text, expected = WRONG_CONFIGS[case]
    out = check(lab04.q1, text)
    assert out.status is Status.INCORRECT and expected in out.message, out.message


def test_q1_accepts_the_folder_name_and_kind_auto():
    assert "name" not in RIGHT_CONFIG_3.split("input")[0] and "kind" not in RIGHT_CONFIG_3
    for text in (RIGHT_CONFIG.replace('name: "digits_onnx"\n', ""),
                 RIGHT_CONFIG.replace("count: 2 kind: KIND_CPU", "count: 2"), RIGHT_CONFIG_3):
        out = check(lab04.q1, text)
        assert out.correct, out.message
    assert "KIND_AUTO" in check(lab04.q1, RIGHT_CONFIG_3).message  # told what it means on a GPU machine
    assert "KIND_AUTO" not in check(lab04.q1, RIGHT_CONFIG).message
    # still wrong elsewhere: the missing name does not hide another problem
    out = check(lab04.q1, RIGHT_CONFIG_3.replace("count: 2", "count: 1"))
    assert out.status is Status.INCORRECT and "count: 2" in out.message
    out = check(lab04.q1, RIGHT_CONFIG_3.replace("count: 2 }", "count: 2 kind: KIND_GPU }"))
    assert out.status is Status.INCORRECT and "KIND_GPU" in out.message


def test_q1_schema_error_names_the_field():
    message = check(lab04.q1, RIGHT_CONFIG.replace("max_batch_size", "max_batch")).message
    assert 'no field named "max_batch"' in message
    assert "str" in check(lab04.q1, 42).message


def test_q5_messages():
    assert "seconds" in check(lab04.q5, _MS / 1e3).message
    assert "microseconds" in check(lab04.q5, _MS * 1e3).message
    assert "not a time" in check(lab04.q5, lab04.Q5_THROUGHPUT_INFER_S / lab04.Q5_CONCURRENCY).message
    assert "multiply by the concurrency" in check(lab04.q5, _MS / 16).message
    message = check(lab04.q5, 20.0).message
    assert "too high" in message and "6.7" not in message


def test_q7_messages_and_data():
    assert "over the 8.0 ms target" in check(lab04.q7, 500).message
    assert "longer delay" in check(lab04.q7, 100).message
    assert "was not measured" in check(lab04.q7, 300).message
    assert "whole number" in check(lab04.q7, 2.5).message
    tputs = [r["throughput_infer_s"] for _, r in sorted(lab04.Q7_MEASURED.items())]
    p95s = [r["p95_ms"] for _, r in sorted(lab04.Q7_MEASURED.items())]
    assert tputs == sorted(tputs) and p95s == sorted(p95s)  # the trade-off the question is about


def test_q7_grader_ignores_a_mutated_table():
    saved = copy.deepcopy(lab04.Q7_MEASURED)
    try:
        lab04.Q7_MEASURED[500]["p95_ms"] = 1.0
        assert check(lab04.q7, 200).correct
    finally:
        lab04.Q7_MEASURED.clear()
        lab04.Q7_MEASURED.update(saved)


def test_q8_stats_are_consistent():
    s = lab04.Q8_STATS["model_stats"][0]
    weighted = sum(b["batch_size"] * b["compute_infer"]["count"] for b in s["batch_stats"])
    assert weighted == s["inference_count"]
    assert sum(b["compute_infer"]["count"] for b in s["batch_stats"]) == s["execution_count"]
    st = s["inference_stats"]
    stages = ("queue", "compute_input", "compute_infer", "compute_output")
    assert sum(st[k]["ns"] for k in stages) <= st["success"]["ns"]


def test_every_exercise_has_hints_and_solution():
    exercises = exercises_of(lab04)
    assert len(exercises) >= 4
    names = sorted(k for k, v in vars(lab04).items() if isinstance(v, Exercise))
    assert names == [f"q{i}" for i in range(1, len(names) + 1)]
    for exercise in exercises:
        assert exercise.name.startswith("04.")
        assert 2 <= len(exercise.hints) <= 3 and all(h.strip() for h in exercise.hints)
        assert exercise.solution_text.strip()


_PREAMBLE = """
import json, time
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from lab_utils.serving.backend.model import to_numpy, to_tensor
from lab_utils.exercises.lab04 import *  # noqa
"""


@pytest.mark.parametrize("exercise", exercises_of(lab04), ids=lambda e: e.name)
def test_solution_code_passes_its_check(exercise, tmp_path, request):
    if isinstance(exercise, CodeExercise) and exercise is not lab04.q8:
        request.getfixturevalue("lab")  # these run against the server
    # a file, not exec: the execute check reads its function's source
    path = tmp_path / f"solution_{exercise.var}.py"
    path.write_text(_PREAMBLE + exercise.solution_text + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = check(exercise, getattr(module, exercise.var))
    assert out.correct, out.message


test_hints_step_from_first_to_last, test_solution_prints = hint_and_solution_tests(exercises_of(lab04))


def test_all_exports_exist():
    for name in lab04.__all__:
        assert hasattr(lab04, name), name


def test_a_malformed_triton_url_makes_the_server_checks_not_applicable_naming_it(unbound, monkeypatch):
    monkeypatch.setenv("TRITON_URL", "127.0.0.1:abc")
    why = server._no_server()
    assert why is not None and why.startswith("TRITON_URL='127.0.0.1:abc'") and "port 'abc'" in why


def test_after_the_lab_stopped_its_server_a_check_says_what_to_run_then_works(lab):
    # The lab's last cell stops the server; a check run after it must not say "not applicable on this tier" (the lab
    # runs here), but what to run, and that must work: the repository stays until the kernel exits. The module's
    # server, stopped and started again here (a server of the test's own would cost a start more).
    try:
        lab.stop()
        status, message = outcome(lab04.q2, deploy_model)
        assert status is Status.NOT_NOW, message
        assert "stopped" in message and "server.restart()" in message and "\n" not in message, message
    finally:
        lab.restart()
    status, message = outcome(lab04.q2, deploy_model)
    assert status is Status.CORRECT, message
    assert outcome(lab04.q3, grpc_infer)[0] is Status.CORRECT  # the lab's model loaded again for the request


def test_lab04_hints_keep_code_names_as_written():

    hint = server._hint("bad argument type for config", config._DEPLOY_HINTS)
    assert hint.startswith(" load_model's config= takes JSON text"), hint
    assert server._hint("unknown output 'y'", server._CLIENT_HINTS).startswith(" The model's output")
