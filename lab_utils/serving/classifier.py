"""Lab 07's classifier: DigitsCNN trained here, exported (ONNX with a dynamic batch, TorchScript for the torch
engine) into a model's version folder with its python-backend files, and the versions a repository serves.

Design notes: docs/internals.md#lab_utilsservingensemblepy
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab_utils.serving import backend as backend_files
from lab_utils.serving import repository as triton_repo
from lab_utils.serving.ensemble_config import (
    CLASSIFIER,
    CLASSIFIER_ENGINES,
    DIGITS_SIZE,
    ONNX_INPUT,
    ONNX_OUTPUT,
    TORCH_FILE,
)

_PY_MODEL = "nvlab_triton_model.py"  # the course's model file, beside each python model's model.py
_DRIFT_MODULE = "nvlab_drift.py"  # backend/drift_stats.py beside the preprocessing model


def export_classifier(model: Any, version_dir: str | Path, image_size: int = DIGITS_SIZE, channels: int = 1,
                      torchscript: bool = False, onnx: bool = True) -> Path:
    """``model.onnx`` in ``version_dir`` with a dynamic batch (the course's ``export_onnx``); returns its path.
    ``torchscript``: ``model.pt`` beside it as well (``export_torchscript``: what the torch engine loads);
    ``onnx`` False: ``model.pt`` only (the torch engine reads nothing else), and its path is returned; then
    ``model`` may be an exported ``model.pt`` (a path), copied as it is (one export for several variants)."""
    if isinstance(model, (str, Path)):
        if onnx:
            raise ValueError(f"export_classifier({model!r}): a saved model.pt is copied only with onnx=False")
        Path(version_dir).mkdir(parents=True, exist_ok=True)
        return Path(shutil.copyfile(model, Path(version_dir) / TORCH_FILE))
    import torch

    from lab_utils.inference.onnx import export_onnx  # lazy: pulls torch and onnx

    if not onnx:
        return export_torchscript(model, version_dir, image_size, channels)
    example = torch.zeros(2, channels, image_size, image_size)
    path = export_onnx(model, Path(version_dir) / "model.onnx", example, input_name=ONNX_INPUT,
                       output_name=ONNX_OUTPUT)
    if torchscript:
        export_torchscript(model, version_dir, image_size, channels)
    return path


def export_torchscript(model: Any, version_dir: str | Path, image_size: int = DIGITS_SIZE,
                       channels: int = 1) -> Path:
    """``model.pt`` in ``version_dir``: the model traced on the CPU (``torch.jit.trace``, FP32, eval mode) and saved
    with ``torch.jit.save``, so the python backend loads it without the model's Python class and on any device
    (``map_location``). Checked here at another batch size than the trace's: a trace that froze the batch fails
    now, not in the server. Returns its path."""
    import copy
    import warnings

    import torch

    path = Path(version_dir) / TORCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # a CPU copy: the caller's model stays where it is (and in its mode)
    cpu = copy.deepcopy(model).to("cpu").float().eval()
    example = torch.zeros(2, channels, image_size, image_size)
    check = torch.randn(3, channels, image_size, image_size, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():  # torch >= 2.9 flags TorchScript as deprecated; it still traces and loads
        warnings.simplefilter("ignore", DeprecationWarning)
        with torch.no_grad():
            # check_trace off: torch's check re-traces and reruns the model (most of a ResNet-50's tracing time, 15 of
            # 19 s on 2 cores); the batch-3 comparison with the model below checks what matters, and more
            traced = torch.jit.trace(cpu, example, check_trace=False)
            torch.jit.save(traced, str(path))
            want = cpu(check)
            got = torch.jit.load(str(path), map_location="cpu")(check)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        path.unlink()
        raise RuntimeError(f"{path}: the traced model answers a batch of 3 differently from the model (shape "
                           f"{tuple(got.shape)} vs {tuple(want.shape)}): its forward depends on the batch size or on "
                           "Python control flow that tracing cannot record; make it shape-generic")
    return path


def broken_classifier(classes: int = 9, seed: int = 0) -> Any:
    """A DigitsCNN whose head has ``classes`` outputs (not 10): the wrong output shape a server must refuse."""
    import torch

    from lab_utils.models import make_digits_cnn  # lazy: pulls torch

    torch.manual_seed(seed)
    model = make_digits_cnn()
    model.head[-1] = torch.nn.Linear(model.head[-1].in_features, classes)
    return model.eval()


def write_classifier_version(repo: str | Path, version: int, *, epochs: int = 4, seed: int | None = None,
                             name: str = CLASSIFIER, model: Any = None) -> dict[str, Any]:
    """Train (or take ``model``) and write ``<repo>/<name>/<version>/``: ``model.onnx`` and, for the python backend,
    ``model.py``. The config is left as it is (see ``set_served_versions``). Returns the training facts
    (``accuracy`` in-process on the held-out digits), with ``version`` and ``export_s``."""
    model_dir = Path(repo) / name
    backend, engine = _classifier_kind(model_dir)
    facts: dict[str, Any] = {}
    if model is None:
        from lab_utils.inference.model_zoo import trained_digits  # lazy: pulls torch; once per process (seconds)

        model, facts = trained_digits(epochs, version - 1 if seed is None else seed)
    vdir = model_dir / str(version)
    t0 = time.perf_counter()
    export_classifier(model, vdir, torchscript=engine == "torch")
    if backend == "python":
        _write_python_files(vdir, CLASSIFIER_ENGINES[engine])
    return {**facts, "version": version, "export_s": time.perf_counter() - t0}


def write_broken_version(repo: str | Path, version: int = 2, *, name: str = CLASSIFIER, classes: int = 9) -> Path:
    """Write a version whose ONNX file outputs ``classes`` logits where the config says 10: Triton refuses it at
    load (the onnxruntime backend's check, or ``onnx_classifier``'s / ``torch_classifier``'s on the python backend).
    Returns its folder."""
    write_classifier_version(repo, version, name=name, model=broken_classifier(classes))
    return Path(repo) / name / str(version)


def set_served_versions(repo: str | Path, versions: Sequence[int] | None, *, name: str = CLASSIFIER) -> Path:
    """Rewrite ``<name>/config.pbtxt`` to serve exactly ``versions`` (``version_policy { specific }``), or the latest
    one (None). The server reads it at the next ``load_model``. Returns the config's path."""
    model_dir = Path(repo) / name
    cfg = triton_repo.parse_config((model_dir / "config.pbtxt").read_text())  # the protobuf: values round-trip
    cfg.ClearField("version_policy")
    if versions:
        cfg.version_policy.specific.versions.extend(int(v) for v in versions)
    gpus = int(any(g.kind == g.KIND_GPU for g in cfg.instance_group))
    return triton_repo.write_config(model_dir, cfg, gpus=gpus)


def _classifier_kind(model_dir: Path) -> tuple[str, str]:
    """The classifier's (backend, engine): ``python`` or ``onnxruntime``, and the python backend's ``engine``
    parameter (``onnxruntime`` for Triton's onnxruntime backend)."""
    cfg_path = model_dir / "config.pbtxt"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} does not exist: build the repository first (build_service_repository)")
    cfg = triton_repo.parse_config(cfg_path.read_text())
    if cfg.backend != "python":
        return "onnxruntime", "onnxruntime"
    engine = cfg.parameters["engine"].string_value if "engine" in cfg.parameters else ""
    return "python", engine if engine in CLASSIFIER_ENGINES else "onnxruntime"


def _write_python_files(version_dir: Path, model: str) -> None:
    """``model.py`` (the backend file ``model``) and the course's model file beside it, both compiled."""
    folder = Path(backend_files.__file__).parent
    triton_repo.write_model_py(version_dir, (folder / f"{model}.py").read_text())
    triton_repo.write_model_py(version_dir, (folder / "model.py").read_text(), name=_PY_MODEL)
    if model == "preprocess_png":  # its drift statistics (NumPy only)
        triton_repo.write_model_py(version_dir, (folder / "drift_stats.py").read_text(), name=_DRIFT_MODULE)

