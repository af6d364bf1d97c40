"""The most a token tree can gain over a chain for a target / draft pair on this machine, from measurements.

1. Ranks: the target's greedy continuation of each prompt is scored by the draft (teacher forcing: along an accepted
   path the draft sees exactly those tokens); ``p_k`` = the fraction of positions where the target's token is the
   draft's k-th likeliest. Greedy tree verification accepts a child of rank k exactly when that happens, so the
   events are disjoint and ``p_1`` is the chain's per-token acceptance alpha.
2. The best tree: assuming positions are independent with these ``p_k`` (Sequoia, Chen et al. 2024, Sec. 3.1), the
   largest expected accepted length of any tree with ``n`` nodes and depth ``<= d`` is ``tau(n, d) = 1 + F(n, d)``,
   ``F(n, d) = max over child sizes m_1 >= m_2 >= ... (sum = n) of sum_k p_k (1 + F(m_k - 1, d - 1))`` (the
   dynamic programme of Sequoia, Sec. 3.2; the k-th child is the draft's k-th likeliest token). A chain of gamma is
   the tree with one child per node: ``1 + p_1 + ... + p_1^gamma``.
3. Costs: the target's and the draft's cached forward over ``w`` new positions (``decode.block_forward_times_s``,
   widths alternated), in one-position target forwards: ``v(w)``; ``c`` = one draft position. A step of a tree
   with ``n`` nodes and depth ``d`` costs at least ``d c + v(n + 1) + o`` (a draft forward per level at the price
   of one position, however many nodes the level has: a lower bound on the draft phase; ``o`` = the loop's own
   work per step, ``--overhead``), a chain of gamma ``gamma c + v(gamma + 1) + o``.

Prints the rank distribution, the best chain's expected rate (accepted tokens per one-position target forward of
step time) and, per depth, the best tree's tau and rate for some node budgets (and the first that reaches "+25 % tau
at equal depth"), with the verify cost ratio ``v(n + 1)`` at which that tree would tie the best chain: a tree pays
only where some budget reaches both, i.e. where the measured ``v(n + 1)`` lies below the break-even one.

Example (distill_med's draft, medical)::

    python scripts/tree_bound.py --target models/assets/reference_target --draft RUN/drafts/distilled --domain medical
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rank_distribution(target, draft, prompts, max_new_tokens: int, top: int) -> tuple[list[float], int]:
    """``p_k`` for k = 1..top (the target's greedy token is the draft's k-th likeliest), and the positions counted."""
    import torch

    from decode import autoregressive_generate

    counts = [0] * (top + 1)  # last: rank > top
    n = 0
    for ids in prompts:
        out = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=[]).sequences  # every position counts (no EOS stop)
        new = out.shape[1] - ids.shape[1]
        if new < 1:
            continue
        with torch.inference_mode():
            logits = draft(out).logits[0, ids.shape[1] - 1:out.shape[1] - 1].float()  # (new, V)
        tok = out[0, ids.shape[1]:]
        rank = (logits > logits.gather(1, tok[:, None])).sum(1)  # 0-based rank of the target's token
        for r in rank.tolist():
            counts[min(r, top)] += 1
        n += new
    return [c / max(n, 1) for c in counts[:top]], n


def best_tree(p: list[float], max_nodes: int, max_depth: int):
    """``tau(n, d)`` (Sequoia's DP, module docstring) for n = 0..max_nodes, d = 0..max_depth, as a function.

    Bottom-up (no recursion, so any depth and rank count work): ``F[d][n]`` = the best expected accepted tokens
    below a node with ``n`` nodes and depth ``<= d``; per depth, ``G[k][n]`` = the best over children of rank
    ``>= k + 1`` using ``n`` nodes, ``G[k][n] = max(G[k + 1][n], max_m p_k (1 + F[d - 1][m - 1]) + G[k + 1][n - m])``.
    O(max_depth x len(p) x max_nodes^2) steps."""
    top = len(p)
    f_prev = [0.0] * (max_nodes + 1)  # depth 0: nothing below
    table = [f_prev]
    for _ in range(max_depth):
        g_next = [0.0] * (max_nodes + 1)  # k = top: no more ranks
        for k in range(top - 1, -1, -1):
            g = g_next[:]  # no child of rank k + 1
            for n in range(1, max_nodes + 1):
                best = g[n]
                for m in range(1, n + 1):
                    best = max(best, p[k] * (1.0 + f_prev[m - 1]) + g_next[n - m])
                g[n] = best
            g_next = g
        f_prev = g_next
        table.append(f_prev)
    return lambda n, d: 1.0 + table[d][n]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before anything loads: a bad value is a one-line usage error (exit 2)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's Hugging Face directory")
    ap.add_argument("--draft", required=True, help="the draft's Hugging Face directory")
    ap.add_argument("--domain", default="medical", help="the evaluation prompts of this domain (default medical)")
    ap.add_argument("--max-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="target greedy tokens per prompt for the ranks")
    ap.add_argument("--max-nodes", type=int, default=64, help="the largest tree considered (draft nodes)")
    ap.add_argument("--depths", default="3,4,6,8", help="comma-separated tree depths, each >= 1")
    ap.add_argument("--overhead", type=float, default=0.25,
                    help="the loop's own work per step o, in one-position target forwards (bench_decode's 'other')")
    ap.add_argument("--steps", type=int, default=20, help="timed forwards per width")
    ap.add_argument("--top", type=int, default=8, help="draft ranks counted (a tree node's children are ranks 1..top)")
    args = ap.parse_args(argv)
    for name in ("max_prompts", "max_new_tokens", "max_nodes", "steps", "top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if not args.overhead >= 0 or args.overhead == float("inf"):
        ap.error(f"--overhead must be a finite number >= 0 (got {args.overhead})")
    try:
        args.depths = sorted({int(x) for x in args.depths.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--depths {args.depths!r}: expected comma-separated whole numbers, e.g. 3,4,6,8")
    if not args.depths or args.depths[0] < 1:
        ap.error(f"--depths {args.depths}: give at least one depth, each >= 1")
    if args.max_nodes < args.depths[-1]:
        ap.error(f"--max-nodes {args.max_nodes} is below the deepest --depths {args.depths[-1]}: a tree of depth d "
                 f"needs at least d nodes; raise --max-nodes or lower --depths")
    from models.checkpoints import check_checkpoint_dir
    from data.loading import get_domain
    from core.errors import CheckpointError

    try:
        get_domain(args.domain)
    except ValueError as e:
        ap.error(f"--domain: {e}")
    try:
        check_checkpoint_dir(args.target, "target", "--target")
        check_checkpoint_dir(args.draft, "draft", "--draft", need_tokenizer=False)
    except CheckpointError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)

    import torch

    from models.checkpoints import check_context_fits, load_target_and_draft
    from data.loading import eval_prompts
    from decode.timing import block_forward_times_s

    torch.manual_seed(0)
    try:
        target, draft, tok = load_target_and_draft(args.target, args.draft)
        prompts = [tok(e.prompt, return_tensors="pt").input_ids
                   for e in eval_prompts(args.domain, max_prompts=args.max_prompts, tokenizer=tok)]
        if not prompts:
            raise ValueError(f"domain {args.domain!r} has no evaluation prompts; choose another --domain")
        longest = max(x.shape[1] for x in prompts)
        for model, role in ((target, "target"), (draft, "draft")):
            limit = getattr(model.config, "max_position_embeddings", None)
            check_context_fits(model, longest + max(args.max_new_tokens, args.max_nodes + 1), role,
                               f"the longest prompt ({longest} tokens) + max(--max-new-tokens, --max-nodes + 1)",
                               fix=f"lower --max-new-tokens and --max-nodes + 1 to at most {limit - longest} each"
                               if limit and limit > longest else "use a domain with shorter prompts")
    except ValueError as e:  # CheckpointError, TokenizerMismatchError, data errors: one line, exit 1
        raise SystemExit(f"error: {e}") from None
    p, n = rank_distribution(target, draft, prompts, args.max_new_tokens, args.top)
    if n == 0:
        raise SystemExit(f"error: the target generated no token on any of the {len(prompts)} prompts of "
                         f"{args.domain!r} (EOS at once?): no ranks to count; choose another --domain")
    print(f"{args.domain}: {len(prompts)} prompts, {n} target tokens; draft rank of the target's greedy token:")
    print("  " + "  ".join(f"p_{k + 1} {x:.3f}" for k, x in enumerate(p)) + f"  (rank > {args.top}: {1 - sum(p):.3f})")

    depths = args.depths
    widths = sorted({1, *range(2, 10), *[w for w in (13, 17, 25, 33, 49, 65) if w <= args.max_nodes + 1],
                     args.max_nodes + 1})
    ref = prompts[0]
    tv = block_forward_times_s(target, ref, widths, args.steps)
    dv = block_forward_times_s(draft, ref, [1], args.steps)
    one = tv[1]
    c = dv[1] / one

    def v(w: int) -> float:  # linear between measured widths
        lo = max(x for x in widths if x <= w)
        hi = min(x for x in widths if x >= w)
        t = tv[lo] if lo == hi else tv[lo] + (tv[hi] - tv[lo]) * (w - lo) / (hi - lo)
        return t / one

    print(f"target one-position forward {one * 1e3:.2f} ms, c {c:.3f}, o {args.overhead}; v(w): "
          + ", ".join(f"{w}: {tv[w] / one:.2f}" for w in widths))
    tau = best_tree(p, args.max_nodes, max(depths))
    chains = {g: sum(p[0] ** i for i in range(g + 1)) for g in range(1, max(depths) + 1)}
    rate = {g: chains[g] / (g * c + v(g + 1) + args.overhead) for g in chains}
    gbest = max(rate, key=rate.get)
    print(f"chains (expected tau, rate): " + ", ".join(f"gamma {g}: {chains[g]:.2f}, {rate[g]:.3f}" for g in chains))
    print(f"best chain: gamma {gbest}, rate {rate[gbest]:.3f} tokens per one-position target forward")
    print()
    print("| depth | chain tau | tau needed (+25 %) | nodes | best tree tau | step cost (lower bound) | rate "
          "| vs best chain "
          "| v(nodes + 1) measured / to break even |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in depths:
        need = 1.25 * chains[d]
        first_reach = None
        for nodes in range(d, args.max_nodes + 1):
            t = tau(nodes, d)
            cost = d * c + v(nodes + 1) + args.overhead
            if first_reach is None and t >= need:
                first_reach = nodes
            if nodes in (d, 2 * d, 16, 32, args.max_nodes) or nodes == first_reach:
                mark = " (first to reach +25 %)" if nodes == first_reach else ""
                even = t / rate[gbest] - d * c - args.overhead  # the verify cost at which this tree ties the chain
                print(f"| {d} | {chains[d]:.2f} | {need:.2f} | {nodes}{mark} | {t:.2f} | {cost:.2f} | "
                      f"{t / cost:.3f} | {t / cost / rate[gbest]:.2f}x | {v(nodes + 1):.2f} / "
                      f"{f'{even:.2f}' if even > 0 else 'none (its draft levels alone cost more)'} |")
        if first_reach is None:
            print(f"| {d} | {chains[d]:.2f} | {need:.2f} | no tree of up to {args.max_nodes} nodes reaches it "
                  f"(best tau at {args.max_nodes} nodes:) | {tau(args.max_nodes, d):.2f} "
                  f"| | | | |")


if __name__ == "__main__":
    main()
