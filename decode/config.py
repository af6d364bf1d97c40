"""The ``decode`` config section (typed, range-checked).

Draft routing tables: which draft decodes which domain (``decode.draft_routing=PATH``).

A routing table is the JSON file the evaluation writes (``routing.json`` in the run directory, see
:mod:`eval.decision`)::

    {"schema": "specdraft.routing/1",
     "metric": "measured_speedup",
     "routes": {"medical": {"draft": "lora_medical", "path": "/abs/drafts/lora_medical", "num_draft_tokens": 4,
                            "measured_speedup": 1.12, "mean_accepted_length": 2.9, ...,
                            "candidates": {"distilled": {...}, "lora_medical": {...}}},
                "code": {...}},
     "default": {"draft": "distilled", "path": "/abs/drafts/distilled", ...}}

A route with ``"target_only": true`` (``draft`` and ``path`` null) sends its domain to no draft: it is decoded with
the target alone (the evaluation writes such a route where every draft's measured speedup interval lies below 1).

``routes.<domain>.path`` (absolute, or relative to the table's folder) is the draft for that domain; ``default``
(optional) is the fallback for a domain without a route. :func:`load_routing` reads and checks a table;
:meth:`RoutingTable.draft_for` answers one domain. The numbers beside each path are what the choice was based on;
the loader only needs ``path`` (and ``draft``, the name shown in reports).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import RoutingError

DRAFT_LENGTH_POLICIES = ("fixed", "adaptive", "confidence")


@dataclass
class LookupConfig:
    """The lookup drafts' settings (``decode.lookup``; decode/ngram.py)."""

    min_ngram: int = 2  # the shortest n-gram matched (longest first, down to this)
    max_ngram: int = 4  # the longest n-gram matched
    min_share: float = 0.5  # suffix: propose a token only while it follows at least this share of the matches
    max_store_tokens: int = 65536  # suffix: earlier answers' tokens kept per domain (oldest dropped first)
    max_occurrences: int = 64  # suffix: most recent matching occurrences counted per lookup

    def make(self, kind: str):
        """A :class:`decode.ngram.NgramDraft` of ``kind`` with these settings.

        Raises:
            ValueError: an unknown kind or a setting out of range (the message names the ``decode.lookup`` key).
        """
        from decode.ngram import NgramDraft

        return NgramDraft(kind, min_ngram=self.min_ngram, max_ngram=self.max_ngram, min_share=self.min_share,
                          max_store_tokens=self.max_store_tokens, max_occurrences=self.max_occurrences)


def ignored_sampling_keys(do_sample: bool, settings: dict) -> dict:
    """The sampling settings among ``settings`` (``temperature``, ``top_k``, ``top_p``) that greedy decoding would
    ignore: ``{}`` when ``do_sample``, else those set away from their no-op values (temperature 1 or 0, top-k 0,
    top-p 1). Transformers' ``GenerationConfig`` warns about the same; here it is an error, since a run decoded
    greedily in place of the sampled one it was asked for measures the wrong thing."""
    if do_sample:
        return {}
    neutral = {"temperature": (0.0, 1.0), "top_k": (0,), "top_p": (1.0,)}
    return {k: v for k, v in settings.items() if k in neutral and v is not None and float(v) not in neutral[k]}


@dataclass
class DecodeConfig:
    num_draft_tokens: int = 4  # gamma: tokens the draft proposes per verify step (adaptive: the starting length)
    do_sample: bool = False  # greedy when false
    temperature: float = 1.0  # sampling only; > 0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    # Routing table (routing.json written by an evaluation): each domain is decoded with its routed draft.
    draft_routing: str | None = None
    # How many tokens the draft proposes per verify step (decode.speculative): fixed (num_draft_tokens), adaptive
    # (starts at num_draft_tokens, +/- adaptive_step after every adaptive_window verify steps, within
    # [min_draft_tokens, max_draft_tokens]) or confidence (up to max_draft_tokens, a row stops drafting when the
    # draft's top probability falls below confidence_threshold).
    draft_length_policy: str = "fixed"
    min_draft_tokens: int = 1  # adaptive: lower bound
    max_draft_tokens: int = 8  # adaptive: upper bound; confidence: most tokens drafted per step
    adaptive_window: int = 4  # adaptive: verify steps (per row) behind each grow/shrink decision
    adaptive_step: int = 1  # adaptive: change of the draft length per decision
    confidence_threshold: float = 0.5  # confidence: keep drafting while the draft's top probability is >= this
    # torch.compile of the lean forward (decode/fast_llama.py): auto (on for CUDA, off on CPU, where it does not pay),
    # on, off. Lossless either way (the same computation).
    compile: str = "auto"
    # CPU threads for forwards over more than one token (the target's verify block, prefills, batches): auto (every
    # core the process may use), off (the caller's torch setting), or a number. One-token forwards keep the caller's
    # eval.num_threads / trainer.num_threads (decode/fast_settings.py). Lossless either way.
    block_threads: Any = "auto"
    lookup: LookupConfig = field(default_factory=LookupConfig)  # the lookup drafts (eval.lookup_drafts)

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"decode.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0) or (self.do_sample and self.temperature == 0):
            raise ValueError(f"decode.temperature must be a finite number > 0 when sampling (>= 0 otherwise), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decode.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"decode.top_k must be >= 0 (0 disables it), got {self.top_k}")
        unused = ignored_sampling_keys(self.do_sample, {"temperature": self.temperature, "top_k": self.top_k,
                                                        "top_p": self.top_p})
        if unused:
            one = len(unused) == 1
            raise ValueError(f"{', '.join(f'decode.{k}={v}' for k, v in unused.items())} only act{'s' if one else ''} "
                             "when sampling, and decode.do_sample=false decodes greedily: add decode.do_sample=true, or "
                             f"leave {'it' if one else 'them'} unset")
        if self.draft_routing is not None and not str(self.draft_routing).strip():
            raise ValueError("decode.draft_routing must be null or the path of a routing.json")
        if self.min_draft_tokens < 1:
            raise ValueError(f"decode.min_draft_tokens must be >= 1, got {self.min_draft_tokens}")
        if self.max_draft_tokens < self.min_draft_tokens:
            raise ValueError(f"decode.max_draft_tokens must be >= decode.min_draft_tokens ({self.min_draft_tokens}), "
                             f"got {self.max_draft_tokens}")
        if self.adaptive_window < 1:
            raise ValueError(f"decode.adaptive_window must be >= 1 verify step, got {self.adaptive_window}")
        if self.adaptive_step < 1:
            raise ValueError(f"decode.adaptive_step must be >= 1 token, got {self.adaptive_step}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"decode.confidence_threshold must be a probability in [0, 1], got "
                             f"{self.confidence_threshold}")
        self.check_policy(self.draft_length_policy)
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"decode.compile must be one of auto, on, off, got {self.compile!r}")
        from decode.fast_settings import parse_block_threads

        self.block_threads = parse_block_threads(self.block_threads)
        if isinstance(self.lookup, dict):
            self.lookup = LookupConfig(**self.lookup)
        self.lookup.make("prompt_lookup")  # ValueError naming the decode.lookup key

    def check_policy(self, name: str) -> None:
        """Raise ValueError (naming the keys to fix) unless policy ``name`` can be built from this section."""
        if name not in DRAFT_LENGTH_POLICIES:
            raise ValueError(f"decode.draft_length_policy must be one of {', '.join(DRAFT_LENGTH_POLICIES)}, "
                             f"got {name!r}")
        if name == "adaptive" and not self.min_draft_tokens <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ValueError(f"decode.num_draft_tokens (the adaptive policy's starting draft length) must be in "
                             f"[decode.min_draft_tokens, decode.max_draft_tokens] = [{self.min_draft_tokens}, "
                             f"{self.max_draft_tokens}], got {self.num_draft_tokens}")

    def make_policy(self, name: str | None = None):
        """A fresh :class:`decode.speculative.DraftLengthPolicy` (``name``, default ``draft_length_policy``) with this
        section's parameters. Policies are stateful: build one per independent decode.

        Raises:
            ValueError: unknown name, or parameters that do not fit it (see :meth:`check_policy`).
        """
        from decode.speculative import AdaptiveDraftLength, ConfidenceDraftLength, FixedDraftLength

        name = name or self.draft_length_policy
        self.check_policy(name)
        if name == "fixed":
            return FixedDraftLength(self.num_draft_tokens)
        if name == "adaptive":
            return AdaptiveDraftLength(initial=self.num_draft_tokens, min_draft_tokens=self.min_draft_tokens,
                                       max_draft_tokens=self.max_draft_tokens, window=self.adaptive_window,
                                       step=self.adaptive_step)
        return ConfidenceDraftLength(max_draft_tokens=self.max_draft_tokens, threshold=self.confidence_threshold)

    def policy_settings(self, name: str | None = None) -> dict:
        """The keys that define policy ``name`` (default ``draft_length_policy``), for reports and metadata."""
        name = name or self.draft_length_policy
        if name == "fixed":
            return {"draft_length_policy": name, "num_draft_tokens": self.num_draft_tokens}
        if name == "adaptive":
            return {"draft_length_policy": name, "num_draft_tokens": self.num_draft_tokens,
                    "min_draft_tokens": self.min_draft_tokens, "max_draft_tokens": self.max_draft_tokens,
                    "adaptive_window": self.adaptive_window, "adaptive_step": self.adaptive_step}
        return {"draft_length_policy": name, "max_draft_tokens": self.max_draft_tokens,
                "confidence_threshold": self.confidence_threshold}

    def sampling_kwargs(self) -> dict:
        """Keyword arguments for ``speculative_generate`` / ``autoregressive_generate``."""
        if not self.do_sample:
            return {}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


SCHEMA = "specdraft.routing/1"
DEFAULT_KEY = "default"


@dataclass(frozen=True)
class Route:
    draft: str | None  # the draft's name (as in the report); None: decode with the target alone
    path: str | None  # absolute path of the draft's Hugging Face directory; None: decode with the target alone
    num_draft_tokens: int | None = None  # gamma it was measured best with (None: not recorded)

    @property
    def target_only(self) -> bool:
        """True for a route to no draft: decode the domain with the target alone."""
        return self.path is None


@dataclass(frozen=True)
class RoutingTable:
    """domain -> :class:`Route`, plus an optional fallback ``default`` route."""

    routes: dict[str, Route]
    default: Route | None = None
    source: str = ""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def draft_for(self, domain: str) -> Route:
        """The route of ``domain``, else the ``default`` route.

        Raises:
            RoutingError: no route for ``domain`` and no ``default`` (names the table and the routed domains).
        """
        if domain in self.routes:
            return self.routes[domain]
        if self.default is not None:
            return self.default
        raise RoutingError(f"routing table {self.source} has no route for domain {domain!r} and no "
                           f"{DEFAULT_KEY!r} route; it routes {sorted(self.routes)}. Re-run the evaluation with "
                           f"that domain in eval.domains, or add a {DEFAULT_KEY!r} entry to the table.")

    def as_paths(self) -> dict[str, str]:
        """domain -> draft path (None: the target alone; the ``default`` route under the key ``"default"`` when
        present)."""
        out = {d: r.path for d, r in self.routes.items()}
        if self.default is not None:
            out[DEFAULT_KEY] = self.default.path
        return out


def _route(entry, where: str, base: Path) -> Route:
    if isinstance(entry, dict) and entry.get("target_only") is True:
        if entry.get("path") is not None or entry.get("draft") is not None:
            raise RoutingError(f"{where} is target_only but names a draft ({entry.get('draft')!r}, "
                               f"{entry.get('path')!r}); drop target_only or the draft")
        return Route(draft=None, path=None, num_draft_tokens=None)
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
        raise RoutingError(f"{where} must be an object with a non-empty string 'path' (the draft directory), "
                           f"got {entry!r}")
    from decode.hybrid import parse_hybrid_spec
    from decode.ngram import parse_lookup_spec

    try:
        # ngram:<kind>: a lookup draft, no directory; ngram:<kind>+<dir>: a lookup in front of the draft in <dir>
        lookup = parse_lookup_spec(entry["path"]) is not None or parse_hybrid_spec(entry["path"]) is not None
    except ValueError as e:
        raise RoutingError(f"{where}.path: {e}") from None
    p = Path(entry["path"]).expanduser()
    if not p.is_absolute() and not lookup:
        p = base / p
    hybrid = parse_hybrid_spec(entry["path"])
    if hybrid is not None:  # its trained draft resolves as a plain route's directory does
        from decode.hybrid import hybrid_name, hybrid_spec

        inner = Path(hybrid[1]).expanduser()
        inner = inner if inner.is_absolute() else base / inner
        entry = {**entry, "path": hybrid_spec(hybrid[0], inner),
                 "draft": entry.get("draft") or hybrid_name(hybrid[0], inner.name)}
    gamma = entry.get("num_draft_tokens")
    if gamma is not None and (not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1):
        raise RoutingError(f"{where}.num_draft_tokens must be an integer >= 1 or absent, got {gamma!r}")
    name = entry.get("draft") or p.name
    if not isinstance(name, str):
        raise RoutingError(f"{where}.draft must be a string, got {name!r}")
    return Route(draft=name, path=entry["path"] if lookup else str(p), num_draft_tokens=gamma)


def load_routing(path: str | os.PathLike, check_paths: bool = True) -> RoutingTable:
    """Read and check the routing table at ``path``.

    Args:
        path: a ``routing.json`` written by the evaluation (or by hand, same schema).
        check_paths: also require every routed draft directory to hold a ``config.json``.

    Returns:
        the :class:`RoutingTable` (relative draft paths resolved against the table's folder).

    Raises:
        RoutingError: the file is missing, not JSON, has another schema, no ``routes`` object, an entry without a
            path, or (``check_paths``) a routed draft directory that does not exist; the message names the file.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise RoutingError(f"decode.draft_routing: routing table {p} does not exist. Point it at the routing.json "
                           f"an evaluation wrote (python -m eval / the eval stage / +experiment=adapt_domains).")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RoutingError(f"routing table {p} is not valid JSON ({e}); re-run the evaluation that wrote it.") from None
    if not isinstance(doc, dict):
        raise RoutingError(f"routing table {p} must hold a JSON object, got {type(doc).__name__}")
    if doc.get("schema") not in (None, SCHEMA):
        raise RoutingError(f"routing table {p} has schema {doc.get('schema')!r}; this version reads {SCHEMA!r}")
    routes = doc.get("routes")
    if not isinstance(routes, dict):
        raise RoutingError(f"routing table {p} has no 'routes' object (domain -> {{draft, path}})")
    base = p.parent
    table = RoutingTable(
        routes={str(d): _route(e, f"{p}: routes.{d}", base) for d, e in routes.items()},
        default=_route(doc[DEFAULT_KEY], f"{p}: {DEFAULT_KEY}", base) if doc.get(DEFAULT_KEY) is not None else None,
        source=str(p), raw=doc)
    if not table.routes and table.default is None:
        raise RoutingError(f"routing table {p} routes no domain and has no {DEFAULT_KEY!r} route")
    if check_paths:
        routed = list(table.routes.items()) + ([(DEFAULT_KEY, table.default)] if table.default else [])
        from decode.hybrid import parse_hybrid_spec

        for d, r in routed:
            if r.target_only or (r.path.startswith("ngram:") and parse_hybrid_spec(r.path) is None):
                continue
            model_dir = parse_hybrid_spec(r.path)[1] if r.path.startswith("ngram:") else r.path  # a hybrid's draft
            if not (Path(model_dir) / "config.json").is_file():
                raise RoutingError(f"routing table {p}: the draft for {d!r} ({r.draft}) is not a model directory: "
                                   f"{model_dir} has no config.json. Re-run the evaluation, or fix the path.")
    return table
