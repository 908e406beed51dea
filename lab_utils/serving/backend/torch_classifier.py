"""Works around: the pytriton wheel's Triton has the python backend only and the course's ONNX Runtime is CPU-only,
so torch runs lab 07's classifier on a GPU inside a python model. Goes when: the course serves from the NGC
tritonserver image, whose onnxruntime backend runs ``model.onnx`` on the GPU.

Lab 07's classifier on the python backend, run by torch: on the instance's GPU for a ``KIND_GPU`` instance
(``cuda:<model_instance_device_id>``), on the CPU for a ``KIND_CPU`` one (what CI tests without a GPU). Copied as
``<repo>/<model>/<version>/model.py`` beside ``nvlab_triton_model.py``; it imports nothing from ``lab_utils`` and
loads ``model.pt`` (TorchScript). ``input`` FP32 [B, C, H, W] -> ``logits`` FP32 [B, classes]. ``config.pbtxt``
parameters: ``engine`` = ``torch``; ``precision`` = ``fp32`` (default) | ``fp16`` | ``bf16`` (autocast);
``threads`` (torch's intra-op threads on the CPU, default 1).

Design notes: docs/internals.md#lab_utilsservingbackendtorch_classifierpy
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from nvlab_triton_model import NUMPY2, quiet_capsule_rename, to_numpy, to_tensor

TORCH_FILE = "model.pt"
PRECISIONS = ("fp32", "fp16", "bf16")


class TorchClassifier:
    """Runs ``model.pt`` on ``device`` over a batch ``x`` [N, C, H, W] float32 -> logits [N, classes] float32."""

    def __init__(self, path: str | Path, device: str = "cpu", precision: str = "fp32", threads: int = 1):
        import torch

        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: use one of {PRECISIONS} (parameter 'precision' in "
                             "config.pbtxt)")
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise RuntimeError(f"engine torch on a GPU instance ({device}), but torch {torch.__version__} sees "
                                   "no GPU: install a CUDA build of torch where the server runs, or build the "
                                   "service with gpus=0 (ONNX Runtime on the CPU)")
            index = int(device.split(":")[1]) if ":" in device else 0
            if index >= torch.cuda.device_count():
                raise RuntimeError(f"engine torch on {device}, but torch sees {torch.cuda.device_count()} GPU(s): "
                                   "check CUDA_VISIBLE_DEVICES and the instance group's gpus")
            torch.cuda.set_device(index)  # kernels and allocations of this stub go to the instance's GPU
        else:
            torch.set_num_threads(max(1, int(threads)))
        with warnings.catch_warnings():  # torch >= 2.9 flags TorchScript as deprecated; it still loads and runs
            warnings.simplefilter("ignore", DeprecationWarning)
            self.module = torch.jit.load(str(path), map_location=device).eval()
        self.torch, self.device, self.precision = torch, device, precision
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        torch = self.torch
        cast = torch.autocast(self.device_type, dtype=self.dtype) if self.dtype else contextlib.nullcontext()
        with torch.inference_mode(), cast:
            t = torch.tensor(x, device=self.device)  # a copy: inputs that cross the stub may be read-only
            y = self.module(t)
            return y.float().cpu().numpy()  # .cpu() waits for the GPU: the response leaves with finished data


def shape_problems(y: np.ndarray, batch: int, cfg: dict[str, Any]) -> list[str]:
    """What differs between the logits of a ``batch``-row run and the configuration's output; [] when they match."""
    dims = [int(d) for d in cfg["output"][0].get("dims", [])]
    batched = int(cfg.get("max_batch_size", 0)) > 0
    want = ([batch] if batched else []) + dims
    if list(y.shape) == want:
        return []
    shape = ([-1] if batched else []) + list(y.shape[1 if batched else 0:])
    return [f"output {cfg['output'][0]['name']!r}: {TORCH_FILE} gives shape {shape}, config.pbtxt declares dims "
            f"{dims}" + (" (plus the batch dimension)" if batched else "")]


class TritonPythonModel:
    """What the python backend calls: ``initialize`` once per instance, ``execute`` per (dynamic) batch."""

    def initialize(self, args: dict[str, str]) -> None:
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
        engine = params.get("engine", "torch") or "torch"
        if engine != "torch":
            raise ValueError(f"model {cfg['name']!r}: engine {engine!r} in a torch classifier's config.pbtxt: "
                             "this model.py runs engine 'torch' only (onnx_classifier runs 'onnxruntime')")
        kind = args.get("model_instance_kind", "CPU")
        device = f"cuda:{int(args.get('model_instance_device_id', '0'))}" if kind == "GPU" else "cpu"
        version_dir = Path(args["model_repository"]) / args["model_version"]
        path = version_dir / TORCH_FILE
        if not path.is_file():
            raise FileNotFoundError(f"model {cfg['name']!r} version {args['model_version']}: no {path}: export it "
                                    "beside model.onnx (lab_utils.serving.ensemble.export_torchscript)")
        self.runner = TorchClassifier(path, device, params.get("precision", "fp32") or "fp32",
                                      int(params.get("threads", "1") or 1))
        self.input_name, self.output_name = cfg["input"][0]["name"], cfg["output"][0]["name"]
        if NUMPY2:
            quiet_capsule_rename()
        # Warm up here, not on the first request (the first run allocates; on a GPU cuDNN picks its kernels per
        # shape, so the largest batch too). Its output is the load-time check of the version's shape.
        dims = [int(d) for d in cfg["input"][0].get("dims", [])]
        batches = [1] + ([int(cfg.get("max_batch_size", 0))] if device != "cpu" and cfg.get("max_batch_size") else [])
        for batch in batches:
            y = self.runner(np.zeros([batch, *dims], np.float32))
            problems = shape_problems(y, batch, cfg)
            if problems:  # raised in initialize: Triton refuses this version and keeps serving the loaded ones
                raise ValueError(f"model {cfg['name']!r} version {args['model_version']}: {TORCH_FILE} does not "
                                 f"match config.pbtxt: {'; '.join(problems)}. Re-export the model, or fix "
                                 "config.pbtxt")

    def execute(self, requests: list[Any]) -> list[Any]:
        """One run over every request's rows (dynamic batching), one response per request, in order."""
        import triton_python_backend_utils as pb_utils

        xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, self.input_name)) for r in requests]
        rows = [len(x) for x in xs]
        y = self.runner(np.concatenate(xs) if len(xs) > 1 else xs[0])
        responses, start = [], 0
        for n in rows:
            responses.append(pb_utils.InferenceResponse([to_tensor(self.output_name, y[start:start + n])]))
            start += n
        return responses
