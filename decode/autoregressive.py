"""Target-only autoregressive decoding with a KV cache: the baseline speculative decoding must match and beat.
"""
from __future__ import annotations

import time

import torch

from decode.common import (
    DecodeSetup,
    GenerationOutput,
    Timer,
    finalize,
    new_kv_state,
    output_vocab_size,
    prefill,
    setup_decoding,
    sync,
)
from decode.sampling import greedy_tokens, process_logits, sample_tokens, validate_sampling_args
from decode.stats import AcceptanceStats

__all__ = ['autoregressive_generate']


@torch.inference_mode()
def autoregressive_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    fast_path: bool | None = None,
) -> GenerationOutput:
    """Decode one token per target forward (KV cache), with the same sampling pipeline and stopping rules as
    :func:`decode.speculative_generate`.

    Args / returns / errors: as :func:`decode.speculative_generate` without the draft arguments. ``vocab_size``
    restricts decoding to ids ``< vocab_size`` (to match a speculative run over a smaller shared vocabulary).
    ``fast_path``: as in :func:`decode.speculative_generate` (the lean Llama forward where supported).
    The stats count one verify step per target forward and active row, ``verify_time_s`` = target time after
    the prefill (``prefill_time_s``),
    ``drafted_tokens = accepted_tokens = 0`` and ``emitted_tokens`` = new tokens.
    """
    validate_sampling_args(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    io = setup_decoding((target,), input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, vocab_size,
                        spare=1)
    device, input_ids, buf = io.device, io.input_ids, io.buf
    bsz, prompt_len = input_ids.shape
    stats = AcceptanceStats()
    if max_new_tokens == 0:
        return GenerationOutput(finalize(buf, prompt_len), io.num_new, stats)

    wall_t0 = time.perf_counter()
    timer, prefill_timer = Timer(device), Timer(device)
    state = new_kv_state(target, bsz, device, prompt_len + max_new_tokens + 1, fast_path)
    with prefill_timer:
        prefill((state,), input_ids, io.attention_mask)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    sliced = io.vocab < output_vocab_size(target)
    _decode_steps(state, io, max_new_tokens, sliced, stats, timer, do_sample, sampling, generator)
    stats.verify_time_s, stats.prefill_time_s = timer.seconds, prefill_timer.seconds
    sync(device)
    stats.wall_time_s = time.perf_counter() - wall_t0
    return GenerationOutput(finalize(buf, prompt_len + max_new_tokens), io.num_new, stats)


def _decode_steps(state, io: DecodeSetup, max_new_tokens: int, sliced: bool, stats: AcceptanceStats, timer: Timer,
                  do_sample: bool, sampling: dict, generator) -> None:
    """One target forward per new token of every active row, from the prefilled ``state``: the tokens go into
    ``io.buf (B, P + max_new_tokens + 1)`` after each prompt and the per-row counts into ``io.num_new (B,)``; a row
    that emits an EOS retires (its rows leave the state). ``sliced``: keep only the logits of ids ``< io.vocab``."""
    buf, device, eos_t, vocab = io.buf, io.device, io.eos_t, io.vocab
    prompt_len, num_new_all = io.input_ids.shape[1], io.num_new
    rows = torch.arange(io.input_ids.shape[0], device=device)
    last = io.input_ids[:, -1]
    # tokens are collected on the device and written once at the end (or when rows retire): no per-step sync
    new_tokens: list[torch.Tensor] = []  # per step (b,) for the rows active since the last retirement
    written = 0  # steps already flushed into buf

    def flush() -> None:
        if new_tokens:
            block = torch.stack(new_tokens, 1)  # (b, steps since the last flush)
            buf[rows, prompt_len + written: prompt_len + written + block.shape[1]] = block
            new_tokens.clear()

    for step in range(max_new_tokens):
        with timer:
            logits = state.forward(last[:, None])[:, -1]  # (b, V)
        tok = _next_tokens(logits[:, :vocab] if sliced else logits, do_sample, sampling, generator)
        new_tokens.append(tok)
        stats.verify_steps += rows.numel()
        stats.emitted_tokens += rows.numel()
        last = tok
        if eos_t is not None and step + 1 < max_new_tokens:
            hit_eos = torch.isin(tok, eos_t)
            done_list = hit_eos.tolist()  # host sync only when an EOS can end rows early
            if any(done_list):
                flush()
                written = step + 1
                num_new_all[rows] = written
                keep_idx = [i for i, dn in enumerate(done_list) if not dn]
                if not keep_idx:
                    rows = rows[:0]
                    break
                sel = torch.tensor(keep_idx, dtype=torch.long, device=device)
                rows, last = rows[sel], last[sel]
                state.select_rows(sel)
    else:
        step = max_new_tokens - 1
    if rows.numel():
        flush()
        num_new_all[rows] = step + 1


def _next_tokens(logits: torch.Tensor, do_sample: bool, sampling: dict, generator) -> torch.Tensor:
    """``(b,)`` next tokens from ``logits (b, V)``: argmax, or a sample from the processed distribution
    (:func:`decode.sampling.process_logits`: temperature, top-k, top-p in transformers' order)."""
    if do_sample:
        return sample_tokens(process_logits(logits, **sampling), generator)
    return greedy_tokens(logits)
