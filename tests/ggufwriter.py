"""A tiny Llama GGUF written with the ``gguf`` package's own writer (tests of the GGUF target conversion).

The file has what transformers' GGUF reader needs: Llama hyper-parameters, a byte-level BPE tokenizer (``gpt2``
model, a few letters, one merge, ChatML control tokens), a chat template, and the weights, most of them Q8_0-quantized
as in a real release (the norms stay float32, as llama.cpp writes them).
"""
from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_llama_gguf(path: str | Path, vocab_size: int = 64, hidden: int = 32, layers: int = 2,
                          heads: int = 4, kv_heads: int = 2, ffn: int = 64, seed: int = 0) -> Path:
    """Write a random tiny Llama as GGUF at ``path``; returns the path."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    b2u = bytes_to_unicode()
    letters = [b2u[c] for c in b"abcdefghijklmnopqrstuvwxyz .,?\n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + letters + ["ab"]
    tokens += [f"t{i}" for i in range(vocab_size - len(tokens))]
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab_size - 3))
    w.add_token_merges([f"{b2u[ord('a')]} {b2u[ord('b')]}"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)

    def tensor(name, shape, quantized=True):
        a = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if quantized:
            w.add_tensor(name, gguf.quants.quantize(a, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, 1.0 + 0.1 * a)

    kv = kv_heads * hidden // heads
    tensor("token_embd.weight", (vocab_size, hidden))
    tensor("output_norm.weight", (hidden,), quantized=False)
    tensor("output.weight", (vocab_size, hidden))
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), quantized=False)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), quantized=False)
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            tensor(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
