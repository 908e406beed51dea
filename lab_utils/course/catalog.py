"""The labs of the course: number, file stem, title, and what each needs for its full tier."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Lab:
    number: str  # "00", "01", "01b" (a lab added after 01 without renumbering the rest), "02", ...
    slug: str  # file stem after the number
    title: str
    needs: tuple[str, ...]  # components of the full tier besides a GPU

    @property
    def filename(self) -> str:
        return f"{self.number}_{self.slug}.ipynb"


LABS: tuple[Lab, ...] = (Lab("00", "environment", "Environment and driver", ("nvml",)),
                         Lab("01", "cuda_timing", "CUDA and cuBLAS timing", ("torch-cuda",)),
                         Lab("01b", "gpu_kernels", "GPU kernels in Triton", ("torch-cuda", "triton")),
                         Lab("02", "nccl_ddp", "NCCL and multi-GPU training", ("torch-cuda", "nccl", "2 GPUs")),
                         Lab("03", "tensorrt", "TensorRT optimization", ("torch-cuda", "tensorrt", "modelopt")),
                         Lab("04", "triton", "Triton serving", ("torch-cuda", "tritonserver")),
                         Lab("05", "monitoring", "Monitoring and operations", ("tritonserver", "prometheus")),
                         Lab("06", "profiling", "Profiling and diagnosing", ("torch-cuda", "ncu")),
                         Lab("07", "service", "Capstone: the image-classification service",
                             ("tritonserver", "nginx", "prometheus")),
                         Lab("08", "mlops", "The MLOps lifecycle", ("tritonserver", "nginx", "prometheus", "mlflow")),
                         Lab("09", "exam_review", "The stack map and exam review", ("torch-cuda",)))


# Every lab notebook's file name (solutions/, labs/, a run's folder): two digits, maybe a letter, "_", the slug.
NOTEBOOK_GLOB = "[0-9][0-9]*_*.ipynb"


def repo_root() -> Path:
    """The course checkout this package was installed from (editable install or the container's copy)."""
    return Path(__file__).resolve().parents[2]


def lab_by_number(number: str) -> Lab:
    """The lab numbered ``number`` ("1", "01", "01_cuda_timing", "1b" or "01b"); ValueError lists the valid ones."""
    key = str(number).split("_", 1)[0].removesuffix(".ipynb").lower()
    letter = key[-1:] if key[-1:].isalpha() else ""
    key = key.removesuffix(letter).zfill(2) + letter
    for lab in LABS:
        if lab.number == key:
            return lab
    valid = ", ".join(f"{lab.number} ({lab.slug})" for lab in LABS)
    raise ValueError(f"unknown lab {number!r}; valid labs: {valid}")
