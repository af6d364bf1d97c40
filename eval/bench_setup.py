"""What the decoder benchmark (:mod:`eval.bench`) runs on: its settings (:class:`BenchConfig`, one field per flag
of ``scripts/bench_decode.py``), its prompts (random ids, a JSONL file, a domain's evaluation prompts or four
built-in texts), the tiny random models of ``--family``, the device and dtypes, the target and draft loaded with
one-line errors, and the check that prompt + new tokens + a verify block fit both models' context.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from decode.common import output_vocab_size

__all__ = ["BUILTIN_PROMPTS", "FAMILIES", "BenchConfig", "BenchError", "check_context", "family_models",
           "load_models", "load_prompts", "read_prompts_file", "resolve_device_dtype"]

BUILTIN_PROMPTS = [
    "The patient was admitted to the hospital with",
    "def fibonacci(n):\n    ",
    "Speculative decoding speeds up inference by",
    "Once upon a time, in a small village,",
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


class BenchError(ValueError):
    """Input the benchmark cannot run on (a device this machine lacks, a model directory that does not load, two
    tokenizers that differ, prompts too long for a model's context); the message is one line naming the flag."""


@dataclass
class BenchConfig:
    """What to benchmark and how: one field per ``scripts/bench_decode.py`` flag, same names and defaults (its
    ``--help`` describes each; the script checks the values before anything loads, this class does not)."""

    target: str | None = None  # model directories; or family: a tiny random pair of that family
    draft: str | None = None
    family: str | None = None
    family_layers: int = 4
    family_hidden: int = 256
    family_window: int = 16
    domain: str | None = None  # prompts: a domain's evaluation prompts, a JSONL file, random ids or BUILTIN_PROMPTS
    prompts_file: str | None = None
    text_field: str = "text"
    max_prompts: int = 8
    prompt_texts: list[str] | None = None  # prompts_file's texts when already read (the script reads it to check it)
    prompt_ids: bool = False
    num_prompts: int = 4
    prompt_len: int = 16
    num_draft_tokens: int = 4  # decoding: gamma, new tokens, timed rounds over the prompts
    max_new_tokens: int = 64
    repeats: int = 3
    device: str = "auto"
    dtype: str = "auto"
    target_dtype: str | None = None
    draft_dtype: str | None = None
    draft_quantize: str = "auto"  # auto: the draft directory's specdraft.json "quantize" | none | int8
    stop_at_eos: bool = False
    cost_steps: int = 32
    seed: int = 0
    num_threads: int = 1
    fast_path: str = "auto"
    compile: str = "auto"
    block_threads: str = "auto"
    draft_length_policy: str = "fixed"
    policy_config: Any = None  # decode.config.DecodeConfig of ours' policy; None: the fixed policy at gamma
    trees: list = dataclasses.field(default_factory=list)  # decode.tree shapes (parsed --draft-tree) timed beside the chain
    chain_gamma: list[int] = dataclasses.field(default_factory=list)
    no_hf: bool = False
    row_layout: str = "auto"
    row_layout_peer: str | None = None

    def __post_init__(self):
        if self.policy_config is None:
            from decode.config import DecodeConfig

            self.policy_config = DecodeConfig(num_draft_tokens=max(1, self.num_draft_tokens),
                                              draft_length_policy=self.draft_length_policy)

    @classmethod
    def from_namespace(cls, ns) -> "BenchConfig":
        """The fields of an ``argparse.Namespace`` (or any object) that has them."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def read_prompts_file(path: str, field: str, limit: int) -> list[str]:
    """The first ``limit`` non-empty ``field`` strings of a JSONL file.

    Raises:
        ValueError: the file is missing or unreadable, a line is not a JSON object, lacks ``field`` or holds a
            non-string or empty text, or no prompt remains; the message names the file, the line and the fix.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (expected JSONL: one JSON object per line)") from None
    texts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {i}: not JSON ({e.msg}); expected one JSON object per line") from None
        if not isinstance(row, dict) or field not in row:
            raise ValueError(f"{path}, line {i}: no field {field!r} (--text-field names the prompt's field)")
        if not isinstance(row[field], str) or not row[field].strip():
            raise ValueError(f"{path}, line {i}: field {field!r} must be a non-empty string, got {row[field]!r}")
        texts.append(row[field])
        if len(texts) >= limit:
            break
    if not texts:
        raise ValueError(f"{path} holds no prompt (every line is blank)")
    return texts


def load_prompts(cfg, tokenizer, vocab: int) -> list[torch.Tensor]:
    """The prompts of ``cfg`` (a :class:`BenchConfig` or the script's arguments) as ``(1, P)`` int64 tensors:
    ``num_prompts`` random ids below ``vocab`` (``prompt_ids``), a domain's evaluation prompts
    (:func:`data.loading.eval_prompts`), a JSONL file's texts or :data:`BUILTIN_PROMPTS`, tokenized by
    ``tokenizer``."""
    if cfg.prompt_ids:
        gen = torch.Generator().manual_seed(cfg.seed)
        return [torch.randint(0, vocab, (1, cfg.prompt_len), generator=gen) for _ in range(cfg.num_prompts)]
    if cfg.domain:
        from data.loading import eval_prompts

        texts = [e.prompt for e in eval_prompts(cfg.domain, max_prompts=cfg.max_prompts, tokenizer=tokenizer)]
    elif cfg.prompts_file:
        texts = getattr(cfg, "prompt_texts", None) or read_prompts_file(cfg.prompts_file, cfg.text_field,
                                                                        cfg.max_prompts)
    else:
        texts = BUILTIN_PROMPTS
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def family_models(family: str, layers: int, hidden: int, window: int, vocab: int = 1024, seed: int = 0):
    """(target, draft): a random ``family`` model (``layers`` layers, max(4, hidden // 64) heads over half as many
    KV groups, windowed layers as the family lays them out, ``window`` positions) and a 1-layer draft sharing its
    embeddings, first layer, final norm and head."""
    import transformers as tf

    heads = max(4, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                  num_key_value_heads=heads // 2, max_position_embeddings=2048, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hd = hidden // heads

    def build(n):
        if family == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_hidden_layers=n))
        if family == "mistral":
            return tf.MistralForCausalLM(tf.MistralConfig(**common, num_hidden_layers=n, sliding_window=window))
        if family in ("qwen2", "qwen3"):
            cfg_cls, cls = (tf.Qwen2Config, tf.Qwen2ForCausalLM) if family == "qwen2" else (tf.Qwen3Config,
                                                                                             tf.Qwen3ForCausalLM)
            return cls(cfg_cls(**common, num_hidden_layers=n, use_sliding_window=True, sliding_window=window,
                               max_window_layers=0))  # every layer windowed
        types = [("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(n)]
        if family == "gemma2":
            return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, num_hidden_layers=n, head_dim=hd,
                                                        sliding_window=window, layer_types=types))
        if family == "gemma3":
            return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, num_hidden_layers=n, head_dim=hd,
                                                            sliding_window=window, layer_types=types))
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common, num_hidden_layers=n, sliding_window=window))

    torch.manual_seed(seed)
    target = build(layers).eval()
    draft = build(1).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return target, draft


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` / ``--dtype`` as eval.device / eval.dtype resolve them (:mod:`data.devices`).

    Raises:
        BenchError: an unavailable GPU or an unknown name (the message names the flag).
    """
    from data.devices import DeviceError, resolve_device, resolve_dtype

    try:
        dev = resolve_device(device, "--device")
        return dev, resolve_dtype(dtype, dev, "--dtype")
    except DeviceError as e:
        raise BenchError(str(e)) from None


def load_models(cfg: BenchConfig):
    """``(target, draft, tokenizer or None, device, {"dtype", "target_dtype", "draft_dtype"}, shared vocabulary)``:
    the pair of ``cfg`` (directories, or a tiny random ``family`` pair) on the resolved device in their dtypes.
    The shared vocabulary is the logits both models produce (a trimmed draft head still scores every id, -inf
    outside its kept ids), capped by the tokenizer.

    Raises:
        BenchError: a device or dtype this machine lacks, a missing / partial / unloadable directory, two
            tokenizers that differ.
    """
    device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
    t_dtype = resolve_device_dtype(cfg.device, cfg.target_dtype)[1] if cfg.target_dtype else dtype
    d_dtype = resolve_device_dtype(cfg.device, cfg.draft_dtype)[1] if cfg.draft_dtype else dtype
    tokenizer = None
    if cfg.family:
        target, draft = family_models(cfg.family, cfg.family_layers, cfg.family_hidden, cfg.family_window,
                                      seed=cfg.seed)
        target, draft = target.to(device=device, dtype=t_dtype), draft.to(device=device, dtype=d_dtype)
    else:
        from data.checkpoints import load_target_and_draft

        try:
            target, draft, tokenizer = load_target_and_draft(cfg.target, cfg.draft, dtype=t_dtype,
                                                             draft_dtype=d_dtype, device=device,
                                                             need_tokenizer=not cfg.prompt_ids)
        except ValueError as e:
            raise BenchError(str(e)) from None
        tokenizer = None if cfg.prompt_ids else tokenizer
    draft, quantize = _quantized(cfg, draft)
    vocab = min(output_vocab_size(target), output_vocab_size(draft))
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
    dtypes = {"dtype": dtype, "target_dtype": t_dtype, "draft_dtype": d_dtype if quantize == "none" else quantize}
    return target, draft, tokenizer, device, dtypes, vocab


def _quantized(cfg: BenchConfig, draft):
    """``(draft, mode)``: the draft quantized as ``cfg.draft_quantize`` says (``auto``: as its directory's
    ``specdraft.json`` records; :mod:`decode.quantize`), for ours and transformers' assisted generation alike.

    Raises:
        BenchError: an unknown mode, or int8 asked for a draft on a GPU or not in float32 (CPU kernels only).
    """
    from decode.quantize import QUANTIZE_MODES, check_quantize_meta, quantize_draft

    mode = cfg.draft_quantize
    if mode == "auto":
        try:
            mode = check_quantize_meta(cfg.draft) if cfg.draft and not cfg.family else "none"
        except ValueError as e:
            raise BenchError(str(e)) from None
    if mode not in QUANTIZE_MODES:
        raise BenchError(f"--draft-quantize must be auto or one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    if mode != "none" and next(draft.parameters()).dtype != torch.float32:
        raise BenchError(f"--draft-quantize {mode}: the int8 kernels take a float32 draft; drop --draft-dtype / "
                         f"--dtype or use --draft-quantize none")
    try:
        return quantize_draft(draft, mode), mode
    except ValueError as e:
        raise BenchError(f"--draft-quantize {mode}: {e}") from None


def check_context(cfg: BenchConfig, target, draft, prompts: list[torch.Tensor]) -> None:
    """The decoders' caches hold prompt + new tokens + one verify block (the largest chain or tree + 2).

    Raises:
        BenchError: a prompt with no tokens, or the longest prompt + ``max_new_tokens`` + that block beyond a
            model's context (the message says how far to lower ``--max-new-tokens``).
    """
    from data.checkpoints import check_context_fits
    from data.errors import CheckpointError

    if not prompts or min(p.shape[1] for p in prompts) < 1:
        raise BenchError("a prompt tokenizes to no tokens; give prompts with text")
    longest = max(p.shape[1] for p in prompts)
    block = max([cfg.num_draft_tokens, *cfg.chain_gamma, *(t.max_nodes for t in cfg.trees)]) + 2
    try:
        for model, role in ((target, "target"), (draft, "draft")):
            limit = getattr(model.config, "max_position_embeddings", None) or 0
            check_context_fits(model, longest + cfg.max_new_tokens + block, role,
                               f"the longest prompt ({longest} tokens) + --max-new-tokens ({cfg.max_new_tokens}) + "
                               f"the largest verify block ({block})",
                               fix=f"lower --max-new-tokens to at most {limit - longest - block}"
                               if limit > longest + block else "use shorter prompts or a smaller draft tree")
    except CheckpointError as e:
        raise BenchError(str(e)) from None
