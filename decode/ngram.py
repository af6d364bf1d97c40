"""Drafts that cost nothing: n-gram lookup over the text itself, verified by the target like every draft.

Two kinds (:class:`NgramDraft`), no weights and no training:

- ``prompt_lookup`` (prompt lookup decoding, Saxena 2023; transformers' ``prompt_lookup_num_tokens``, vLLM's
  ``ngram`` method): the last ``n`` tokens of the row's text (prompt and tokens generated so far), for ``n`` from
  ``max_ngram`` down to ``min_ngram``, are looked up earlier in that text; the first ``n`` that matches proposes the
  tokens that followed its most recent earlier occurrence, up to the step's draft length.
- ``suffix`` (after SuffixDecoding, Oliaro et al. 2024): the same longest match, over the row's text and a bounded
  per-domain store of earlier answers (:meth:`NgramDraft.observe`), and the proposal grows one token at a time by
  frequency: among the occurrences still matching, the most frequent next token, while its share of them is at least
  ``min_share`` (the share is the draft's confidence: the confidence draft-length policy reads it). So it proposes
  where earlier text agrees, and nothing where it does not.

A row whose text has no match proposes zero tokens: its step is a plain target step (one forward over the last
token). Verification is :func:`decode.speculative.verify_block`: greedy accepts a drafted token iff it is the
target's argmax (the output is the target's greedy output); under sampling the proposal is a one-hot draft
distribution ``q`` (Leviathan et al. 2023, Algorithm 1 with ``q_j = onehot(d_j)``): ``d_j`` is accepted with
probability ``p_j(d_j)``, a rejection draws from ``norm(max(0, p_j - onehot(d_j)))``, so the output has exactly the
target's distribution. Rows of a batch propose different lengths (``lengths``), as in the chain decoder.
"""
from __future__ import annotations

from collections import Counter, deque

import torch

from decode.common import GenerationOutput, finalize, prefill, setup_decoding
from decode.speculative import LoopClock, _Block, _emit, _retire, _Rows, _validated_policy, _verify
from decode.stats import AcceptanceStats

__all__ = ["NGRAM_KINDS", "NgramDraft", "NgramIndex", "ngram_generate", "lookup_lists", "lookup_spec", "parse_lookup_spec",
           "verify_step"]

NGRAM_KINDS = ("prompt_lookup", "suffix")
_SPEC = "ngram:"


def lookup_spec(kind: str) -> str:
    """The draft "path" that names a lookup draft in ``eval.drafts`` and ``routing.json``: ``ngram:<kind>``."""
    return _SPEC + kind


def parse_lookup_spec(path) -> str | None:
    """``kind`` of an ``ngram:<kind>`` draft spec, None for anything else (a checkpoint path, or a lookup in front of
    a trained draft, ``ngram:<kind>+<draft dir>``: :func:`decode.hybrid.parse_hybrid_spec`).

    Raises:
        ValueError: ``ngram:<kind>`` with an unknown kind."""
    s = str(path)
    if not s.startswith(_SPEC) or "+" in s:
        return None
    kind = s[len(_SPEC):]
    if kind not in NGRAM_KINDS:
        raise ValueError(f"unknown lookup draft {s!r}: use one of {[lookup_spec(k) for k in NGRAM_KINDS]}")
    return kind


class NgramIndex:
    """A growing token sequence with, for every ``n`` in ``[min_n, max_n]``, where each n-gram ends: ``ends(key)``
    lists the end positions (exclusive) of the earlier occurrences of the n-gram ``key``, oldest first. Appending
    a token costs ``max_n - min_n + 1`` dictionary updates; a lookup is one dictionary read."""

    def __init__(self, min_n: int, max_n: int, tokens=()):
        self.min_n, self.max_n = int(min_n), int(max_n)
        self.tokens: list[int] = []
        self._ends: dict[tuple, list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        toks = self.tokens
        for t in tokens:
            toks.append(int(t))
            end = len(toks)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends.setdefault(tuple(toks[end - n:end]), []).append(end)

    def ends(self, key: tuple) -> list[int]:
        return self._ends.get(key, [])

    def __len__(self) -> int:
        return len(self.tokens)


class NgramDraft(torch.nn.Module):
    """A lookup draft for :func:`decode.speculative_generate` (module docstring); ``is_ngram`` routes it to
    :func:`ngram_generate`.

    Args:
        kind: ``prompt_lookup`` or ``suffix``.
        min_ngram, max_ngram: the n-gram sizes matched, longest first (``1 <= min_ngram <= max_ngram``).
        min_share: ``suffix``: a token is proposed only while it follows at least this share of the matching
            occurrences (in (0, 1]).
        max_store_tokens: ``suffix``: answer tokens kept per domain store (oldest answers dropped first).
        max_occurrences: ``suffix``: the most recent matching occurrences counted per lookup.

    Raises:
        ValueError: an unknown kind or a setting out of range.
    """

    is_ngram = True

    def __init__(self, kind: str = "prompt_lookup", *, min_ngram: int = 2, max_ngram: int = 4,
                 min_share: float = 0.5, max_store_tokens: int = 65536, max_occurrences: int = 64):
        super().__init__()
        if kind not in NGRAM_KINDS:
            raise ValueError(f"lookup draft kind must be one of {list(NGRAM_KINDS)}, got {kind!r}")
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise ValueError(f"decode.lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if not 0 < float(min_share) <= 1:
            raise ValueError(f"decode.lookup.min_share must be in (0, 1], got {min_share}")
        if int(max_store_tokens) < 0 or int(max_occurrences) < 1:
            raise ValueError("decode.lookup.max_store_tokens must be >= 0 and decode.lookup.max_occurrences >= 1, "
                             f"got {max_store_tokens} and {max_occurrences}")
        self.kind, self.min_ngram, self.max_ngram = kind, int(min_ngram), int(max_ngram)
        self.min_share, self.max_store_tokens, self.max_occurrences = (float(min_share), int(max_store_tokens),
                                                                       int(max_occurrences))
        # no weights: a zero-size parameter gives the decoder the device it runs on
        self.anchor = torch.nn.Parameter(torch.zeros(0), requires_grad=False)
        self._stores: dict[str, deque] = {}
        self._index: dict[str, NgramIndex] = {}
        self.domain = "default"

    def settings(self) -> dict:
        """The settings (what ``serving.json`` and the report show)."""
        out = {"kind": self.kind, "min_ngram": self.min_ngram, "max_ngram": self.max_ngram}
        if self.kind == "suffix":
            out.update(min_share=self.min_share, max_store_tokens=self.max_store_tokens,
                       max_occurrences=self.max_occurrences)
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings().items())

    # ------------------------------------------------------------------ the suffix store
    def use_domain(self, domain: str) -> None:
        """Select the store later lookups read and :meth:`observe` writes (one per domain)."""
        self.domain = str(domain)

    def observe(self, answer, domain: str | None = None) -> None:
        """Add one finished answer (token ids) to the store of ``domain`` (default: the selected one); only the
        ``suffix`` kind reads stores. The decoder never calls this: a caller adds answers once they are final, so
        a repeated decode of the same prompt never sees its own answer."""
        if self.kind != "suffix" or self.max_store_tokens == 0:
            return
        d = self.domain if domain is None else str(domain)
        store = self._stores.setdefault(d, deque())
        store.append([int(t) for t in answer])
        total = sum(len(a) for a in store)
        while total > self.max_store_tokens and len(store) > 1:
            total -= len(store.popleft())
        self._index.pop(d, None)  # rebuilt on the next lookup

    def clear_store(self, domain: str | None = None) -> None:
        """Forget the answers of ``domain`` (None: every domain)."""
        for d in ([domain] if domain is not None else list(self._stores)):
            self._stores.pop(d, None)
            self._index.pop(d, None)

    def _store_index(self) -> NgramIndex | None:
        if self.kind != "suffix" or not self._stores.get(self.domain):
            return None
        idx = self._index.get(self.domain)
        if idx is None:  # answers joined by a separator no token equals, so no n-gram spans two answers
            idx = NgramIndex(self.min_ngram, self.max_ngram)
            for a in self._stores[self.domain]:
                idx.extend(a)
                idx.tokens.append(-1)
            self._index[self.domain] = idx
        return idx

    # ------------------------------------------------------------------ proposals
    def history(self, tokens) -> NgramIndex:
        """A row's text (its prompt ids) as an :class:`NgramIndex` the decoder extends with emitted tokens."""
        return NgramIndex(self.min_ngram, self.max_ngram, tokens)

    def propose(self, hist: NgramIndex, max_tokens: int) -> tuple[list[int], list[float]]:
        """``(tokens, confidences)``: up to ``max_tokens`` drafted ids after ``hist``'s text, with the share of
        matching occurrences each token followed (1.0 for ``prompt_lookup``); empty without a match."""
        if max_tokens <= 0:
            return [], []
        toks, length = hist.tokens, len(hist.tokens)
        store = self._store_index()
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            key = tuple(toks[length - n:])
            ends = hist.ends(key)  # ascending; the text's own last n tokens end at `length`
            own = ends[:-1] if ends and ends[-1] == length else ends
            if self.kind == "prompt_lookup":
                if own:
                    e = own[-1]  # the most recent earlier occurrence
                    out = toks[e:e + max_tokens]
                    return out, [1.0] * len(out)
                continue
            occ = [(toks, e) for e in own[-self.max_occurrences:]]
            if store is not None:
                occ += [(store.tokens, e) for e in store.ends(key)[-self.max_occurrences:]]
            if occ:
                return self._walk(occ, max_tokens)
        return [], []

    def _walk(self, occ: list[tuple[list[int], int]], max_tokens: int) -> tuple[list[int], list[float]]:
        out, conf = [], []
        while len(out) < max_tokens and occ:
            nxt = Counter(seq[e] for seq, e in occ if e < len(seq) and seq[e] >= 0)
            if not nxt:
                break
            tok, count = nxt.most_common(1)[0]
            share = count / len(occ)
            if share < self.min_share:
                break
            out.append(tok)
            conf.append(share)
            occ = [(seq, e + 1) for seq, e in occ if e < len(seq) and seq[e] == tok]
        return out, conf


def lookup_lists(draft: NgramDraft, hists: dict, rows: _Rows, caps: list[int], policy, vocab: int) -> list[list[int]]:
    """One lookup per row (its text so far, ``hists[row]``), at most ``caps[i]`` tokens, cut by the policy's
    confidence test and before any id outside ``[0, vocab)``: the proposed ids per row (``[]``: no match)."""
    props = []
    for row, cap in zip(rows.ids, caps):
        toks, conf = draft.propose(hists[row], cap)
        bad = next((j for j, t in enumerate(toks) if not 0 <= t < vocab), None)  # an id the decoder never emits
        toks = toks if bad is None else toks[:bad]
        if policy.uses_confidence and toks:
            k = 1
            while k < len(toks) and bool(policy.keep_drafting(torch.tensor([conf[k]]))[0]):
                k += 1
            toks = toks[:k]
        props.append(toks)
    return props


def _proposals(draft: NgramDraft, hists: dict, rows: _Rows, caps: list[int], policy, pad: int, vocab: int,
               do_sample: bool, device) -> _Block:
    """One lookup per row (:func:`lookup_lists`) as a :class:`_Block`."""
    props = lookup_lists(draft, hists, rows, caps, policy, vocab)
    g = max((len(p) for p in props), default=0)
    tokens = torch.full((len(props), g), pad, dtype=torch.long)
    for i, p in enumerate(props):
        if p:
            tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long)
            tokens[i, len(p):] = p[-1]  # filler the verdict ignores (beyond the row's length)
    lengths = [len(p) for p in props]
    tokens = tokens.to(device)
    probs = None
    if do_sample and g:
        probs = torch.zeros(len(props), g, vocab, device=device)
        probs.scatter_(2, tokens[..., None], 1.0)  # q_j = onehot(d_j)
    lens = None if min(lengths, default=0) == g else torch.tensor(lengths, dtype=torch.long, device=device)
    return _Block(tokens, probs, lens, 0, 0, 1)


def verify_step(tstate, block: _Block, rows: _Rows, hists: dict, io, clock: LoopClock, max_new_tokens: int,
                do_sample: bool, sampling: dict, generator) -> tuple:
    """One verify step after a lookup's proposals (and :mod:`decode.hybrid`'s mixed blocks): one target forward over
    each row's last emitted token and its proposals, the verdict, the emitted tokens written to ``io.buf`` and added
    to each row's text (``hists``). Returns ``(verdict, the target cache length before the step, emitted ids per
    row (host lists))``."""
    verify_start = tstate.length
    with clock.verify:  # one target forward over the last emitted token and the proposals
        logits = tstate.forward(torch.cat([rows.last[:, None], block.tokens], 1), None, logits_to_keep=0)
    v = _verify(logits[..., :io.vocab], block, rows, max_new_tokens, io.eos_t, do_sample, sampling, generator)
    _emit(io.buf, rows, v, io.input_ids.shape[1], io.pad)
    emitted = v.emitted.tolist()
    for i, (row, m) in enumerate(zip(rows.ids, v.m)):
        hists[row].extend(emitted[i][:m])
    return v, verify_start, emitted


@torch.inference_mode()
def ngram_generate(target, draft: NgramDraft, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   max_new_tokens: int, num_draft_tokens: int = 4, do_sample: bool = False, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, eos_token_id=None, pad_token_id: int | None = None,
                   generator: torch.Generator | None = None, draft_length_policy=None, vocab_size: int | None = None,
                   fast_path: bool | None = None) -> GenerationOutput:
    """Speculative decoding with a lookup draft (module docstring); the arguments and the output are those of
    :func:`decode.speculative.speculative_generate` (no ``draft_tree``). ``input_ids (B, P)`` left padded; the
    output ``sequences (B, P + max_new_tokens)`` is the target's own greedy output (exactly its distribution when
    sampling). The draft timer counts the lookups, the verify timer the target forwards.

    Raises:
        ValueError: as :func:`decode.speculative.speculative_generate`.
    """
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    policy = _validated_policy(target, draft, num_draft_tokens, draft_length_policy, do_sample, sampling)
    io = setup_decoding((target,), input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, vocab_size,
                        spare=int(policy.max_draft_tokens) + 1)
    bsz, prompt_len = io.input_ids.shape
    if max_new_tokens == 0:
        return GenerationOutput(finalize(io.buf, prompt_len), io.num_new, AcceptanceStats())
    clock = LoopClock(io, max_new_tokens, policy)
    tstate = clock.kv_state(target, fast_path)
    with clock.prefill:
        prefill((tstate,), io.input_ids, io.attention_mask)
    mask = io.attention_mask.bool().cpu()
    ids_host = io.input_ids.cpu()
    hists = {i: draft.history(ids_host[i][mask[i]].tolist()) for i in range(bsz)}
    last = io.input_ids[:, -1]
    rows = _Rows(list(range(bsz)), torch.arange(bsz, device=io.device), [0] * bsz, last, last[:, None])
    while rows.ids:
        gamma = max(1, min(int(policy.propose_length()), clock.max_gamma))
        caps = [min(gamma, max_new_tokens - t - 1) for t in rows.num_new]
        with clock.draft:
            block = _proposals(draft, hists, rows, caps, policy, io.pad, io.vocab, do_sample, io.device)
        v, verify_start, _ = verify_step(tstate, block, rows, hists, io, clock, max_new_tokens, do_sample, sampling,
                                         generator)
        for k, n, m in zip(v.k, v.n, v.m):
            clock.stats.record_step(k, n, m)
        policy.update(v.k, v.n)
        tstate.truncate(verify_start, None if min(v.n) == max(v.n) else v.num_accepted + 1, max(v.n) + 1)
        rows.last = v.next_token
        rows.pending = v.next_token[:, None]
        if any(v.done):
            _retire(tstate, None, rows, v.done, io.num_new)
    return clock.finish(io)
