"""Per-domain acceptance evaluation: one implementation for the pipeline's eval stage and ``python -m eval``.

Each prompt is decoded in alternation on the same inputs: target-only (the baseline and the lossless reference),
then speculative decoding with each draft at each swept ``num_draft_tokens`` and under each draft-length policy. This
module only decodes and times; it returns one row per (draft, domain, prompt, num_draft_tokens or policy) with the
counts (and the draft length of every verify step) that rebuild every pooled number
(see :mod:`eval.metrics`). The timing (alternated rounds, forward cost ratios, machine load) is
:mod:`eval.evaluate`'s, the engine the decoder benchmark (:mod:`eval.bench`) times with too.

Timing decodes on a shared machine: the one alternated-timing engine of the evaluation (:mod:`eval.evaluate`)
and the decoder benchmark (:mod:`eval.bench`, ``scripts/bench_decode.py``), the forward cost ratios c and v, and
the machine's load over a measurement.

Every measured decode is one call of a round: each compared method runs once on the same input, one after the
other, so slow drift of the machine (thermal state, other processes) hits all of them alike and each round gives
side-by-side times. A call is timed with ``time.perf_counter`` around it, the device synchronised before and after
(CUDA: its queued work counts in the call that queued it).

Where speculative decoding's time goes, per draft and domain: the ``time_breakdown`` of ``metrics.json`` and its
report section.

The same quantities as the decoder benchmark prints (:mod:`eval.bench`, ``scripts/bench_decode.py``; the phase
split is :func:`phase_split` for both), from the per-prompt rows at the primary gamma (fixed policy) and the
measured forward times:

- ``prefill_s``, ``draft_s``, ``verify_s``: summed decoder phase times (``AcceptanceStats.prefill_time_s`` /
  ``draft_time_s`` / ``verify_time_s``), ``wall_s`` the summed speculative decode time (``speculative_time_s``, the
  time the measured speedup uses) and ``other_s = wall_s - prefill_s - draft_s - verify_s`` (the loop's own work);
- ``loop_efficiency = (prefill_s + draft_s + verify_s) / wall_s`` (time in model forwards / wall time);
- ``cost_ratio`` c (one-position draft forward / one-position target forward, medians: ``cost_ratio.<draft>``)
  and ``cost_ratio_in_loop = (draft_s / drafted_tokens) / target_forward_s``;
- ``verify_cost_ratio`` v ((gamma + 1)-position target forward / one-position target forward, medians, measured
  once per gamma: ``verify_cost_ratio.<gamma>``, :func:`decode.block_forward_times_s`) and
  ``verify_cost_ratio_in_loop = (verify_s / verify_steps) / target_forward_s``;
- ``expected_speedup_components``: the cell's measured tau over its steps' mean cost ``k c + v_k``
  (:func:`decode.stats.expected_speedup_from_costs`, the value the verdicts break ties with), beside
  ``expected_speedup_leviathan`` (``(1 - a^(g+1)) / ((1 - a)(g c + 1))``, v = 1, Leviathan et al. 2023, Thm 3.8)
  and the ``measured_speedup``.

A value that cannot be computed (rows written before ``prefill_time_s`` was recorded, nothing drafted, no verify
measurement) is ``None``.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
from tqdm.auto import tqdm

from core.io import fmt
from data.text import encode_prompt  # noqa: F401  (re-exported: used below and by callers)
from decode import autoregressive_generate, frozen_weights, speculative_generate
from decode.common import sync
from decode.stats import expected_speedup
from decode.timing import block_forward_times_s, cost_ratio
from decode.tree import DraftTree

__all__ = [
    'OTHER_LOAD_LIMIT', 'LoadMeter', 'alternated_rounds', 'busy_cpu_seconds', 'cpu_cores', 'load_record',
    'measure_cost_ratio', 'measure_verify_cost_ratio', 'timed_call', 'phase_split', 'time_breakdown',
    'time_breakdown_section',
]


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), wall seconds of the call)``, the device synchronised before and after (CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def alternated_rounds(calls: dict[Hashable, Callable[[], Any]], device: torch.device, rounds: int = 1, *,
                      rotate: bool = False, after: Callable[[Hashable], None] | None = None
                      ) -> tuple[dict[Hashable, list], dict[Hashable, list[float]]]:
    """``rounds`` rounds of every call in ``calls``, each call timed by :func:`timed_call`.

    Round r runs the calls in their dict order, or with ``rotate`` on odd rounds that order rotated left by one
    (the first call runs last), so neither the first method nor the others always run on a "fresh" machine; the
    evaluation passes target-only first. ``after(key)`` runs after each call, outside its time (a progress bar).

    Returns:
        ``(results, seconds)``: ``{key: [fn() of each round]}`` and ``{key: [wall seconds of each round]}``.
    """
    keys = list(calls)
    results: dict[Hashable, list] = {k: [] for k in keys}
    seconds: dict[Hashable, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[1:] + keys[:1] if rotate and r % 2 == 1 else keys
        for key in order:
            out, t = timed_call(calls[key], device)
            results[key].append(out)
            seconds[key].append(t)
            if after is not None:
                after(key)
    return results, seconds


@torch.inference_mode()
def measure_cost_ratio(target, draft, input_ids: torch.Tensor, trials: int = 20,
                       fast_path: bool | None = None) -> dict[str, float]:
    """Cost ratio c of ``draft`` against ``target`` on ``input_ids`` (1, T): ``{"cost_ratio", "target_forward_s",
    "draft_forward_s"}`` (seconds; medians of ``trials`` one-token cached forwards, the two models alternating,
    through the decoder's own forward path: :func:`decode.timing.cost_ratio`; ``fast_path`` False: the Hugging
    Face forward)."""
    device = next(target.parameters()).device
    return cost_ratio(target, draft, input_ids.to(device), steps=trials, fast_path=fast_path)


def measure_verify_cost_ratio(target, input_ids: torch.Tensor, draft_lengths, trials: int = 20,
                              fast_path: bool | None = None) -> dict[str, dict]:
    """Verify cost ratio v per draft length k: ``{str(k): {"verify_cost_ratio", "verify_forward_s",
    "target_forward_s"}}`` = (k + 1)-position target forward / one-position forward (seconds; medians of ``trials``,
    the decoder's own forward path, widths alternating: :func:`decode.block_forward_times_s`). ``draft_lengths``:
    every draft length (and token tree's mean node count) the decodes used, :func:`eval.evaluate.verified_lengths`;
    0 is skipped (v_0 = 1)."""
    device = next(target.parameters()).device
    ks = sorted({int(k) for k in draft_lengths if int(k) > 0})
    if not ks:
        return {}
    widths = sorted({1, *(k + 1 for k in ks)})
    t = block_forward_times_s(target, input_ids.to(device), widths, steps=trials, fast_path=fast_path)
    return {str(k): {"verify_cost_ratio": t[k + 1] / t[1], "verify_forward_s": t[k + 1], "target_forward_s": t[1]}
            for k in ks}


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity set; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


OTHER_LOAD_LIMIT = 0.25  # cores other processes may keep busy before a domain's timing counts as disturbed


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has spent busy since boot (``/proc/stat``'s first line: everything
    but idle and iowait), or None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_record(before, after, own_cores: float | None = None, other_cores: float | None = None) -> dict:
    """The machine's load around a measurement: ``{"loadavg_before": [1, 5, 15 min], "loadavg_after": [...],
    "cores": n, "own_cores", "other_load", "overloaded": bool}``.

    ``own_cores``: the cores this process kept busy while measuring (its CPU seconds / wall seconds, all threads).
    ``other_cores``: the cores every other process kept busy over the same interval (the machine's busy CPU
    seconds from ``/proc/stat`` minus this process's, per wall second): recorded as ``other_load``. Without it,
    ``other_load`` = the higher 1-minute load average minus ``own_cores`` (the load average counts this process's
    busy threads too, and lags by about a minute). Overloaded when ``other_load`` exceeds :data:`OTHER_LOAD_LIMIT`
    (a quarter of a core); without ``own_cores`` either (an older caller) when the load average exceeds the
    cores."""
    cores = cpu_cores()
    before, after = [round(float(x), 2) for x in before], [round(float(x), 2) for x in after]
    peak = max(before[0], after[0])
    if own_cores is None and other_cores is None:
        return {"loadavg_before": before, "loadavg_after": after, "cores": cores, "own_cores": None,
                "other_load": None, "overloaded": peak > cores}
    own = None if own_cores is None else round(float(own_cores), 2)
    other = round(max(0.0, float(other_cores) if other_cores is not None else peak - own), 2)
    return {"loadavg_before": before, "loadavg_after": after, "cores": cores, "own_cores": own,
            "other_load": other, "overloaded": other > OTHER_LOAD_LIMIT}


class LoadMeter:
    """The machine's load over a timed measurement (the evaluation's domains, the decoder benchmark):
    ``meter = LoadMeter().start()`` ... ``meter.stop()`` (or ``with LoadMeter() as meter:``) sets ``meter.record``
    to :func:`load_record` over that interval (``meter.seconds``: its wall seconds), this process's busy cores from
    its CPU time and every other process's from ``/proc/stat``."""

    record: dict | None = None

    def start(self) -> "LoadMeter":
        self._t, self._cpu, self._busy = time.perf_counter(), time.process_time(), busy_cpu_seconds()
        self._load = os.getloadavg()
        return self

    def stop(self) -> dict:
        wall, own = time.perf_counter() - self._t, time.process_time() - self._cpu
        busy = busy_cpu_seconds()
        self.seconds = wall
        self.record = load_record(self._load, os.getloadavg(), own / wall if wall > 0 else None,
                                  (busy - self._busy - own) / wall if wall > 0 and None not in (self._busy, busy)
                                  else None)
        return self.record

    def __enter__(self) -> "LoadMeter":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


log = logging.getLogger(__name__)


@dataclass
class Prompt:
    domain: str
    id: str
    text: str
    format: str = "raw"  # how it reaches the target (data.text.FORMATS): chat_template, chat_template_user_turn, ...


def verified_lengths(rows: list[dict]) -> set[int]:
    """Every number of draft tokens a verify step of ``rows`` scored: the chains' per-step draft lengths, and per
    token-tree cell (draft, domain, tree) its pooled nodes per step, rounded: the widths
    :func:`decode.stats.expected_speedup_from_costs` needs."""
    out: set[int] = set()
    trees: dict[tuple, list[int]] = {}
    for r in rows:
        if r.get("nodes_verified") is not None and str(r.get("draft_length_policy", "")).startswith("tree:"):
            acc = trees.setdefault((r["draft"], r["domain"], r["draft_length_policy"]), [0, 0])
            acc[0], acc[1] = acc[0] + int(r["nodes_verified"]), acc[1] + int(r["verify_steps"])
        else:
            out.update(int(k) for k in r.get("draft_lengths") or [])
    out.update(int(round(n / s)) for n, s in trees.values() if s)
    return out


def _row(draft: str, domain: str, prompt_id, ids: torch.Tensor, truncated: bool, policy_name: str, gamma, policy,
         out, ts: list[float], ref, t_ref: list[float], compare: bool, draft_model=None) -> dict:
    """One ``per_prompt.csv`` row (:data:`eval.metrics.PER_PROMPT_COLUMNS`): the counts of the first round's
    decode, the mean and per-round wall times of both sides (``lookup_drafted_tokens`` for a hybrid
    ``draft_model`` only)."""
    s = out.stats
    return {
        "draft": draft, "domain": domain, "prompt_id": prompt_id,
        "num_draft_tokens": policy.depth if isinstance(policy, DraftTree) else gamma
        if policy is None else int(policy.max_draft_tokens),
        "draft_length_policy": policy_name, "draft_lengths": list(s.draft_lengths),
        "prompt_tokens": ids.size(1), "truncated": truncated,
        "new_tokens": int(out.num_new_tokens[0]), "verify_steps": s.verify_steps,
        "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
        "emitted_tokens": s.emitted_tokens, "nodes_verified": s.nodes_verified, "draft_time_s": s.draft_time_s,
        "verify_time_s": s.verify_time_s, "prefill_time_s": s.prefill_time_s,
        "speculative_time_s": sum(ts) / len(ts),
        "target_new_tokens": int(ref.num_new_tokens[0]), "target_time_s": sum(t_ref) / len(t_ref),
        "speculative_trial_times_s": list(ts), "target_trial_times_s": list(t_ref),
        "greedy_equal": bool(torch.equal(out.sequences, ref.sequences)) if compare else None,
        "numerical_tie_gap": None,
        "per_position_drafted": list(s.per_position_drafted),
        "per_position_accepted": list(s.per_position_accepted),
        "accepted_length_histogram": list(s.accepted_length_histogram),
        "lookup_drafted_tokens": s.lookup_drafted_tokens if getattr(draft_model, "is_hybrid", False) else None,
    }


# A greedy divergence is a numerical tie when, at the first position where the two outputs part, the token the
# speculative decoder emitted has a logit within this many units of the top logit in an independent full forward of
# the target (its own Hugging Face forward over the reference prefix, no KV cache): a verify block over several
# positions and a one-token forward sum the same products in another order, and on SmolLM2 (30 layers, float32) the
# two put the same position's logits up to about 1e-4 apart. A decoder fault emits a token the target ranks lower.
TIE_LOGIT_TOLERANCE = 1e-3


@torch.inference_mode()
def divergence(target, ref: torch.Tensor, out: torch.Tensor, prompt_len: int,
               tolerance: float = TIE_LOGIT_TOLERANCE) -> dict | None:
    """Where a speculative greedy output ``out`` (1, N) parts from the target-only one ``ref`` (1, N'), and whether
    that is a numerical tie (see :data:`TIE_LOGIT_TOLERANCE`); None when they are equal.

    Returns:
        ``{"position": new-token index of the first difference, "logit_gap": top logit - the logit of the token the
        speculative decoder emitted there (>= 0; in logit units), "top2_gap": top logit - second logit,
        "numerical_tie": logit_gap <= tolerance}``; a length difference without a differing token (one output
        stopped, the other did not) is never a tie (``logit_gap`` None).
    """
    a, b = ref[0, prompt_len:].tolist(), out[0, prompt_len:].tolist()
    if a == b:
        return None
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return {"position": min(len(a), len(b)), "logit_gap": None, "top2_gap": None, "numerical_tie": False}
    logits = target(ref[:, : prompt_len + j]).logits[0, -1].float()  # (V,)
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - logits[b[j]]) if b[j] < logits.numel() else float("inf")
    return {"position": j, "logit_gap": gap, "top2_gap": float(top2[0] - top2[1]),
            "numerical_tie": gap <= tolerance}


def _warm_up(target, drafts: dict[str, Any], ids: torch.Tensor, num_draft_tokens: int, eos, pad) -> None:
    """One short decode per model so the first timed prompt does not pay for lazy initialisation."""
    autoregressive_generate(target, ids, max_new_tokens=4, eos_token_id=eos, pad_token_id=pad)
    for d in drafts.values():
        speculative_generate(target, d, ids, max_new_tokens=4, num_draft_tokens=num_draft_tokens, eos_token_id=eos,
                             pad_token_id=pad)


TARGET_ONLY = "target_only"  # the key of the target-only decode among a prompt's timed calls


@dataclass
class _Evaluation:
    """One evaluation's plan: the models, the speculative ``settings`` (``[(policy name, gamma or None, policy
    factory or None)]``), the decode settings and how many timed ``trials`` each prompt gets."""

    target: Any
    tokenizer: Any
    drafts: dict[str, Any]
    settings: list[tuple]
    max_new_tokens: int
    max_prompt_tokens: int
    decode_kwargs: dict
    trials: int
    check_lossless: bool  # greedy domains: check every speculative output against target-only's
    domain_kwargs: dict = field(default_factory=dict)  # domain -> its own sampling settings (eval.domain_sampling)

    def __post_init__(self):
        self.base_kwargs = dict(self.decode_kwargs)
        self.compare = self.check_lossless and not self.base_kwargs.get("do_sample")
        self.eos, self.pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.device = next(self.target.parameters()).device  # sampling draws on the models' device
        self.target_outputs: dict[str, dict[str, list[int]]] = {}  # domain -> prompt id -> target-only greedy ids

    def target_only(self, ids: torch.Tensor, seed: int):
        g = torch.Generator(device=self.device).manual_seed(seed)
        return autoregressive_generate(self.target, ids, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                                       pad_token_id=self.pad, generator=g, **self.decode_kwargs)

    def speculative(self, ids: torch.Tensor, seed: int, gamma, make, draft):
        """``(GenerationOutput, the policy it ran with)``; ``make`` builds a fresh draft-length policy or token tree
        (None: the fixed policy at ``gamma``). Reseeded per call: every trial decodes the same tokens."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        policy = make() if make is not None else None
        tree = policy if isinstance(policy, DraftTree) else None  # eval.draft_tree: a token tree
        out = speculative_generate(self.target, draft, ids, max_new_tokens=self.max_new_tokens,
                                   num_draft_tokens=gamma or 1, draft_length_policy=None if tree is not None else policy,
                                   eos_token_id=self.eos, pad_token_id=self.pad, generator=g, draft_tree=tree,
                                   **self.decode_kwargs)
        return out, policy

    def pairs(self) -> list[tuple[int, str, Any]]:
        """``(setting index, draft name, draft)`` of every speculative decode of a prompt: each draft at each setting,
        except token trees for drafts that only chain (EAGLE-3 heads, lookup and hybrid drafts)."""
        chain_only = ("is_ngram", "is_eagle3", "is_hybrid")
        return [(k, name, draft) for k, (policy, _, _) in enumerate(self.settings) for name, draft in self.drafts.items()
                if not (str(policy).startswith("tree:") and any(getattr(draft, a, False) for a in chain_only))]

    def paired_trials(self, ids: torch.Tensor, seed: int, bar):
        """``trials`` rounds of one prompt: target-only and every (setting, draft), the order alternating (odd
        rounds run the speculative settings first: :func:`eval.evaluate.alternated_rounds` with ``rotate``) so each
        round is a side-by-side pair. Returns the target-only output of the first round, its seconds per round,
        ``{(setting index, draft): (output, policy)}`` of the first round, and ``{(setting index, draft): [seconds
        per round]}``."""
        calls = {TARGET_ONLY: functools.partial(self.target_only, ids, seed)}
        for k, name, draft in self.pairs():
            _, gamma, make = self.settings[k]
            calls[(k, name)] = functools.partial(self.speculative, ids, seed, gamma, make, draft)
        results, seconds = alternated_rounds(calls, self.device, self.trials, rotate=True,
                                             after=lambda _: bar.update(1))
        first = {key: res[0] for key, res in results.items() if key != TARGET_ONLY}
        t_spec = {key: ts for key, ts in seconds.items() if key != TARGET_ONLY}
        return results[TARGET_ONLY][0], seconds[TARGET_ONLY], first, t_spec

    def domain(self, domain: str, prompts: list[Prompt], seed: int) -> tuple[list[dict], int, dict]:
        """``(rows, prompts truncated, target-only summary)`` of one domain; prompt i decodes with seed
        ``seed + i``."""
        rows: list[dict] = []
        self.decode_kwargs = dict(self.domain_kwargs.get(domain, self.base_kwargs))  # what this domain's traffic uses
        self.compare = self.check_lossless and not self.decode_kwargs.get("do_sample")
        outputs = self.target_outputs.setdefault(domain, {})
        truncated_total, tgt_tokens, tgt_time = 0, 0, 0.0
        runs = len(prompts) * (1 + len(self.pairs())) * self.trials
        bar = tqdm(total=runs, desc=f"eval {domain}", unit="decode", dynamic_ncols=True)
        lookups = [d for d in self.drafts.values() if getattr(d, "is_ngram", False) or getattr(d, "is_hybrid", False)]
        for d in lookups:  # a suffix draft's store (a hybrid's lookup's): this domain's earlier answers, from empty
            d.clear_store(domain)
            d.use_domain(domain)
        for i, p in enumerate(prompts):
            ids, truncated = encode_prompt(self.tokenizer, p.text, self.max_prompt_tokens)
            truncated_total += truncated
            ref, t_ref, first, t_spec = self.paired_trials(ids, seed + i, bar)
            tgt_tokens, tgt_time = tgt_tokens + int(ref.num_new_tokens[0]), tgt_time + sum(t_ref) / len(t_ref)
            outputs[p.id] = ref.sequences[0, ids.size(1): ids.size(1) + int(ref.num_new_tokens[0])].tolist()
            for d in lookups:  # after every setting decoded it: no decode sees its own prompt's answer
                d.observe(outputs[p.id])
            for k, name, model in self.pairs():
                policy_name, gamma, _ = self.settings[k]
                out, policy = first[(k, name)]
                row = _row(name, domain, p.id, ids, truncated, policy_name, gamma, policy, out,
                           t_spec[(k, name)], ref, t_ref, self.compare, draft_model=model)
                if row["greedy_equal"] is False:  # a fault, or a numerical tie of the target's logits?
                    d = divergence(self.target, ref.sequences, out.sequences, ids.size(1))
                    if d is not None and d["numerical_tie"]:
                        row["numerical_tie_gap"] = d["logit_gap"]
                    log.warning("greedy outputs differ (%s, %s, prompt %s, %s): %s", name, domain, p.id,
                                policy_name if gamma is None else f"gamma {gamma}", d)
                rows.append(row)
        bar.close()
        summary = {"prompts": len(prompts), "new_tokens": tgt_tokens, "time_s": tgt_time,
                   "tokens_per_s": tgt_tokens / tgt_time if tgt_time else None}
        return rows, truncated_total, summary


def evaluate_drafts(target, tokenizer, drafts: dict[str, Any], prompts_by_domain: dict[str, list[Prompt]], *,
                    num_draft_tokens: int | list[int], max_new_tokens: int, max_prompt_tokens: int,
                    check_lossless: bool = True, cost_ratio_trials: int = 20, decode_kwargs: dict | None = None,
                    seed: int = 0, events: Callable[..., None] | None = None,
                    draft_length_policies: dict[str, Callable[[], Any]] | None = None,
                    warn_truncation: bool = True, timing_trials: int = 1,
                    domain_sampling: dict[str, dict] | None = None) -> dict:
    """Decode every prompt target-only, then speculatively with every draft at every ``num_draft_tokens``, then
    with every draft under every draft-length policy of ``draft_length_policies``.

    The same prompt is decoded in alternation (target-only, then each gamma x draft), so slow drift of the machine
    affects all settings alike. With ``timing_trials`` T > 1 every prompt's decodes are repeated T times, the trials
    of a prompt back to back and the order alternating (odd trials run the speculative settings before
    target-only), so each trial gives a paired (speculative, target-only) time measured side by side. The counts
    come from the first trial (the decodes are deterministic: the generator is reseeded per decode). Sampling uses
    one generator seeded with ``seed + prompt index`` per decode. The machine's load (``os.getloadavg``) is
    recorded before and after every domain, with the core count.

    Args:
        target: HF causal LM (eval mode). tokenizer: the target's tokenizer (drafts must share it).
        drafts: name -> HF causal LM, EAGLE-3 head or lookup draft (:class:`decode.ngram.NgramDraft`; a suffix
            draft's store holds the domain's earlier prompts' target answers, added after each prompt's decodes).
        prompts_by_domain: domain -> prompts.
        num_draft_tokens: gamma, or a list of gammas to sweep (the fixed policy).
        draft_length_policies: policy name -> factory of a fresh :class:`decode.speculative.DraftLengthPolicy`
            (e.g. ``DecodeConfig.make_policy``); each decode gets its own policy, so every prompt is an independent
            run and its row does not depend on the order of prompts. Their rows carry the policy's name in
            ``draft_length_policy`` and its cap ``max_draft_tokens`` in ``num_draft_tokens``.
        decode_kwargs: sampling settings (``do_sample``, ``temperature``, ``top_k``, ``top_p``); greedy by default.
        domain_sampling: domain -> the sampling settings that domain decodes with instead (``{}``: greedy); its rows
            are checked for losslessness only where it decodes greedily.
        events: optional ``events(name, **fields)`` callback (the run's event log).
        warn_truncation: warn when prompts were truncated (the pipeline passes False: it warned once already).
        timing_trials: timed repetitions of every decode (>= 1); a row's ``target_trial_times_s`` /
            ``speculative_trial_times_s`` hold one wall time (seconds) per trial, its ``target_time_s`` /
            ``speculative_time_s`` their mean.

    Returns:
        ``{"rows": [per-prompt row], "cost_ratio": {draft: {...}}, "verify_cost_ratio": {str(gamma): {...}}
        (:func:`eval.evaluate.measure_verify_cost_ratio`), "num_draft_tokens": [gammas], "max_new_tokens",
        "sampling", "domain_sampling", "truncated_prompts", "draft_length_policies": [names], "timing_trials",
        "machine_load", "target_only", "target_outputs"}`` (``target_outputs``: domain -> prompt id -> the target-only
        ids of the first trial, greedy or a sample where the domain samples; ``machine_load``: :func:`eval.evaluate.load_record` per domain; ``target_only``: per domain the
        target-only decodes' ``new_tokens``, ``time_s`` (trial means summed) and ``tokens_per_s``); rows have the columns of
        :data:`eval.metrics.PER_PROMPT_COLUMNS` (``draft_lengths``: the decoder's ``AcceptanceStats.draft_lengths``).
    """
    decode_kwargs = dict(decode_kwargs or {})
    gammas = sorted(set([num_draft_tokens] if isinstance(num_draft_tokens, int) else num_draft_tokens))
    policies = dict(draft_length_policies or {})
    settings = [("fixed", gamma, None) for gamma in gammas] + [(n, None, f) for n, f in policies.items()]
    domain_sampling = {d: dict(kw) for d, kw in (domain_sampling or {}).items()}
    ev = _Evaluation(target, tokenizer, drafts, settings, max_new_tokens, max_prompt_tokens, decode_kwargs,
                     max(1, int(timing_trials)), check_lossless, domain_sampling)
    rows: list[dict] = []
    truncated_total, load, target_only = 0, {}, {}  # target_only: domain -> target-only tokens, mean time
    # the weights stay as they are for the whole evaluation: every decode call reuses what the first one read
    # from each model (decode.frozen_weights), as a server would, instead of re-checking every weight per call
    with frozen_weights(target, *drafts.values()):
        first = next(p for ps in prompts_by_domain.values() for p in ps)
        probe, _ = encode_prompt(tokenizer, first.text, max_prompt_tokens)
        _warm_up(target, drafts, probe, gammas[0], ev.eos, ev.pad)
        cost = {name: measure_cost_ratio(target, d, probe, cost_ratio_trials) for name, d in drafts.items()}
        if events:
            events("eval_cost_ratio", cost_ratio={n: c["cost_ratio"] for n, c in cost.items()})
        for domain, prompts in prompts_by_domain.items():
            with LoadMeter() as meter:
                domain_rows, truncated, target_only[domain] = ev.domain(domain, prompts, seed)
            rows.extend(domain_rows)
            truncated_total += truncated
            load[domain] = meter.record
            if events:
                events("eval_domain_done", domain=domain, prompts=len(prompts), seconds=meter.seconds,
                       machine_load=load[domain])
        # v for every draft length the decodes used (not a swept gamma no step reached: a gamma of 100000 with 4
        # new tokens drafts at most 4): the verdicts' cost model weighs each step by it
        verify = measure_verify_cost_ratio(target, probe, verified_lengths(rows), cost_ratio_trials)
    if truncated_total and warn_truncation:  # the pipeline warns once itself, before any model loads
        warnings.warn(f"{truncated_total} prompt(s) longer than eval.max_prompt_tokens={max_prompt_tokens} were "
                      f"truncated from the left", stacklevel=2)
    return {"rows": rows, "cost_ratio": cost, "verify_cost_ratio": verify, "num_draft_tokens": gammas,
            "max_new_tokens": max_new_tokens, "sampling": decode_kwargs, "domain_sampling": domain_sampling,
            "truncated_prompts": truncated_total,
            "draft_length_policies": list(policies), "timing_trials": ev.trials, "machine_load": load,
            "target_only": target_only, "target_outputs": ev.target_outputs}


def _div(a, b):
    return a / b if a is not None and b not in (None, 0) and math.isfinite(b) else None


def phase_split(wall_s: float, prefill_s: float | None, draft_s: float, verify_s: float, missing=None) -> dict:
    """Speculative decoding's wall seconds split by phase: ``{"wall_s", "prefill_s", "draft_s", "verify_s",
    "other_s", "loop_efficiency"}`` with ``other_s = wall_s - prefill_s - draft_s - verify_s`` (the loop's own work)
    and ``loop_efficiency = (prefill_s + draft_s + verify_s) / wall_s`` (time in model forwards / wall). Seconds
    summed over the decodes (``AcceptanceStats.prefill_time_s`` / ``draft_time_s`` / ``verify_time_s``); what cannot
    be computed (``prefill_s`` None, a zero wall time) is ``missing``."""
    forwards = None if prefill_s is None else prefill_s + draft_s + verify_s
    efficiency = _div(forwards, wall_s)
    return {"wall_s": wall_s, "prefill_s": prefill_s, "draft_s": draft_s, "verify_s": verify_s,
            "other_s": missing if forwards is None else wall_s - forwards,
            "loop_efficiency": missing if efficiency is None else efficiency}


def time_breakdown(rows: list[dict], cost_ratio: dict, verify_cost_ratio: dict | None, drafts: dict,
                   num_draft_tokens: int) -> dict:
    """``{draft: {domain: {...}}}`` (fields in the module docstring) at gamma ``num_draft_tokens``, fixed policy.

    ``rows``: per-prompt rows (:data:`eval.metrics.PER_PROMPT_COLUMNS`); ``cost_ratio``: ``{draft: {"cost_ratio",
    "target_forward_s", ...}}``; ``verify_cost_ratio``: ``{str(gamma): {"verify_cost_ratio", ...}}`` or None;
    ``drafts``: the metrics document's ``drafts`` (for the token acceptance rate, measured and expected speedup).
    """
    g = int(num_draft_tokens)
    v = ((verify_cost_ratio or {}).get(str(g)) or {}).get("verify_cost_ratio")
    out: dict[str, dict] = {}
    for name, by_domain in drafts.items():
        cost = cost_ratio.get(name) or {}
        c, t1 = cost.get("cost_ratio"), cost.get("target_forward_s")
        for domain, entry in by_domain.items():
            cell = [r for r in rows if r["draft"] == name and r["domain"] == domain and int(r["num_draft_tokens"]) == g
                    and r.get("draft_length_policy", "fixed") == "fixed"]
            if not cell:
                continue
            wall = sum(r["speculative_time_s"] for r in cell)
            draft_s = sum(r["draft_time_s"] for r in cell)
            verify_s = sum(r["verify_time_s"] for r in cell)
            pre = [r.get("prefill_time_s") for r in cell]
            prefill_s = None if any(p is None for p in pre) else sum(pre)
            steps = sum(r["verify_steps"] for r in cell)
            drafted = sum(r["drafted_tokens"] for r in cell)
            a = entry.get("token_acceptance_rate")
            finite = a is not None and math.isfinite(a) and c is not None
            out.setdefault(name, {})[domain] = {
                "num_draft_tokens": g,
                **phase_split(wall, prefill_s, draft_s, verify_s),
                "cost_ratio": c,
                "cost_ratio_in_loop": _div(_div(draft_s, drafted), t1),
                "verify_cost_ratio": v,
                "verify_cost_ratio_in_loop": _div(_div(verify_s, steps), t1),
                "measured_speedup": entry.get("measured_speedup"),
                "expected_speedup_leviathan": expected_speedup(a, g, c) if finite else None,
                "expected_speedup_components": entry.get("expected_speedup_components") if v else None,
            }
    return out




def _share(x, wall) -> str:
    return "n/a" if x is None or not wall else f"{x:.3f} ({x / wall:.0%})"


def time_breakdown_section(doc: dict) -> list[str]:
    """Markdown lines of the report's "Where decoding time goes" section (empty without ``time_breakdown``)."""
    tb = doc.get("time_breakdown") or {}
    if not tb:
        return []
    lines = ["", f"## Where decoding time goes (gamma = {doc['num_draft_tokens']})", "",
             "Seconds summed over the domain's prompts (share of the speculative wall time); c and v measured "
             "standalone (in the loop); expected speedup from the measured c and v beside Leviathan's (v = 1). "
             "Loop efficiency = time in model forwards / wall time.", "",
             "| domain | draft | wall s | prefill s | draft s | verify s | other s | loop efficiency | c (in loop) | "
             "v (in loop) | measured speedup | expected: measured c, v | expected: Leviathan |", "|" + "---|" * 13]
    for name, by_domain in tb.items():
        for domain, e in by_domain.items():
            wall = e["wall_s"]
            lines.append(
                f"| {domain} | {name} | {fmt(wall, '.3f')} | {_share(e['prefill_s'], wall)} | "
                f"{_share(e['draft_s'], wall)} | {_share(e['verify_s'], wall)} | {_share(e['other_s'], wall)} | "
                f"{fmt(e['loop_efficiency'], '.2f')} | {fmt(e['cost_ratio'], '.3f')} "
                f"({fmt(e['cost_ratio_in_loop'], '.3f')}) | {fmt(e['verify_cost_ratio'], '.2f')} "
                f"({fmt(e['verify_cost_ratio_in_loop'], '.2f')}) | {fmt(e['measured_speedup'], '.2f', suffix='x')} | "
                f"{fmt(e['expected_speedup_components'], '.2f', suffix='x')} | "
                f"{fmt(e['expected_speedup_leviathan'], '.2f', suffix='x')} |")
    return lines
