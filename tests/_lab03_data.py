"""Lab 03 test data built once per test session: the digits CNN (lab 03's quick-mode model, shared with the
exercise checks) and its ONNX export."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from lab_utils.procs import owned_tempdir


@functools.lru_cache(maxsize=1)
def digits_onnx() -> tuple[Any, Path, dict[str, Any]]:
    """(model, onnx path, facts): the digits CNN trained 3 epochs, exported with a dynamic batch (a few seconds)."""
    import torch

    from lab_utils import models
    from lab_utils.inference import model_zoo, onnx

    folder = owned_tempdir("lab03-tests")
    model, facts = model_zoo.trained_digits(3)
    path = onnx.export_onnx(model, folder / "digits.onnx", torch.from_numpy(models.digits_arrays()["x_test"][:2]))
    return model, path, facts
