"""Reading NCCL's own account of a run: what an ``NCCL_DEBUG=INFO`` log says, with sentences explaining it.

``parse_nccl_log(text)`` takes the log as text (``collectives.capture_nccl_debug`` on two GPUs, or a saved capture such
as ``course.probe.capture("nccl-debug")``) and returns the transports, channels, rings and trees, NCCL's tuning model
and per-call choices, and the ``NCCL_*`` variables it read. Plain text in, plain values out: no torch, no GPU. Units are
in the names: ``_gbps`` GB/s (1e9 B/s), ``_us`` microseconds, ``_s`` seconds."""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from typing import Any

# NCCL's algorithm and protocol numbers (nccl.h / device.h), for logs that print numbers.
_ALGOS = ["TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"]
_PROTOS = ["LL", "LL128", "SIMPLE"]
# Search patterns of NCCL's topology graphs (graph/topo.h).
_PATTERNS = {1: "balanced tree", 2: "split tree", 3: "tree", 4: "ring", 5: "NVLS", 6: "CollNet direct"}
_PATH_TYPES = {"LOC": "same device", "NVL": "NVLink", "NVB": "NVLink through an intermediate GPU", "C2C": "C2C",
               "PIX": "one PCIe switch", "PXB": "several PCIe switches", "PXN": "NVLink then PCIe (PXN)",
               "PHB": "PCIe through the CPU's host bridge", "SYS": "across CPU sockets", "NET": "the network"}

# Formats seen in NCCL 2.2x INFO logs (2.28.9 on 2 × H200 over NVLink, and older issue reports).
_RE = {
    "version": re.compile(r"NCCL version (\d+\.\d+\.\d+\S*)"),
    "init": re.compile(r"\brank (\d+) nranks (\d+)\b", re.I),
    "nnodes": re.compile(r"\bnRanks (\d+) nNodes (\d+) localRanks (\d+)"),
    # P2P prints "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM", SHM "Channel 00 : 0[0] -> 1[1] via SHM/direct/direct",
    # the network "Channel 00/0 : 2[0] -> 0[0] [receive] via NET/IB/3/GDRDMA".
    "transport": re.compile(
        r"Channel (\d+)(?:/\d+)? : (\d+)\[(\w+)\] -> (\d+)\[(\w+)\]\s*(?:\[(send|receive)\]\s*)?via (\S+)"),
    "ring": re.compile(r"Channel (\d+)/(\d+) :((?:\s+\d+)+)\s*$"),
    "tree": re.compile(r"Trees\s+(\[\d+\].*)$"),
    "coll_channels": re.compile(
        r"(\d+) coll channels, (\d+) collnet channels, (\d+) nvls channels, (\d+) p2p channels"),
    "env": re.compile(r"(NCCL_\w+) set by environment to (.*?)\.?\s*$"),
    "net": re.compile(r"(?:Using network|Assigned NET plugin) (\w+)"),
    "net_ok": re.compile(r"Initialized NET plugin (\w+)|NET/(\w+) : Using \[\d"),
    "net_failed": re.compile(r"Failed to initialize NET plugin (\w+)|NET/(\w+) : No device found"),
    "choice": re.compile(
        r"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)(?:.*?channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\})?", re.I),
    "connected": re.compile(r"Connected all (rings|trees)"),
    "cuda_driver": re.compile(r"cudaDriverVersion (\d+)"),
    "nvls": re.compile(r"NVLS multicast support is (not )?available"),
    "system_bw": re.compile(r"System : maxBw ([\d.]+) totalBw ([\d.]+)"),
    "graph": re.compile(r"Pattern (\d+), crossNic \d+, nChannels (\d+), bw ([\d.]+)/([\d.]+), type (\w+)/(\w+)"),
    "init_time": re.compile(r"Init timings.*?total ([\d.]+)"),
    "table_algos": re.compile(r"NCCL INFO\s+Algorithm\s+\|(.*)$"),
    "table_protos": re.compile(r"NCCL INFO\s+Protocol\s+\|(.*)$"),
    "table_row": re.compile(r"NCCL INFO\s+(Broadcast|Reduce|AllGather|ReduceScatter|AllReduce)\s+\|(.*)$")}


def _name(value: str, table: list[str]) -> str:
    return table[int(value)] if value.isdigit() and int(value) < len(table) else value.upper()


def parse_nccl_log(text: str) -> dict[str, Any]:
    """What an NCCL_DEBUG=INFO log says, with a few sentences explaining it.

    Keys: version, n_ranks, n_nodes, cuda_driver, transports (Counter of channel connections by transport,
    e.g. 'P2P/CUMEM', 'SHM/direct/direct', 'NET/IB/0/GDRDMA'), transport_kinds ('P2P', 'SHM', 'NET'),
    n_channels, rings and trees (one entry per distinct line), coll_channels, p2p_channels, graphs (NCCL's
    topology search: pattern, n_channels, bw_gbps per channel, path type), system_bw_gbps (NCCL's own
    estimate of the GPU-to-GPU path), tuning (NCCL's model: collective, algorithm, protocol, latency_us,
    bw_gbps; non-zero entries), choices (per call: collective, bytes, algorithm, protocol, channels),
    network, net_plugins, net_unavailable, env (NCCL_* variables it read), nvls_available, connected,
    init_time_s, n_lines, explanations. Unknown lines are ignored; nothing here raises on odd input."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    if not isinstance(text, str):
        raise ValueError(f"parse_nccl_log(text=...): expected the log as a string, got {type(text).__name__}")
    out: dict[str, Any] = {"version": None, "n_ranks": None, "n_nodes": None, "cuda_driver": None,
                           "transports": Counter(), "transport_kinds": Counter(), "n_channels": None, "rings": [],
                           "trees": [], "coll_channels": None, "p2p_channels": None, "graphs": [],
                           "system_bw_gbps": None, "tuning": [], "choices": [], "network": None, "net_plugins": [],
                           "net_unavailable": [], "env": {}, "nvls_available": None, "connected": [],
                           "init_time_s": None, "n_lines": 0, "explanations": []}
    state: dict[str, Any] = {"ring_channels": set(), "link_channels": set(), "nranks": [], "algos": [],
                             "protos": [], "tuning_seen": set()}
    for raw in text.splitlines():
        line = raw.rstrip()
        if "NCCL" not in line and "Channel" not in line:
            continue
        out["n_lines"] += 1
        with contextlib.suppress(Exception):  # one odd line must not lose the rest of the log
            _parse_line(line, out, state)
    if state["nranks"]:
        out["n_ranks"] = max(state["nranks"])
    if out["n_channels"] is None and (state["ring_channels"] or state["link_channels"]):
        out["n_channels"] = len(state["ring_channels"] or state["link_channels"])
    out["explanations"] = _explain(out)
    return out


def _add_once(items: list[Any], item: Any) -> None:
    if item not in items:
        items.append(item)


def _parse_line(line: str, out: dict[str, Any], state: dict[str, Any]) -> None:
    if m := _RE["transport"].search(line):
        via = m.group(7)
        out["transports"][via] += 1
        out["transport_kinds"][via.split("/")[0]] += 1
        state["link_channels"].add(int(m.group(1)))
        return
    if m := _RE["ring"].search(line):
        ch, total = int(m.group(1)), int(m.group(2))
        state["ring_channels"].add(ch)
        out["n_channels"] = max(out["n_channels"] or 0, total)
        _add_once(out["rings"], f"channel {ch:02d}: " + " -> ".join(m.group(3).split()))
        return
    if m := _RE["tree"].search(line):
        _add_once(out["trees"], m.group(1).strip())
        return
    if _parse_table(line, out, state):
        return
    if (m := _RE["version"].search(line)) and out["version"] is None:
        out["version"] = m.group(1)
    if m := _RE["nnodes"].search(line):
        state["nranks"].append(int(m.group(1)))
        out["n_nodes"] = max(out["n_nodes"] or 0, int(m.group(2)))
    elif m := _RE["init"].search(line):
        state["nranks"].append(int(m.group(2)))
    if m := _RE["cuda_driver"].search(line):
        out["cuda_driver"] = int(m.group(1))
    if m := _RE["coll_channels"].search(line):
        out["coll_channels"], out["p2p_channels"] = int(m.group(1)), int(m.group(4))
    if m := _RE["env"].search(line):
        out["env"][m.group(1)] = m.group(2).strip()
    if m := _RE["net"].search(line):
        out["network"] = m.group(1)
    if m := _RE["net_ok"].search(line):
        _add_once(out["net_plugins"], m.group(1) or m.group(2))
    if m := _RE["net_failed"].search(line):
        _add_once(out["net_unavailable"], m.group(1) or m.group(2))
    if m := _RE["choice"].search(line):
        out["choices"].append({"collective": m.group(1), "bytes": int(m.group(2)),
                               "algorithm": _name(m.group(3), _ALGOS), "protocol": _name(m.group(4), _PROTOS),
                               "channels": int(m.group(6)) - int(m.group(5)) + 1 if m.group(5) is not None else None})
    if m := _RE["connected"].search(line):
        _add_once(out["connected"], m.group(1))
    if m := _RE["nvls"].search(line):
        out["nvls_available"] = m.group(1) is None
    if m := _RE["system_bw"].search(line):
        out["system_bw_gbps"] = float(m.group(1))
    if m := _RE["graph"].search(line):
        pattern = int(m.group(1))
        _add_once(out["graphs"],
                  {"pattern": _PATTERNS.get(pattern, f"pattern {pattern}"), "n_channels": int(m.group(2)),
                   "bw_gbps": float(m.group(3)), "type": m.group(5)})
    if m := _RE["init_time"].search(line):
        out["init_time_s"] = max(out["init_time_s"] or 0.0, float(m.group(1)))


def _parse_table(line: str, out: dict[str, Any], state: dict[str, Any]) -> bool:
    """NCCL's tuning table (TUNING): per collective, 'latency_us/ bw_gbps' for each algorithm and protocol."""
    for key in ("algos", "protos"):
        if m := _RE[f"table_{key}"].search(line):
            state[key] = [a.strip() for a in m.group(1).split("|") if a.strip()]
            return True
    m = _RE["table_row"].search(line)
    if not m or not state["algos"]:
        return bool(m)
    cells = [c.strip() for c in m.group(2).split("|") if c.strip()]
    per_algo = 3  # LL, LL128, Simple
    for i, cell in enumerate(cells):
        if i // per_algo >= len(state["algos"]) or "/" not in cell:
            break
        latency, bw = (float(v) for v in cell.split("/"))
        algo = state["algos"][i // per_algo]
        proto = state["protos"][i] if i < len(state["protos"]) else _PROTOS[i % per_algo]
        key = (m.group(1), algo, proto)
        if bw > 0 and key not in state["tuning_seen"]:
            state["tuning_seen"].add(key)
            out["tuning"].append({"collective": key[0], "algorithm": algo, "protocol": proto,
                                  "latency_us": latency, "bw_gbps": bw})
    return True


def _explain(p: dict[str, Any]) -> list[str]:
    says = []
    if p["version"]:
        who = f" on {p['n_ranks']} ranks" if p["n_ranks"] else ""
        nodes = f", {p['n_nodes']} node(s)" if p["n_nodes"] else ""
        took = f"; setting up the communicator took {p['init_time_s']:g} s" if p["init_time_s"] else ""
        says.append(f"NCCL {p['version']}{who}{nodes}{took}.")
    kinds, vias = p["transport_kinds"], p["transports"]
    if kinds.get("P2P"):
        how = ", ".join(sorted(v for v in vias if v.startswith("P2P")))
        says.append(f"{kinds['P2P']} channel connections go GPU to GPU directly (P2P: {how}), over NVLink or PCIe peer "
                    "access. CUMEM: buffers shared through CUDA's virtual memory API; IPC: legacy CUDA IPC handles; "
                    "/read: the receiver reads from the sender's memory.")
    if kinds.get("SHM"):
        says.append(
            f"{kinds['SHM']} channel connections go through host shared memory: the GPUs do not use peer access "
            "(none between them, across CPU sockets, or NCCL_P2P_DISABLE=1), so data crosses PCIe twice.")
    if kinds.get("NET"):
        says.append(f"{kinds['NET']} channel connections go through the network "
                    f"({', '.join(sorted(v for v in vias if v.startswith('NET')))}): expected between nodes; inside "
                    "one node it means P2P and SHM were not usable.")
    if p["n_channels"]:
        says.append(f"{p['n_channels']} channels: NCCL splits each collective over them, each run by its own CUDA "
                    "block on its own path; more channels use more links and SMs in parallel.")
    if p["rings"]:
        says.append(f"Ring order, e.g. {p['rings'][0]}: each rank sends to the next and receives from the one "
                    "before; all_reduce goes round twice (reduce-scatter, then all-gather).")
    if p["trees"]:
        says.append("'Trees' lines give each rank's parent and children per channel, for the tree algorithm "
                    "(latency-bound sizes).")
    for g in p["graphs"][:2]:
        says.append(f"Topology search, {g['pattern']}: {g['n_channels']} channels at {g['bw_gbps']:g} GB/s each "
                    f"over {_PATH_TYPES.get(g['type'], g['type'])} ({g['type']}).")
    if p["system_bw_gbps"]:
        nvl = any(g["type"] == "NVL" for g in p["graphs"])
        says.append(f"NCCL's model of the fastest GPU path: {p['system_bw_gbps']:g} GB/s"
                    + (" (NCCL rates a Hopper NVLink below the datasheet's 25 GB/s per link: 370.8 for 18 links, "
                       "against 450)." if nvl else "."))
    if best := [t for t in p["tuning"] if t["collective"] == "AllReduce"]:
        top = max(best, key=lambda t: t["bw_gbps"])
        says.append(f"NCCL's tuning model for AllReduce: best {top['algorithm']}/{top['protocol']} at "
                    f"{top['bw_gbps']:g} GB/s (algorithm bandwidth) with {top['latency_us']:g} µs latency; it "
                    "picks per call the pair with the least predicted time.")
    if algos := Counter(f"{c['algorithm']}/{c['protocol']}" for c in p["choices"]):
        says.append("Algorithm/protocol chosen per call: " + ", ".join(f"{k} ×{v}" for k, v in algos.items())
                    + " (LL/LL128 for small messages: low latency; SIMPLE for large: full bandwidth).")
    if p["network"]:
        says.append(f"Network plugin: {p['network']} (used between nodes only; "
                    + ("no InfiniBand found, so TCP sockets" if p["network"].lower() == "socket"
                       else "RDMA over InfiniBand/RoCE") + ").")
    if p["env"]:
        says.append("Read from the environment: " + ", ".join(f"{k}={v}" for k, v in p["env"].items()) + ".")
    if p["env"].get("NCCL_NVLS_ENABLE") == "0" or p["nvls_available"] is False:
        says.append("NVLink SHARP (NVLS, multicast in the NVSwitch) is off, so busbw stays below the link's "
                    "line rate; with it, all_reduce busbw can exceed it.")
    if not says:
        says.append("No NCCL INFO lines recognised: was the log written with NCCL_DEBUG=INFO?")
    return says
