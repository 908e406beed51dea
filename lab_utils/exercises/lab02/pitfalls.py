"""Lab 02's questions on running NCCL and DDP: 02.4 the NCCL variable for a hang at init, 02.5 the one bug in a DDP
training loop."""

from __future__ import annotations

import re
from typing import Any

from lab_utils.exercises.framework import Exercise, Wrong, choice

# --- q4: the NCCL variable for a scenario -------------------------------------------------------------

# NCCL's own choice skips docker* and lo interfaces, then takes the first other one it finds; here that
# is the management network, which the two nodes cannot reach each other over.
NCCL_SCENARIO = (
    "Two nodes, one GPU process per GPU, no InfiniBand. Each node has the interfaces lo, docker0, eth0 (a "
    "1 GbE management network; a firewall between the nodes blocks it) and eth1 (the 100 GbE data network "
    "the nodes reach each other over). init_process_group('nccl') hangs; NCCL_DEBUG=INFO shows "
    "'NET/Socket : Using [0]eth0:...'. Which variable makes NCCL use eth1?"
)

NCCL_CHOICES = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG",
              "NCCL_P2P_DISABLE")

_NCCL_WHY_NOT = {
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

_NCCL_ANSWER = re.compile(r"""^(?:export\s+)?(NCCL_[A-Z0-9_]+)\s*(?:=\s*(['"]?)([^'"\s]*)\2)?$""", re.IGNORECASE)


def _grade_nccl_var(value: Any) -> None:
    if not isinstance(value, str):
        raise Wrong(f"answer with one of {list(NCCL_CHOICES)}, as a string (a value may follow: 'NAME=value')")
    match = _NCCL_ANSWER.match(value.strip())
    if not match or match[1].upper() not in NCCL_CHOICES:
        raise Wrong(f"answer with one of {list(NCCL_CHOICES)}, optionally with a value: 'NAME=value'")
    name = match[1].upper()
    if name != "NCCL_SOCKET_IFNAME":
        raise Wrong(_NCCL_WHY_NOT[name])
    setting = match[3] or ""
    if setting in ("", "=eth1"):
        return
    picked = _socket_ifname_matches(setting)
    if picked == ["eth1"]:
        return
    exclude = setting.startswith("^")
    if "eth1" not in picked:
        if exclude:
            raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' excludes eth1 ('^' means all but these), "
                        "the network the nodes reach each other over. Name it: NCCL_SOCKET_IFNAME=eth1.")
        if setting.lstrip("=") in ("eth0", "docker0", "lo"):
            raise Wrong(f"NCCL_SOCKET_IFNAME is right, but {setting.lstrip('=')} is not the network the nodes "
                        "reach each other over: that is eth1.")
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but no interface '{setting}' is in the scenario; the data "
                    "network is eth1.")
    others = ", ".join(i for i in picked if i != "eth1")
    if exclude:
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' still allows {others}: '^' excludes only the "
                    "prefixes listed, and a list you give replaces NCCL's default one, so docker0 and lo are no "
                    f"longer skipped unless you list them. NCCL takes the first allowed interface ({picked[0]}). "
                    "Exclude every other interface, or name the one to use: NCCL_SOCKET_IFNAME=eth1.")
    if "eth1".startswith(setting.split(",")[0]) and "," not in setting:
        raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' is a prefix: it matches eth0 too, which "
                    "NCCL finds first. Name the interface: eth1 (or '=eth1', an exact match).")
    raise Wrong(f"NCCL_SOCKET_IFNAME is right, but '{setting}' also allows {others}, which NCCL may pick. Name "
                "only the interface to use: eth1.")


# The scenario's interfaces in the order the system lists them (NCCL takes the first one its list allows).
_INTERFACES = ("lo", "docker0", "eth0", "eth1")


def _socket_ifname_matches(setting: str) -> list[str]:
    """The scenario's interfaces that NCCL_SOCKET_IFNAME=``setting`` allows, in order: comma-separated prefixes,
    '=' for an exact name, a leading '^' for "all but these" (NCCL's own rules)."""
    exclude = setting.startswith("^")
    text = setting[1:] if exclude else setting
    exact = text.startswith("=")
    names = [n.strip() for n in (text[1:] if exact else text).split(",") if n.strip()]
    return [i for i in _INTERFACES if any(i == n if exact else i.startswith(n) for n in names) != exclude]


q4 = Exercise(
    name="02.4 NCCL variable for a hang at init", var="nccl_env_var", grade=_grade_nccl_var,
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
# --- q5: the one bug in a DDP loop --------------------------------------------------------------------

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

BUG_CHOICES = ("set_epoch", "no_sync", "all_reduce the metric", "barrier", "zero_grad")

# Whole answers that name a choice by its call (a choice, never a word found inside a sentence: "set_epoch is
# fine" must not count as set_epoch).
_BUG_SYNONYMS = {
    "set_epoch": ["sampler.set_epoch(epoch)", "sampler.set_epoch", "set_epoch(epoch)", "set_epoch()"],
    "no_sync": ["model.no_sync()", "no_sync()"],
    "all_reduce the metric": ["all_reduce", "allreduce", "dist.all_reduce(total)", "all_reduce(total)"],
    "barrier": ["dist.barrier()", "barrier()"],
    "zero_grad": ["opt.zero_grad()", "zero_grad()", "opt.zero_grad(set_to_none=True)"],
}

_BUG_WHY_NOT = {
    "no_sync": "model.no_sync() skips the gradient all-reduce, for the micro-batches of gradient "
               "accumulation. This loop steps after every batch, so every backward must synchronize; with "
               "no_sync the replicas would drift apart.",
    "all_reduce the metric": "the metric is already reduced: dist.all_reduce(total) sums the losses and "
                             "the sample counts over the ranks before rank 0 prints their ratio.",
    "barrier": "no barrier is needed: the gradient all-reduce inside every backward() already keeps the "
               "ranks in step. A barrier is for, e.g., rank 0 writing a file the others then read.",
    "zero_grad": "opt.zero_grad(set_to_none=True) is there, at the top of every step.",
}


def _grade_missing_fix(value: Any) -> None:
    picked = choice(value, BUG_CHOICES, _BUG_SYNONYMS)
    if picked is None:
        several = isinstance(value, str) and sum(c.split()[0] in value for c in BUG_CHOICES) > 1
        why = "name one fix, not several: the loop has exactly one bug. " if several else ""
        raise Wrong(f"{why}Answer with exactly one of {list(BUG_CHOICES)}: the choice itself, not a sentence")
    if picked != "set_epoch":
        raise Wrong(_BUG_WHY_NOT[picked])


q5 = Exercise(
    name="02.5 the bug in a DDP loop", var="missing_fix", grade=_grade_missing_fix,
    hints=[
        "Each of BUG_CHOICES is a real DDP pitfall, but this loop has exactly one. Read it for what should "
        "change from one epoch to the next.",
        "DistributedSampler shuffles with a generator seeded by seed + epoch, and its epoch is whatever it "
        "was last told (0 unless told otherwise).",
        "Without a call at the start of each epoch, every epoch replays the epoch-0 permutation: each rank "
        "sees the same shard in the same order every epoch. Which choice tells the sampler the epoch? Answer with "
        "that element of BUG_CHOICES, as it is written there.",
    ],
    solution_text=(
        'missing_fix = "set_epoch"   # one of BUG_CHOICES\n'
        "# In train(), first thing in each epoch:\n"
        "#     for epoch in range(epochs):\n"
        "#         sampler.set_epoch(epoch)   # a new shuffle each epoch, the same one on every rank\n"
        "# Without it, DistributedSampler reuses the epoch-0 order, so each rank sees the same shard,\n"
        "# in the same order, every epoch."
    ),
)

