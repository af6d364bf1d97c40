"""Tiny real Hugging Face models built from a config (never mocks), shared by every test folder.

Import as ``from tinymodels import tiny_llama`` (``tests/`` is on ``sys.path`` through the root conftest); a
uniquely named module avoids the ambiguity of ``from conftest import`` when several folders have a conftest.
"""
from __future__ import annotations

import torch


def tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    eos_token_id: int | None = None,
):
    """A tiny randomly initialised ``LlamaForCausalLM`` in eval mode (fp32, CPU), deterministic in ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Sharpen the output distribution a little so random models have structure worth drafting.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.eval()


def tiny_family_lm(family: str, vocab_size: int = 64, seed: int = 0, **overrides):
    """A tiny randomly initialised causal LM of one model family (eval mode, fp32, CPU), built from its config:
    ``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``gemma``, ``phi3``, ``gpt2``, ``gpt_neox``, ``opt``, ``falcon``.
    Embeddings tied as the family's config defaults unless ``overrides`` say otherwise (the LoRA tests need the
    families as their configs ship them; :func:`tiny_family` builds the sliding-window variants)."""
    import transformers as tf

    h, layers, heads = 32, 2, 4
    common = dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    llama_like = dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=2, max_position_embeddings=128, **common)
    configs = {
        "llama": (tf.LlamaConfig, llama_like),
        "qwen2": (tf.Qwen2Config, llama_like),
        "qwen3": (tf.Qwen3Config, {**llama_like, "head_dim": 8}),
        "mistral": (tf.MistralConfig, llama_like),
        "gemma": (tf.GemmaConfig, {**llama_like, "head_dim": 8}),
        "phi3": (tf.Phi3Config, llama_like),
        "gpt2": (tf.GPT2Config, dict(n_embd=h, n_layer=layers, n_head=heads, n_positions=128, **common)),
        "gpt_neox": (tf.GPTNeoXConfig, dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers,
                                            num_attention_heads=heads, max_position_embeddings=128, **common)),
        "opt": (tf.OPTConfig, dict(hidden_size=h, ffn_dim=2 * h, num_hidden_layers=layers, num_attention_heads=heads,
                                   word_embed_proj_dim=h, max_position_embeddings=128, **common)),
        "falcon": (tf.FalconConfig, dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                         **common)),
    }
    cls, kw = configs[family]
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cls(**{**kw, **overrides})).eval()


def gpu_test_device() -> torch.device:
    """Where the ``gpu`` marked tests run: ``cuda`` when torch sees a GPU; otherwise the CPU, which only happens in
    ``scripts/device_check.sh --cpu`` (``SPECDRAFT_GPU_TESTS_ON_CPU=1``: the same tests as a CPU dry run; elsewhere
    the root conftest skips them without a GPU)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kill_9_when(proc, ready, *, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Wait until ``ready()`` is true while ``proc`` (a ``subprocess.Popen`` with ``stderr=PIPE``) runs, then
    kill it with SIGKILL. Fails the test with the child's stderr if it exits first, or with ``what`` after
    ``timeout_s`` seconds; the child never outlives the call."""
    import signal

    signal_when(proc, ready, signal.SIGKILL, timeout_s=timeout_s, what=what, poll_s=poll_s)
    assert proc.returncode == -signal.SIGKILL


def signal_when(proc, ready, sig, *, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Wait until ``ready()`` is true while ``proc`` runs, send it ``sig`` and wait for it to exit (the child never
    outlives the call). ``proc.stderr``: a pipe (read only when the child exits first) or ``None``."""
    import os
    import time

    deadline = time.time() + timeout_s
    try:
        while not ready():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else proc.returncode
            assert time.time() < deadline, what
            time.sleep(poll_s)
        os.kill(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def save_code_target(out_dir, *, num_layers: int, hidden_size: int, seed: int = 7, records: int = 300,
                     vocab_size: int = 300):
    """A tiny Llama target with a BPE tokenizer trained on the code domain's first ``records`` training records,
    saved as a Hugging Face directory ``out_dir``. Returns (tokenizer, the records' dataset)."""
    from models.checkpoints import save_hf_atomic
    from data.loading import DataOptions, load_domain
    from data.text import train_bpe_tokenizer
    from distill.drafts import LlamaArch, build_llama

    rows = load_domain("code", DataOptions())["train"].select(range(records))
    tok = train_bpe_tokenizer((r["prompt"] + r["completion"] for r in rows), vocab_size=vocab_size)
    arch = LlamaArch(hidden_size=hidden_size, num_layers=num_layers, num_heads=4, intermediate_size=64,
                     max_position_embeddings=128)
    save_hf_atomic(build_llama(arch, tok, seed=seed), tok, out_dir)
    return tok, rows


SLIDING_FAMILIES = ("mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


def tiny_family(family: str, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2, seed: int = 0,
                sliding_window: int | None = 4, num_heads: int = 4, num_kv_heads: int = 2, max_window_layers: int = 1):
    """A tiny random ``*ForCausalLM`` of ``family`` (one of :data:`SLIDING_FAMILIES`, or ``"llama"``) in eval mode.

    ``sliding_window``: the attention window (``None``: full attention everywhere). Layer patterns follow each
    family: every layer windowed (Mistral, Phi-3); the first layer full and the rest windowed (Qwen2 / Qwen3 with
    ``max_window_layers=1``; 0: every layer windowed); alternating windowed / full (Gemma-2: even layers windowed; Gemma-3: every second
    layer full), with Gemma's attention and final logit soft-capping.
    """
    import transformers as tf

    head_dim = hidden_size // num_heads
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=sliding_window, head_dim=head_dim), tf.MistralForCausalLM
    elif family in ("qwen2", "qwen3"):
        extra = dict(head_dim=head_dim) if family == "qwen3" else {}
        cfg_cls = tf.Qwen2Config if family == "qwen2" else tf.Qwen3Config
        cfg = cfg_cls(**common, **extra, use_sliding_window=sliding_window is not None,
                      sliding_window=sliding_window, max_window_layers=max_window_layers)
        cls = tf.Qwen2ForCausalLM if family == "qwen2" else tf.Qwen3ForCausalLM
    elif family == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        cfg = tf.Gemma2Config(**common, head_dim=head_dim, sliding_window=sliding_window or 4096,
                              layer_types=types if sliding_window else ["full_attention"] * num_layers,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=head_dim)
        cls = tf.Gemma2ForCausalLM
    elif family == "gemma3":
        types = ["full_attention" if i % 2 == 1 else "sliding_attention" for i in range(num_layers)]
        cfg = tf.Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=sliding_window or 4096,
                                  layer_types=types if sliding_window else ["full_attention"] * num_layers,
                                  final_logit_softcapping=3.0, query_pre_attn_scalar=head_dim)
        cls = tf.Gemma3ForCausalLM
    elif family == "phi3":
        cfg = tf.Phi3Config(**common, sliding_window=sliding_window, resid_pdrop=0.0, embd_pdrop=0.0,
                            attention_dropout=0.0)
        cls = tf.Phi3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # sharper distributions: structure worth drafting
    return model.eval()


def compose_config(overrides: list[str]):
    """The project's Hydra config composed with ``overrides`` as ``python -m eval`` / ``python -m train`` compose
    it (without the hydra node), for in-process runs."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import eval.__main__  # noqa: F401  (registers the specdraft_root resolver)

    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def perturbed_copy(model, noise: float, seed: int):
    """A draft made from ``model`` by adding ``noise * std(param)`` Gaussian noise to every weight: it partly
    agrees with ``model``."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return draft.eval()


def save_tiny_lm(out_dir, texts, vocab_size: int, seed: int):
    """A tiny Llama with a BPE tokenizer trained on ``texts``, saved to ``out_dir`` (a checkpoint folder the CLI
    loads); returns ``out_dir``."""
    from pathlib import Path

    from data.text import train_bpe_tokenizer

    tok = train_bpe_tokenizer(iter(texts), vocab_size=vocab_size, min_frequency=1)
    model = tiny_llama(vocab_size=len(tok), seed=seed, eos_token_id=tok.eos_token_id)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return Path(out_dir)
