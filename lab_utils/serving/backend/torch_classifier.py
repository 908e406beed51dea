"""Works around: the pytriton wheel's Triton has the python backend only and the course's ONNX Runtime is CPU-only,
so torch runs lab 07's classifier on a GPU inside a python model. Goes when: the course serves from the NGC
tritonserver image, whose onnxruntime backend runs ``model.onnx`` on the GPU.

Lab 07's classifier on the python backend, run by torch: on the instance's GPU for a ``KIND_GPU`` instance
(``cuda:<model_instance_device_id>``), on the CPU for a ``KIND_CPU`` one (what CI tests without a GPU). Copied as
``<repo>/<model>/<version>/model.py`` beside ``nvlab_triton_model.py``; it imports nothing from ``lab_utils`` and
loads ``model.pt`` (TorchScript). ``input`` FP32 [B, C, H, W] -> ``logits`` FP32 [B, classes]. ``config.pbtxt``
parameters: ``engine`` = ``torch``; ``precision`` = ``fp32`` (default) | ``fp16`` | ``bf16`` (autocast; with CUDA
graphs the weights are cast); ``threads`` (torch's intra-op threads on the CPU, default 1); ``channels_last``
(``1``: NHWC activations); ``cuda_graphs`` (``1``, GPU only: one graph per batch size 1, 2, 4 ... max, replayed).

Design notes: docs/internals.md#lab_utilsservingbackendtorch_classifierpy
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
from nvlab_triton_model import NUMPY2, ServiceTime, instance_args, quiet_capsule_rename
from nvlab_triton_model import TritonPythonModel as CourseModel

TORCH_FILE = "model.pt"
PRECISIONS = ("fp32", "fp16", "bf16")


def graph_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a CUDA graph: 1, 2, 4 ... and ``max_batch`` (a batch runs in the next size up)."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return sorted({*sizes, max(1, max_batch)})


class TorchClassifier:
    """Runs ``model.pt`` on ``device`` over a batch ``x`` [N, C, H, W] float32 -> logits [N, classes] float32.
    ``graphs``: (C, H, W, max batch) to capture CUDA graphs for (GPU only), else None (eager)."""

    def __init__(self, path: str | Path, device: str = "cpu", precision: str = "fp32", threads: int = 1,
                 channels_last: bool = False, graphs: tuple[int, int, int, int] | None = None):
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
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        if channels_last:
            self.module = self.module.to(memory_format=torch.channels_last)
        self.graphs: dict[int, tuple[Any, Any, Any]] = {}
        self.cast_weights = False  # True once captured: the weights are in ``dtype``, no autocast in a graph
        if graphs is not None:
            if self.device_type != "cuda":
                raise ValueError(f"cuda_graphs=1 on {device}: CUDA graphs need a GPU instance (KIND_GPU); remove "
                                 "the parameter for a CPU instance")
            self._capture(graphs)

    def _forward(self, t: Any) -> Any:
        """The module on a device tensor, in this classifier's precision and memory format."""
        torch = self.torch
        t = t.contiguous(memory_format=self.memory_format)
        if self.cast_weights:
            return self.module(t.to(self.dtype))
        if not self.dtype:
            return self.module(t)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(t)

    def _capture(self, graphs: tuple[int, int, int, int]) -> None:
        """One CUDA graph per ``graph_sizes`` batch, the largest first (the smaller ones share its memory pool);
        each warmed up on a side stream before its capture, as torch.cuda.graphs requires."""
        torch = self.torch
        *shape, max_batch = graphs
        if self.dtype:
            self.module, self.cast_weights = self.module.to(self.dtype), True
        pool = None
        with torch.inference_mode(), torch.jit.optimized_execution(False):  # no re-profiling inside a capture
            for b in sorted(graph_sizes(max_batch), reverse=True):
                x = torch.zeros((b, *shape), device=self.device)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        self._forward(x)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    y = self._forward(x)
                pool = g.pool()
                self.graphs[b] = (g, x, y)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        torch = self.torch
        if self.graphs:
            return self._replay(x)
        with torch.inference_mode():
            t = torch.tensor(x, device=self.device)  # a copy: inputs that cross the stub may be read-only
            return self._forward(t).float().cpu().numpy()  # .cpu() waits for the GPU: finished data leaves

    def _replay(self, x: np.ndarray) -> np.ndarray:
        """``x`` through the graph of the next batch size up (larger batches in slices of the largest)."""
        torch = self.torch
        top = max(self.graphs)
        if len(x) > top:
            return np.concatenate([self._replay(x[i:i + top]) for i in range(0, len(x), top)])
        b = min(s for s in self.graphs if s >= len(x))
        g, static_x, static_y = self.graphs[b]
        with torch.inference_mode(), warnings.catch_warnings():  # the static tensors are inference tensors
            warnings.simplefilter("ignore", UserWarning)  # inputs that cross the stub may be read-only: only read
            static_x[:len(x)].copy_(torch.from_numpy(x))
            g.replay()
            return static_y[:len(x)].float().cpu().numpy()


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


class TritonPythonModel(CourseModel):
    """The course model's ``execute`` (one run per dynamic batch) over a ``TorchClassifier``."""

    def initialize(self, args: dict[str, str]) -> None:
        cfg, params, device, version_dir = instance_args(args)
        engine = params.get("engine", "torch") or "torch"
        if engine != "torch":
            raise ValueError(f"model {cfg['name']!r}: engine {engine!r} in a torch classifier's config.pbtxt: "
                             "this model.py runs engine 'torch' only (onnx_classifier runs 'onnxruntime')")
        path = version_dir / TORCH_FILE
        if not path.is_file():
            raise FileNotFoundError(f"model {cfg['name']!r} version {args['model_version']}: no {path}: export it "
                                    "beside model.onnx (lab_utils.serving.ensemble_models.export_torchscript)")
        dims = [int(d) for d in cfg["input"][0].get("dims", [])]
        graphs = None
        if params.get("cuda_graphs", "0") == "1":
            if len(dims) != 3:
                raise ValueError(f"model {cfg['name']!r}: cuda_graphs=1 needs an input of dims [C, H, W], not {dims}")
            graphs = (*dims, max(1, int(cfg.get("max_batch_size", 1))))
        self.runner = TorchClassifier(path, device, params.get("precision", "fp32") or "fp32",
                                      int(params.get("threads", "1") or 1), params.get("channels_last") == "1", graphs)
        self.model, self.service = self.runner, ServiceTime(params, device)
        self.input_name, self.output_name = cfg["input"][0]["name"], cfg["output"][0]["name"]
        if NUMPY2:
            quiet_capsule_rename()
        # Warm up here, not on the first request (the first run allocates; on a GPU cuDNN picks its kernels per
        # shape, so the largest batch too). Its output is the load-time check of the version's shape.
        batches = [1] + ([int(cfg.get("max_batch_size", 0))] if device != "cpu" and cfg.get("max_batch_size") else [])
        for batch in batches:
            y = self.runner(np.zeros([batch, *dims], np.float32))
            problems = shape_problems(y, batch, cfg)
            if problems:  # raised in initialize: Triton refuses this version and keeps serving the loaded ones
                raise ValueError(f"model {cfg['name']!r} version {args['model_version']}: {TORCH_FILE} does not "
                                 f"match config.pbtxt: {'; '.join(problems)}. Re-export the model, or fix "
                                 "config.pbtxt")
