"""The decoder, the lean forward and one distillation step on CUDA (marked ``gpu``).

Without a GPU these are skipped with a reason; ``scripts/device_check.sh --cpu`` runs the same tests on the CPU
(``SPECDRAFT_GPU_TESTS_ON_CPU=1``) to dry-run the check. Every greedy test uses a draft that is a perturbed copy
of the target, so acceptance is partial (0 < alpha < 1): rejections, cache rollback of rows that accepted
different lengths, and the draft catching up after a full acceptance all run on the device.
"""
from __future__ import annotations

import copy

import pytest
import torch
from decode_testutils import left_pad, make_pair, random_prompts

from decode import autoregressive_generate, process_logits, speculative_generate
from decode.common import new_kv_state
from tinymodels import gpu_test_device, tiny_llama

pytestmark = pytest.mark.gpu
DEV = gpu_test_device()


def _pair(dtype=torch.float32):
    target, draft = make_pair(seed=5, noise=0.3)
    return target.to(DEV, dtype), draft.to(DEV, dtype)


def _prompts():
    ids, mask = left_pad(random_prompts([9, 6, 9, 4], 64, seed=3))  # left padding on two rows
    return ids.to(DEV), mask.to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equality_with_partial_acceptance(dtype, gamma):
    """Speculative greedy output equals target-only greedy output token for token, in fp32 and bf16, while the
    draft is rejected at some positions and accepted at others (both happen: 0 < alpha < 1)."""
    target, draft = _pair(dtype)
    ids, mask = _prompts()
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=37)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=37, num_draft_tokens=gamma)
    assert out.sequences.device.type == DEV.type
    assert torch.equal(out.sequences, ref.sequences)
    s = out.stats
    assert 0.0 < s.acceptance_rate < 1.0, s.acceptance_rate
    hist = s.accepted_length_histogram
    assert hist[0] > 0 and sum(hist[1:]) > 0  # rejected at the first position and accepted somewhere too


def test_identical_draft_accepts_everything():
    target = tiny_llama(vocab_size=96, hidden_size=64, num_layers=2, seed=0).to(DEV)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0)).to(DEV)
    out = speculative_generate(target, target, ids, max_new_tokens=40, num_draft_tokens=4)
    assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.05)])
def test_lean_forward_logits_match_hugging_face(dtype, tol):
    """The lean Llama forward (prefill in two chunks, then one token at a time through the KV cache) gives the
    Hugging Face forward's logits on the device; bf16: within 5% of the largest logit (rounding of a differently
    shaped computation), fp32: within 1e-3."""
    target, _ = _pair(dtype)
    ids, mask = _prompts()
    with torch.inference_mode():
        ref = target(input_ids=ids, attention_mask=mask).logits.float()
        state = new_kv_state(target, ids.shape[0], DEV, capacity=4, fast_path=True)  # tiny capacity: must grow
        out = [state.forward(ids[:, :5], mask[:, :5], logits_to_keep=0)]
        for j in range(5, ids.shape[1]):
            out.append(state.forward(ids[:, j:j + 1], mask[:, j:j + 1]))
    got = torch.cat(out, 1)
    assert got.device.type == DEV.type and got.dtype == dtype
    err = (got.float() - ref)[mask.bool()].abs().max().item()
    assert err <= tol * (ref.abs().max().item() if dtype != torch.float32 else 1.0), err


V, N, PROMPT = 12, 4000, [[3, 7, 1]]


@torch.inference_mode()
def _exact_joint(model, prompt, cfg) -> torch.Tensor:
    """``(V, V)`` float64 on the CPU: p(x1) * p(x2 | x1) after the shared sampling pipeline, on the device."""
    p1 = process_logits(model(prompt).logits[0, -1].float(), **cfg)
    seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V, device=prompt.device)[:, None]], 1)
    p2 = process_logits(model(seqs).logits[:, -1].float(), **cfg)
    return (p1[:, None] * p2).double().cpu()


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    stats = pytest.importorskip("scipy.stats")
    expected = probs.flatten() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if expected[~big].sum() > 0:
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    return float(stats.chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


@pytest.mark.parametrize("gamma,cfg", [(3, {}), (2, dict(temperature=0.7, top_k=6, top_p=0.9))])
def test_sampling_is_exact_on_the_device(gamma, cfg):
    """Speculative sampling with a device generator reproduces the target's joint distribution of the first two
    tokens (chi-square, fails at p < 1e-4); the same test rejects the draft's own distribution (power), and a seeded
    device generator repeats its output."""
    target = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=1).to(DEV)
    draft = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=5).to(DEV)
    prompt = torch.tensor(PROMPT, device=DEV)
    joint = _exact_joint(target, prompt, cfg)

    def run(seed):
        return speculative_generate(target, draft, prompt.repeat(N, 1), max_new_tokens=3, num_draft_tokens=gamma,
                                    do_sample=True, generator=torch.Generator(DEV).manual_seed(seed), **cfg)

    out = run(1234)
    seq = out.sequences.cpu()
    counts = torch.bincount(seq[:, 3] * V + seq[:, 4], minlength=V * V).double()
    assert counts[joint.flatten() == 0].sum() == 0  # pairs filtered by top-k / top-p never appear
    assert _chi_square_pvalue(counts, joint) > 1e-4
    assert _chi_square_pvalue(counts, _exact_joint(draft, prompt, cfg)) < 1e-4
    assert 0.0 < out.stats.acceptance_rate < 1.0
    assert torch.equal(run(1234).sequences, out.sequences)


def test_one_distillation_step_on_the_device(tmp_path):
    """Two optimizer steps of forward-KL distillation in bf16 mixed precision: the student ends on the device
    (accelerate placed it there), its weights moved, the loss is finite, and the teacher is untouched."""
    from distill.losses import forward_kl
    from distill.trainer import TrainerConfig, make_distill_step, train

    teacher = tiny_llama(vocab_size=64, hidden_size=32, seed=1)
    student = tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=3)
    before = copy.deepcopy(student.state_dict())
    teacher_before = copy.deepcopy(teacher.state_dict())
    blocks = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    cfg = TrainerConfig(max_steps=2, micro_batch_size=4, grad_accum_steps=1, warmup_steps=1, save_every=0,
                        log_every=1, lr=1e-2, mixed_precision="bf16")
    stats = train(student, blocks, tmp_path, cfg, make_distill_step(forward_kl, 1.0), teacher=teacher)
    assert stats["steps"] == 2 and torch.isfinite(torch.tensor(stats["final_loss"]))
    assert next(student.parameters()).device.type == DEV.type
    moved = [k for k, v in student.state_dict().items() if not torch.equal(v.cpu(), before[k])]
    assert moved, "no weight changed"
    assert all(torch.equal(v.cpu(), teacher_before[k]) for k, v in teacher.state_dict().items())


def test_selection_evaluation_never_moves_the_online_teacher():
    """ZeRO-3 with a replicated teacher: training's teacher sits on the GPU while the gathered draft is a full copy
    in host memory. The selection evaluation runs on the teacher's device with a copy of the draft; neither model
    moves (the next training step feeds the teacher device inputs)."""
    from distill.generation import make_acceptance_eval

    target, draft = make_pair(seed=5, noise=0.3)
    target = target.to(DEV)
    prompts = [p[None] for p in random_prompts([7, 5], 64, seed=4)]
    evaluate = make_acceptance_eval(target, prompts, num_draft_tokens=3, max_new_tokens=12, move_target=False)
    with torch.no_grad():
        m = evaluate(draft)
    assert next(target.parameters()).device.type == DEV.type and next(draft.parameters()).device.type == "cpu"
    assert m["verify_steps"] > 0 and 1.0 <= m["mean_accepted_length"] <= 4.0


def test_decoding_does_not_synchronize_per_step(monkeypatch):
    """The decoders' timers record CUDA events instead of synchronising around every phase: no
    ``torch.cuda.synchronize`` while decoding (greedy acceptance still reads its counts on the host once per
    verify step), and the timed seconds are real."""
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    target, draft = _pair()
    ids, mask = _prompts()
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=20)
    spec = speculative_generate(target, draft, ids, mask, max_new_tokens=20, num_draft_tokens=3)
    assert calls == []
    assert ar.stats.verify_time_s > 0 and spec.stats.draft_time_s > 0 and spec.stats.verify_time_s > 0


def test_event_timer_agrees_with_a_synchronised_wall_clock():
    from decode.common import Timer, sync
    import time

    x = torch.randn(1024, 1024, device=DEV)
    for _ in range(3):  # warm-up
        x @ x
    sync(DEV)
    t0 = time.perf_counter()
    with Timer(DEV) as timer:
        for _ in range(20):
            y = x @ x
    sync(DEV)
    wall = time.perf_counter() - t0
    assert y.shape == x.shape and 0.0 < timer.seconds <= wall * 1.05 + 1e-4
    assert timer.seconds >= 0.5 * wall  # the queued matmuls count in the interval that launched them


def test_compiled_lean_forward_is_lossless_in_bf16():
    """decode.compile (auto: on for CUDA): the compiled lean forward gives the same bf16 greedy tokens as the
    uncompiled one, batch 1 and a padded batch. On the CPU dry run auto stays off (compiling there does not pay and
    takes minutes; tests/decode/test_decode_fast_path.py has a slow CPU test of the compiled path)."""
    from decode.fast_llama import compile_enabled, compile_seconds, set_compile

    target, draft = _pair(torch.bfloat16)
    ids, mask = _prompts()
    assert compile_enabled(DEV) is (DEV.type == "cuda")
    runs = {}
    before = compile_seconds()
    try:
        for mode in ("off", "auto"):
            set_compile(mode)
            runs[mode] = [speculative_generate(target, draft, ids[:1], mask[:1], max_new_tokens=24,
                                               num_draft_tokens=3).sequences,
                          speculative_generate(target, draft, ids, mask, max_new_tokens=24,
                                               num_draft_tokens=3).sequences]
    finally:
        set_compile("auto")
    assert (compile_seconds() > before) is (DEV.type == "cuda")
    for off, on in zip(runs["off"], runs["auto"]):
        assert torch.equal(off, on)
