"""Byte-level BPE tokenizer training, and tokenizing + packing text into fixed-length blocks (with a cache)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import datasets
import torch

log = logging.getLogger(__name__)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization) with the ``tokenizers`` library.

    Special tokens ``<s>`` (BOS, prepended by the post-processor like Llama's), ``</s>`` (EOS) and ``<pad>``.

    Args:
        texts: training text (an iterator is fine; it is consumed once).
        vocab_size: total vocabulary including the 256 byte symbols and 3 special tokens.

    Returns:
        ``transformers.PreTrainedTokenizerFast`` ready for ``save_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def _group(batch: dict, block_size: int) -> dict:
    # Concatenate the documents of this batch ((N docs) -> one stream) and cut (stream) -> (n_blocks, block_size).
    stream = [t for ids in batch["input_ids"] for t in ids]
    n = (len(stream) // block_size) * block_size
    return {"input_ids": [stream[i : i + block_size] for i in range(0, n, block_size)]}


def pack_blocks(texts: datasets.Dataset | list[str], tokenizer, block_size: int, batch_size: int = 1000) -> datasets.Dataset:
    """Tokenize documents (BOS + text + EOS) and pack them into blocks of exactly ``block_size`` tokens.

    Documents are concatenated in order within batches of ``batch_size`` documents and the tail of each batch
    (fewer than ``block_size`` tokens) is dropped, as in Hugging Face's ``run_clm`` ``group_texts``.

    Args:
        texts: a dataset with a ``text`` column, or a list of strings.
        tokenizer: the *target's* tokenizer (drafts share it).
        block_size: tokens per block.

    Returns:
        ``datasets.Dataset`` with one column ``input_ids`` of shape (num_blocks, block_size).
    """
    if isinstance(texts, list):
        texts = datasets.Dataset.from_dict({"text": texts})
    eos = tokenizer.eos_token_id

    def tok(batch):
        enc = tokenizer(batch["text"], add_special_tokens=True)["input_ids"]
        return {"input_ids": [ids + [eos] for ids in enc]}

    ds = texts.map(tok, batched=True, remove_columns=texts.column_names, desc="tokenize", load_from_cache_file=False)
    return ds.map(lambda b: _group(b, block_size), batched=True, batch_size=batch_size, desc="pack",
                  load_from_cache_file=False)


def cache_root() -> Path:
    """Cache folder: ``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft``."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")).expanduser()


def cached_pack_blocks(key_parts: Iterable[str], texts_fn, tokenizer, block_size: int) -> datasets.Dataset:
    """:func:`pack_blocks` with an on-disk cache keyed by ``key_parts`` (data fingerprint, tokenizer, sizes).

    The cache entry is written to a temporary folder and renamed into place, so an interrupted run never
    leaves a half-written entry that a later run would read as complete.
    """
    h = hashlib.sha256()
    for part in [*key_parts, tokenizer.backend_tokenizer.to_str(), str(block_size)]:
        h.update(str(part).encode() + b"\0")
    path = cache_root() / "blocks" / h.hexdigest()[:24]
    if path.is_dir():
        try:
            cached = datasets.load_from_disk(str(path))
            cached.with_format(None)[-1:]  # touch the data: a damaged entry fails here, not in a later stage
            return cached
        except Exception as e:  # a damaged cache entry is rebuilt, never trusted
            log.warning("token-block cache entry %s is unreadable (%s); rebuilding it", path, e)
            shutil.rmtree(path, ignore_errors=True)
    blocks = pack_blocks(texts_fn(), tokenizer, block_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    blocks.save_to_disk(str(tmp))
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race: use its entry
        shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(path))


def iter_texts(ds: datasets.Dataset) -> Iterator[str]:
    for row in ds:
        yield row["prompt"] + row["completion"]


def encode_prompt(tokenizer, text: str, max_prompt_tokens: int) -> tuple[torch.Tensor, bool]:
    """Token ids (1, T) of ``text`` with the tokenizer's special tokens; keeps the last ``max_prompt_tokens``
    (left truncation, BOS re-prepended). Returns (ids, truncated)."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    truncated = len(ids) > max_prompt_tokens
    if truncated:
        bos = tokenizer.bos_token_id
        keep = ids[-(max_prompt_tokens - (bos is not None)) :]
        ids = ([bos] if bos is not None else []) + keep
    return torch.tensor([ids], dtype=torch.long), truncated
