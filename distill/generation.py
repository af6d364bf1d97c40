"""Generated training data and acceptance-based evaluation for distillation.

* ``distill.data_source=teacher`` (sequence-level KD, Kim & Rush 2016): :func:`generate_teacher_sequences` lets the
  target continue the domain's training prompts once, with ``distill.generation`` sampling settings, and stores
  the token sequences in a resumable, checksummed :class:`distill.teacher.ShardStore` (one shard per
  ``generation.batch_size`` prompts, each with its own seeded generator, so a resumed pass produces the same
  tokens). :func:`pack_sequences` packs them (prompt + continuation + EOS) into training blocks; the teacher's
  soft labels then cover every position, as with the dataset.
* ``distill.data_source=on_policy`` (GKD, Agarwal et al. ICLR 2024, Alg. 1): :class:`OnPolicyHook` replaces a
  share ``lambda_s`` of each micro-batch's rows (``distill.on_policy_fraction``, reached after the warm start of
  ``distill.on_policy_schedule``) by the *draft's* own continuations: the first ``T - max_new_tokens`` tokens of
  each block are the prompt, the draft samples ``max_new_tokens`` tokens for all its rows in one KV-cached batch
  (no early stop, so the shape stays ``(B, T)``), and only positions from the last prompt token on count in the
  loss (they predict the generated tokens). The target scores them online (with a cached teacher, only those
  rows run the target's forward).
* Closing the loop: :func:`make_acceptance_eval` measures the pooled mean accepted length of greedy speculative
  decoding with the current draft on fixed prompts (``decode.speculative_generate``).

All generation goes through :func:`decode.autoregressive_generate` (KV cache, shared sampling pipeline).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from decode.common import left_pad
from distill.config import GenerationConfig, OnPolicySchedule
from distill.teacher import ShardStore
from distill.trainer import EvalFn, MicroBatch

log = logging.getLogger(__name__)


def derived_seed(*parts) -> int:
    """A 60-bit seed that is a pure function of ``parts`` (e.g. run seed, step, micro-batch index)."""
    return int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def pack_sequences(seqs: list[list[int]], block_size: int) -> torch.Tensor:
    """Concatenate token sequences in order and cut the stream into LongTensor (N, block_size); the tail shorter
    than a block is dropped (as :func:`data.text.pack_blocks`).

    Raises:
        ValueError: fewer than ``block_size`` tokens in total.
    """
    stream = torch.tensor([t for s in seqs for t in s], dtype=torch.long)  # (L,)
    n = stream.numel() // block_size
    if n == 0:
        raise ValueError(f"generated sequences hold {stream.numel()} tokens, fewer than one block of {block_size}; "
                         f"raise distill.generation.max_prompts or max_new_tokens")
    return stream[: n * block_size].view(n, block_size)  # (N, block_size)


def answer_loss_mask(seqs: list[list[int]], prompt_lengths: list[int], block_size: int) -> torch.Tensor:
    """BoolTensor ``(N, block_size)`` aligned with :func:`pack_sequences` ``(seqs, block_size)``: ``True`` at the
    positions whose next token is one the target generated (its answer and the closing EOS), ``False`` where the next
    token is a prompt token (of the same or the next packed sequence) and at the very end of the stream.
    ``prompt_lengths[i]`` is how many leading tokens of ``seqs[i]`` are its prompt. The prediction *at* position t is
    of token t+1, so this is what counts under ``distill.train_on_prompts=false`` (as torchtune's
    ``train_on_input=False`` or TRL's completion-only loss).

    Raises:
        ValueError: different numbers of sequences and prompt lengths, or a prompt length outside its sequence.
    """
    if len(seqs) != len(prompt_lengths):
        raise ValueError(f"{len(seqs)} sequences but {len(prompt_lengths)} prompt lengths")
    flags = []
    for s, p in zip(seqs, prompt_lengths):
        if not 0 <= p <= len(s):
            raise ValueError(f"a prompt of {p} tokens in a sequence of {len(s)}")
        flags += [False] * p + [True] * (len(s) - p)
    answer = torch.tensor(flags + [False], dtype=torch.bool)  # (L + 1,): nothing follows the stream
    n = (answer.numel() - 1) // block_size
    return answer[1: n * block_size + 1].view(n, block_size)  # (N, block_size): is the NEXT token an answer's?


class AnswerMaskHook:
    """A :data:`distill.trainer.BatchHook` that counts only the positions of ``mask`` (``(N, T)`` over the
    training blocks, :func:`answer_loss_mask`) in each micro-batch's loss, by its rows' ``block_index``."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask.bool()

    def __call__(self, batch, step: int, micro: int, student: torch.nn.Module):
        if batch.block_index is None:
            return batch
        rows = self.mask[batch.block_index.cpu()].to(batch.loss_mask.device)  # (B, T)
        return dataclasses.replace(batch, loss_mask=batch.loss_mask.bool() & rows)


def _prompts_fingerprint(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def generate_teacher_sequences(
    target: torch.nn.Module, prompts: list[list[int]], gen: GenerationConfig, root: str | os.PathLike, *,
    seed: int, eos_token_id: int | None, pad_token_id: int | None, vocab_size: int | None = None,
    target_fingerprint: str | None = None, precision: str = "no", target_path: str | os.PathLike | None = None,
    follow_free_cores: bool = False,
) -> tuple[list[list[int]], dict]:
    """The target's continuations of ``prompts`` (token id lists), generated once and stored under
    ``root/sequences-<key>/`` (reused on rerun; a killed pass resumes at the first unfinished shard).

    Each returned sequence is ``prompt + generated tokens``, ending with ``eos_token_id`` (appended when the
    generation stopped at ``max_new_tokens``). Prompts are processed sorted by length (less left padding), and the
    result keeps that order. ``vocab_size`` restricts sampling to the ids shared with the draft. ``precision``:
    the run's ``trainer.mixed_precision``; the target generates in it (:func:`core.runtime.run_precision`; part of
    the cache key unless ``no``). ``follow_free_cores`` (``trainer.follow_free_cores``): the torch threads follow the
    free cores between shards; False keeps the caller's count (the answers then do not depend on the machine's load).

    With ``gen.engine == "llama_cpp"`` the answers come from llama.cpp instead
    (:func:`generate_teacher_sequences_engine`, serving the target saved at ``target_path``).

    Returns:
        (sequences, info) with ``path``, shard counts, ``num_sequences``, ``generated_tokens`` and ``time_s``.
    """
    if gen.engine == "llama_cpp":
        if target_path is None:
            raise ValueError("distill.generation.engine=llama_cpp needs the target's folder (target_path)")
        return generate_teacher_sequences_engine(target_path, prompts, gen, root, seed=seed, eos_token_id=eos_token_id)
    from core.runtime import run_precision
    from decode import autoregressive_generate
    from decode.fast_settings import following_free_cores
    from distill.teacher import model_fingerprint

    if not prompts:
        raise ValueError("no prompts to generate teacher data from (the domain's training split has no prompts)")
    t0 = time.perf_counter()
    order = sorted(prompts, key=len)
    meta = {"kind": "teacher_sequences", "teacher_sha256": target_fingerprint or model_fingerprint(target),
            "prompts_sha256": _prompts_fingerprint(order), "generation": asdict(gen), "seed": seed,
            "eos_token_id": eos_token_id, "vocab_size": vocab_size, **({"precision": precision}
                                                                       if precision != "no" else {})}
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    bs = gen.batch_size
    store = ShardStore(Path(root) / f"sequences-{key}", meta, -(-len(order) // bs))
    device = next(target.parameters()).device
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)

    def compute(i: int) -> dict[str, torch.Tensor]:
        update_threads()  # follow_free_cores: the cores other processes leave free
        part = order[i * bs : (i + 1) * bs]
        ids, mask = left_pad(part, pad)  # (b, P) each
        g = torch.Generator(device=device).manual_seed(derived_seed(seed, "teacher_sequences", i))
        with run_precision(precision, device):
            out = autoregressive_generate(target.eval(), ids.to(device), mask.to(device),
                                          max_new_tokens=gen.max_new_tokens, eos_token_id=eos_token_id,
                                          pad_token_id=pad, generator=g, vocab_size=vocab_size,
                                          **gen.sampling_kwargs())
        width = ids.size(1)
        seqs = []
        for b, p in enumerate(part):
            new = out.sequences[b, width : width + int(out.num_new_tokens[b])].tolist()
            s = list(p) + new
            if eos_token_id is not None and (not new or new[-1] != eos_token_id):
                s.append(eos_token_id)
            seqs.append(s)
        return {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                "lengths": torch.tensor([len(s) for s in seqs], dtype=torch.int64)}

    with following_free_cores() if follow_free_cores else contextlib.nullcontext(int) as update_threads:
        counts = store.ensure(compute, desc="teacher sequences")
    seqs: list[list[int]] = []
    for i in range(store.num_shards):
        shard = store.load(i)
        seqs.extend(t.tolist() for t in torch.split(shard["tokens"].long(), shard["lengths"].tolist()))
    info = {"path": str(store.root), **counts, "num_sequences": len(seqs),
            "generated_tokens": sum(len(s) for s in seqs) - sum(len(p) for p in order),
            "time_s": time.perf_counter() - t0}
    log.info("teacher sequences %s: %d shards reused, %d generated, %.1f s", store.root, counts["reused"],
             counts["computed"], info["time_s"])
    return seqs, info


def generate_teacher_sequences_engine(
    target_path: str | os.PathLike, prompts: list[list[int]], gen: GenerationConfig, root: str | os.PathLike, *,
    seed: int, eos_token_id: int | None, threads: int | None = None,
) -> tuple[list[list[int]], dict]:
    """:func:`generate_teacher_sequences` through llama.cpp (``distill.generation.engine=llama_cpp``): the target
    served by ``llama-server`` with ``gen.engine_slots`` parallel slots, each shard's prompts sent concurrently.
    The same store layout and returned sequences (``prompt + answer + EOS``, prompts sorted by length), under
    ``root/sequences-<key>/`` with the engine, its version and the served target file in the key, so answers of
    the two engines never mix. The target file is ``gen.engine_target_format`` (:func:`decode.llamacpp.target_gguf`:
    SmolLM2's own Q4_1 file by default, the model users serve). Sampling (temperature > 0) seeds request ``j`` of
    shard ``i`` from ``(seed, i, j)``.

    Raises:
        decode.llamacpp.EngineNotInstalled: llama.cpp is not installed (the message names the install command).
    """
    from concurrent.futures import ThreadPoolExecutor

    from core.io import sha256_file
    from decode.fast_settings import free_cores
    from decode.llamacpp import LlamaServer, find_engine, target_gguf

    if not prompts:
        raise ValueError("no prompts to generate teacher data from (the domain's training split has no prompts)")
    engine = find_engine()
    t0 = time.perf_counter()
    order = sorted(prompts, key=len)
    served, served_from = target_gguf(target_path, gen.engine_target_format, Path(root) / "gguf")
    meta = {"kind": "teacher_sequences", "engine": engine.describe(), "served_sha256": sha256_file(served),
            "prompts_sha256": _prompts_fingerprint(order), "generation": asdict(gen), "seed": seed,
            "eos_token_id": eos_token_id}
    key = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()[:16]
    bs = gen.batch_size
    store = ShardStore(Path(root) / f"sequences-{key}", meta, -(-len(order) // bs))
    ctx = max(len(p) for p in order) + gen.max_new_tokens + 8
    threads = int(threads or free_cores())  # the cores free now: llama.cpp's threads spin on a busy core
    server: list = []  # started at the first shard that needs computing (a fully cached pass starts nothing)

    def compute(i: int) -> dict[str, torch.Tensor]:
        if not server:
            server.append(LlamaServer(engine, served, threads=threads, slots=gen.engine_slots,
                                      ctx_size=ctx).__enter__())
        s = server[0]
        part = order[i * bs : (i + 1) * bs]
        sampling = {} if gen.temperature == 0 else {"temperature": gen.temperature, "top_k": gen.top_k,
                                                    "top_p": gen.top_p}

        def one(j: int):
            extra = dict(sampling, seed=derived_seed(seed, "teacher_engine", i, j) % (2 ** 31)) if sampling else {}
            return s.complete(part[j], gen.max_new_tokens, **extra).tokens

        with ThreadPoolExecutor(max_workers=gen.engine_slots) as pool:
            answers = list(pool.map(one, range(len(part))))
        seqs = []
        for p, new in zip(part, answers):
            seq = list(p) + list(new)
            if eos_token_id is not None and (not new or new[-1] != eos_token_id):
                seq.append(eos_token_id)
            seqs.append(seq)
        return {"tokens": torch.tensor([t for q in seqs for t in q], dtype=torch.int32),
                "lengths": torch.tensor([len(q) for q in seqs], dtype=torch.int64)}

    try:
        counts = store.ensure(compute, desc=f"teacher sequences (llama.cpp, {gen.engine_slots} slots)")
    finally:
        if server:
            server[0].__exit__(None, None, None)
    seqs: list[list[int]] = []
    for i in range(store.num_shards):
        shard = store.load(i)
        seqs.extend(t.tolist() for t in torch.split(shard["tokens"].long(), shard["lengths"].tolist()))
    info = {"path": str(store.root), **counts, "num_sequences": len(seqs), "engine": engine.describe(),
            "served": served_from, "generated_tokens": sum(len(q) for q in seqs) - sum(len(p) for p in order),
            "time_s": time.perf_counter() - t0}
    log.info("teacher sequences (llama.cpp) %s: %d shards reused, %d generated, %.1f s", store.root,
             counts["reused"], counts["computed"], info["time_s"])
    return seqs, info


class OnPolicyHook:
    """A trainer ``batch_hook`` for GKD-style on-policy distillation (see the module docstring).

    At optimizer step ``s`` the on-policy fraction is ``lambda_s = schedule.fraction(s, fraction)`` (a warm start:
    0 during ``schedule.warmup_steps``, then a linear ramp to ``fraction``); each micro-batch of ``B`` rows gets
    ``k = floor(lambda_s * B + u)`` draft rows (stochastic rounding, ``u`` uniform from the seeded coin, so
    ``E[k] = lambda_s * B`` and ``k = lambda_s * B`` exactly when that is whole). The first ``k`` rows (the step's
    blocks are already a seeded permutation) are replaced by the draft's continuation of their first
    ``T - n`` tokens (``n = gen.max_new_tokens``), generated in one batch with the KV-cached decoder
    (:func:`decode.autoregressive_generate`, no early stop, so the shape stays ``(B, T)``); only their positions
    ``T - n - 1 .. T - 1`` count (the predictions of the generated tokens, and the one after the last).

    Args:
        fraction: the final on-policy fraction (GKD's lambda) in [0, 1].
        gen: sampling settings (``max_new_tokens`` < block length).
        seed: run seed; the coin and the sampling generator of micro-batch ``j`` at step ``s`` are seeded from
            ``(seed, s, j)``, so a resumed run replays them exactly.
        vocab_size: sample only ids ``< vocab_size`` (the ids shared with the target).
        schedule: the warm start (:class:`distill.config.OnPolicySchedule`; default: ``fraction`` from step 0).

    The returned micro-batch keeps ``block_index`` (the cached teacher still covers the other rows) and sets
    ``generated`` (B,). Cost counters (this process, since construction: a resumed run counts from the resume):
    ``generated_batches`` (micro-batches with a draft row), ``generated_rows``, ``generated_tokens``,
    ``generation_s`` (seconds in the draft's generation); :meth:`window` returns and resets the per-log-window
    ones.

    Raises:
        ValueError: ``fraction`` outside [0, 1]; at call time ``max_new_tokens >= T``.
    """

    def __init__(self, fraction: float, gen: GenerationConfig, seed: int, vocab_size: int | None = None,
                 schedule: OnPolicySchedule | None = None):
        if not 0 <= fraction <= 1:
            raise ValueError(f"on-policy fraction must be in [0, 1], got {fraction}")
        self.fraction, self.gen, self.seed, self.vocab_size = fraction, gen, seed, vocab_size
        self.schedule = schedule if schedule is not None else OnPolicySchedule()
        self.generated_batches = self.generated_rows = self.generated_tokens = 0
        self.generation_s = 0.0
        self._win = {"rows": 0, "tokens": 0, "s": 0.0, "micro": 0, "steps": set()}

    def fraction_at(self, step: int) -> float:
        """lambda_s of optimizer step ``step`` (0-based), from the schedule."""
        return self.schedule.fraction(step, self.fraction)

    def rows_at(self, step: int, micro: int, rows: int) -> int:
        """Draft rows of micro-batch ``micro`` (of ``rows`` rows) at step ``step``: ``floor(lambda_s * rows + u)``,
        ``u`` from the seeded coin of ``(seed, step, micro)`` (drawn only when ``lambda_s * rows`` is not whole)."""
        x = round(self.fraction_at(step) * rows, 9)  # 0.5 * 16 stays 8, not 7.999...
        k = math.floor(x)
        if x > k:
            coin = torch.Generator().manual_seed(derived_seed(self.seed, "on_policy_coin", step, micro))
            k += int(torch.rand((), generator=coin).item() < x - k)
        return min(k, rows)

    def window(self) -> dict:
        """Cost since the last call (for the train log): draft rows, generated tokens, generation seconds and
        seconds per optimizer step; then resets them."""
        w = self._win
        steps = max(1, len(w["steps"]))
        out = {"on_policy_rows": w["rows"], "on_policy_generated_tokens": w["tokens"],
               "on_policy_generation_s": w["s"], "on_policy_generation_s_per_step": w["s"] / steps,
               "on_policy_row_share": w["rows"] / w["micro"] if w["micro"] else 0.0}
        self._win = {"rows": 0, "tokens": 0, "s": 0.0, "micro": 0, "steps": set()}
        return out

    def __call__(self, batch: MicroBatch, step: int, micro: int, student: torch.nn.Module) -> MicroBatch:
        from decode import autoregressive_generate

        B, T = batch.input_ids.shape
        n = self.gen.max_new_tokens
        k = self.rows_at(step, micro, B)
        self._win["micro"] += B
        self._win["steps"].add(step)
        if k == 0:
            return batch
        if n >= T:
            raise ValueError(f"distill.generation.max_new_tokens ({n}) must be < the block length ({T}) for "
                             f"on-policy data: each block's first T - max_new_tokens tokens are the prompt")
        device = batch.input_ids.device
        t0 = time.perf_counter()
        g = torch.Generator(device=device).manual_seed(derived_seed(self.seed, "on_policy_sample", step, micro))
        was_training = student.training
        student.eval()
        out = autoregressive_generate(student, batch.input_ids[:k, : T - n], max_new_tokens=n, eos_token_id=[],
                                      generator=g, vocab_size=self.vocab_size, **self.gen.sampling_kwargs())
        student.train(was_training)
        ids = batch.input_ids.clone()  # (B, T); a normal tensor (inference-mode outputs cannot be saved for grad)
        ids[:k] = out.sequences
        attention_mask = batch.attention_mask.clone()
        attention_mask[:k] = 1
        loss_mask = batch.loss_mask.clone()
        loss_mask[:k] = False
        loss_mask[:k, T - n - 1 :] = True  # positions whose next token the draft generated (and the last one)
        generated = torch.zeros(B, dtype=torch.bool, device=device)
        generated[:k] = True
        dt = time.perf_counter() - t0
        self.generated_batches += 1
        self.generated_rows += k
        self.generated_tokens += k * n
        self.generation_s += dt
        self._win["rows"] += k
        self._win["tokens"] += k * n
        self._win["s"] += dt
        return MicroBatch(ids, attention_mask, loss_mask, batch.block_index, generated)

    def summary(self) -> dict:
        """The totals for ``specdraft.json``."""
        return {"fraction": self.fraction, "schedule": asdict(self.schedule), "generation": asdict(self.gen),
                "generated_micro_batches": self.generated_batches, "generated_rows": self.generated_rows,
                "generated_tokens": self.generated_tokens, "generation_s": self.generation_s}


def make_acceptance_eval(target: torch.nn.Module, prompts: list[torch.Tensor], *, num_draft_tokens: int,
                         max_new_tokens: int, eos_token_id: int | None = None, pad_token_id: int | None = None,
                         vocab_size: int | None = None, move_target: bool = True,
                         draft_length_policy=None) -> EvalFn:
    """An :data:`distill.trainer.EvalFn`: greedy speculative decoding of each prompt (1, P) with the draft.

    ``draft_length_policy``: ``None`` (a fixed ``num_draft_tokens``) or a factory returning a fresh
    :class:`decode.speculative.DraftLengthPolicy` (``DecodeConfig.make_policy``), called once per prompt so each
    evaluation of each checkpoint starts from the same policy state.

    The returned function maps a draft to ``{"mean_accepted_length", "acceptance_rate", "verify_steps",
    "emitted_tokens", "eval_decode_s"}``, pooled over prompts (sum of emitted tokens / sum of verify steps).
    ``move_target=True`` (the target is not the training teacher: cached teacher, baseline): the target is moved to
    the draft's device. ``move_target=False`` (the target *is* the online teacher): the evaluation runs where the
    target is and never moves it (under ZeRO-3 a replicated teacher stays on the GPU that training feeds, a
    ``teacher_placement=zero3`` teacher's full copy stays in host memory); a draft on another device is evaluated
    as a copy moved there (in the target's dtype), so the draft being trained stays in place.

    Raises:
        ValueError: no prompts.
    """
    from decode import AcceptanceStats, frozen_weights, speculative_generate

    if not prompts:
        raise ValueError("acceptance evaluation needs at least one prompt (distill.eval_prompts)")

    def evaluate(draft: torch.nn.Module) -> dict:
        if move_target:
            target.to(next(draft.parameters()).device)
        p = next(target.parameters())
        device = p.device
        target.eval()
        if next(draft.parameters()).device != device:
            draft = copy.deepcopy(draft).to(device=device, dtype=p.dtype).eval()
        t0 = time.perf_counter()
        with frozen_weights(target, draft):  # unchanged during one evaluation: read them once, not per prompt
            stats = AcceptanceStats.pool([
                speculative_generate(target, draft, ids.to(device), max_new_tokens=max_new_tokens,
                                     num_draft_tokens=num_draft_tokens, eos_token_id=eos_token_id,
                                     pad_token_id=pad_token_id, vocab_size=vocab_size,
                                     draft_length_policy=draft_length_policy() if draft_length_policy else None
                                     ).stats
                for ids in prompts])
        return {"mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate,
                "verify_steps": stats.verify_steps, "emitted_tokens": stats.emitted_tokens,
                "mean_draft_length": stats.drafted_tokens / stats.verify_steps if stats.verify_steps else None,
                "eval_decode_s": time.perf_counter() - t0}

    return evaluate


def selection_eval_from_texts(rc, target: torch.nn.Module, tokenizer, texts: list[str], *, max_new_tokens: int,
                              vocab_size: int | None, move_target: bool = True) -> EvalFn:
    """:func:`make_acceptance_eval` over prompt ``texts`` encoded like evaluation prompts (``eval.max_prompt_tokens``)
    with the run's ``decode.num_draft_tokens`` / draft-length policy: the checkpoint-selection score of the
    distill, baseline and LoRA stages."""
    from data.text import encode_prompt

    return make_acceptance_eval(
        target, [encode_prompt(tokenizer, t, rc.eval.max_prompt_tokens)[0] for t in texts],
        num_draft_tokens=rc.decode.num_draft_tokens, max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, vocab_size=vocab_size,
        move_target=move_target, draft_length_policy=rc.decode.make_policy)


def selection_meta(rc, stats: dict, *, eval_every: int, eval_prompts: int, eval_max_new_tokens: int) -> dict:
    """The ``specdraft.json`` fields of checkpoint selection: the selected step (the last one without selection),
    its mean accepted length and the selection settings (None without selection)."""
    best = stats.get("best")
    return {
        "selected_step": best["step"] if best else stats["steps"],
        "selected_mean_accepted_length": best["metrics"]["mean_accepted_length"] if best else None,
        "selection": {"metric": "mean_accepted_length", "eval_every": eval_every, "eval_prompts": eval_prompts,
                      "eval_max_new_tokens": eval_max_new_tokens, "num_draft_tokens": rc.decode.num_draft_tokens,
                      "draft_length_policy": rc.decode.policy_settings(), "split": "validation",
                      "best": best} if best else None,
    }
