"""Deterministic train/validation/test splits by a hash of each record's id.

A record's split depends only on ``"{domain}/{source}/{record_id}"``, never on file order or on which other
files are present, so adding a file (or records) never moves an existing record to another split.
"""
from __future__ import annotations

import hashlib

SPLITS = ("train", "validation", "test")


def hash_unit(key: str) -> float:
    """Map ``key`` to a float in [0, 1) with SHA-256 (stable across Python processes, unlike ``hash``)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(key: str, validation_fraction: float, test_fraction: float, policy: str = "hash") -> str:
    """Split of one record.

    Args:
        key: stable record key, ``"{domain}/{source}/{record_id}"``.
        validation_fraction, test_fraction: shares in [0, 1) of records sent to validation and test (hash policy).
        policy: ``"hash"`` (train/validation/test by hash), ``"train"`` (train/validation only: a training file
            whose benchmark test set is a separate file), ``"test"`` (all test: a benchmark never trained on),
            ``"validation"`` (all validation: a user's own validation file).

    Raises:
        ValueError: fractions out of range or an unknown policy.
    """
    if not (0 <= validation_fraction < 1 and 0 <= test_fraction < 1 and validation_fraction + test_fraction < 1):
        raise ValueError(
            f"split fractions must be in [0, 1) with validation + test < 1; got validation={validation_fraction}, "
            f"test={test_fraction}. Fix data.validation_fraction / data.test_fraction."
        )
    if policy in ("test", "validation"):
        return policy
    u = hash_unit(key)
    if policy == "train":
        return "validation" if u < validation_fraction else "train"
    if policy == "hash":
        if u < test_fraction:
            return "test"
        if u < test_fraction + validation_fraction:
            return "validation"
        return "train"
    raise ValueError(f"unknown split policy {policy!r}; use 'hash', 'train', 'validation' or 'test'")
