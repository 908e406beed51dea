"""Lab 09 exercises: LLM-serving arithmetic (the quiz itself is ``lab_utils.exercises.quiz``).

Four are code the check runs on inputs drawn at random: ``kv_bytes_per_token(layers, kv_heads, head_dim,
dtype_bytes)``, ``max_sequences(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac)`` (GB = 1e9
bytes), ``kv_waste(lengths, max_len, block)`` and ``ttft_tpot(prefill_ms, decode_ms, batch, new_tokens)``. Four
are values: the KV cache of a Llama-3.1-70B sequence, decode's arithmetic intensity, the batch where decode meets
the H200's ridge, and the body of an OpenAI-compatible chat request to a NIM (no request is sent).

Design notes: docs/internals.md#lab_utilsexerciseslab09py
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from typing import Any

import torch

from lab_utils.exercises import lab01
from lab_utils.exercises.framework import CodeExercise, Exercise, Wrong, close_to, items, number, run_student, source_as
from lab_utils.exercises.quiz import in_byte_unit
from lab_utils.inference.llm import decode_attention as reference_decode_attention

__all__ = [
    "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9",
    "reference_kv_bytes_per_token", "reference_max_sequences", "reference_kv_waste", "reference_ttft_tpot",
    "reference_decode_attention",
    "H200_MEM_GB", "H200_RIDGE", "NIM_REQUEST",
]

H200_MEM_GB = round(143771 * 2**20 / 1e9, 1)  # 150.8 GB of 1e9 bytes: nvidia-smi's 143,771 MiB. The datasheet's
# "141 GB" counts capacity in powers of two (about 141 GiB), so it is not 141e9 bytes.
H200_RIDGE = lab01.H200_RIDGE  # FLOP/byte: dense bf16 peak / HBM bandwidth, ~206 (lab 01 derives it)
GIB = 2**30


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


# --- q1: KV bytes per token ---------------------------------------------------------------------------------


def reference_kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token adds: a key and a value vector per KV head, in every layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes  # K and V, every layer, every KV head


# Real shapes (layers, KV heads, head dim) beside random ones: Llama-3.1-8B/70B/405B, Mistral-7B, Llama-2-7B (MHA).
_REAL_SHAPES = [(32, 8, 128), (80, 8, 128), (126, 8, 128), (32, 8, 128), (32, 32, 128)]


def _shapes(rng: random.Random, n: int = 5) -> list[tuple[int, int, int, int]]:
    out = [(*rng.choice(_REAL_SHAPES), 2)]
    while len(out) < n:
        shape = (rng.randint(2, 128), rng.choice([1, 2, 4, 8, 16]), rng.choice([64, 80, 96, 128, 256]),
                 rng.choice([1, 2, 4]))
        if all(shape[0] != s[0] for s in out):
            out.append(shape)
    if len({s[3] for s in out}) < 2:  # two element sizes at least, so bits/bytes slips show
        out[-1] = (*out[-1][:3], 4 if out[-1][3] != 4 else 1)
    return out


def _grade_kv_bytes(fn: Any) -> str:
    shapes = _shapes(random.Random())
    got, want = [], []
    for layers, kvh, hd, nb in shapes:
        call = f"kv_bytes_per_token(layers={layers}, kv_heads={kvh}, head_dim={hd}, dtype_bytes={nb})"
        got.append(number(run_student(fn, layers, kvh, hd, nb, call=call, timeout_s=10), f"{call}'s result"))
        want.append(reference_kv_bytes_per_token(layers, kvh, hd, nb))
    if all(_close(g, w) for g, w in zip(got, want, strict=True)):
        return f"Right on {len(shapes)} random model shapes."
    ratios = [g / w for g, w in zip(got, want, strict=True)]
    if len(set(got)) == 1:
        raise Wrong(f"{got[0]:g} bytes for every shape: the result must follow the model's sizes (a constant?).")
    slips = {  # a common mistake's ratio (answer / expected) for a shape -> what it got wrong
        "half the bytes: each token stores a key AND a value vector per KV head (the factor 2).": lambda s: 0.5,
        "8x: that counts bits; dtype_bytes is bytes per element already (bf16 = 2 bytes, not 16).": lambda s: 8.0,
        "4x: the factor 2 (K and V) counted twice?": lambda s: 4.0,
        "that is KiB: return bytes.": lambda s: 1 / 1024,
        "that is kB: return bytes.": lambda s: 1e-3,
        "that is MiB: return bytes.": lambda s: 1 / 2**20,
        "that is MB: return bytes.": lambda s: 1e-6,
        "one layer's worth: every layer keeps its own keys and values (multiply by layers).": lambda s: 1 / s[0],
        "that counts elements: multiply by dtype_bytes for bytes.": lambda s: 1 / s[3],
    }
    for msg, slip in slips.items():
        if all(math.isclose(x, slip(s), rel_tol=1e-6) for x, s in zip(ratios, shapes, strict=True)):
            raise Wrong(msg)
    i = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not _close(g, w))
    layers, kvh, hd, nb = shapes[i]
    raise Wrong(f"for layers={layers}, kv_heads={kvh}, head_dim={hd}, dtype_bytes={nb} you return {got[i]:g} bytes; "
                f"expected {want[i]:g} ({ratios[i]:.3g}x off). Count: K and V, per layer, per KV head, head_dim "
                "elements of dtype_bytes each.")


q1 = CodeExercise(
    name="09.1 KV cache bytes per token", var="kv_bytes_per_token", grade=_grade_kv_bytes,
    signature="kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes) -> int",
    hints=[
        "Each new token leaves, in every layer, one key vector and one value vector per KV head.",
        "A vector is head_dim elements of dtype_bytes bytes. With grouped-query attention (GQA) only the KV heads "
        "are stored, not the (more numerous) query heads.",
        "Multiply it out: a key and a value (2 vectors), per KV head, per layer, each head_dim elements of "
        "dtype_bytes bytes.",
    ],
    solution_text=source_as(reference_kv_bytes_per_token,
                            "kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes)"),
)

# --- q2: one Llama-3.1-70B sequence -------------------------------------------------------------------------

_KV_70B_GB = reference_kv_bytes_per_token(80, 8, 128, 2) * 8192 / 1e9  # 2.68 GB

_q2_close = close_to(
    _KV_70B_GB, rel=0.02, reveal=False,
    why="2 (K, V) x 80 layers x 8 KV heads x 128 x 2 bytes x 8192 tokens, in GB (1e9 bytes).",
    slips={
        8.0: "8x: either the 64 attention heads instead of the 8 KV heads (GQA stores only KV heads), or bits "
             "(16) where bytes (2) are meant.",
        0.5: "half: every token stores a key and a value (the factor 2).",
        1 / (GIB / 1e9): "that is GiB (2**30 bytes); the question asks for GB (1e9 bytes). (A text that names its "
                         "unit, such as '... GiB', is read in that unit.)",
        1e3: "1000x: that is MB; the question asks for GB.",
        4.0: "4x: the 64 query heads instead of 8 KV heads, and K/V forgotten?",
    })

q2 = Exercise(
    name="09.2 KV cache of one Llama-3.1-70B sequence", var="kv_gb_70b",
    grade=lambda value: _q2_close(in_byte_unit(value, "GB")),  # "2.5 GiB" says its unit: it is read in it
    hints=[
        "Your kv_bytes_per_token with Llama-3.1-70B's shape, times the sequence length.",
        "80 layers, 8 KV heads (64 query heads share them: GQA), head_dim 128, bf16 = 2 bytes; 8192 tokens.",
        "Bytes per token (hint 1's function, or by hand) times 8192 tokens, over 1e9 for GB.",
    ],
    solution_text="kv_gb_70b = 2 * 80 * 8 * 128 * 2 * 8192 / 1e9   # 2.68 GB per 8k-token sequence",
)

# --- q3: how many sequences fit -------------------------------------------------------------------------------


def reference_max_sequences(gpu_mem_gb: float, weights_gb: float, seq_len: int, kv_bytes_per_token: float,
                            reserve_frac: float) -> int:
    """Whole sequences of ``seq_len`` tokens whose KV cache fits in what is left of the GPU's memory once
    ``reserve_frac`` of it is kept back (activations, CUDA context, fragmentation) and the weights are loaded.
    GB = 1e9 bytes; 0 when the weights alone do not fit."""
    free_bytes = (gpu_mem_gb * (1 - reserve_frac) - weights_gb) * 1e9  # GB = 1e9 bytes
    return max(0, math.floor(free_bytes / (seq_len * kv_bytes_per_token)))  # whole sequences


def _seq_variants(mem: float, w: float, seq: int, kv: int, reserve: float) -> list[tuple[int, str]]:
    """What common mistakes return for one case, with what to tell the student."""
    per_seq = seq * kv

    def count(free_bytes: float) -> int:
        return max(0, math.floor(free_bytes / per_seq))

    exact = (mem * (1 - reserve) - w) * 1e9 / per_seq
    return [
        (count((mem * (1 - reserve) - w) * GIB), "gpu_mem_gb and weights_gb are GB of 1e9 bytes; 2**30 is a GiB, 7 % "
                                                 "larger."),
        (count((mem - w) * 1e9), "reserve_frac of the GPU's memory is kept back (activations, CUDA context, "
                                 "fragmentation) before the KV cache gets any."),
        (count((mem - w) * (1 - reserve) * 1e9), "reserve_frac is a share of the whole GPU's memory (as vLLM's "
                                                 "gpu_memory_utilization), taken before the weights: "
                                                 "mem × (1 − reserve_frac) − weights."),
        (count(mem * (1 - reserve) * 1e9), "the weights sit in the same memory: subtract weights_gb first."),
        (math.ceil(exact), "a partial sequence does not fit: round down, not up."),
    ]


def _seq_cases(rng: random.Random) -> list[tuple[float, float, int, int, float]]:
    cases = []
    weights = [16.1, 70.6, 40.0, 8.0, 26.0]  # GB: an 8B in bf16, a 70B in fp8, ...
    rng.shuffle(weights)
    while len(cases) < 4:
        mem = rng.choice([H200_MEM_GB, H200_MEM_GB, 80, 94])
        w = weights[len(cases)]
        seq = rng.choice([512, 1024, 2048, 4096]) + rng.randint(0, 256)
        kv = reference_kv_bytes_per_token(*rng.choice(_REAL_SHAPES[:4]), rng.choice([1, 2]))
        reserve = round(rng.uniform(0.05, 0.15), 3)
        exact = (mem * (1 - reserve) - w) * 1e9 / (seq * kv)
        values = [v for v, _ in _seq_variants(mem, w, seq, kv, reserve)] + [math.floor(exact)]
        if exact < 20 or abs(exact - round(exact)) < 0.02 or len(set(values)) < len(values):
            continue  # clear of integer boundaries, every mistake distinguishable
        cases.append((mem, w, seq, kv, reserve))
    cases.append((H200_MEM_GB, 810.0, 4096, reference_kv_bytes_per_token(126, 8, 128, 2), 0.1))  # 405B in bf16
    return cases


def _grade_max_sequences(fn: Any) -> str:
    for mem, w, seq, kv, reserve in _seq_cases(random.Random()):
        call = (f"max_sequences(gpu_mem_gb={mem}, weights_gb={w}, seq_len={seq}, kv_bytes_per_token={kv}, "
                f"reserve_frac={reserve})")
        raw = run_student(fn, mem, w, seq, kv, reserve, call=call, timeout_s=10)
        got = number(raw, f"{call}'s result")
        want = reference_max_sequences(mem, w, seq, kv, reserve)
        if got == want:
            continue
        if want == 0:
            raise Wrong(f"{call} returned {got:g}: the weights ({w} GB) do not fit in {mem} GB at all, so no sequence "
                        "fits: return 0, never a negative count.")
        if not float(got).is_integer():
            raise Wrong(f"{call} returned {got:g}: a count of sequences is a whole number; a partial sequence does not "
                        "fit, so round down (math.floor or //).")
        if got > 1000 * max(want, 1):
            raise Wrong(f"{call} returned {got:g}: far too many. One sequence needs seq_len × kv_bytes_per_token "
                        "bytes of KV cache (did you divide by the bytes of one token only?).")
        for value, why in _seq_variants(mem, w, seq, kv, reserve):
            if got == value:
                raise Wrong(f"{call} returned {got:g}, expected {want}: {why}")
        raise Wrong(f"{call} returned {got:g}, expected {want}. Free = gpu_mem_gb × (1 − reserve_frac) − weights_gb "
                    "(GB, 1e9 bytes); one sequence needs seq_len × kv_bytes_per_token bytes; whole sequences only.")
    return "Right on 5 random GPUs, models and lengths (one where the weights alone do not fit)."


q3 = CodeExercise(
    name="09.3 sequences that fit beside the weights", var="max_sequences", grade=_grade_max_sequences,
    signature="max_sequences(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac) -> int",
    hints=[
        "Keep reserve_frac of the GPU's memory back, load the weights, and give the rest to the KV cache.",
        "free bytes = (gpu_mem_gb × (1 − reserve_frac) − weights_gb) × 1e9; one sequence needs seq_len × "
        "kv_bytes_per_token bytes.",
        "Whole sequences only: round the quotient down (math.floor); weights larger than the memory leave none, "
        "never a negative count.",
    ],
    solution_text=source_as(reference_max_sequences,
                            "max_sequences(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac)"),
)

# --- q4: paged against contiguous KV memory --------------------------------------------------------------------


def reference_kv_waste(lengths: list[int], max_len: int, block: int) -> tuple[float, float]:
    """(contiguous, paged) share of reserved KV memory that holds no token. Contiguous: every sequence reserves
    ``max_len`` slots. Paged: a sequence holds ceil(length / block) blocks of ``block`` slots."""
    used = sum(lengths)
    contiguous = 1 - used / (len(lengths) * max_len)  # max_len reserved each
    paged = 1 - used / sum(math.ceil(n / block) * block for n in lengths)  # whole blocks only
    return contiguous, paged


def _numbers(value: Any, call: str, names: tuple[str, ...]) -> list[float]:
    """The tuple a function returned, as numbers: Wrong unless it is ``len(names)`` of them."""
    got = items(value, len(names), call, f"{len(names)} numbers, ({', '.join(names)})")
    return [number(v, name) for v, name in zip(got, names, strict=True)]


def _grade_kv_waste(fn: Any) -> str:
    rng = random.Random()
    for _ in range(3):
        max_len = rng.choice([2048, 4096, 8192])
        block = rng.choice([16, 32])
        n = rng.randint(40, 120)
        lengths = [max(1, min(max_len, int(rng.lognormvariate(math.log(max_len / 6), 0.9)))) for _ in range(n)]
        call = f"kv_waste(lengths=<{len(lengths)} lengths>, max_len={max_len}, block={block})"
        got = _numbers(run_student(fn, list(lengths), max_len, block, call=call, timeout_s=10), call,
                       ("contiguous_waste", "paged_waste"))
        want = reference_kv_waste(lengths, max_len, block)
        if all(_close(g, w) for g, w in zip(got, want, strict=True)):
            continue
        used = sum(lengths)
        if _close(got[0], want[1]) and _close(got[1], want[0]):
            raise Wrong(f"{call}: the two are swapped: return (contiguous, paged).")
        if all(_close(g, 100 * w) for g, w in zip(got, want, strict=True)):
            raise Wrong(f"{call}: those are percentages; return fractions (0.25, not 25).")
        if all(_close(g, 1 - w) for g, w in zip(got, want, strict=True)):
            raise Wrong(f"{call}: that is the share used; the question asks for the share wasted (1 − used/reserved).")
        contiguous_used = len(lengths) * max_len / used - 1
        paged_used = sum(math.ceil(n / block) * block for n in lengths) / used - 1
        if _close(got[0], contiguous_used) or _close(got[1], paged_used):
            raise Wrong(f"{call}: waste is a share of the memory reserved (1 − used/reserved), not of the memory used.")
        mean_c = sum(1 - n / max_len for n in lengths) / len(lengths)
        mean_p = sum(1 - n / (math.ceil(n / block) * block) for n in lengths) / len(lengths)
        if _close(got[1], mean_p) or (_close(got[0], mean_c) and not _close(mean_c, want[0])):
            raise Wrong(f"{call}: that averages each sequence's waste fraction; add up the slots instead (total "
                        "unused / total reserved), so a long sequence counts for its size.")
        floor_p = sum((n // block) * block for n in lengths)
        if (floor_p and _close(got[1], 1 - used / floor_p)) or (_close(got[0], want[0]) and got[1] < want[1]):
            raise Wrong(f"{call}: paged waste {got[1]:.4g} is too low: a sequence of 17 tokens in blocks of 16 needs "
                        "2 blocks; round the number of blocks up (math.ceil), not down.")
        which = "contiguous" if not _close(got[0], want[0]) else "paged"
        raise Wrong(f"{call}: the {which} waste is off (yours {got[0]:.4g}, {got[1]:.4g}). Contiguous: every sequence "
                    "reserves max_len slots; paged: ceil(length / block) blocks of block slots; waste = 1 − used / "
                    "reserved.")
    return "Right on 3 random length distributions."


q4 = CodeExercise(
    name="09.4 KV memory wasted: contiguous against paged", var="kv_waste", grade=_grade_kv_waste,
    signature="kv_waste(lengths, max_len, block) -> (contiguous_waste, paged_waste)",
    hints=[
        "Used slots: sum(lengths). A contiguous cache reserves max_len slots for every sequence; a paged one only "
        "whole blocks of `block` slots, as many as the sequence needs.",
        "Blocks for a sequence of n tokens: math.ceil(n / block). Waste = 1 − used / reserved, over all sequences.",
        "Both fractions share the numerator, the used slots; the denominators are the reserved slots: every "
        "sequence's max_len for the contiguous cache, each sequence's whole blocks times `block` for the paged one. "
        "Return the two, contiguous first.",
    ],
    solution_text=source_as(reference_kv_waste, "kv_waste(lengths, max_len, block)"),
)

# --- q5: one decode step's attention with a KV cache ----------------------------------------------------------


def _attn_variant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, upto: int, *, scale: bool = True,
                  interleave: bool = True, dim: int = -1) -> torch.Tensor:
    group = q.shape[1] // k_cache.shape[1]
    spread = (lambda t: t.repeat_interleave(group, dim=1)) if interleave else (lambda t: t.repeat(1, group, 1, 1))
    keys, values = spread(k_cache[:, :, :upto]), spread(v_cache[:, :, :upto])
    scores = q @ keys.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    return torch.softmax(scores, dim=dim) @ values


def _close_t(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4,
                                                                               atol=1e-5)


def _grade_decode_attention(fn: Any) -> str:
    rng = random.Random()
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    # (B, heads, kv_heads, head_dim, max_len, pos): GQA with 2+ KV heads first (so repeat vs repeat_interleave
    # shows), then MHA, then another GQA
    cases = [(rng.randint(1, 3), 8, 2, rng.choice([16, 32]), rng.randint(40, 64), rng.randint(5, 30)),
             (rng.randint(1, 3), 4, 4, rng.choice([16, 32]), rng.randint(40, 64), rng.randint(5, 30)),
             (rng.randint(1, 3), 8, 4, rng.choice([16, 32]), rng.randint(40, 64), rng.randint(0, 30))]
    for b, h, kvh, hd, max_len, pos in cases:
        k_cache = torch.zeros(b, kvh, max_len, hd)
        v_cache = torch.zeros(b, kvh, max_len, hd)
        k_cache[:, :, :pos] = torch.randn(b, kvh, pos, hd, generator=gen)  # pos tokens already cached
        v_cache[:, :, :pos] = torch.randn(b, kvh, pos, hd, generator=gen)
        for step in range(2):  # two decode steps in a row: the second must see the first's key and value
            p = pos + step
            q = torch.randn(b, h, 1, hd, generator=gen)
            k_new, v_new = torch.randn(b, kvh, 1, hd, generator=gen), torch.randn(b, kvh, 1, hd, generator=gen)
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            want = reference_decode_attention(q, k_new, v_new, ref_k, ref_v, p)
            before_k = k_cache.clone()
            call = (f"decode_attention(q[{b},{h},1,{hd}], k_new, v_new, k_cache[{b},{kvh},{max_len},{hd}], v_cache, "
                    f"pos={p})")
            got = run_student(fn, q.clone(), k_new.clone(), v_new.clone(), k_cache, v_cache, p, call=call,
                              timeout_s=30, returns=torch.Tensor, returns_text="a tensor [B, heads, 1, head_dim]")
            if tuple(got.shape) != (b, h, 1, hd):
                raise Wrong(f"{call} returned shape {tuple(got.shape)}; expected {(b, h, 1, hd)}: one output vector "
                            "per query head, for the one new token.")
            if not torch.equal(k_cache[:, :, p], k_new[:, :, 0]) or not torch.equal(v_cache[:, :, p], v_new[:, :, 0]):
                if p + 1 < max_len and torch.equal(k_cache[:, :, p + 1], k_new[:, :, 0]):
                    raise Wrong(f"{call}: k_new was written at pos + 1; the cache holds pos tokens (0 .. pos - 1), so "
                                "the new one goes at index pos.")
                raise Wrong(f"{call}: the cache at position pos does not hold k_new and v_new afterwards. Write them "
                            "into k_cache and v_cache in place (k_cache[:, :, pos] = k_new[:, :, 0]): the next step "
                            "attends to this token too.")
            changed = (k_cache != before_k).any(dim=-1)
            changed[:, :, p] = False
            if changed.any():
                raise Wrong(f"{call}: the cache changed at positions other than pos: only the new token's slot may be "
                            "written.")
            if _close_t(got, want):
                continue
            upd_k, upd_v = ref_k, ref_v  # the reference's cache after the step: same as what the student's must be
            slips = [
                (_attn_variant(q, upd_k, upd_v, max_len), "it attends to all max_len slots, empty ones included: "
                 "attend to the pos + 1 cached tokens only (k_cache[:, :, :pos + 1])."),
                (_attn_variant(q, upd_k, upd_v, p), "it leaves out the new token: a token attends to itself too, so "
                 "the keys run up to and including pos (:pos + 1)."),
                (_attn_variant(q, upd_k, upd_v, p + 1, scale=False), "the scores are not scaled: divide q·kᵀ by "
                 "sqrt(head_dim)."),
                (_attn_variant(q, upd_k, upd_v, p + 1, dim=-2), "softmax over the wrong dimension: normalize over the "
                 "keys (the last dimension of the scores)."),
            ]
            if kvh not in (1, h):
                slips.append((_attn_variant(q, upd_k, upd_v, p + 1, interleave=False), "query heads are matched "
                              "with the wrong KV heads: with GQA, query head i uses KV head i // (heads // kv_heads): "
                              "repeat_interleave(group, dim=1), not repeat."))
            for alt, why in slips:
                if _close_t(got, alt):
                    raise Wrong(f"{call}: {why}")
            err = float((got.float() - want).abs().max())
            raise Wrong(f"{call}: the output differs from attention over the cached tokens (largest difference "
                        f"{err:.3g}): softmax(q·kᵀ / sqrt(head_dim)) · v over positions 0 .. pos.")
    return "Right on 3 random shapes (GQA and MHA), two steps each."


q5 = CodeExercise(
    name="09.5 one decode step with a KV cache", var="decode_attention", grade=_grade_decode_attention,
    signature="decode_attention(q, k_new, v_new, k_cache, v_cache, pos) -> Tensor",
    hints=[
        "First the cache: the new token's key and value go in at position pos of the cache's token dimension (the "
        "third); the cache then holds pos + 1 tokens.",
        "Keys and values are k_cache[:, :, :pos + 1] and v_cache[:, :, :pos + 1]. With GQA, give each query head its "
        "KV head: .repeat_interleave(heads // kv_heads, dim=1).",
        "Scaled dot-product attention over the cached tokens: q times the keys transposed, over sqrt(head_dim); a "
        "softmax over the last dimension weights the values.",
    ],
    solution_text=source_as(reference_decode_attention, "decode_attention(q, k_new, v_new, k_cache, v_cache, pos)"),
)

# --- q8: TTFT, TPOT and throughput of a static batch ---------------------------------------------------------------


def reference_ttft_tpot(prefill_ms: Mapping[int, float], decode_ms: Mapping[int, float], batch: int,
                        new_tokens: int) -> tuple[float, float, float]:
    """(TTFT ms, TPOT ms, output tokens/s) of ``batch`` requests that arrive together and are served as one batch:
    their prompts prefilled in one forward (``prefill_ms[batch]``, which also yields each first token), then
    ``new_tokens - 1`` decode steps of ``decode_ms[batch]`` each."""
    ttft = prefill_ms[batch]  # one forward over every prompt: first tokens
    tpot = decode_ms[batch]  # every request waits a whole step per token
    total_ms = ttft + (new_tokens - 1) * tpot
    return ttft, tpot, batch * new_tokens / (total_ms / 1e3)


def _grade_ttft_tpot(fn: Any) -> str:
    rng = random.Random()
    for _ in range(3):
        p1, d1 = rng.uniform(20, 200), rng.uniform(5, 30)
        batches = [1, 2, 4, 8, 16, 32]
        prefill = {b: round(p1 * b * rng.uniform(0.9, 1.0), 3) for b in batches}  # compute-bound: ~linear in B
        decode = {b: round(d1 * (1 + 0.03 * b) * rng.uniform(0.97, 1.03), 3) for b in batches}  # memory-bound: ~flat
        b, n = rng.choice(batches[2:]), rng.randint(16, 48)
        call = f"ttft_tpot(prefill_ms, decode_ms, batch={b}, new_tokens={n})"
        got = _numbers(run_student(fn, dict(prefill), dict(decode), b, n, call=call, timeout_s=10), call,
                       ("ttft_ms", "tpot_ms", "tokens_per_s"))
        ttft, tpot, tps = reference_ttft_tpot(prefill, decode, b, n)
        if not _close(got[0], ttft):
            if _close(got[0], prefill[1]):
                raise Wrong(f"{call}: TTFT {got[0]:g} ms is one prompt's prefill; the {b} prompts go through one "
                            f"forward together, and prefill is compute-bound: prefill_ms[{b}].")
            if _close(got[0], prefill[b] / b):
                raise Wrong(f"{call}: TTFT {got[0]:g} ms divides the batch's prefill by the batch; every request "
                            "waits for the whole forward: its first token comes when the batch's prefill ends.")
            if _close(got[0], prefill[b] + decode[b]):
                raise Wrong(f"{call}: TTFT {got[0]:g} ms adds a decode step; prefill already yields the first token.")
            raise Wrong(f"{call}: TTFT {got[0]:g} ms, expected {ttft:g}: the batch's prefill time.")
        if not _close(got[1], tpot):
            if _close(got[1], decode[b] / b):
                raise Wrong(f"{call}: TPOT {got[1]:g} ms divides a decode step by the batch: each request still waits "
                            "a whole step for its next token (that division is the server's throughput, not a "
                            "request's latency).")
            if _close(got[1], decode[1]):
                raise Wrong(f"{call}: TPOT {got[1]:g} ms is the batch-1 step; use the step time at batch {b}.")
            raise Wrong(f"{call}: TPOT {got[1]:g} ms, expected {tpot:g}: one decode step at this batch size.")
        if not _close(got[2], tps):
            r = got[2] / tps
            if math.isclose(r, 1 / b, rel_tol=1e-6):
                raise Wrong(f"{call}: tokens/s of one request: the batch produces {b} tokens per step.")
            if math.isclose(r, 1e-3, rel_tol=1e-6):
                raise Wrong(f"{call}: tokens per millisecond: the times are ms, so divide by total_ms / 1000.")
            if _close(got[2], b * n / ((prefill[b] + n * decode[b]) / 1e3)):
                raise Wrong(f"{call}: one decode step too many: the first of the {n} tokens comes from the prefill, "
                            f"so {n - 1} decode steps follow it.")
            if _close(got[2], b * (n - 1) / ((n - 1) * decode[b] / 1e3)) or _close(got[2], b * 1e3 / decode[b]):
                raise Wrong(f"{call}: the prefill time counts too: the batch's {n} tokens take TTFT + {n - 1} × TPOT.")
            raise Wrong(f"{call}: {got[2]:.4g} tokens/s, expected {tps:.4g}: batch × new_tokens over "
                        "(TTFT + (new_tokens − 1) × TPOT) in seconds.")
    return "Right on 3 random timing tables."


q8 = CodeExercise(
    name="09.8 TTFT, TPOT and tokens/s of a batch", var="ttft_tpot", grade=_grade_ttft_tpot,
    signature="ttft_tpot(prefill_ms, decode_ms, batch, new_tokens) -> (ttft_ms, tpot_ms, tokens_per_s)",
    hints=[
        "The batch's prompts go through one forward: every request's first token appears when it ends. After that "
        "each decode step gives every request one more token.",
        "TTFT = prefill_ms[batch]; TPOT = decode_ms[batch]; the first token came from the prefill, so new_tokens − 1 "
        "decode steps follow.",
        "The total time is the prefill plus those decode steps; tokens/s counts every token of every request over "
        "that time in seconds.",
    ],
    solution_text=source_as(reference_ttft_tpot, "ttft_tpot(prefill_ms, decode_ms, batch, new_tokens)"),
)

# --- q6/q7: decode's intensity and the ridge ---------------------------------------------------------------------

q6 = Exercise(
    name="09.6 arithmetic intensity of a batch-1 decode step", var="decode_flop_per_byte",
    grade=close_to(
        1.0, rel=0.05, reveal=False,
        why="Per weight: a multiply-add (FLOPs) for one token, and the weight read once from HBM in bf16 (bytes).",
        slips={
            0.5: "half: a multiply-add is 2 FLOPs.",
            2.0: "double: a bf16 weight is 2 bytes.",
            0.25: "a quarter: a multiply-add is 2 FLOPs, and bf16 is 2 bytes (not 4 as fp32).",
            4.0: "4x: count the weight's bytes (2) once.",
        }),
    hints=[
        "At batch 1 each weight is read from memory once and used for one token: one multiply-add.",
        "A multiply-add is 2 FLOPs; a bf16 weight is 2 bytes. (The KV cache adds bytes too, so the true figure is "
        "a little lower.)",
        "Divide the FLOPs each weight brings by the bytes it costs to read.",
    ],
    solution_text="decode_flop_per_byte = 2 / 2   # 1 FLOP/byte: ~200x below the H200's ridge -> memory-bound",
)

q7 = Exercise(
    name="09.7 batch at which decode reaches the ridge", var="ridge_batch",
    grade=close_to(
        H200_RIDGE, rel=0.05, reveal=False,
        why="At batch B a weight read once serves B tokens: intensity ≈ B FLOP/byte in bf16; set it equal to the "
            "H200's ridge (989 TFLOP/s / 4.8 TB/s).",
        slips={
            0.5: "half: at batch B a 2-byte bf16 weight does B multiply-adds, 2·B FLOPs: intensity 2B / 2 = B "
                 "FLOP/byte, so B equals the ridge (not half of it).",
            2.0: "double: at batch B a 2-byte bf16 weight does B multiply-adds, 2·B FLOPs: intensity B FLOP/byte, "
                 "not B/2.",
            **dict.fromkeys((1e-3, 1e3), "a units slip: 989 TFLOP/s / 4.8 TB/s is 206 FLOP/byte."),
        }),
    hints=[
        "With B sequences in the batch, each weight read from memory is used for B tokens.",
        "Intensity ≈ B FLOP/byte (bf16, ignoring the KV cache). The ridge is where it equals peak FLOP/s / bandwidth.",
        "So the batch is the ridge itself: the H200's dense bf16 FLOP/s over its HBM bytes/s (lab 01's figures).",
    ],
    solution_text="ridge_batch = 989e12 / 4.8e12   # ~206 sequences (fewer once the KV cache's bytes count)",
)

# --- q9: an OpenAI-compatible request to a NIM -------------------------------------------------------------------

NIM_REQUEST = {
    "model": "meta/llama-3.1-8b-instruct",
    "messages": [{"role": "user", "content": "What is a KV cache?"}],
    "max_tokens": 128,
    "stream": True,
}


def _grade_nim_request(value: Any) -> None:
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise Wrong(f"not valid JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(value, Mapping):
        raise Wrong(f"the body is a JSON object (a dict), got a {type(value).__name__}")
    if "prompt" in value and "messages" not in value:
        raise Wrong("`prompt` belongs to the legacy /v1/completions API; /v1/chat/completions takes `messages`, a list "
                    "of {\"role\": ..., \"content\": ...}.")
    if value.get("model") != NIM_REQUEST["model"]:
        raise Wrong(f"model should name the NIM's model, {NIM_REQUEST['model']!r} (GET /v1/models lists it); "
                    f"got {value.get('model')!r}")
    msgs = value.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, Mapping) for m in msgs):
        raise Wrong("messages is a list of objects like {\"role\": \"user\", \"content\": \"...\"}, not a string.")
    if bad := [m.get("role") for m in msgs if m.get("role") not in ("system", "user", "assistant", "tool")]:
        raise Wrong(f"roles are system, user, assistant (or tool); got {bad}")
    last = msgs[-1]
    if last.get("role") != "user" or last.get("content") != NIM_REQUEST["messages"][0]["content"]:
        raise Wrong(f"the last message should be the user's question, {NIM_REQUEST['messages'][0]['content']!r}; "
                    f"got {dict(last)!r}")
    mt = value.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int):
        raise Wrong(f"max_tokens is a JSON number (128), got {mt!r} ({type(mt).__name__})")
    if mt != NIM_REQUEST["max_tokens"]:
        raise Wrong(f"max_tokens should be {NIM_REQUEST['max_tokens']}, got {mt}")
    if value.get("stream") is not True:
        raise Wrong(f"stream is the JSON boolean true (Python True) to receive tokens as server-sent events; got "
                    f"{value.get('stream')!r}")


q9 = Exercise(
    name="09.9 an OpenAI-compatible chat request to a NIM", var="nim_request", grade=_grade_nim_request,
    hints=[
        "POST /v1/chat/completions takes a JSON object: model, messages, and generation options.",
        "messages is a list of {\"role\": \"user\", \"content\": ...}; max_tokens is a number; stream a boolean.",
        "Here: the model 'meta/llama-3.1-8b-instruct'; one user message asking 'What is a KV cache?'; at most 128 "
        "new tokens; streamed (the tokens come as they are made).",
    ],
    solution_text=f"nim_request = {json.dumps(NIM_REQUEST, indent=2)}",
)
