"""Lab 02 exercises: NCCL collectives and multi-GPU DDP training; the rank exercises run in real ranks
(``grading_ranks``). Sizes in bytes, bandwidths in GB/s (1e9 bytes/s).

One module per exercise or pair, each with its references: ``factors`` (02.1 the busbw factors, 02.3 the gradients'
all-reduce time), ``bench`` (02.2 the all-reduce benchmark worker), ``pitfalls`` (02.4 the NCCL variable, 02.5 the
bug in a DDP loop), ``training`` (02.6 DDP training), ``metric`` (02.7 a metric over ranks); ``in_ranks`` runs a
student's function in the ranks and says how it failed.

Design notes: docs/internals.md#lab_utilsexerciseslab02
"""

from lab_utils.exercises.lab02.bench import BENCH_ITERS, BENCH_WARMUP, bench_sizes, q2, reference_allreduce_bench
from lab_utils.exercises.lab02.factors import (
    COLLECTIVES,
    GRAD_BUSBW_GBPS,
    GRAD_BYTES_PER_PARAM,
    GRAD_PARAMS,
    GRAD_RANKS,
    q1,
    q3,
    reference_busbw_factor,
)
from lab_utils.exercises.lab02.in_ranks import grading_ranks
from lab_utils.exercises.lab02.metric import metric_shards, q7, reference_global_accuracy
from lab_utils.exercises.lab02.pitfalls import BUG_CHOICES, BUGGY_LOOP, NCCL_CHOICES, NCCL_SCENARIO, q4, q5
from lab_utils.exercises.lab02.training import DDP_CHECK, make_digits_model, q6, reference_ddp_run, reference_train_ddp

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7",
    "COLLECTIVES", "reference_busbw_factor",
    "grading_ranks", "BENCH_ITERS", "BENCH_WARMUP", "bench_sizes", "reference_allreduce_bench",
    "GRAD_PARAMS", "GRAD_BYTES_PER_PARAM", "GRAD_RANKS", "GRAD_BUSBW_GBPS",
    "NCCL_SCENARIO", "NCCL_CHOICES",
    "BUGGY_LOOP", "BUG_CHOICES",
    "DDP_CHECK", "reference_train_ddp", "make_digits_model", "reference_ddp_run",
    "metric_shards", "reference_global_accuracy",
]
