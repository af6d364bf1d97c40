"""Tokenizer compatibility between the target and the draft, checked before any work (docs/architecture.md, "The decoder's lossless contract").

Speculative decoding feeds the draft the target's token ids and verifies the draft's proposed ids with the target,
so both must mean the same thing by every id: same vocabulary (token -> id), same BPE merges (so a prompt
tokenizes to the same ids), same special tokens (bos / eos / pad / unk and their ids) and same added tokens.
:func:`check_tokenizers_compatible` compares exactly the parts that :func:`tokenizer_fingerprint` hashes, so two
tokenizers pass the check if and only if their fingerprints are equal.

Works with any Hugging Face tokenizer (``transformers.PreTrainedTokenizerFast`` / ``TokenizersBackend`` and slow
tokenizers); merges are compared when both are fast tokenizers with a BPE model.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

__all__ = ["TokenizerMismatchError", "check_tokenizers_compatible", "tokenizer_fingerprint"]

SPECIAL_TOKEN_NAMES = ("bos", "eos", "pad", "unk")
_MAX_EXAMPLES = 5


class TokenizerMismatchError(ValueError):
    """Target and draft tokenizers differ; the message lists every difference and how to fix it."""


# --------------------------------------------------------------------------------------------------------------
# What a tokenizer means by its ids: one canonical description, used by both the check and the fingerprint.
# --------------------------------------------------------------------------------------------------------------


def _backend_json(tokenizer: Any) -> Optional[dict]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    return json.loads(backend.to_str())


def _normalise_merge(merge: Any) -> tuple[str, str]:
    # tokenizers writes merges either as "a b" strings (older files) or as ["a", "b"] pairs (newer files).
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return (left, right)
    left, right = merge
    return (str(left), str(right))


def _describe(tokenizer: Any) -> dict:
    """Canonical, JSON-serialisable description: model type, size, vocab, merges, special and added tokens."""
    backend = _backend_json(tokenizer)
    model = (backend or {}).get("model") or {}
    model_type = model.get("type") if backend is not None else f"slow:{type(tokenizer).__name__}"
    merges = None
    if model_type == "BPE":
        merges = [_normalise_merge(m) for m in model.get("merges", [])]
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = getattr(tokenizer, f"{name}_token", None)
        token_id = getattr(tokenizer, f"{name}_token_id", None) if token is not None else None
        special[name] = (None if token is None else str(token), token_id)
    added = {
        int(idx): (str(tok.content) if hasattr(tok, "content") else str(tok), bool(getattr(tok, "special", False)))
        for idx, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
    }
    return {
        "model_type": model_type,
        "size": len(tokenizer),
        "vocab": dict(tokenizer.get_vocab()),
        "merges": merges,
        "special": special,
        "added": added,
    }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) over the vocabulary, BPE merges, special tokens (with ids) and added tokens.

    Equal fingerprints <=> :func:`check_tokenizers_compatible` passes. Independent of file layout or of how the
    tokenizer was loaded; use it to record in a run directory which tokenizer a draft was trained with.
    """
    d = _describe(tokenizer)
    canonical = {
        "model_type": d["model_type"],
        "size": d["size"],
        "vocab": sorted(d["vocab"].items(), key=lambda kv: (kv[1], kv[0])),
        "merges": d["merges"],
        "special": d["special"],
        "added": sorted(d["added"].items()),
    }
    payload = json.dumps(canonical, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------------------------
# Differences, in words.
# --------------------------------------------------------------------------------------------------------------


def _fmt_examples(items: list[str], total: int) -> str:
    more = f", ... ({total - len(items)} more)" if total > len(items) else ""
    return ", ".join(items) + more


def _vocab_differences(a: dict, b: dict, size_a: int, size_b: int, na: str, nb: str) -> Optional[str]:
    va, vb = a, b
    if va == vb and size_a == size_b:
        return None
    parts = [f"vocabulary differs: {na} has {size_a} tokens (len(tokenizer)), {nb} has {size_b}"]
    moved = sorted((i, t) for t, i in va.items() if t in vb and vb[t] != i)
    if moved:
        ex = [f"{t!r} ({na} id {i}, {nb} id {vb[t]})" for i, t in moved[:_MAX_EXAMPLES]]
        parts.append(f"tokens with different ids: {_fmt_examples(ex, len(moved))}")
    only_a = sorted((i, t) for t, i in va.items() if t not in vb)
    if only_a:
        ex = [f"{t!r} (id {i})" for i, t in only_a[:_MAX_EXAMPLES]]
        parts.append(f"in {na} but missing from {nb}: {_fmt_examples(ex, len(only_a))}")
    only_b = sorted((i, t) for t, i in vb.items() if t not in va)
    if only_b:
        ex = [f"{t!r} (id {i})" for i, t in only_b[:_MAX_EXAMPLES]]
        parts.append(f"in {nb} but missing from {na}: {_fmt_examples(ex, len(only_b))}")
    return "; ".join(parts)


def _merge_differences(ma: list, mb: list, na: str, nb: str) -> Optional[str]:
    if ma == mb:
        return None
    first = next((i for i, (x, y) in enumerate(zip(ma, mb)) if x != y), min(len(ma), len(mb)))

    def at(merges: list, i: int) -> str:
        return repr(tuple(merges[i])) if i < len(merges) else "(none)"

    return (
        f"BPE merges differ: {na} has {len(ma)} merges, {nb} has {len(mb)}; first difference at merge index "
        f"{first}: {na} {at(ma, first)} vs {nb} {at(mb, first)}"
    )


def _special_differences(sa: dict, sb: dict, na: str, nb: str) -> list[str]:
    out = []
    for name in SPECIAL_TOKEN_NAMES:
        (ta, ia), (tb, ib) = sa[name], sb[name]
        if (ta, ia) != (tb, ib):

            def show(tok, idx):
                return "not set" if tok is None else f"{tok!r} (id {idx})"

            out.append(f"special token {name}_token differs: {na} {show(ta, ia)} vs {nb} {show(tb, ib)}")
    return out


def _added_differences(aa: dict, ab: dict, na: str, nb: str) -> Optional[str]:
    if aa == ab:
        return None
    ids = sorted(set(aa) | set(ab))
    diff = [i for i in ids if aa.get(i) != ab.get(i)]

    def show(entry):
        if entry is None:
            return "none"
        content, special = entry
        return f"{content!r}{' (special)' if special else ''}"

    ex = [f"id {i}: {na} {show(aa.get(i))} vs {nb} {show(ab.get(i))}" for i in diff[:_MAX_EXAMPLES]]
    return f"added tokens differ: {_fmt_examples(ex, len(diff))}"


def check_tokenizers_compatible(
    target_tokenizer: Any,
    draft_tokenizer: Any,
    *,
    target_name: str = "target",
    draft_name: str = "draft",
) -> None:
    """Raise :class:`TokenizerMismatchError` unless the draft's tokenizer means the same as the target's.

    Compares, and reports every difference of: the tokenizer model type; the vocabulary (sizes, and up to five
    example tokens with different ids or missing on one side); the BPE merges when both are fast BPE tokenizers
    (counts and the first differing merge index, from ``tokenizer.backend_tokenizer``'s JSON); the bos / eos /
    pad / unk tokens and their ids; the added tokens. ``target_name`` / ``draft_name`` (e.g. model paths) name
    the two sides in the message, which ends with how to fix it. Returns ``None`` when compatible.
    """
    if target_tokenizer is draft_tokenizer:
        return
    a, b = _describe(target_tokenizer), _describe(draft_tokenizer)
    na, nb = target_name, draft_name
    problems: list[str] = []
    if a["model_type"] != b["model_type"]:
        problems.append(f"tokenizer model type differs: {na} {a['model_type']} vs {nb} {b['model_type']}")
    vocab = _vocab_differences(a["vocab"], b["vocab"], a["size"], b["size"], na, nb)
    if vocab:
        problems.append(vocab)
    if a["merges"] is not None and b["merges"] is not None:
        merges = _merge_differences(a["merges"], b["merges"], na, nb)
        if merges:
            problems.append(merges)
    problems.extend(_special_differences(a["special"], b["special"], na, nb))
    added = _added_differences(a["added"], b["added"], na, nb)
    if added:
        problems.append(added)
    if not problems:
        return
    lines = "\n".join(f"  - {p}" for p in problems)
    # a name such as "--target distill/reference_target" (a script's flag and its value): the path alone
    name = na.split(" ", 1)[1] if na.startswith("-") and " " in na else na
    source = "<target dir or hub id>" if na == "target" else repr(name)
    raise TokenizerMismatchError(
        f"the {nb} tokenizer is not compatible with the {na} tokenizer; speculative decoding needs both to map "
        f"every token to the same id:\n{lines}\n"
        f"Fix: the draft must use the target's tokenizer: save the target tokenizer into the draft directory "
        f"(AutoTokenizer.from_pretrained({source}).save_pretrained(<draft dir>)); if that changes the vocabulary "
        f"size, resize the draft's embeddings (draft.resize_token_embeddings(len(tokenizer))) and re-train or "
        f"re-distill the draft on data tokenized with the target's tokenizer."
    )
