"""Render records the way the target sees them: with its tokenizer's chat template, or a plain fallback.

A chat-shaped record (:attr:`data.registry.Example.messages`: ``((role, content), ...)``, roles ``system`` /
``user`` / ``assistant``) becomes

- ``prompt``: the conversation up to (not including) its last assistant turn, rendered with
  ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``: what the target is sent in production, used
  for evaluation prompts, teacher-generation prompts and the prompt part of training text;
- ``completion``: the rest of the whole conversation rendered by the same template (the last assistant turn with
  its end-of-turn markup), so ``prompt + completion`` is the training text as the target sees the conversation.

A tokenizer without a ``chat_template`` gets the plain format (:func:`plain_render`), the format the built-in chat
domains have always used. The reference target's tokenizer carries :data:`REFERENCE_CHAT_TEMPLATE`, which renders
exactly the plain format, so the default path runs the template code and the reference target sees the text it was
trained on.

Completion-style records (QA, code tasks, instructions: no messages) are sent to a chat model as it sees them in
production: as a user turn (:meth:`Renderer.turns`). The user content is the record's prompt without its trailing
answer cue (``Answer:``, ``Summary:``, ``Note:``, ...), the reference answer (when there is one) the assistant turn;
an instruct model sent raw ``Question: ...
Answer:`` text answers its end-of-turn token at once. Only the
reference target, trained on the raw text, gets it unchanged. Each record's format is one of :data:`FORMATS`.

Byte-level BPE tokenizer training, and tokenizing + packing text into fixed-length blocks (with a cache).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import datasets
import torch

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
PROMPT_FORMATS = ("chat_template", "plain")
# how one record reaches the target: a conversation in the chat template, a completion-style record made a user turn
# of the chat template, a conversation in the plain "User: ...\nAssistant:" format (no template), the raw text
FORMATS = ("chat_template", "chat_template_user_turn", "plain", "raw")
# a completion-style prompt's trailing answer cue ("...\nAnswer:"), dropped when the prompt becomes a user turn
# (a line of its own at the end, as the built-in formatters write it; "...structure of DNA:" keeps its last word)
_ANSWER_CUE = re.compile(r"(?:^|\n)[ \t]*(Answer|Summary|Note|Solution|Response|Output|Translation|TL;DR|A)[ \t]*:[ \t]*$")

# Renders what the reference target was trained on: "User: ...\nAssistant: ..." (see plain_render).
REFERENCE_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}{{ '\\n' }}"
    "{%- elif m['role'] == 'user' -%}User: {{ m['content'] }}{{ '\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}Assistant: {{ m['content'] }}"
    "{%- if not loop.last or add_generation_prompt -%}{{ '\\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)


def _split_final(messages: Sequence[Sequence[str]]) -> tuple[list, str | None]:
    """(context turns, final assistant content or None when the conversation ends with a non-assistant turn)."""
    if messages and messages[-1][0] == "assistant":
        return list(messages[:-1]), messages[-1][1]
    return list(messages), None


def plain_render(messages: Sequence[Sequence[str]]) -> tuple[str, str]:
    """The plain format of a conversation: ``(prompt, completion)``.

    ``system`` -> ``"<content>\\n"``, ``user`` -> ``"User: <content>\\n"``, an earlier ``assistant`` turn ->
    ``"Assistant: <content>\\n"``; the prompt ends with ``"Assistant:"`` and the completion is ``" <last assistant
    content>"`` (``""`` when the conversation ends with a user turn). A single turn gives the built-in chat format
    ``"User: <u>\\nAssistant:"`` + ``" <a>"``.
    """
    context, final = _split_final(messages)
    lines = {"system": "{}\n", "user": "User: {}\n", "assistant": "Assistant: {}\n"}
    prompt = "".join(lines[r].format(c) for r, c in context) + "Assistant:"
    return prompt, (" " + final) if final is not None else ""


def encode_messages(messages: Iterable[Sequence[str]] | None) -> str:
    """Messages as the ``messages`` column of :func:`data.loading.load_domain` (JSON; ``""`` for none)."""
    return "" if messages is None else json.dumps([list(m) for m in messages], ensure_ascii=False)


def decode_messages(s: str | None) -> list[tuple[str, str]] | None:
    return [tuple(m) for m in json.loads(s)] if s else None


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's chat template (a string), or None."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # several named templates: the default one
        t = t.get("default") or next(iter(t.values()), None)
    return t or None


class Renderer:
    """Renders (prompt, completion, messages) for one tokenizer. ``format``: ``chat_template`` or ``plain``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.template = chat_template_of(tokenizer)
        self.format = "chat_template" if self.template else "plain"
        bos = getattr(tokenizer, "bos_token", None)
        bos_id = getattr(tokenizer, "bos_token_id", None)
        adds_bos = bos_id is not None and tokenizer("", add_special_tokens=True)["input_ids"][:1] == [bos_id]
        # a template that writes the BOS text itself (Llama 3's "<|begin_of_text|>") would get a second BOS when
        # the prompt is tokenized with add_special_tokens=True; drop the template's
        self._strip = bos if (adds_bos and bos) else None
        self._warned = False

    def key(self) -> str:
        """Identifies the rendering (for caches of tokenized text): the format and a hash of the template."""
        user = ":user_turns-1" if self.user_turns else ""
        return f"{self.format}:{hashlib.sha256((self.template or '').encode()).hexdigest()[:16]}{user}"

    def _apply(self, msgs: list[dict], gen: bool) -> str:
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        if self._strip and text.startswith(self._strip):
            text = text[len(self._strip):]
        return text

    @property
    def user_turns(self) -> bool:
        """Whether completion-style records become user turns (a chat template other than the reference one)."""
        return self.template is not None and self.template != REFERENCE_CHAT_TEMPLATE

    def turns(self, prompt: str, completion: str, messages: Sequence[Sequence[str]] | None):
        """The conversation the chat template renders for a record, or None (the record is sent as it is): its
        own ``messages``, else (with :attr:`user_turns`) ``(("user", prompt without its answer cue),
        ("assistant", completion))`` (no assistant turn when the completion is empty)."""
        if messages:
            return messages
        if not self.user_turns or not prompt.strip():
            return None
        user = _ANSWER_CUE.sub("", prompt.rstrip()).strip() or prompt.strip()
        user = (user[len("Question:"):].strip() or user) if user.startswith("Question:") and "\n" not in user else user
        # " <answer>" (the QA convention) loses its separator; code keeps its indentation
        answer = (completion[1:] if completion.startswith(" ") and not completion.startswith("  ")
                  else completion.strip("\n")).rstrip()
        return (("user", user),) + ((("assistant", answer),) if answer else ())

    def format_of(self, messages: Sequence[Sequence[str]] | None) -> str:
        """How a record with these ``messages`` (None: completion-style) reaches the target (one of
        :data:`FORMATS`)."""
        if messages:
            return "chat_template" if self.template is not None else "plain"
        return "chat_template_user_turn" if self.user_turns else "raw"

    def __call__(self, prompt: str, completion: str, messages: Sequence[Sequence[str]] | None) -> tuple[str, str]:
        """``(prompt, completion)`` as the target sees them (see :meth:`turns`; unchanged when it gives None)."""
        messages = self.turns(prompt, completion, messages)
        if not messages or self.template is None:
            return prompt, completion
        msgs = [{"role": r, "content": c} for r, c in messages]
        context, final = _split_final(messages)
        p = self._apply(msgs[: len(context)], True)
        if final is None:
            return p, ""
        full = self._apply(msgs, False)
        if full.startswith(p):
            return p, full[len(p):]
        # a template that renders the last assistant turn differently from a generation prompt: train on the
        # rendered conversation, the completion being what follows the longest common prefix
        if not self._warned:
            log.warning("the chat template renders a finished conversation with a different prefix than its "
                        "generation prompt; training text is the rendered conversation")
            self._warned = True
        n = 0
        while n < min(len(p), len(full)) and p[n] == full[n]:
            n += 1
        return full[:n], full[n:]

    def rows(self, ds):
        """A ``datasets.Dataset`` with ``prompt`` / ``completion`` / ``messages`` columns, rendered."""
        if self.template is None:
            return ds

        def fn(r: dict[str, Any]) -> dict[str, str]:
            p, c = self(r["prompt"], r["completion"], decode_messages(r.get("messages")))
            return {"prompt": p, "completion": c}

        return ds.map(fn, desc="chat template", load_from_cache_file=False)


def renderer(tokenizer) -> Renderer | None:
    return None if tokenizer is None else Renderer(tokenizer)



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
