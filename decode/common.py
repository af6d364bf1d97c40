"""Internals shared by the speculative decoder and the autoregressive baseline (not public API).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache

from decode.fast_settings import BlockThreads
from decode.fast_weights import CachePolicy, cache_policy, tree_visibility  # noqa: F401  (CachePolicy re-exported by decode)
from decode.stats import AcceptanceStats


@dataclass
class GenerationOutput:
    """Result of :func:`decode.speculative_generate` / :func:`decode.autoregressive_generate`.

    Attributes:
        sequences: ``(B, prompt_len + max_new_tokens)`` int64: the prompts exactly as given (left padding kept)
            followed by the new tokens; a row that stopped at EOS is filled with ``pad_token_id`` after the EOS.
        num_new_tokens: ``(B,)`` int64: new tokens per row (EOS included).
        stats: pooled :class:`~decode.stats.AcceptanceStats` of the whole call.
    """

    sequences: torch.Tensor
    num_new_tokens: torch.Tensor
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def output_vocab_size(model: torch.nn.Module) -> int:
    """Number of logits the model produces (embedding rows may be padded beyond the tokenizer's vocabulary)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(getattr(head, "out_features", None), int):  # nn.Linear and quantized Linear (weight() is a method)
        return int(head.out_features)
    if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def sync(device: torch.device) -> None:
    """Wait for queued device work so ``time.perf_counter`` measures it (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Accumulating timer around device work, without host synchronisation while it runs.

    CPU: ``time.perf_counter`` around each interval. CUDA: a pair of timing events recorded on the device's current
    stream per interval (no ``cuda.synchronize`` per step); reading :attr:`seconds` waits once for the last event
    and adds up the intervals (event resolution about 0.5 us), so a queued kernel counts in the interval that
    launched it.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._seconds = 0.0
        self._events: list = []  # CUDA: (start, end) event pairs not yet added up

    def __enter__(self):
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._events.append((self._start, end))
        else:
            self._seconds += time.perf_counter() - self._t0
        return False

    @property
    def seconds(self) -> float:
        """Seconds inside the timer so far (CUDA: one wait for the last recorded event)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3  # elapsed_time: milliseconds
            self._events.clear()
        return self._seconds


def default_eos(target):
    """The EOS id(s) ``generate`` would stop at for ``target``: its ``generation_config.eos_token_id``, else its
    ``config.eos_token_id``, else None (transformers' rule; an instruct model's end-of-turn token, e.g. SmolLM2's
    ``<|im_end|>``, is there)."""
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(getattr(target, "config", None), "eos_token_id", None)
    return eos


def normalize_eos(eos_token_id) -> list[int]:
    """``eos_token_id`` (None, an int, a list / tuple of ints, an integer tensor) as a list of non-negative ids.

    Raises:
        ValueError: a string (a token's text is not its id: ``tokenizer.convert_tokens_to_ids``), a float, a
            negative id, or anything else that is not an integer id.
    """
    import numbers

    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.is_floating_point() or eos_token_id.is_complex():
            raise ValueError(f"eos_token_id must hold integer token ids (got a {eos_token_id.dtype} tensor).")
        items = eos_token_id.flatten().tolist()
    elif isinstance(eos_token_id, (str, bytes)):
        raise ValueError(f"eos_token_id must be a token id, not text (got {eos_token_id!r}); convert it with "
                         f"tokenizer.convert_tokens_to_ids.")
    elif isinstance(eos_token_id, numbers.Integral) and not isinstance(eos_token_id, bool):
        items = [eos_token_id]
    else:
        try:
            items = list(eos_token_id)
        except TypeError:
            raise ValueError(f"eos_token_id must be None, an int or a list of ints (got {eos_token_id!r}).") from None
    ids = []
    for x in items:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or int(x) < 0:
            raise ValueError(f"eos_token_id must be None, an int or a list of non-negative ints (got "
                             f"{eos_token_id!r}).")
        ids.append(int(x))
    return ids


def prepare_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``input_ids (B, P)`` / ``attention_mask (B, P)`` (left padding) and move them to ``device``."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0 (got {max_new_tokens!r}).")
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (batch >= 1, prompt_len >= 1) (got {tuple(input_ids.shape)}).")
    input_ids = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    else:
        if not isinstance(attention_mask, torch.Tensor):
            attention_mask = torch.as_tensor(attention_mask)
        if attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}."
            )
        attention_mask = attention_mask.to(device=device, dtype=torch.long)
        if not bool(attention_mask[:, -1].all()):
            raise ValueError(
                "every prompt must end with a real token (attention_mask[:, -1] == 1): use left padding "
                "(tokenizer.padding_side = 'left'); empty prompts are not supported."
            )
    return input_ids, attention_mask




class KVState:
    """One model's ``DynamicCache`` plus a ``(B, L)`` validity mask over its physical cache slots.

    Rows advance by different amounts per verify step, so slots of rejected tokens stay in the cache as *holes*
    (mask 0) until the physical length is cropped to the longest row. Position ids come from the mask: the position
    of a new token is the number of valid tokens before it in its row, so holes and left padding are invisible to
    the model (attention ignores masked keys exactly).

    Sliding-window models (:func:`cache_policy`): every layer keeps a full cache (so cropping is exact) and the
    state passes its own additive 4-D masks ``(B, 1, T, L)``, one per layer type, with the window measured in
    positions; a ``ValueError`` is raised for a model whose cache cannot be rolled back.
    """

    fast = False

    def __init__(self, model: torch.nn.Module, batch_size: int, device: torch.device, capacity: int = 0):
        self.model = model
        self.policy = cache_policy(model, batch_size, capacity)
        if self.policy.windowed:
            self.cache = DynamicCache()  # full layers everywhere: crop is exact; the mask applies the window
            self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (B, L) position of each slot
            self.mixed = len(set(self.policy.layer_types)) > 1
            self.mask_dtype = next(model.parameters()).dtype
        else:
            self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # (B, L)
        self.num_valid = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,) = next position id
        self.capture, self.features = None, None  # see set_capture

    def set_capture(self, layers) -> None:
        """After every forward, keep ``features (B, T, len(layers) * E)``: Hugging Face's ``hidden_states[i]`` for
        ``i`` in ``layers`` (the input of decoder layer ``i``) concatenated, for an EAGLE-3 draft."""
        self.capture = tuple(int(i) for i in layers)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def _window_masks(self, position_ids: torch.Tensor):
        """Additive ``(B, 1, T, L)`` masks for the new block: causal over valid slots (full layers), and also
        ``position(query) - position(key) < W`` (sliding layers). Each query also sees its own slot, so a padding
        or hole query never has an all-masked row (its output is never read; its key stays masked for others)."""
        length, t = self.mask.shape[1], position_ids.shape[1]
        slot = torch.arange(length, device=self.mask.device)
        qslot = slot[length - t:]
        causal = slot[None, :] <= qslot[:, None]  # (T, L)
        diag = (slot[None, :] == qslot[:, None])[None]  # (1, T, L)
        allowed = self.mask.bool()[:, None, :] & causal[None]  # (B, T, L)
        near = (position_ids[:, :, None] - self.pos[:, None, :]) < self.policy.window  # (B, T, L)
        neg = torch.finfo(self.mask_dtype).min

        def additive(a):
            return torch.zeros(a.shape, dtype=self.mask_dtype, device=a.device).masked_fill_(~(a | diag), neg)[:, None]

        sliding = additive(allowed & near)
        if not self.mixed:
            return sliding
        return {"full_attention": additive(allowed), "sliding_attention": sliding}

    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None, logits_to_keep: int = 1
                ) -> torch.Tensor:
        """Append ``tokens (B, T)`` (``token_mask (B, T)``: 1 real, 0 hole; ``None`` = all real) to the cache;
        return logits ``(B, T', V)`` for the last ``T' = logits_to_keep`` slots (all slots when 0)."""
        tm = torch.ones_like(tokens) if token_mask is None else token_mask.to(torch.long)
        position_ids = self.num_valid[:, None] + tm.cumsum(1) - tm  # (B, T): valid tokens before each slot
        self.mask = torch.cat([self.mask, tm], dim=1)  # (B, L + T)
        attention_mask = self.mask
        if self.policy.windowed:
            self.pos = torch.cat([self.pos, position_ids], dim=1)
            attention_mask = self._window_masks(position_ids)
        with BlockThreads(tokens.device, tokens.numel()):  # decode.block_threads (decode/fast_settings.py)
            out = self.model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids,
                             cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep,
                             output_hidden_states=self.capture is not None)
        if self.capture is not None:
            self.features = torch.cat([out.hidden_states[i] for i in self.capture], -1)
        self.num_valid = self.num_valid + tm.sum(1)
        return out.logits

    def truncate(self, start: int, keep: torch.Tensor | None, max_keep: int) -> None:
        """Keep, per row, only the first ``keep[b]`` slots of the region ``[start, L)``; later slots become holes
        and the physical cache is cropped to ``start + max_keep`` (``max_keep == keep.max()``; ``keep=None``:
        every row keeps ``max_keep``)."""
        new_len = start + max_keep
        if keep is None:  # every row keeps max_keep
            keep = torch.full_like(self.num_valid, max_keep)
        remove = self.length - new_len
        if remove > 0:
            self.cache.crop(-remove)  # transformers >= 5: a negative value removes that many trailing slots
            self.mask = self.mask[:, :new_len]
            if self.policy.windowed:
                self.pos = self.pos[:, :new_len]
        region = self.mask[:, start:]  # (B, max_keep)
        slot = torch.arange(region.shape[1], device=region.device)
        region = region * (slot[None, :] < keep[:, None])
        self.mask = torch.cat([self.mask[:, :start], region], dim=1)
        self.num_valid = self.mask.sum(1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (1-D index tensor)."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.num_valid = self.num_valid[rows]
        if self.policy.windowed:
            self.pos = self.pos[rows]

    def forward_tree(self, tokens: torch.Tensor, positions: torch.Tensor, region_start: int,
                     region_positions: torch.Tensor, allowed_region: torch.Tensor) -> torch.Tensor:
        """Append a token-tree block (batch 1, :mod:`decode.tree`): ``tokens (T,)`` int64 at position ids
        ``positions (T,)``; return logits ``(T, V)``.

        Every valid slot before ``region_start`` is visible to every new token; in the region ``[region_start,
        L + T)`` token ``i`` sees the slots where ``allowed_region[i]`` is set (``(T, L + T - region_start)`` bool:
        its ancestors and itself), whose positions are ``region_positions (L + T - region_start,)``. A windowed
        model's window applies on top, by position (one additive mask per layer type when they differ)."""
        dev, t = allowed_region.device, tokens.shape[0]
        allowed, kpos = tree_visibility(self.mask[0, :region_start].bool(), allowed_region, region_positions)
        window = self.policy.window
        full = allowed
        if window is not None:
            allowed = allowed & ((positions[:, None] - kpos[None, :]) < window)
        dtype = next(self.model.parameters()).dtype
        neg = torch.finfo(dtype).min

        def additive(a):
            return torch.zeros(a.shape, dtype=dtype, device=dev).masked_fill_(~a, neg)[None, None]

        mask = additive(allowed)
        if window is not None:
            self.pos = torch.cat([self.pos, positions[None]], 1)
            if self.mixed:
                mask = {"full_attention": additive(full), "sliding_attention": mask}
        self.mask = torch.cat([self.mask, torch.ones(1, t, dtype=torch.long, device=dev)], 1)
        with BlockThreads(dev, t):  # decode.block_threads (decode/fast_settings.py)
            out = self.model(input_ids=tokens[None], attention_mask=mask, position_ids=positions[None],
                             cache=self.cache, use_cache=True, logits_to_keep=0)
        self.num_valid = self.num_valid + t
        return out.logits[0]

    def compact(self, start: int, keep: list[int]) -> None:
        """Keep only the slots ``start + keep[i]`` (``keep`` ascending) of the region after ``start``, moved into the
        consecutive slots ``start + i``; every later slot is cut off (token trees, batch 1: the accepted path).
        Their positions must already be consecutive (a root-to-node path). No recomputation: the K/V entries are
        copied."""
        n = len(keep)
        if keep != list(range(n)):
            idx = torch.tensor(keep, dtype=torch.long, device=self.num_valid.device) + start
            for layer in self.cache.layers:  # (B, H_kv, L, D)
                layer.keys[:, :, start:start + n] = layer.keys[:, :, idx]
                layer.values[:, :, start:start + n] = layer.values[:, :, idx]
            if self.policy.windowed:
                self.pos[:, start:start + n] = self.pos[:, idx]
        self.truncate(start, None, n)


def new_kv_state(model: torch.nn.Module, batch_size: int, device: torch.device, capacity: int = 256,
                 fast_path: bool | None = None):
    """A KV state for ``model``: the lean Llama forward (:class:`decode.fast_llama.FastKVState`) where it supports
    the model, else the Hugging Face forward (:class:`KVState`).

    ``fast_path``: ``None`` = automatic, ``False`` = always the Hugging Face forward, ``True`` = require the lean
    forward (``ValueError`` naming the reason when the model is not supported). ``capacity``: expected number of
    cache slots (the lean state preallocates that many and grows when needed).
    """
    from decode.fast_llama import FastKVState
    from decode.fast_weights import frozen_cached, unsupported_reason

    if fast_path is False:
        return KVState(model, batch_size, device, capacity)
    reason = frozen_cached(model, "unsupported_reason", lambda: unsupported_reason(model))
    if reason is None:
        return FastKVState(model, batch_size, device, capacity=capacity)
    if fast_path:
        raise ValueError(f"fast_path=True but the lean forward does not support this model: {reason}.")
    return KVState(model, batch_size, device, capacity)


def first_stop(tokens: torch.Tensor, count: torch.Tensor, eos_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row of ``tokens (B, T)`` (``count (B,)`` candidates) at its first EOS (kept).

    Returns ``(num_emitted (B,), hit_eos (B,) bool)``.
    """
    if eos_ids is None:
        return count, torch.zeros_like(count, dtype=torch.bool)
    slot = torch.arange(tokens.shape[1], device=tokens.device)
    is_eos = torch.isin(tokens, eos_ids) & (slot[None, :] < count[:, None])  # (B, T)
    hit = is_eos.any(1)
    first = is_eos.to(torch.long).argmax(1)  # first True (0 when none, masked by hit)
    return torch.where(hit, first + 1, count), hit


def write_tokens(
    buf: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor, pad: int
) -> None:
    """``buf[rows[b], start[b] + j] = tokens[b, j]`` for ``j < num[b]`` (pad for ``j >= num[b]``; those slots are
    still unwritten, ``buf`` has room for them)."""
    slot = torch.arange(tokens.shape[1], device=tokens.device)
    cols = start[:, None] + slot[None, :]  # (B, T)
    vals = torch.where(slot[None, :] < num[:, None], tokens, torch.full_like(tokens, pad))
    buf[rows[:, None], cols] = vals


def finalize(buf: torch.Tensor, width: int) -> torch.Tensor:
    return buf[:, :width].contiguous()


@dataclass
class DecodeSetup:
    """What both decoders derive from their arguments: inputs on the model's device, the stop ids (``eos_t``:
    ``(E,)`` int64 or ``None``), the pad id, the id range ``[0, vocab)`` decoded from, and the output buffer
    ``buf (B, P + max_new_tokens + spare)`` (prompts copied in, pad elsewhere) with ``num_new (B,)``."""

    device: torch.device
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    eos_t: torch.Tensor | None
    pad: int
    vocab: int
    buf: torch.Tensor
    num_new: torch.Tensor


def setup_decoding(models: Sequence[torch.nn.Module], input_ids, attention_mask, max_new_tokens: int,
                   eos_token_id, pad_token_id: int | None, vocab_size: int | None, spare: int) -> DecodeSetup:
    """Validate and place the inputs (see :func:`prepare_inputs`) on the first model's device; ``vocab`` is the
    smallest logit count of ``models``, capped by ``vocab_size`` (so padded ids are never decoded).

    Raises:
        ValueError: bad shapes / right padding, ``max_new_tokens < 0``, ``vocab_size < 1``, a bad ``eos_token_id``.
    """
    device = model_device(models[0])
    input_ids, attention_mask = prepare_inputs(input_ids, attention_mask, max_new_tokens, device)
    eos = normalize_eos(default_eos(models[0]) if eos_token_id is None else eos_token_id)
    vocab = min(output_vocab_size(m) for m in models)
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (got {vocab_size!r}).")
        vocab = min(vocab, int(vocab_size))
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    bsz, prompt_len = input_ids.shape
    buf = torch.full((bsz, prompt_len + max_new_tokens + spare), pad, dtype=torch.long, device=device)
    buf[:, :prompt_len] = input_ids
    return DecodeSetup(device, input_ids, attention_mask,
                       torch.tensor(eos, dtype=torch.long, device=device) if eos else None, pad, vocab, buf,
                       torch.zeros(bsz, dtype=torch.long, device=device))


def prefill(states, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Feed every prompt token but the last ``(B, P - 1)`` to each KV state; the last one goes in with the first
    drafted / verified block."""
    if input_ids.shape[1] > 1:
        pm = None if bool(attention_mask.all()) else attention_mask[:, :-1]
        for state in states:
            state.forward(input_ids[:, :-1], pm)


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to ``(B, P)`` ids and attention mask (1 = real token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError("empty prompt: every prompt needs at least one token")
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask
