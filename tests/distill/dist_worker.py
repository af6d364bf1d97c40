"""Training run for the multi-process tests: ``accelerate launch ... tests/distill/dist_worker.py OUT [options]``
(or :func:`run` in-process for the one-process reference).

A tiny student is distilled from a tiny teacher (forward KL, rows with unequal token counts) with a fixed global
batch, so any process count must give the same loss curve. The main process saves the student as a Hugging Face
directory (``OUT/hf``) and the returned stats (``OUT/stats.json``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from core.io import write_json_atomic  # noqa: E402
from models.checkpoints import save_hf_atomic  # noqa: E402
from distill.losses import forward_kl  # noqa: E402
from distill.trainer import MicroBatch, TrainerConfig, distributed_state, make_distill_step, train  # noqa: E402
from tinymodels import tiny_llama  # noqa: E402

V, T, N_BLOCKS = 64, 16, 48


def ragged_hook(batch: MicroBatch, step, micro, student) -> MicroBatch:
    """Rows count 4..13 positions, so processes and micro-batches carry unequal token counts."""
    keep = torch.arange(T)[None, :] < (4 + 3 * (batch.block_index % 4))[:, None]  # (B, T)
    return MicroBatch(batch.input_ids, batch.attention_mask, keep.to(batch.input_ids.device), batch.block_index)


def _checked(evaluate, teacher, prompts, out: Path):
    """``evaluate`` (the lean forward where supported), recording the Hugging Face forward's numbers beside it."""
    from decode import AcceptanceStats, speculative_generate
    from decode.fast_llama import FastKVState, fast_path_supported

    keys = ("mean_accepted_length", "acceptance_rate", "verify_steps", "emitted_tokens")

    def wrapped(draft):
        metrics = evaluate(draft)
        assert fast_path_supported(draft), "the draft must take the lean forward in this check"
        hf = AcceptanceStats.pool(speculative_generate(teacher, draft, ids, max_new_tokens=6, num_draft_tokens=3,
                                                       fast_path=False).stats for ids in prompts)
        ids = torch.cat(prompts)
        with torch.inference_mode():
            fast_logits = FastKVState(draft, ids.shape[0], ids.device).forward(ids, logits_to_keep=0)
            hf_logits = draft(input_ids=ids).logits
        rec = {"fast": {k: metrics[k] for k in keys}, "hf": {k: getattr(hf, k) for k in keys},
               "logit_diff": (fast_logits - hf_logits).abs().max().item(), "probe": hf_logits[0, -1, :4].tolist()}
        if distributed_state().is_main_process:
            with open(out / "fast_path_check.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        return metrics

    return wrapped


def run(out: str | Path, strategy: str = "single", max_steps: int = 6, save_every: int = 0, resume: bool = False,
        stop_after: int | None = None, teacher_placement: str = "replicate", eval_every: int = 0,
        check_fast_path: bool = False) -> dict:
    """Train, save ``OUT/hf`` + ``OUT/stats.json`` on the main process; returns the stats.

    ``check_fast_path``: every selection evaluation also decodes through the Hugging Face forward on the same
    weights and appends both results to ``OUT/fast_path_check.jsonl`` (``fast``, ``hf``: the acceptance numbers;
    ``logit_diff``: max |lean - HF| draft logits on the eval prompts; ``probe``: a few draft logits)."""
    torch.set_num_threads(1)
    out = Path(out)
    teacher, student = tiny_llama(vocab_size=V, hidden_size=32, seed=1), tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    blocks = torch.randint(0, V, (N_BLOCKS, T), generator=torch.Generator().manual_seed(1))
    cfg = TrainerConfig(max_steps=max_steps, micro_batch_size=2, global_batch_size=8, warmup_steps=2, lr=1e-2,
                        log_every=1, save_every=save_every, resume=resume, strategy=strategy,
                        teacher_placement=teacher_placement)
    evaluate = None
    if eval_every:
        from distill.generation import make_acceptance_eval

        prompts = [blocks[i : i + 1, :6] for i in range(2)]
        evaluate = make_acceptance_eval(teacher, prompts, num_draft_tokens=3, max_new_tokens=6)
        if check_fast_path:
            evaluate = _checked(evaluate, teacher, prompts, out)

    def on_step(step, record):
        if stop_after is not None and step == stop_after:
            raise KeyboardInterrupt  # an interruption after the last checkpoint

    stats = train(student, blocks, out, cfg, make_distill_step(forward_kl, 1.0), teacher=teacher, seed=0,
                  batch_hook=ragged_hook, on_step=on_step, evaluate=evaluate, eval_every=eval_every)
    stats["student_parameters"] = sum(p.numel() for p in student.parameters())
    dist = distributed_state()
    if dist.is_main_process:
        save_hf_atomic(student, None, out / "hf")
        write_json_atomic(out / "stats.json", stats)
    dist.wait_for_everyone()
    return stats


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", default="single")
    ap.add_argument("--max-steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--teacher-placement", default="replicate")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--check-fast-path", action="store_true")
    a = ap.parse_args()
    try:
        run(a.out, a.strategy, a.max_steps, a.save_every, stop_after=a.stop_after,
            teacher_placement=a.teacher_placement, eval_every=a.eval_every, check_fast_path=a.check_fast_path)
    except KeyboardInterrupt:
        sys.exit(130)
