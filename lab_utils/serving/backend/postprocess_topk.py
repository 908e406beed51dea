"""Lab 07's postprocessing model (python backend): logits in, the top-k labels (bytes) and scores out.

Copied as ``<repo>/<model>/<version>/model.py`` with the course's model file beside it as
``nvlab_triton_model.py`` (tensor helpers); imports nothing from ``lab_utils``.

Input ``LOGITS``: FP32 [classes]. Outputs ``LABELS``: ``TYPE_STRING`` [k] (UTF-8 bytes), ``SCORES``: FP32 [k]
(softmax probabilities, descending); k is the outputs' dims. Parameter ``labels``: the class names,
comma-separated, in the classifier's order. Batch-aware: one softmax and one top-k over every request's rows,
then split per request. BYTES outputs cross the stub through NumPy's 1.x C API (see ``preprocess_png``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from nvlab_triton_model import instance_args, to_numpy, to_tensor


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        cfg, p, _, _ = instance_args(args)
        self.labels = np.array([s.strip().encode() for s in p.get("labels", "").split(",")], dtype=object)
        self.input_name = cfg["input"][0]["name"]
        outs = {o["name"]: o for o in cfg["output"]}
        self.k = int(outs["LABELS"]["dims"][-1])
        classes = int(cfg["input"][0]["dims"][-1])
        if len(self.labels) != classes:
            raise ValueError(f"parameter labels has {len(self.labels)} names for {classes} classes (input "
                             f"{self.input_name} dims): give one name per class, comma-separated")
        if not 1 <= self.k <= classes:
            raise ValueError(f"LABELS dims [{self.k}]: k must be between 1 and the {classes} classes")

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        xs = [to_numpy(pb_utils.get_input_tensor_by_name(r, self.input_name)) for r in requests]  # each [n_i, C]
        logits = np.concatenate(xs).astype(np.float32)
        z = np.exp(logits - logits.max(axis=1, keepdims=True))  # stable softmax
        probs = z / z.sum(axis=1, keepdims=True)
        top = np.argsort(-probs, axis=1, kind="stable")[:, : self.k]  # [N, k], best first
        scores = np.take_along_axis(probs, top, axis=1).astype(np.float32)
        labels = self.labels[top]  # [N, k] object array of bytes
        responses, start = [], 0
        for x in xs:
            n = len(x)
            out_labels = pb_utils.Tensor("LABELS", labels[start:start + n])
            responses.append(pb_utils.InferenceResponse([out_labels, to_tensor("SCORES", scores[start:start + n])]))
            start += n
        return responses
