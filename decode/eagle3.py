"""Speculative decoding with an EAGLE-3 head (:mod:`models.eagle3`; Li et al. 2025), lossless as the chain decoder.

The target runs as in :func:`decode.speculative_generate` (the same KV states, the same verification rule
:func:`decode.speculative.verify_block`: greedy argmax matching, or Leviathan et al. 2023, Algorithm 1), and its
verify forward also returns its hidden states at the head's three layers (``set_capture`` on the target's state:
the lean forward or Hugging Face's ``hidden_states``), so features cost no extra target work.

Per verify step (rows of a batch advance by different amounts, holes as in :class:`decode.common.KVState`):

1. **Catch-up.** The head's cache gets one entry per token the target has just verified: the pair
   (fused feature of the target at position ``t``, token ``x_{t+1}``) for ``t`` = the last emitted token and the
   accepted drafts; the last pair's state gives the first draft distribution. Its entries from the previous draft
   phase are dropped first (they were the head's guesses).
2. **Drafting.** Draft step ``j`` feeds (the head's own previous hidden state, the drafted token), as in training
   (training-time test, :meth:`models.eagle3.Eagle3Draft.unroll`: the same keys at every step).
3. **Verify** ``[last, d_1 .. d_G]`` in one target forward; accept; emit; crop the target's cache.

The first step drafts nothing (the head needs the target's state at the last prompt token, which the first target
forward computes); it emits the target's own first token, counted as a step with 0 drafts. Draft ids are mapped to
target ids through ``d2t``; under sampling the draft distribution ``q`` is the head's (temperature / top-k / top-p
over its draft vocabulary) placed on those target ids, zero elsewhere, so the rejection rule keeps the output exactly
the target's distribution. Draft-length policies (fixed, adaptive, confidence) act as in the chain decoder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from decode.common import GenerationOutput, finalize, prefill, setup_decoding
from decode.sampling import greedy_tokens, process_logits, sample_tokens
from decode.speculative import DraftLengthPolicy, LoopClock, _Block, _emit, _Rows, _validated_policy, _verify
from decode.speculative import speculative_generate as chain_generate
from decode.stats import AcceptanceStats

__all__ = ["Eagle3State", "eagle3_generate", "speculative_generate"]


def speculative_generate(target, draft, input_ids, attention_mask=None, **kwargs):
    """``decode.speculative_generate``: an EAGLE-3 head (``draft.is_eagle3``) goes to :func:`eagle3_generate`, a
    lookup draft (``draft.is_ngram``) to :func:`decode.ngram.ngram_generate`, a lookup in front of a trained draft
    (``draft.is_hybrid``) to :func:`decode.hybrid.hybrid_generate`, any other draft to
    :func:`decode.speculative.speculative_generate` (its docstring: the arguments).

    Raises:
        ValueError: what those raise; ``draft_tree`` with an EAGLE-3 head, a lookup or a hybrid draft (the chain only).
    """
    if getattr(draft, "is_hybrid", False):  # a lookup in front of a trained draft (decode/hybrid.py)
        from decode.hybrid import hybrid_generate

        if kwargs.pop("draft_tree", None) is not None:
            raise ValueError("draft_tree is not supported with a hybrid draft: use the chain (draft_tree=None).")
        return hybrid_generate(target, draft, input_ids, attention_mask, **kwargs)
    if getattr(draft, "is_ngram", False):  # a lookup draft (decode/ngram.py)
        from decode.ngram import ngram_generate

        if kwargs.pop("draft_tree", None) is not None:
            raise ValueError("draft_tree is not supported with a lookup draft: use the chain (draft_tree=None).")
        return ngram_generate(target, draft, input_ids, attention_mask, **kwargs)
    if not getattr(draft, "is_eagle3", False):
        return chain_generate(target, draft, input_ids, attention_mask, **kwargs)
    if kwargs.pop("draft_tree", None) is not None:
        raise ValueError("draft_tree is not supported with an EAGLE-3 head: use the chain (draft_tree=None).")
    return eagle3_generate(target, draft, input_ids, attention_mask, **kwargs)


class Eagle3State:
    """The head's cache: per slot ``K, V (B, cap, H_kv, D)``, ``valid (B, cap)`` bool; a slot's position is the
    number of valid slots before it in its row (as :class:`decode.common.KVState`)."""

    def __init__(self, head, batch_size: int, device: torch.device, capacity: int = 256):
        c = head.cfg
        self.head, self.cap, self.length = head, 0, 0
        self.dtype = head.fc.weight.dtype
        self.k = torch.empty(batch_size, 0, c.num_key_value_heads, c.head_dim, dtype=self.dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.num_valid = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._grow(max(16, capacity))

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.cap)
        b, n = self.valid.shape[0], self.length
        k = self.k.new_empty(b, cap, *self.k.shape[2:])
        v = self.v.new_empty(b, cap, *self.v.shape[2:])
        valid = torch.zeros(b, cap, dtype=torch.bool, device=self.valid.device)
        k[:, :n], v[:, :n], valid[:, :n] = self.k[:, :n], self.v[:, :n], self.valid[:, :n]
        self.k, self.v, self.valid, self.cap = k, v, valid, cap

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, token_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Append ``tokens (B, T)`` with their input features ``hidden (B, T, H)`` (``token_mask (B, T)``: 1 real, 0
        hole) and return the head's hidden states ``(B, T, H)`` (:class:`models.eagle3.Eagle3Layer`)."""
        head, c = self.head, self.head.cfg
        b, t = tokens.shape
        start, end = self.length, self.length + t
        if end > self.cap:
            self._grow(end + 64)
        tm = torch.ones_like(tokens) if token_mask is None else token_mask.to(torch.long)
        positions = self.num_valid[:, None] + tm.cumsum(1) - tm  # (B, T)
        q, k, v = head.midlayer.qkv(head.embed_tokens(tokens), hidden.to(self.dtype), positions)
        self.k[:, start:end], self.v[:, start:end], self.valid[:, start:end] = k, v, tm.bool()
        self.length, self.num_valid = end, self.num_valid + tm.sum(1)
        slot = torch.arange(end, device=tokens.device)
        qslot = slot[start:end]
        allowed = self.valid[:, None, :end] & (slot[None, :] <= qslot[:, None])[None]  # (B, T, L)
        allowed = allowed | (slot[None, :] == qslot[:, None])[None]  # a hole query sees itself: no empty row
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=tokens.device)
        mask = mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[:, None]  # (B, 1, T, L)
        groups = c.num_attention_heads // c.num_key_value_heads
        keys = self.k[:, :end].transpose(1, 2)  # (B, H_kv, L, D)
        vals = self.v[:, :end].transpose(1, 2)
        if groups > 1:
            keys, vals = keys.repeat_interleave(groups, 1), vals.repeat_interleave(groups, 1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask)  # (B, Hq, T, D)
        return head.midlayer.finish(hidden.to(self.dtype), o.transpose(1, 2).reshape(b, t, -1))

    def truncate(self, start: int, keep: torch.Tensor | None, max_keep: int) -> None:
        """As :meth:`decode.common.KVState.truncate`: the region after ``start`` keeps ``keep[b]`` slots per row."""
        new_len = start + max_keep
        self.length = new_len
        if keep is not None:
            region = self.valid[:, start:new_len]
            region &= torch.arange(max_keep, device=region.device)[None, :] < keep[:, None]
        self.num_valid = self.valid[:, :new_len].sum(1)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)
        self.valid, self.num_valid = self.valid.index_select(0, rows), self.num_valid.index_select(0, rows)


def _pending_pairs(feats: torch.Tensor, emitted: torch.Tensor, num_acc: torch.Tensor, n_max: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The catch-up pairs of each row, right-aligned: ``(tokens (b, w), features (b, w, 3H_t), mask (b, w) | None)``
    with ``w = n_max + 1``; row ``i`` has ``num_acc[i] + 1`` real pairs (block feature ``j``, emitted token ``j``)."""
    w = n_max + 1
    if int(num_acc.min()) == n_max:
        return emitted[:, :w], feats[:, :w], None
    slot = torch.arange(w, device=emitted.device)
    j = slot[None, :] - (w - 1 - num_acc[:, None])  # (b, w) index into the block; < 0: a hole
    real = j >= 0
    jj = j.clamp(min=0)
    toks = emitted.gather(1, jj)
    fts = feats.gather(1, jj[..., None].expand(-1, -1, feats.shape[-1]))
    return toks, fts, real.to(torch.long)


def _draft_phase(head, hstate: Eagle3State, pending, caps: list[int], policy: DraftLengthPolicy, d2t_ids,
                 vocab: int, do_sample: bool, sampling: dict, generator) -> tuple[_Block, int]:
    """Feed the catch-up ``pending`` pairs, then draft up to ``max(caps)`` tokens per row. Returns the block (target
    ids; ``probs (b, G, V)`` over target ids when sampling) and the head's cache length before its draft entries."""
    toks, fts, mask = pending
    b, steps, device = toks.shape[0], max(caps), toks.device
    hidden = hstate.forward(toks, head.fuse(fts), mask)[:, -1:]  # (b, 1, H)
    base = hstate.length
    capped = min(caps) != steps
    caps_t = torch.tensor(caps, dtype=torch.long, device=device) if capped else None
    tokens, probs, lengths, alive = [], [], None, None
    for j in range(steps):
        if j > 0:
            hidden = hstate.forward(tokens[-1][:, None], hidden)
        logits = head.logits(hidden)[:, -1].float()  # (b, N_d)
        q_d = process_logits(logits, **sampling) if do_sample else None
        d = sample_tokens(q_d, generator) if do_sample else greedy_tokens(logits)  # (b,) draft ids
        if policy.uses_confidence or capped:
            proposing = caps_t > j if capped else torch.ones(b, dtype=torch.bool, device=device)
            if policy.uses_confidence and j > 0:
                top = (q_d if q_d is not None else logits.softmax(-1)).amax(-1)
                alive = policy.keep_drafting(top) if alive is None else alive & policy.keep_drafting(top)
                proposing = proposing & alive
                if not bool(proposing.any()):
                    break
            lengths = (0 if lengths is None else lengths) + proposing.to(torch.long)
        tokens.append(d2t_ids[d])
        if do_sample:
            q = torch.zeros(b, vocab, dtype=q_d.dtype, device=device)
            q[:, d2t_ids] = q_d  # the draft's distribution on target ids (d2t ids < vocab: checked by the caller)
            probs.append(q)
    empty = torch.empty(b, 0, dtype=torch.long, device=device)
    block = _Block(torch.stack(tokens, 1) if tokens else empty, torch.stack(probs, 1) if probs else None,
                   lengths, 0, base, 0)
    return block, base


@torch.inference_mode()
def eagle3_generate(target, head, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    max_new_tokens: int, num_draft_tokens: int = 4, do_sample: bool = False, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, eos_token_id=None, pad_token_id: int | None = None,
                    generator: torch.Generator | None = None, draft_length_policy: DraftLengthPolicy | None = None,
                    vocab_size: int | None = None, fast_path: bool | None = None) -> GenerationOutput:
    """Speculative decoding of ``target`` with the EAGLE-3 head ``head`` (module docstring); the arguments and the
    result are those of :func:`decode.speculative_generate` (``input_ids (B, P)`` left padded, ``sequences (B, P +
    max_new_tokens)``), the output distributed exactly as the target's own decoding.

    Raises:
        ValueError: what :func:`decode.speculative_generate` raises, and a head whose draft vocabulary maps outside
            the target's decoded ids or whose feature layers are outside the target.
    """
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    policy = _validated_policy(target, head, num_draft_tokens, draft_length_policy, do_sample, sampling)
    io = setup_decoding((target,), input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                        vocab_size, spare=int(policy.max_draft_tokens) + 1)
    layers = head.cfg.target_layers
    n_layers = int(target.config.num_hidden_layers)
    if max(layers) >= n_layers:
        raise ValueError(f"the EAGLE-3 head reads target layers {list(layers)}, but the target has {n_layers}")
    d2t_ids = head.draft_to_target.to(io.device)
    if int(d2t_ids.max()) >= io.vocab:
        raise ValueError(f"the EAGLE-3 head proposes id {int(d2t_ids.max())}, outside the target's decoded ids "
                         f"[0, {io.vocab}): it was trained for another vocabulary")
    device, buf, vocab = io.device, io.buf, io.vocab
    bsz, prompt_len = io.input_ids.shape
    if max_new_tokens == 0:
        return GenerationOutput(finalize(buf, prompt_len), io.num_new, AcceptanceStats())
    clock = LoopClock(io, max_new_tokens, policy)
    stats, max_gamma, draft_timer, verify_timer = clock.stats, clock.max_gamma, clock.draft, clock.verify
    tstate, prefill_timer = clock.kv_state(target, fast_path), clock.prefill
    tstate.set_capture(layers)
    hstate = Eagle3State(head, bsz, device, clock.capacity)
    with prefill_timer:
        prefill((tstate,), io.input_ids, io.attention_mask)
        if prompt_len > 1:  # the prompt's pairs (feature t, token t + 1); a pad slot's pair is a hole
            pm = None if bool(io.attention_mask.all()) else io.attention_mask[:, :-1]
            hstate.forward(io.input_ids[:, 1:], head.fuse(tstate.features), pm)
    last = io.input_ids[:, -1]
    rows = _Rows(list(range(bsz)), torch.arange(bsz, device=device), [0] * bsz, last, last[:, None])
    pending = None
    while rows.ids:
        if pending is None:  # the first step: nothing to draft from yet
            block, base = _Block(torch.empty(len(rows.ids), 0, dtype=torch.long, device=device), None, None, 0,
                                 hstate.length, 0), hstate.length
        else:
            gamma = max(1, min(int(policy.propose_length()), max_gamma))
            caps = [min(gamma, max_new_tokens - t - 1) for t in rows.num_new]
            with draft_timer:
                block, base = _draft_phase(head, hstate, pending, caps, policy, d2t_ids, vocab, do_sample, sampling,
                                           generator)
        verify_start = tstate.length
        with verify_timer:
            target_logits = tstate.forward(torch.cat([rows.last[:, None], block.tokens], 1), None, logits_to_keep=0)
        feats = tstate.features  # (b, G + 1, 3 H_t)
        verdict = _verify(target_logits[..., :vocab], block, rows, max_new_tokens, io.eos_t, do_sample, sampling,
                          generator)
        _emit(buf, rows, verdict, prompt_len, io.pad)
        for k, n, m in zip(verdict.k, verdict.n, verdict.m):
            stats.record_step(k, n, m)
        if pending is not None:
            policy.update(verdict.k, verdict.n)
        n_max = max(verdict.n)
        tstate.truncate(verify_start, None if min(verdict.n) == n_max else verdict.num_accepted + 1, n_max + 1)
        hstate.truncate(base, None, 0)  # the draft entries go; the catch-up pairs stay
        rows.last = verdict.next_token
        pending = _pending_pairs(feats, verdict.emitted, verdict.num_accepted, n_max)
        if any(verdict.done):
            io.num_new[rows.index] = torch.tensor(rows.num_new, dtype=torch.long, device=device)
            keep = [i for i, d in enumerate(verdict.done) if not d]
            if keep:
                sel = torch.tensor(keep, dtype=torch.long, device=device)
                rows.ids, rows.num_new = [rows.ids[i] for i in keep], [rows.num_new[i] for i in keep]
                rows.index, rows.last = rows.index[sel], rows.last[sel]
                tstate.select_rows(sel)
                hstate.select_rows(sel)
                pending = tuple(None if x is None else x[sel] for x in pending)
            else:
                rows.ids = []
    return clock.finish(io)
