"""EAGLE-3 decoding (decode/eagle3.py, models/eagle3.py): lossless greedy and sampling for random targets and heads,
batched with left padding and EOS, every draft-length policy, both target forwards; the training-time-test unroll
predicts exactly what the decoder drafts; the saved head is the vLLM eagle3 layout and loads back bit for bit."""
from __future__ import annotations

import json

import pytest
import torch

from tinymodels import tiny_llama
from decode_testutils import pooled_chisquare_pvalue
from decode import autoregressive_generate, make_policy, process_logits, speculative_generate
from decode.eagle3 import eagle3_generate
from decode.common import left_pad
from models.eagle3 import Eagle3Config, Eagle3Draft, default_target_layers, load_eagle3, save_eagle3


def make_head(target, draft_vocab: int, how: str, seed: int = 0) -> Eagle3Draft:
    cfg = Eagle3Config.from_target(target.config, draft_vocab)
    head = Eagle3Draft(cfg)
    gen = torch.Generator().manual_seed(seed)
    kept = torch.randperm(target.config.vocab_size, generator=gen)[:draft_vocab]
    head.init_from_target(target, kept, how=how, seed=seed)
    return head.eval()


def test_default_layers_and_config_checks():
    assert default_target_layers(30) == (2, 15, 27) and default_target_layers(7) == (2, 3, 4)
    assert default_target_layers(4) == (1, 2, 3) and default_target_layers(6) == (1, 3, 5)
    with pytest.raises(ValueError, match=">= 4 layers"):
        default_target_layers(3)
    t = tiny_llama(num_layers=6)
    with pytest.raises(ValueError, match="outside"):
        Eagle3Config.from_target(t.config, 16, target_layers=(1, 3, 6))
    with pytest.raises(ValueError, match="three different"):
        Eagle3Config.from_target(t.config, 16, target_layers=(1, 1, 3))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target(t.config, 65)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_equals_the_target_for_random_pairs(seed):
    g = torch.Generator().manual_seed(seed)
    layers = 4 + seed % 3
    target = tiny_llama(vocab_size=48, hidden_size=32, num_layers=layers, seed=seed, eos_token_id=5)
    head = make_head(target, draft_vocab=int(torch.randint(8, 48, (1,), generator=g)), how=("target", "random")[seed % 2],
                     seed=seed)
    prompts = [torch.randint(6, 48, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (3,), generator=g)]
    ids, mask = left_pad(prompts, 0)
    eos = [5] if seed % 2 else []
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    for gamma, policy in ((1, None), (3, None), (5, None), (3, "adaptive"), (4, "confidence")):
        pol = (make_policy("adaptive", initial=gamma, max_draft_tokens=5) if policy == "adaptive" else
               make_policy("confidence", max_draft_tokens=gamma, threshold=0.3) if policy else None)
        for fast in (None, False):
            out = eagle3_generate(target, head, ids, mask, max_new_tokens=20, num_draft_tokens=gamma,
                                  eos_token_id=eos, pad_token_id=0, draft_length_policy=pol, fast_path=fast)
            assert torch.equal(out.sequences, ref.sequences), (gamma, policy, fast)
            assert torch.equal(out.num_new_tokens, ref.num_new_tokens)
            s = out.stats
            assert s.emitted_tokens == int(ref.num_new_tokens.sum()) and s.accepted_tokens <= s.drafted_tokens
    # the dispatch: speculative_generate with an EAGLE-3 head runs this decoder
    out = speculative_generate(target, head, ids, mask, max_new_tokens=20, num_draft_tokens=3, eos_token_id=eos,
                               pad_token_id=0)
    assert torch.equal(out.sequences, ref.sequences)


def test_a_head_copying_the_target_is_accepted():
    """A 4-layer target whose last layer is the identity (zero o_proj / down_proj) and a head that is that layer's
    twin reading the high feature: every draft is the target's own next-next token, so nearly all are accepted."""
    target = tiny_llama(vocab_size=40, hidden_size=32, num_layers=5, seed=3)
    with torch.no_grad():
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    head = make_head(target, 40, "target")
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    out = eagle3_generate(target, head, ids, max_new_tokens=24, num_draft_tokens=3, eos_token_id=[])
    ref = autoregressive_generate(target, ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, ref.sequences)


def test_unroll_predicts_what_the_decoder_drafts():
    """Teacher-forced along the target's greedy answer, the unroll's step-j argmax at the block start equals the
    decoder's j-th draft whenever the earlier drafts were accepted: the replay of eval/heldout.py is the decoder."""
    target = tiny_llama(vocab_size=40, hidden_size=32, num_layers=4, seed=8)
    head = make_head(target, 24, "target", seed=2)
    prompt = torch.tensor([[7, 3, 9, 11]])
    ref = autoregressive_generate(target, prompt, max_new_tokens=16, eos_token_id=[]).sequences  # (1, 20)
    with torch.no_grad():
        hs = target(ref, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i] for i in head.cfg.target_layers], -1)
        outs = head.unroll(ref[:, 1:], head.fuse(feats[:, :-1]), steps=3)
    preds = [head.draft_to_target[head.logits(o).argmax(-1)] for o in outs]  # step j at t: token t + j + 2
    # decode with gamma 3 and compare the drafted tokens of every block with the unroll at the block's start
    from decode import eagle3 as e3

    blocks = []
    real = e3._draft_phase

    def spy(*a, **k):
        block, base = real(*a, **k)
        blocks.append(block.tokens[0].tolist())
        return block, base

    e3._draft_phase = spy
    try:
        out = eagle3_generate(target, head, prompt, max_new_tokens=16, num_draft_tokens=3, eos_token_id=[])
    finally:
        e3._draft_phase = real
    assert torch.equal(out.sequences, ref)
    pos, checked = prompt.shape[1], 0  # the first target step emits token P (no drafts)
    for drafted in blocks:
        start = pos  # the block drafts tokens start+1.. ; the unroll's position t = start - 1 predicts token start+1
        for j, d in enumerate(drafted):
            assert d == int(preds[j][0, start - 1]), (start, j)
            checked += 1
            if d != int(ref[0, start + 1 + j]):
                break
        n = next((j for j, d in enumerate(drafted) if d != int(ref[0, start + 1 + j])), len(drafted))
        pos = start + n + 1
    assert checked >= len(blocks)


V = 10
N = 4000


@torch.inference_mode()
def _joint_23(model, prompt, cfg) -> torch.Tensor:
    """``(V, V)``: P(x2, x3) = sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) after the sampling pipeline."""
    p1 = process_logits(model(prompt).logits[0, -1], **cfg)
    s2 = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
    p2 = process_logits(model(s2).logits[:, -1], **cfg)  # (V1, V2)
    s3 = torch.cat([s2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p3 = process_logits(model(s3).logits[:, -1], **cfg).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).double()


@pytest.mark.parametrize("cfg", [dict(num_draft_tokens=3, temperature=0.7, top_k=6)], ids=["g3-t0.7-k6"])
def test_sampling_keeps_the_target_distribution(cfg):
    pytest.importorskip("scipy.stats")
    target = tiny_llama(vocab_size=V, hidden_size=16, num_layers=4, seed=1)
    head = make_head(target, 7, "target", seed=4)
    prompt = torch.tensor([[3, 7, 1]])
    cfg = dict(cfg)
    gamma = cfg.pop("num_draft_tokens")
    joint = _joint_23(target, prompt, cfg)
    out = eagle3_generate(target, head, prompt.repeat(N, 1), max_new_tokens=3, num_draft_tokens=gamma,
                          do_sample=True, eos_token_id=[], generator=torch.Generator().manual_seed(7), **cfg)
    assert out.stats.accepted_tokens > 0
    x = out.sequences[:, 4] * V + out.sequences[:, 5]
    counts = torch.bincount(x, minlength=V * V).double()
    assert counts[joint.flatten() == 0].sum() == 0
    assert pooled_chisquare_pvalue(counts, joint, N) > 1e-4


def test_save_load_round_trip_is_the_vllm_layout(tmp_path):
    from safetensors import safe_open

    target = tiny_llama(vocab_size=40, hidden_size=32, num_layers=6, seed=2)
    head = make_head(target, 16, "target")
    save_eagle3(head, None, tmp_path / "h", meta={"draft_kind": "eagle3"})
    doc = json.loads((tmp_path / "h" / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLMEagle3"] and doc["draft_vocab_size"] == 16
    assert doc["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and "eagle_config" not in doc  # layer inputs
    with safe_open(str(tmp_path / "h" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_tensor("fc.weight").shape) == (32, 96)
        assert tuple(f.get_tensor("midlayer.self_attn.q_proj.weight").shape) == (32, 64)
    assert {"d2t", "t2d", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight"} <= names
    back = load_eagle3(tmp_path / "h", target=target)
    assert back.embed_tokens.weight is target.model.embed_tokens.weight
    ids = torch.randint(0, 40, (1, 7))
    a = eagle3_generate(target, head, ids, max_new_tokens=10, eos_token_id=[])
    b = eagle3_generate(target, back, ids, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(a.sequences, b.sequences) and a.stats.accepted_tokens == b.stats.accepted_tokens
