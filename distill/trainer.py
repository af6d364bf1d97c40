"""One training loop for every stage: reference-target pretraining, the cross-entropy baseline, distillation and
LoRA / full fine-tuning (:func:`train`).

The loop runs on ``accelerate`` (one process here; several under ``accelerate launch``). Loss normalisation is
explicit: each micro-batch returns a *summed* loss over its counted tokens, and the optimizer step divides by the
global token count of the whole step, so the update does not depend on how a batch is split into micro-batches
(docs/architecture.md, "Conventions"; tested for 8x1 / 4x2 / 2x4 splits).

Data: the optimizer step ``s`` uses the blocks :func:`batch_indices` picks for ``s`` (a pure function of the step
and seed). A ``batch_hook`` may replace a micro-batch (on-policy distillation swaps in the draft's own
generations); it receives the step and micro-batch index so its randomness is a pure function of them too.

Checkpoints (:mod:`distill.trainer`: ``accelerate.save_state`` plus ``trainer_state.json`` and the best
weights, atomically in ``<out_dir>/checkpoint-last``); with ``resume=True`` training continues from there and ends
with the same weights as an uninterrupted run (tested with a real ``kill -9``).

Scale-out (``trainer.strategy``, :mod:`distill.launch`): the same loop runs on one process, under DDP, or under
DeepSpeed ZeRO-2/3 when started with ``accelerate launch --config_file conf/accelerate/<strategy>.yaml``. The
global batch (``trainer.global_batch_size``) is split into per-process micro-batches and accumulation steps, so the
sequences of every optimizer step, and hence the loss curve, do not depend on the process count; each process takes
its contiguous share of the step's block indices. The frozen teacher is replicated, or (ZeRO-3,
``trainer.teacher_placement=zero3``) runs in its own DeepSpeed inference engine. Checkpoints are collective
(DeepSpeed writes one partition per process); the selected weights are gathered on the main process.

Closing the loop: with ``evaluate`` and ``eval_every > 0`` the student is evaluated every ``eval_every`` steps and
at the last step; the weights with the highest ``select_key`` (mean accepted length) are restored at the end.
(A run shorter than ``eval_every`` steps is never evaluated: it keeps its last weights.)

The trainer's pieces live by job: settings in :mod:`distill.config`, launch and preparation in
:mod:`distill.launch`, checkpoints in :mod:`distill.trainer`, the micro-batch losses in
:mod:`distill.trainer`; their public names are importable from here too.

What one micro-batch of training computes: the :class:`MicroBatch`, the step-loss contract (:data:`StepLoss`) and
its two implementations (next-token cross-entropy, online distillation), and the validation loss.

:func:`next_token_cross_entropy` is the project's one next-token cross-entropy: the baseline's training step
(:func:`cross_entropy_step`) and every validation loss (:func:`evaluate_loss`) go through it, so a trimmed draft
vocabulary (:mod:`models.vocab`) is handled in one place. (The hard-label term of the divergences,
:func:`distill.losses.cross_entropy`, takes labels already aligned with the logits.)

Resumable checkpoints and checkpoint selection of :func:`distill.trainer.train`.

``<out_dir>/checkpoint-last`` holds ``accelerate.save_state`` (model, optimizer, scheduler, RNG; DeepSpeed: one
partition per process), ``trainer_state.json`` (:class:`TrainState`) and the selected weights so far
(``best_model.safetensors``), written atomically by :func:`save_checkpoint`; :func:`resume` loads them back after
:func:`check_resumable` has compared the stored launch with this one. :class:`CheckpointSelector` scores the student
during training and keeps the best weights; :class:`TrainLog` is ``train_log.jsonl``.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from core.runtime import torch_threads
from core.io import atomic_dir, write_json_atomic
from distill.config import STRATEGIES, TrainerConfig, cosine_with_warmup, zero_stage
from distill.launch import (
    Run,
    check_launch,
    distributed_state,
    optimizer_parameters,
    prepare_run,
    state_dict_copy,
    uses_deepspeed,
)

__all__ = [
    'train', 'batch_indices', 'rows_this_run_uses', 'blocks_this_run_uses', 'BudgetClock', 'TrainerConfig',
    'STRATEGIES', 'cosine_with_warmup', 'check_launch', 'distributed_state', 'uses_deepspeed', 'prepare_run',
    'optimizer_parameters', 'Run', 'TrainState', 'save_checkpoint', 'check_resumable', 'CheckpointSelector',
    'TrainLog', 'MicroBatch', 'StepLoss', 'BatchHook', 'EvalFn', 'cross_entropy_step', 'make_distill_step',
    'count_tokens', 'next_token_cross_entropy', 'evaluate_loss',
]


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
            (:mod:`models.vocab`) gives its ``(B, T, N)`` kept logits.
        input_ids: (B, T) long, the sequences the logits were computed on.
        counted: (B, T-1) bool, whether the prediction at t (label ``input_ids[t+1]``) counts.
        model: the model that produced ``logits``; with a trimmed head the labels are mapped to its kept rows
            (:func:`models.vocab.draft_labels`) and labels outside the kept set add nothing.

    Returns:
        (loss, labels): the scalar fp32 sum over the counted labels, and the (B, T-1) labels it used (-100 where
        nothing was counted: not ``counted``, or outside a trimmed vocabulary).
    """
    from models.vocab import draft_labels

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
    (:func:`next_token_cross_entropy`). A draft with a trimmed vocabulary (:mod:`models.vocab`) is scored over
    the labels inside its kept set only (it gives the others probability 0)."""
    from models.vocab import trimmed_logits

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


log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What a resumable checkpoint records (``checkpoint-last/trainer_state.json``, same keys)."""

    step: int = 0  # optimizer steps done
    elapsed_s: float = 0.0  # training-loop wall clock so far, resumed parts included, selection evaluations not
    tokens_seen: int = 0
    final_loss: float | None = None  # mean loss per token of the last logged window
    best: dict | None = None  # {"step", "metrics"} of the selected weights
    last_eval_step: int | None = None
    stopped_early: str | None = None  # "max_time_s" when the budget ended the run
    selection_eval_s: float = 0.0  # time spent in selection evaluations
    global_batch_sequences: int = 0
    num_processes: int = 1
    strategy: str = "single"


def save_checkpoint(accelerator, ckpt: Path, state: dict, best_weights: dict[str, torch.Tensor] | None = None) -> None:
    """Resumable state (``state["step"]`` etc.), written atomically: a killed save leaves the previous checkpoint
    intact. ``best_weights`` (the selected weights so far) go to ``best_model.safetensors`` beside it.

    Collective: every process calls it. The main process picks the temporary folder; every process writes its part
    of ``accelerator.save_state`` there (DeepSpeed: its partition; RNG state), then the main process renames it.
    """
    from contextlib import nullcontext

    from safetensors.torch import save_file

    accelerator.wait_for_everyone()
    main = accelerator.is_main_process
    with atomic_dir(ckpt) if main else nullcontext() as tmp:
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            tmp = Path(broadcast_object_list([str(tmp) if main else None], from_process=0)[0])
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()
        if main:
            if best_weights is not None:
                save_file(best_weights, str(tmp / "best_model.safetensors"))
            write_json_atomic(tmp / "trainer_state.json", state)
    accelerator.wait_for_everyone()


def check_resumable(saved: dict, now: dict, ckpt: Path) -> None:
    """A checkpoint resumes under another process count only with the same global batch, and (DeepSpeed keeps
    one optimizer partition per process) only outside DeepSpeed.

    Raises:
        ValueError: naming the stored and the new setting and the fix.
    """
    gb = saved.get("global_batch_sequences")
    if gb is not None and gb != now["global_batch_sequences"]:
        raise ValueError(f"{ckpt} was trained with {gb} sequences per optimizer step; this launch gives "
                         f"{now['global_batch_sequences']} (micro_batch_size x accumulation x {now['num_processes']} "
                         f"processes). Set trainer.global_batch_size={gb} so the batch stays the same across "
                         f"process counts.")
    was, strategy = saved.get("strategy", "single"), now["strategy"]
    deepspeed = zero_stage(was) is not None or zero_stage(strategy) is not None
    if deepspeed and (was != strategy or saved.get("num_processes", 1) != now["num_processes"]):
        raise ValueError(f"{ckpt} holds a {was} checkpoint of {saved.get('num_processes', 1)} process(es); resuming it "
                         f"as {strategy} on {now['num_processes']} is not supported (DeepSpeed partitions the optimizer "
                         f"state per process). Resume with trainer={was} on {saved.get('num_processes', 1)} "
                         f"process(es), or start a new run directory.")


def resume(run: Run, cfg: TrainerConfig, ckpt: Path, state: TrainState, desc: str) -> dict | None:
    """Load ``ckpt`` into the prepared objects and ``state`` (with ``cfg.resume``); returns the selected weights
    saved with it (None when there are none or this process does not keep them).

    Raises:
        ValueError: a damaged checkpoint, or one that cannot resume under this launch (:func:`check_resumable`).
    """
    from safetensors.torch import load_file

    if not cfg.resume:
        return None
    if not (ckpt / "trainer_state.json").exists():
        log.warning("%s: trainer.resume=true but no checkpoint in %s (checkpoints are written every "
                    "trainer.save_every=%d steps); starting from step 0", desc, ckpt, cfg.save_every)
        return None
    try:
        saved = json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{desc}: cannot resume, {ckpt / 'trainer_state.json'} is damaged ({e}). Delete "
                         f"{ckpt} to start this stage over, or start a new run directory.") from None
    check_resumable(saved, asdict(state), ckpt)
    try:
        run.accelerator.load_state(str(ckpt))
    except Exception as e:  # noqa: BLE001  (safetensors, torch.load, missing files: all mean a damaged checkpoint)
        raise ValueError(f"{desc}: cannot resume, the checkpoint {ckpt} is damaged or incomplete "
                         f"({type(e).__name__}: {e}). Delete {ckpt} to start this stage over, or start a new run "
                         f"directory.") from None
    known = {k: v for k, v in saved.items() if k in TrainState.__dataclass_fields__}
    # the launch's own process count and strategy; a new budget (or none) applies to the continuation
    state.__dict__.update({**known, "num_processes": state.num_processes, "strategy": state.strategy,
                           "stopped_early": None})
    log.info("resumed %s from step %d", desc, state.step)
    if state.best is not None and (ckpt / "best_model.safetensors").exists() and run.keeps_best:
        return load_file(str(ckpt / "best_model.safetensors"))
    return None


def diverged(desc: str, what: str, step: int, ckpt: Path) -> str:
    """The message of a run that stopped on a non-finite loss or weights: the step, the checkpoint kept, the fix."""
    kept = f"the last good checkpoint {ckpt} (step {_ckpt_step(ckpt)}) is kept" if ckpt.exists() else \
        "no checkpoint was written yet"
    return (f"{desc}: {what} at step {step}; training stopped and {kept}. Start a new run with a lower trainer.lr "
            f"(or a larger trainer.warmup_steps / smaller trainer.max_grad_norm), or check the data; resuming "
            f"needs the same settings.")


def _ckpt_step(ckpt: Path):
    try:
        return json.loads((ckpt / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return "?"


def check_finite_params(model: torch.nn.Module, desc: str, step: int, ckpt: Path) -> None:
    """Raise FloatingPointError when a parameter holds NaN/inf (an optimizer step overflowed): such weights are
    never saved over the last good checkpoint."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise FloatingPointError(diverged(desc, f"weights became non-finite ({', '.join(bad[:3])})", step, ckpt))


class TrainLog:
    """``train_log.jsonl`` (main process only): one JSON record per logged step and per evaluation. A resumed run
    first drops the records written after its checkpoint (they are replayed)."""

    def __init__(self, path: Path, start_step: int, is_main: bool):
        self.path, self.is_main = path, is_main
        if is_main and start_step == 0:
            path.unlink(missing_ok=True)
        elif is_main and path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
            path.write_text("".join(line + "\n" for line in keep))

    def __call__(self, rec: dict) -> None:
        if self.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def _score(value) -> float:
    """A selection score; NaN or None (e.g. no verify step) ranks below every number."""
    return -math.inf if value is None or value != value else float(value)


class CheckpointSelector:
    """Scores the student with ``evaluate`` and keeps a CPU copy of the best weights by ``select_key`` (higher is
    better; ties keep the earlier step). Evaluation time pauses the budget clock
    (:class:`distill.trainer.BudgetClock`)."""

    def __init__(self, run: Run, state: TrainState, clock: Any, evaluate, select_key: str,
                 desc: str, write_log: TrainLog, on_eval, best_weights: dict | None):
        self.run, self.state, self.clock, self.evaluate = run, state, clock, evaluate
        self.select_key, self.desc, self.write_log, self.on_eval = select_key, desc, write_log, on_eval
        self.best_weights = best_weights

    def __call__(self, done: int, last_loss: float | None) -> None:
        t_eval = time.perf_counter()
        model = self.run.eval_model()  # ZeRO-3: full weights gathered on the main process only (None elsewhere)
        metrics = None
        if model is not None:
            model.eval()
            with torch.no_grad():
                metrics = dict(self.evaluate(model))
            model.train(model is self.run.raw_student)
        metrics = self.run.main_value(metrics)  # every process selects by the main process's numbers
        if self.select_key not in metrics:
            raise ValueError(f"{self.desc}: the evaluation returned {sorted(metrics)}, without {self.select_key!r}")
        best = self.state.best
        if best is None or _score(metrics[self.select_key]) > _score(best["metrics"][self.select_key]):
            self.state.best = {"step": done, "metrics": metrics}
            self.best_weights = state_dict_copy(model) if model is not None else None
        self.state.last_eval_step = done
        eval_s = time.perf_counter() - t_eval
        self.clock.pause(eval_s)  # selection evaluations are not training: they don't spend the budget
        self.state.selection_eval_s += eval_s
        rec = {"kind": "eval", "step": done, "loss": last_loss, **metrics, "eval_time_s": eval_s,
               "best_step": self.state.best["step"]}
        self.write_log(rec)
        if self.on_eval is not None:
            self.on_eval(done, rec)




def batch_indices(num_blocks: int, step: int, global_batch: int, seed: int) -> torch.Tensor:
    """Indices (global_batch,) of the blocks used at optimizer step ``step``: a per-epoch seeded permutation, so the
    data position is a pure function of the step (exact resume, deterministic sharding)."""
    start = step * global_batch
    idx = []
    while len(idx) < global_batch:
        epoch, offset = divmod(start + len(idx), num_blocks)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(num_blocks, generator=g)
        take = min(global_batch - len(idx), num_blocks - offset)
        idx.extend(perm[offset : offset + take].tolist())
    return torch.tensor(idx)


def rows_this_run_uses(num_blocks: int, tcfg: TrainerConfig, seed: int, num_processes: int = 1
                       ) -> torch.Tensor | None:
    """The blocks a run of ``tcfg.max_steps`` steps will read, when that is less than one epoch: the first
    ``max_steps * global batch`` indices of the epoch-0 permutation (:func:`batch_indices`), at most
    ``tcfg.unique_blocks`` of them when that is set (the run then reads those several times); ``None`` when it reads
    all of them."""
    needed = tcfg.max_steps * tcfg.global_batch(num_processes)  # trainer.global_batch_size or mb x accum x world
    if tcfg.unique_blocks:
        needed = min(needed, tcfg.unique_blocks)
    return None if needed >= num_blocks else batch_indices(num_blocks, 0, needed, seed)


def blocks_this_run_uses(blocks: torch.Tensor, tcfg: TrainerConfig, seed: int, num_processes: int = 1
                         ) -> torch.Tensor:
    """The training blocks (N, T) a run will read (:func:`rows_this_run_uses`): caching the teacher for only these
    costs the same teacher forwards as the online teacher instead of a pass over the whole domain."""
    rows = rows_this_run_uses(blocks.size(0), tcfg, seed, num_processes)
    return blocks if rows is None else blocks[rows]  # (needed, T)


class BudgetClock:
    """The ``trainer.max_time_s`` clock: training-loop seconds, continued across resumed parts, paused during
    selection evaluations; every process follows the main process's reading (same stop step, same LR). Before
    :meth:`start` (while the run is prepared) no time has been spent."""

    def __init__(self, cfg: TrainerConfig):
        self.cfg, self.run = cfg, None
        self.t0 = time.perf_counter()
        self.shared_s = 0.0  # the last reading shared by all processes

    def start(self, run: Run, elapsed_s: float = 0.0) -> "BudgetClock":
        """Start counting, ``elapsed_s`` seconds already spent (by the resumed parts)."""
        self.run, self.t0, self.shared_s = run, time.perf_counter() - elapsed_s, elapsed_s
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def sync(self) -> float:
        self.shared_s = self.run.main_value(self.elapsed())
        return self.shared_s

    def pause(self, seconds: float) -> None:
        self.t0 += seconds

    def progress(self) -> float:
        """Spent fraction of the budget with ``schedule_over="time"`` (0 otherwise): drives the cosine."""
        return min(1.0, self.shared_s / self.cfg.max_time_s) if self.cfg.schedule_over == "time" else 0.0

    def exhausted(self) -> bool:
        return bool(self.cfg.max_time_s) and self.sync() >= self.cfg.max_time_s


def exposure(blocks: torch.Tensor, out: dict) -> dict:
    """How much distinct data a run read: ``unique_tokens`` (N x T positions of ``blocks``) and
    ``max_reads_per_token`` (the epochs begun: :func:`batch_indices` reads every block once per epoch)."""
    reads = int(out["steps"]) * int(out["global_batch_sequences"])
    return {"unique_tokens": int(blocks.numel()), "max_reads_per_token": -(-reads // max(1, blocks.size(0)))}


def _with_cfg_threads(fn):
    """Run a ``(student, blocks, out_dir, cfg, ...)`` function with a thread count fixed for the whole run:
    ``cfg.num_threads`` torch threads, ``0``: torch's count when it starts (``OMP_NUM_THREADS``, which a multi-process
    ``accelerate launch`` sets per process, else torch's default), never the machine's load, so that the weights do not
    depend on how busy the machine is (the thread count changes the summation order of the CPU kernels). With
    ``cfg.follow_free_cores`` the count follows the cores other processes leave free, re-measured during the run
    (:class:`decode.fast_settings.FreeCoreThreads`, passed as ``_threads_update``). The result's ``threads`` lists
    ``[seconds, count]`` at each change; the run's :func:`exposure` is added."""

    @functools.wraps(fn)
    def wrapper(student, blocks, out_dir, cfg, *args, **kwargs):
        if not cfg.follow_free_cores:
            n = cfg.num_threads or torch.get_num_threads()
            with torch_threads(n):
                out = fn(student, blocks, out_dir, cfg, *args, **kwargs)
            return {**out, **exposure(blocks, out), "threads": [[0.0, n]]}
        from decode.fast_settings import FreeCoreThreads

        follow = FreeCoreThreads()
        try:
            out = fn(student, blocks, out_dir, cfg, *args, _threads_update=follow.update, **kwargs)
        finally:
            follow.close()
        return {**out, **exposure(blocks, out), "threads": [list(c) for c in follow.changes]}

    return wrapper


@_with_cfg_threads
def train(student: torch.nn.Module, blocks: torch.Tensor, out_dir: str | os.PathLike, cfg: TrainerConfig,
          step_loss: StepLoss = cross_entropy_step, *, teacher: Any = None, seed: int = 0, desc: str = "train",
          on_step: Callable[[int, dict], None] | None = None, batch_hook: BatchHook | None = None,
          evaluate: EvalFn | None = None, eval_every: int = 0, select_key: str = "mean_accepted_length",
          on_eval: Callable[[int, dict], None] | None = None, _threads_update: Callable[[], int] = int) -> dict:
    """Train ``student`` on token ``blocks`` (N, T) for ``cfg.max_steps`` optimizer steps (or until
    ``cfg.max_time_s`` seconds of training-loop wall clock have passed, checked at step boundaries; time spent in
    the ``evaluate`` callback does not count). With ``cfg.schedule_over="time"`` the cosine decay follows the spent
    fraction of that budget (see :func:`cosine_with_warmup`), so a budget-stopped run still anneals.

    Args:
        student: the model to train (its parameters that require grad, and only them, go into the optimizer: all
            of a plain model, the adapters of a peft LoRA model). Under ZeRO-3 a copy is trained and ``student``
            stays unpartitioned; it ends with the gathered weights on the main process (the one that saves).
        blocks: LongTensor (N, T) of packed token blocks.
        out_dir: stage folder; holds ``checkpoint-last`` (resumable state) and ``train_log.jsonl``.
        step_loss: returns (summed loss, token count) for one micro-batch, see :data:`StepLoss`.
        teacher: passed to ``step_loss``; an ``nn.Module`` teacher is kept in eval mode, frozen and never in the
            optimizer (replicated on every process, or a copy in its own ZeRO-3 inference engine with
            ``cfg.teacher_placement="zero3"``); anything else (e.g. a :class:`distill.teacher.TeacherCache`) is
            passed through.
        on_step: called after each logged optimizer step with (step, log record); may add keys to the record.
        batch_hook: may replace each micro-batch, see :data:`BatchHook`.
        evaluate: scores the student (see :data:`EvalFn`); run every ``eval_every`` steps and, when that ran at
            least once, at the last step. The best weights by ``select_key`` (higher is better; ties keep the
            earlier step) are restored into ``student`` before returning; a run shorter than ``eval_every`` is not
            evaluated and keeps its last weights. Runs on every process (under ZeRO-3 on the main process only,
            with the gathered weights); the main process's result decides on every process.
        on_eval: called with (step, eval record) after each evaluation.

    Returns:
        dict with ``final_loss`` (mean loss per token of the last logged window), ``steps`` (optimizer steps
        done), ``train_time_s`` (training-loop wall clock in seconds, summed over resumed parts, without the
        selection evaluations: the clock ``cfg.max_time_s`` budgets), ``selection_eval_s`` (those evaluations),
        ``tokens_seen``, ``stopped_early`` (``"max_time_s"`` or None), ``best`` ({``step``, ``metrics``} or None),
        ``num_processes``, ``grad_accum_steps`` (per process), ``global_batch_sequences``, ``optimizer_parameters``
        (parameters the optimizer updates: the student's count), ...

    Raises:
        FloatingPointError: the loss became NaN/inf; the message names the step, the last good checkpoint stays.
        ValueError: ``eval_every < 0``, ``evaluate`` did not return ``select_key``, a launch that does not match
            ``cfg.strategy`` or the global batch (:func:`check_launch`), a checkpoint that cannot resume here
            (:func:`check_resumable`), a student without a parameter that requires grad.
    """
    if eval_every < 0:
        raise ValueError(f"eval_every must be >= 0 (0 disables evaluation), got {eval_every}")
    run, state, clock, ckpt, best_weights = _start(student, teacher, Path(out_dir), cfg, seed, desc)
    start_step = step = state.step
    write_log = TrainLog(Path(out_dir) / "train_log.jsonl", start_step, run.accelerator.is_main_process)
    select = CheckpointSelector(run, state, clock, evaluate, select_key, desc, write_log, on_eval, best_weights) \
        if evaluate is not None else None
    window, last_loss = _LossWindow(), None
    bar = _progress_bar(cfg, start_step, run.accelerator.is_main_process, desc)
    while step < cfg.max_steps and not _out_of_time(clock, state, cfg, desc, step):
        micro = _micro_batches(run, cfg, blocks, step, seed, batch_hook)
        loss_sum, n_tokens = _optimizer_step(run, cfg, clock, micro, step_loss, step, desc, ckpt)
        last_loss = loss_sum / max(1, n_tokens)
        window.add(loss_sum, n_tokens)
        state.tokens_seen += n_tokens
        step = state.step = step + 1
        state.elapsed_s = clock.elapsed()
        bar.update(1)
        _threads_update()  # trainer.follow_free_cores: follow the cores other processes leave free
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            state.final_loss = window.take()
            _log_step(run, state, step, on_step, bar, write_log)
        if select is not None and eval_every and step % eval_every == 0:
            select(step, last_loss)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            check_finite_params(run.raw_student, desc, step, ckpt)  # never checkpoint diverged weights
            save_checkpoint(run.accelerator, ckpt, asdict(state), select.best_weights if select else best_weights)
    bar.close()
    if select is not None and state.last_eval_step not in (None, step):
        select(step, last_loss)  # once selection is on, the last weights compete too
    return _finish(run, cfg, state, clock, select.best_weights if select else best_weights, start_step, ckpt, desc)


def _start(student, teacher, out_dir: Path, cfg: TrainerConfig, seed: int, desc: str):
    """``(run, state, clock, checkpoint folder, selected weights)`` of a train() call: the prepared run (its LR
    follows the budget clock), the seed set, and the state of ``checkpoint-last`` when resuming."""
    from accelerate.utils import set_seed

    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.warmup_steps >= cfg.max_steps:  # legal (a short run may want a constant ramp), rarely what was meant
        log.warning("%s: trainer.warmup_steps=%d >= trainer.max_steps=%d: the learning rate only ramps up and never "
                    "decays (it reaches trainer.lr at the last step at most); set trainer.warmup_steps below "
                    "trainer.max_steps for the cosine decay", desc, cfg.warmup_steps, cfg.max_steps)
    clock = BudgetClock(cfg)  # the schedule reads it from the first step
    run = prepare_run(student, teacher, cfg, lambda s: cosine_with_warmup(
        s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, clock.progress()))
    acc = run.accelerator
    set_seed(seed)
    ckpt = out_dir / "checkpoint-last"
    state = TrainState(global_batch_sequences=cfg.micro_batch_size * run.accum * acc.num_processes,
                       num_processes=acc.num_processes, strategy=cfg.strategy)
    best_weights = resume(run, cfg, ckpt, state, desc)
    return run, state, clock.start(run, state.elapsed_s), ckpt, best_weights  # the budget counts every resumed part


def _out_of_time(clock: BudgetClock, state: TrainState, cfg: TrainerConfig, desc: str, step: int) -> bool:
    """Whether the wall-clock budget ``trainer.max_time_s`` is spent (then recorded in ``state``)."""
    if not clock.exhausted():
        return False
    state.stopped_early = "max_time_s"
    log.info("%s: wall-clock budget trainer.max_time_s=%.0f s reached after %d steps", desc, cfg.max_time_s, step)
    return True


def _progress_bar(cfg: TrainerConfig, start_step: int, is_main: bool, desc: str):
    # A budgeted run says so: its step total is only a cap, the budget usually ends it first.
    return tqdm(total=cfg.max_steps, initial=start_step, disable=not is_main, dynamic_ncols=True,
                desc=f"{desc} (stops at {cfg.max_time_s:.0f} s of training)" if cfg.max_time_s else desc)


def _micro_batches(run: Run, cfg: TrainerConfig, blocks: torch.Tensor, step: int, seed: int,
                   batch_hook: BatchHook | None) -> list[MicroBatch]:
    """This process's micro-batches of optimizer step ``step`` (each of ``cfg.micro_batch_size`` blocks)."""
    acc, accum = run.accelerator, run.accum
    global_batch = cfg.micro_batch_size * accum * acc.num_processes
    idx = batch_indices(blocks.size(0), step, global_batch, seed)  # (global_batch,)
    # This process's share, then split into micro-batches: (world*accum*mb) -> accum x (mb,)
    mine = idx.view(acc.num_processes, -1)[acc.process_index].view(accum, cfg.micro_batch_size)
    micro = []
    for j, m in enumerate(mine):
        batch = MicroBatch.from_blocks(blocks[m].to(acc.device), m)
        if batch_hook is not None:
            batch = batch_hook(batch, step, acc.process_index * accum + j, run.raw_student)
        micro.append(batch)
    return micro


def _optimizer_step(run: Run, cfg: TrainerConfig, clock: BudgetClock, micro: list[MicroBatch],
                    step_loss: StepLoss, step: int, desc: str, ckpt: Path) -> tuple[float, int]:
    """Forward and backward every micro-batch, then one optimizer and scheduler step. Returns the summed loss and
    the token count over all processes (the loss normaliser: a global token mean, whatever the split)."""
    acc, world, accum = run.accelerator, run.accelerator.num_processes, run.accum
    # Global token count of this optimizer step (all processes, all micro-batches), known before any backward
    # so each micro-batch's backward runs right after its forward (DDP / DeepSpeed sync on the last one).
    counts = [count_tokens(step_loss, b) for b in micro]
    global_tokens = acc.reduce(torch.tensor(float(sum(counts)), device=acc.device), reduction="sum").clamp_min(1.0)
    acc.step = 0  # accumulate() below syncs gradients on this step's last micro-batch
    losses = []
    for batch, expected in zip(micro, counts):
        with acc.accumulate(run.engine):
            with run.precision(cfg.mixed_precision):
                loss_sum, n_tok = step_loss(run.engine, run.teacher, batch)
            if n_tok != expected:
                raise RuntimeError(f"{desc}: the step loss counted {n_tok} tokens, count_tokens {expected}")
            if not torch.isfinite(loss_sum.detach()):
                raise FloatingPointError(diverged(desc, f"loss is {loss_sum.item()}", step + 1, ckpt))
            losses.append(loss_sum.detach().float())
            # DDP / DeepSpeed average gradients over processes and accelerator.backward divides by the
            # accumulation steps; x world x accum turns that into sum over all micro-batches / global tokens.
            acc.backward(loss_sum * (world * accum) / global_tokens)
    if cfg.max_grad_norm > 0:
        acc.clip_grad_norm_(run.engine.parameters(), cfg.max_grad_norm)  # DeepSpeed: gradient_clipping
    run.optimizer.step()
    if cfg.schedule_over == "time":
        clock.sync()  # the LR of the next step follows the spent budget
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return acc.reduce(torch.stack(losses).sum(), reduction="sum").item(), int(global_tokens.item())


@dataclass
class _LossWindow:
    """Summed loss and tokens of the optimizer steps since the last log record."""

    loss: float = 0.0
    tokens: int = 0

    def add(self, loss_sum: float, n_tokens: int) -> None:
        self.loss, self.tokens = self.loss + loss_sum, self.tokens + n_tokens

    def take(self) -> float:
        """Mean loss per token of the window (nats), and a fresh window."""
        mean = self.loss / max(1, self.tokens)
        self.loss, self.tokens = 0.0, 0
        return mean


def _log_step(run: Run, state: TrainState, step: int, on_step, bar, write_log: TrainLog) -> None:
    """One ``train`` log record (window loss, learning rate, tokens, elapsed seconds): to ``on_step`` (which may add
    keys), the progress bar and ``train_log.jsonl``."""
    record = {"kind": "train", "step": step, "loss": state.final_loss, "lr": run.scheduler.get_last_lr()[0],
              "tokens_seen": state.tokens_seen, "elapsed_s": state.elapsed_s}
    if on_step is not None:
        on_step(step, record)
    bar.set_postfix(loss=f"{record['loss']:.3f}")
    write_log(record)


def _finish(run: Run, cfg: TrainerConfig, state: TrainState, clock: BudgetClock, best_weights: dict | None,
            start_step: int, ckpt: Path, desc: str) -> dict:
    """The last checkpoint (finite weights only), the selected weights into the caller's student, and what
    :func:`train` returns (see its docstring)."""
    acc = run.accelerator
    state.elapsed_s = clock.elapsed()
    acc.wait_for_everyone()
    check_finite_params(run.raw_student, desc, state.step, ckpt)
    save_checkpoint(acc, ckpt, asdict(state), best_weights)
    run.finish(state.best is not None, best_weights, cfg.gradient_checkpointing)
    return {"final_loss": state.final_loss, "steps": state.step, "max_steps": cfg.max_steps,
            "train_time_s": state.elapsed_s, "selection_eval_s": state.selection_eval_s,
            "tokens_seen": state.tokens_seen, "global_batch_sequences": state.global_batch_sequences,
            "num_processes": acc.num_processes, "grad_accum_steps": run.accum,
            "optimizer_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in optimizer_parameters(run.optimizer)),
            "resumed_from_step": start_step, "stopped_early": state.stopped_early, "best": state.best,
            "config": asdict(cfg)}
