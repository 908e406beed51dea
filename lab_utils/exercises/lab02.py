"""Lab 02 exercises: NCCL collectives and multi-GPU DDP training.

Bus-bandwidth factors follow the nccl-tests definitions (``shared/REFERENCE.md`` §2): busbw = algbw ×
factor, with algbw = S / t in GB/s (1 GB = 1e9 bytes). The questions need no GPU: the student's
function is called on fixed cases, the rest are numbers, a choice or a variable name.
"""

from __future__ import annotations

import math
import re
from typing import Any

from lab_utils.distributed.bandwidth import busbw_factor  # the one definition the lab's measurements use
from lab_utils.exercises.framework import Exercise, Wrong, close_to, number

__all__ = [
    "q1", "q2", "q3", "q4", "q5",
    "COLLECTIVES", "reference_busbw_factor",
    "Q2_PARAMS", "Q2_BYTES_PER_PARAM", "Q2_RANKS", "Q2_BUSBW_GBPS",
    "BUGGY_LOOP", "Q3_CHOICES",
    "Q4_RANK_ACCURACIES",
    "Q5_SCENARIO", "Q5_CHOICES",
]

# --- q1: busbw factor per collective ------------------------------------------------------------------

# The collectives as torch.distributed names them; nccl-tests' binaries carry the same names
# (all_reduce_perf, ..., alltoall_perf).
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")

_ALIASES = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter", "allgather": "all_gather",
            "alltoall": "all_to_all"}


def reference_busbw_factor(collective: str, n: int) -> float:
    """busbw / algbw for ``collective`` on ``n`` ranks, as nccl-tests defines it.

    all_reduce 2(n-1)/n (a reduce-scatter then an all-gather); reduce_scatter, all_gather and
    all_to_all (n-1)/n (one phase); broadcast and reduce 1. Names as in torch.distributed;
    "allreduce", "all-reduce" and the like are accepted too.
    """
    key = str(collective).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"n must be a whole number of ranks >= 1, got {n!r}")
    return busbw_factor(key, int(n))


# (collective, n, why). The most-used case first, so a function wrong everywhere hears about it.
_FACTOR_CASES: list[tuple[str, int, str]] = [
    ("all_reduce", 8, "all_reduce moves the data twice: a reduce-scatter, then an all-gather, each sending "
                      "(n-1)/n of the buffer per rank, so 2(n-1)/n"),
    ("all_reduce", 2, "2(n-1)/n with n = 2 is 1: on two ranks busbw equals algbw"),
    ("all_gather", 8, "all_gather is one phase: each rank receives the (n-1)/n of the gathered buffer it "
                      "does not hold"),
    ("reduce_scatter", 8, "reduce_scatter is one phase: each rank sends out the (n-1)/n of the buffer it "
                          "does not keep"),
    ("all_to_all", 4, "all_to_all is one phase: each rank keeps 1/n of its buffer and exchanges the other "
                      "(n-1)/n"),
    ("broadcast", 8, "broadcast is pipelined along a chain: every link carries the whole buffer once, so "
                     "busbw = algbw (factor 1) for any n"),
    ("reduce", 2, "reduce is a broadcast in reverse: every link carries the whole buffer once, factor 1"),
    ("all_reduce", 1, "with one rank nothing crosses a link: 2(n-1)/n = 0"),
    ("all_gather", 1, "with one rank there is nothing to gather: (n-1)/n = 0"),
    ("reduce_scatter", 2, "(n-1)/n with n = 2 is 0.5"),
]


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _grade_busbw_factor(fn: Any) -> None:
    if not callable(fn):
        raise Wrong(f"expected a function busbw_factor(collective, n) -> float, got a {type(fn).__name__}; "
                    "define it with `def busbw_factor(...)` and pass the function")
    for collective, n, why in _FACTOR_CASES:
        call = f"busbw_factor({collective!r}, {n})"
        expected = reference_busbw_factor(collective, n)
        try:
            result = fn(collective, n)
        except Exception as err:
            raise Wrong(f"{call} raised {type(err).__name__}: {err}. The collectives are "
                        f"{', '.join(COLLECTIVES)}.") from None
        if result is None or isinstance(result, str):
            raise Wrong(f"{call} returned {result!r}; return the factor as a number")
        got = number(result, f"{call}'s result")
        if _same(got, expected):
            continue
        head = f"{call} returned {got:g}, expected {expected:g}"
        one_phase, two_phase = (n - 1) / n, 2 * (n - 1) / n
        if collective == "all_reduce" and n > 1 and _same(got, one_phase):
            raise Wrong(f"{head}: that is (n-1)/n, one phase. {why}.")
        if collective in ("reduce_scatter", "all_gather", "all_to_all") and n > 1 and _same(got, two_phase):
            raise Wrong(f"{head}: only all_reduce has the 2 (two phases). {why}.")
        if n > 1 and got in (n - 1, 2 * (n - 1)):
            raise Wrong(f"{head}: the /n is missing; the factor is a fraction of the buffer. {why}.")
        if got.is_integer() and got == math.floor(expected) and not expected.is_integer():
            raise Wrong(f"{head}: a whole number where a fraction is due looks like integer division "
                        f"((n - 1) // n is 0 in Python; use /). {why}.")
        raise Wrong(f"{head}: {why}.")


q1 = Exercise(
    name="02.1 busbw factor per collective",
    var="busbw_factor",
    grade=_grade_busbw_factor,
    hints=[
        "busbw = algbw × factor: the factor turns 'bytes of the buffer per second' into 'bytes over the "
        "busiest link per second', so busbw can be held against the link speed for any n.",
        "In a ring of n ranks, a one-phase collective (reduce_scatter, all_gather, all_to_all) sends "
        "(n-1)/n of the buffer through each link; all_reduce is two such phases; broadcast and reduce "
        "pass the whole buffer along a chain once.",
        "all_reduce -> 2*(n-1)/n; reduce_scatter, all_gather, all_to_all -> (n-1)/n; broadcast, reduce -> "
        "1.0. Use /, not //.",
    ],
    solution_text=(
        "def busbw_factor(collective: str, n: int) -> float:\n"
        '    """busbw / algbw for a collective on n ranks (nccl-tests definitions)."""\n'
        '    if collective == "all_reduce":\n'
        "        return 2 * (n - 1) / n       # reduce-scatter, then all-gather\n"
        '    if collective in ("reduce_scatter", "all_gather", "all_to_all"):\n'
        "        return (n - 1) / n           # one phase\n"
        '    if collective in ("broadcast", "reduce"):\n'
        "        return 1.0                   # the whole buffer crosses each link once\n"
        '    raise ValueError(f"unknown collective {collective!r}")'
    ),
)

# --- q2: all-reduce time for a model's gradients ------------------------------------------------------

Q2_PARAMS = 350_000_000  # parameters, all with gradients
Q2_BYTES_PER_PARAM = 2  # bf16 gradients
Q2_RANKS = 8
Q2_BUSBW_GBPS = 340.0  # GB/s (1 GB = 1e9 bytes); REFERENCE.md §1: 338 GB/s measured on 2 H200s, NVLink 4

_Q2_BYTES = Q2_PARAMS * Q2_BYTES_PER_PARAM
_Q2_FACTOR = reference_busbw_factor("all_reduce", Q2_RANKS)  # 1.75
_Q2_MS = _Q2_BYTES * _Q2_FACTOR / (Q2_BUSBW_GBPS * 1e9) * 1e3  # 3.603 ms

_GIB = 2**30 / 1e9
q2 = Exercise(
    name="02.2 all-reduce time for the gradients",
    var="allreduce_ms",
    grade=close_to(
        _Q2_MS,
        rel=0.02,
        reveal=False,
        why=f"t = S × 2(n-1)/n / busbw, with S the gradient bytes on one rank, n = {Q2_RANKS}, busbw in "
            "bytes/s; answer in milliseconds.",
        slips={
            1 / _Q2_FACTOR: f"the all_reduce factor is missing: busbw = algbw × 2(n-1)/n, so the time is S × "
                            f"{_Q2_FACTOR:g} / busbw, not S / busbw.",
            0.5: "that factor is (n-1)/n, one phase; all_reduce is two (reduce-scatter, then all-gather): "
                 "2(n-1)/n.",
            2 / _Q2_FACTOR: f"that is 2·S / busbw: either the gradients counted as fp32 (4 bytes) and no "
                            f"all_reduce factor, or the factor 2 without (n-1)/n. Use S = params × "
                            f"{Q2_BYTES_PER_PARAM} bytes (bf16) and 2(n-1)/n = {_Q2_FACTOR:g}.",
            2.0: f"twice the time: the gradients are bf16, {Q2_BYTES_PER_PARAM} bytes each, not fp32 (4).",
            1e-3: "that looks like seconds; answer in milliseconds (× 1000).",
            1e3: "that looks like microseconds; answer in milliseconds (÷ 1000).",
            Q2_RANKS: "the /n is missing from 2(n-1)/n: the factor is a fraction of the buffer per link.",
            1 / _Q2_FACTOR**2: "you divided by the factor: busbw = algbw × factor, so algbw = busbw / factor "
                               "and t = S / algbw = S × factor / busbw.",
            1 / _GIB: "GB/s means 1e9 bytes/s here (nccl-tests' convention), not GiB/s (2^30): don't mix "
                      "GiB and GB in one formula.",
            _GIB: "GB/s means 1e9 bytes/s here (nccl-tests' convention), not GiB/s (2^30): don't mix GiB and "
                  "GB in one formula.",
        },
    ),
    hints=[
        "algbw = S / t and busbw = algbw × factor, so t = S × factor / busbw, with S the bytes of the "
        "gradient buffer on one rank.",
        f"S = Q2_PARAMS × Q2_BYTES_PER_PARAM bytes (bf16 is 2); the all_reduce factor for n = {Q2_RANKS} is "
        f"2·{Q2_RANKS - 1}/{Q2_RANKS}; GB/s means 1e9 bytes/s.",
        "allreduce_ms = Q2_PARAMS * Q2_BYTES_PER_PARAM * 2 * (Q2_RANKS - 1) / Q2_RANKS / (Q2_BUSBW_GBPS * 1e9) "
        "* 1e3",
    ],
    solution_text=(
        "S = Q2_PARAMS * Q2_BYTES_PER_PARAM                   # 7.0e8 bytes of bf16 gradients\n"
        "factor = 2 * (Q2_RANKS - 1) / Q2_RANKS               # 1.75: reduce-scatter + all-gather\n"
        "allreduce_ms = S * factor / (Q2_BUSBW_GBPS * 1e9) * 1e3   # ~3.60 ms per step, if not overlapped"
    ),
)

# --- q3: the one bug in a DDP loop --------------------------------------------------------------------

BUGGY_LOOP = '''\
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

def train(model, dataset, epochs):
    dist.init_process_group("nccl")              # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    model = DDP(model.cuda(rank), device_ids=[rank])
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        model.train()
        total = torch.zeros(2, device=rank)      # [sum of losses, samples] on this rank
        for x, y in loader:
            x, y = x.cuda(rank), y.cuda(rank)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()                      # DDP all-reduces the gradients here
            opt.step()
            total[0] += loss.detach() * len(y)
            total[1] += len(y)
        dist.all_reduce(total)                   # sums over ranks
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: mean loss {(total[0] / total[1]).item():.4f}")
    dist.destroy_process_group()
'''

Q3_CHOICES = ("set_epoch", "no_sync", "all_reduce the metric", "barrier", "zero_grad")

# A keyword that names each choice in a free-form answer ("sampler.set_epoch(epoch)", "zero_grad()").
_Q3_KEYS = {"set_epoch": "set_epoch", "no_sync": "no_sync", "all_reduce": "all_reduce the metric",
            "allreduce": "all_reduce the metric", "barrier": "barrier", "zero_grad": "zero_grad"}

_Q3_WHY_NOT = {
    "no_sync": "model.no_sync() skips the gradient all-reduce, for the micro-batches of gradient "
               "accumulation. This loop steps after every batch, so every backward must synchronize; with "
               "no_sync the replicas would drift apart.",
    "all_reduce the metric": "the metric is already reduced: dist.all_reduce(total) sums the losses and "
                             "the sample counts over the ranks before rank 0 prints their ratio.",
    "barrier": "no barrier is needed: the gradient all-reduce inside every backward() already keeps the "
               "ranks in step. A barrier is for, e.g., rank 0 writing a file the others then read.",
    "zero_grad": "opt.zero_grad(set_to_none=True) is there, at the top of every step.",
}


def _q3_choice(value: Any) -> str:
    if not isinstance(value, str):
        raise Wrong(f"answer with one of {list(Q3_CHOICES)}, as a string")
    text = re.sub(r"[\s-]+", "_", value.strip().lower())
    named = {choice for key, choice in _Q3_KEYS.items() if key in text}
    if len(named) > 1:
        raise Wrong(f"name one fix, not several ({', '.join(sorted(named))}): the loop has exactly one bug")
    if not named:
        raise Wrong(f"answer with one of {list(Q3_CHOICES)}")
    return named.pop()


def _grade_missing_fix(value: Any) -> None:
    choice = _q3_choice(value)
    if choice != "set_epoch":
        raise Wrong(_Q3_WHY_NOT[choice])


q3 = Exercise(
    name="02.3 the bug in a DDP loop",
    var="missing_fix",
    grade=_grade_missing_fix,
    hints=[
        "Each of Q3_CHOICES is a real DDP pitfall, but this loop has exactly one. Read it for what should "
        "change from one epoch to the next.",
        "DistributedSampler shuffles with a generator seeded by seed + epoch, and its epoch is whatever it "
        "was last told (0 unless told otherwise).",
        "Without a call at the start of each epoch, every epoch replays the epoch-0 permutation: each rank "
        "sees the same shard in the same order every epoch. Which choice tells the sampler the epoch?",
    ],
    solution_text=(
        'missing_fix = "set_epoch"\n'
        "# In train(), first thing in each epoch:\n"
        "#     for epoch in range(epochs):\n"
        "#         sampler.set_epoch(epoch)   # a new shuffle each epoch, the same one on every rank\n"
        "# Without it, DistributedSampler reuses the epoch-0 order, so each rank sees the same shard,\n"
        "# in the same order, every epoch."
    ),
)

# --- q4: a metric averaged the wrong way --------------------------------------------------------------

# Evaluation where each rank scores the shard files it was given: the shards differ in size (no
# padding, unlike DistributedSampler), so the per-rank accuracies must be weighted by their samples.
Q4_RANK_ACCURACIES = (
    {"rank": 0, "accuracy": 0.92, "samples": 5000},
    {"rank": 1, "accuracy": 0.85, "samples": 3000},
    {"rank": 2, "accuracy": 0.80, "samples": 2500},
    {"rank": 3, "accuracy": 0.70, "samples": 1500},
)

_Q4_ROWS = tuple((r["accuracy"], r["samples"]) for r in Q4_RANK_ACCURACIES)  # the grader's own copy
_Q4_CORRECT = sum(round(acc * n) for acc, n in _Q4_ROWS)  # 10200
_Q4_SAMPLES = sum(n for _, n in _Q4_ROWS)  # 12000
_Q4_GLOBAL = _Q4_CORRECT / _Q4_SAMPLES  # 0.85
_Q4_SLIPS = {
    sum(acc for acc, _ in _Q4_ROWS) / len(_Q4_ROWS):
        "that is the plain mean of the per-rank accuracies. The ranks scored different numbers of samples, "
        "so each accuracy must count by its samples: sum(correct) / sum(samples).",
    _Q4_ROWS[0][0]: "that is rank 0's accuracy only: its own shard, not the whole evaluation set. Combine "
                    "all ranks (what dist.all_reduce of the counts does).",
    sum(acc for acc, _ in _Q4_ROWS):
        "that is the sum of the accuracies (what dist.all_reduce with the default SUM of each rank's accuracy "
        "gives). Reduce the counts (correct, samples), then divide.",
    _Q4_CORRECT: "that is the number of correct predictions; divide it by the number of samples.",
    _Q4_GLOBAL * 100: "that is a percentage; answer as a fraction between 0 and 1.",
}


def _grade_global_accuracy(value: Any) -> None:
    got = number(value, "the global accuracy")
    if math.isclose(got, _Q4_GLOBAL, abs_tol=5e-4):
        return
    for slip, message in _Q4_SLIPS.items():
        if math.isclose(got, slip, rel_tol=5e-3):
            raise Wrong(message)
    side = "high" if got > _Q4_GLOBAL else "low"
    raise Wrong(f"not the accuracy over all samples (too {side}): count each rank's correct predictions "
                "(accuracy × samples), add them up and divide by all the samples.")


q4 = Exercise(
    name="02.4 global accuracy from per-rank accuracies",
    var="global_accuracy",
    grade=_grade_global_accuracy,
    hints=[
        "The global accuracy is correct predictions over all samples, on all ranks. The ranks scored "
        "different numbers of samples.",
        "Each rank's correct count is accuracy × samples. In a real run you would all_reduce the two "
        "counts (correct, samples) with SUM, never the accuracies themselves.",
        "global_accuracy = sum(r['accuracy'] * r['samples'] for r in Q4_RANK_ACCURACIES) / "
        "sum(r['samples'] for r in Q4_RANK_ACCURACIES)",
    ],
    solution_text=(
        "correct = sum(r['accuracy'] * r['samples'] for r in Q4_RANK_ACCURACIES)   # 10200\n"
        "samples = sum(r['samples'] for r in Q4_RANK_ACCURACIES)                  # 12000\n"
        "global_accuracy = correct / samples                                      # 0.85\n"
        "# In DDP: t = torch.tensor([correct, samples], device=...); dist.all_reduce(t); t[0] / t[1]\n"
        "# The plain mean of the accuracies (0.8175) weights a rank of 1500 samples like one of 5000."
    ),
)

# --- q5: the NCCL variable for a scenario -------------------------------------------------------------

# NCCL's own choice skips docker* and lo interfaces, then takes the first other one it finds; here that
# is the management network, which the two nodes cannot reach each other over.
Q5_SCENARIO = (
    "Two nodes, one GPU process per GPU, no InfiniBand. Each node has the interfaces lo, docker0, eth0 (a "
    "1 GbE management network; a firewall between the nodes blocks it) and eth1 (the 100 GbE data network "
    "the nodes reach each other over). init_process_group('nccl') hangs; NCCL_DEBUG=INFO shows "
    "'NET/Socket : Using [0]eth0:...'. Which variable makes NCCL use eth1?"
)

Q5_CHOICES = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG",
              "NCCL_P2P_DISABLE")

_Q5_WHY_NOT = {
    "NCCL_IB_HCA": "NCCL_IB_HCA picks which InfiniBand/RoCE adapters and ports NCCL uses (e.g. mlx5_0:1). "
                   "These nodes have none; the hang is about the socket interface NCCL bootstraps over.",
    "NCCL_ALGO": "NCCL_ALGO chooses the collective algorithm (Ring, Tree, NVLS, ...). The hang is at init, "
                 "before any collective runs, while the ranks try to reach each other.",
    "NCCL_PROTO": "NCCL_PROTO chooses the wire protocol of collectives (LL, LL128, Simple). The hang is at "
                  "init, before any collective runs, while the ranks try to reach each other.",
    "NCCL_DEBUG": "NCCL_DEBUG=INFO is how you found the problem: it logs what NCCL picked. It changes "
                  "nothing; another variable tells NCCL which interface to use.",
    "NCCL_P2P_DISABLE": "NCCL_P2P_DISABLE turns off direct GPU-to-GPU transfers (NVLink, PCIe) inside a "
                        "node. It has no say over the network interface between nodes.",
}

_Q5_ANSWER = re.compile(r"""^(?:export\s+)?(NCCL_[A-Z0-9_]+)\s*(?:=\s*(['"]?)([^'"\s]*)\2)?$""", re.IGNORECASE)


def _grade_nccl_var(value: Any) -> None:
    if not isinstance(value, str):
        raise Wrong(f"answer with one of {list(Q5_CHOICES)}, as a string (a value may follow: 'NAME=value')")
    match = _Q5_ANSWER.match(value.strip())
    if not match or match[1].upper() not in Q5_CHOICES:
        raise Wrong(f"answer with one of {list(Q5_CHOICES)}, optionally with a value: 'NAME=value'")
    name = match[1].upper()
    if name != "NCCL_SOCKET_IFNAME":
        raise Wrong(_Q5_WHY_NOT[name])
    setting = match[3] or ""
    if setting in ("", "eth1", "=eth1"):
        return
    if setting.startswith("^"):
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' only excludes: a list you give replaces "
                    "NCCL's default one, so docker0 and lo are no longer skipped and may be picked. Name "
                    "the interface to use: NCCL_SOCKET_IFNAME=eth1.")
    if setting.lstrip("=") in ("eth0", "docker0", "lo"):
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but {setting.lstrip('=')} is not the network the nodes "
                    "reach each other over: that is eth1.")
    if "eth1".startswith(setting) and setting:
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' is a prefix: it matches eth0 too, which "
                    "NCCL finds first. Name the interface: eth1 (or '=eth1', an exact match).")
    raise Wrong(f"NCCL_SOCKET_IFNAME is right, but no interface '{setting}' is in the scenario; the data "
                "network is eth1.")


q5 = Exercise(
    name="02.5 NCCL variable for a hang at init",
    var="nccl_env_var",
    grade=_grade_nccl_var,
    hints=[
        "The hang is at init, before any collective: the ranks cannot reach each other. Algorithms and "
        "protocols do not run yet.",
        "NCCL_DEBUG=INFO shows which network interface NCCL chose for its sockets; the variable you need "
        "overrides that choice.",
        "NCCL_SOCKET_IFNAME takes interface names or prefixes ('^' excludes, '=' means an exact name).",
    ],
    solution_text=(
        'nccl_env_var = "NCCL_SOCKET_IFNAME=eth1"\n'
        "# Set on every node before init (export NCCL_SOCKET_IFNAME=eth1, or in the launcher's env).\n"
        "# The gloo backend's twin is GLOO_SOCKET_IFNAME."
    ),
)
