"""What one micro-batch of training computes: the :class:`MicroBatch`, the step-loss contract (:data:`StepLoss`) and
its two implementations (next-token cross-entropy, online distillation), and the validation loss.

:func:`next_token_cross_entropy` is the project's one next-token cross-entropy: the baseline's training step
(:func:`cross_entropy_step`) and every validation loss (:func:`evaluate_loss`) go through it, so a trimmed draft
vocabulary (:mod:`data.draft_vocab`) is handled in one place. (The hard-label term of the divergences,
:func:`distill.losses.cross_entropy`, takes labels already aligned with the logits.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclass
class MicroBatch:
    """One micro-batch of token sequences.

    Attributes:
        input_ids: LongTensor (B, T).
        attention_mask: LongTensor (B, T), 1 = real token (what the models attend to).
        loss_mask: BoolTensor (B, T): ``True`` where the prediction made *at* position t counts (its next-token
            distribution for distillation; the label ``input_ids[t+1]`` for cross-entropy, which also needs
            ``attention_mask[t+1]``).
        block_index: LongTensor (B,) rows of the training blocks this came from (looks up a cached teacher);
            ``None`` for generated sequences.
        generated: BoolTensor (B,): ``True`` for rows the draft generated (on-policy; no cached teacher entry, the
            block_index entry of such a row is the block its prompt came from); ``None``: no generated row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    block_index: torch.Tensor | None = None
    generated: torch.Tensor | None = None

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, block_index: torch.Tensor | None = None) -> "MicroBatch":
        """Every position of packed blocks (B, T) is real and counts."""
        return cls(blocks, torch.ones_like(blocks), torch.ones(blocks.shape, dtype=torch.bool, device=blocks.device),
                   block_index)

    def counted(self) -> torch.Tensor:
        """BoolTensor (B, T): positions whose prediction counts (loss mask on real tokens)."""
        return self.loss_mask.bool() & self.attention_mask.bool()

    def next_token_counted(self) -> torch.Tensor:
        """BoolTensor (B, T-1): positions t whose next-token label ``input_ids[t+1]`` counts (``counted()[t]`` and
        a real token at t+1)."""
        return self.counted()[:, :-1] & self.attention_mask[:, 1:].bool()


# A step loss: (student, teacher or None, micro-batch) -> (summed loss over counted tokens, token count). The count
# must equal count_tokens(step_loss, batch): ``batch.counted().sum()`` unless the function carries a
# ``count_tokens(batch) -> int`` attribute.
StepLoss = Callable[[torch.nn.Module, Any, MicroBatch], "tuple[torch.Tensor, int]"]
# A batch hook: (micro-batch, optimizer step, micro-batch index within the step over all processes, unwrapped
# student) -> the micro-batch to train on. Must be a deterministic function of its arguments (and the seed it
# closed over) so resumed runs replay it exactly.
BatchHook = Callable[[MicroBatch, int, int, torch.nn.Module], MicroBatch]
# An evaluation: unwrapped student (eval mode, no grad) -> metrics, e.g. {"mean_accepted_length": 2.1, ...}.
EvalFn = Callable[[torch.nn.Module], dict]


def next_token_cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor, counted: torch.Tensor,
                             model: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy in nats: position t predicts token t+1, the last position has no label.

    Args:
        logits: (B, T, V) float, computed in fp32; a model with a trimmed draft vocabulary
            (:mod:`data.draft_vocab`) gives its ``(B, T, N)`` kept logits.
        input_ids: (B, T) long, the sequences the logits were computed on.
        counted: (B, T-1) bool, whether the prediction at t (label ``input_ids[t+1]``) counts.
        model: the model that produced ``logits``; with a trimmed head the labels are mapped to its kept rows
            (:func:`data.draft_vocab.draft_labels`) and labels outside the kept set add nothing.

    Returns:
        (loss, labels): the scalar fp32 sum over the counted labels, and the (B, T-1) labels it used (-100 where
        nothing was counted: not ``counted``, or outside a trimmed vocabulary).
    """
    from data.draft_vocab import draft_labels

    labels = input_ids[:, 1:].masked_fill(~counted, -100)  # (B, T-1)
    if model is not None:
        labels = draft_labels(model, labels)  # trimmed: kept rows, -100 outside
    flat = logits[:, :-1].float()  # (B, T-1, V)
    return F.cross_entropy(flat.reshape(-1, flat.size(-1)), labels.reshape(-1), reduction="sum"), labels


def cross_entropy_step(student, teacher, batch: MicroBatch):
    """The baseline's :data:`StepLoss`: summed next-token cross-entropy over positions t with ``counted()[t]`` and a
    real label at t+1 (:func:`next_token_cross_entropy`; a trimmed draft vocabulary: labels outside the kept set add
    nothing but are counted, as :func:`count_tokens` knows before the forward)."""
    keep = batch.next_token_counted()  # (B, T-1)
    out = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    loss, _ = next_token_cross_entropy(out.logits, batch.input_ids, keep, student)
    return loss, int(keep.sum())


cross_entropy_step.count_tokens = lambda batch: int(batch.next_token_counted().sum())


def count_tokens(step_loss: StepLoss, batch: MicroBatch) -> int:
    """Tokens ``step_loss`` counts on ``batch`` (its ``count_tokens`` attribute; default: ``batch.counted()``),
    known before the forward so the step's global token count can scale every micro-batch's backward."""
    fn = getattr(step_loss, "count_tokens", None)
    return int(fn(batch)) if fn is not None else int(batch.counted().sum())


def make_distill_step(loss_fn, temperature: float, shared_vocab: int | None = None, **loss_kwargs) -> StepLoss:
    """A step loss for distillation: teacher forward under no_grad (eval mode), divergence ``loss_fn`` summed over
    the counted positions.

    ``loss_fn`` is a :mod:`distill.losses` function called with ``reduction="sum"``; logits are cut to the
    ``shared_vocab`` ids when the two models' embedding matrices are padded to different sizes.
    """

    def step(student, teacher, batch: MicroBatch):
        ids, attn, keep = batch.input_ids, batch.attention_mask, batch.counted()
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, attention_mask=attn).logits  # (B, T, V_t)
        s_logits = student(input_ids=ids, attention_mask=attn).logits  # (B, T, V_s)
        if shared_vocab is not None:
            s_logits, t_logits = s_logits[..., :shared_vocab], t_logits[..., :shared_vocab]
        loss = loss_fn(s_logits, t_logits, keep, temperature=temperature, reduction="sum", **loss_kwargs)
        return loss, int(keep.sum())

    return step


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` over ``blocks`` (N, T)
    (:func:`next_token_cross_entropy`). A draft with a trimmed vocabulary (:mod:`data.draft_vocab`) is scored over
    the labels inside its kept set only (it gives the others probability 0)."""
    from data.draft_vocab import trimmed_logits

    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with trimmed_logits(model):
        for i in range(0, blocks.size(0), batch_size):
            x = blocks[i : i + batch_size].to(device)  # (b, T)
            every = torch.ones(x.size(0), x.size(1) - 1, dtype=torch.bool, device=device)  # (b, T-1)
            logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits
            loss, labels = next_token_cross_entropy(logits, x, every, model)
            total += loss.item()
            count += int((labels >= 0).sum())
    return total / max(1, count)
