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

Draft-length policies: how many tokens the draft proposes per verify step.

The decoder asks :meth:`DraftLengthPolicy.propose_length` for the step's draft length gamma, asks
:meth:`DraftLengthPolicy.keep_drafting` after every drafted token (per row, from the draft's top probability), and
reports the outcome with :meth:`DraftLengthPolicy.update`. Policies only look at the draft's own distribution and at
past outcomes, never at the current step's target output, so rejection sampling stays exact.

Policies are stateful (the adaptive one learns across calls); create a fresh one (``make_policy``) per run when
independent runs are wanted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from decode.common import (
    DecodeSetup,
    GenerationOutput,
    Timer,
    finalize,
    first_stop,
    model_device,
    new_kv_state,
    prefill,
    setup_decoding,
    sync,
    write_tokens,
)
from decode.sampling import greedy_tokens, process_logits, sample_tokens, uniform, validate_sampling_args
from decode.stats import AcceptanceStats

__all__ = [
    'DraftLengthPolicy', 'FixedDraftLength', 'AdaptiveDraftLength', 'ConfidenceDraftLength', 'make_policy',
    'speculative_generate', 'verify_block',
]


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low} (got {value!r}).")
    return value


class DraftLengthPolicy:
    """Base class. Subclasses set ``max_draft_tokens`` and override what they need."""

    #: whether :meth:`keep_drafting` can stop a row early (the decoder then checks it after every draft token)
    uses_confidence: bool = False
    max_draft_tokens: int = 1

    def propose_length(self) -> int:
        """Draft length gamma (>= 1) for the next verify step."""
        raise NotImplementedError

    def keep_drafting(self, top_prob: torch.Tensor) -> torch.Tensor:
        """``top_prob (B,)``: the draft's highest probability for the next token -> ``(B,)`` bool, True = draft it."""
        return torch.ones_like(top_prob, dtype=torch.bool)

    def update(self, draft_lengths: Sequence[int], accepted_lengths: Sequence[int]) -> None:
        """Outcome of one verify step, one entry per active row: tokens proposed and tokens accepted."""

    def reset(self) -> None:
        """Forget learned state."""


class FixedDraftLength(DraftLengthPolicy):
    """Always propose ``num_draft_tokens`` tokens (the classic constant gamma)."""

    def __init__(self, num_draft_tokens: int = 4):
        self.max_draft_tokens = self.num_draft_tokens = _check_int("num_draft_tokens", num_draft_tokens, 1)

    def propose_length(self) -> int:
        return self.num_draft_tokens

    def __repr__(self) -> str:
        return f"FixedDraftLength({self.num_draft_tokens})"


class AdaptiveDraftLength(DraftLengthPolicy):
    """Grow or shrink gamma from a sliding window of recent block outcomes.

    After every ``window`` row-steps: if every block in the window was fully accepted, gamma grows by ``step``;
    otherwise it shrinks by ``step``; always clamped to ``[min_draft_tokens, max_draft_tokens]``. The window is then
    cleared so each decision uses fresh evidence (``window=1`` reproduces the Hugging Face "heuristic" schedule
    with symmetric steps).
    """

    def __init__(
        self,
        initial: int = 4,
        min_draft_tokens: int = 1,
        max_draft_tokens: int = 8,
        window: int = 4,
        step: int = 1,
    ):
        self.min_draft_tokens = _check_int("min_draft_tokens", min_draft_tokens, 1)
        self.max_draft_tokens = _check_int("max_draft_tokens", max_draft_tokens, 1)
        if self.max_draft_tokens < self.min_draft_tokens:
            raise ValueError(
                f"max_draft_tokens ({max_draft_tokens}) must be >= min_draft_tokens ({min_draft_tokens})."
            )
        self.initial = _check_int("initial", initial, 1)
        if not (min_draft_tokens <= initial <= max_draft_tokens):
            raise ValueError(
                f"initial must be in [min_draft_tokens, max_draft_tokens] = [{min_draft_tokens}, {max_draft_tokens}]"
                f" (got {initial})."
            )
        self.window = _check_int("window", window, 1)
        self.step = _check_int("step", step, 1)
        self.reset()

    def reset(self) -> None:
        self.current = self.initial
        self._recent: deque[bool] = deque(maxlen=self.window)

    def propose_length(self) -> int:
        return self.current

    def update(self, draft_lengths: Sequence[int], accepted_lengths: Sequence[int]) -> None:
        for k, n in zip(draft_lengths, accepted_lengths):
            if k <= 0:  # nothing was drafted (final token of a row): no evidence
                continue
            self._recent.append(n >= k)
            if len(self._recent) == self.window:
                delta = self.step if all(self._recent) else -self.step
                self.current = min(self.max_draft_tokens, max(self.min_draft_tokens, self.current + delta))
                self._recent.clear()

    def __repr__(self) -> str:
        return (
            f"AdaptiveDraftLength(current={self.current}, min={self.min_draft_tokens}, max={self.max_draft_tokens},"
            f" window={self.window}, step={self.step})"
        )


class ConfidenceDraftLength(DraftLengthPolicy):
    """Draft up to ``max_draft_tokens``, stopping a row when the draft's top probability falls below ``threshold``.

    The first token of a block is always drafted; a later token is drafted only if the draft's highest next-token
    probability (after the shared sampling pipeline; softmax of the raw logits for greedy) is ``>= threshold``.
    """

    uses_confidence = True

    def __init__(self, max_draft_tokens: int = 8, threshold: float = 0.5):
        self.max_draft_tokens = _check_int("max_draft_tokens", max_draft_tokens, 1)
        if not isinstance(threshold, (int, float)) or not (0.0 <= threshold <= 1.0):
            raise ValueError(f"threshold must be a float in [0, 1] (got {threshold!r}).")
        self.threshold = float(threshold)

    def propose_length(self) -> int:
        return self.max_draft_tokens

    def keep_drafting(self, top_prob: torch.Tensor) -> torch.Tensor:
        return top_prob >= self.threshold

    def __repr__(self) -> str:
        return f"ConfidenceDraftLength(max_draft_tokens={self.max_draft_tokens}, threshold={self.threshold})"


_POLICIES = {
    "fixed": FixedDraftLength,
    "adaptive": AdaptiveDraftLength,
    "confidence": ConfidenceDraftLength,
}


def make_policy(name: str, **cfg) -> DraftLengthPolicy:
    """Build a policy by name: ``"fixed"`` | ``"adaptive"`` | ``"confidence"``; ``cfg`` goes to its constructor.

    Raises:
        ValueError: unknown name, or invalid/unknown configuration keys.
    """
    if name not in _POLICIES:
        raise ValueError(f"unknown draft length policy {name!r}; expected one of {sorted(_POLICIES)}.")
    try:
        return _POLICIES[name](**cfg)
    except TypeError as e:
        raise ValueError(f"invalid configuration for draft length policy {name!r}: {e}") from e


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


@dataclass
class _Rows:
    """The rows still decoding. ``ids``/``index``: their original batch rows (host list / device tensor);
    ``num_new``: tokens emitted so far per row (host); ``last (b,)``: last emitted token, not yet in the target's
    cache; ``pending (b, w)``: tokens not yet in the draft's cache (w = 1, or 2 after a fully accepted block), with
    ``pending_mask (b, w)`` (1 real, 0 hole; ``None``: all real)."""

    ids: list[int]
    index: torch.Tensor
    num_new: list[int]
    last: torch.Tensor
    pending: torch.Tensor
    pending_mask: torch.Tensor | None = None


@dataclass
class _Block:
    """One draft phase. ``tokens (b, G)`` drafted, ``probs (b, G, V)`` the distributions q they were drawn from
    (sampling; ``None`` for greedy), ``lengths (b,)`` tokens proposed per row (``None``: all ``G``), ``fed`` drafted
    tokens already in the draft's cache, ``cache_start`` the draft cache length before the phase, ``width`` the
    pending tokens fed first."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    lengths: torch.Tensor | None
    fed: int
    cache_start: int
    width: int


@dataclass
class _Verdict:
    """Acceptance of one verify step, on the host: per row tokens proposed ``k``, accepted ``n``, emitted ``m``
    (``n + 1``, or fewer at an EOS) and whether the row is finished; on the device ``emitted (b, G+1)`` (the
    accepted drafts then the correction / bonus token) and ``next_token (b,)``."""

    k: list[int]
    n: list[int]
    m: list[int]
    done: list[bool]
    emitted: torch.Tensor
    next_token: torch.Tensor
    num_accepted: torch.Tensor


def _draft(dstate, rows: _Rows, caps: list[int], policy: DraftLengthPolicy, vocab: int, do_sample: bool,
           sampling: dict, generator) -> _Block:
    """Up to ``max(caps)`` draft tokens per row, autoregressively through the draft's cache (row ``i`` proposes at
    most ``caps[i]``; a confidence policy may stop rows earlier)."""
    b, steps, device = len(rows.ids), max(caps), rows.last.device
    capped = min(caps) != steps
    caps_t = torch.tensor(caps, dtype=torch.long, device=device) if capped else None  # (b,)
    confidence = policy.uses_confidence
    tokens, probs, lengths, alive, forwards = [], [], None, None, 0
    start, width = dstate.length, rows.pending.shape[1]
    feed, feed_mask = rows.pending, rows.pending_mask
    for j in range(steps):
        logits = dstate.forward(feed, feed_mask)[:, -1, :vocab]  # (b, V)
        forwards += 1
        q = process_logits(logits, **sampling) if do_sample else None  # (b, V)
        d = sample_tokens(q, generator) if do_sample else greedy_tokens(logits)  # (b,)
        if confidence or capped:
            proposing = caps_t > j if capped else torch.ones(b, dtype=torch.bool, device=device)
            if confidence and j > 0:
                top = (q if q is not None else logits.float().softmax(-1)).amax(-1)  # (b,)
                alive = policy.keep_drafting(top) if alive is None else alive & policy.keep_drafting(top)
                proposing = proposing & alive
                if not bool(proposing.any()):
                    break
            lengths = (0 if lengths is None else lengths) + proposing.to(torch.long)
        tokens.append(d)
        if do_sample:
            probs.append(q)
        feed, feed_mask = d[:, None], None
    fed = max(0, forwards - 1)  # drafted tokens in the draft's cache (forward j > 0 fed token j - 1)
    empty = torch.empty(b, 0, dtype=torch.long, device=device)
    return _Block(torch.stack(tokens, 1) if tokens else empty, torch.stack(probs, 1) if probs else None,
                  lengths, fed, start, width)


def _verify(target_logits: torch.Tensor, block: _Block, rows: _Rows, max_new_tokens: int, eos_t, do_sample: bool,
            sampling: dict, generator) -> _Verdict:
    """:func:`verify_block` on the step's target logits ``(b, G+1, V)``, the cut at the first EOS, and one host
    sync for every decision the loop takes."""
    num_acc, next_tok = verify_block(target_logits, block.tokens, block.probs, block.lengths, do_sample=do_sample,
                                     generator=generator, **sampling)
    emitted = torch.cat([block.tokens, next_tok[:, None]], 1)  # (b, G+1)
    emitted.scatter_(1, num_acc[:, None], next_tok[:, None])  # the extra token right after the accepted prefix
    # Fetch only what the host cannot know: accepted counts, plus proposed counts / EOS cuts when they vary.
    fetch = [num_acc]
    if block.lengths is not None:
        fetch.append(block.lengths)
    if eos_t is not None:
        num_emit, hit_eos = first_stop(emitted, num_acc + 1, eos_t)
        fetch += [num_emit, hit_eos.long()]
    host = torch.stack(fetch).tolist() if len(fetch) > 1 else [num_acc.tolist()]  # the one host sync
    n = host[0]
    k = host[1] if block.lengths is not None else [block.tokens.shape[1]] * len(n)
    m, hit = (host[-2], host[-1]) if eos_t is not None else ([x + 1 for x in n], [0] * len(n))
    done = [bool(h) or t + mi >= max_new_tokens for h, t, mi in zip(hit, rows.num_new, m)]
    return _Verdict(k, n, m, done, emitted, next_tok, num_acc)


def _emit(buf: torch.Tensor, rows: _Rows, v: _Verdict, prompt_len: int, pad: int) -> None:
    """Write each row's emitted tokens after its earlier ones and count them."""
    if len(rows.ids) <= 8:  # a few rows: one slice copy each is cheaper than building index tensors
        for i, (row, t, mi) in enumerate(zip(rows.ids, rows.num_new, v.m)):
            buf[row, prompt_len + t:prompt_len + t + mi] = v.emitted[i, :mi]
    else:
        start = torch.tensor([prompt_len + t for t in rows.num_new], dtype=torch.long, device=buf.device)  # (b,)
        write_tokens(buf, rows.index, start, v.emitted, torch.tensor(v.m, dtype=torch.long, device=buf.device), pad)
    rows.num_new = [t + mi for t, mi in zip(rows.num_new, v.m)]


def _roll_back(tstate, dstate, rows: _Rows, block: _Block, v: _Verdict, verify_start: int) -> None:
    """Crop both caches to the accepted prefix (rows that accepted fewer keep holes) and set what each model has
    not seen yet: the target the extra token; the draft the extra token, after the last drafted token when a row
    accepted every draft (that token was drafted but never fed back)."""
    uniform = min(v.n) == max(v.n)
    max_acc = max(v.n)
    tstate.truncate(verify_start, None if uniform else v.num_accepted + 1, max_acc + 1)  # last + accepted stay
    g = block.tokens.shape[1]
    if g > 0:
        keep = v.num_accepted.clamp(max=block.fed) + block.width
        dstate.truncate(block.cache_start, None if uniform else keep, block.width + min(max_acc, block.fed))
    rows.last = v.next_token
    catch_up = [n > block.fed for n in v.n] if g > 0 else [False]
    if not any(catch_up):  # (g == 0 only when every row had one token left: every row is done)
        rows.pending, rows.pending_mask = v.next_token[:, None], None
    elif all(catch_up):
        rows.pending, rows.pending_mask = torch.stack([block.tokens[:, -1], v.next_token], 1), None  # (b, 2)
    else:
        need = v.num_accepted > block.fed  # (b,)
        rows.pending = torch.stack([torch.where(need, block.tokens[:, -1], v.next_token), v.next_token], 1)
        rows.pending_mask = torch.stack([need.to(torch.long), torch.ones_like(need, dtype=torch.long)], 1)


def _retire(tstate, dstate, rows: _Rows, done: list[bool], num_new_all: torch.Tensor) -> None:
    """Record the final counts of every row and drop the finished ones from the batch and both caches."""
    num_new_all[rows.index] = torch.tensor(rows.num_new, dtype=torch.long, device=num_new_all.device)
    keep = [i for i, d in enumerate(done) if not d]
    if len(keep) == len(done) or not keep:
        rows.ids = [rows.ids[i] for i in keep]
        return
    sel = torch.tensor(keep, dtype=torch.long, device=rows.index.device)
    rows.ids, rows.num_new = [rows.ids[i] for i in keep], [rows.num_new[i] for i in keep]
    rows.index, rows.last, rows.pending = rows.index[sel], rows.last[sel], rows.pending[sel]
    rows.pending_mask = rows.pending_mask[sel] if rows.pending_mask is not None else None
    tstate.select_rows(sel)
    if dstate is not None:  # None: a draft without a cache (decode/ngram.py)
        dstate.select_rows(sel)


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
        eos_token_id: int or list of ints ending a row (the EOS is kept); ``None`` (default) = the target's
            ``generation_config.eos_token_id`` as ``generate`` does (:func:`decode.common.default_eos`); ``[]`` =
            never stop early.
        pad_token_id: fill after EOS (default: the first EOS id, else 0).
        generator: ``torch.Generator`` making sampling reproducible (same seed and inputs -> same output).
        draft_length_policy: a :mod:`decode.speculative` policy (default ``FixedDraftLength(num_draft_tokens)``).
        vocab_size: optional tokenizer vocabulary size, to exclude padded ids both models share.
        fast_path: run supported Llama models through the lean forward of :mod:`decode.fast_llama` (same math,
            no Hugging Face wrapper overhead): ``None`` = wherever supported, per model; ``False`` = always the
            Hugging Face forward; ``True`` = require it (``ValueError`` for an unsupported model).
        draft: or, through ``decode.speculative_generate`` (:func:`decode.eagle3.speculative_generate`), an EAGLE-3
            head (:class:`models.eagle3.Eagle3Draft`), decoded by :func:`decode.eagle3.eagle3_generate`.
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
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    policy = _validated_policy(target, draft, num_draft_tokens, draft_length_policy, do_sample, sampling)
    inputs = (input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, vocab_size)
    if draft_tree is not None:  # token trees live in decode/tree.py
        if draft_length_policy is not None:
            raise ValueError("draft_tree and draft_length_policy cannot be combined: the tree fixes the draft shape; "
                             "pass one of them.")
        io = setup_decoding((target, draft), *inputs, spare=0)
        return _tree_generate(target, draft, io, draft_tree, max_new_tokens, do_sample, sampling, generator, fast_path)
    # buf (B, P + max_new_tokens + G + 1): a block's overhang
    io = setup_decoding((target, draft), *inputs, spare=int(policy.max_draft_tokens) + 1)
    return _chain_generate(target, draft, io, policy, max_new_tokens, do_sample, sampling, generator, fast_path)


def _validated_policy(target, draft, num_draft_tokens, draft_length_policy, do_sample: bool, sampling: dict
                      ) -> DraftLengthPolicy:
    """The call's draft-length policy (``draft_length_policy``, else ``FixedDraftLength(num_draft_tokens)``), once
    the arguments every speculative call shares are checked.

    Raises:
        ValueError: ``num_draft_tokens`` not an int >= 1, bad sampling arguments
            (:func:`decode.sampling.validate_sampling_args`), models on different devices, a policy that is not a
            :class:`~decode.speculative.DraftLengthPolicy`.
    """
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1 (got {num_draft_tokens!r}).")
    validate_sampling_args(do_sample=do_sample, **sampling)
    _check_models(target, draft, model_device(target))
    policy = draft_length_policy if draft_length_policy is not None else FixedDraftLength(num_draft_tokens)
    if not isinstance(policy, DraftLengthPolicy):
        raise ValueError(f"draft_length_policy must be a decode.speculative.DraftLengthPolicy (got {policy!r}).")
    return policy


class LoopClock:
    """What a speculative decoding loop counts and times (the chain's and :mod:`decode.eagle3`'s): the pooled
    :class:`~decode.stats.AcceptanceStats`, the output width, the largest gamma, the draft / verify / prefill timers
    and the wall clock from construction; :meth:`finish` writes the times into the stats and returns the output."""

    def __init__(self, io: DecodeSetup, max_new_tokens: int, policy: DraftLengthPolicy):
        self.stats, self.width_out = AcceptanceStats(), io.input_ids.shape[1] + max_new_tokens
        self.max_gamma = int(policy.max_draft_tokens)
        self.wall_t0 = time.perf_counter()
        self.draft, self.verify, self.prefill = Timer(io.device), Timer(io.device), Timer(io.device)
        self.capacity, self.batch, self.device = self.width_out + self.max_gamma + 2, io.input_ids.shape[0], io.device

    def kv_state(self, model, fast_path):
        """A KV state for ``model`` with room for the whole output and a block's overhang."""
        return new_kv_state(model, self.batch, self.device, self.capacity, fast_path)

    def finish(self, io: DecodeSetup) -> GenerationOutput:
        s = self.stats
        s.draft_time_s, s.verify_time_s, s.prefill_time_s = self.draft.seconds, self.verify.seconds, self.prefill.seconds
        sync(io.device)
        s.wall_time_s = time.perf_counter() - self.wall_t0
        return GenerationOutput(finalize(io.buf, self.width_out), io.num_new, s)


def _chain_generate(target, draft, io: DecodeSetup, policy: DraftLengthPolicy, max_new_tokens: int,
                    do_sample: bool, sampling: dict, generator, fast_path) -> GenerationOutput:
    """Chain speculative decoding of the validated inputs ``io`` (:func:`decode.common.setup_decoding`, ``buf``
    with room for a block's overhang): per verify step the draft proposes up to gamma tokens per row
    (:func:`_draft`), the target scores them in one forward, :func:`_verify` accepts, both caches roll back
    (:func:`_roll_back`) and finished rows retire (:func:`_retire`). Returns ``sequences (B, P + max_new_tokens)``."""
    device, input_ids, buf, vocab = io.device, io.input_ids, io.buf, io.vocab
    bsz, prompt_len = input_ids.shape
    if max_new_tokens == 0:
        return GenerationOutput(finalize(buf, prompt_len), io.num_new, AcceptanceStats())
    clock = LoopClock(io, max_new_tokens, policy)
    stats, max_gamma, draft_timer, verify_timer = clock.stats, clock.max_gamma, clock.draft, clock.verify
    tstate, dstate, prefill_timer = clock.kv_state(target, fast_path), clock.kv_state(draft, fast_path), clock.prefill
    with prefill_timer:
        prefill((tstate, dstate), input_ids, io.attention_mask)
    last = input_ids[:, -1]  # (B,)
    rows = _Rows(list(range(bsz)), torch.arange(bsz, device=device), [0] * bsz, last, last[:, None])
    while rows.ids:
        gamma = max(1, min(int(policy.propose_length()), max_gamma))
        # never draft tokens that cannot be emitted: at most remaining - 1 (the extra token fills the last slot)
        caps = [min(gamma, max_new_tokens - t - 1) for t in rows.num_new]
        with draft_timer:
            block = _draft(dstate, rows, caps, policy, vocab, do_sample, sampling, generator)
        verify_start = tstate.length
        with verify_timer:  # one target forward over the last emitted token and the drafts
            target_logits = tstate.forward(torch.cat([rows.last[:, None], block.tokens], 1), None, logits_to_keep=0)
        verdict = _verify(target_logits[..., :vocab], block, rows, max_new_tokens, io.eos_t, do_sample, sampling,
                          generator)
        _emit(buf, rows, verdict, prompt_len, io.pad)
        for k, n, m in zip(verdict.k, verdict.n, verdict.m):
            stats.record_step(k, n, m)
        policy.update(verdict.k, verdict.n)
        _roll_back(tstate, dstate, rows, block, verdict, verify_start)
        if any(verdict.done):
            _retire(tstate, dstate, rows, verdict.done, io.num_new)

    return clock.finish(io)


def _tree_generate(target, draft, io, draft_tree, max_new_tokens: int, do_sample: bool, sampling: dict, generator,
                   fast_path) -> GenerationOutput:
    """``speculative_generate(..., draft_tree=...)``: token-tree drafting of :mod:`decode.tree`, batch size 1.

    Raises:
        ValueError: a batch of more than one row; a malformed tree spec.
    """
    from decode.tree import parse_draft_tree, tree_generate

    tree = parse_draft_tree(draft_tree)
    if io.input_ids.shape[0] != 1:
        raise ValueError(f"draft_tree supports batch size 1 only (got a batch of {io.input_ids.shape[0]}): decode "
                         "one prompt per call, or use the chain (draft_tree=None) for batches.")
    return tree_generate(target, draft, io, tree=tree, max_new_tokens=max_new_tokens, do_sample=do_sample,
                         sampling=sampling, generator=generator, fast_path=fast_path)
