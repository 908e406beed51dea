"""The lab's python-backend model: an MLP served by Triton, run by ONNX Runtime on CPU or by torch on a GPU.

Copied as ``<repo>/<model>/<version>/model.py``, beside ``model.onnx`` and ``weights.npz``; it imports nothing
from ``lab_utils``. ``config.pbtxt`` parameters: ``engine`` = ``auto`` | ``onnxruntime`` | ``torch`` |
``numpy``; ``threads`` (ONNX Runtime's intra-op threads, default 1); an optional added service time, default 0:
``service_ms`` + ``service_per_item_ms`` x batch (ms of sleep), ``gpu_matmul_reps`` x batch matmuls of
``gpu_matmul_n``^2. ``execute`` runs a dynamic batch's requests as one batch; ``ExerciseModel`` serves lab 04's
exercise.

Design notes: docs/internals.md#lab_utilsservingbackendmodelpy
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ENGINES = ("auto", "onnxruntime", "torch", "numpy")
EXECUTE_LOG = "execute_log.txt"  # ExerciseModel: one line per execution, "<requests> <model runs>"


class MlpRunner:
    """Runs the exported MLP on a batch ``x`` of shape [N, in_features] (float32) -> [N, out_features]."""

    def __init__(self, version_dir: str | Path, engine: str = "auto", device: str = "cpu", threads: int = 1):
        version_dir = Path(version_dir)
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r}: use one of {ENGINES}")
        if engine == "auto":
            engine = "torch" if device.startswith("cuda") else "onnxruntime"
        self.engine, self.device = engine, device
        if engine == "onnxruntime":
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = max(1, int(threads))
            so.inter_op_num_threads = 1
            self.sess = ort.InferenceSession(str(version_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
            self.input_name = self.sess.get_inputs()[0].name
        else:  # the weights as stored (weight [out, in], as torch.nn.Linear), kept transposed: a layer is x @ w + b
            with np.load(version_dir / "weights.npz") as w:
                n = len([k for k in w.files if k.startswith("w")])
                self.arrays = [(w[f"w{i}"].T.copy(), w[f"b{i}"].copy()) for i in range(n)]  # [in, out], [out]
        if engine == "torch":
            import torch

            if device.startswith("cuda") and not torch.cuda.is_available():
                raise RuntimeError(f"engine torch on {device}, but torch sees no GPU (torch {torch.__version__})")
            if device == "cpu":
                torch.set_num_threads(max(1, int(threads)))
            self.layers = [(torch.from_numpy(w).to(device), torch.from_numpy(b).to(device)) for w, b in self.arrays]
            self.torch = torch

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.engine == "onnxruntime":
            return self.sess.run(None, {self.input_name: x})[0]
        if self.engine == "numpy":
            h = np.asarray(x, dtype=np.float32)
            for i, (w, b) in enumerate(self.arrays):
                h = h @ w + b
                if i < len(self.arrays) - 1:
                    h = np.maximum(h, 0)
            return h
        torch = self.torch
        with torch.inference_mode():
            h = torch.tensor(x, device=self.device)  # a copy: inputs that cross the stub may be read-only
            last = len(self.layers) - 1
            for i, (w, b) in enumerate(self.layers):
                h = torch.addmm(b, h, w)
                if i < last:
                    h = torch.relu_(h)
            return h.cpu().numpy()  # .cpu() waits for the GPU: the response leaves with finished data


# --- crossing the stub boundary --------------------------------------------------------------------------
# Triton 2.51's python backend was built against NumPy 1.x. With NumPy 2 in the stub's environment
# `Tensor.as_numpy()` returns zeros and `pb_utils.Tensor(name, ndarray)` an empty tensor, silently. DLPack
# crosses the boundary without NumPy's C API, so it is used whenever NumPy is 2 or newer.
NUMPY2 = int(np.__version__.split(".")[0]) >= 2  # lab 04's check reads it too


def to_numpy(tensor: Any) -> np.ndarray:
    """A request's input tensor as a NumPy array: ``Tensor.as_numpy()``, across the stub by DLPack under NumPy 2."""
    return np.from_dlpack(tensor) if NUMPY2 else tensor.as_numpy()


def to_tensor(name: str, array: np.ndarray) -> Any:
    """``pb_utils.Tensor(name, array)`` for a response, across the stub by DLPack under NumPy 2."""
    import triton_python_backend_utils as pb_utils

    array = np.ascontiguousarray(array)
    return pb_utils.Tensor.from_dlpack(name, array.__dlpack__()) if NUMPY2 else pb_utils.Tensor(name, array)


def instance_args(args: dict[str, str]) -> tuple[dict[str, Any], dict[str, str], str, Path]:
    """``initialize``'s ``args`` read: (the model's config, its string parameters, the instance's device, its version
    folder)."""
    cfg = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    gpu = args.get("model_instance_kind", "CPU") == "GPU"
    device = f"cuda:{int(args.get('model_instance_device_id', '0'))}" if gpu else "cpu"
    return cfg, params, device, Path(args["model_repository"]) / args["model_version"]


_CAPSULE_MSG = "PyCapsule_GetPointer called with incorrect name"


def quiet_capsule_rename() -> None:
    """Drop one harmless "unraisable" message per response from the server log: the stub renames a DLPack capsule
    ``used_dlpack`` (not ``used_dltensor``), so NumPy's destructor cannot read the tensor the stub already freed."""
    previous = sys.unraisablehook
    if getattr(previous, "_nvlab", False):
        return

    def hook(unraisable: Any) -> None:
        if _CAPSULE_MSG not in str(unraisable.exc_value):
            previous(unraisable)

    hook._nvlab = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class ServiceTime:
    """The optional added service time of one execution (see the module docstring); a no-op by default."""

    def __init__(self, params: dict[str, str], device: str = "cpu"):
        def num(key: str) -> float:
            return float(params.get(key, "0") or 0)

        self.base_s, self.per_item_s = num("service_ms") / 1000, num("service_per_item_ms") / 1000
        n, self.reps = int(num("gpu_matmul_n")), int(num("gpu_matmul_reps"))
        self.torch: Any = None
        if n > 0 and self.reps > 0 and device.startswith("cuda"):
            import torch

            gen = torch.Generator(device=device).manual_seed(0)
            self.a = torch.randn(n, n, device=device, generator=gen) / n**0.5  # random, not zeros: real power
            self.c = torch.empty_like(self.a)
            self.torch = torch

    def __call__(self, batch: int) -> None:
        if self.torch is not None:
            for _ in range(self.reps * batch):
                self.torch.mm(self.a, self.a, out=self.c)
            self.torch.cuda.synchronize()
        wait_s = self.base_s + self.per_item_s * batch
        if wait_s > 0:
            time.sleep(wait_s)


class TritonPythonModel:
    """What the python backend calls: ``initialize`` once per instance, ``execute`` per (dynamic) batch."""

    def initialize(self, args: dict[str, str]) -> None:
        cfg, params, device, version_dir = instance_args(args)
        self.runner = MlpRunner(version_dir, params.get("engine", "auto") or "auto", device,
                                int(params.get("threads", "1") or 1))
        self.model = self.runner  # what execute runs: [N, in_features] float32 -> [N, out_features]
        self.input_name, self.output_name = cfg["input"][0]["name"], cfg["output"][0]["name"]
        self.service = ServiceTime(params, device)
        if NUMPY2:
            quiet_capsule_rename()
        # Warm up here, not on the first request (the first run allocates): a model load may be slow, a
        # request should not.
        dims = [int(d) for d in cfg["input"][0].get("dims", []) if int(d) != -1]
        if dims:
            self.runner(np.zeros([1, *dims], np.float32))

    def execute(self, requests: list[Any]) -> list[Any]:
        """One call per (dynamic) batch: one run over every request's rows, one response per request, in order."""
        import triton_python_backend_utils as pb_utils

        xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, self.input_name)) for r in requests]  # each [n_i, F]
        rows = [len(x) for x in xs]
        y = self.model(np.concatenate(xs) if len(xs) > 1 else xs[0])  # one run for the whole batch: [sum n_i, O]
        self.service(sum(rows))
        responses, start = [], 0
        for n in rows:
            responses.append(pb_utils.InferenceResponse([to_tensor(self.output_name, y[start:start + n])]))
            start += n
        return responses


class CountingRunner:
    """``self.model`` of ``ExerciseModel``: the MLP, counting its runs."""

    def __init__(self, runner: Any):
        self.runner, self.calls = runner, 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        return self.runner(x)


class ExerciseModel(TritonPythonModel):
    """Serves lab 04's student-written ``execute`` (appended to this file by the check) and reports how it ran.

    ``checked_execute`` calls it, refuses what Triton would mishandle (no list, one response too few: Triton would
    leave the requests waiting) with a message that reaches the clients, and logs ``<requests> <model runs>``.
    """

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        self.model = CountingRunner(self.runner)
        self.log_path = Path(args["model_repository"]) / args["model_version"] / EXECUTE_LOG

    def checked_execute(self, requests: list[Any], execute: Any) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        before = self.model.calls
        responses = execute(self, requests)
        runs = self.model.calls - before
        with open(self.log_path, "a") as log:
            log.write(f"{len(requests)} {runs}\n")
        if not isinstance(responses, (list, tuple)):
            raise TypeError(f"execute returned {type(responses).__name__}, not a list: return one "
                            f"pb_utils.InferenceResponse per request, in the order of `requests`")
        if len(responses) != len(requests):
            raise ValueError(f"execute returned {len(responses)} responses for {len(requests)} requests: one "
                             "pb_utils.InferenceResponse per request, in the order of `requests`")
        for r in responses:
            if not isinstance(r, pb_utils.InferenceResponse):
                raise TypeError(f"execute returned a list holding a {type(r).__name__}: each item must be a "
                                "pb_utils.InferenceResponse([output tensors])")
        return list(responses)


def source() -> str:
    """This file's text: what goes into each version folder as ``model.py``."""
    return Path(__file__).read_text()
