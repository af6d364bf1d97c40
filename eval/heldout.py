"""Held-out acceptance: how often each draft proposes the target's greedy token, per draft position, on prompts the
draft never trained on, beside the same measurement on training prompts (so memorisation shows).

**Prompts.** A domain's test records (hash order, :func:`data.loading.load_domain`) whose user text is not a
near-duplicate of any training or validation record of that domain: records split by id can still repeat a
question (MedQuAD asks "What is (are) X ?" under several ids), and such a prompt is not held out. Two prompts are
near-duplicates when the IDF-weighted Jaccard similarity of their word sets is at least ``near_duplicate_jaccard``
(:class:`NearDuplicateIndex`; exact duplicates have similarity 1).

**Answers.** The target's greedy answer to each prompt (our decoder, ``max_new_tokens``, stopping at EOS): what
the target sends at temperature 0, so what a lossless decoder must reproduce.

**Exact greedy acceptance from one draft pass.** With greedy decoding a chained draft proposes, at answer position
``j``, ``argmax q(. | prompt, y_<j)`` as long as every earlier proposal of the block was accepted, and an accepted
proposal equals the target's token ``y_j``. So one teacher-forced draft forward over ``prompt + y`` gives
``m_j = [argmax q(. | prompt, y_<j) == y_j]`` for every ``j``, and speculative greedy decoding at ``gamma`` is
replayed exactly from ``m``: a block starting at ``t`` drafts ``min(gamma, L - t - 1)`` tokens (an answer of
``L`` tokens: the decoder never drafts past its token budget), accepts ``a = `` the run of consecutive ``m`` from
``t`` within them, emits ``a + 1`` tokens (the target's correction or bonus token) and the next block starts at
``t + a + 1`` (Leviathan et al. 2023, Alg. 1 with ``p``, ``q`` one-hot). Then

- ``alpha_k`` (acceptance at draft position ``k``) = accepted proposals at position ``k`` / proposals at ``k``,
  pooled over the blocks of the replay at ``gamma = max_gamma``;
- ``tau(gamma)`` (mean accepted length, tokens per target forward) = answer tokens / blocks at that ``gamma``.

This holds for drafts whose next proposal depends only on the tokens (every token draft decoded by
:func:`decode.speculative_generate`); it is engine-independent and needs no timing. An EAGLE-3 head's proposal also
depends on where its block starts (the target's features reach it up to the block's start); its replay takes, per
start, the chain the head drafts from there (:func:`eagle3_runs`, one training-time-test unroll), and its first
block drafts nothing, as its decoder (:mod:`decode.eagle3`). A lookup draft's proposal depends on the text so far
and may be shorter than gamma (:func:`ngram_runs`); a hybrid (:mod:`decode.hybrid`) takes its lookup's proposal
where there is one and its model's chain elsewhere (:func:`hybrid_runs`). Intervals: percentile
bootstrap over prompts (:func:`eval.metrics.bootstrap_ratio_ci`).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from core.io import fmt, fmt_interval
from eval.metrics import _cell_seed, bootstrap_ratio_ci

log = logging.getLogger(__name__)
_WORD = re.compile(r"\w+")


def words(text: str) -> frozenset:
    """The set of lower-cased words of ``text``."""
    return frozenset(_WORD.findall(text.lower()))


class NearDuplicateIndex:
    """Reference texts as word sets with an inverted index, answering "is this text a near-duplicate of any
    reference?": IDF-weighted Jaccard similarity ``sum_{w in A & B} idf(w) / sum_{w in A | B} idf(w)`` at least
    ``threshold`` (set similarity with tf-idf weights, Chum, Philbin & Zisserman 2008, eq. 4; ``idf(w) =
    log((N + 1) / (df(w) + 1)) + 1`` over the ``N`` references). The weights let "What is (are) Glaucoma ?" match
    "What is Glaucoma?" (similarity 0.9) while "What are the symptoms of Glaucoma ?" and "... of Diabetes ?" do
    not (the rare words dominate).
    """

    def __init__(self, texts, threshold: float):
        if not 0 < threshold <= 1:
            raise ValueError(f"eval.heldout.near_duplicate_jaccard must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self.sets = [w for w in (words(t) for t in texts) if w]
        self.index: dict[str, list[int]] = {}
        for i, s in enumerate(self.sets):
            for w in s:
                self.index.setdefault(w, []).append(i)
        self.n = len(self.sets)

    def idf(self, w: str) -> float:
        return float(np.log((self.n + 1) / (len(self.index.get(w, ())) + 1)) + 1)

    def similarity(self, a: frozenset, b: frozenset) -> float:
        union = sum(self.idf(w) for w in a | b)
        return sum(self.idf(w) for w in a & b) / union if union else 0.0

    def duplicate_of(self, text: str) -> int | None:
        """Index of the most similar reference at or above the threshold, else None. Only references sharing one
        of the text's rarest words (those holding the first ``1 - threshold`` of its weight) are compared: a
        reference without any of them misses more than that share, so its similarity is below the threshold."""
        s = words(text)
        if not s:
            return None
        ranked = sorted(s, key=self.idf, reverse=True)
        total, acc, cand = sum(self.idf(w) for w in s), 0.0, set()
        for w in ranked:
            cand.update(self.index.get(w, ()))
            acc += self.idf(w)
            if acc > (1 - self.threshold) * total:
                break
        best, best_j = None, 0.0
        for i in cand:
            j = self.similarity(s, self.sets[i])
            if j >= self.threshold and j > best_j:
                best, best_j = i, j
        return best


@dataclass
class Replay:
    """One prompt's greedy replay: ``tokens`` answer tokens; ``blocks[g]`` target forwards at gamma ``g``;
    ``proposed[k]`` / ``accepted[k]`` proposals and accepted proposals at draft position ``k + 1`` (at max gamma)."""

    tokens: int
    blocks: dict[int, int]
    proposed: list[int]
    accepted: list[int]


def match_runs(matches: list[bool]) -> list[int]:
    """``run[j]``: the consecutive matches starting at answer position ``j`` (``len(matches) + 1`` entries, the last
    0): what a token draft's chain from ``j`` has accepted when its block may draft that far."""
    run = [0] * (len(matches) + 1)
    for j in range(len(matches) - 1, -1, -1):
        run[j] = run[j + 1] + 1 if matches[j] else 0
    return run


def replay(matches: list[bool] | None, max_gamma: int, *, runs: list[int] | None = None,
           lengths: list[int] | None = None) -> Replay:
    """Replay greedy speculative decoding of one answer from its match vector (module docstring).

    Args:
        matches: ``m_j`` for each answer token ``j`` (length ``L >= 0``): a token draft.
        max_gamma: the largest number of draft tokens per block (>= 1); blocks are counted for 1..max_gamma.
        runs: instead of ``matches``, ``run[t]`` for each answer position (an EAGLE-3 head, whose proposals depend on
            where the block starts: :func:`eagle3_runs`): the drafts a block starting at ``t`` would have accepted
            (up to ``max_gamma``); ``run[0] = None``: the first block drafts nothing (the target's first token).
        lengths: with ``runs``, the tokens a block starting at ``t`` proposes at most (a lookup draft, which may
            propose fewer than gamma, or none: :func:`ngram_runs`); None: as many as the block may draft.
    """
    if max_gamma < 1:
        raise ValueError(f"eval.heldout.max_gamma must be >= 1, got {max_gamma}")
    if runs is None:
        n = len(matches)
        run = match_runs(matches)
        first_drafts = True
    else:
        n, first_drafts = len(runs), not (runs and runs[0] is None)
        run = [0 if r is None else r for r in runs] + [0]
    blocks = {}
    proposed, accepted = [0] * max_gamma, [0] * max_gamma
    for g in range(1, max_gamma + 1):
        t = steps = 0
        while t < n:
            cap = min(g, n - t - 1)  # the decoder drafts at most the tokens left but one (the target emits the last)
            if t == 0 and not first_drafts:
                cap = 0
            if lengths is not None:
                cap = min(cap, lengths[t])
            a = min(run[t], cap)
            if g == max_gamma:
                for k in range(cap):
                    if k > a:
                        break
                    proposed[k] += 1
                    accepted[k] += int(k < a)
            t += a + 1
            steps += 1
        blocks[g] = steps
    return Replay(n, blocks, proposed, accepted)


@torch.no_grad()
def draft_matches(draft: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]], vocab: int,
                  batch_size: int = 8) -> list[list[bool]]:
    """``m_j`` per answer (module docstring) from teacher-forced draft forwards over ``prompt + answer``.

    Args:
        prompts, answers: token ids (same length lists); an empty answer gives ``[]``.
        vocab: the shared vocabulary the decoder draws from (logits ``>= vocab`` are ignored, as the decoder does).
        batch_size: sequences per forward (right-padded: a causal model's earlier positions are unaffected).
    """
    out: list[list[bool]] = []
    for i in range(0, len(prompts), batch_size):
        seqs = [p + a for p, a in zip(prompts[i:i + batch_size], answers[i:i + batch_size])]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.tensor(s)
            mask[b, :len(s)] = 1
        dev = next(draft.parameters()).device
        pred = draft(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits[..., :vocab].argmax(-1).cpu()
        for b, (p, a) in enumerate(zip(prompts[i:i + batch_size], answers[i:i + batch_size])):
            guess = pred[b, len(p) - 1 : len(p) - 1 + len(a)]  # position P-1+j predicts answer token j
            out.append((guess == torch.tensor(a, dtype=torch.long)).tolist() if a else [])
    return out


@torch.no_grad()
def eagle3_runs(target, head, prompts: list[list[int]], answers: list[list[int]], max_gamma: int,
                batch_size: int = 8) -> list[list[int | None]]:
    """``run[t]`` per answer for :func:`replay`: one target forward over ``prompt + answer`` gives the features,
    the head's training-time-test unroll (:meth:`models.eagle3.Eagle3Draft.unroll`, ``max_gamma`` steps) gives at
    every position the chain it drafts from there, teacher-forced on the answer (an accepted draft is the answer's
    token); ``run[t]`` counts the leading matches of the chain drafting answer tokens ``t, t+1, ...`` (state at
    sequence position ``P + t - 2``, the pair ending with answer token ``t - 1``). ``run[0] = None``: the decoder's
    first step drafts nothing."""
    out: list[list[int | None]] = []
    layers = head.cfg.target_layers
    dev = next(head.parameters()).device
    to_target = head.draft_to_target.to(dev)
    for i in range(0, len(prompts), batch_size):
        ps, ans = prompts[i:i + batch_size], answers[i:i + batch_size]
        seqs = [p + a for p, a in zip(ps, ans)]
        width = max(len(x) for x in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, x in enumerate(seqs):
            ids[b, :len(x)], mask[b, :len(x)] = torch.tensor(x), 1
        ids, mask = ids.to(dev), mask.to(dev)
        hs = target(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[j] for j in layers], -1)
        if width < 2:
            out.extend([[None] if a else [] for a in ans])
            continue
        outs = head.unroll(ids[:, 1:], head.fuse(feats[:, :-1]), max_gamma, valid=mask[:, :-1].bool())
        preds = torch.stack([to_target[head.logits(o).argmax(-1)] for o in outs], -1).cpu()  # (B, W-1, G)
        for b, (p, a) in enumerate(zip(ps, ans)):
            runs: list[int | None] = [None] if a else []
            for t in range(1, len(a)):
                r = 0
                while r < max_gamma and t + r < len(a) and int(preds[b, len(p) + t - 2, r]) == a[t + r]:
                    r += 1
                runs.append(r)
            out.append(runs)
    return out


def ngram_runs(draft, prompts: list[list[int]], answers: list[list[int]], max_gamma: int
               ) -> list[tuple[list[int], list[int]]]:
    """``(run, lengths)`` per answer for :func:`replay` of a lookup draft (:class:`decode.ngram.NgramDraft`): at
    every answer position ``t`` the proposal after ``prompt + answer[:t]`` (what the decoder looks up there),
    ``lengths[t]`` its length (0: no match) and ``run[t]`` its leading matches with ``answer[t:]``. A suffix draft's
    store gets each answer after its own replay (the prompts in order), as the evaluation adds them."""
    out = []
    for p, a in zip(prompts, answers):
        hist = draft.history(p)
        run, lengths = [], []
        for t in range(len(a)):
            toks, _ = draft.propose(hist, max_gamma)
            r = 0
            while r < len(toks) and t + r < len(a) and toks[r] == a[t + r]:
                r += 1
            run.append(r)
            lengths.append(len(toks))
            hist.extend(a[t:t + 1])
        draft.observe(a)
        out.append((run, lengths))
    return out


def hybrid_runs(draft, prompts: list[list[int]], answers: list[list[int]], max_gamma: int, vocab: int,
                batch_size: int = 8) -> list[tuple[list[int], list[int]]]:
    """``(run, lengths)`` per answer for :func:`replay` of a hybrid (:class:`decode.hybrid.HybridDraft`): where its
    lookup proposes at answer position ``t`` (:func:`ngram_runs`), that proposal; elsewhere its model's chain from
    ``t``, whose leading matches are the consecutive teacher-forced matches from ``t`` (:func:`draft_matches`: an
    accepted draft token is the answer's token, so the chain reads what teacher forcing reads), as long as the block
    may draft."""
    looked = ngram_runs(draft.lookup, prompts, answers, max_gamma)
    matches = draft_matches(draft.model, prompts, answers, vocab, batch_size)
    out = []
    for (run, lengths), m in zip(looked, matches):
        model_run = match_runs(m)
        out.append(([r if n else model_run[t] for t, (r, n) in enumerate(zip(run, lengths))],
                    [n if n else max_gamma for n in lengths]))
    return out


def summarize_replays(replays: list[Replay], max_gamma: int, *, samples: int, confidence: float, seed: int,
                      key: tuple) -> dict:
    """Pooled ``alpha`` per draft position and ``tau`` per gamma with bootstrap intervals over prompts."""
    tokens = np.array([r.tokens for r in replays], dtype=float)
    out: dict = {"prompts": len(replays), "answer_tokens": int(tokens.sum()), "alpha": [], "alpha_ci": [],
                 "tau": {}, "tau_ci": {}}
    for k in range(max_gamma):
        acc = np.array([r.accepted[k] for r in replays], dtype=float)
        prop = np.array([r.proposed[k] for r in replays], dtype=float)
        out["alpha"].append(float(acc.sum() / prop.sum()) if prop.sum() else None)
        out["alpha_ci"].append(bootstrap_ratio_ci(acc, prop, samples=samples, confidence=confidence,
                                                  seed=_cell_seed(seed, "heldout_alpha", *key, k)))
    for g in range(1, max_gamma + 1):
        steps = np.array([r.blocks[g] for r in replays], dtype=float)
        out["tau"][g] = float(tokens.sum() / steps.sum()) if steps.sum() else None
        out["tau_ci"][g] = bootstrap_ratio_ci(tokens, steps, samples=samples, confidence=confidence,
                                              seed=_cell_seed(seed, "heldout_tau", *key, g))
    return out




def _with_ci(x, ci) -> str:
    return fmt(x, missing="-") + fmt_interval(ci, missing="-")


class HeldoutSection:
    """A report section ``f(doc) -> markdown`` adding ``doc["heldout"]``: per draft, per domain, the held-out
    measurement, and the same measurement on training prompts (``"train:<domain>"``)."""

    def __init__(self, record: dict | None, reason: str = ""):
        self.record, self.reason = record, reason

    def __call__(self, doc: dict) -> str:
        head = "## Held-out acceptance"
        if self.record is None:
            doc["heldout"] = {"skipped": self.reason}
            return f"{head}\n\nNot measured: {self.reason}."
        doc["heldout"] = self.record
        r = self.record
        g = r["max_gamma"]
        lines = [head, "",
                 f"Greedy replay (eval/heldout.py) on the target's greedy answers (at most {r['max_new_tokens']} "
                 f"tokens) to test prompts never trained on: near-duplicates of training or validation records "
                 f"(IDF-weighted word Jaccard >= {r['near_duplicate_jaccard']}) removed "
                 f"({', '.join(f'{d}: {n}' for d, n in r['near_duplicates_removed'].items())}). "
                 f"alpha_k: acceptance at draft position k (gamma {g}); tau: mean accepted length per target "
                 f"forward. Rows `train:<domain>` replay training prompts: a large gap is memorisation.", "",
                 "| draft | prompts | n | " + " | ".join(f"alpha_{k}" for k in range(1, g + 1)) + " | "
                 + " | ".join(f"tau g={k}" for k in range(1, g + 1)) + " |",
                 "|---|---|---|" + "---|" * (2 * g)]
        notes = [f"Not measured on {d}: {why}" for d, why in r.get("skipped_domains", {}).items()]
        lines[3:3] = ["", *notes] if notes else []
        for name, per in r["drafts"].items():
            for dom, s in per.items():
                alphas = [(_with_ci(a, c) if k == 0 else fmt(a, '.2f', missing='-')) for k, (a, c) in
                          enumerate(zip(s["alpha"], s["alpha_ci"]))]
                taus = [(_with_ci(s["tau"][k], s["tau_ci"][k]) if k == min(3, g) else fmt(s["tau"][k], '.2f', missing='-'))
                        for k in range(1, g + 1)]
                lines.append(f"| {name} | {dom} | {s['prompts']} | " + " | ".join(alphas + taus) + " |")
        return "\n".join(lines)


def _rendered(render, row: dict) -> str:
    from data.text import decode_messages

    return render(row["prompt"], row["completion"], decode_messages(row["messages"]))[0] if render else row["prompt"]


def heldout_prompts(domain: str, splits, tokenizer, limit: int, index: NearDuplicateIndex) -> tuple[list[str], int]:
    """The first ``limit`` test prompts of ``domain`` (``splits``: its :func:`data.loading.load_domain`; hash
    order, rendered as the target sees them) whose user text is no near-duplicate of a reference in ``index``;
    returns ``(prompts, near-duplicates skipped)``.

    Raises:
        DataSourceError: the domain has no test prompts left.
    """
    from core.errors import DataSourceError
    from data.text import renderer

    render, out, removed = renderer(tokenizer), [], 0
    for row in splits["test"]:
        if not row["prompt"].strip():
            continue
        if index.duplicate_of(row["prompt"]) is not None:
            removed += 1
            continue
        out.append(_rendered(render, row))
        if len(out) >= limit:
            break
    if not out:
        raise DataSourceError(f"domain {domain!r} has no held-out test prompts (all {removed} are near-duplicates "
                              f"of training records); raise data.test_fraction or eval.heldout.near_duplicate_jaccard")
    return out, removed


def reference_index(loaded: dict, threshold: float) -> NearDuplicateIndex:
    """The train and validation user texts of the ``loaded`` domains (name -> :func:`data.loading.load_domain`):
    what a draft of this project may have trained on."""
    texts = [r["prompt"] for splits in loaded.values() for s in ("train", "validation") for r in splits[s]
             if r["prompt"].strip()]
    return NearDuplicateIndex(texts, threshold)


@torch.no_grad()
def greedy_answers(target, prompts: list[list[int]], max_new_tokens: int, eos, pad: int,
                   batch_size: int = 16) -> list[list[int]]:
    """The target's greedy continuation of each prompt (our decoder, batched with left padding), EOS included
    when it stopped there."""
    from decode import autoregressive_generate
    from decode.common import left_pad

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    answers: dict[int, list[int]] = {}
    for s in range(0, len(order), batch_size):
        part = order[s:s + batch_size]
        ids, mask = left_pad([prompts[i] for i in part], pad)
        dev = next(target.parameters()).device
        res = autoregressive_generate(target, ids.to(dev), mask.to(dev), max_new_tokens=max_new_tokens,
                                      eos_token_id=eos, pad_token_id=pad)
        for b, i in enumerate(part):
            answers[i] = res.sequences[b, ids.size(1): ids.size(1) + int(res.num_new_tokens[b])].tolist()
    return [answers[i] for i in range(len(prompts))]


def measure_heldout(target, tokenizer, drafts: dict, domains: list[str], train_domains: list[str], opts, cfg, *,
                    max_prompt_tokens: int, samples: int, confidence: float, seed: int) -> dict:
    """The held-out record of :class:`HeldoutSection` (module docstring): for each domain its first
    ``cfg.max_prompts`` held-out prompts, and for each ``train_domains`` entry its first ``cfg.train_prompts``
    training prompts (as ``"train:<domain>"``); every draft replayed on the target's greedy answers to them.

    Args:
        drafts: name -> draft model; domains: the evaluation's built-in domains; train_domains: the domains the
            drafts trained on (``data.domain`` / ``data.mixture``); cfg: :class:`eval.config.HeldoutConfig`.

    A domain without a held-out prompt is left out and named in ``skipped_domains`` with the reason.
    """
    from core.errors import DataSourceError
    from data.loading import load_domain
    from data.text import encode_prompt, renderer
    from decode.common import default_eos, output_vocab_size

    loaded = {d: load_domain(d, opts) for d in dict.fromkeys(list(domains) + list(train_domains))}
    index = reference_index(loaded, cfg.near_duplicate_jaccard)
    texts, removed, skipped, render = {}, {}, {}, renderer(tokenizer)
    for d in domains:
        try:
            texts[d], removed[d] = heldout_prompts(d, loaded[d], tokenizer, cfg.max_prompts, index)
        except DataSourceError as e:  # one domain without held-out prompts is reported, never ends the evaluation
            skipped[d] = str(e)
    for d in train_domains:
        if cfg.train_prompts:
            rendered = (p for p in (_rendered(render, r) for r in loaded[d]["train"]) if p.strip())
            texts[f"train:{d}"] = [p for p, _ in zip(rendered, range(cfg.train_prompts))]  # data.blocks.domain_prompts
    eos = default_eos(target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        eos if isinstance(eos, int) else (eos or [0])[0])
    total = sum(len(ts) for ts in texts.values())
    log.info("held-out acceptance: the target's greedy answers (up to %d tokens) to %d prompts (%s), each draft of %d "
             "replayed on them; sizes: eval.heldout.max_prompts=%d, eval.heldout.train_prompts=%d, "
             "eval.heldout.max_new_tokens=%d; eval.heldout.enabled=false skips it", cfg.max_new_tokens, total,
             ", ".join(f"{d} {len(ts)}" for d, ts in texts.items()), len(drafts), cfg.max_prompts, cfg.train_prompts,
             cfg.max_new_tokens)
    bar = tqdm(total=len(texts) * (1 + len(drafts)), desc="held-out replay", unit="pass", dynamic_ncols=True,
               disable=not total)  # per prompt set: the target's answers, then each draft's replay
    record = {"max_gamma": cfg.max_gamma, "max_new_tokens": cfg.max_new_tokens, "max_prompts": cfg.max_prompts,
              "near_duplicate_jaccard": cfg.near_duplicate_jaccard, "near_duplicates_removed": removed,
              "skipped_domains": skipped, "prompts": {}, "drafts": {n: {} for n in drafts}}
    for d, ts in texts.items():
        prompts = [encode_prompt(tokenizer, t, max_prompt_tokens)[0][0].tolist() for t in ts]
        bar.set_postfix_str(f"{d}: target answers")
        answers = greedy_answers(target, prompts, cfg.max_new_tokens, eos, pad, cfg.batch_size)
        bar.update()
        record["prompts"][d] = len(prompts)
        for name, draft in drafts.items():
            bar.set_postfix_str(f"{d}: {name}")
            if getattr(draft, "is_hybrid", False):  # a lookup in front of a model: each position's proposer
                draft.clear_store(d)
                draft.use_domain(d)
                vocab = min(output_vocab_size(target), output_vocab_size(draft.model))
                replays = [replay(None, cfg.max_gamma, runs=r, lengths=n) for r, n in
                           hybrid_runs(draft, prompts, answers, cfg.max_gamma, vocab, cfg.batch_size)]
            elif getattr(draft, "is_ngram", False):  # a lookup draft: its proposals, this domain's store
                draft.clear_store(d)
                draft.use_domain(d)
                replays = [replay(None, cfg.max_gamma, runs=r, lengths=n) for r, n in
                           ngram_runs(draft, prompts, answers, cfg.max_gamma)]
            elif getattr(draft, "is_eagle3", False):
                replays = [replay(None, cfg.max_gamma, runs=r) for r in
                           eagle3_runs(target, draft, prompts, answers, cfg.max_gamma, cfg.batch_size)]
            else:
                vocab = min(output_vocab_size(target), output_vocab_size(draft))
                replays = [replay(m, cfg.max_gamma) for m in
                           draft_matches(draft, prompts, answers, vocab, cfg.batch_size)]
            record["drafts"][name][d] = summarize_replays(replays, cfg.max_gamma, samples=samples,
                                                          confidence=confidence, seed=seed, key=(name, d))
            bar.update()
    bar.close()
    return record
