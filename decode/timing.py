"""Timing the forward the decoder really uses (for the cost ratio c of Leviathan et al. 2023, Sec. 3.3).
"""
from __future__ import annotations

import statistics

import torch

from decode.common import Timer, new_kv_state

__all__ = [
    'forward_times_s', 'cost_ratio', 'block_forward_times_s', 'head_share', 'memory_bound_s',
    'weights_read_per_token',
]


class _HeadTiming:
    """One EAGLE-3 draft step as the decoder runs it (decode/eagle3.py): the head's layer over (token, feature) with
    its cache, then its head; features of the target's width fused by ``fc`` (the catch-up's share per token)."""

    def __init__(self, head, prompt: torch.Tensor, steps: int):
        from decode.eagle3 import Eagle3State

        self.head = head
        self.state = Eagle3State(head, 1, prompt.device, prompt.shape[1] + steps + 2)
        self.feat = torch.zeros(1, 1, 3 * head.cfg.target_hidden_size, dtype=head.fc.weight.dtype,
                                device=prompt.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        hidden = self.state.forward(tokens, self.head.fuse(self.feat.expand(-1, t, -1)))
        return self.head.logits(hidden[:, -1:])


class _LookupTiming:
    """One lookup of an n-gram draft (decode/ngram.py) as the decoder runs it: the text so far, then a proposal of
    up to ``max_tokens`` per call; the text grows by one token per call, as decoding does."""

    def __init__(self, draft, max_tokens: int = 4):
        self.draft, self.hist, self.max_tokens = draft, None, max_tokens

    def forward(self, tokens: torch.Tensor) -> None:
        if self.hist is None:
            self.hist = self.draft.history(tokens[0].tolist())
            return
        toks, _ = self.draft.propose(self.hist, self.max_tokens)
        self.hist.extend(toks[:1] or tokens[0].tolist())


def _timing_state(m, prompt: torch.Tensor, steps: int, fast_path):
    if getattr(m, "is_hybrid", False):  # its model's forward (the evaluation scales c by the model's share)
        m = m.model
    if getattr(m, "is_eagle3", False):
        return _HeadTiming(m, prompt, steps)
    if getattr(m, "is_ngram", False):
        return _LookupTiming(m)
    return new_kv_state(m, 1, prompt.device, prompt.shape[1] + steps + 2, fast_path)


@torch.inference_mode()
def forward_times_s(models, prompt: torch.Tensor, steps: int, fast_path: bool | None = None) -> list[float]:
    """Median seconds of one cached single-token forward of each model after prefilling ``prompt`` (the forward
    ours uses; an n-gram draft: one lookup over the prompt's text, its cost per verify step). The models alternate
    step by step, so a load change on a shared machine hits them alike."""
    states = [_timing_state(m, prompt, steps, fast_path) for m in models]
    for state in states:
        state.forward(prompt)
    tok = prompt[:, -1:]
    times = [[] for _ in models]
    for _ in range(steps + 2):
        for state, ts in zip(states, times):
            with Timer(prompt.device) as timer:  # CUDA: events, one wait when read below
                state.forward(tok)
            ts.append(timer)
    return [statistics.median(t.seconds for t in ts[2:]) for ts in times]  # first two are warm-up


def cost_ratio(target, draft, prompt: torch.Tensor, steps: int = 20, fast_path: bool | None = None) -> dict[str, float]:
    """Cost ratio c = (one draft forward) / (one target forward), both one new token with a KV cache after a
    prefill of ``prompt`` (1, T), through the same forward path the decoder uses; medians of ``steps`` forwards,
    the two models alternating. Returns ``{"cost_ratio", "target_forward_s", "draft_forward_s"}`` (seconds)."""
    t, d = forward_times_s([target, draft], prompt, steps, fast_path)
    return {"cost_ratio": d / t, "target_forward_s": t, "draft_forward_s": d}


@torch.inference_mode()
def block_forward_times_s(model, prompt: torch.Tensor, widths, steps: int, fast_path: bool | None = None
                          ) -> dict[int, float]:
    """Median seconds of one cached forward of ``w`` new positions (``w`` in ``widths``, e.g. ``[1, gamma + 1]``:
    a decode step and a verify block) after prefilling ``prompt`` (1, T), through the decoder's own forward. Each
    forward is rolled back right after (the cache length stays T), and the widths alternate step by step, so load
    changes hit them alike. ``block_forward_times_s(...)[g + 1] / [...][1]`` is the verify cost ratio v of
    :func:`decode.expected_speedup`."""
    widths = [int(w) for w in widths]
    state = new_kv_state(model, 1, prompt.device, prompt.shape[1] + max(widths) + 2, fast_path)
    state.forward(prompt[:, :-1])
    base = state.length
    blocks = {w: prompt[:, -1:].repeat(1, w) for w in widths}
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(steps + 2):
        for w in widths:
            with Timer(prompt.device) as timer:  # CUDA: events, one wait when read below
                state.forward(blocks[w], None, logits_to_keep=0 if w > 1 else 1)
            times[w].append(timer)
            state.truncate(base, None, 0)
    return {w: statistics.median(t.seconds for t in ts[2:]) for w, ts in times.items()}  # first two: warm-up


@torch.inference_mode()
def head_share(model, steps: int = 50) -> dict[str, float]:
    """The output head's part of a one-token forward: median seconds of the head's product for one position
    (``(1, E) x (E, N)``, N = the kept rows of a trimmed head, else the vocabulary; the faster of the two weight
    layouts, as the decoder's forward picks; an int8 head's own quantized product) over ``steps`` calls, as
    ``{"head_forward_s", "head_rows"}``; divide by the model's one-token forward (:func:`forward_times_s`) for the
    share."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    head = model.get_output_embeddings()
    int8 = head if isinstance(head, QLinear) else getattr(head, "quantized", None)
    if int8 is not None:  # an int8 head (decode/fast_settings.py): its own fbgemm product is what the forward runs
        x = torch.randn(1, int8.in_features)
        times = []
        for _ in range(steps + 2):
            with Timer(x.device) as timer:
                int8(x)
            times.append(timer)
        return {"head_forward_s": statistics.median(t.seconds for t in times[2:]), "head_rows": int(int8.out_features)}
    w = head.weight
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    packed = w.t().contiguous()  # the (in, out) copy the lean CPU forward multiplies with (decode/fast_weights.py)
    times = {"rows": [], "packed": []}
    for _ in range(steps + 2):  # both layouts alternated; the faster one is what the decoder's forward uses
        with Timer(w.device) as timer:
            torch.nn.functional.linear(x, w)
        times["rows"].append(timer)
        with Timer(w.device) as timer:
            torch.matmul(x, packed)
        times["packed"].append(timer)
    best = min(statistics.median(t.seconds for t in ts[2:]) for ts in times.values())
    return {"head_forward_s": best, "head_rows": int(w.shape[0])}


def weights_read_per_token(model, in_bytes: bool = False) -> int:
    """Parameters (or bytes, ``in_bytes``) one forward of ``model`` at batch 1 must read: every parameter once,
    except the input embedding, of which a forward reads a few rows (an output head tied to it is read whole and
    counts). For a memory-bound forward its time is proportional to this: a self-draft that keeps the target's
    49,152 x 576 embedding reads none of it but the rows of its tokens."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_w = getattr(head, "weight", None) if head is not None else None
    seen, total = {emb.data_ptr()}, 0
    for p in model.parameters():
        if p.data_ptr() in seen and not (head_w is not None and p is head_w):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * (p.element_size() if in_bytes else 1)
    return total


@torch.inference_mode()
def memory_bound_s(model, repeats: int = 5) -> dict[str, float]:
    """The memory bound of one forward of ``model`` on this machine: the bytes a forward must read (every parameter
    except the input embedding, of which it reads a few rows; a head tied to it is counted once) divided by the
    read bandwidth measured here (a sum over a copy of the largest weights, best of ``repeats``). Returns
    ``{"weight_bytes", "bandwidth_gb_s", "bound_s"}``. A forward over a few positions reads the same weights, so its
    time over this bound is how far it is from memory speed."""
    emb = model.get_input_embeddings().weight
    total = weights_read_per_token(model, in_bytes=True)
    probe = torch.empty(max(total, 1 << 26) // 4, dtype=torch.float32, device=emb.device).fill_(1.0)
    best = float("inf")
    for _ in range(repeats + 1):
        with Timer(emb.device) as timer:
            probe.sum()
        best = min(best, timer.seconds)
    bandwidth = probe.numel() * 4 / best
    return {"weight_bytes": float(total), "bandwidth_gb_s": bandwidth / 1e9, "bound_s": total / bandwidth}
