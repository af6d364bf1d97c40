"""Speculative decoding on the real target SmolLM2-135M-Instruct (30 layers, grouped-query attention, vocabulary
49,152, ChatML): greedy output equals the target's own, for a layer-pruned self-draft, several gammas, one prompt and
a left-padded batch of chat-templated medical questions."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

QUESTIONS = ["What are the symptoms of anemia?", "How is high blood pressure treated?",
             "What causes migraines and how can they be prevented?"]


@pytest.fixture(scope="module")
def pair(smollm2):
    from distill.drafts import build_layer_pruned

    target, tok = smollm2
    return target, build_layer_pruned(target, [0, 12]), tok


def _prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_speculative_greedy_equals_target_greedy_batch_1_and_padded_3(pair, gamma):
    from decode import autoregressive_generate, speculative_generate
    from decode.fast_llama import frozen_weights

    target, draft, tok = pair
    texts = _prompts(tok)
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    assert batch["attention_mask"].min() == 0  # the batch really is left padded
    single = tok(texts[:1], return_tensors="pt")
    with frozen_weights(target, draft):
        for enc in (single, batch):
            ref = autoregressive_generate(target, enc["input_ids"], enc["attention_mask"], max_new_tokens=16)
            out = speculative_generate(target, draft, enc["input_ids"], enc["attention_mask"], max_new_tokens=16,
                                       num_draft_tokens=gamma)
            assert torch.equal(out.sequences, ref.sequences)
            assert torch.equal(out.num_new_tokens, ref.num_new_tokens)
    answer = tok.decode(ref.sequences[0, batch["input_ids"].size(1):], skip_special_tokens=True)
    assert len(answer.split()) >= 5  # a real answer, not an immediate end of turn


def test_decoding_stops_at_the_targets_end_of_turn_by_default(pair):
    """No eos_token_id given: the decoders stop at <|im_end|> (the target's generation config), as generate does."""
    from decode import autoregressive_generate

    target, _, tok = pair
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}],
                                      tokenize=False, add_generation_prompt=True), return_tensors="pt")["input_ids"]
    out = autoregressive_generate(target, ids, max_new_tokens=40)
    n = int(out.num_new_tokens[0])
    assert n < 40 and int(out.sequences[0, ids.size(1) + n - 1]) == tok.convert_tokens_to_ids("<|im_end|>")
    full = autoregressive_generate(target, ids, max_new_tokens=40, eos_token_id=[])
    assert int(full.num_new_tokens[0]) == 40


def test_a_saved_self_draft_loads_with_auto_class_and_assists_generate(pair, tmp_path):
    """A draft folder the pipeline writes (save_hf_atomic: safetensors + tokenizer + specdraft.json) loads with
    AutoModelForCausalLM and serves as transformers' assistant_model for the converted target, greedy output equal
    to the target's own."""
    from transformers import AutoModelForCausalLM

    from models.checkpoints import save_hf_atomic

    target, draft, tok = pair
    save_hf_atomic(draft, tok, tmp_path / "draft", extra={"kind": "layer_pruned"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    ids = tok(_prompts(tok)[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = target.generate(ids, do_sample=False, max_new_tokens=12)
        assisted = target.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=12)
    assert torch.equal(plain, assisted)
