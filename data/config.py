"""The ``data`` config section (typed, range-checked): where the data lives, which domain trains the draft, how
records are split and packed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


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
            weights = dict(self.mixture)
            if not weights or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0
                                  or not math.isfinite(w) for w in weights.values()) \
                    or not math.isfinite(sum(weights.values())):  # 1e308 + 1e308: each finite, the total not
                raise ValueError(f"data.mixture must map domains to finite weights > 0 (numbers), got {weights}: e.g. "
                                 f"data.mixture='{{medical: 3, chat: 1}}'")
            from data.loading import get_domain

            for d in weights:
                get_domain(d, key="data.mixture")  # UnknownDomainError listing the known names

    def training_domains(self) -> dict[str, float]:
        """domain -> weight of the draft's training data: ``mixture``, else ``{domain: 1.0}``."""
        return dict(self.mixture) if self.mixture else {self.domain: 1.0}  # a data root that is set but missing: named before any work

    def options(self):
        from data.loading import DataOptions

        return DataOptions(root=self.root, source=self.source, validation_fraction=self.validation_fraction,
                           test_fraction=self.test_fraction)


