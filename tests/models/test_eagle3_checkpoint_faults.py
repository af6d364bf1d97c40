"""A damaged EAGLE-3 head folder is refused with one clear error that names the draft, the folder and the fix
(models/eagle3.py ``load_eagle3``, decode/fast_settings.py ``load_draft``): a truncated weights file, a config.json
that disagrees with the weights or with itself, NaN weights, no tokenizer. An intact copy of the same folder loads."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tinymodels import tiny_llama


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    from data.text import train_bpe_tokenizer
    from models.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3

    text = ["Question: what is a fever? Answer: a raised body temperature.", "def f(x):\n    return x + 1"] * 20
    tok = train_bpe_tokenizer(iter(text), vocab_size=120, min_frequency=1)
    target = tiny_llama(vocab_size=len(tok), num_layers=6, seed=3)
    head = Eagle3Draft(Eagle3Config.from_target(target.config, 32))
    head.init_from_target(target, torch.arange(32), how="target")
    out = tmp_path_factory.mktemp("heads") / "head"
    save_eagle3(head, tok, out, meta={"kind": "distilled", "init": "eagle3"})
    return out


def _damage(src, dst, how: str):
    shutil.copytree(src, dst)
    weights, cfg = dst / "model.safetensors", dst / "config.json"
    doc = json.loads(cfg.read_text())
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "config_width":
        doc["intermediate_size"] += 8
    elif how == "layers_disagree":
        doc["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    elif how == "two_layers":
        doc["num_hidden_layers"] = 2
    elif how == "nan":
        from safetensors.torch import load_file, save_file

        state = load_file(str(weights))
        state["fc.weight"][0, 0] = float("nan")
        save_file(state, str(weights))
    elif how == "no_tokenizer":  # tokenizer_config.json stays: transformers then fails in six lines
        (dst / "tokenizer.json").unlink()
    elif how == "meta_not_json":
        (dst / "specdraft.json").write_text("{not json")
    elif how in CONFIG_EDITS:
        key, value = CONFIG_EDITS[how]
        if key is None:
            doc = value
        elif key == "layers":
            doc["eagle_aux_hidden_state_layer_ids"] = doc["specdraft_eagle3"]["target_layers"] = value
        else:
            doc[key] = value
    elif how in TENSOR_EDITS:
        from safetensors.torch import load_file, save_file

        state = load_file(str(weights))
        TENSOR_EDITS[how](state)
        save_file(state, str(weights))
    cfg.write_text(json.dumps(doc))


# config.json values of the wrong type or range: each would otherwise be a traceback, a silently different head, or
# (checked after the tokenizer) a tokenizer error
CONFIG_EDITS = {
    "architectures_null": ("architectures", None),
    "kv_heads_0": ("num_key_value_heads", 0),
    "intermediate_huge": ("intermediate_size", 10 ** 9),  # below the bound: the weights header disagrees
    "own_section_not_an_object": ("specdraft_eagle3", "x"),
    "rope_theta_string": ("rope_theta", "10000"),
    "layer_negative": ("layers", [-1, 2, 4]),
    "layer_zero": ("layers", [0, 2, 4]),
    "layer_float": ("layers", [1.5, 2, 4]),
    "layers_not_a_list": ("layers", 3),
    "eps_nan": ("rms_norm_eps", float("nan")),
    "eps_negative": ("rms_norm_eps", -1e-5),
    "act_bogus": ("hidden_act", "bogus"),
    "vocab_size_string": ("vocab_size", "120"),
    "config_a_list": (None, [1, 2]),
    "layers_past_target": ("layers", [1, 3, 9]),
    "head_dim_huge": ("head_dim", 10 ** 20),
    "head_dim_0": ("head_dim", 0),
    "layers_string": ("num_hidden_layers", "1"),
    "sglang_section_not_an_object": ("eagle_config", "x"),
    "attention_bias": ("attention_bias", True),
    "tied_output": ("tie_word_embeddings", True),
    "model_type_gpt2": ("model_type", "gpt2"),
    "scaled_rope": ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    "vocab_below_draft_vocab": ("vocab_size", 20),
}


def _shift_d2t(state):
    state["d2t"][0] -= 5  # draft id 0 -> target id -5


def _repeat_d2t(state):
    state["d2t"][1] -= 1  # draft ids 0 and 1 -> target id 0


def _int_weights(state):
    state["fc.weight"] = state["fc.weight"].to(torch.int32)


TENSOR_EDITS = {"d2t_below_0": _shift_d2t, "d2t_repeated": _repeat_d2t, "int32_weights": _int_weights}


@pytest.mark.parametrize("how, says", [
    ("truncated", "model.safetensors cannot be read"),
    ("config_width", "config.json disagrees with the weights"),
    ("layers_disagree", "disagree"),
    ("two_layers", "num_hidden_layers is 2"),
    ("nan", "non-finite"),
    ("no_tokenizer", "tokenizer.json is missing"),
    ("architectures_null", "architectures is None"),
    ("kv_heads_0", "num_key_value_heads must be a positive integer below 2**31 (got 0)"),
    ("intermediate_huge", "config.json disagrees with the weights"),
    ("own_section_not_an_object", "specdraft_eagle3 must be a JSON object"),
    ("rope_theta_string", "rope_theta must be a positive finite number (got '10000')"),
    ("layer_negative", "integers >= 1 (got [-1, 2, 4])"),
    ("layer_zero", "integers >= 1"),
    ("layer_float", "integers >= 1"),
    ("layers_not_a_list", "integers >= 1 (got 3)"),
    ("eps_nan", "rms_norm_eps must be a positive finite number (got nan)"),
    ("eps_negative", "rms_norm_eps must be a positive finite number"),
    ("act_bogus", "hidden_act 'bogus'"),
    ("vocab_size_string", "vocab_size must be a positive integer below 2**31 (got '120')"),
    ("config_a_list", "config.json holds a JSON list"),
    ("head_dim_huge", "head_dim must be a positive integer below 2**31"),
    ("head_dim_0", "head_dim must be a positive integer below 2**31 (got 0)"),
    ("layers_string", "num_hidden_layers is '1'; an EAGLE-3 head here has one layer: it must be 1"),
    ("sglang_section_not_an_object", "eagle_config must be a JSON object"),
    ("attention_bias", "attention_bias is True"),
    ("tied_output", "tie_word_embeddings is True"),
    ("model_type_gpt2", "model_type is 'gpt2'"),
    ("scaled_rope", "scaled RoPE is not supported"),
    ("vocab_below_draft_vocab", "draft_vocab_size 32 is larger than vocab_size 20: one of the two is wrong"),
    ("d2t_below_0", "1 draft ids map outside the target vocabulary"),
    ("d2t_repeated", "1 target ids are reached by two draft ids"),
    ("int32_weights", "fc.weight I32"),
])
def test_a_damaged_head_is_one_clear_error(head_dir, tmp_path, how, says):
    from decode.fast_settings import load_draft
    from models.checkpoints import CheckpointError

    bad = tmp_path / how
    _damage(head_dir, bad, how)
    with pytest.raises(CheckpointError) as ei:
        load_draft(bad, role="draft 'h'")
    msg = str(ei.value)
    assert str(bad) in msg and "draft 'h'" in msg and says in msg, msg
    assert len(msg.splitlines()) <= 2, msg  # one error, not a traceback's worth


def test_the_intact_head_loads(head_dir, tmp_path):
    from decode.fast_settings import load_draft

    shutil.copytree(head_dir, tmp_path / "ok")
    head, tok, meta = load_draft(tmp_path / "ok", role="draft 'h'")
    assert head.cfg.draft_vocab_size == 32 and tok is not None and meta.init == "eagle3"


@pytest.mark.parametrize("how, says", [("vocab_size_string", "vocab_size must be a positive integer"),
                                       ("config_a_list", "config.json holds a JSON list"),
                                       ("intermediate_huge", "config.json disagrees with the weights"),
                                       ("d2t_below_0", "its d2t is damaged"),
                                       ("layers_past_target", "reads target layers [1, 3, 9], but this target has 6 layers (feature layers are in [1, 5])"),
                                       ("meta_not_json", "specdraft.json is not valid JSON"),
                                       ("hybrid_of_the_head", "needs a trained token draft behind the lookup")])
def test_python_m_eval_names_the_heads_config_fault_not_the_tokenizer(head_dir, tmp_path, how, says):
    """``python -m eval`` with a head whose config.json is damaged: the eval inputs check names the fault (before the
    target's tokenizer is compared with the head's), exit 2, no traceback, no report."""
    import subprocess
    import sys

    from pathlib import Path

    from clierrors import assert_clean_error, cli_env
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(head_dir))
    target_dir = tmp_path / "target"
    tiny_llama(vocab_size=len(tok), num_layers=6, seed=3).save_pretrained(str(target_dir))  # the head's target
    tok.save_pretrained(str(target_dir))
    bad = tmp_path / how
    _damage(head_dir, bad, how)  # hybrid_of_the_head: an intact head behind a lookup (ngram:suffix+<head>)
    run_dir = tmp_path / "run"
    spec = f"'ngram:suffix+{bad}'" if how == "hybrid_of_the_head" else bad
    proc = subprocess.run([sys.executable, "-m", "eval", f"target.name_or_path={target_dir}",
                           f"eval.drafts={{h: {spec}}}", "eval.domains=[chat]", "eval.max_prompts=1",
                           f"hydra.run.dir={run_dir}"], cwd=Path(__file__).resolve().parents[2], env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    err = assert_clean_error(proc, 2, says, str(bad))
    assert "tokenizer" not in err.lower(), err
    assert not run_dir.exists()  # refused before Hydra writes anything


def test_a_head_saved_without_its_embedding_takes_the_targets(head_dir, tmp_path):
    """vLLM's heads often leave ``embed_tokens.weight`` out (it is the target's): loaded with the target, the head
    shares the target's embedding tensor; without one, the error says what is missing."""
    from safetensors.torch import load_file, save_file

    from decode.fast_settings import load_draft
    from models.checkpoints import CheckpointError
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    shutil.copytree(head_dir, bare)
    state = load_file(str(bare / "model.safetensors"))
    del state["embed_tokens.weight"]
    save_file(state, str(bare / "model.safetensors"))
    target = tiny_llama(vocab_size=len(AutoTokenizer.from_pretrained(str(head_dir))), num_layers=6, seed=3)
    head, _, _ = load_draft(bare, role="draft 'h'", target=target)
    assert head.embed_tokens.weight is target.get_input_embeddings().weight
    with pytest.raises(CheckpointError, match="no embed_tokens.weight"):
        load_draft(bare, role="draft 'h'")
