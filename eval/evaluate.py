"""Per-domain acceptance evaluation: one implementation for the pipeline's eval stage and ``python -m eval``.

For every domain and draft, each prompt is decoded three ways in alternation on the same inputs: target-only
greedy (the baseline and the lossless reference), then speculative decoding with each draft. Acceptance counts
are pooled over prompts (sums, never a mean of per-prompt means).
"""
from __future__ import annotations

import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from decode import AcceptanceStats, autoregressive_generate, speculative_generate
from decode.stats import expected_speedup

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    domain: str
    id: str
    text: str


def encode_prompt(tokenizer, text: str, max_prompt_tokens: int) -> tuple[torch.Tensor, bool]:
    """Token ids (1, T) of ``text`` with the tokenizer's special tokens; keeps the last ``max_prompt_tokens``
    (left truncation, BOS re-prepended). Returns (ids, truncated)."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    truncated = len(ids) > max_prompt_tokens
    if truncated:
        bos = tokenizer.bos_token_id
        keep = ids[-(max_prompt_tokens - (bos is not None)) :]
        ids = ([bos] if bos is not None else []) + keep
    return torch.tensor([ids], dtype=torch.long), truncated


@torch.inference_mode()
def measure_cost_ratio(target, draft, input_ids: torch.Tensor, trials: int = 20) -> dict[str, float]:
    """Cost ratio c = (time of one draft forward) / (time of one target forward), one new token with a KV cache
    after a prefill of ``input_ids`` (1, T); medians over ``trials`` timed forwards each (Leviathan et al. 2023,
    Sec. 3.3 defines c this way). Returns ``{"cost_ratio", "target_forward_s", "draft_forward_s"}``."""
    from transformers import DynamicCache

    def one(model):
        device = next(model.parameters()).device
        ids = input_ids.to(device)
        cache = DynamicCache()
        out = model(input_ids=ids, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        n = ids.size(1)
        for _ in range(trials):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, cache=cache, use_cache=True,
                        position_ids=torch.tensor([[n]], device=device))
            nxt = out.logits[:, -1:].argmax(-1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            n += 1
        return statistics.median(times)

    one(target), one(draft)  # warm-up
    t, d = one(target), one(draft)
    return {"cost_ratio": d / t, "target_forward_s": t, "draft_forward_s": d}


def evaluate_drafts(target, tokenizer, drafts: dict[str, Any], prompts_by_domain: dict[str, list[Prompt]], *,
                    num_draft_tokens: int, max_new_tokens: int, max_prompt_tokens: int, check_lossless: bool = True,
                    cost_ratio_trials: int = 20, decode_kwargs: dict | None = None, seed: int = 0) -> dict:
    """Evaluate every draft on every domain against ``target``.

    Args:
        target: HF causal LM (eval mode). tokenizer: the target's tokenizer (drafts must share it).
        drafts: name -> HF causal LM.
        prompts_by_domain: domain -> prompts.
        decode_kwargs: sampling settings (``do_sample``, ``temperature``, ``top_k``, ``top_p``); greedy by default.

    Returns:
        ``{"domains": {domain: {draft: entry}}, "cost_ratio": {draft: ...}, "per_prompt": [rows]}`` where an
        entry holds ``acceptance_rate``, ``mean_accepted_length``, ``target_tokens_per_s``,
        ``speculative_tokens_per_s``, ``measured_speedup``, ``expected_speedup``, ``num_prompts``,
        ``lossless`` and the pooled ``stats``.
    """
    decode_kwargs = dict(decode_kwargs or {})
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sampling = bool(decode_kwargs.get("do_sample"))
    first = next(p for ps in prompts_by_domain.values() for p in ps)
    probe, _ = encode_prompt(tokenizer, first.text, max_prompt_tokens)
    cost = {name: measure_cost_ratio(target, d, probe, cost_ratio_trials) for name, d in drafts.items()}
    results: dict = {"domains": {}, "cost_ratio": cost, "per_prompt": [], "num_draft_tokens": num_draft_tokens,
                     "max_new_tokens": max_new_tokens, "sampling": decode_kwargs}
    truncated_total = 0
    for domain, prompts in prompts_by_domain.items():
        acc = {name: {"stats": [], "time_s": 0.0, "tokens": 0, "lossless": True} for name in drafts}
        base_time, base_tokens = 0.0, 0
        for i, p in enumerate(tqdm(prompts, desc=f"eval {domain}", dynamic_ncols=True)):
            ids, truncated = encode_prompt(tokenizer, p.text, max_prompt_tokens)
            truncated_total += truncated
            g = torch.Generator().manual_seed(seed + i)
            t0 = time.perf_counter()
            ref = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                          pad_token_id=pad, generator=g, **decode_kwargs)
            t_ref = time.perf_counter() - t0
            n_ref = int(ref.num_new_tokens[0])
            base_time += t_ref
            base_tokens += n_ref
            for name, draft in drafts.items():
                g = torch.Generator().manual_seed(seed + i)
                t0 = time.perf_counter()
                out = speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens,
                                           num_draft_tokens=num_draft_tokens, eos_token_id=eos, pad_token_id=pad,
                                           generator=g, **decode_kwargs)
                t_spec = time.perf_counter() - t0
                n_spec = int(out.num_new_tokens[0])
                same = bool(torch.equal(out.sequences, ref.sequences)) if check_lossless and not sampling else None
                a = acc[name]
                a["stats"].append(out.stats)
                a["time_s"] += t_spec
                a["tokens"] += n_spec
                if same is False:
                    a["lossless"] = False
                s = out.stats
                results["per_prompt"].append({
                    "draft": name, "domain": domain, "prompt_id": p.id, "prompt_tokens": ids.size(1),
                    "truncated": truncated, "new_tokens": n_spec, "verify_steps": s.verify_steps,
                    "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
                    "emitted_tokens": s.emitted_tokens, "draft_time_s": s.draft_time_s,
                    "verify_time_s": s.verify_time_s, "speculative_time_s": t_spec, "target_new_tokens": n_ref,
                    "target_time_s": t_ref, "greedy_equal": same,
                })
        target_tps = base_tokens / base_time if base_time > 0 else float("nan")
        results["domains"][domain] = {}
        for name, a in acc.items():
            pooled = AcceptanceStats.pool(a["stats"])
            spec_tps = a["tokens"] / a["time_s"] if a["time_s"] > 0 else float("nan")
            c = cost[name]["cost_ratio"]
            results["domains"][domain][name] = {
                "acceptance_rate": pooled.acceptance_rate,
                "mean_accepted_length": pooled.mean_accepted_length,
                "target_tokens_per_s": target_tps,
                "speculative_tokens_per_s": spec_tps,
                "measured_speedup": spec_tps / target_tps,
                "expected_speedup": expected_speedup(pooled.acceptance_rate, num_draft_tokens, c),
                "cost_ratio": c,
                "num_prompts": len(prompts),
                "lossless": a["lossless"] if check_lossless and not sampling else None,
                "stats": pooled.to_dict(),
            }
    if truncated_total:
        warnings.warn(f"{truncated_total} prompt(s) longer than eval.max_prompt_tokens={max_prompt_tokens} were "
                      f"truncated from the left", stacklevel=2)
    return results
