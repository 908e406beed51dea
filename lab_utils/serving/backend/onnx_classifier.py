"""Works around: the pytriton wheel's Triton has the python backend only, no onnxruntime backend, so ONNX Runtime
runs lab 07's classifier inside a python model. Goes when: the course serves from the NGC tritonserver image, whose
onnxruntime backend serves ``model.onnx`` as it is (``classifier_config(backend="onnxruntime")``).

Lab 07's classifier on the python backend: the course's model (``model.py``: ONNX Runtime, batch-aware) plus
the check that Triton's own onnxruntime backend makes at load: the ONNX file's inputs and outputs must match
``config.pbtxt``. A version exported with the wrong output shape is refused at load, not at the first request.

Copied as ``<repo>/<model>/<version>/model.py``; the course's model file sits beside it as
``nvlab_triton_model.py``. Parameters as the course's model (give ``engine: onnxruntime``).
"""

from __future__ import annotations

import json
from typing import Any

from nvlab_triton_model import TritonPythonModel as CourseModel


def shape_problems(session: Any, cfg: dict[str, Any]) -> list[str]:
    """What differs between an ONNX Runtime session's tensors and the configuration's (batch dimension added
    when ``max_batch_size`` > 0); [] when they match."""
    batched = int(cfg.get("max_batch_size", 0)) > 0
    problems = []
    for kind, declared, actual in (("input", cfg["input"], session.get_inputs()),
                                   ("output", cfg["output"], session.get_outputs())):
        have = {t.name: t.shape for t in actual}
        for t in declared:
            dims = [int(d) for d in t.get("dims", [])]
            want = ([-1] if batched else []) + dims
            if t["name"] not in have:
                problems.append(f"{kind} {t['name']!r} is not in the ONNX file (it has {sorted(have)})")
                continue
            shape = [d if isinstance(d, int) and d >= 0 else -1 for d in have[t["name"]]]
            fits = len(shape) == len(want) and all(w == -1 or s in (w, -1) for s, w in zip(shape, want, strict=True))
            if not fits:
                problems.append(f"{kind} {t['name']!r}: the ONNX file has shape {shape}, config.pbtxt declares dims "
                                f"{dims}" + (" (plus the batch dimension)" if batched else ""))
    return problems


class TritonPythonModel(CourseModel):
    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        cfg = json.loads(args["model_config"])
        problems = shape_problems(self.runner.sess, cfg)
        if problems:  # raised in initialize: Triton refuses this version and keeps serving the loaded ones
            raise ValueError(f"model {cfg['name']!r} version {args['model_version']}: model.onnx does not match "
                             f"config.pbtxt: {'; '.join(problems)}. Re-export the model, or fix config.pbtxt")
