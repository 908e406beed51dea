"""The lifecycle map that closes lab 08: each stage, what the labs used for it, the NVIDIA tool at scale, the common
tool, and the lab where the student did it (the syllabus's lifecycle and MLOps sections)."""

from __future__ import annotations

import pandas as pd

COLUMNS = ("stage", "what the labs used", "NVIDIA at scale", "common tool", "lab")

LIFECYCLE = (
    ("data preparation", "scikit-learn's digits, a stratified split, a sha256 of the arrays",
     "RAPIDS (cuDF), DALI, NeMo Curator", "Spark, pandas", "02, 08"),
    ("training", "PyTorch DDP with AMP on NCCL (gloo on a CPU)", "PyTorch + CUDA/cuDNN/NCCL, NeMo, NGC containers",
     "TensorFlow, JAX", "02"),
    ("experiment tracking and versioning", "MLflow server: params, per-epoch metrics, ONNX artifact, data hash, "
     "git commit; registry with aliases and lineage", "NGC model registry, NeMo experiment manager",
     "MLflow, Weights & Biases", "08"),
    ("optimization", "ONNX export, TensorRT engines FP32/FP16/INT8/FP8 (ModelOpt + ONNX Runtime on a CPU)",
     "TensorRT, TensorRT-LLM, ModelOpt", "ONNX Runtime", "03"),
    ("deployment", "Triton: repository, dynamic batching, ensembles, versions; nginx in front",
     "Dynamo-Triton, NIM", "vLLM, KServe, BentoML", "04, 07"),
    ("release: canary and A/B", "nginx weights 10 -> 50 -> 100 % with guards read from Prometheus; user-id hash "
     "routing, z-test and bootstrap interval", "NIM on Kubernetes (NIM Operator), Run:ai",
     "Argo Rollouts, Flagger, KServe canary", "08"),
    ("monitoring and operations", "Triton and GPU metrics, Prometheus, PromQL, alert rules, a failure drill",
     "DCGM (dcgm-exporter), Run:ai", "Prometheus, Grafana", "05"),
    ("model-quality monitoring", "PSI and KS of inputs and confidence against the training reference, exported "
     "and alerted on", "Triton metrics (custom python-backend metrics), DCGM for the GPU side",
     "Evidently, Alibi Detect, WhyLabs", "08"),
    ("pipeline automation", "one explicit function: check data, train, evaluate, log, register, set challenger",
     "NeMo Framework launcher, Run:ai workloads", "Kubeflow Pipelines, Airflow", "08"),
    ("orchestration and scheduling", "owned processes on free ports; the course's compose stack",
     "Run:ai, Base Command, Slurm (with Pyxis/Enroot)", "Kubernetes, Slurm", "00, 02"))


def lifecycle_map() -> pd.DataFrame:
    """The table: one row per stage, columns ``COLUMNS``."""
    return pd.DataFrame(list(LIFECYCLE), columns=list(COLUMNS))
