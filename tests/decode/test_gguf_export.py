"""GGUF export (decode/llamacpp.py): round trips through transformers' own GGUF reader, the target's tokenizer
carried over key for key, llama.cpp's vocabulary checks, and every draft kind (full head, trimmed head, tied
embeddings, grouped-query attention, Qwen2's biases)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from models.target import TargetConfig
from models.target import prepare_target
from decode.llamacpp import _permute, export_gguf, export_once, gguf_tokenizer_matches, source_gguf, target_gguf, vocab_compatibility, vocab_summary
from core.errors import GGUFExportError
from ggufwriter import write_tiny_llama_gguf
from tinymodels import tiny_family_lm

TEXT = "abc cab, bad?\nface"


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """(HF folder of a converted tiny GGUF target, its source GGUF file): the path target=smollm2 takes."""
    pkg = tmp_path / "site" / "tinyexportpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    write_tiny_llama_gguf(pkg / "tiny.gguf", seed=3)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    out = prepare_target(TargetConfig(name_or_path=str(tmp_path / "cache" / "tiny"), gguf_package="tinyexportpkg",
                                      gguf_file="tiny.gguf"))
    return Path(out), pkg / "tiny.gguf"


def _gguf_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_f32_round_trip_gives_the_same_logits_and_the_targets_tokenizer(tmp_path, converted):
    from models.checkpoints import load_causal_lm

    folder, source = converted
    res = export_gguf(folder, tmp_path / "t.gguf", outtype="f32", tokenizer_gguf=source)
    assert res.path.is_file() and res.arch == "llama" and res.tokenizer_from == "gguf:tiny.gguf"
    assert gguf_tokenizer_matches(res.path, source) == []
    assert vocab_compatibility(source, res.path) == []
    model, tok = load_causal_lm(folder, role="target")
    back, back_tok = _gguf_model(res.path)
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    assert back_tok(TEXT, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    assert torch.equal(_logits(back, ids), _logits(model, ids))  # q/k rows permuted there and back exactly
    msgs = [{"role": "user", "content": "abc"}]
    assert back_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_q8_0_and_f16_round_trips_are_close_and_smaller(tmp_path, converted):
    from models.checkpoints import load_causal_lm

    folder, source = converted
    model, tok = load_causal_lm(folder, role="target")
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    ref = _logits(model, ids)
    sizes = {}
    for outtype, tol in (("f32", 0.0), ("f16", 2e-2), ("q8_0", 5e-2)):
        res = export_gguf(folder, tmp_path / f"{outtype}.gguf", outtype=outtype, tokenizer_gguf=source)
        sizes[outtype] = res.size_bytes
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(res.path)).tensors}
        assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32  # norms stay float32
        want = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
                "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
        assert types["blk.0.attn_q.weight"] == want
        diff = (_logits(_gguf_model(res.path)[0], ids) - ref).abs().max().item()
        assert diff <= tol * ref.abs().max().item() + 1e-6, (outtype, diff)
    assert sizes["q8_0"] < sizes["f16"] < sizes["f32"]


def test_trimmed_head_draft_exports_its_full_vocabulary_form(tmp_path, converted):
    """A trimmed-head draft is saved with zero rows outside its kept ids: the GGUF keeps the full vocabulary (what
    llama.cpp's vocabulary check needs) and gives exactly the saved logits."""
    from models.checkpoints import load_causal_lm
    from models.vocab import full_vocab_head, install_trimmed_head
    from models.checkpoints import save_hf_atomic

    folder, source = converted
    draft, tok = load_causal_lm(folder, role="draft")
    kept = torch.tensor(sorted({0, 1, 2, *range(5, 40, 3)}))
    install_trimmed_head(draft, kept)
    save_hf_atomic(draft, tok, tmp_path / "trimmed")
    res = export_gguf(tmp_path / "trimmed", tmp_path / "trimmed.gguf", tokenizer_gguf=source)
    assert vocab_compatibility(source, res.path) == []
    back, _ = _gguf_model(res.path)
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    with full_vocab_head(draft):
        want = _logits(draft, ids)
    got = _logits(back, ids)
    assert torch.equal(got, want)
    outside = torch.ones(got.size(-1), dtype=torch.bool)
    outside[kept] = False
    assert torch.all(got[..., outside] == 0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_families_with_a_tokenizer_json_round_trip(tmp_path, family):
    """Without the target's GGUF file the byte-level BPE of tokenizer.json is written (gpt2 model), and the
    family's tensors (Qwen2's q/k/v biases, tied or untied heads) come back with the same logits."""
    from transformers import AutoTokenizer

    tok_src = tmp_path / "tok"
    _byte_level_tokenizer(tok_src)
    tok = AutoTokenizer.from_pretrained(tok_src)
    model = tiny_family_lm(family, vocab_size=len(tok), seed=1)
    model.save_pretrained(tmp_path / family)
    tok.save_pretrained(tmp_path / family)
    res = export_gguf(tmp_path / family, tmp_path / f"{family}.gguf", name="tiny")  # transformers reads a
    # "mistral" in general.name as its own model type
    assert res.tokenizer_from == "tokenizer.json"
    summary = vocab_summary(res.path)
    assert summary["model"] == "gpt2" and summary["n_tokens"] == len(tok)
    back, back_tok = _gguf_model(res.path)
    ids = tok("hello world, bye", return_tensors="pt")["input_ids"]
    assert back_tok("hello world, bye", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    torch.testing.assert_close(_logits(back, ids), _logits(model, ids), rtol=0, atol=1e-5)


def _byte_level_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["hello world, bye world. hello again!"] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.save_pretrained(out)


def test_vocabulary_checks_follow_llama_cpps_rules(tmp_path, converted):
    folder, source = converted
    ok = export_gguf(folder, tmp_path / "ok.gguf", tokenizer_gguf=source).path
    assert vocab_compatibility(source, ok) == []
    r = gguf.GGUFReader(str(source))
    tokens = list(r.fields["tokenizer.ggml.tokens"].contents())

    def variant(name, **change):
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        for k, f in r.fields.items():
            if not k.startswith("tokenizer."):
                continue
            val = change.get(k, f.contents())
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(k, val, f.types[0], sub_type=sub)
        w.add_tensor("x", np.zeros(4, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    renamed = list(tokens)
    renamed[7] = renamed[7] + "x"
    assert "token 7 differs" in vocab_compatibility(source, variant("a.gguf", **{"tokenizer.ggml.tokens": renamed}))[0]
    early = list(tokens)
    early[3] = "zz"  # ids below 5 are not compared (llama.cpp: SPEC_VOCAB_CHECK_START_TOKEN_ID)
    assert vocab_compatibility(source, variant("b.gguf", **{"tokenizer.ggml.tokens": early})) == []
    longer = tokens + [f"x{i}" for i in range(129)]
    assert "sizes differ by more than 128" in vocab_compatibility(source, variant(
        "c.gguf", **{"tokenizer.ggml.tokens": longer, "tokenizer.ggml.token_type": [1] * len(longer)}))[0]
    fine = tokens + [f"x{i}" for i in range(128)]
    assert vocab_compatibility(source, variant(
        "d.gguf", **{"tokenizer.ggml.tokens": fine, "tokenizer.ggml.token_type": [1] * len(fine)})) == []
    assert "vocabulary type" in vocab_compatibility(source, variant("e.gguf", **{"tokenizer.ggml.model": "llama"}))[0]
    assert gguf_tokenizer_matches(variant("f.gguf", **{"tokenizer.ggml.model": "llama"}), source) == \
        ["tokenizer.ggml.model"]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 5))
def test_permutation_is_a_per_head_bijection(n_head, half, cols):
    """The HF -> llama.cpp rotary row order is a permutation inside each head (so q.k products are preserved when
    both sides use the same order), and pairs row i of a head's first half with row i of its second half."""
    d = 2 * half
    w = np.arange(n_head * d * cols, dtype=np.float32).reshape(n_head * d, cols)
    p = _permute(w, n_head)
    for h in range(n_head):
        head, out = w[h * d:(h + 1) * d], p[h * d:(h + 1) * d]
        assert sorted(map(tuple, head)) == sorted(map(tuple, out))
        for i in range(half):
            assert np.array_equal(out[2 * i], head[i]) and np.array_equal(out[2 * i + 1], head[half + i])


def test_export_errors_name_the_fix(tmp_path, converted):
    folder, source = converted
    with pytest.raises(GGUFExportError, match="outtype"):
        export_gguf(folder, tmp_path / "x.gguf", outtype="q4_0")
    with pytest.raises(GGUFExportError, match="config.json"):
        export_gguf(tmp_path, tmp_path / "x.gguf")
    gpt2 = tiny_family_lm("gpt2", vocab_size=64)
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(GGUFExportError, match="convert_hf_to_gguf"):
        export_gguf(tmp_path / "gpt2", tmp_path / "x.gguf")
    assert not list(tmp_path.glob(".x.gguf.tmp*")) and not (tmp_path / "x.gguf").exists()


def test_source_file_and_export_once(tmp_path, converted):
    folder, source = converted
    assert source_gguf(folder) == source
    assert target_gguf(folder, "source", tmp_path) == (source, "the target's own file tiny.gguf")
    out, what = target_gguf(folder, "q8_0", tmp_path)
    assert out.name.startswith("target-") and out.name.endswith("-q8_0.gguf") and "q8_0" in what
    mtime = out.stat().st_mtime_ns
    assert export_once(folder, out, "q8_0", source) == out and out.stat().st_mtime_ns == mtime  # reused
    (folder / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text())))
    export_once(folder, out, "q8_0", source)
    assert out.stat().st_mtime_ns >= mtime  # the checkpoint was saved again: exported again


def test_refusals_rope_scaling_wrong_vocabulary_and_shared_store_names(tmp_path, converted):
    """Rope scaling (transformers 5 writes it to rope_parameters) is refused, not dropped; a checkpoint whose
    vocabulary rows differ from the copied tokenizer's tokens is refused (llama.cpp would not load it); two targets
    exported into one store get different files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decode.llamacpp import target_export_name

    folder, source = converted
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "scaled")
    with pytest.raises(GGUFExportError, match="rope_scaling 'linear'"):
        export_gguf(tmp_path / "scaled", tmp_path / "s.gguf", tokenizer_gguf=source)
    small = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    LlamaForCausalLM(small).save_pretrained(tmp_path / "small")
    with pytest.raises(GGUFExportError, match="40 vocabulary rows but tiny.gguf has 64 tokens"):
        export_gguf(tmp_path / "small", tmp_path / "v.gguf", tokenizer_gguf=source)
    with pytest.raises(GGUFExportError, match="is a folder"):
        export_gguf(folder, tmp_path, tokenizer_gguf=source)
    assert target_export_name(folder, "q8_0") != target_export_name(tmp_path / "small", "q8_0")
    assert target_export_name(folder, "q8_0") != target_export_name(folder, "f32")
