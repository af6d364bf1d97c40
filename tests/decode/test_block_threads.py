"""decode.block_threads: forwards over more than one token run with the block thread count, one-token forwards
with the caller's, the caller's setting is restored (also after an error), and decoding stays lossless."""
from __future__ import annotations

import pytest
import torch
from decode_testutils import hf_greedy, left_pad, make_pair, random_prompts

from decode import autoregressive_generate, speculative_generate
import decode.fast_settings as block
from decode.common import KVState
from decode.config import DecodeConfig
from decode.fast_llama import FastKVState


@pytest.fixture
def block_threads():
    """Set decode.block_threads for one test; the caller's thread count and the setting are restored after it."""
    prev, saved = torch.get_num_threads(), (block._setting, block._threads)
    yield block.set_block_threads
    block._setting, block._threads = saved  # as they were (available_cores may still be patched here)
    torch.set_num_threads(prev)


def _record_threads(monkeypatch, cls):
    """Wrap ``cls``'s model call so every forward records (tokens in it, torch threads during it)."""
    seen = []
    if cls is FastKVState:
        orig = FastKVState._forward

        def spy(self, tokens, *a, **k):
            seen.append((tokens.numel(), torch.get_num_threads()))
            return orig(self, tokens, *a, **k)

        monkeypatch.setattr(FastKVState, "_forward", spy)
    else:
        orig = KVState.forward

        def spy(self, tokens, *a, **k):
            model = self.model
            inner = model.forward

            def call(*args, **kw):
                seen.append((kw["input_ids"].numel(), torch.get_num_threads()))
                return inner(*args, **kw)

            model.forward = call
            try:
                return orig(self, tokens, *a, **k)
            finally:
                del model.forward

        monkeypatch.setattr(KVState, "forward", spy)
    return seen


@pytest.mark.parametrize("fast_path", [None, False])  # the lean forward and the Hugging Face forward
def test_multi_token_forwards_use_block_threads_and_one_token_forwards_the_callers(monkeypatch, block_threads,
                                                                                    fast_path):
    target, draft = make_pair(seed=3, noise=0.3)
    ids, mask = left_pad(random_prompts([7], 64, seed=2))
    ref = hf_greedy(target, ids, mask, 12)
    seen = _record_threads(monkeypatch, FastKVState if fast_path is None else KVState)
    monkeypatch.setattr(block, "available_cores", lambda: 8)  # so 3 threads are allowed on any machine
    torch.set_num_threads(1)
    block_threads(3)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=12, num_draft_tokens=4, fast_path=fast_path)
    assert torch.equal(out.sequences, ref)
    assert torch.get_num_threads() == 1  # restored
    multi = [n for tokens, n in seen if tokens > 1]
    single = [n for tokens, n in seen if tokens == 1]
    assert multi and single  # prefills and verify blocks; the draft's one-token steps
    assert set(multi) == {3} and set(single) == {1}


def test_off_and_auto_keep_the_callers_threads(monkeypatch, block_threads):
    """A caller at 1 thread (another job holds a core) gets 1 thread in every forward: auto never raises it."""
    target, _ = make_pair(seed=4, noise=0.3)
    ids, mask = left_pad(random_prompts([6, 4], 64, seed=3))  # batch 2: every forward has more than one token
    seen = _record_threads(monkeypatch, FastKVState)
    monkeypatch.setattr(block, "available_cores", lambda: 8)
    for setting in ("off", "auto"):
        torch.set_num_threads(1)
        block_threads(setting)
        seen.clear()
        autoregressive_generate(target, ids, mask, max_new_tokens=4)
        assert {n for _, n in seen} == {1}, setting
        assert block.resolved_block_threads("cpu") is None
    assert block.resolved_block_threads("meta") is None  # not a CPU: the caller's setting


def test_auto_caps_a_caller_above_the_cores(monkeypatch, block_threads):
    monkeypatch.setattr(block, "available_cores", lambda: 1)
    torch.set_num_threads(2)
    block_threads("auto")
    with block.BlockThreads("cpu", tokens=5):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with block.BlockThreads("cpu", tokens=1):  # one-token forwards: the caller's setting
        assert torch.get_num_threads() == 2


def test_threads_are_restored_after_an_error(block_threads):
    torch.set_num_threads(1)
    block_threads(2)
    with pytest.raises(RuntimeError, match="boom"):
        with block.BlockThreads("cpu", tokens=5):
            assert torch.get_num_threads() == 2
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 1
    with block.BlockThreads("cpu", tokens=1):
        assert torch.get_num_threads() == 1


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("off", "off"), ("2", 2), (4, 4), (" AUTO ", "auto")])
def test_setting_accepts_auto_off_and_thread_counts(value, expected):
    assert DecodeConfig(block_threads=value).block_threads == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "", "1.5", None, True, "\u00b2", "\u0663"])
def test_setting_refuses_other_values_naming_the_key(value):
    with pytest.raises(ValueError, match=r"decode\.block_threads must be auto, off or a positive number"):
        DecodeConfig(block_threads=value)


def test_a_count_above_the_cores_is_capped_with_a_warning(monkeypatch, block_threads, caplog):
    monkeypatch.setattr(block, "available_cores", lambda: 2)
    with caplog.at_level("WARNING", logger="decode.fast_settings"):
        block_threads(1000)
    assert "decode.block_threads=1000 exceeds the 2 CPU cores" in caplog.text
    assert block.resolved_block_threads("cpu") == 2
    torch.set_num_threads(1)
    with block.BlockThreads("cpu", tokens=4):
        assert torch.get_num_threads() == 2
