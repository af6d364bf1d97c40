"""distill.generation: target-generated training data is stored once and reused (resumable, deterministic), the
on-policy hook replaces a share lambda of each micro-batch's rows with the draft's own continuations, and the acceptance
evaluation measures the pooled mean accepted length."""
from __future__ import annotations

import pytest
import torch

from distill.config import GenerationConfig
from distill.generation import (AnswerMaskHook, OnPolicyHook, answer_loss_mask, generate_teacher_sequences,
                                make_acceptance_eval, pack_sequences)
from distill.losses import forward_kl
from distill.trainer import MicroBatch, TrainerConfig, make_distill_step, train
from tinymodels import tiny_llama

V, T, EOS = 64, 16, 2


def _prompts(n=7):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, V, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_pack_sequences():
    blocks = pack_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4)
    assert blocks.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    with pytest.raises(ValueError, match="fewer than one block"):
        pack_sequences([[1, 2]], 4)


def test_answer_loss_mask_counts_positions_whose_next_token_is_an_answer():
    # stream 1 2 3 | 4 5 | 6 7 8 9 with prompts [1], [4], [6, 7]: the answers are 2 3, 5, 8 9
    mask = answer_loss_mask([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [1, 1, 2], 4)
    assert mask.tolist() == [[True, True, False, True], [False, False, True, True]]
    with pytest.raises(ValueError, match="3 sequences but 2 prompt lengths"):
        answer_loss_mask([[1, 2, 3], [4, 5], [6]], [1, 1], 4)
    with pytest.raises(ValueError, match="a prompt of 3 tokens in a sequence of 2"):
        answer_loss_mask([[1, 2], [4, 5]], [3, 1], 2)


@pytest.mark.parametrize("seed", range(5))
def test_answer_loss_mask_matches_the_packed_blocks(seed):
    """For random sequences and prompt lengths, the mask is True exactly where the token after that position of
    the packed stream belongs to an answer, block by block, and has the blocks' shape."""
    g = torch.Generator().manual_seed(seed)
    seqs, plens, owner = [], [], []
    for i in range(int(torch.randint(3, 12, (), generator=g))):
        n = int(torch.randint(1, 15, (), generator=g))
        p = int(torch.randint(0, n + 1, (), generator=g))
        seqs.append(torch.randint(0, 50, (n,), generator=g).tolist())
        plens.append(p)
        owner += [j >= p for j in range(n)]
    block = int(torch.randint(2, 9, (), generator=g))
    if sum(map(len, seqs)) < block:
        return
    blocks, mask = pack_sequences(seqs, block), answer_loss_mask(seqs, plens, block)
    assert mask.shape == blocks.shape and mask.dtype == torch.bool
    flat = mask.flatten().tolist()
    want = [owner[i + 1] if i + 1 < len(owner) else False for i in range(len(flat))]
    assert flat == want


def test_answer_mask_hook_masks_rows_by_their_block():
    mask = torch.tensor([[True, False, True], [False, False, True], [True, True, True]])
    blocks = torch.arange(9).view(3, 3)
    batch = MicroBatch.from_blocks(blocks[[2, 0]], torch.tensor([2, 0]))
    out = AnswerMaskHook(mask)(batch, 0, 0, None)
    assert out.loss_mask.tolist() == [[True, True, True], [True, False, True]]
    assert torch.equal(out.input_ids, batch.input_ids) and torch.equal(out.block_index, batch.block_index)
    generated = MicroBatch(blocks[:1], torch.ones_like(blocks[:1]), torch.ones(1, 3, dtype=torch.bool))
    assert AnswerMaskHook(mask)(generated, 0, 0, None) is generated  # no block_index: nothing to look up


def test_teacher_sequences_are_generated_once_and_reused(tmp_path):
    target = tiny_llama(vocab_size=V, hidden_size=32, seed=1, eos_token_id=EOS)
    gen = GenerationConfig(max_new_tokens=6, temperature=1.0, top_k=20, batch_size=3)
    prompts = _prompts()
    seqs, info = generate_teacher_sequences(target, prompts, gen, tmp_path, seed=0, eos_token_id=EOS,
                                            pad_token_id=0)
    assert info["computed"] == 3 and info["num_sequences"] == 7
    for s, p in zip(seqs, sorted(prompts, key=len)):
        assert s[: len(p)] == p and s[-1] == EOS and len(p) < len(s) <= len(p) + gen.max_new_tokens + 1
    again, info2 = generate_teacher_sequences(target, prompts, gen, tmp_path, seed=0, eos_token_id=EOS,
                                              pad_token_id=0)
    assert again == seqs and info2["computed"] == 0 and info2["reused"] == 3
    # A killed pass (shard 1 lost) regenerates exactly the same tokens: each shard has its own seeded generator.
    store = next(tmp_path.glob("sequences-*"))
    (store / "shard-00001.safetensors").unlink()
    third, info3 = generate_teacher_sequences(target, prompts, gen, tmp_path, seed=0, eos_token_id=EOS,
                                              pad_token_id=0)
    assert third == seqs and info3["computed"] == 1
    # Other sampling settings are other data.
    _, info4 = generate_teacher_sequences(target, prompts, GenerationConfig(max_new_tokens=6, temperature=0.0,
                                                                            batch_size=3),
                                          tmp_path, seed=0, eos_token_id=EOS, pad_token_id=0)
    assert info4["path"] != info["path"]


def test_teacher_passes_keep_the_callers_threads_unless_told_to_follow_the_free_cores(tmp_path, monkeypatch):
    """The one-off teacher passes (answers, top-k cache) run at the caller's thread count (the run's fixed one), not
    at the free cores' count, so what they store does not depend on the machine's load; follow_free_cores=True
    (trainer.follow_free_cores) takes the count from the free cores. The caller's count is restored after."""
    import decode
    from decode import fast_settings
    from distill.teacher import build_teacher_cache

    if fast_settings.available_cores() < 2:
        pytest.skip("needs 2 cores: the caller's 2 threads would be capped")
    monkeypatch.setattr(fast_settings, "free_cores", lambda window_s=0.5: 1)
    target = tiny_llama(vocab_size=V, hidden_size=32, seed=1, eos_token_id=EOS)
    seen: list[int] = []
    target.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))  # the cache's forwards
    generate = decode.autoregressive_generate  # the answers (its lean forward does not call the module)
    monkeypatch.setattr(decode, "autoregressive_generate",
                        lambda *a, **kw: (seen.append(torch.get_num_threads()), generate(*a, **kw))[1])
    blocks = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(0))
    gen = GenerationConfig(max_new_tokens=3, temperature=0.0, batch_size=4)
    torch.set_num_threads(2)
    for follow, want in ((False, {2}), (True, {1})):
        seen.clear()
        generate_teacher_sequences(target, _prompts(), gen, tmp_path / str(follow), seed=0, eos_token_id=EOS,
                                   pad_token_id=0, follow_free_cores=follow)
        assert set(seen) == want and torch.get_num_threads() == 2, ("answers", follow, seen)
        seen.clear()
        build_teacher_cache(target, blocks, tmp_path / str(follow), k=4, follow_free_cores=follow)
        assert set(seen) == want and torch.get_num_threads() == 2, ("top-k cache", follow, seen)


def test_on_policy_hook_rows_prefix_mask_and_determinism():
    student = tiny_llama(vocab_size=V, hidden_size=32, seed=3).train()
    blocks = torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1))
    batch = MicroBatch.from_blocks(blocks, torch.arange(4))
    gen = GenerationConfig(max_new_tokens=5)
    assert OnPolicyHook(0.0, gen, seed=0)(batch, 0, 0, student) is batch
    hook = OnPolicyHook(0.5, gen, seed=0, vocab_size=50)
    out = hook(batch, 3, 1, student)
    assert student.training, "the student is back in train mode"
    assert out.generated.tolist() == [True, True, False, False] and out.input_ids.shape == (4, T)
    assert torch.equal(out.block_index, batch.block_index)  # the cached teacher still covers the other rows
    assert torch.equal(out.input_ids[:, : T - 5], blocks[:, : T - 5]) and torch.equal(out.input_ids[2:], blocks[2:])
    assert (out.input_ids[:2, T - 5 :] < 50).all()
    assert out.loss_mask[:2, : T - 6].sum() == 0 and out.loss_mask[:2, T - 6 :].all() and out.loss_mask[2:].all()
    assert not out.input_ids.is_inference()
    assert torch.equal(hook(batch, 3, 1, student).input_ids, out.input_ids)  # pure in (seed, step, micro)
    assert hook.generated_rows == 4 and hook.generated_tokens == 20 and hook.generation_s > 0
    w = hook.window()
    assert w["on_policy_rows"] == 4 and w["on_policy_generated_tokens"] == 20 and w["on_policy_row_share"] == 0.5
    assert hook.window()["on_policy_rows"] == 0, "the window resets"
    with pytest.raises(ValueError, match="must be < the block length"):
        OnPolicyHook(1.0, GenerationConfig(max_new_tokens=T), seed=0)(batch, 0, 0, student)


def test_on_policy_training_runs_and_counts_only_generated_positions(tmp_path):
    teacher, student = tiny_llama(vocab_size=V, hidden_size=32, seed=1), tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    blocks = torch.randint(0, V, (16, T), generator=torch.Generator().manual_seed(1))
    hook = OnPolicyHook(1.0, GenerationConfig(max_new_tokens=4), seed=0)
    stats = train(student, blocks, tmp_path, TrainerConfig(max_steps=2, micro_batch_size=4, warmup_steps=1,
                                                           save_every=0, log_every=1),
                  make_distill_step(forward_kl, 1.0), teacher=teacher, batch_hook=hook)
    assert hook.generated_batches == 2 and hook.generated_rows == 8
    assert stats["tokens_seen"] == 2 * 4 * 5  # steps x rows x counted positions (T-5 .. T-1)


def test_acceptance_eval_identical_draft_accepts_everything():
    target = tiny_llama(vocab_size=V, hidden_size=32, seed=1)
    prompts = [torch.tensor([p]) for p in _prompts(3)]
    evaluate = make_acceptance_eval(target, prompts, num_draft_tokens=4, max_new_tokens=10)
    m = evaluate(tiny_llama(vocab_size=V, hidden_size=32, seed=1))
    assert m["acceptance_rate"] == 1.0 and m["mean_accepted_length"] == pytest.approx(5.0)
    other = evaluate(tiny_llama(vocab_size=V, hidden_size=32, seed=5))
    assert 1.0 <= other["mean_accepted_length"] < 5.0
    assert other["mean_accepted_length"] == pytest.approx(other["emitted_tokens"] / other["verify_steps"])
    with pytest.raises(ValueError, match="at least one prompt"):
        make_acceptance_eval(target, [], num_draft_tokens=4, max_new_tokens=4)


def test_acceptance_eval_for_checkpoint_selection_uses_the_configured_draft_length_policy():
    """Checkpoint selection decodes with ``decode.draft_length_policy`` (a fresh policy per prompt, so every
    checkpoint is scored from the same policy state): an identical draft under the adaptive policy grows its draft
    length past the starting gamma, and scoring twice gives the same numbers."""
    from decode import AcceptanceStats, speculative_generate
    from decode.config import DecodeConfig

    dc = DecodeConfig(num_draft_tokens=2, draft_length_policy="adaptive", max_draft_tokens=6, adaptive_window=1)
    target = tiny_llama(vocab_size=V, hidden_size=32, seed=1)
    draft = tiny_llama(vocab_size=V, hidden_size=32, seed=1)
    prompts = [torch.tensor([p]) for p in _prompts(3)]
    evaluate = make_acceptance_eval(target, prompts, num_draft_tokens=dc.num_draft_tokens, max_new_tokens=16,
                                    draft_length_policy=dc.make_policy)
    first, second = evaluate(draft), evaluate(draft)
    assert first["mean_draft_length"] > 2 and first["acceptance_rate"] == 1.0
    keys = ("mean_accepted_length", "acceptance_rate", "verify_steps", "emitted_tokens", "mean_draft_length")
    assert {k: first[k] for k in keys} == {k: second[k] for k in keys}
    direct = AcceptanceStats.pool(speculative_generate(target, draft, p, max_new_tokens=16,
                                                       draft_length_policy=dc.make_policy()).stats for p in prompts)
    assert first["verify_steps"] == direct.verify_steps
    assert first["mean_draft_length"] == pytest.approx(direct.drafted_tokens / direct.verify_steps)
    fixed = make_acceptance_eval(target, prompts, num_draft_tokens=2, max_new_tokens=16)(draft)
    assert fixed["verify_steps"] > first["verify_steps"]  # gamma 2 needs more steps than the grown lengths
