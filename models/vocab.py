"""Vocabularies: trimmed draft heads (a draft's kept token ids) and the tokenizer compatibility check between
target and draft.

Trimmed draft vocabularies: a draft output head over ``N`` of the target's ``V`` token ids, with a
draft-to-target id map (EAGLE-3's ``draft_vocab_size`` / ``d2t``; FR-Spec, Zhao et al. 2025; VocabTrim, Goel et
al. 2025).

At a real vocabulary the draft's output layer is most of its forward (SmolLM2: 49,152 x 576 = 28.3M weights, the
2-layer self-draft's layers hold 7M). Keeping the ``N`` ids the target emits most often cuts that product by
``V / N``.

**Why decoding stays exactly lossless.** :class:`TrimmedLMHead` computes the ``N`` kept logits and, outside
training, returns them scattered into a full ``(..., V)`` tensor that is ``-inf`` everywhere else. Every decoder
path (greedy argmax, temperature / top-k / top-p, the rejection test of Leviathan et al. 2023, Alg. 1) then sees a
draft distribution ``q`` with ``q(x) = 0`` outside the kept set: such a token is never proposed, and the
residual ``max(0, p - q)`` keeps the target's full mass ``p(x)`` there, so it can still be emitted as the
correction / bonus token. Nothing in the decoder changes; ``q`` is still exactly the distribution the draft token
was drawn from.

**Training** (``model.training``, or inside :func:`trimmed_logits`): the head returns the ``(..., N)`` logits only;
labels and teacher distributions are mapped to draft ids with :meth:`TrimmedLMHead.to_draft` (``-1`` outside).

**On disk** a trimmed draft is a plain full-vocabulary Hugging Face checkpoint (:func:`full_vocab_head`): its
``lm_head.weight`` is ``(V, E)`` with the kept rows and zero rows elsewhere (``tie_word_embeddings=false``), its
``generation_config.json`` lists the other ids in ``suppress_tokens`` (``generate`` then never emits them), and
``specdraft.json`` holds ``draft_vocab`` (size, the ``draft_to_target`` id map, how it was counted). That folder
loads with ``AutoModelForCausalLM.from_pretrained`` and is accepted by engines that require the target's vocabulary
size (vLLM's ``draft_model``; transformers' ``assistant_model``); :func:`models.checkpoints.load_causal_lm` turns it
back into the trimmed head (:func:`apply_saved_draft_vocab`).

Tokenizer compatibility between the target and the draft, checked before any work (docs/architecture.md, "The decoder's lossless contract").

Speculative decoding feeds the draft the target's token ids and verifies the draft's proposed ids with the target,
so both must mean the same thing by every id: same vocabulary (token -> id), same BPE merges (so a prompt
tokenizes to the same ids), same special tokens (bos / eos / pad / unk and their ids) and same added tokens.
:func:`check_tokenizers_compatible` compares exactly the parts that :func:`tokenizer_fingerprint` hashes, so two
tokenizers pass the check if and only if their fingerprints are equal.

Works with any Hugging Face tokenizer (``transformers.PreTrainedTokenizerFast`` / ``TokenizersBackend`` and slow
tokenizers); merges are compared when both are fast tokenizers with a BPE model.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import TokenizerMismatchError

__all__ = [
    'TrimmedLMHead', 'install_trimmed_head', 'trimmed_head', 'trimmed_logits', 'draft_labels', 'kept_token_ids',
    'full_vocab_head', 'apply_saved_draft_vocab', 'draft_vocab_record', 'remap_topk', 'RemappedTeacher',
    'kept_mass', 'TokenizerMismatchError', 'check_tokenizers_compatible', 'tokenizer_fingerprint',
]


class TrimmedLMHead(nn.Module):
    """An output head over ``N`` kept target ids.

    Attributes:
        weight: ``(N, E)`` float parameter, row ``i`` scores target id ``draft_to_target[i]``.
        draft_to_target: ``(N,)`` int64 buffer, strictly increasing target ids in ``[0, V)``.
        target_to_draft: ``(V,)`` int64 buffer, the draft row of each target id, ``-1`` outside the kept set.
        out_features: ``V`` (the target's vocabulary: what :func:`decode.common.output_vocab_size` reads).
        force_trimmed: return ``(..., N)`` even in eval mode (set by :func:`trimmed_logits`).
        quantized: ``None``, or the dynamic int8 Linear over the N rows that the forward uses instead of ``weight``
            (set by :func:`decode.fast_settings.quantize_draft`).

    ``forward(h (..., E))`` returns ``(..., N)`` logits in training mode (or under :func:`trimmed_logits`), else
    ``(..., V)`` logits equal to those ``N`` values at ``draft_to_target`` and ``-inf`` elsewhere.
    """

    def __init__(self, weight: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int):
        super().__init__()
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).flatten().cpu()
        if weight.dim() != 2 or weight.shape[0] != ids.numel():
            raise ValueError(f"trimmed head weight {tuple(weight.shape)} must be (N, hidden) with N = "
                             f"{ids.numel()} kept ids")
        check_kept_ids(ids, vocab_size)
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        self.register_buffer("draft_to_target", ids.to(weight.device))
        inverse = torch.full((vocab_size,), -1, dtype=torch.long)
        inverse[ids] = torch.arange(ids.numel())
        self.register_buffer("target_to_draft", inverse.to(weight.device))
        self.out_features = int(vocab_size)
        self.in_features = int(weight.shape[1])
        self.force_trimmed = False
        self.quantized = None

    @property
    def num_kept(self) -> int:
        return int(self.draft_to_target.numel())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, kept={self.num_kept}, out_features={self.out_features}"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight) if self.quantized is None else self.quantized(hidden)  # (..., N)
        if self.training or self.force_trimmed:
            return logits
        return scatter_to_vocab(logits, self.draft_to_target, self.out_features)

    def to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids ``(...)`` (any int dtype; negative ids such as ``-100`` stay ``-1``) -> draft rows ``(...)``
        int64, ``-1`` outside the kept set."""
        ids = ids.long()
        safe = ids.clamp(0, self.out_features - 1)
        return torch.where((ids >= 0) & (ids < self.out_features), self.target_to_draft[safe], -1)


def scatter_to_vocab(logits: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(..., N)`` draft logits -> ``(..., V)`` with ``-inf`` outside ``draft_to_target`` (same dtype)."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, draft_to_target, logits)


def check_kept_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``ids`` is a non-empty, strictly increasing set of ids in ``[0, vocab_size)``."""
    if ids.numel() == 0:
        raise ValueError("a trimmed draft vocabulary needs at least one kept id")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"kept ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("kept ids must be strictly increasing (sorted, no repeats)")


def trimmed_head(model: nn.Module | None) -> TrimmedLMHead | None:
    """The :class:`TrimmedLMHead` of ``model`` (also inside a DDP / accelerate wrapper), else ``None``."""
    if model is None or not isinstance(model, nn.Module):
        return None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(out, TrimmedLMHead):
        return out
    inner = getattr(model, "module", None)
    return trimmed_head(inner) if isinstance(inner, nn.Module) else None


@contextlib.contextmanager
def trimmed_logits(model: nn.Module) -> Iterator[TrimmedLMHead | None]:
    """Within the block, ``model``'s trimmed head returns ``(..., N)`` logits in eval mode too (validation
    losses); yields the head (``None`` for a full-vocabulary model, which is left as it is)."""
    head = trimmed_head(model)
    if head is None:
        yield None
        return
    before, head.force_trimmed = head.force_trimmed, True
    try:
        yield head
    finally:
        head.force_trimmed = before


def draft_labels(model: nn.Module, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token labels for ``model``'s logits: unchanged for a full-vocabulary model; mapped to draft rows for a
    trimmed head, with ids outside the kept set (and ``ignore_index``) set to ``ignore_index``."""
    head = trimmed_head(model)
    if head is None:
        return labels
    mapped = head.to_draft(labels)
    return torch.where(mapped >= 0, mapped, ignore_index)


def install_trimmed_head(model: nn.Module, kept_ids: torch.Tensor | Iterable[int]) -> TrimmedLMHead:
    """Replace ``model``'s output head by a :class:`TrimmedLMHead` over ``kept_ids`` (sorted, unique), its rows
    copied from the current head (a tied head: the input embedding rows, then untied:
    ``config.tie_word_embeddings = False``). The new rows are trainable. Returns the head.

    Raises:
        ValueError: ids out of range / unsorted / repeated, or a model whose head is already trimmed.
    """
    out = model.get_output_embeddings()
    if isinstance(out, TrimmedLMHead):
        raise ValueError("the draft's output head is already trimmed")
    vocab = int(out.weight.shape[0])
    if isinstance(kept_ids, torch.Tensor):
        if kept_ids.is_floating_point() or kept_ids.dtype == torch.bool:
            raise ValueError(f"kept ids must be integers, got a {kept_ids.dtype} tensor")
        ids = kept_ids.to(torch.long).flatten().cpu()
    else:
        items = list(kept_ids)
        bad = [i for i in items if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise ValueError(f"kept ids must be integers, got {bad[0]!r}")
        ids = torch.tensor(items, dtype=torch.long)
    check_kept_ids(ids, vocab)  # before indexing: an id out of range is a clear error, not an IndexError
    with torch.no_grad():
        weight = out.weight.detach()[ids.to(out.weight.device)].clone()
    head = TrimmedLMHead(weight.requires_grad_(True), ids, vocab)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(head)
    return head


def kept_token_ids(counts: torch.Tensor, n: int, forced: Iterable[int] = ()) -> torch.Tensor:
    """The ``n`` ids to keep: every id in ``forced`` (special tokens, EOS), then the most frequent ids of
    ``counts`` (``(V,)`` occurrences), ties and never-seen ids filled in id order (a BPE vocabulary numbers its
    tokens by merge rank, i.e. by frequency in the tokenizer's own corpus). Returns sorted ``(n,)`` int64.

    Raises:
        ValueError: ``n`` not in ``[1, V]``, more forced ids than ``n``, or a forced id out of range.
    """
    vocab = int(counts.numel())
    if not 1 <= n <= vocab:
        raise ValueError(f"draft.draft_vocab_size must be in [1, {vocab}] (the target's vocabulary), got {n}")
    forced = sorted({int(i) for i in forced})
    if forced and (forced[0] < 0 or forced[-1] >= vocab):
        raise ValueError(f"forced ids must lie in [0, {vocab}), got {forced[0]}..{forced[-1]}")
    if len(forced) > n:
        raise ValueError(f"draft.draft_vocab_size={n} cannot hold the {len(forced)} special tokens it must keep; "
                         f"raise it")
    # score: count first, then lower id (stable sort on -count keeps id order among equal counts)
    score = counts.double().clone()
    score[torch.tensor(forced, dtype=torch.long)] = float("inf")
    order = torch.sort(-score, stable=True).indices
    return order[:n].sort().values


def kept_mass(counts: torch.Tensor, kept: torch.Tensor) -> float:
    """Share of the occurrences in ``counts`` ``(V,)`` that fall on ``kept`` ids (1.0 when ``counts`` is empty)."""
    total = float(counts.sum())
    return 1.0 if total == 0 else float(counts[kept].sum()) / total


def remap_topk(head: TrimmedLMHead, values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cached teacher top-k ``values, indices (..., k)`` (target ids) -> the same over draft rows: entries whose id
    is outside the kept set get value ``-inf`` (so the renormalised teacher of :mod:`distill.losses` conditions on the
    kept set) and index 0."""
    rows = head.to_draft(indices.to(head.target_to_draft.device))
    kept = rows >= 0
    return (torch.where(kept.to(values.device), values.float(), float("-inf")),
            rows.clamp(min=0).to(indices.device))


class RemappedTeacher:
    """A full-vocabulary teacher seen over a trimmed draft's kept ids: ``teacher(**kw).logits[..., draft_to_target]``
    (the teacher's softmax over the kept ids is its distribution conditioned on the kept set)."""

    def __init__(self, teacher: nn.Module, head: TrimmedLMHead):
        self.teacher, self.head = teacher, head

    def __getattr__(self, name):
        return getattr(self.teacher, name)

    def __call__(self, *args, **kwargs):
        out = self.teacher(*args, **kwargs)
        ids = self.head.draft_to_target.to(out.logits.device)
        out.logits = out.logits.index_select(-1, ids)
        return out


def draft_vocab_record(head: TrimmedLMHead, **how) -> dict:
    """The ``draft_vocab`` field of ``specdraft.json``: ``size``, ``target_vocab_size``, the ``draft_to_target`` id
    list, and ``how`` (how the ids were counted, their coverage)."""
    return {"size": head.num_kept, "target_vocab_size": head.out_features,
            "draft_to_target": [int(i) for i in head.draft_to_target.tolist()], **how}


@contextlib.contextmanager
def full_vocab_head(model: nn.Module) -> Iterator[list[int]]:
    """While saving: ``model``'s trimmed head swapped for a plain ``nn.Linear`` ``(V, E)`` holding the kept rows and
    zero rows elsewhere, and its generation config suppressing the other ids; yields those suppressed ids (empty
    for a full-vocabulary model, which is left as it is). Restored on exit."""
    head = trimmed_head(model)
    if head is None:
        yield []
        return
    lin = nn.Linear(head.in_features, head.out_features, bias=False, device=head.weight.device,
                    dtype=head.weight.dtype)
    with torch.no_grad():
        lin.weight.zero_()
        lin.weight[head.draft_to_target] = head.weight.detach()
    outside = (head.target_to_draft < 0).nonzero().flatten().tolist()
    gen = getattr(model, "generation_config", None)
    before = getattr(gen, "suppress_tokens", None) if gen is not None else None
    model.set_output_embeddings(lin)
    if gen is not None:
        gen.suppress_tokens = outside
    try:
        yield outside
    finally:
        model.set_output_embeddings(head)
        if gen is not None:
            gen.suppress_tokens = before


def apply_saved_draft_vocab(model: nn.Module, record: dict | None, source: str = "draft") -> TrimmedLMHead | None:
    """Turn a loaded full-vocabulary export back into its trimmed draft: ``record`` is ``specdraft.json``'s
    ``draft_vocab`` (``None``: nothing to do). Returns the head.

    Raises:
        ValueError: a record whose ids do not fit the model's vocabulary (names ``source`` and the fix).
    """
    if not record:
        return None
    ids = record.get("draft_to_target") if isinstance(record, dict) else None
    out = model.get_output_embeddings()
    vocab = int(out.weight.shape[0])
    if not isinstance(ids, list) or not ids or record.get("target_vocab_size", vocab) != vocab \
            or record.get("size", len(ids)) != len(ids):
        raise ValueError(f"{source}: specdraft.json's draft_vocab does not fit this checkpoint (vocabulary {vocab}); "
                         f"it was edited or belongs to another model: restore it or remove the draft_vocab field "
                         f"to use the full-vocabulary export as it is")
    try:
        head = install_trimmed_head(model, ids)
    except ValueError as e:
        raise ValueError(f"{source}: specdraft.json's draft_vocab is invalid ({e}); restore it or remove the "
                         f"draft_vocab field to use the full-vocabulary export as it is") from e
    head.weight.requires_grad_(False)
    return head


SPECIAL_TOKEN_NAMES = ("bos", "eos", "pad", "unk")
_MAX_EXAMPLES = 5


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
    # a name such as "--target models/assets/reference_target" (a script's flag and its value): the path alone
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
