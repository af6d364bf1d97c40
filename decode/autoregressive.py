"""Target-only autoregressive decoding with a KV cache: the baseline speculative decoding must match and beat."""
from __future__ import annotations

import torch

from ._common import (
    GenerationOutput,
    KVState,
    Timer,
    finalize,
    first_stop,
    model_device,
    normalize_eos,
    output_vocab_size,
    prepare_inputs,
    write_tokens,
)
from .sampling import greedy_tokens, process_logits, sample_tokens, validate_sampling_args
from .stats import AcceptanceStats

__all__ = ["autoregressive_generate"]


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
) -> GenerationOutput:
    """Decode one token per target forward (KV cache), with the same sampling pipeline and stopping rules as
    :func:`decode.speculative_generate`.

    Args / returns / errors: as :func:`decode.speculative_generate` without the draft arguments. ``vocab_size``
    restricts decoding to ids ``< vocab_size`` (to match a speculative run over a smaller shared vocabulary).
    The stats count one verify step per target forward and active row, ``verify_time_s`` = target time,
    ``drafted_tokens = accepted_tokens = 0`` and ``emitted_tokens`` = new tokens.
    """
    validate_sampling_args(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    device = model_device(target)
    input_ids, attention_mask = prepare_inputs(input_ids, attention_mask, max_new_tokens, device)
    eos = normalize_eos(eos_token_id)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    vocab = output_vocab_size(target)
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (got {vocab_size!r}).")
        vocab = min(vocab, int(vocab_size))

    bsz, prompt_len = input_ids.shape
    stats = AcceptanceStats()
    buf = torch.full((bsz, prompt_len + max_new_tokens + 1), pad, dtype=torch.long, device=device)
    buf[:, :prompt_len] = input_ids
    num_new_all = torch.zeros(bsz, dtype=torch.long, device=device)
    if max_new_tokens == 0:
        return GenerationOutput(finalize(buf, prompt_len), num_new_all, stats)

    timer = Timer(device)
    state = KVState(target, bsz, device)
    if prompt_len > 1:
        with timer:
            state.forward(input_ids[:, :-1], attention_mask[:, :-1])
    rows = torch.arange(bsz, device=device)
    last = input_ids[:, -1]
    num_new_t = torch.zeros(bsz, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        with timer:
            logits = state.forward(last[:, None], torch.ones_like(last[:, None]))[:, -1, :vocab]  # (b, V)
        if do_sample:
            tok = sample_tokens(process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p), generator)
        else:
            tok = greedy_tokens(logits)
        one = torch.ones_like(tok)
        num_emit, hit_eos = first_stop(tok[:, None], one, eos_t)
        write_tokens(buf, rows, prompt_len + num_new_t, tok[:, None], num_emit, pad)
        num_new_t = num_new_t + 1
        stats.verify_steps += rows.numel()
        stats.emitted_tokens += rows.numel()
        last = tok
        if eos_t is not None and step + 1 < max_new_tokens:
            done_list = hit_eos.tolist()  # host sync only when an EOS can end rows early
            if any(done_list):
                num_new_all[rows] = num_new_t
                keep_idx = [i for i, dn in enumerate(done_list) if not dn]
                if not keep_idx:
                    rows = rows[:0]
                    break
                sel = torch.tensor(keep_idx, dtype=torch.long, device=device)
                rows, last, num_new_t = rows[sel], last[sel], num_new_t[sel]
                state.select_rows(sel)
    if rows.numel():
        num_new_all[rows] = num_new_t
    stats.verify_time_s = timer.seconds
    return GenerationOutput(finalize(buf, prompt_len + max_new_tokens), num_new_all, stats)
