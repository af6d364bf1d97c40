"""Token-tree drafting and verification: several candidates per position, one target forward per step.

A chain draft proposes one continuation; when its first token is wrong the step yields one token. A *tree* draft
proposes alternatives at every depth and the target scores every node in ONE forward with a tree attention mask
(each node sees the cached prefix, the last emitted token and its own ancestors; its position id is the prefix
length plus its depth): SpecInfer (Miao et al. 2024), Medusa (Cai et al. 2024), EAGLE-2 (Li et al. 2024),
Sequoia (Chen et al. 2024).

Shapes:

- :class:`TokenTree` ``(branching=(b1, b2, ...), max_nodes=None)``: static. Every node at depth ``i`` expands into
  its ``b_{i+1}`` most likely draft tokens (greedy) or ``b_{i+1}`` tokens drawn from the draft distribution
  without replacement (sampling); ``b1 + b1 b2 + b1 b2 b3 + ...`` nodes, the first ``max_nodes`` of them in
  breadth-first order (children of earlier parents first, siblings in draft order).
- :class:`DynamicTokenTree` ``(depth, top_k, max_nodes)``: EAGLE-2's context-dependent tree. At each depth the
  ``top_k`` nodes of the newest level with the highest path probability under the draft (product of the draft
  probabilities along the path) are expanded into their ``top_k`` most likely tokens; at the end the ``max_nodes``
  nodes with the highest path probability are verified (an ancestor's path probability is never below its
  descendants', so the kept set is a tree).

Verification (batch size 1):

- Greedy: a child is accepted iff its token equals the target's argmax at its parent; at most one sibling can
  match, so the emitted tokens are exactly the target's own greedy tokens, whatever the tree.
- Sampling, static tree: multi-candidate recursive rejection (SpecInfer Alg. 2 / EAGLE's multi-round speculative
  sampling, with siblings drawn without replacement as in Sequoia Alg. 1). At a node with target distribution
  ``r = p`` and draft distribution ``q`` the siblings ``x_1, x_2, ...`` (drawn sequentially from ``q`` without
  replacement) are tried in order: ``x_i`` is accepted with probability ``min(1, r(x_i) / q(x_i))``; after a
  rejection ``r <- norm(max(0, r - q))`` and ``q <- norm(q`` with ``q(x_i) = 0)``. If every sibling is rejected
  the emitted token is drawn from the last ``r``; if one is accepted the walk continues at it (its children were
  drawn from the draft distribution at it). Each round emits ``min(r, q)`` directly and leaves exactly the mass
  of ``norm(max(0, r - q))`` to the later rounds, so every emitted token has the target's distribution p.
- Sampling, dynamic tree: the candidates are the draft's top tokens (a deterministic function of the prefix,
  chosen by comparing path probabilities across branches), so each is verified as a point-mass proposal:
  accepted with probability ``r(x_i)``, after a rejection ``r <- norm(r`` with ``r(x_i) = 0)``. This is exact for
  any candidate set that does not depend on the target's randomness.

Caches: the draft feeds one level of the tree per forward (tree mask over its own cache); the target scores the last
emitted token plus all nodes in one forward. After acceptance the KV entries of the accepted path are moved into
consecutive slots after the prefix and the rest is cut off (no recomputation of the accepted prefix); an accepted
leaf that the draft never fed is fed with the next step's first draft forward, together with the new token. Both
KV states (:class:`decode.common.KVState`, :class:`decode.fast_llama.FastKVState`) do the cache work:
``forward_tree`` (a block under a tree mask) and ``compact`` (the accepted path into place).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from decode.common import DecodeSetup, GenerationOutput, Timer, finalize, new_kv_state, output_vocab_size, prefill, sync
from decode.sampling import process_logits, sample_tokens, uniform
from decode.stats import AcceptanceStats

__all__ = ['DraftTree', 'TokenTree', 'DynamicTokenTree', 'parse_draft_tree', 'tree_generate']


class DraftTree:
    """Base of the tree shapes: ``depth`` (longest root-to-leaf path, the most draft tokens one step can accept),
    ``max_nodes`` (most nodes verified per step) and :meth:`spec` (the string :func:`parse_draft_tree` reads)."""

    depth: int
    max_nodes: int

    def spec(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1 (got {value!r}).")
    return value


@dataclass(frozen=True)
class TokenTree(DraftTree):
    """Static tree: ``branching[i]`` children per node at depth ``i`` (the root, the last emitted token, is depth 0).

    Args:
        branching: sequence of ints >= 1, one per depth, e.g. ``(3, 2, 1)`` = 3 + 6 + 6 = 15 nodes, depth 3.
            ``(1,) * g`` is the chain of ``g`` tokens.
        max_nodes: cap on the nodes per step (>= 1; ``None`` = the full tree); the first ``max_nodes`` in
            breadth-first order are kept.
        spine: expand only the spine, each depth's first child of the previous spine node (the draft's most
            likely token greedy, its first draw sampling): ``b_i - 1`` alternatives per depth, ``sum(b_i)`` nodes,
            and one draft token per draft forward as in the chain (spec ``"spine:3,3,3"``).
    Raises:
        ValueError: empty branching, a branching factor or ``max_nodes`` that is not an int >= 1.
    """

    branching: tuple[int, ...]
    max_nodes: int | None = None
    spine: bool = False

    def __post_init__(self):
        try:
            branching = tuple(self.branching)
        except TypeError:
            raise ValueError(f"branching must be a sequence of ints >= 1, e.g. (3, 2, 1) (got {self.branching!r}).") \
                from None
        if not branching:
            raise ValueError("branching must name at least one depth, e.g. (3, 2, 1) (got an empty sequence).")
        for b in branching:
            _positive_int(b, f"every branching factor (got branching={branching!r}), so each")
        object.__setattr__(self, "branching", branching)
        full = self._full()
        if self.max_nodes is None:
            object.__setattr__(self, "max_nodes", full)
        else:
            object.__setattr__(self, "max_nodes", min(_positive_int(self.max_nodes, "max_nodes"), full))

    @property
    def depth(self) -> int:
        return len(self.branching)

    def _full(self) -> int:
        b = self.branching
        return sum(b) if self.spine else sum(math.prod(b[:i + 1]) for i in range(len(b)))

    def spec(self) -> str:
        s = ("spine:" if self.spine else "") + ",".join(str(b) for b in self.branching)
        return s if self.max_nodes == self._full() else f"{s}/{self.max_nodes}"


@dataclass(frozen=True)
class DynamicTokenTree(DraftTree):
    """Dynamic tree (EAGLE-2, Li et al. 2024, Sec. 4): expand the ``top_k`` nodes of highest draft path
    probability per depth into their ``top_k`` most likely tokens, then keep the ``max_nodes`` nodes of highest path
    probability.

    Args:
        depth: draft forwards after the root's (>= 1): the longest path.
        top_k: nodes expanded per depth and children per expanded node (>= 1).
        max_nodes: nodes verified per step (>= 1).
    Raises:
        ValueError: an argument that is not an int >= 1.
    """

    depth: int = 4
    top_k: int = 4
    max_nodes: int = 16

    def __post_init__(self):
        _positive_int(self.depth, "depth")
        _positive_int(self.top_k, "top_k")
        _positive_int(self.max_nodes, "max_nodes")

    def spec(self) -> str:
        return f"dynamic:{self.depth},{self.top_k},{self.max_nodes}"


def parse_draft_tree(spec) -> DraftTree | None:
    """A tree shape from a config value: ``None`` / ``""`` -> ``None`` (the chain); ``"3,2,1"``, ``[3, 2, 1]`` or
    ``"3,2,1/12"`` (``max_nodes`` 12) -> :class:`TokenTree`; ``"spine:3,3,3"`` -> ``TokenTree((3, 3, 3), spine=True)``; ``"dynamic:D,K,N"`` -> :class:`DynamicTokenTree`
    ``(depth=D, top_k=K, max_nodes=N)``; a :class:`DraftTree` is returned as is.

    Raises:
        ValueError: anything else (the message shows both accepted forms).
    """
    if spec is None or isinstance(spec, DraftTree):
        return spec
    fix = ("write a static tree as 'b1,b2,...' (optionally '/max_nodes'; 'spine:b1,b2,...' expands only the most "
           "likely path) or a dynamic one as 'dynamic:depth,top_k,max_nodes'")
    if isinstance(spec, str):
        s = spec.strip().replace(" ", "")
        if not s:
            return None
        try:
            if s.startswith("dynamic:"):
                d, k, n = (int(x) for x in s[len("dynamic:"):].split(","))
                return DynamicTokenTree(depth=d, top_k=k, max_nodes=n)
            spine = s.startswith("spine:")
            shape, _, cap = s[len("spine:") if spine else 0:].partition("/")
            return TokenTree(tuple(int(x) for x in shape.split(",")), int(cap) if cap else None, spine)
        except ValueError as e:
            raise ValueError(f"draft tree {spec!r} is not valid ({e}): {fix}.") from None
    try:
        return TokenTree(tuple(int(x) for x in spec))
    except (TypeError, ValueError) as e:
        raise ValueError(f"draft tree {spec!r} is not valid ({e}): {fix}.") from None


# ---------------------------------------------------------------------------------------------------- cache edits
def _tree_forward(state, tokens: list[int], positions: list[int], region_start: int, region_pos: list[int],
                  allowed_region: torch.Tensor) -> torch.Tensor:
    """Append ``tokens`` (T nodes) to ``state`` (batch 1) with a tree mask (the state's ``forward_tree``); return
    logits ``(T, V)``.

    Args:
        positions: position id of each new token.
        region_start: first cache slot of the tree region; every valid slot before it is visible to every new token.
        region_pos: position of every region slot, old and new (``L + T - region_start``).
        allowed_region: ``(T, L + T - region_start)`` bool: which region slots each new token sees (its ancestors
            and itself).
    """
    dev = allowed_region.device
    return state.forward_tree(torch.tensor(tokens, dtype=torch.long, device=dev),
                              torch.tensor(positions, dtype=torch.long, device=dev), region_start,
                              torch.tensor(region_pos, dtype=torch.long, device=dev), allowed_region)


# ---------------------------------------------------------------------------------------------------- drafting
class _Nodes:
    """The nodes of one step's tree (batch 1), in creation order; ``-1`` is the root (the last emitted token)."""

    def __init__(self):
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.logp: list[float] = []
        self.slot: list[int | None] = []  # draft cache slot (relative to the tree region) once fed
        self.children: dict[int, list[int]] = {-1: []}
        self.q: dict[int, torch.Tensor] = {}  # sampling, static tree: draft distribution at a parent
        self.stochastic = False  # True: children drawn from q without replacement; False: deterministic candidates

    def add(self, token: int, parent: int, logp: float = 0.0) -> int:
        i = len(self.token)
        self.token.append(token)
        self.parent.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.logp.append(logp)
        self.slot.append(None)
        self.children[i] = []
        self.children[parent].append(i)
        return i

    def path(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.parent[i]
        return out[::-1]


def _feed(dstate, nodes: _Nodes, feed: list[int], region_start: int, base_pos: int, region_pos: list[int]
          ) -> torch.Tensor:
    """One draft forward over the nodes ``feed`` (each sees its fed ancestors); returns their logits ``(F, V)``."""
    fed_before = dstate.length - region_start
    dev = dstate.num_valid.device
    allowed = torch.zeros(len(feed), fed_before + len(feed), dtype=torch.bool, device=dev)
    rows, cols = [], []
    for r, i in enumerate(feed):
        for a in nodes.path(i)[:-1]:  # ancestors were fed in earlier levels
            rows.append(r)
            cols.append(nodes.slot[a])
        rows.append(r)
        cols.append(fed_before + r)
    allowed[rows, cols] = True
    positions = [base_pos + nodes.depth[i] - 1 for i in feed]
    region_pos.extend(positions)
    logits = _tree_forward(dstate, [nodes.token[i] for i in feed], positions, region_start, region_pos, allowed)
    for r, i in enumerate(feed):
        nodes.slot[i] = fed_before + r
    return logits


def _children(logits: torch.Tensor, k: int, do_sample: bool, stochastic: bool, sampling: dict, generator
              ) -> tuple[list[int], list[float], torch.Tensor | None]:
    """Up to ``k`` candidate tokens from the draft ``logits (V,)``: the top ``k`` (greedy, or deterministic
    candidates under sampling) or ``k`` draws without replacement from q (``stochastic``); also their log
    probabilities and q (sampling)."""
    if do_sample:
        q = process_logits(logits, **sampling)  # (V,) float32
        k = min(k, int((q > 0).sum()))
        if stochastic:
            src = q if generator is None or generator.device == q.device else q.to(generator.device)
            toks = torch.multinomial(src, k, replacement=False, generator=generator).to(q.device)
        else:
            toks = q.topk(k).indices
        return toks.tolist(), q[toks].log().tolist(), q
    lp = logits.float().log_softmax(-1)
    top = lp.topk(k)
    return top.indices.tolist(), top.values.tolist(), None


def _draft_static(dstate, nodes: _Nodes, root_logits, tree: TokenTree, depth: int, region_start: int, base_pos: int,
                  do_sample: bool, sampling: dict, generator, vocab: int) -> None:
    nodes.stochastic = do_sample
    budget = tree.max_nodes
    parents, logits = [-1], root_logits[None]  # logits (F, V): one row per parent
    region_pos: list[int] = []
    for level in range(depth):
        b = min(tree.branching[level], budget)
        # candidates of every parent of this level at once (one host sync)
        if do_sample:
            q = process_logits(logits, **sampling)  # (F, V)
            if int((q > 0).sum(1).min()) >= b:
                src = q if generator is None or generator.device == q.device else q.to(generator.device)
                toks = torch.multinomial(src, b, replacement=False, generator=generator).tolist()
            else:  # a parent with fewer than b candidates (top-k / top-p): draw per parent
                toks = [_children(lg, b, True, True, sampling, generator)[0] for lg in logits]
            for r, par in enumerate(parents):
                nodes.q[par] = q[r]
        else:
            toks = logits.topk(b, dim=-1).indices.tolist()  # (F, b), most likely first
        new = []
        for par, row in zip(parents, toks):
            row = row[:max(0, budget)]
            new += [nodes.add(t, par) for t in row]
            budget -= len(row)
        if level + 1 >= depth or not new or budget <= 0:
            break
        b_next = tree.branching[level + 1]
        parents = new[:1] if tree.spine else new[:-(-budget // b_next)]  # only the nodes that will get children
        logits = _feed(dstate, nodes, parents, region_start, base_pos, region_pos)[:, :vocab]


def _draft_dynamic(dstate, nodes: _Nodes, root_logits, tree: DynamicTokenTree, depth: int, region_start: int,
                   base_pos: int, do_sample: bool, sampling: dict, generator, vocab: int) -> None:
    nodes.stochastic = False
    k = tree.top_k
    toks, lps, _ = _children(root_logits, k, do_sample, False, sampling, generator)
    level = [nodes.add(t, -1, lp) for t, lp in zip(toks, lps)]
    region_pos: list[int] = []
    for _ in range(depth - 1):
        if not level:
            break
        feed = sorted(level, key=lambda i: -nodes.logp[i])[:k]
        feed.sort()
        logits = _feed(dstate, nodes, feed, region_start, base_pos, region_pos)[:, :vocab]
        level = []
        for r, i in enumerate(feed):
            toks, lps, _ = _children(logits[r], k, do_sample, False, sampling, generator)
            level += [nodes.add(t, i, nodes.logp[i] + lp) for t, lp in zip(toks, lps)]
    # rerank: the max_nodes nodes of highest path probability (ancestors first on ties), renumbered breadth-first
    order = sorted(range(len(nodes.token)), key=lambda i: (-nodes.logp[i], nodes.depth[i], i))
    keep = set(order[:tree.max_nodes])
    keep = {i for i in keep if all(a in keep for a in nodes.path(i))}  # a tree even under float ties
    kept = sorted(keep, key=lambda i: (nodes.depth[i], i))
    new = _Nodes()
    remap = {-1: -1}
    for i in kept:
        remap[i] = new.add(nodes.token[i], remap[nodes.parent[i]], nodes.logp[i])
        new.slot[remap[i]] = nodes.slot[i]
    nodes.__dict__.update(new.__dict__)


# ---------------------------------------------------------------------------------------------------- verification
def _accept_sampled(p: torch.Tensor, nodes: _Nodes, generator) -> tuple[list[int], int]:
    """Recursive rejection over the tree (see the module docstring). ``p (N+1, V)``: target distribution at the
    root (row 0) and after each node (row ``1 + i``). Returns the accepted path (node ids) and the emitted token."""
    cur, path = -1, []
    while True:
        r = p[cur + 1]
        kids = nodes.children[cur]
        nxt = None
        if kids:
            u = uniform((len(kids),), device=p.device, generator=generator).tolist()
            q = nodes.q[cur] if nodes.stochastic else None
            for j, c in enumerate(kids):
                x = nodes.token[c]
                if nodes.stochastic:
                    qx, rx = float(q[x]), float(r[x])
                    if u[j] * qx < rx:
                        nxt = c
                        break
                    res = (r - q).clamp_min(0.0)
                    q = q.clone()
                    q[x] = 0.0
                    qs = q.sum()
                    q = q / qs if qs > 0 else q
                else:
                    if u[j] < float(r[x]):
                        nxt = c
                        break
                    res = r.clone()
                    res[x] = 0.0
                s = res.sum()
                if s > 0:  # sum 0 is impossible after a rejection in exact arithmetic; keep r if rounding hits it
                    r = res / s
        if nxt is None:
            return path, int(sample_tokens(r, generator))
        path.append(nxt)
        cur = nxt


def _accept_greedy(tgt: list[int], nodes: _Nodes) -> tuple[list[int], int]:
    cur, path = -1, []
    while True:
        want = tgt[cur + 1]
        nxt = next((c for c in nodes.children[cur] if nodes.token[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        cur = nxt


# ---------------------------------------------------------------------------------------------------- generation
def tree_generate(target, draft, io: DecodeSetup, *, tree: DraftTree, max_new_tokens: int, do_sample: bool,
                  sampling: dict, generator: torch.Generator | None, fast_path: bool | None) -> GenerationOutput:
    """Tree speculative decoding of one prompt (called by :func:`decode.speculative_generate` with
    ``draft_tree``; arguments already validated there): ``io`` holds the ``(1, P)`` prompt, its stop ids, pad id,
    shared vocabulary and the output buffer (:func:`decode.common.setup_decoding`).

    Stats per verify step: ``draft_length`` = depth of the tree drafted, ``num_accepted`` = accepted path length,
    ``nodes_verified`` = nodes scored by the target (the last emitted token not counted).
    """
    device, input_ids, attention_mask, buf, vocab = io.device, io.input_ids, io.attention_mask, io.buf, io.vocab
    prompt_len = input_ids.shape[1]
    width_out = prompt_len + max_new_tokens
    stats = AcceptanceStats()
    if max_new_tokens == 0:
        return GenerationOutput(finalize(buf, width_out), io.num_new, stats)
    eos_set = set(io.eos_t.tolist()) if io.eos_t is not None else set()
    wall_t0 = time.perf_counter()
    draft_timer, verify_timer, prefill_timer = Timer(device), Timer(device), Timer(device)
    capacity = width_out + tree.max_nodes + 2
    tstate = new_kv_state(target, 1, device, capacity, fast_path)
    dstate = new_kv_state(draft, 1, device, capacity + tree.max_nodes, fast_path)
    with prefill_timer:
        prefill((tstate, dstate), input_ids, attention_mask)
    last = int(input_ids[0, -1])
    pending = [last]  # tokens not yet in the draft cache
    num_new = 0
    target_vocab, draft_vocab = output_vocab_size(target), output_vocab_size(draft)
    static = isinstance(tree, TokenTree)
    while True:
        depth = min(tree.depth, max_new_tokens - num_new - 1)  # never draft tokens that cannot be emitted
        nodes = _Nodes()
        if depth > 0:
            with draft_timer:
                base_pos = int(dstate.num_valid[0]) + len(pending)  # position of the depth-1 nodes
                root = dstate.forward(torch.tensor([pending], dtype=torch.long, device=device), None)[0, -1]
                region_start = dstate.length
                root = root[:vocab] if vocab < draft_vocab else root
                if static:
                    _draft_static(dstate, nodes, root, tree, depth, region_start, base_pos, do_sample, sampling,
                                  generator, vocab)
                else:
                    _draft_dynamic(dstate, nodes, root, tree, depth, region_start, base_pos, do_sample, sampling,
                                   generator, vocab)
        n_nodes = len(nodes.token)
        verify_start = tstate.length
        allowed = _tree_mask(nodes, device)
        base = int(tstate.num_valid[0])
        positions = [base] + [base + d for d in nodes.depth]
        with verify_timer:
            logits = _tree_forward(tstate, [last] + nodes.token, positions, verify_start, list(positions), allowed)
        if vocab < target_vocab:
            logits = logits[:, :vocab]
        if do_sample:
            path, next_tok = _accept_sampled(process_logits(logits, **sampling), nodes, generator)
        else:
            path, next_tok = _accept_greedy(logits.max(-1).indices.tolist(), nodes)
        emitted = [nodes.token[i] for i in path] + [next_tok]
        m = next((j + 1 for j, tok in enumerate(emitted) if tok in eos_set), len(emitted))  # up to the first EOS
        hit = emitted[m - 1] in eos_set
        buf[0, prompt_len + num_new:prompt_len + num_new + m] = torch.tensor(emitted[:m], dtype=torch.long)
        num_new += m
        stats.record_step(max(nodes.depth, default=0), len(path), m, nodes_verified=n_nodes)
        if hit or num_new >= max_new_tokens:
            break
        # caches: keep the last emitted token and the accepted path (target); the fed part of the path (draft)
        tstate.compact(verify_start, [0] + [1 + i for i in path])
        if depth > 0:
            fed = [i for i in path if nodes.slot[i] is not None]  # a prefix of the path
            dstate.compact(region_start, [nodes.slot[i] for i in fed])
            pending = [nodes.token[i] for i in path[len(fed):]] + [next_tok]
        else:
            pending = pending + [next_tok]
        last = next_tok
    stats.draft_time_s, stats.verify_time_s = draft_timer.seconds, verify_timer.seconds
    stats.prefill_time_s = prefill_timer.seconds
    sync(device)
    stats.wall_time_s = time.perf_counter() - wall_t0
    return GenerationOutput(finalize(buf, width_out), torch.tensor([num_new], dtype=torch.long, device=device), stats)


def _tree_mask(nodes, device) -> torch.Tensor:
    """``allowed (N + 1, N + 1)`` bool over the verify block [last emitted token, node 0 .. node N - 1]: the last
    emitted token sees itself (and the cached prefix), every node sees that token and its own ancestors and itself
    (SpecInfer's tree attention, Miao et al. 2024, Sec. 4)."""
    n_nodes = len(nodes.token)
    allowed = torch.zeros(n_nodes + 1, n_nodes + 1, dtype=torch.bool, device=device)
    allowed[:, 0] = True
    rows, cols = [], []
    for i in range(n_nodes):
        for a in nodes.path(i):
            rows.append(1 + i)
            cols.append(1 + a)
    if rows:
        allowed[rows, cols] = True
    return allowed
