"""The lean Llama forward (decode.fast_llama): same logits as the Hugging Face forward, same decoding results,
and a clean fallback to the Hugging Face forward for models it does not cover."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from decode_testutils import hf_greedy, left_pad, make_pair, random_prompts

from decode import autoregressive_generate, speculative_generate
from decode.common import KVState, new_kv_state
from decode.fast_llama import FastKVState, fast_path_supported


def _llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=80, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=6, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def _hf_logits(model, ids, mask):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("kv_heads", [6, 2])  # MHA and GQA (3 query heads per key/value head)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("packed", [True, False])  # packed transposed copies (CPU) / the model's own F.linear weights
def test_logits_match_hf_forward(kv_heads, padded, packed):
    model = _llama(seed=kv_heads, num_key_value_heads=kv_heads)
    assert fast_path_supported(model)
    lengths = [9, 4, 7] if padded else [9, 9, 9]
    ids, mask = left_pad(random_prompts(lengths, 80, seed=1))
    ref = _hf_logits(model, ids, mask)  # (B, P, V) one uncached forward
    with torch.inference_mode():
        # prefill in two chunks, then one token at a time: every cached shape the decoder uses
        state = FastKVState(model, 3, torch.device("cpu"), capacity=4, packed=packed)  # tiny capacity: must grow
        out = [state.forward(ids[:, :5], mask[:, :5], logits_to_keep=0)]
        out.append(state.forward(ids[:, 5:7], mask[:, 5:7], logits_to_keep=0))
        for j in range(7, ids.shape[1]):
            out.append(state.forward(ids[:, j:j + 1], mask[:, j:j + 1]))
    got = torch.cat(out, 1)
    real = mask.bool()
    assert (got - ref)[real].abs().max().item() < 1e-4
    assert torch.equal(state.num_valid, mask.sum(1))


def test_holes_and_truncation_match_hf_cache_state():
    """Speculative cache edits (holes from rejected tokens, row retirement) give the HF KVState's logits."""
    model = _llama(seed=3, num_key_value_heads=3)
    ids, mask = left_pad(random_prompts([6, 3, 5], 80, seed=2))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        hf, fast = KVState(model, 3, torch.device("cpu")), FastKVState(model, 3, torch.device("cpu"), capacity=8)
        for s in (hf, fast):
            s.forward(ids, mask)
        for step in range(6):
            block = torch.randint(0, 80, (hf.mask.shape[0], 4), generator=gen)
            bmask = torch.ones_like(block)
            bmask[0, 0] = step % 2  # a hole inside the block (the draft's catch-up slot)
            start = hf.length
            a = hf.forward(block, bmask, logits_to_keep=0)
            b = fast.forward(block, bmask, logits_to_keep=0)
            assert (a - b)[bmask.bool()].abs().max().item() < 1e-4
            keep = torch.randint(1, 5, (block.shape[0],), generator=gen)
            for s in (hf, fast):
                s.truncate(start, keep, int(keep.max()))
            assert torch.equal(hf.mask, fast.mask) and torch.equal(hf.num_valid, fast.num_valid)
            if step == 3:
                for s in (hf, fast):
                    s.select_rows(torch.tensor([0, 2]))
        tok = torch.randint(0, 80, (2, 1), generator=gen)
        assert (hf.forward(tok) - fast.forward(tok)).abs().max().item() < 1e-4


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_fast_path_equals_generate_and_hf_path(gamma):
    target, draft = make_pair(seed=21, noise=0.3)
    prompts = random_prompts([5, 2, 8], 64, 4)
    ids, mask = left_pad(prompts)
    n = 21
    ref = hf_greedy(target, ids, mask, n)
    for fast_path in (True, False):
        sp = speculative_generate(target, draft, ids, mask, max_new_tokens=n, num_draft_tokens=gamma,
                                  fast_path=fast_path)
        assert torch.equal(sp.sequences, ref), fast_path
        ar = autoregressive_generate(target, ids, mask, max_new_tokens=n, fast_path=fast_path)
        assert torch.equal(ar.sequences, ref), fast_path
        one = speculative_generate(target, draft, prompts[1][None], max_new_tokens=n, num_draft_tokens=gamma,
                                   fast_path=fast_path)  # batch 1: the dense (hole-free) path
        assert torch.equal(one.sequences[0, -n:], ref[1, -n:]), fast_path


def test_greedy_gqa_target_matches_generate():
    target = _llama(seed=5, num_key_value_heads=2, vocab_size=64, num_hidden_layers=3)
    draft = _llama(seed=6, num_key_value_heads=3, vocab_size=64, num_hidden_layers=1)
    ids, mask = left_pad(random_prompts([4, 7], 64, 8))
    ref = hf_greedy(target, ids, mask, 17)
    sp = speculative_generate(target, draft, ids, mask, max_new_tokens=17, num_draft_tokens=3, fast_path=True)
    assert torch.equal(sp.sequences, ref)


def test_sampling_same_seed_same_output_on_both_paths():
    target, draft = make_pair(seed=8, noise=0.5)
    ids, mask = left_pad(random_prompts([3, 6], 64, 3))
    outs = []
    for fast_path in (True, False):
        out = speculative_generate(target, draft, ids, mask, max_new_tokens=20, num_draft_tokens=3, do_sample=True,
                                   temperature=0.9, top_p=0.95, generator=torch.Generator().manual_seed(7),
                                   fast_path=fast_path)
        outs.append(out.sequences)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("overrides,why", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope"),
    (dict(attention_bias=True), "bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_llama_configs_fall_back(overrides, why):
    target = _llama(seed=9, vocab_size=64, **overrides)
    draft = _llama(seed=10, vocab_size=64, num_hidden_layers=1)
    assert not fast_path_supported(target)
    assert isinstance(new_kv_state(target, 1, torch.device("cpu")), KVState)
    assert isinstance(new_kv_state(draft, 1, torch.device("cpu")), FastKVState)
    with pytest.raises(ValueError, match=why):
        new_kv_state(target, 1, torch.device("cpu"), fast_path=True)
    ids, mask = left_pad(random_prompts([3, 5], 64, 0))
    ref = hf_greedy(target, ids, mask, 9)
    sp = speculative_generate(target, draft, ids, mask, max_new_tokens=9, num_draft_tokens=2)  # mixed paths
    assert torch.equal(sp.sequences, ref)


def test_other_architecture_falls_back():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert not fast_path_supported(gpt2)
    with pytest.raises(ValueError, match="gpt2"):
        new_kv_state(gpt2, 1, torch.device("cpu"), fast_path=True)


def test_bf16_logits_close_to_hf_forward():
    model = _llama(seed=4, num_key_value_heads=3).to(torch.bfloat16)
    ids, mask = left_pad(random_prompts([7, 3, 5], 80, seed=6))
    ref = _hf_logits(model, ids, mask).float()
    with torch.inference_mode():
        for packed in (True, False):
            got = FastKVState(model, 3, torch.device("cpu"), packed=packed).forward(ids, mask, logits_to_keep=0)
            assert got.dtype == torch.bfloat16
            # bf16 rounding of a differently shaped (cached) computation: HF's own cached forward differs as much
            assert (got.float() - ref)[mask.bool()].abs().max().item() < 0.05 * ref.abs().max().item()


def test_packed_weights_follow_in_place_weight_edits():
    """The packed copies are cached per model; editing a parameter in place (or reloading) must rebuild them."""
    target, draft = make_pair(seed=13, noise=0.3)
    ids = random_prompts([6], 64, 2)[0][None]
    before = speculative_generate(target, draft, ids, max_new_tokens=12, num_draft_tokens=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(-1.0)  # reverses the target's preferences
        target.model.layers[0].mlp.down_proj.weight.add_(0.5)
    after = speculative_generate(target, draft, ids, max_new_tokens=12, num_draft_tokens=3)
    ref = hf_greedy(target, ids, torch.ones_like(ids), 12)
    assert torch.equal(after.sequences, ref)
    assert not torch.equal(after.sequences, before.sequences)


def test_state_usable_outside_inference_mode():
    model = _llama(seed=2)
    ids = random_prompts([5], 80, 0)[0][None]
    state = FastKVState(model, 1, torch.device("cpu"))
    out = torch.cat([state.forward(ids[:, :3], logits_to_keep=0), state.forward(ids[:, 3:], logits_to_keep=0)], 1)
    assert (out - _hf_logits(model, ids, torch.ones_like(ids))).abs().max().item() < 1e-4
    state.truncate(3, None, 1)
    assert state.length == 4 and state.num_valid.tolist() == [4]


def test_training_mode_falls_back():
    model = _llama(seed=1)
    model.train()
    assert not fast_path_supported(model)
    model.eval()
    assert fast_path_supported(model)


# ---------------------------------------------------------------- the lean forward reads the live weights (issue 12)
def _assert_fast_is_hf(model, ids):
    """A new lean state (on CPU: the packed copies) gives the Hugging Face forward's logits on the current weights."""
    with torch.inference_mode():
        got = FastKVState(model, ids.shape[0], torch.device("cpu")).forward(ids, logits_to_keep=0)
    torch.testing.assert_close(got, _hf_logits(model, ids, torch.ones_like(ids)), atol=1e-4, rtol=1e-4)


def test_draft_decodes_new_weights_after_a_write_through_data():
    """The smallest case of issue 12: ``.data`` writes bump neither the storage pointer nor the version counter."""
    _, draft = make_pair(seed=21, noise=0.3)
    ids = random_prompts([6], 64, 3)[0][None]
    before = autoregressive_generate(draft, ids, max_new_tokens=10).sequences
    draft.lm_head.weight.data.mul_(-1.0)
    after = autoregressive_generate(draft, ids, max_new_tokens=10).sequences
    assert torch.equal(after, hf_greedy(draft, ids, torch.ones_like(ids), 10))
    assert not torch.equal(after, before)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(["inplace", "assign", "row", "swap"]),
                                st.sampled_from(["q", "k", "v", "o", "gate", "up", "down", "lm"]),
                                st.integers(0, 1), st.integers(0, 2 ** 16)), min_size=1, max_size=4))
def test_every_kind_of_weight_write_reaches_the_lean_forward(edits):
    """Any sequence of writes (in place through ``.data``, ``.data = new tensor``, one row, two parameters swapping
    storages), each followed by a new lean state: its logits are the Hugging Face forward's on the current weights.
    One model for all examples, so copies packed by an earlier example are in play."""
    model, ids = _EDITED
    for kind, name, layer_i, seed in edits:
        w = _weight(model, name, layer_i)
        noise = 0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
        if kind == "inplace":
            w.data.mul_(-0.5).add_(noise)
        elif kind == "assign":
            w.data = noise
        elif kind == "row":
            w.data[seed % w.shape[0]] = noise[0]
        else:  # the same projection of the other layer (lm_head: the untied input embedding) swaps storages with it
            other = model.model.embed_tokens.weight if name == "lm" else _weight(model, name, 1 - layer_i)
            w.data, other.data = other.data, w.data
        _assert_fast_is_hf(model, ids)


def _weight(model, name: str, layer_i: int) -> torch.nn.Parameter:
    if name == "lm":
        return model.lm_head.weight
    layer = model.model.layers[layer_i]
    return getattr(layer.mlp if name in ("gate", "up", "down") else layer.self_attn, f"{name}_proj").weight


_EDITED = (_llama(seed=11, num_key_value_heads=2), random_prompts([7], 80, 9)[0][None])


def test_lean_forward_after_a_peft_lora_merge():
    """peft's merge adds the LoRA update through ``weight.data``: the merged draft's lean forward is the adapted
    draft's forward, on a model whose packed copies were built before the merge."""
    from peft import LoraConfig, get_peft_model

    model = _llama(seed=5, num_key_value_heads=2)
    ids = random_prompts([8], 80, 4)[0][None]
    _assert_fast_is_hf(model, ids)  # packs the base weights
    before = _hf_logits(model, ids, torch.ones_like(ids))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj", "lm_head"],
                     init_lora_weights=False)  # random B: the update is not zero
    peft_model = get_peft_model(model, cfg)
    adapted = _hf_logits(peft_model, ids, torch.ones_like(ids))
    merged = peft_model.merge_and_unload()
    assert fast_path_supported(merged)
    with torch.inference_mode():
        fast = FastKVState(merged, 1, torch.device("cpu")).forward(ids, logits_to_keep=0)
    torch.testing.assert_close(fast, adapted, atol=1e-4, rtol=1e-4)
    assert (adapted - before).abs().max().item() > 0.1  # the merge did change the model


def test_packed_copies_are_reused_only_for_bitwise_equal_weights():
    """The reuse test is exact: one flipped bit (one ulp, a NaN payload) or -0.0 for 0.0 is a change, for views at
    odd offsets, transposed views and half precision too."""
    from decode.fast_weights import _same_bits

    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    flat = torch.randn(61)
    ints = {2: torch.int16, 4: torch.int32}
    for live in (w, flat[1:31].view(6, 5), w.t(), w.half(), w.bfloat16()[:, 1:], torch.full((2, 3), float("nan"))):
        snap = live.clone(memory_format=torch.contiguous_format)
        assert _same_bits(live, snap)
        flipped = snap.clone()
        word = flipped.view(-1).view(ints[flipped.element_size()])
        word[3] = word[3] ^ 1  # the lowest mantissa bit
        assert not _same_bits(live, flipped)
    zeros = torch.zeros(3, 4)
    assert not _same_bits(zeros, -zeros) and not _same_bits(w, w.double()) and not _same_bits(w, w[:5])


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("family,window,window_layers", [
    ("mistral", 3, 0), ("mistral", None, 0), ("qwen2", 3, 0), ("qwen2", None, 0), ("qwen2", 3, 1), ("qwen3", 3, 0),
    ("qwen3", None, 0), ("gemma2", 3, 0), ("gemma3", 3, 0), ("phi3", 3, 0)])  # Gemma: windowed and full layers
def test_family_on_the_lean_forward_matches_hf(family, window, window_layers, packed):
    """Mistral (Llama + a sliding window), Qwen2 (+ q/k/v biases; the first layer full, the rest windowed too),
    Qwen3 (+ q/k head RMSNorm), Gemma-2 (soft-capped attention and logits, windowed / full layers alternating,
    query_pre_attn_scalar, (1 + w) RMSNorms before and after attention and MLP, scaled embedding, GELU-tanh),
    Gemma-3 (+ q/k head norms, a RoPE base per layer type) and Phi-3 (fused qkv / gate_up) run on the lean
    forward: the same logits as transformers' uncached forward with left padding (a padded vocabulary: the head
    has more rows than the prompts use), and the same as the Hugging Face KV state through holes, truncation and
    row retirement, with the window counted in positions."""
    from tinymodels import tiny_family

    def build(w):
        return tiny_family(family, vocab_size=80, hidden_size=48, num_heads=6, num_kv_heads=3, seed=4,
                           sliding_window=w, max_window_layers=window_layers)

    model = build(window)
    with torch.no_grad():  # non-zero biases, norm weights away from their init (0 or 1)
        for name, p in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    assert fast_path_supported(model)
    ids, mask = left_pad(random_prompts([9, 4, 7], 64, seed=1))  # ids < 64 of 80 rows
    ref = _hf_logits(model, ids, mask)
    with torch.inference_mode():
        state = FastKVState(model, 3, torch.device("cpu"), capacity=4, packed=packed)
        out = [state.forward(ids[:, :5], mask[:, :5], logits_to_keep=0)]
        out += [state.forward(ids[:, j:j + 1], mask[:, j:j + 1]) for j in range(5, ids.shape[1])]
    assert (torch.cat(out, 1) - ref)[mask.bool()].abs().max().item() < 1e-4
    if window is not None:  # the window changes these logits (else the test could not see a wrong window)
        full = build(None)
        full.load_state_dict(model.state_dict())
        assert (_hf_logits(full, ids, mask) - ref)[mask.bool()].abs().max().item() > 1e-2
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        hf = KVState(model, 3, torch.device("cpu"))
        fast = FastKVState(model, 3, torch.device("cpu"), capacity=8, packed=packed)
        for s in (hf, fast):
            s.forward(ids, mask)
        for step in range(6):
            block = torch.randint(0, 80, (hf.mask.shape[0], 4), generator=gen)
            bmask = torch.ones_like(block)
            bmask[0, 0] = step % 2
            start = hf.length
            a, b = hf.forward(block, bmask, logits_to_keep=0), fast.forward(block, bmask, logits_to_keep=0)
            assert (a - b)[bmask.bool()].abs().max().item() < 1e-4
            keep = torch.randint(1, 5, (block.shape[0],), generator=gen)
            for s in (hf, fast):
                s.truncate(start, keep, int(keep.max()))
            if step == 3:
                for s in (hf, fast):
                    s.select_rows(torch.tensor([0, 2]))
        tok = torch.randint(0, 80, (2, 1), generator=gen)
        assert (hf.forward(tok) - fast.forward(tok)).abs().max().item() < 1e-4
    # batch 1 (dense: keys outside the window are sliced off) against generate()
    one = autoregressive_generate(model, ids[:1], max_new_tokens=12)
    assert torch.equal(one.sequences, hf_greedy(model, ids[:1], mask[:1], 12))


def test_mixed_window_layers_on_the_lean_forward():
    """Full and windowed layers in one model (Qwen2's max_window_layers, Gemma's alternation) get one mask each."""
    from tinymodels import tiny_family

    mixed = tiny_family("qwen2", sliding_window=3, max_window_layers=1)  # layer 0 full, layer 1 windowed
    state = new_kv_state(mixed, 1, torch.device("cpu"))
    assert isinstance(state, FastKVState) and state.layer_window == [None, 3]
    gemma3 = new_kv_state(tiny_family("gemma3", sliding_window=3), 1, torch.device("cpu"))
    assert gemma3.layer_window == [3, None] and len(gemma3.inv_freqs) == 2  # RoPE base per layer type


def test_decode_compile_setting_resolves_per_device_and_refuses_unknown_values():
    from decode.config import DecodeConfig
    from decode.fast_llama import compile_enabled, set_compile

    try:
        set_compile("auto")
        assert not compile_enabled("cpu") and compile_enabled("cuda")  # auto: measured not to pay on CPU
        set_compile("on")
        assert compile_enabled("cpu")
        assert FastKVState(_llama(), 1, torch.device("cpu")).compiled
        set_compile("off")
        assert not compile_enabled("cuda")
        with pytest.raises(ValueError, match="decode.compile must be one of auto, on, off"):
            set_compile("yes")
    finally:
        set_compile("auto")
    with pytest.raises(ValueError, match="decode.compile"):
        DecodeConfig(compile="true")


@pytest.mark.slow
@pytest.mark.extended  # compiling takes minutes on a small CPU (each graph: inductor + gcc)
def test_compiled_lean_forward_is_lossless():
    """decode.compile=on: the same greedy tokens as the uncompiled lean forward (same dtype), batch 1 and a left
    padded batch with holes, on a windowed family; the compile time is counted."""
    from decode.fast_llama import compile_seconds, set_compile
    from tinymodels import tiny_family

    target = tiny_family("gemma2", vocab_size=64, hidden_size=32, seed=3, sliding_window=3)
    draft = tiny_family("gemma2", vocab_size=64, hidden_size=32, num_layers=1, seed=4, sliding_window=3)
    ids, mask = left_pad(random_prompts([6, 3], 64, seed=2))
    runs = {}
    before = compile_seconds()
    try:
        for mode in ("off", "on"):
            set_compile(mode)
            runs[mode] = [speculative_generate(target, draft, ids[:1], max_new_tokens=12, num_draft_tokens=3),
                          speculative_generate(target, draft, ids, mask, max_new_tokens=12, num_draft_tokens=3)]
    finally:
        set_compile("auto")
    assert compile_seconds() > before  # the compiled calls compiled (and their time was counted)
    for off, on in zip(runs["off"], runs["on"]):
        assert torch.equal(off.sequences, on.sequences)
    assert torch.equal(runs["on"][1].sequences, hf_greedy(target, ids, mask, 12))


# ---------------------------------------------------------------- decode.frozen_weights: read the weights once
def _reads(monkeypatch):
    """Count how often a state reads a model's weights (``_layer_weights``)."""
    import decode.fast_weights as fl

    calls = []
    real = fl._layer_weights
    monkeypatch.setattr(fl, "_layer_weights", lambda model, packed: calls.append(model) or real(model, packed))
    return calls


@pytest.mark.parametrize("gamma", [1, 4])
def test_frozen_weights_reads_each_model_once_and_decodes_the_same(monkeypatch, gamma):
    from decode import frozen_weights

    target, draft = make_pair(seed=31, noise=0.3)
    prompts = random_prompts([5, 9, 3], 64, 7)
    plain = [speculative_generate(target, draft, p[None], max_new_tokens=10, num_draft_tokens=gamma).sequences
             for p in prompts]
    calls = _reads(monkeypatch)
    with frozen_weights(target, draft):
        got = [speculative_generate(target, draft, p[None], max_new_tokens=10, num_draft_tokens=gamma).sequences
               for p in prompts]
        ar = [autoregressive_generate(target, p[None], max_new_tokens=10).sequences for p in prompts]
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert all(torch.equal(a, b) for a, b in zip(ar, plain))  # lossless: the target's own greedy output
    assert calls.count(target) == 1 and calls.count(draft) == 1  # 6 target states and 3 draft states, one read each
    calls.clear()
    speculative_generate(target, draft, prompts[0][None], max_new_tokens=4, num_draft_tokens=gamma)
    assert calls.count(target) == 1 and calls.count(draft) == 1  # outside the block: every state reads again


@pytest.mark.parametrize("edit", ["inplace", "assign", "load_state_dict", "train"])
def test_frozen_weights_sees_edits_through_the_parameters(edit):
    """Inside the block an edit through the parameter itself (version counter), new storage, a reload or a mode
    change is still seen: the next decode uses the current weights, as without the block."""
    from decode import frozen_weights

    target, draft = make_pair(seed=33, noise=0.3)
    ids = random_prompts([6], 64, 5)[0][None]
    with frozen_weights(target, draft):
        before = speculative_generate(target, draft, ids, max_new_tokens=12, num_draft_tokens=3).sequences
        w = target.lm_head.weight
        if edit == "inplace":
            with torch.no_grad():
                w.mul_(-1.0)
        elif edit == "assign":
            w.data = -w.data
        elif edit == "load_state_dict":
            target.load_state_dict({**target.state_dict(), "lm_head.weight": -w.detach().clone()})
        else:
            target.train()  # dropout is 0 in these configs, but the lean forward refuses training mode
        after = speculative_generate(target, draft, ids, max_new_tokens=12, num_draft_tokens=3).sequences
    assert torch.equal(after, hf_greedy(target, ids, torch.ones_like(ids), 12))
    if edit != "train":
        assert not torch.equal(after, before)


def test_frozen_weights_nests_and_forgets_the_models_on_exit(monkeypatch):
    import gc
    import weakref

    import decode.fast_weights as fl
    from decode import frozen_weights

    model = _llama(seed=3)
    ids = random_prompts([5], 80, 1)[0][None]
    calls = _reads(monkeypatch)
    with frozen_weights(model):
        autoregressive_generate(model, ids, max_new_tokens=3)
        with frozen_weights(model):  # reentrant: the inner exit keeps what the outer block cached
            autoregressive_generate(model, ids, max_new_tokens=3)
        autoregressive_generate(model, ids, max_new_tokens=3)
        assert len(calls) == 1
    assert model not in fl._frozen and model not in fl._frozen_plans
    ref = weakref.ref(model)
    del model, calls[:]
    gc.collect()
    assert ref() is None  # nothing the block cached keeps the model alive


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
def test_several_row_products_on_the_out_in_copy_match_the_one_row_layout(rows):
    """``_rows_times`` / ``_rows_addmm`` (weight as the left operand) compute ``x @ W^T`` and ``r + x @ W^T`` for
    any rows (one row multiplied beside a zero row), including a transposed (non-contiguous) ``x``, to fp32
    rounding; the result is contiguous."""
    from decode.fast_settings import rows_addmm as _rows_addmm, rows_times as _rows_times

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 24, generator=g)  # (out, in)
    x = torch.randn(rows, 24, generator=g)
    res = torch.randn(rows, 37, generator=g)
    for xi in (x, x.t().contiguous().t()):
        out = _rows_times(xi, w)
        assert out.shape == (rows, 37) and out.is_contiguous()
        torch.testing.assert_close(out, x @ w.t(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_rows_addmm(res, xi, w), res + x @ w.t(), atol=1e-5, rtol=1e-5)


def test_block_forward_matches_token_by_token_forward():
    """A state fed a prompt in one block (several-row products) gives the logits of a state fed it one token at a
    time (one-row products) to fp32 rounding, on the packed CPU path."""
    model = _llama(seed=8, num_key_value_heads=2)
    ids = random_prompts([9], 80, 6)[0][None]
    with torch.inference_mode():
        block = FastKVState(model, 1, torch.device("cpu"), packed=True).forward(ids, logits_to_keep=0)
        one = FastKVState(model, 1, torch.device("cpu"), packed=True)
        steps = torch.cat([one.forward(ids[:, j:j + 1]) for j in range(ids.shape[1])], 1)
    torch.testing.assert_close(block, steps, atol=1e-4, rtol=1e-4)


def test_frozen_weights_sees_new_storage_even_at_a_reused_address():
    """``param.data = t`` twice between decodes frees the first storage, and the allocator often hands its address
    to the second tensor (same pointer, same version): the cached reading keeps the storage it was built from alive,
    so the pointer always changes and the edit is seen (several rounds: a reuse happened in 3 of 5 tries before)."""
    from decode import frozen_weights

    target, draft = make_pair(seed=35, noise=0.3)
    ids = random_prompts([6], 64, 8)[0][None]
    w = target.lm_head.weight
    with frozen_weights(target, draft):
        for _ in range(5):
            autoregressive_generate(target, ids, max_new_tokens=8)
            w.data = -w.data
            w.data = w.data.clone()
            got = speculative_generate(target, draft, ids, max_new_tokens=8, num_draft_tokens=3).sequences
            assert torch.equal(got, hf_greedy(target, ids, torch.ones_like(ids), 8))
            assert torch.equal(autoregressive_generate(target, ids, max_new_tokens=8).sequences, got)


def test_frozen_weights_refuses_a_non_model_and_registers_nothing():
    import decode.fast_weights as fl
    from decode import frozen_weights

    model = _llama(seed=4)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        with frozen_weights(model, None):
            pass
    assert model not in fl._frozen and model not in fl._frozen_plans


@pytest.fixture
def row_layout():
    """Set decode.fast_llama's several-row layout for one test; back to ``auto`` after it."""
    import decode.fast_llama as fl

    yield fl.set_row_layout
    fl.set_row_layout("auto")


@pytest.mark.parametrize("layout", ["weight_left", "activation_left"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_both_row_layouts_give_the_hf_logits_and_the_same_greedy_decoding(row_layout, layout, family):
    """Whichever layout several-row products use (the measured choice differs between machines), the lean forward's
    block logits are the Hugging Face forward's to fp32 rounding (fused q/k/v and gate/up, biases, Gemma's head
    soft-cap included), and chain and tree speculative greedy decoding equal target-only greedy decoding."""
    from tinymodels import tiny_family

    from decode import TokenTree

    row_layout(layout)
    model = (_llama(seed=3, num_key_value_heads=2) if family == "llama" else
             tiny_family(family, vocab_size=80, hidden_size=48, num_heads=6, num_kv_heads=3, seed=4))
    ids, mask = left_pad(random_prompts([9, 4, 7], 64, seed=2))
    with torch.inference_mode():
        state = FastKVState(model, 3, torch.device("cpu"), packed=True)
        assert (state.rows_w is not None) == (layout == "weight_left")  # the set layout is the one used
        got = state.forward(ids, mask, logits_to_keep=0)
    assert (got - _hf_logits(model, ids, mask))[mask.bool()].abs().max().item() < 1e-4
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    prompt = random_prompts([6], 64, seed=5)[0][None]
    ref = autoregressive_generate(model, prompt, max_new_tokens=16).sequences
    for kw in ({"num_draft_tokens": 4}, {"draft_tree": TokenTree(branching=(2, 2, 1))}):
        assert torch.equal(speculative_generate(model, draft, prompt, max_new_tokens=16, **kw).sequences, ref), kw


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_one_row_forwards_in_the_weight_left_form_give_the_hf_logits_and_target_only_greedy(monkeypatch, family):
    """Where ``auto`` measures the weight-left form faster for one row (a one-row product multiplied as two, beside a
    zero row: the AMD EPYC), one-token forwards use it: their logits are the Hugging Face forward's to fp32
    rounding, step by step (biases, post-norms and Gemma's soft-cap included), and speculative greedy decoding still
    equals target-only greedy decoding."""
    import decode.fast_settings as fs
    from tinymodels import tiny_family

    monkeypatch.setattr(fs.SETTINGS, "row_layout", "auto")
    monkeypatch.setattr(fs.SETTINGS, "one_row_measured", {})
    monkeypatch.setattr(fs, "_measure_one_row", lambda pairs, threads, rounds=7: ("weight_left", {}))
    model = (_llama(seed=12, num_key_value_heads=2) if family == "llama" else
             tiny_family(family, vocab_size=80, hidden_size=48, num_heads=6, num_kv_heads=3, seed=4))
    ids = random_prompts([10], 80, 13)[0][None]
    with torch.inference_mode():
        state = FastKVState(model, 1, torch.device("cpu"), packed=True)
        assert state.rows_one is not None  # the measured one-row layout is the one used
        steps = torch.cat([state.forward(ids[:, j:j + 1]) for j in range(ids.shape[1])], 1)
    torch.testing.assert_close(steps, _hf_logits(model, ids, torch.ones_like(ids)), atol=1e-4, rtol=1e-4)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ref = hf_greedy(model, ids, torch.ones_like(ids), 12)
    assert torch.equal(autoregressive_generate(model, ids, max_new_tokens=12).sequences, ref)
    for g in (1, 3):
        assert torch.equal(speculative_generate(model, draft, ids, max_new_tokens=12, num_draft_tokens=g).sequences,
                           ref)


def test_auto_row_layout_is_measured_once_per_shape_and_thread_count(row_layout, monkeypatch):
    """``auto`` times the two forms on the model's own projections (one layer's four and the head) and keeps the
    faster, once per shapes / dtype / threads (recorded for reports); a set layout measures nothing; anything else
    is refused with the accepted values."""
    import decode.fast_settings as fl

    calls = []
    real = fl._measure_row_layout

    def spy(pairs, threads, rounds=9):
        calls.append(([tuple(w.shape) for w, _ in pairs], threads))
        return real(pairs, threads, rounds=3)

    monkeypatch.setattr(fl, "_measure_row_layout", spy)
    monkeypatch.setattr(fl.SETTINGS, "row_layout_measured", {})
    model = _llama(seed=5)
    with torch.inference_mode():
        states = [FastKVState(model, 1, torch.device("cpu"), packed=True) for _ in range(3)]
    assert len(calls) == 1  # measured once for these shapes and threads
    shapes, threads = calls[0]
    assert shapes == [(48, 144), (48, 48), (48, 192), (96, 48), (48, 80)]  # (in, out): qkv, o, gate-up, down, head
    record = fl.row_layout_record()
    assert record["setting"] == "auto" and len(record["measured"]) == 1
    m = record["measured"][0]
    faster = "weight_left" if m["weight_left_us"] < m["activation_left_us"] else "activation_left"
    assert m["chosen"] == faster and m["threads"] == threads
    assert all((s.rows_w is not None) == (faster == "weight_left") for s in states)
    row_layout("activation_left")
    monkeypatch.setattr(fl.SETTINGS, "row_layout_measured", {})
    with torch.inference_mode():
        FastKVState(_llama(seed=6, hidden_size=60, intermediate_size=128), 1, torch.device("cpu"), packed=True)
    assert len(calls) == 1  # a set layout: nothing measured
    with pytest.raises(ValueError, match="row layout must be one of auto, weight_left, activation_left"):
        fl.set_row_layout("columns")
