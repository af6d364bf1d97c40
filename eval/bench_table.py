"""The decoder benchmark's results (:func:`eval.bench.run_bench`) as Markdown tables: one ``| metric | value |``
row per number (:func:`format_table`) and chain vs tree (:func:`format_compare`)."""
from __future__ import annotations

__all__ = ["format_compare", "format_table"]

SKIPPED = "skipped (--no-hf)"


def _setup_rows(r: dict) -> list[tuple[str, str]]:
    """The machine's load while timing, and what ran where."""
    load = r["load"]
    other = load.get("other_load")
    return [
        ("machine load while timing (other processes' busy cores)",
         ("unknown" if other is None else f"{other:.2f} of {load['cores']}")
         + (": DISTURBED, other processes kept more than a quarter of a core busy; re-run on a quiet machine "
            "before trusting these timings" if load.get("overloaded") else "")),
        ("model family (tiny random, --family)", r["family"] or "-"),
        ("device / dtype (target, draft) / threads (one-token, block)",
         f"{r['device']} / {r['target_dtype']}, {r['draft_dtype']} / {r['num_threads']}, "
         f"{r['block_threads']['threads'] or r['num_threads']}"),
        ("ours: lean forward (target, draft)",
         f"{r['fast_path']} ({'yes' if r['fast_path_used']['target'] else 'no'}, "
         f"{'yes' if r['fast_path_used']['draft'] else 'no'})"),
        ("prompts x repeats", f"{r['num_prompts']} x {r['repeats']}"),
        ("num_draft_tokens (gamma)", f"{r['num_draft_tokens']}"),
        ("ours: draft-length policy (mean draft length)",
         f"{r['draft_length_policy']['draft_length_policy']} ({r['mean_draft_length']:.2f})"),
        ("max_new_tokens", f"{r['max_new_tokens']}"),
    ]


def _speed_rows(r: dict) -> list[tuple[str, str]]:
    """Tokens/s of every method, the speedups and the acceptance."""
    tps = r["tokens_per_s"]
    hf_ran = tps["hf_assisted"] == tps["hf_assisted"]  # NaN: skipped (--no-hf)
    return [
        ("tokens/s target-only (ours AR)", f"{tps['target_only']:.1f}"),
        *([(f"tokens/s target-only, every forward at {r['block_threads']['threads']} threads",
            f"{tps['target_only_block_threads']:.1f}")] if "target_only_block_threads" in tps else []),
        (f"tokens/s transformers assisted (num_assistant_tokens {r['num_draft_tokens']}, constant)",
         f"{tps['hf_assisted']:.1f}" if hf_ran else SKIPPED),
        ("tokens/s ours speculative", f"{tps['ours_speculative']:.1f}"),
        ("tokens/s transformers generate (target only)", f"{tps['hf_target_only']:.1f}" if hf_ran else SKIPPED),
        ("ours / transformers assisted", f"{r['ours_over_transformers']:.2f}x" if hf_ran else SKIPPED),
        ("ours / transformers generate (target only)", f"{r['ours_over_transformers_target_only']:.2f}x" if hf_ran
         else SKIPPED),
        ("ours / target-only (measured speedup; the faster target-only)", f"{r['ours_over_target_only']:.2f}x"),
        ("acceptance rate (accepted / drafted)", f"{r['acceptance_rate']:.3f}"),
        ("per-token acceptance alpha (accepted / tested)", f"{r['token_acceptance_rate']:.3f}"),
        ("mean accepted length tau", f"{r['mean_accepted_length']:.2f}"),
    ]


def _cost_rows(r: dict) -> list[tuple[str, str]]:
    """Forward times, c and v (standalone and in the loop), the draft head, the target's memory bound, where the
    speculative wall time goes and the expected speedups."""
    bd, il = r["time_breakdown"]["ours_speculative"], r["in_loop"]
    wall = bd["wall_s"] or float("nan")
    head, bound = r["draft_head"], r["target_memory_bound"]
    return [
        ("one-position forward ms (target, draft)",
         f"{1e3 * r['target_forward_s']:.3f}, {1e3 * r['draft_forward_s']:.3f}"),
        ("verify forward ms (gamma + 1 positions)", f"{1e3 * r['target_verify_forward_s']:.3f}"),
        ("cost ratio c (draft / target forward)", f"{r['cost_ratio']:.3f} (in loop {il['cost_ratio']:.3f})"),
        ("draft head: rows, ms per position, share of the draft forward",
         f"{head['head_rows']}, {1e3 * head['head_forward_s']:.3f}, {head['share_of_draft_forward']:.0%}"),
        ("target memory bound: MB read / GB/s measured / bound ms; verify and 1-pos forward over it",
         f"{bound['weight_bytes'] / 1e6:.0f} / {bound['bandwidth_gb_s']:.1f} / {1e3 * bound['bound_s']:.2f}; "
         f"{bound['verify_over_bound']:.2f}x, {bound['one_token_over_bound']:.2f}x"),
        ("verify cost ratio v (verify / 1-pos forward)",
         f"{r['verify_cost_ratio']:.2f} (in loop {il['verify_cost_ratio']:.2f})"),
        ("spec wall: prefill / draft / verify / other",
         f"{bd['prefill_s'] / wall:.0%} / {bd['draft_s'] / wall:.0%} / {bd['verify_s'] / wall:.0%} / "
         f"{bd['other_s'] / wall:.0%}"),
        ("loop efficiency (time in forwards / wall)",
         f"{bd['loop_efficiency']:.2f} (target-only {r['time_breakdown']['target_only']['loop_efficiency']:.2f})"),
        ("expected speedup (Leviathan Thm 3.8, v = 1)", f"{r['expected_speedup']:.2f}x"),
        ("expected speedup (measured c and v)", f"{r['expected_speedup_components']:.2f}x"),
        ("measured / expected (Leviathan)", f"{r['measured_over_expected']:.2f}"),
    ]


def _check_rows(r: dict) -> list[tuple[str, str]]:
    """Greedy outputs differing from target-only, compilation and the several-row layout."""
    hf_ran = r["tokens_per_s"]["hf_assisted"] == r["tokens_per_s"]["hf_assisted"]
    peer, calls = r["row_layout"]["peer"], r["num_prompts"] * r["repeats"]
    return [
        ("ours: greedy outputs differing from target-only (of prompts x repeats)",
         f"{r['greedy_output_mismatches']['ours_speculative']} of {calls}"),
        ("decode.compile (compiled; compile s warm-up / timed)",
         f"{r['compile']['setting']} ({'yes' if r['compile']['compiled'] else 'no'}; "
         f"{r['compile']['compile_time_s']:.1f} / {r['compile']['compile_time_in_timed_s']:.1f})"),
        *([("ours compiled / uncompiled (tokens/s)", f"{r['compile']['compiled_over_uncompiled']:.2f}x"),
           ("ours uncompiled: outputs differing from target-only",
            f"{r['greedy_output_mismatches']['ours_speculative_uncompiled']}")] if r["compile"]["compiled"] else []),
        ("ours: several-row products (row layout; auto: per model, the timed set of its products)",
         _layout_choices(r["row_layout"], "measured", lambda m: f"hidden {m['shapes'][0][0]}")),
        ("ours: one-row products (one-token forwards; auto: all of a model's products, one row as two)",
         _layout_choices(r["row_layout"], "one_row", lambda m: f"{m['layers']} layers")),
        *([(f"ours / ours with row layout {peer} (tokens/s; its mismatches)",
            f"{r['row_layout']['ours_over_peer']:.2f}x; "
            f"{r['greedy_output_mismatches'][f'ours_speculative_row_layout_{peer}']}")] if peer else []),
        ("transformers: outputs differing from target-only (of prompts x repeats)",
         f"{r['greedy_output_mismatches']['hf_assisted']} of {calls}" if hf_ran else SKIPPED),
    ]


def _layout_choices(record: dict, kind: str, label) -> str:
    """The setting, then per model measured under ``auto`` (``record[kind]``, see ``row_layout_record``): its
    ``label(m)``, the chosen layout and the two forms' timed sweeps."""
    return record["setting"] + "".join(
        f"; {label(m)}: {m['chosen']} (weight-left {m['weight_left_us']:.0f} us, "
        f"activation-left {m['activation_left_us']:.0f} us)" for m in record.get(kind, []))


def format_table(r: dict) -> str:
    """``| metric | value |`` Markdown rows of a :func:`eval.bench.run_bench` result (ratios as ``1.23x``, shares
    as percentages, forward times in ms, the load first: DISTURBED above a quarter of a core)."""
    rows = _setup_rows(r) + _speed_rows(r) + _cost_rows(r) + _check_rows(r)
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def format_compare(r: dict) -> str:
    """Chain vs tree: one row per chain / tree method (equal target forwards: tokens per target forward)."""
    lines = ["| method | tokens / target forward (tau) | nodes / target forward | target forwards | tokens/s | "
             "tokens/s vs chain | vs target-only | vs transformers | greedy mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    hf = r["tokens_per_s"]["hf_assisted"]
    for name, c in r["chain_vs_tree"].items():
        vs_hf = f"{c['tokens_per_s'] / hf:.2f}x" if hf == hf else "skipped"
        lines.append(f"| {name} | {c['tokens_per_target_forward']:.2f} | {c['nodes_per_target_forward']:.1f} | "
                     f"{c['target_forwards']} | {c['tokens_per_s']:.1f} | {c['tokens_per_s_over_chain']:.2f}x | "
                     f"{c['tokens_per_s_over_target_only']:.2f}x | {vs_hf} | {c['greedy_output_mismatches']} |")
    return "\n".join(lines)
