"""decode.fast_settings: INT8 drafts (torch.ao dynamic quantization). The lean forward runs Llama-like int8 drafts (a
biased family falls back to the Hugging Face forward), a trimmed head is quantized too, speculative greedy with an
INT8 draft equals target greedy, and an INT8 draft directory is an fp32 HF checkpoint that our loader quantizes."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decode import autoregressive_generate, speculative_generate
from decode.common import new_kv_state, output_vocab_size
from decode.fast_llama import FastKVState, unsupported_reason as _unsupported_reason
from decode.fast_settings import is_quantized, load_draft, quantize_draft
from decode_testutils import left_pad, make_pair, random_prompts

TARGET, DRAFT = make_pair(seed=5, noise=0.3)
QDRAFT = quantize_draft(DRAFT)


def test_quantize_replaces_every_linear_and_leaves_the_input_alone():
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    assert is_quantized(QDRAFT) and not is_quantized(DRAFT)
    assert not any(type(m) is torch.nn.Linear for m in QDRAFT.modules())
    assert sum(isinstance(m, QLinear) for m in QDRAFT.modules()) == 2 * 7 + 1  # 7 projections per layer + LM head
    assert any(type(m) is torch.nn.Linear for m in DRAFT.modules())
    assert output_vocab_size(QDRAFT) == output_vocab_size(DRAFT) == 64
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = DRAFT(ids).logits, QDRAFT(ids).logits
    assert not torch.equal(a, b)  # really quantized
    assert (a - b).abs().max() < 0.1 * a.abs().max()  # ... and still close to fp32


def test_lean_forward_runs_int8_drafts_and_matches_the_hf_forward():
    """Llama-like int8 drafts run in the lean forward (the same quantized modules, called in its layer loop), with
    the Hugging Face int8 forward's logits; fast_path=False still takes the HF forward."""
    state = new_kv_state(QDRAFT, 1, torch.device("cpu"), 32)
    assert isinstance(state, FastKVState) and state.fast and not state.packed
    hf = new_kv_state(QDRAFT, 1, torch.device("cpu"), 32, fast_path=False)
    assert not isinstance(hf, FastKVState)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = state.forward(ids, logits_to_keep=9)
        ref = QDRAFT(ids).logits
        # a cached one-token step after the prefill, against the HF forward's own cached step (activations are
        # quantized per call, so a step is compared with a step, not with a longer forward)
        hf.forward(ids)
        step, ref_step = state.forward(ids[:, :1]), hf.forward(ids[:, :1])
    torch.testing.assert_close(got[:, -9:], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, ref_step, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(rows=st.lists(st.integers(1, 40), min_size=2, max_size=3), width=st.integers(1, 48),
       lead=st.sampled_from([(1,), (3,), (2, 5)]), seed=st.integers(0, 2**16))
def test_stacked_int8_rows_equal_the_separate_projections_bit_for_bit(rows, width, lead, seed):
    """fuse_int8_rows (what the lean forward calls for q/k/v and gate/up): per-row int8 weights keep their values
    and scales and the activation is quantized from the same input, so the stacked product is the separate ones
    concatenated, exactly, for any row counts, widths and batch shapes."""
    from decode.fast_settings import fuse_int8_rows

    g = torch.Generator().manual_seed(seed)
    lins = torch.nn.Sequential(*[torch.nn.Linear(width, r, bias=False) for r in rows])
    with torch.no_grad():
        for m in lins:
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * torch.rand(m.weight.shape[0], 1,
                                                                              generator=g) * 3)
    q = list(quantize_draft(lins))
    fused = fuse_int8_rows(q)
    x = torch.randn(*lead, width, generator=g) * 2
    assert fused is not None and torch.equal(fused(x), torch.cat([m(x) for m in q], -1))
    assert fuse_int8_rows(q[:1]) is None  # nothing to stack
    assert fuse_int8_rows([*q, torch.nn.Linear(width, 2)]) is None  # not all int8


def test_lean_forward_stacks_int8_qkv_and_gate_up():
    """The lean forward calls one int8 module for q/k/v and one for gate/up per layer (built once, reused while the
    modules are the same), and its logits are the Hugging Face int8 forward's (test above)."""
    from decode.fast_weights import _layer_weights as layer_weights

    layers, _, _ = layer_weights(QDRAFT, packed=False)
    again, _, _ = layer_weights(QDRAFT, packed=False)
    for (_, _, qkv, _, _, _, gu, _), (_, _, qkv2, _, _, _, gu2, _) in zip(layers, again):
        assert len(qkv) == 1 and len(gu) == 1 and qkv[0] is qkv2[0] and gu[0] is gu2[0]
    fp32, _, _ = layer_weights(DRAFT, packed=False)
    assert all(len(qkv) == 3 and len(gu) == 2 for _, _, qkv, _, _, _, gu, _ in fp32)


def test_stacked_int8_follows_weights_reloaded_in_place_and_skips_float16_modules():
    """load_state_dict / set_weight_bias repack an int8 module's weights inside the same module object: the lean
    forward must then run the new weights (no stale stack), and a float16 dynamic draft is not stacked (it runs)."""
    from decode.fast_settings import fuse_int8_rows

    _, other = make_pair(seed=9, noise=0.3)
    a, b = quantize_draft(DRAFT), quantize_draft(other)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        new_kv_state(a, 1, torch.device("cpu"), 16).forward(ids)  # builds the stacks for a's weights
        a.load_state_dict(b.state_dict())
        got = new_kv_state(a, 1, torch.device("cpu"), 16).forward(ids, logits_to_keep=7)
        torch.testing.assert_close(got, b(ids).logits, rtol=1e-5, atol=1e-5)
    half = torch.ao.quantization.quantize_dynamic(DRAFT, {torch.nn.Linear}, dtype=torch.float16)
    attn = half.model.layers[0].self_attn
    assert fuse_int8_rows([attn.q_proj, attn.k_proj, attn.v_proj]) is None
    out = speculative_generate(TARGET, half, ids, max_new_tokens=6, num_draft_tokens=3)
    ref = autoregressive_generate(TARGET, ids, max_new_tokens=6)
    assert torch.equal(out.sequences, ref.sequences)


def test_int8_draft_of_a_biased_family_falls_back_to_the_hf_forward():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    q = quantize_draft(Qwen2ForCausalLM(cfg).eval())
    assert "quantized" in _unsupported_reason(q)
    state = new_kv_state(q, 1, torch.device("cpu"), 32)
    assert not isinstance(state, FastKVState) and not state.fast
    with pytest.raises(ValueError, match="quantized"):
        new_kv_state(q, 1, torch.device("cpu"), 32, fast_path=True)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(state.forward(ids, logits_to_keep=9)[:, -9:], q(ids).logits, rtol=1e-5, atol=1e-5)


def test_int8_trimmed_head_quantizes_its_rows_and_decodes_losslessly():
    """A trimmed draft head (models.vocab) is quantized too; its logits stay -inf outside the kept ids, the
    lean and HF forwards agree, and speculative greedy equals target greedy."""
    import copy

    from models.vocab import install_trimmed_head, trimmed_head

    trimmed = copy.deepcopy(DRAFT)
    install_trimmed_head(trimmed, torch.arange(0, 64, 2))  # even ids only: the target's odd argmaxes are missed
    q = quantize_draft(trimmed.eval())
    head = trimmed_head(q)
    assert head is not None and head.quantized is not None and is_quantized(q)
    assert trimmed_head(trimmed).quantized is None  # the input is left alone
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = q(ids).logits
        state = new_kv_state(q, 1, torch.device("cpu"), 32)
        assert isinstance(state, FastKVState)
        got = state.forward(ids, logits_to_keep=9)[:, -9:]
        fp32 = trimmed(ids).logits
    assert torch.isinf(ref[..., 1::2]).all() and torch.isfinite(ref[..., 0::2]).all()
    assert not torch.equal(ref[..., 0::2], fp32[..., 0::2])  # the rows really are int8
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for seed in range(3):
        prompts = random_prompts([5, 9], 64, seed)
        ids, mask = left_pad(prompts)
        want = autoregressive_generate(TARGET, ids, mask, max_new_tokens=10, eos_token_id=7, pad_token_id=0)
        out = speculative_generate(TARGET, q, ids, mask, max_new_tokens=10, num_draft_tokens=3,
                                   eos_token_id=7, pad_token_id=0)
        assert torch.equal(out.sequences, want.sequences)


@settings(max_examples=3, deadline=None)
@given(gamma=st.integers(1, 6), seed=st.integers(0, 2 ** 16), batch=st.integers(1, 3))
def test_speculative_greedy_with_int8_draft_equals_target_greedy(gamma, seed, batch):
    prompts = random_prompts([int(n) for n in torch.randint(3, 12, (batch,), generator=torch.Generator()
                                                             .manual_seed(seed))], 64, seed)
    ids, mask = left_pad(prompts)
    ref = autoregressive_generate(TARGET, ids, mask, max_new_tokens=12, eos_token_id=7, pad_token_id=0)
    out = speculative_generate(TARGET, QDRAFT, ids, mask, max_new_tokens=12, num_draft_tokens=gamma,
                               eos_token_id=7, pad_token_id=0)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.drafted_tokens > 0


def test_int8_directory_is_an_fp32_checkpoint_that_load_draft_quantizes(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(64)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  unk_token="t0", pad_token="t1")
    DRAFT.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    (tmp_path / "specdraft.json").write_text(json.dumps({"quantize": "int8"}))
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers sees the fp32 draft
    assert not is_quantized(fp32)
    model, _, meta = load_draft(tmp_path)
    assert is_quantized(model) and meta.quantize == "int8"
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # rebuilt at load time: the same int8 model as quantizing the in-memory draft
        torch.testing.assert_close(model(ids).logits, QDRAFT(ids).logits, rtol=0, atol=0)
    (tmp_path / "specdraft.json").write_text(json.dumps({"quantize": "int4"}))
    with pytest.raises(ValueError, match="quantize='int4'; supported: none, int8"):
        load_draft(tmp_path)


def test_bad_modes_and_devices_are_clear_errors():
    with pytest.raises(ValueError, match="draft.quantize must be one of none, int8"):
        quantize_draft(DRAFT, "fp8")
    assert quantize_draft(DRAFT, "none") is DRAFT
    meta = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="CPU only; the draft is on \\['meta'\\]"):
        quantize_draft(meta)
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_draft(torch.nn.Embedding(4, 4))
    with pytest.raises(ValueError, match="already int8; quantize its fp32 draft"):
        quantize_draft(QDRAFT)
    import copy

    with pytest.raises(ValueError, match=r"takes a float32 draft .* this one is bfloat16: load it in float32"):
        quantize_draft(copy.deepcopy(DRAFT).to(torch.bfloat16))


@pytest.mark.gpu
def test_int8_refuses_a_draft_on_cuda_with_the_reason():
    with pytest.raises(ValueError, match=r"CPU only; the draft is on \['cuda'\]"):
        quantize_draft(DRAFT.to("cuda"))
    DRAFT.to("cpu")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma2", "gemma3", "qwen2", "phi3"])
def test_int8_drafts_of_each_family_decode_like_their_hf_forward(family):
    """Every lean-forward family: an int8 draft runs in the lean forward where the family has no projection biases
    (else the HF forward), its prefill and cached steps equal the HF int8 forward's, and speculative greedy with it
    equals the target's greedy output."""
    from eval.bench import family_models

    target, draft = family_models(family, layers=2, hidden=64, window=6, vocab=96, seed=1)
    q = quantize_draft(draft)
    lean = new_kv_state(q, 1, torch.device("cpu"), 40)
    assert isinstance(lean, FastKVState) == (family not in ("qwen2", "phi3"))
    hf = new_kv_state(q, 1, torch.device("cpu"), 40, fast_path=False)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        torch.testing.assert_close(lean.forward(ids, logits_to_keep=10), hf.forward(ids, logits_to_keep=10),
                                   rtol=1e-4, atol=1e-4)
        for t in range(3):  # cached one-token steps, past the sliding window
            tok = ids[:, t:t + 1]
            torch.testing.assert_close(lean.forward(tok), hf.forward(tok), rtol=1e-4, atol=1e-4)
    ids, mask = left_pad(random_prompts([4, 8], 96, 3))
    want = autoregressive_generate(target, ids, mask, max_new_tokens=10, pad_token_id=0)
    got = speculative_generate(target, q, ids, mask, max_new_tokens=10, num_draft_tokens=3, pad_token_id=0)
    assert torch.equal(got.sequences, want.sequences)


def test_head_share_times_the_head_the_forward_runs():
    """decode.timing.head_share: the fp32 head's rows, an int8 draft's quantized head (LM head or trimmed rows)."""
    import copy

    from models.vocab import install_trimmed_head
    from decode.timing import head_share

    assert head_share(DRAFT, steps=3)["head_rows"] == 64
    assert head_share(QDRAFT, steps=3)["head_rows"] == 64
    trimmed = copy.deepcopy(DRAFT)
    install_trimmed_head(trimmed, torch.arange(0, 64, 2))
    for model in (trimmed, quantize_draft(trimmed.eval())):
        got = head_share(model, steps=3)
        assert got["head_rows"] == 32 and got["head_forward_s"] > 0
