"""models.vocab on tiny byte-level BPE tokenizers trained in the test (no downloads)."""
from __future__ import annotations

import itertools
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from models.vocab import check_tokenizers_compatible, tokenizer_fingerprint
from core.errors import TokenizerMismatchError

TEXT_A = [
    "the patient was given aspirin and the pain went away",
    "the quick brown fox jumps over the lazy dog",
    "def main(): return the answer",
] * 3
TEXT_B = [
    "import numpy as np; np.zeros((3, 3)) is a matrix of zeros",
    "medical records mention hypertension and diabetes often",
] * 3
SPECIALS = ["<|bos|>", "<|eos|>", "<|end|>"]


def _train(texts, vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _wrap(tok: Tokenizer, eos: str = "<|eos|>", **kw) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token=eos, **kw)


def _swap_independent_merges(tok: Tokenizer) -> tuple[Tokenizer, int]:
    """Same vocabulary, different merge order: swap two adjacent merges that do not build on each other."""
    data = json.loads(tok.to_str())
    merges = data["model"]["merges"]
    as_pair = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    for i in range(len(as_pair) - 2, -1, -1):
        (a1, b1), (a2, b2) = as_pair[i], as_pair[i + 1]
        if a1 + b1 not in (a2, b2) and (a1, b1) != (a2, b2):
            merges[i], merges[i + 1] = merges[i + 1], merges[i]
            return Tokenizer.from_str(json.dumps(data)), i
    raise AssertionError("no independent adjacent merges")


@pytest.fixture(scope="module")
def toks():
    base = _train(TEXT_A)
    swapped, index = _swap_independent_merges(_train(TEXT_A))
    return {
        "a": _wrap(base),
        "a_retrained": _wrap(_train(TEXT_A)),
        "b": _wrap(_train(TEXT_B)),
        "eos_end": _wrap(_train(TEXT_A), eos="<|end|>"),
        "merges_swapped": _wrap(swapped),
        "with_pad": _wrap(_train(TEXT_A), pad_token="<|end|>"),
        "_swap_index": index,
    }


def _message(target, draft, **kw) -> str:
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizers_compatible(target, draft, **kw)
    assert isinstance(err.value, ValueError)
    msg = str(err.value)
    assert "the draft must use the target's tokenizer" in msg and "save_pretrained" in msg
    return msg


def test_identical_tokenizers_pass(toks, tmp_path):
    check_tokenizers_compatible(toks["a"], toks["a"])
    check_tokenizers_compatible(toks["a"], toks["a_retrained"])
    # The documented fix works: save the target's tokenizer into the draft directory and load it from there.
    toks["a"].save_pretrained(tmp_path)
    check_tokenizers_compatible(toks["a"], AutoTokenizer.from_pretrained(tmp_path))


def test_different_vocabulary(toks):
    msg = _message(toks["a"], toks["b"], target_name="tgt-dir", draft_name="drf-dir")
    assert "vocabulary differs" in msg
    assert f"tgt-dir has {len(toks['a'])} tokens" in msg and f"drf-dir has {len(toks['b'])}" in msg
    assert "missing from drf-dir" in msg or "different ids" in msg
    assert "tgt-dir" in msg and "drf-dir" in msg


def test_same_vocab_different_eos(toks):
    assert toks["a"].get_vocab() == toks["eos_end"].get_vocab()
    msg = _message(toks["a"], toks["eos_end"])
    assert "vocabulary differs" not in msg and "merges differ" not in msg
    eos_a, eos_b = toks["a"].eos_token_id, toks["eos_end"].eos_token_id
    assert eos_a != eos_b
    assert f"eos_token differs: target '<|eos|>' (id {eos_a}) vs draft '<|end|>' (id {eos_b})" in msg


def test_pad_token_set_on_one_side_only(toks):
    msg = _message(toks["a"], toks["with_pad"])
    assert "pad_token differs: target not set vs draft '<|end|>'" in msg


def test_different_merges_same_vocab(toks):
    a, m = toks["a"], toks["merges_swapped"]
    assert a.get_vocab() == m.get_vocab()
    msg = _message(a, m)
    assert "vocabulary differs" not in msg
    assert "BPE merges differ" in msg and f"first difference at merge index {toks['_swap_index']}" in msg


def test_fingerprint_equal_iff_compatible(toks):
    names = [n for n in toks if not n.startswith("_")]
    for x, y in itertools.product(names, repeat=2):
        try:
            check_tokenizers_compatible(toks[x], toks[y])
            compatible = True
        except TokenizerMismatchError:
            compatible = False
        same = tokenizer_fingerprint(toks[x]) == tokenizer_fingerprint(toks[y])
        assert same == compatible, (x, y)
        assert compatible == (x == y or {x, y} == {"a", "a_retrained"}), (x, y)
    fp = tokenizer_fingerprint(toks["a"])
    assert len(fp) == 64 and int(fp, 16) >= 0
