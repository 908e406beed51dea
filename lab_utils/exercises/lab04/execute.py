"""04.6: the python backend's ``execute`` for a dynamic batch, deployed on the lab's server and driven by the load
generator."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import textwrap
from typing import Any

import numpy as np

from lab_utils.exercises.framework import CodeExercise, References, StudentLine, Wrong
from lab_utils.exercises.lab04.config import _PYTHON_MODEL
from lab_utils.exercises.lab04.server import _close, _lab, _no_server
from lab_utils.serving import client as triton_client
from lab_utils.serving import load as triton_load
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.backend import model as triton_model
from lab_utils.serving.backend.model import NUMPY2  # the wheel's stub runs this interpreter's NumPy

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
        # a count of rows that does not match says most about the split: shown before rows of another input
        example = max(wrong, key=lambda m: ("row(s) back" in m, wrong[m])).split("wrong answer: ", 1)[-1]
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
    vdir = lab.repo / EXECUTE_MODEL / "1"
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
