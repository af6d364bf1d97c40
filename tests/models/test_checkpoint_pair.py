"""models.checkpoints.load_target_and_draft (the scripts' loader) on tiny saved models with tokenizers trained in the
test: what loads, and the one-line errors for a missing directory, a draft whose tokenizer differs, a draft with too
few vocabulary rows; and the two scripts that use it (bench_decode.py, tree_bound.py) failing with those messages."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from models.checkpoints import load_target_and_draft
from core.errors import CheckpointError
from core.errors import TokenizerMismatchError

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")


def _save(path: Path, vocab: int, tok=None, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tok_a = _tokenizer(["the patient was given aspirin and the pain went away"] * 3)
    tok_b = _tokenizer(["import numpy as np; np.zeros((3, 3)) is a matrix of zeros"] * 3)
    n = len(tok_a)
    out = {
        "target": _save(root / "target", n, tok_a),
        "draft": _save(root / "draft", n, tok_a, seed=1),
        "draft_no_tok": _save(root / "draft_no_tok", n, seed=2),
        "draft_other_tok": _save(root / "draft_other_tok", max(n, len(tok_b)), tok_b, seed=3),
        "draft_small": _save(root / "draft_small", n - 10, seed=4),
        "draft_bad_config": _save(root / "draft_bad_config", n, tok_a, seed=5),
    }
    (out["draft_bad_config"] / "config.json").write_text('{"model_type": "llama", ')  # a save cut short
    return out


def test_loads_a_pair_and_a_draft_without_tokenizer_files(dirs):
    target, draft, tok = load_target_and_draft(dirs["target"], dirs["draft"])
    assert tok is not None and not target.training and not draft.training
    _, draft2, tok2 = load_target_and_draft(dirs["target"], dirs["draft_no_tok"])
    assert len(tok2) == len(tok) and draft2.config.vocab_size == len(tok)
    _, _, none = load_target_and_draft(dirs["draft_no_tok"], dirs["draft"], need_tokenizer=False)
    assert none is None  # a target without tokenizer files, allowed: no tokenizer (the draft's is not borrowed) ...
    with pytest.raises(CheckpointError, match="tokenizer files"):  # ... unless one is needed
        load_target_and_draft(dirs["draft_no_tok"], dirs["draft"])


@pytest.mark.parametrize("target,draft,error,needles", [
    ("missing", "draft", CheckpointError, ("--target", "does not exist")),
    ("target", "missing", CheckpointError, ("--draft", "does not exist")),
    ("target", "draft_other_tok", TokenizerMismatchError, ("--draft", "vocab")),
    ("target", "draft_small", CheckpointError, ("--draft", "output embedding rows", "resize_token_embeddings")),
    ("target", "draft_bad_config", CheckpointError, ("--draft", "config.json is not valid JSON")),
])
def test_errors_name_the_flag_and_the_fix(dirs, tmp_path, target, draft, error, needles):
    path = {**dirs, "missing": tmp_path / "nope"}
    with pytest.raises(error) as e:
        load_target_and_draft(path[target], path[draft])
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_a_missing_model_folder_names_the_folders_beside_it_and_the_closest(dirs):
    """A mistyped draft folder (``drafts/distilled_int8`` where only ``drafts/distilled`` was written): the error lists
    the model folders beside the missing one and names the closest; a folder with no models beside it says neither."""
    from models.checkpoints import check_checkpoint_dir

    parent = dirs["draft"].parent
    with pytest.raises(CheckpointError) as e:
        check_checkpoint_dir(parent / f"{dirs['draft'].name}_int8", role="draft 'd'")
    msg = str(e.value)
    assert f"{parent} holds " in msg and dirs["target"].name in msg, msg
    assert "did you mean " in msg and f" {dirs['draft']}?" in msg, msg  # (draft_no_tok is as close)
    with pytest.raises(CheckpointError) as e:
        check_checkpoint_dir(dirs["draft"] / "nope" / "deeper", role="draft 'd'")
    assert "holds" not in str(e.value) and "did you mean" not in str(e.value)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script", ["bench_decode", "tree_bound"])
def test_scripts_fail_in_one_line_on_a_bad_pair(dirs, tmp_path, capsys, script):
    """A missing directory is a usage error before anything loads (exit 2); differing tokenizers stop the run with
    the checker's message (not a traceback)."""
    mod = _script(script)
    with pytest.raises(SystemExit) as e:
        mod.main(["--target", str(tmp_path / "nope"), "--draft", str(dirs["draft"])])
    assert e.value.code == 2 and "--target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        mod.main(["--target", str(dirs["target"]), "--draft", str(dirs["draft_other_tok"])])
    assert str(e.value).startswith("error: ") and "tokenizer" in str(e.value) and "--draft" in str(e.value)
