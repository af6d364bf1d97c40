"""Speculative decoding with exact verification (Leviathan et al. 2023; Chen et al. 2023).

Per verify step: the draft proposes up to gamma tokens autoregressively (with its own KV cache); the target scores
the last emitted token plus all drafted tokens in ONE forward pass; each row accepts the longest valid prefix and
emits one more token (the correction on a rejection, or the bonus token when all drafted tokens were accepted).

- Greedy: drafted token ``d_j`` is accepted iff it equals the target's argmax at that position; the emitted extra
  token is the target's argmax, so the output is the target's own greedy output token for token.
- Sampling (Leviathan et al. 2023, Algorithm 1 / Chen et al. 2023, Algorithm 2): accept ``d_j ~ q_j`` with
  probability ``min(1, p_j(d_j) / q_j(d_j))``; on the first rejection emit a token drawn from the residual
  ``norm(max(0, p_j - q_j))``; if all are accepted draw the bonus token from ``p_{gamma+1}``. The output then has
  exactly the target's distribution p (after the shared temperature / top-k / top-p pipeline).

Caches: both models keep a ``DynamicCache`` across steps. Rejected slots are cropped (or masked as holes when rows
in a batch advanced by different amounts); the accepted prefix is never recomputed. The draft catches up on the
last accepted draft token and the bonus token inside its next drafting forward (two tokens in one pass).
"""
from __future__ import annotations

import time

import torch

from ._common import (
    GenerationOutput,
    Timer,
    finalize,
    first_stop,
    model_device,
    new_kv_state,
    normalize_eos,
    output_vocab_size,
    prepare_inputs,
    sync,
    write_tokens,
)
from .policies import DraftLengthPolicy, FixedDraftLength
from .sampling import greedy_tokens, process_logits, sample_tokens, uniform, validate_sampling_args
from .stats import AcceptanceStats

__all__ = ["speculative_generate", "verify_block"]


def verify_block(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_lengths: torch.Tensor | None,
    *,
    do_sample: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure verification rule of one speculative step.

    Args:
        target_logits: ``(B, G+1, V)`` target logits; position ``j`` is the distribution of the token after
            the last emitted token and ``draft_tokens[:, :j]``.
        draft_tokens: ``(B, G)`` int64 drafted tokens.
        draft_probs: ``(B, G, V)`` float32 draft distributions ``q_j`` the tokens were drawn from (sampling only;
            ``None`` for greedy).
        draft_lengths: ``(B,)`` int64 tokens actually proposed per row (``<= G``); later columns are ignored.
            ``None``: every row proposed all ``G``.
    Returns:
        ``(num_accepted (B,), next_token (B,))``: accepted draft tokens per row (``0..draft_lengths``) and the extra
        token emitted after them (correction drawn from ``norm(max(0, p - q))`` on a rejection, bonus from ``p``
        otherwise; Leviathan et al. 2023, Algorithm 1). Greedy: the target's argmax.
    """
    bsz, g = draft_tokens.shape
    if draft_lengths is None:
        in_block = None
    else:
        slot = torch.arange(g, device=draft_tokens.device)
        in_block = slot[None, :] < draft_lengths[:, None]  # (B, G)
    if not do_sample:
        tgt = greedy_tokens(target_logits)  # (B, G+1)
        accept = draft_tokens == tgt[:, :g]
        if in_block is not None:
            accept = accept & in_block
        num_accepted = accept.to(torch.long).cumprod(1).sum(1)  # (B,) length of the accepted prefix
        return num_accepted, tgt.gather(1, num_accepted[:, None]).squeeze(1)
    rows = torch.arange(bsz, device=draft_tokens.device)
    p = process_logits(target_logits, temperature=temperature, top_k=top_k, top_p=top_p)  # (B, G+1, V)
    if g > 0:
        p_d = p[:, :g].gather(2, draft_tokens[..., None]).squeeze(-1)  # (B, G)
        q_d = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # (B, G)
        u = uniform((bsz, g), device=p.device, generator=generator)
        # accept with probability min(1, p/q)  <=>  u * q < p   (q > 0 because the token was drawn from q)
        accept = u * q_d < p_d
        if in_block is not None:
            accept = accept & in_block
        num_accepted = accept.to(torch.long).cumprod(1).sum(1)
        rejected = num_accepted < (draft_lengths if draft_lengths is not None else g)  # (B,)
        q_at = draft_probs[rows, num_accepted.clamp(max=g - 1)] * rejected[:, None]  # (B, V), 0 for the bonus
    else:
        num_accepted = torch.zeros(bsz, dtype=torch.long, device=p.device)
        q_at = torch.zeros_like(p[:, 0])
    p_at = p[rows, num_accepted]  # (B, V)
    residual = (p_at - q_at).clamp_min(0.0)  # max(0, p - q); equals p for the bonus token
    # sum 0 is impossible after a rejection in exact arithmetic (it implies p == q); fall back to p if rounding hits it
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return num_accepted, sample_tokens(residual, generator)


def _check_models(target, draft, device):
    if model_device(draft) != device:
        raise ValueError(f"target and draft must be on the same device (target {device}, draft {model_device(draft)}).")


@torch.inference_mode()
def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    num_draft_tokens: int = 4,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    draft_length_policy: DraftLengthPolicy | None = None,
    vocab_size: int | None = None,
    fast_path: bool | None = None,
    draft_tree=None,
) -> GenerationOutput:
    """Generate with speculative decoding; the output is distributed exactly as the target's own decoding.

    Args:
        target, draft: causal LMs (Hugging Face ``*ForCausalLM`` taking ``cache=``) on the same device, sharing a
            tokenizer. Their logit sizes may differ (padded embedding rows): only the shared ids
            ``[0, min(V_target, V_draft, vocab_size))`` are compared and proposed, so a padded id is never emitted.
        input_ids: ``(B, P)`` int64 prompts, left padded for ``B > 1``.
        attention_mask: ``(B, P)`` 1 for real tokens, 0 for left padding (default: all ones).
        max_new_tokens: new tokens per row (>= 0), reached exactly unless the row hits EOS; never overshot.
        num_draft_tokens: gamma (>= 1), tokens the draft proposes per verify step (ignored when
            ``draft_length_policy`` is given).
        do_sample: False = greedy (argmax of raw logits), True = sampling with temperature / top-k / top-p
            (transformers semantics, shared by p and q; see :func:`decode.sampling.process_logits`).
        eos_token_id: int or list of ints ending a row (the EOS is kept); ``None`` = never stop early.
        pad_token_id: fill after EOS (default: the first EOS id, else 0).
        generator: ``torch.Generator`` making sampling reproducible (same seed and inputs -> same output).
        draft_length_policy: a :mod:`decode.policies` policy (default ``FixedDraftLength(num_draft_tokens)``).
        vocab_size: optional tokenizer vocabulary size, to exclude padded ids both models share.
        fast_path: run supported Llama models through the lean forward of :mod:`decode.fast_llama` (same math,
            no Hugging Face wrapper overhead): ``None`` = wherever supported, per model; ``False`` = always the
            Hugging Face forward; ``True`` = require it (``ValueError`` for an unsupported model).
        draft_tree: ``None`` (default) = the chain above; a :class:`decode.tree.TokenTree` /
            :class:`decode.tree.DynamicTokenTree` (or a spec string such as ``"3,2,1"``, see
            :func:`decode.tree.parse_draft_tree`) = token-tree drafting, all nodes verified in one target forward
            with a tree attention mask (batch size 1; ``num_draft_tokens`` and ``draft_length_policy`` unused).
    Returns:
        :class:`GenerationOutput` with ``sequences (B, P + max_new_tokens)``, ``num_new_tokens (B,)`` and
        :class:`~decode.stats.AcceptanceStats` (row-steps; draft/verify seconds from ``time.perf_counter``).
    Raises:
        ValueError: ``num_draft_tokens < 1``, ``max_new_tokens < 0``, ``temperature < 0`` (or 0 with
            ``do_sample``), ``top_p`` outside (0, 1], ``top_k < 0``, bad shapes / right padding, models on
            different devices; a ``draft_tree`` with a batch > 1 or with a ``draft_length_policy``.
    """
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1 (got {num_draft_tokens!r}).")
    validate_sampling_args(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    device = model_device(target)
    _check_models(target, draft, device)
    input_ids, attention_mask = prepare_inputs(input_ids, attention_mask, max_new_tokens, device)
    policy = draft_length_policy if draft_length_policy is not None else FixedDraftLength(num_draft_tokens)
    if not isinstance(policy, DraftLengthPolicy):
        raise ValueError(f"draft_length_policy must be a decode.policies.DraftLengthPolicy (got {policy!r}).")
    eos = normalize_eos(eos_token_id)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
    eos_set = set(eos)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    vocab = min(output_vocab_size(target), output_vocab_size(draft))
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (got {vocab_size!r}).")
        vocab = min(vocab, int(vocab_size))
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    if draft_tree is not None:  # token trees live in decode/tree.py
        from .tree import parse_draft_tree, tree_generate

        tree = parse_draft_tree(draft_tree)
        if input_ids.shape[0] != 1:
            raise ValueError(f"draft_tree supports batch size 1 only (got a batch of {input_ids.shape[0]}): decode "
                             "one prompt per call, or use the chain (draft_tree=None) for batches.")
        if draft_length_policy is not None:
            raise ValueError("draft_tree and draft_length_policy cannot be combined: the tree fixes the draft shape; "
                             "pass one of them.")
        return tree_generate(target, draft, input_ids, attention_mask, tree=tree, max_new_tokens=max_new_tokens,
                             do_sample=do_sample, sampling=sampling, eos=eos, pad=pad, generator=generator,
                             vocab=vocab, fast_path=fast_path)

    bsz, prompt_len = input_ids.shape
    stats = AcceptanceStats()
    max_gamma = int(policy.max_draft_tokens)
    width_out = prompt_len + max_new_tokens
    buf = torch.full((bsz, width_out + max_gamma + 1), pad, dtype=torch.long, device=device)
    buf[:, :prompt_len] = input_ids
    num_new_all = torch.zeros(bsz, dtype=torch.long, device=device)
    if max_new_tokens == 0:
        return GenerationOutput(finalize(buf, prompt_len), num_new_all, stats)

    wall_t0 = time.perf_counter()
    draft_timer, verify_timer, prefill_timer = Timer(device), Timer(device), Timer(device)
    capacity = width_out + max_gamma + 2
    tstate = new_kv_state(target, bsz, device, capacity, fast_path)
    dstate = new_kv_state(draft, bsz, device, capacity, fast_path)
    # Prefill everything but the last prompt token; that token is fed with the first drafted / verified block.
    prompt_mask = None if bool(attention_mask.all()) else attention_mask
    if prompt_len > 1:
        pm = None if prompt_mask is None else prompt_mask[:, :-1]
        with prefill_timer:
            tstate.forward(input_ids[:, :-1], pm)
            dstate.forward(input_ids[:, :-1], pm)
    rows = torch.arange(bsz, device=device)  # original row of each active row
    rows_list = list(range(bsz))
    last = input_ids[:, -1]  # (b,) last emitted token, not yet in the target cache
    pending = last[:, None]  # (b, w) tokens not yet in the draft cache (w = 1 or 2)
    pending_mask = None  # (b, w) 1 real, 0 hole; None = all real
    num_new = [0] * bsz  # per active row (host copy, refreshed once per step)
    num_new_t = torch.zeros(bsz, dtype=torch.long, device=device)
    confidence = policy.uses_confidence
    target_vocab = output_vocab_size(target)
    draft_vocab = output_vocab_size(draft)

    while rows_list:
        b = len(rows_list)
        gamma = max(1, min(int(policy.propose_length()), max_gamma))
        # never draft tokens that cannot be emitted: at most remaining - 1 (the extra token fills the last slot)
        caps_list = [min(gamma, max_new_tokens - n - 1) for n in num_new]
        steps = max(caps_list)
        uniform_caps = min(caps_list) == steps  # every row drafts `steps` tokens unless confidence stops it
        caps = None if uniform_caps else torch.tensor(caps_list, dtype=torch.long, device=device)  # (b,)

        # ---------------------------------------------------------------- draft phase
        drafts: list[torch.Tensor] = [last]  # last, then d_1..d_G: stacked into the verify block
        probs: list[torch.Tensor] = []
        fed = 0  # drafted tokens already in the draft cache
        draft_start = dstate.length
        width = pending.shape[1]
        lengths = None  # (b,) tokens proposed per row; None = `steps` for every row
        with draft_timer:
            alive = None
            tokens, tokens_mask = pending, pending_mask
            for j in range(steps):
                logits = dstate.forward(tokens, tokens_mask)[:, -1]  # (b, V_draft)
                if vocab < draft_vocab:
                    logits = logits[:, :vocab]
                if j > 0:
                    fed += 1
                if do_sample:
                    q = process_logits(logits, **sampling)  # (b, V)
                    d = sample_tokens(q, generator)
                    probs.append(q)
                else:
                    q, d = None, greedy_tokens(logits)
                if confidence or caps is not None:
                    if lengths is None:
                        lengths = torch.zeros(b, dtype=torch.long, device=device)
                    proposing = caps > j if caps is not None else torch.ones(b, dtype=torch.bool, device=device)
                    if confidence and j > 0:
                        top = (q if q is not None else logits.float().softmax(-1)).amax(-1)
                        alive = policy.keep_drafting(top) if alive is None else alive & policy.keep_drafting(top)
                        proposing = proposing & alive
                        if not bool(proposing.any()):
                            if do_sample:
                                probs.pop()
                            break
                    lengths = lengths + proposing
                drafts.append(d)
                tokens, tokens_mask = d[:, None], None
        g = len(drafts) - 1
        block = torch.stack(drafts, 1)  # (b, G+1): last emitted token, then the drafted tokens
        draft_tokens = block[:, 1:]  # (b, G)
        draft_probs = torch.stack(probs, 1) if probs else None  # (b, G, V)

        # ---------------------------------------------------------------- verify: one target forward
        verify_start = tstate.length
        with verify_timer:
            target_logits = tstate.forward(block, None, logits_to_keep=0)  # (b, G+1, V_target)
        if vocab < target_vocab:
            target_logits = target_logits[..., :vocab]

        # ---------------------------------------------------------------- accept, emit, stop rules
        if not do_sample:
            # Greedy: d_j is accepted iff it equals the target's argmax, so the emitted tokens of a row are exactly
            # the target's argmaxes tgt[:, :n+1]. One host sync fetches tgt and the drafts; the decisions are made
            # on the host (no per-step tensor bookkeeping).
            tgt = greedy_tokens(target_logits)  # (b, G+1)
            parts = [tgt, draft_tokens] + ([lengths[:, None]] if lengths is not None else [])
            host = torch.cat(parts, 1).tolist() if len(parts) > 1 else tgt.tolist()
            n_list, m_list, k_list, done_list = [], [], [], []
            for i, row in enumerate(host):
                k = row[2 * g + 1] if lengths is not None else caps_list[i] if caps is not None else g
                n = 0
                while n < k and row[g + 1 + n] == row[n]:
                    n += 1
                m = n + 1  # <= tokens left: never more than caps + 1 were possible
                hit = False
                if eos_set:
                    for j in range(m):
                        if row[j] in eos_set:
                            m, hit = j + 1, True
                            break
                num_new[i] += m
                n_list.append(n)
                m_list.append(m)
                k_list.append(k)
                done_list.append(hit or num_new[i] >= max_new_tokens)
            emitted = tgt
            if b == 1:
                num_acc = None
                next_tok = tgt[:, n_list[0]]  # (1,)
            else:
                num_acc = torch.tensor(n_list, dtype=torch.long, device=device)
                next_tok = tgt.gather(1, num_acc[:, None]).squeeze(1)  # (b,)
        else:
            num_acc, next_tok = verify_block(
                target_logits, draft_tokens, draft_probs, lengths, do_sample=True, generator=generator, **sampling
            )
            emitted = torch.cat([draft_tokens, next_tok[:, None]], 1)  # (b, G+1)
            if g > 0:
                emitted.scatter_(1, num_acc[:, None], next_tok[:, None])  # slots after it are never written out
            num_emit, hit_eos = first_stop(emitted, num_acc + 1, eos_t)
            lens_t = lengths if lengths is not None else torch.full_like(num_acc, g)
            # one host sync per step for all bookkeeping decisions
            k_list, n_list, m_list, hit_list = torch.stack([lens_t, num_acc, num_emit, hit_eos.long()]).tolist()
            num_new = [t + m for t, m in zip(num_new, m_list)]
            done_list = [bool(h) or t >= max_new_tokens for h, t in zip(hit_list, num_new)]
        if b == 1:
            start = prompt_len + num_new[0] - m_list[0]
            buf[rows_list[0], start:start + m_list[0]] = emitted[0, :m_list[0]]
        else:
            num_emit = torch.tensor(m_list, dtype=torch.long, device=device)
            write_tokens(buf, rows, prompt_len + num_new_t, emitted, num_emit, pad)
            num_new_t = num_new_t + num_emit
        for k_i, n_i, m_i in zip(k_list, n_list, m_list):
            stats.record_step(k_i, n_i, m_i)
        policy.update(k_list, n_list)

        # ---------------------------------------------------------------- roll caches back to the accepted prefix
        max_acc = max(n_list)
        tstate.truncate(verify_start, None if b == 1 else num_acc + 1, max_acc + 1)  # last + accepted drafts stay
        if g > 0:
            dstate.truncate(draft_start, None if b == 1 else width + num_acc.clamp(max=fed), width + min(max_acc, fed))
        last = next_tok
        if g > 0 and max_acc > fed:
            # a row that accepted all G never fed d_G to the draft: it needs d_G and the bonus token
            if b == 1:
                pending_mask = None
                if do_sample:
                    pending = torch.cat([draft_tokens[:, -1:], next_tok[:, None]], 1)  # (1, 2)
                else:  # all G accepted: d_G == tgt[:, G-1] and the bonus token is tgt[:, G]
                    pending = tgt[:, g - 1:]  # (1, 2)
            else:
                catch_up = num_acc > fed
                pending = torch.stack([torch.where(catch_up, draft_tokens[:, -1], next_tok), next_tok], 1)  # (b, 2)
                pending_mask = torch.stack([catch_up.to(torch.long), torch.ones_like(num_acc)], 1)
        else:
            # (g == 0 only when every row had one token left, so every row is done below)
            pending, pending_mask = next_tok[:, None], None

        # ---------------------------------------------------------------- retire finished rows
        if any(done_list):
            keep_idx = [i for i, dn in enumerate(done_list) if not dn]
            if b == 1:
                num_new_all[rows_list[0]] = num_new[0]
            else:
                num_new_all[rows] = num_new_t
            if not keep_idx:
                break
            sel = torch.tensor(keep_idx, dtype=torch.long, device=device)
            rows, last, pending = rows[sel], last[sel], pending[sel]
            pending_mask = pending_mask[sel] if pending_mask is not None else None
            num_new = [num_new[i] for i in keep_idx]
            rows_list = [rows_list[i] for i in keep_idx]
            num_new_t = torch.tensor(num_new, dtype=torch.long, device=device)
            tstate.select_rows(sel)
            dstate.select_rows(sel)

    stats.draft_time_s = draft_timer.seconds
    stats.verify_time_s = verify_timer.seconds
    stats.prefill_time_s = prefill_timer.seconds
    sync(device)
    stats.wall_time_s = time.perf_counter() - wall_t0
    return GenerationOutput(finalize(buf, width_out), num_new_all, stats)
