"""The ``eval`` and ``logger`` config sections and the typed root of ``python -m eval``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.config import DataConfig
from models.target import TargetConfig
from core.cli import validate_structured
from core.cli import PathsConfig
from decode.config import DecodeConfig


@dataclass
class ExtraDomainConfig:
    """A user's own file evaluated as one more domain (all its records are evaluation prompts); built like a
    declared domain (:func:`data.loading.extra_domain`)."""

    name: str = "???"  # domain name in the report; must not clash with a registered domain
    path: str = "???"  # .jsonl or .csv file
    text_field: str | None = None  # field holding the prompt (or, with prompt_field, the reference completion);
    # required unless shape is messages / conversations
    prompt_field: str | None = None  # optional separate prompt field (formatted like the chat domain)
    format: str | None = None  # jsonl | json | csv | parquet | text | disk (null: from the suffix)
    shape: str | None = None  # text | prompt_completion | messages | conversations (null: from the fields above)
    field: str | None = None  # the messages / conversations field (shape messages / conversations)
    max_prompts: int | None = None  # cap on the records used as prompts (null: every record; eval.max_prompts
    # caps only the built-in domains)

    def __post_init__(self):
        from data.registry import check_report_name

        check_report_name(self.name, "eval.extra_domains[].name")
        if self.text_field is None and self.shape not in ("messages", "conversations"):
            raise ValueError(f"eval.extra_domains: {self.name}.text_field is missing: name the field holding the "
                             f"prompt text (or set shape: messages / conversations)")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"eval.extra_domains: {self.name}.max_prompts must be >= 1 or null (every record), "
                             f"got {self.max_prompts}")


@dataclass
class DeploymentConfig:
    """Where the drafts will be deployed, for the *projected* speedup (Leviathan et al. 2023, Thm 3.8) beside the
    measured one: a cost ratio c, or parameter counts (a memory-bound GPU at batch 1: c = draft / target
    parameters), or ``memory_bound: true`` (the evaluated models' own parameter counts). All unset: no projection."""

    cost_ratio: float | None = None  # c = one draft forward / one target forward on the deployment
    target_parameters: int | None = None  # with draft_parameters: c = draft_parameters / target_parameters
    draft_parameters: int | None = None
    memory_bound: bool = False  # c = each evaluated draft's parameter count / the target's

    def __post_init__(self):
        if self.cost_ratio is not None and not self.cost_ratio > 0:
            raise ValueError(f"eval.deployment.cost_ratio must be > 0 (draft forward time / target forward time), "
                             f"got {self.cost_ratio}")
        if (self.target_parameters is None) != (self.draft_parameters is None):
            raise ValueError("eval.deployment.target_parameters and eval.deployment.draft_parameters go together: "
                             "give both (or neither)")
        for k in ("target_parameters", "draft_parameters"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ValueError(f"eval.deployment.{k} must be >= 1, got {v}")

    def enabled(self) -> bool:
        return self.cost_ratio is not None or self.target_parameters is not None or self.memory_bound


@dataclass
class EngineConfig:
    """The engine check (``eval.engine``): the target alone and with each draft in llama.cpp's ``llama-server`` on
    the evaluation's prompts (greedy), its own acceptance counters and tokens/s beside ours (:mod:`eval.engine`)."""

    enabled: str = "auto"  # auto (when llama.cpp is installed: python scripts/install_engine.py) | true | false
    target_format: str = "source"  # source: the target's own GGUF file when it came from one (else q8_0) | f32 | f16 | q8_0
    draft_format: str = "q8_0"  # the drafts' GGUF type: q8_0 | f16 | f32
    num_draft_tokens: int | None = None  # gamma in the engine; null: decode.num_draft_tokens
    threads: int | None = None  # llama-server threads; null: eval.num_threads, else the cores free at its start
    max_prompts: int | None = None  # prompts per domain; null: eval.max_prompts (the same prompts as ours)

    def __post_init__(self):
        self.enabled = str(self.enabled).lower()
        if self.enabled not in ("auto", "true", "false"):
            raise ValueError(f"eval.engine.enabled must be auto, true or false, got {self.enabled!r}")
        if self.target_format not in ("source", "f32", "f16", "q8_0"):
            raise ValueError(f"eval.engine.target_format must be source, f32, f16 or q8_0, got {self.target_format!r}")
        if self.draft_format not in ("f32", "f16", "q8_0"):
            raise ValueError(f"eval.engine.draft_format must be f32, f16 or q8_0, got {self.draft_format!r}")
        for k in ("num_draft_tokens", "threads", "max_prompts"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ValueError(f"eval.engine.{k} must be null or >= 1, got {v}")


@dataclass
class HeldoutConfig:
    """The held-out acceptance measurement (``eval.heldout``, :mod:`eval.heldout`): each draft replayed on the
    target's greedy answers to test prompts that are no near-duplicate of a training record, beside training
    prompts."""

    enabled: bool = True
    max_prompts: int = 32  # held-out prompts per built-in domain
    train_prompts: int = 16  # training prompts of each training domain replayed beside them (0: none)
    max_new_tokens: int = 64  # tokens of each greedy target answer
    max_gamma: int = 5  # alpha at draft positions 1..max_gamma, tau at gamma 1..max_gamma
    near_duplicate_jaccard: float = 0.7  # IDF-weighted word Jaccard at which a test prompt repeats a training one
    batch_size: int = 16  # prompts per target generation batch and per draft forward

    def __post_init__(self):
        for key, low in (("max_prompts", 1), ("train_prompts", 0), ("max_new_tokens", 1), ("max_gamma", 1),
                         ("batch_size", 1)):
            if getattr(self, key) < low:
                raise ValueError(f"eval.heldout.{key} must be >= {low}, got {getattr(self, key)}")
        if not 0 < self.near_duplicate_jaccard <= 1:
            raise ValueError(f"eval.heldout.near_duplicate_jaccard must be in (0, 1], got "
                             f"{self.near_duplicate_jaccard}")


@dataclass
class EvalConfig:
    domains: list[str] = field(default_factory=lambda: ["medical", "code", "chat", "math"])
    extra_domains: list[ExtraDomainConfig] = field(default_factory=list)  # user files, evaluated after domains
    # name -> HF dir (or ngram:<kind>, ngram:<kind>+<dir>); an entry set to null is left out (an experiment drops
    # a draft its parent names); null: the run directory's drafts/
    drafts: dict[str, str | None] | None = None
    # lookup drafts (decode/ngram.py, settings decode.lookup) evaluated beside the trained ones, each under its kind's
    # name: prompt_lookup | suffix; [] for none
    lookup_drafts: list[str] = field(default_factory=lambda: ["prompt_lookup", "suffix"])
    # a lookup of each kind listed put in front of every trained token draft evaluated (decode/hybrid.py): the lookup
    # proposes where the text matches, the draft elsewhere; named <kind>+<draft>; [] for none
    hybrid_lookups: list[str] = field(default_factory=list)
    # domain -> the sampling its traffic is decoded with instead of decode's ({do_sample, temperature, top_k, top_p}):
    # e.g. clinical notes greedy and open chat sampled at temperature 1 in one evaluation
    domain_sampling: dict[str, Any] | None = None
    max_prompts: int = 16  # prompts per built-in domain (a user file in extra_domains: every record)
    max_new_tokens: int = 64  # tokens generated per prompt
    max_prompt_tokens: int = 192  # longer prompts: see prompt_overflow
    prompt_overflow: str = "truncate_left"  # truncate_left (keep the last max_prompt_tokens, warn) | error
    check_lossless: bool = True  # compare speculative greedy output with target-only greedy output
    cost_ratio_trials: int = 20  # forwards timed per model to measure the cost ratio c
    num_draft_tokens: list[int] | None = None  # sweep of gamma values; null: just decode.num_draft_tokens
    # draft-length policies measured beside the fixed-gamma sweep (fixed | adaptive | confidence, parameters from
    # decode.*); null: just decode.draft_length_policy. The fixed sweep is always measured.
    draft_length_policies: list[str] | None = None
    # token trees measured beside the chain (decode.tree, batch 1 per prompt, as the rest of eval): a branching list
    # [3, 2, 1] for one static tree, or a list of shape strings ["3,2,1", "2,2,1,1/10", "dynamic:6,4,16"]
    # (decode.parse_draft_tree); each is reported as the policy "tree:<shape>"; null: no tree.
    draft_tree: list[Any] | None = None
    bootstrap_samples: int = 1000  # resamples of the prompts for the 95% confidence intervals (0: none)
    confidence: float = 0.95  # level of the bootstrap percentile intervals, in (0, 1)
    alert_mean_accepted_length: float = 2.0  # the verdict flags domains whose tau is below this (tokens/step)
    # a setting whose tau is below this is never recommended nor routed: it cannot pay for its draft and verify
    # forwards (eval/decision.py, paying_settings); break_even: each setting's own break-even tau at its measured
    # draft cost c and verify cost v (tau_floor in eval/decision.py)
    min_mean_accepted_length: Any = 1.5
    plots: bool = True  # write plots/*.png (matplotlib, Agg)
    num_threads: int | None = None  # torch CPU threads while timing (null: leave torch's setting)
    device: str | None = None  # cpu | cuda | cuda:N; null: cuda when torch sees a GPU, else cpu
    dtype: str | None = None  # float32 | bfloat16 | float16; null: bfloat16 on a GPU, float32 on CPU
    timing_trials: int = 1  # timed repetitions of every decode (paired speculative / target-only, interleaved)
    noisy_relative_width: float = 0.5  # a domain's timing is noisy when its speedup interval is wider than this x
    # the estimate (or other processes kept a quarter core busy: eval.evaluate.load_record)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)  # projected speedup (see the class)
    engine: EngineConfig = field(default_factory=EngineConfig)  # llama.cpp beside our decoder (see the class)
    heldout: HeldoutConfig = field(default_factory=HeldoutConfig)  # held-out acceptance per draft position

    def __post_init__(self):
        for key, low in (("max_prompts", 1), ("max_new_tokens", 1), ("max_prompt_tokens", 2)):
            if getattr(self, key) < low:
                raise ValueError(f"eval.{key} must be >= {low}, got {getattr(self, key)}")
        if self.prompt_overflow not in ("truncate_left", "error"):
            raise ValueError(f"eval.prompt_overflow must be truncate_left or error, got {self.prompt_overflow!r}")
        if self.cost_ratio_trials < 1:
            raise ValueError(f"eval.cost_ratio_trials must be >= 1, got {self.cost_ratio_trials}")
        if not self.domains and not self.extra_domains:
            raise ValueError("eval.domains must list at least one domain (or give eval.extra_domains)")
        if self.drafts:
            self.drafts = {n: p for n, p in self.drafts.items() if p is not None}
        if self.drafts:
            from data.registry import check_report_name

            for name, path in self.drafts.items():
                check_report_name(name, "eval.drafts")
                if not isinstance(path, (str, os.PathLike)):
                    kind = "mapping" if isinstance(path, Mapping) else "list" if isinstance(path, Sequence) \
                        else type(path).__name__
                    raise ValueError(f"eval.drafts.{name} must be a path to a draft (a string), got a {kind}: "
                                     f"eval.drafts='{{{name}: /path/to/draft}}'")
        from decode.ngram import NGRAM_KINDS

        from core.errors import did_you_mean

        for key, kinds in (("lookup_drafts", self.lookup_drafts), ("hybrid_lookups", self.hybrid_lookups)):
            bad = [k for k in kinds if k not in NGRAM_KINDS]
            if bad:
                hint = did_you_mean(str(bad[0]), NGRAM_KINDS)
                raise ValueError(f"eval.{key}: unknown lookup kind {bad[0]!r} (the kinds: {', '.join(NGRAM_KINDS)})"
                                 f"{f'; {hint}' if hint else ''}")
            if len(set(kinds)) != len(kinds):
                raise ValueError(f"eval.{key} must list each of {list(NGRAM_KINDS)} at most once ([] for none), "
                                 f"got {list(kinds)}")
        self.check_domain_sampling()
        if self.num_draft_tokens is not None:
            if not self.num_draft_tokens or any(g < 1 for g in self.num_draft_tokens):
                raise ValueError(f"eval.num_draft_tokens must be null or a non-empty list of integers >= 1, "
                                 f"got {self.num_draft_tokens}")
        if self.draft_length_policies is not None:
            from decode.config import DRAFT_LENGTH_POLICIES

            bad = [p for p in self.draft_length_policies if p not in DRAFT_LENGTH_POLICIES]
            if not self.draft_length_policies or bad:
                raise ValueError(f"eval.draft_length_policies must be null or a non-empty list of "
                                 f"{', '.join(DRAFT_LENGTH_POLICIES)}, got {self.draft_length_policies}")
        self.trees()  # ValueError naming eval.draft_tree
        if self.bootstrap_samples < 0:
            raise ValueError(f"eval.bootstrap_samples must be >= 0 (0 disables the intervals), "
                             f"got {self.bootstrap_samples}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"eval.confidence must be in (0, 1), got {self.confidence}")
        from eval.decision import check_tau_floor

        self.min_mean_accepted_length = check_tau_floor(self.min_mean_accepted_length)
        if self.alert_mean_accepted_length < 0:
            raise ValueError(f"eval.alert_mean_accepted_length must be >= 0 tokens, got "
                             f"{self.alert_mean_accepted_length}")
        if self.timing_trials < 1:
            raise ValueError(f"eval.timing_trials must be >= 1, got {self.timing_trials}")
        if not self.noisy_relative_width > 0:
            raise ValueError(f"eval.noisy_relative_width must be > 0, got {self.noisy_relative_width}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"eval.num_threads must be null or >= 1, got {self.num_threads}")
        self.torch_device()  # DeviceError (a ValueError): e.g. eval.device=cuda on a machine without a GPU
        self.torch_dtype()
        from data.loading import find_declared
        from data.registry import DOMAINS

        extra = [e.name for e in self.extra_domains]
        for e in self.extra_domains:
            if e.name in DOMAINS or find_declared(e.name) is not None:
                raise ValueError(f"eval.extra_domains: name {e.name!r} is a registered domain; pick another name")
        if len(set(extra)) != len(extra):
            raise ValueError(f"eval.extra_domains: duplicate names {extra}")
        for d in self.domains:
            if d not in extra:
                from data.loading import get_domain

                get_domain(d)  # UnknownDomainError (a ValueError) listing the known names

    def torch_device(self):
        """``eval.device`` resolved on this machine (:func:`core.runtime.resolve_device`; raises DeviceError)."""
        import os

        from core.runtime import resolve_device

        try:
            return resolve_device(self.device, "eval.device")
        except ValueError as e:
            if self.device is not None and os.environ.get("SPECDRAFT_EVAL_DEVICE") == self.device:
                raise type(e)(f"{e} (eval.device={self.device} came from the environment variable "
                              f"SPECDRAFT_EVAL_DEVICE: unset it or set it to cpu, cuda or cuda:N)") from None
            raise

    def torch_dtype(self):
        """``eval.dtype`` resolved for :meth:`torch_device` (:func:`core.runtime.resolve_dtype`)."""
        from core.runtime import resolve_dtype

        return resolve_dtype(self.dtype, self.torch_device(), "eval.dtype")

    _DECODE_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0}  # greedy, as decode's

    def check_domain_sampling(self) -> None:
        """Raises ValueError: a ``domain_sampling`` entry for a domain the evaluation does not decode, a key other
        than ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p``, or settings the decoder refuses."""
        from decode.sampling import validate_sampling_args

        keys = ("do_sample", "temperature", "top_k", "top_p")
        for d, kw in (self.domain_sampling or {}).items():
            if d not in self.all_domains():
                raise ValueError(f"eval.domain_sampling.{d}: {d!r} is not among the evaluated domains "
                                 f"{self.all_domains()}; add it to eval.domains or drop the entry")
            if not isinstance(kw, Mapping) or set(kw) - set(keys):
                raise ValueError(f"eval.domain_sampling.{d} must map some of {list(keys)} to values, got {kw!r}: "
                                 f"e.g. eval.domain_sampling='{{{d}: {{do_sample: true, temperature: 1.0}}}}'")
            if "do_sample" in kw and not isinstance(kw["do_sample"], bool):
                raise ValueError(f"eval.domain_sampling.{d}.do_sample must be true or false, got {kw['do_sample']!r}")
            try:
                validate_sampling_args(**{**self._DECODE_DEFAULTS, **kw})
            except ValueError as e:
                raise ValueError(f"eval.domain_sampling.{d}: {e}") from None

    def sampling_for(self, domain: str, default: dict) -> dict:
        """The sampling keyword arguments ``domain`` decodes with: ``default`` (decode's) updated by its
        ``domain_sampling`` entry (``{}``: greedy).

        Raises:
            ValueError: the merged settings are ones the decoder refuses, or the entry sets temperature, top_k or
                top_p for a domain decoded greedily (names the entry)."""
        entry = (self.domain_sampling or {}).get(domain, {})
        kw = {**self._DECODE_DEFAULTS, **default, **entry}
        if not kw["do_sample"]:
            from decode.config import ignored_sampling_keys

            unused = ignored_sampling_keys(False, {k: v for k, v in entry.items() if k != "do_sample"})
            if unused:
                raise ValueError(f"eval.domain_sampling.{domain} sets {', '.join(unused)}, which only act{'s' if len(unused) == 1 else ''} when "
                                 f"sampling, and {domain} decodes greedily: add do_sample: true to its entry "
                                 f"(eval.domain_sampling='{{{domain}: {{do_sample: true, ...}}}}')")
            return {}
        from decode.sampling import validate_sampling_args

        try:  # with decode's settings merged in (decode.do_sample=true and a domain's temperature 0)
            validate_sampling_args(**kw)
        except ValueError as e:
            raise ValueError(f"eval.domain_sampling.{domain} with decode's settings: {e}") from None
        return {"do_sample": True, "temperature": float(kw["temperature"]), "top_k": int(kw["top_k"]),
                "top_p": float(kw["top_p"])}

    def all_domains(self) -> list[str]:
        """``domains`` then any extra domain not already listed, in order, without duplicates."""
        out = list(dict.fromkeys(self.domains))
        return out + [e.name for e in self.extra_domains if e.name not in out]

    def sweep(self, default: int) -> list[int]:
        """The gamma values to measure: the sweep sorted without duplicates, or ``[default]``."""
        return sorted(set(self.num_draft_tokens)) if self.num_draft_tokens else [default]

    def trees(self) -> list:
        """The token-tree shapes of ``draft_tree`` (:class:`decode.tree.DraftTree`), in order, no duplicates.

        Raises:
            ValueError: a shape :func:`decode.parse_draft_tree` refuses, with the key named.
        """
        from decode.tree import parse_draft_tree

        if not self.draft_tree:
            return []
        items = list(self.draft_tree)
        try:
            if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
                return [parse_draft_tree(items)]  # one branching list
            trees = [parse_draft_tree(x if isinstance(x, str) else list(x)) for x in items]
        except (TypeError, ValueError) as e:
            raise ValueError(f"eval.draft_tree: {e}") from None
        if any(t is None for t in trees):
            raise ValueError(f"eval.draft_tree has an empty shape, got {items}")
        return list({t.spec(): t for t in trees}.values())

    def policies(self, default: str) -> list[str]:
        """The draft-length policies other than ``fixed`` to measure beside the fixed sweep, in order, no
        duplicates: ``draft_length_policies``, else ``[default]`` (``decode.draft_length_policy``)."""
        names = self.draft_length_policies if self.draft_length_policies else [default]
        return [p for p in dict.fromkeys(names) if p != "fixed"]


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "specdraft"  # wandb project
    entity: str | None = None  # wandb entity (team or user); null: the default
    mode: str = "offline"  # wandb mode: offline (default, never uploads) | online | disabled
    dir: str | None = None  # where wandb writes its run folder; null: the run directory
    tags: list[str] = field(default_factory=list)
    log_per_prompt: bool = True  # also log per_prompt.csv as a wandb.Table

    def __post_init__(self):
        if self.name not in ("none", "wandb"):
            raise ValueError(f"logger.name must be none or wandb, got {self.name!r}")
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {self.mode!r}")


@dataclass
class EvalRootConfig:
    """The sections ``python -m eval`` reads (the rest of the tree is ignored there)."""

    seed: int = 0
    experiment_name: str = "eval"
    paths: PathsConfig = field(default_factory=PathsConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def __post_init__(self):
        for name in self.eval.policies(self.decode.draft_length_policy):
            self.decode.check_policy(name)  # e.g. adaptive needs decode.num_draft_tokens within its bounds
        # the gammas the evaluation sweeps (eval.num_draft_tokens, else decode.num_draft_tokens): no step drafts more
        # than the tokens left, and a huge gamma only bloats the expected-speedup curves and plots
        over = [g for g in self.eval.sweep(self.decode.num_draft_tokens) if g > self.eval.max_new_tokens]
        if over:
            key = "eval.num_draft_tokens" if self.eval.num_draft_tokens else "decode.num_draft_tokens"
            raise ValueError(f"{key} {over} exceed eval.max_new_tokens={self.eval.max_new_tokens}: no verify step "
                             f"can draft more tokens than are left to generate. Use gammas <= "
                             f"{self.eval.max_new_tokens}, or raise eval.max_new_tokens")


EVAL_SECTIONS = tuple(EvalRootConfig.__dataclass_fields__)  # the top-level keys python -m eval reads


def validate_eval(cfg: Any) -> EvalRootConfig:
    return validate_structured(EvalRootConfig, cfg, keys=EVAL_SECTIONS)


# ------------------------------------------------------------------ the drafts the config names
def _named_paths(rc) -> dict[str, str]:
    """name -> path of the drafts the config names: with ``decode.draft_routing`` the table's routes to a draft
    (over ``eval``'s domains), else ``eval.drafts``."""
    if not rc.decode.draft_routing:
        return {n: str(q) for n, q in (rc.eval.drafts or {}).items()}
    from decode.config import load_routing

    table = load_routing(rc.decode.draft_routing, check_paths=False)
    return {r.draft: r.path for r in (table.draft_for(d) for d in rc.eval.all_domains()) if not r.target_only}


def lookup_specs(rc) -> dict[str, str]:
    """name -> ``ngram:<kind>`` of the lookup drafts (decode/ngram.py) the evaluation decodes: with
    ``decode.draft_routing`` the table's, else ``eval.lookup_drafts`` (named by kind) and the ``eval.drafts`` entries
    that name one.

    Raises:
        ValueError: an ``ngram:<kind>`` with an unknown kind (names the kinds)."""
    from decode.ngram import lookup_spec, parse_lookup_spec

    out = {} if rc.decode.draft_routing else {k: lookup_spec(k) for k in rc.eval.lookup_drafts}
    out.update({n: q for n, q in _named_paths(rc).items() if parse_lookup_spec(q)})
    return out


def hybrid_specs(rc) -> dict[str, tuple[str, Path]]:
    """name -> ``(lookup kind, trained draft directory)`` of the hybrids (decode/hybrid.py) named by path,
    ``ngram:<kind>+<draft dir>``: with ``decode.draft_routing`` the table's, else ``eval.drafts``'s (the ones
    ``eval.hybrid_lookups`` makes are added after the trained drafts load: :func:`_add_hybrids`).

    Raises:
        ValueError: a spec with an unknown kind or no draft directory."""
    from decode.hybrid import parse_hybrid_spec

    specs = {n: parse_hybrid_spec(q) for n, q in _named_paths(rc).items()}
    return {n: (h[0], Path(h[1]).expanduser()) for n, h in specs.items() if h is not None}


def in_run(p, run_dir: Path) -> Path:
    """A draft path as the evaluation reads it: ``drafts/<name>`` is the run directory's, unless only the working
    directory has it."""
    p = Path(p).expanduser()
    if p.is_absolute() or p.parts[:1] != ("drafts",):
        return p
    in_run = Path(run_dir) / p
    return in_run if in_run.exists() or not p.exists() else p


def hybrid_paths(rc, run_dir: Path) -> dict[str, Path]:
    """name -> the trained draft behind each hybrid named by path (``ngram:<kind>+<draft dir>``,
    :func:`eval.config.hybrid_specs`), read as :func:`in_run` reads a draft path."""
    return {n: in_run(p, run_dir) for n, (_, p) in hybrid_specs(rc).items()}


def hybrid_head_error(name: str, kind: str, path) -> ValueError:
    """The error for a hybrid (``ngram:<kind>+<dir>``) whose draft is an EAGLE-3 head: a head drafts from the
    target's features, which a lookup in front of it does not give (decode/hybrid.py)."""
    return ValueError(f"draft {name!r}: a hybrid (ngram:{kind}+<dir>) needs a trained token draft behind the lookup, "
                      f"and {path} is an EAGLE-3 head; evaluate the head on its own instead "
                      f"(eval.drafts.{name}={path}), or put a token draft behind the lookup")


def check_draft_names(rc, paths: dict[str, Path]) -> None:
    """Every draft the evaluation decodes has a name of its own: the checkpoints (``paths``), the lookups
    (:func:`lookup_specs`), the hybrids named by path (:func:`hybrid_specs`) and the ones ``eval.hybrid_lookups``
    makes (``<kind>+<draft>``).

    Raises:
        ValueError: two of them share a name (names both and how to rename one)."""
    from decode.hybrid import hybrid_name
    from models.eagle3 import is_eagle3_dir

    taken: dict[str, str] = {}

    def claim(name: str, what: str) -> None:
        if name in taken:
            raise ValueError(f"two drafts are named {name!r}: {taken[name]} and {what}. Rename the eval.drafts entry "
                             f"(eval.drafts='{{another_name: ...}}'), or drop one of them")
        taken[name] = what

    for n, p in paths.items():
        claim(n, f"the checkpoint {p}")
    for n, spec in lookup_specs(rc).items():
        claim(n, f"the lookup draft {spec}")
    for n, (kind, p) in hybrid_specs(rc).items():
        claim(n, f"the hybrid ngram:{kind}+{p}")
    if not rc.decode.draft_routing:
        for kind in rc.eval.hybrid_lookups:
            for n, p in paths.items():
                if Path(p).is_dir() and not is_eagle3_dir(p):
                    claim(hybrid_name(kind, n), f"the hybrid eval.hybrid_lookups makes of {n!r}")
