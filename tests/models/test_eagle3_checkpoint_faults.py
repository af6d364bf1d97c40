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
    cfg.write_text(json.dumps(doc))


@pytest.mark.parametrize("how, says", [
    ("truncated", "model.safetensors cannot be read"),
    ("config_width", "config.json disagrees with the weights"),
    ("layers_disagree", "disagree"),
    ("two_layers", "num_hidden_layers is 2"),
    ("nan", "non-finite"),
    ("no_tokenizer", "tokenizer.json is missing"),
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
