"""Lab 09's small decoder-only transformer (RANDOM WEIGHTS: it generates nonsense, on purpose) and the timing of
its two phases, prefill and decode, with the FLOPs and bytes each moves.

Prefill runs the prompt through the model in one forward (compute-bound); decode produces one token per sequence
per step (memory-bound). ``prefill_decode`` times both with ``lab_utils.timing.benchmark`` and reports achieved
FLOP/s, bytes/s and intensity (FLOP/byte) from ``phase_cost``'s counts. Shapes: tokens ``[B, T]``, cache
``[layers, B, kv_heads, max_len, head_dim]``.

Design notes: docs/internals.md#lab_utilsinferencellmpy"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab_utils import timing


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the decoder. ``head_dim = d_model // n_heads``; ``n_heads`` must be a multiple of ``n_kv_heads``."""

    vocab: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    d_ff: int = 768
    max_len: int = 1024

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (GQA)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def layer_params(self) -> int:
        """Weights of one block: q, k, v, o projections and the gated MLP (norm scales are negligible)."""
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        return d * d + 2 * d * kv + d * d + 3 * d * self.d_ff

    @property
    def matmul_params(self) -> int:
        """Weights a generated token multiplies with: all blocks and the (tied) LM head."""
        return self.n_layers * self.layer_params + self.vocab * self.d_model

    def kv_bytes_per_token(self, nbytes: int) -> int:
        """KV cache bytes per token: K and V, every layer, every KV head: 2·layers·kv_heads·head_dim·bytes."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * nbytes


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Preallocated keys and values: ``k``, ``v`` of shape ``[layers, B, kv_heads, max_len, head_dim]``."""

    def __init__(self, cfg: DecoderConfig, batch: int, device: str | torch.device, dtype: torch.dtype) -> None:
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, cfg.max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # tokens held

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: int) -> torch.Tensor:
    """One decode step's attention with a KV cache, for one layer.

    ``q``: [B, heads, 1, head_dim], the new token's queries; ``k_new``, ``v_new``: [B, kv_heads, 1, head_dim], its key
    and value; ``k_cache``, ``v_cache``: [B, kv_heads, max_len, head_dim] holding ``pos`` tokens already. Writes the
    new key and value at ``pos`` (in place), then attends over the ``pos + 1`` cached tokens; query head h uses KV
    head h // (heads // kv_heads) (GQA). Returns [B, heads, 1, head_dim]."""
    k_cache[:, :, pos] = k_new[:, :, 0]  # the cache grows by one token: later steps attend to it
    v_cache[:, :, pos] = v_new[:, :, 0]
    group = q.shape[1] // k_cache.shape[1]
    keys = k_cache[:, :, :pos + 1].repeat_interleave(group, dim=1)  # [B, heads, pos+1, head_dim]
    values = v_cache[:, :, :pos + 1].repeat_interleave(group, dim=1)
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, heads, 1, pos+1]
    return torch.softmax(scores, dim=-1) @ values


# Not cuDNN's attention, which PyTorch prefers on Hopper: it plans per shape, and a decode step meets a new cache
# length every token (on the H200 run, a by-hand decode loop took ~60 ms a token with it against ~11 ms per repeat
# of one length).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class _RMSNorm(nn.Module):
    def __init__(self, d: int, **where: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, **where))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, **where: Any) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.n_kv_heads * cfg.head_dim
        self.norm1, self.norm2 = _RMSNorm(cfg.d_model, **where), _RMSNorm(cfg.d_model, **where)
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False, **where)
        self.kv = nn.Linear(cfg.d_model, 2 * kv, bias=False, **where)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False, **where)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False, **where)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False, **where)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int) -> torch.Tensor:
        """``x``: [B, T, d]; ``k_cache``/``v_cache``: [B, kv_heads, max_len, head_dim]; tokens sit at pos..pos+T."""
        cfg = self.cfg
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        k, v = self.kv(h).view(b, t, 2, cfg.n_kv_heads, cfg.head_dim).permute(2, 0, 3, 1, 4)  # [B, kvh, T, hd]
        k_cache[:, :, pos:pos + t] = k  # the KV cache: this step's keys and values, kept for later tokens
        v_cache[:, :, pos:pos + t] = v
        keys, values = k_cache[:, :, :pos + t], v_cache[:, :, :pos + t]  # every token so far
        # decode_attention's arithmetic in one fused kernel: enable_gqa lets each KV head serve its group of query
        # heads without copying the cache `group` times (repeat_interleave would, in every layer of every step).
        # Prefill is causal over the prompt (prompts start at position 0 here; chunked prefill is not modelled).
        with sdpa_kernel(_SDPA_BACKENDS):
            att = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1 and pos == 0, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, cfg.d_model))  # output projection, residual, then the MLP
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyDecoder(nn.Module):
    """A decoder-only transformer with RANDOM weights (seeded), for timing prefill and decode; not a language model."""

    random_weights = True

    def __init__(self, cfg: DecoderConfig, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        """Built (and initialised) directly on ``device`` in ``dtype``; the global random state is left as it was."""
        super().__init__()
        self.cfg = cfg
        where: dict[str, Any] = {"device": device, "dtype": dtype}
        cuda = [torch.device(device)] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(cfg.vocab, cfg.d_model, **where)
            self.blocks = nn.ModuleList(_Block(cfg, **where) for _ in range(cfg.n_layers))
            self.norm = _RMSNorm(cfg.d_model, **where)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=1 / math.sqrt(p.shape[1]))

    def new_cache(self, batch: int) -> KVCache:
        p = self.embed.weight
        return KVCache(self.cfg, batch, p.device, p.dtype)

    def forward(self, tokens: torch.Tensor, cache: KVCache, pos: int = 0, last_only: bool = False) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``tokens`` ``[B, T]`` at positions ``pos..pos+T`` (``[B, 1, vocab]``, the last
        position's, with ``last_only``); fills ``cache`` there."""
        if pos + tokens.shape[1] > self.cfg.max_len:
            raise ValueError(f"{pos + tokens.shape[1]} tokens exceed max_len={self.cfg.max_len}")
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, cache.k[i], cache.v[i], pos)
        cache.length = pos + tokens.shape[1]
        if last_only:  # generation needs the next token only: the LM head runs on the last position
            x = x[:, -1:]
        return self.norm(x) @ self.embed.weight.T  # LM head tied to the embedding

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The prompt in one forward; returns the next token of each sequence (greedy) ``[B, 1]``."""
        return self(tokens, cache, 0, last_only=True).argmax(-1)

    @torch.inference_mode()
    def decode_step(self, token: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
        """One new token per sequence (``token`` ``[B, 1]`` at position ``pos``) against the cache; the next token."""
        return self(token, cache, pos, last_only=True).argmax(-1)


@dataclass(frozen=True)
class PhaseCost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes


def phase_cost(cfg: DecoderConfig, phase: str, batch: int, prompt_len: int, nbytes: int) -> PhaseCost:
    """FLOPs and fewest bytes of one prefill (``batch`` prompts of ``prompt_len``) or one decode step (``batch``
    sequences, ``prompt_len`` tokens cached), weights and cache in ``nbytes``-byte elements.

    FLOPs: 2 per weight per token (a multiply-add; the LM head only for each sequence's last token), plus attention's
    QKᵀ and AV (2·2·d per query-key pair; causal in prefill: half the pairs). Bytes: every weight read once, and the
    KV cache written (prefill) or read (decode)."""
    d, w = cfg.d_model, cfg.matmul_params
    kv_tok = cfg.kv_bytes_per_token(nbytes)
    if phase == "prefill":
        tokens = batch * prompt_len
        pairs = batch * prompt_len * (prompt_len + 1) / 2
        flops = 2 * cfg.n_layers * cfg.layer_params * tokens + 2 * cfg.vocab * d * batch + 4 * d * cfg.n_layers * pairs
        return PhaseCost(flops, w * nbytes + tokens * kv_tok)
    if phase == "decode":
        pairs = batch * (prompt_len + 1)
        return PhaseCost(2 * w * batch + 4 * d * cfg.n_layers * pairs, w * nbytes + batch * (prompt_len + 1) * kv_tok)
    raise ValueError(f"phase={phase!r}: 'prefill' or 'decode'")


def _tokens(cfg: DecoderConfig, batch: int, length: int, device: str) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(1)
    return torch.randint(0, cfg.vocab, (batch, length), generator=gen).to(device)


def time_prefill(model: TinyDecoder, batch: int, prompt_len: int, reps: int = 5, warmup: int = 1) -> timing.Timing:
    """Milliseconds of one prefill: ``batch`` prompts of ``prompt_len`` tokens in one forward (cache allocated
    outside the timed region)."""
    device = str(model.embed.weight.device)
    tokens = _tokens(model.cfg, batch, prompt_len, device)
    cache = model.new_cache(batch)
    return timing.benchmark(lambda: model.prefill(tokens, cache), reps=reps, warmup=warmup, device=device,
                            name=f"prefill B={batch} P={prompt_len}")


def time_decode(model: TinyDecoder, batch: int, prompt_len: int, reps: int = 10, warmup: int = 2,
                graph: bool = False) -> timing.Timing:
    """Milliseconds of one decode step (one new token for each of ``batch`` sequences) with ``prompt_len`` tokens
    already cached. Every repetition writes the same position, so the cache length stays fixed.

    ``graph`` (CUDA only): the step captured once in a CUDA graph and replayed, as serving engines run decode, so
    the several hundred kernel launches of an eager step (Python and the launch path) drop out of the time."""
    device = str(model.embed.weight.device)
    cache = model.new_cache(batch)
    nxt = model.prefill(_tokens(model.cfg, batch, prompt_len, device), cache)  # fill the cache, untimed
    name = f"decode B={batch} L={prompt_len}"
    if not graph:
        return timing.benchmark(lambda: model.decode_step(nxt, cache, prompt_len), reps=reps, warmup=warmup,
                                device=device, name=name)
    if not device.startswith("cuda"):
        raise ValueError(f"time_decode(graph=True) needs a CUDA device; the model is on {device}")
    g, _ = timing.cuda_graph(lambda: model.decode_step(nxt, cache, prompt_len), warmup=2)
    return timing.benchmark(g.replay, reps=reps, warmup=warmup, device=device, name=f"{name}, CUDA graph")


def prefill_decode(model: TinyDecoder, batches: list[int], prompt_len: int, reps: int = 5) -> pd.DataFrame:
    """Prefill and decode timed at each batch size: ms, tokens/s, achieved FLOP/s and bytes/s, intensity. On a GPU
    also ``decode_graph``: the decode step replayed from a CUDA graph."""
    cfg = model.cfg
    nbytes = model.embed.weight.element_size()
    cuda = model.embed.weight.device.type == "cuda"
    rows = []
    for b in batches:
        timed = [("prefill", time_prefill(model, b, prompt_len, reps=reps)),
                 ("decode", time_decode(model, b, prompt_len, reps=2 * reps))]
        if cuda:  # the same step without launch overhead: how close decode gets to the memory roofline
            timed.append(("decode_graph", time_decode(model, b, prompt_len, reps=2 * reps, graph=True)))
        for phase, t in timed:
            cost = phase_cost(cfg, phase.removesuffix("_graph"), b, prompt_len, nbytes)
            s = t.median_ms * 1e-3
            new_tokens = b * prompt_len if phase == "prefill" else b
            rows.append({"phase": phase, "batch": b, "tokens": new_tokens, "median_ms": t.median_ms,
                         "spread": t.spread, "tokens_per_s": new_tokens / s, "tflops": cost.flops / s / 1e12,
                         "gbps": cost.bytes / s / 1e9, "flop_per_byte": cost.intensity, "device": t.device})
    return pd.DataFrame(rows)


H200_BF16 = 2  # bytes per weight as the H200 reference run holds them


def h200_verdicts(table: pd.DataFrame, cfg: DecoderConfig, prompt_len: int, ridge: float) -> pd.DataFrame:
    """Each measured phase's intensity here (``flop_per_byte``, in this run's dtype) and in bf16, as an H200 runs
    the same shapes, with the H200's verdict: compute-bound at or above ``ridge`` FLOP/byte, memory-bound below.

    The verdict is taken in bf16: intensity counts bytes, so the CPU's fp32 weights (4 bytes) halve it, and the
    H200's ridge says nothing about a CPU. A prefill's bf16 intensity is about the tokens it runs per weight read
    (batch × prompt): a prompt of a few hundred tokens or more is compute-bound, a very short one is not."""
    rows = []
    for r in table.itertuples():
        bf16 = phase_cost(cfg, str(r.phase).removesuffix("_graph"), int(r.batch), prompt_len, H200_BF16).intensity
        rows.append({"phase": r.phase, "batch": r.batch, "flop_per_byte_here": r.flop_per_byte,
                     "flop_per_byte_bf16": bf16,
                     "on_an_h200": "compute-bound" if bf16 >= ridge else "memory-bound"})
    return pd.DataFrame(rows)


def _decoder(note: str) -> str:
    """The decoder and prompt a recorded note names ("P=1024, 787 M params, cuda:0" -> "P=1024, 787 M params")."""
    return note.rsplit(", ", 1)[0] if note.count(", ") >= 2 else note


def beside_reference(here: list[dict[str, Any]], reference: list[dict[str, Any]]) -> tuple[pd.DataFrame, str]:
    """This run's prefill/decode records beside the reference run's (``results.load`` rows), and a line saying
    whether they compare. Ratios only between the same decoder and prompt (the tokens/s records' notes): the CPU
    tier's 4 M-parameter fp32 decoder does ~200x less work per token than the H200's 787 M bf16 one, so a ratio
    would only say that."""
    mine = {r["name"]: r for r in here}
    ref = [r for r in reference if r["name"].startswith(("prefill", "decode"))]
    decoders = {(_decoder(mine[r["name"]].get("note", "")), _decoder(r.get("note", ""))) for r in ref
                if r["unit"] == "tokens/s" and r["name"] in mine}
    differ = sorted((ours, theirs) for ours, theirs in decoders if ours != theirs)
    rows = []
    for r in ref:
        m = mine.get(r["name"])
        ratio = m["value"] / r["value"] if m is not None and not differ and r["value"] else None
        rows.append({"name": r["name"], "unit": r["unit"], "this_run": m["value"] if m else None, "h200": r["value"],
                     "ratio": ratio})
    if differ:
        ours, theirs = differ[0]
        why = (f"this run's decoder ({ours}) is not the H200 run's ({theirs}): the numbers stand side by side without "
               "a ratio (a smaller model does less work per token; only the same decoder and prompt compare)")
    else:
        why = "the H200 run's decoder and prompt: each ratio is this run over the H200"
    return pd.DataFrame(rows), why
