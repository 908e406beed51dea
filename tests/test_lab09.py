"""Lab 09: every LLM-serving exercise against right answers (written several ways), blanks and plausible wrong
answers with their specific messages; the random-weight decoder's prefill/decode timing and cost model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _exercise_harness import as_written, check, exercises_of, hint_and_solution_tests, standard_tests

from lab_utils.exercises import lab09
from lab_utils.exercises.framework import Status
from lab_utils.inference import llm

# --- q1 -------------------------------------------------------------------------------------------------------


def kv_right(layers, kv_heads, head_dim, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_right_float(layers, kv_heads, head_dim, dtype_bytes):  # written differently: K and V added, a float
    per_layer = kv_heads * head_dim * dtype_bytes
    return float(per_layer * layers + per_layer * layers)


def kv_no_factor_2(layers, kv_heads, head_dim, dtype_bytes):
    return layers * kv_heads * head_dim * dtype_bytes


def kv_bits(layers, kv_heads, head_dim, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * dtype_bytes * 8


def kv_one_layer(layers, kv_heads, head_dim, dtype_bytes):
    return 2 * kv_heads * head_dim * dtype_bytes


def kv_kib(layers, kv_heads, head_dim, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * dtype_bytes / 1024


def kv_constant(layers, kv_heads, head_dim, dtype_bytes):
    return 131072


def kv_blank(layers, kv_heads, head_dim, dtype_bytes):
    ...


# --- q3 -------------------------------------------------------------------------------------------------------


def seq_right(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac):
    free_bytes = (gpu_mem_gb * (1 - reserve_frac) - weights_gb) * 1e9
    return max(0, math.floor(free_bytes / (seq_len * kv_bytes_per_token)))


def seq_right_floordiv(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac):  # written differently
    usable_gb = gpu_mem_gb - gpu_mem_gb * reserve_frac - weights_gb
    return int(max(usable_gb * 1e9, 0) // (seq_len * kv_bytes_per_token))


def seq_gib(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac):
    free_bytes = (gpu_mem_gb * (1 - reserve_frac) - weights_gb) * 2**30
    return max(0, math.floor(free_bytes / (seq_len * kv_bytes_per_token)))


def seq_no_reserve(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac):
    return max(0, math.floor((gpu_mem_gb - weights_gb) * 1e9 / (seq_len * kv_bytes_per_token)))


def seq_negative(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac):
    return math.floor((gpu_mem_gb * (1 - reserve_frac) - weights_gb) * 1e9 / (seq_len * kv_bytes_per_token))


def seq_float(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac):
    return max(0.0, (gpu_mem_gb * (1 - reserve_frac) - weights_gb) * 1e9 / (seq_len * kv_bytes_per_token))


def seq_per_token(gpu_mem_gb, weights_gb, seq_len, kv_bytes_per_token, reserve_frac):
    return max(0, math.floor((gpu_mem_gb * (1 - reserve_frac) - weights_gb) * 1e9 / kv_bytes_per_token))


# --- q4 -------------------------------------------------------------------------------------------------------


def waste_right(lengths, max_len, block):
    used = sum(lengths)
    return 1 - used / (len(lengths) * max_len), 1 - used / sum(math.ceil(n / block) * block for n in lengths)


def waste_right_list(lengths, max_len, block):  # written differently: a list, blocks by negative floor division
    reserved = sum(-(-n // block) * block for n in lengths)
    unused_c = sum(max_len - n for n in lengths)
    return [unused_c / (max_len * len(lengths)), (reserved - sum(lengths)) / reserved]


def waste_floor(lengths, max_len, block):
    used = sum(lengths)
    return 1 - used / (len(lengths) * max_len), 1 - used / sum((n // block) * block or block for n in lengths)


def waste_swapped(lengths, max_len, block):
    c, p = waste_right(lengths, max_len, block)
    return p, c


def waste_mean_of_fractions(lengths, max_len, block):
    n = len(lengths)
    return (sum(1 - x / max_len for x in lengths) / n,
            sum(1 - x / (math.ceil(x / block) * block) for x in lengths) / n)


def waste_percent(lengths, max_len, block):
    c, p = waste_right(lengths, max_len, block)
    return 100 * c, 100 * p


# --- q5 -------------------------------------------------------------------------------------------------------


def tt_right(prefill_ms, decode_ms, batch, new_tokens):
    ttft, tpot = prefill_ms[batch], decode_ms[batch]
    return ttft, tpot, batch * new_tokens / ((ttft + (new_tokens - 1) * tpot) / 1000)


def tt_right_list(prefill_ms, decode_ms, batch, new_tokens):  # written differently: seconds inside, a list out
    total_s = (prefill_ms[batch] + decode_ms[batch] * (new_tokens - 1)) / 1e3
    return [prefill_ms[batch], decode_ms[batch], new_tokens * batch / total_s]


def tt_tpot_per_batch(prefill_ms, decode_ms, batch, new_tokens):
    ttft, tpot = prefill_ms[batch], decode_ms[batch] / batch
    return ttft, tpot, batch * new_tokens / ((ttft + (new_tokens - 1) * decode_ms[batch]) / 1000)


def tt_ttft_batch1(prefill_ms, decode_ms, batch, new_tokens):
    ttft, tpot = prefill_ms[1], decode_ms[batch]
    return ttft, tpot, batch * new_tokens / ((prefill_ms[batch] + (new_tokens - 1) * tpot) / 1000)


def tt_one_request(prefill_ms, decode_ms, batch, new_tokens):
    ttft, tpot = prefill_ms[batch], decode_ms[batch]
    return ttft, tpot, new_tokens / ((ttft + (new_tokens - 1) * tpot) / 1000)


def tt_extra_step(prefill_ms, decode_ms, batch, new_tokens):
    ttft, tpot = prefill_ms[batch], decode_ms[batch]
    return ttft, tpot, batch * new_tokens / ((ttft + new_tokens * tpot) / 1000)


NIM = as_written(lab09.NIM_REQUEST)
NIM_REORDERED = {"stream": True, "max_tokens": 128, "temperature": 0.2,
                 "messages": [{"role": "system", "content": "Be brief."},
                              {"content": "What is a KV cache?", "role": "user"}],
                 "model": "meta/llama-3.1-8b-instruct"}

CASES = [
    (lab09.q1, [kv_right, kv_right_float], [kv_no_factor_2, kv_bits, kv_one_layer, kv_kib, kv_constant, 131072]),
    (lab09.q2, [2 * 80 * 8 * 128 * 2 * 8192 / 1e9, "2.68", "2.68 GB", "2.5 GiB"],  # a named unit is read in it
     [2 * 80 * 64 * 128 * 2 * 8192 / 1e9, 80 * 8 * 128 * 2 * 8192 / 1e9, 2 * 80 * 8 * 128 * 2 * 8192 / 2**30]),
    (lab09.q3, [seq_right, seq_right_floordiv], [seq_gib, seq_no_reserve, seq_negative, seq_float, seq_per_token]),
    (lab09.q4, [waste_right, waste_right_list], [waste_floor, waste_swapped, waste_mean_of_fractions, waste_percent]),
    (lab09.q8, [tt_right, tt_right_list], [tt_tpot_per_batch, tt_ttft_batch1, tt_one_request, tt_extra_step]),
    (lab09.q6, [1.0, 1, "1"], [0.5, 2.0, 0.25]),
    (lab09.q7, [989e12 / 4.8e12, 206], [103, 412, 0.206]),
    (lab09.q9, [NIM, NIM_REORDERED, json.dumps(NIM)],
     [{"model": NIM["model"], "prompt": "What is a KV cache?", "max_tokens": 128, "stream": True},
      {**NIM, "max_tokens": "128"}, {**NIM, "stream": "true"}, {**NIM, "messages": "What is a KV cache?"},
      {k: v for k, v in NIM.items() if k != "model"}, "{not json"]),
]

test_right, test_wrong, test_blank = standard_tests(CASES)
test_hints, test_solution = hint_and_solution_tests(exercises_of(lab09))


def test_every_exercise_is_tested_and_half_are_code():
    tested = {ex.name for ex, *_ in CASES + ATT_CASES}
    assert tested == {e.name for e in exercises_of(lab09)}
    code = [e for e in exercises_of(lab09) if isinstance(e, lab09.CodeExercise)]
    assert len(code) * 2 >= len(exercises_of(lab09))


def test_a_blank_function_is_not_attempted():
    assert check(lab09.q1, kv_blank).status is Status.NOT_ATTEMPTED


@pytest.mark.parametrize(("exercise", "answer", "words"), [
    (lab09.q1, kv_no_factor_2, "key AND a value"),
    (lab09.q1, kv_bits, "bits"),
    (lab09.q1, kv_one_layer, "every layer"),
    (lab09.q1, kv_kib, "KiB"),
    (lab09.q1, kv_constant, "constant"),
    (lab09.q2, 2 * 80 * 64 * 128 * 2 * 8192 / 1e9, "KV heads"),
    (lab09.q2, 2 * 80 * 8 * 128 * 2 * 8192 / 2**30, "GiB"),
    (lab09.q2, "2.5", "GiB"),  # a bare GiB figure is GB/GiB confusion, named as such
    (lab09.q3, seq_gib, "GiB"),
    (lab09.q3, seq_no_reserve, "kept back"),
    (lab09.q3, seq_negative, "never a negative"),
    (lab09.q3, seq_float, "whole number"),
    (lab09.q4, waste_floor, "round the number of blocks up"),
    (lab09.q4, waste_swapped, "swapped"),
    (lab09.q4, waste_mean_of_fractions, "averages"),
    (lab09.q4, waste_percent, "percentages"),
    (lab09.q8, tt_tpot_per_batch, "divides a decode step"),
    (lab09.q8, tt_ttft_batch1, "one prompt's prefill"),
    (lab09.q8, tt_one_request, "tokens/s of one request"),
    (lab09.q8, tt_extra_step, "one decode step too many"),
    (lab09.q9, {"model": NIM["model"], "prompt": "x", "max_tokens": 128, "stream": True}, "legacy"),
    (lab09.q9, {**NIM, "stream": "true"}, "boolean"),
])
def test_wrong_answers_are_told_their_mistake(exercise, answer, words):
    out = check(exercise, answer)
    assert out.status is Status.INCORRECT and words in out.message, out.message


def test_code_checks_draw_new_inputs_each_time():
    seen = []

    def spy(layers, kv_heads, head_dim, dtype_bytes):
        seen.append((layers, kv_heads, head_dim, dtype_bytes))
        return kv_right(layers, kv_heads, head_dim, dtype_bytes)

    check(lab09.q1, spy)
    first = list(seen)
    check(lab09.q1, spy)
    assert len(first) >= 3 and seen[len(first):] != first
    assert len({s[3] for s in first}) >= 2  # two element sizes: bits-for-bytes shows as a constant ratio


def test_correct_messages_do_not_depend_on_the_draw():
    # the notebook compares these outputs (NBVAL_CHECK_OUTPUT): they must be the same from run to run
    for ex, right in ((lab09.q1, kv_right), (lab09.q3, seq_right), (lab09.q4, waste_right), (lab09.q5, att_right),
                      (lab09.q8, tt_right)):
        assert check(ex, right).message == check(ex, right).message


def test_reference_numbers():
    assert lab09.reference_kv_bytes_per_token(80, 8, 128, 2) == 327_680
    assert lab09.reference_max_sequences(141, 810, 4096, 10**6, 0.1) == 0
    assert lab09.reference_kv_waste([16, 17], 64, 16) == pytest.approx((1 - 33 / 128, 1 - 33 / 48))
    assert lab09.reference_ttft_tpot({4: 100.0}, {4: 10.0}, 4, 11) == pytest.approx((100.0, 10.0, 4 * 11 / 0.2))


# --- the decoder -----------------------------------------------------------------------------------------------

SMALL = llm.DecoderConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_len=64)


def test_decoder_config_checks_and_kv_bytes_agree_with_the_exercise():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        llm.DecoderConfig(n_heads=8, n_kv_heads=3)
    assert SMALL.kv_bytes_per_token(2) == lab09.reference_kv_bytes_per_token(2, 2, 16, 2)
    model = llm.TinyDecoder(SMALL)
    assert model.random_weights
    cache = model.new_cache(3)
    assert cache.nbytes == SMALL.kv_bytes_per_token(4) * 3 * SMALL.max_len


def test_decoder_weights_are_seeded_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = llm.TinyDecoder(SMALL, seed=3), llm.TinyDecoder(SMALL, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    half = llm.TinyDecoder(SMALL, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and half.new_cache(1).k.dtype == torch.bfloat16


def test_decode_with_the_kv_cache_matches_a_full_forward():
    model = llm.TinyDecoder(SMALL).eval()
    tokens = torch.randint(0, SMALL.vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(tokens, model.new_cache(2), 0)[:, -1]
        cache = model.new_cache(2)
        model(tokens[:, :11], cache, 0)
        step = model(tokens[:, 11:], cache, 11)[:, -1]
    assert cache.length == 12
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)


def test_prefill_and_decode_timing_is_positive_and_decode_is_less_intense():
    torch.manual_seed(0)
    model = llm.TinyDecoder(SMALL).eval()
    table = llm.prefill_decode(model, [1, 2], prompt_len=16, reps=2)
    assert set(table["phase"]) == {"prefill", "decode"} and len(table) == 4
    for col in ("median_ms", "tokens_per_s", "tflops", "gbps", "flop_per_byte"):
        assert (table[col] > 0).all(), col
    for b in (1, 2):
        rows = table[table["batch"] == b].set_index("phase")
        assert rows.loc["decode", "flop_per_byte"] < rows.loc["prefill", "flop_per_byte"]


def test_phase_cost_intensity_follows_the_batch():
    big = llm.DecoderConfig(vocab=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                            max_len=4096)
    one = llm.phase_cost(big, "decode", 1, 128, 2).intensity
    many = llm.phase_cost(big, "decode", 64, 128, 2).intensity
    assert 0.9 < one < 1.1  # ~1 FLOP/byte in bf16 (attention and the KV cache shift it a little)
    assert 40 < many < 64
    assert llm.phase_cost(big, "prefill", 1, 1024, 2).intensity > lab09.H200_RIDGE
    with pytest.raises(ValueError, match="phase"):
        llm.phase_cost(big, "train", 1, 1, 2)


# --- q5: the decode step's attention -----------------------------------------------------------------------------


def att_right(q, k_new, v_new, k_cache, v_cache, pos):
    k_cache[:, :, pos] = k_new[:, :, 0]
    v_cache[:, :, pos] = v_new[:, :, 0]
    group = q.shape[1] // k_cache.shape[1]
    keys = k_cache[:, :, :pos + 1].repeat_interleave(group, dim=1)
    values = v_cache[:, :, :pos + 1].repeat_interleave(group, dim=1)
    return torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ values


def att_sdpa(q, k_new, v_new, k_cache, v_cache, pos):  # written differently: slices assigned, torch's SDPA with GQA
    k_cache[:, :, pos:pos + 1] = k_new
    v_cache[:, :, pos:pos + 1] = v_new
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1],
                                                            enable_gqa=True)


def att_no_cache_write(q, k_new, v_new, k_cache, v_cache, pos):
    keys = torch.cat([k_cache[:, :, :pos], k_new], dim=2)
    values = torch.cat([v_cache[:, :, :pos], v_new], dim=2)
    group = q.shape[1] // k_cache.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ values


def att_all_slots(q, k_new, v_new, k_cache, v_cache, pos):
    k_cache[:, :, pos] = k_new[:, :, 0]
    v_cache[:, :, pos] = v_new[:, :, 0]
    group = q.shape[1] // k_cache.shape[1]
    keys, values = k_cache.repeat_interleave(group, dim=1), v_cache.repeat_interleave(group, dim=1)
    return torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ values


def att_repeat(q, k_new, v_new, k_cache, v_cache, pos):
    k_cache[:, :, pos] = k_new[:, :, 0]
    v_cache[:, :, pos] = v_new[:, :, 0]
    group = q.shape[1] // k_cache.shape[1]
    keys = k_cache[:, :, :pos + 1].repeat(1, group, 1, 1)
    values = v_cache[:, :, :pos + 1].repeat(1, group, 1, 1)
    return torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ values


def att_no_scale(q, k_new, v_new, k_cache, v_cache, pos):
    k_cache[:, :, pos] = k_new[:, :, 0]
    v_cache[:, :, pos] = v_new[:, :, 0]
    group = q.shape[1] // k_cache.shape[1]
    keys = k_cache[:, :, :pos + 1].repeat_interleave(group, dim=1)
    values = v_cache[:, :, :pos + 1].repeat_interleave(group, dim=1)
    return torch.softmax(q @ keys.transpose(-2, -1), dim=-1) @ values


def att_off_by_one(q, k_new, v_new, k_cache, v_cache, pos):
    k_cache[:, :, pos] = k_new[:, :, 0]
    v_cache[:, :, pos] = v_new[:, :, 0]
    group = q.shape[1] // k_cache.shape[1]
    keys = k_cache[:, :, :pos].repeat_interleave(group, dim=1)
    values = v_cache[:, :, :pos].repeat_interleave(group, dim=1)
    return torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ values


ATT_CASES = [(lab09.q5, [att_right, att_sdpa],
              [att_no_cache_write, att_all_slots, att_repeat, att_no_scale, att_off_by_one])]
test_att_right, test_att_wrong, test_att_blank = standard_tests(ATT_CASES)


@pytest.mark.parametrize(("answer", "words"), [
    (att_no_cache_write, "in place"),
    (att_all_slots, "empty ones included"),
    (att_repeat, "repeat_interleave"),
    (att_no_scale, "sqrt(head_dim)"),
    (att_off_by_one, "leaves out the new token"),
])
def test_decode_attention_mistakes_are_named(answer, words):
    out = check(lab09.q5, answer)
    assert out.status is Status.INCORRECT and words in out.message, out.message


def test_decoder_decode_step_continues_its_prefill_exactly():
    """The fused (enable_gqa) attention of the model's decode step against a full prefill of one more token."""
    import torch

    from lab_utils.inference import llm

    cfg = llm.DecoderConfig(vocab=512, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=128, max_len=64)
    model = llm.TinyDecoder(cfg).eval()
    tokens = torch.randint(0, cfg.vocab, (2, 10))
    cache, fresh = model.new_cache(2), model.new_cache(2)
    nxt = model.prefill(tokens, cache)
    with torch.inference_mode():
        whole = model(torch.cat([tokens, nxt], 1), fresh, 0, last_only=True)
        step = model(nxt, cache, 10, last_only=True)
    assert torch.allclose(whole, step, atol=1e-4)


CPU_DECODER = llm.DecoderConfig(vocab=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=768, max_len=1024)


def test_the_cpu_tiers_prefill_is_judged_in_bf16_as_the_text_says_compute_bound():
    # The CPU tier's decoder (fp32, prompts of 256 before) had its prefill printed "memory-bound" against the H200's
    # ridge, beside a text that says prefill is compute-bound: fp32's 4 bytes halve the intensity (an H200 runs the
    # shapes in bf16), and at 256 tokens even bf16 sits just below the ridge (its LM head serves one token).
    assert llm.phase_cost(CPU_DECODER, "prefill", 1, 256, 2).intensity < lab09.H200_RIDGE
    model = llm.TinyDecoder(CPU_DECODER).eval()
    table = llm.prefill_decode(model, [1], prompt_len=512, reps=1)
    verdicts = llm.h200_verdicts(table, CPU_DECODER, 512, lab09.H200_RIDGE).set_index("phase")
    assert verdicts.loc["prefill", "on_an_h200"] == "compute-bound"
    assert verdicts.loc["prefill", "flop_per_byte_bf16"] == pytest.approx(
        2 * verdicts.loc["prefill", "flop_per_byte_here"], rel=0.01)
    assert verdicts.loc["decode", "on_an_h200"] == "memory-bound"
    short = llm.h200_verdicts(llm.prefill_decode(model, [1], prompt_len=16, reps=1), CPU_DECODER, 16, lab09.H200_RIDGE)
    assert short.set_index("phase").loc["prefill", "on_an_h200"] == "memory-bound"  # a very short prompt is not


def test_the_h200_table_gives_no_ratio_between_different_decoders():
    from lab_utils.course import results

    reference = [r for d in results.reference_dirs() if d.name == "h200" for r in results.load(d) if r["lab"] == "09"]
    assert reference, "the committed H200 run of lab 09"
    note = ("P=1024, 787 M params, cuda:0", "P=256, 4 M params, cpu")
    cpu = [dict(r, value=r["value"] * 1.65, note=r["note"].replace(*note)) for r in reference]
    table, why = llm.beside_reference(cpu, reference)
    assert table["ratio"].isna().all() and table["this_run"].notna().all()
    assert "4 M params" in why and "787 M params" in why and "without a ratio" in why
    again = [dict(r, note=r["note"].replace("cuda:0", "cuda:1")) for r in reference]  # the same decoder elsewhere
    same, why = llm.beside_reference(again, reference)
    assert (same["ratio"] == 1).all() and "each ratio" in why
