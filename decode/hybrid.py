"""A lookup draft with a trained draft behind it: the lookup proposes where the text matches, the model elsewhere.

SuffixDecoding's hybrid mode (Oliaro et al. 2024, Sec. 4.4) on our chain decoder: at every verify step each row
first asks its lookup draft (:class:`decode.ngram.NgramDraft`, ``prompt_lookup`` or ``suffix``) for a proposal;
rows with one verify it, rows without one draft with the trained model (any causal LM the chain decoder takes), in
the same target forward. A lookup costs microseconds and a model draft ``k c`` target forwards, so the lookup takes
the steps where copying is likely and the model the rest: on a CPU, where a draft pays only when it is accepted often
or nearly free, this is how a trained draft can pay on text that copies its prompt and on text that does not.

Verification is :func:`decode.speculative.verify_block` over the mixed block: greedy output is the target's own
(every accepted token is the target's argmax), and under sampling a row's proposal is the model's ``q`` or the
lookup's one-hot ``q_j = onehot(d_j)`` (Leviathan et al. 2023, Algorithm 1), so the output has exactly the target's
distribution either way (the choice of proposer per row depends only on the text so far, never on the target's
output at this step).

The draft model's cache: a row whose step the lookup took never fed its tokens to the model, so its accepted tokens
and the extra token wait in that row's pending list, fed (left-padded with holes, one forward for the whole batch)
the next time the model drafts. :attr:`decode.stats.AcceptanceStats.lookup_drafted_tokens` counts the drafted
tokens the lookup proposed; the evaluation scales the model's cost ratio by the rest (``eval/metrics.py``).

Names: the draft spec ``ngram:<kind>+<draft dir>`` (:func:`hybrid_spec`), named ``<kind>+<draft name>`` in reports
and ``routing.json``; ``eval.hybrid_lookups`` lists the lookup kinds put in front of every trained draft evaluated.
"""
from __future__ import annotations

import torch

from decode.common import GenerationOutput, finalize, prefill, setup_decoding
from decode.ngram import NGRAM_KINDS, NgramDraft, lookup_lists, lookup_spec, verify_step
from decode.speculative import LoopClock, _Block, _draft, _retire, _Rows, _validated_policy
from decode.stats import AcceptanceStats

__all__ = ["HybridDraft", "hybrid_generate", "hybrid_spec", "parse_hybrid_spec", "hybrid_name"]

_SEP = "+"


def hybrid_spec(kind: str, draft_path) -> str:
    """The draft "path" naming a lookup of ``kind`` in front of the trained draft at ``draft_path``:
    ``ngram:<kind>+<draft_path>``."""
    return lookup_spec(kind) + _SEP + str(draft_path)


def hybrid_name(kind: str, draft_name: str) -> str:
    """The report's name of a hybrid: ``<kind>+<draft name>`` (e.g. ``suffix+distilled``)."""
    return f"{kind}{_SEP}{draft_name}"


def parse_hybrid_spec(path) -> tuple[str, str] | None:
    """``(kind, draft path)`` of an ``ngram:<kind>+<draft path>`` spec; None for anything else.

    Raises:
        ValueError: ``ngram:<kind>+...`` with an unknown kind, no draft path after the ``+``, or another spec there."""
    s = str(path)
    head = lookup_spec("")
    if not s.startswith(head) or _SEP not in s:
        return None
    kind, _, draft = s[len(head):].partition(_SEP)
    if kind not in NGRAM_KINDS:
        raise ValueError(f"unknown lookup draft {kind!r} in {s!r}: use ngram:<kind>+<draft dir> with <kind> one of "
                         f"{list(NGRAM_KINDS)}")
    if not draft:
        raise ValueError(f"{s!r} names no trained draft after '+': use ngram:{kind}+<draft dir>")
    if draft.startswith(head):
        raise ValueError(f"{s!r}: a lookup goes in front of a trained draft's directory, not of another lookup: use "
                         f"ngram:{kind}+<draft dir>, or ngram:{kind} alone")
    return kind, draft


class HybridDraft(torch.nn.Module):
    """A lookup draft in front of a trained draft (module docstring), for :func:`decode.speculative_generate`
    (``is_hybrid`` routes it to :func:`hybrid_generate`).

    Args:
        lookup: the :class:`decode.ngram.NgramDraft` asked first (its suffix store, its settings).
        model: the trained draft (a causal LM the chain decoder takes; not an EAGLE-3 head).

    Raises:
        ValueError: ``lookup`` is not a lookup draft, or ``model`` is a lookup draft or an EAGLE-3 head.
    """

    is_hybrid = True

    def __init__(self, lookup: NgramDraft, model: torch.nn.Module):
        super().__init__()
        if not getattr(lookup, "is_ngram", False):
            raise ValueError(f"HybridDraft needs a decode.ngram.NgramDraft in front, got {type(lookup).__name__}")
        if getattr(model, "is_ngram", False) or getattr(model, "is_eagle3", False) or getattr(model, "is_hybrid", False):
            raise ValueError("HybridDraft's model must be a trained token draft (a causal LM), not a lookup draft, "
                             "an EAGLE-3 head or another hybrid")
        self.lookup, self.model = lookup, model
        self.config = getattr(model, "config", None)  # the decoder's vocabulary and cache checks read the model's

    def settings(self) -> dict:
        """The lookup's settings, with ``fallback: model`` (what ``serving.json`` and the report show)."""
        return {**self.lookup.settings(), "fallback": "model"}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.lookup.settings().items())

    # the lookup's suffix store, as for a lookup draft (decode/ngram.py)
    def use_domain(self, domain: str) -> None:
        self.lookup.use_domain(domain)

    def observe(self, answer, domain: str | None = None) -> None:
        self.lookup.observe(answer, domain)

    def clear_store(self, domain: str | None = None) -> None:
        self.lookup.clear_store(domain)


def _pending(pend: dict[int, list[int]], ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's tokens the model's cache lacks, left-padded with holes: ``(tokens (b, W), mask (b, W) or None)``."""
    width = max(len(pend[r]) for r in ids)
    if all(len(pend[r]) == width for r in ids):
        return torch.tensor([pend[r] for r in ids], dtype=torch.long, device=device), None
    toks = [[pend[r][0]] * (width - len(pend[r])) + pend[r] for r in ids]
    mask = [[0] * (width - len(pend[r])) + [1] * len(pend[r]) for r in ids]
    return (torch.tensor(toks, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device))


def _merged(props: list[list[int]], mblock: _Block | None, use_model: list[bool], pad: int, vocab: int,
            do_sample: bool, device) -> _Block:
    """One block from each row's lookup proposal or, where ``use_model``, the model's drafts (``mblock``)."""
    b = len(props)
    m_len = (mblock.lengths.tolist() if mblock.lengths is not None else [mblock.tokens.shape[1]] * b) \
        if mblock is not None else [0] * b
    lengths = [m_len[i] if use_model[i] else len(props[i]) for i in range(b)]
    g = max([len(p) for p in props] + [mblock.tokens.shape[1] if mblock is not None else 0])
    tokens = torch.full((b, g), pad, dtype=torch.long, device=device)
    if mblock is not None and mblock.tokens.shape[1]:
        tokens[:, :mblock.tokens.shape[1]] = mblock.tokens
    for i, p in enumerate(props):
        if p and not use_model[i]:
            tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long, device=device)
            tokens[i, len(p):] = p[-1]  # filler the verdict ignores (beyond the row's length)
    probs = None
    if do_sample and g:
        probs = torch.zeros(b, g, vocab, device=device)
        probs.scatter_(2, tokens[..., None], 1.0)  # lookup rows: q_j = onehot(d_j) (and filler past any length)
        if mblock is not None and mblock.probs is not None:
            rows_m = torch.tensor([i for i in range(b) if use_model[i]], dtype=torch.long, device=device)
            probs[rows_m, :mblock.probs.shape[1]] = mblock.probs[rows_m][..., :vocab]
    lens = torch.tensor(lengths, dtype=torch.long, device=device)
    return _Block(tokens, probs, lens, 0, 0, 1)


@torch.inference_mode()
def hybrid_generate(target, draft: HybridDraft, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    *, max_new_tokens: int, num_draft_tokens: int = 4, do_sample: bool = False,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id=None,
                    pad_token_id: int | None = None, generator: torch.Generator | None = None,
                    draft_length_policy=None, vocab_size: int | None = None, fast_path: bool | None = None
                    ) -> GenerationOutput:
    """Speculative decoding with a hybrid draft (module docstring); the arguments and the output are those of
    :func:`decode.speculative.speculative_generate` (no ``draft_tree``): ``input_ids (B, P)`` left padded, output
    ``sequences (B, P + max_new_tokens)``, the target's own greedy output (exactly its distribution when sampling).
    The draft timer counts the lookups and the model's drafting; ``stats.lookup_drafted_tokens`` the lookup's share.

    Raises:
        ValueError: as :func:`decode.speculative.speculative_generate`; ``draft`` not a :class:`HybridDraft`.
    """
    if not getattr(draft, "is_hybrid", False):
        raise ValueError(f"hybrid_generate needs a decode.hybrid.HybridDraft, got {type(draft).__name__}")
    model, lookup = draft.model, draft.lookup
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    policy = _validated_policy(target, model, num_draft_tokens, draft_length_policy, do_sample, sampling)
    io = setup_decoding((target, model), input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                        vocab_size, spare=int(policy.max_draft_tokens) + 1)
    bsz, prompt_len = io.input_ids.shape
    if max_new_tokens == 0:
        return GenerationOutput(finalize(io.buf, prompt_len), io.num_new, AcceptanceStats())
    clock = LoopClock(io, max_new_tokens, policy)
    tstate, dstate = clock.kv_state(target, fast_path), clock.kv_state(model, fast_path)
    with clock.prefill:
        prefill((tstate, dstate), io.input_ids, io.attention_mask)
    mask = io.attention_mask.bool().cpu()
    ids_host = io.input_ids.cpu()
    hists = {i: lookup.history(ids_host[i][mask[i]].tolist()) for i in range(bsz)}
    last = io.input_ids[:, -1]
    pend = {i: [int(t)] for i, t in enumerate(last.tolist())}  # per row: tokens not yet in the model's cache
    rows = _Rows(list(range(bsz)), torch.arange(bsz, device=io.device), [0] * bsz, last, last[:, None])
    while rows.ids:
        gamma = max(1, min(int(policy.propose_length()), clock.max_gamma))
        caps = [min(gamma, max_new_tokens - t - 1) for t in rows.num_new]
        with clock.draft:
            props = lookup_lists(lookup, hists, rows, caps, policy, io.vocab)
            use_model = [cap > 0 and not p for p, cap in zip(props, caps)]
            mblock = None
            if any(use_model):  # the model drafts for the whole batch; rows the lookup took keep the lookup's
                rows.pending, rows.pending_mask = _pending(pend, rows.ids, io.device)
                mcaps = [cap if u else 0 for cap, u in zip(caps, use_model)]
                mblock = _draft(dstate, rows, mcaps, policy, io.vocab, do_sample, sampling, generator)
            block = _merged(props, mblock, use_model, io.pad, io.vocab, do_sample, io.device)
        v, verify_start, emitted = verify_step(tstate, block, rows, hists, io, clock, max_new_tokens, do_sample,
                                               sampling, generator)
        for i, (k, n, m) in enumerate(zip(v.k, v.n, v.m)):
            clock.stats.record_step(k, n, m)
            if not use_model[i]:
                clock.stats.lookup_drafted_tokens += k
        policy.update(v.k, v.n)
        tstate.truncate(verify_start, None if min(v.n) == max(v.n) else v.num_accepted + 1, max(v.n) + 1)
        if mblock is not None:  # the model's cache: what it fed stays where it was right, the rest waits in pend
            fed, width = mblock.fed, mblock.width
            keep = []
            for i, row in enumerate(rows.ids):
                n_in = min(v.n[i], fed) if use_model[i] else 0  # the model's own accepted drafts it already fed
                keep.append(width + n_in)
                pend[row] = emitted[i][n_in:v.m[i]]
            keep_t = torch.tensor(keep, dtype=torch.long, device=io.device)
            dstate.truncate(mblock.cache_start, None if min(keep) == max(keep) else keep_t, max(keep))
        else:
            for i, row in enumerate(rows.ids):
                pend[row] = pend[row] + emitted[i][:v.m[i]]
        rows.last = v.next_token
        rows.pending, rows.pending_mask = v.next_token[:, None], None  # rebuilt from pend before the model drafts
        if any(v.done):
            _retire(tstate, dstate, rows, v.done, io.num_new)
    return clock.finish(io)
