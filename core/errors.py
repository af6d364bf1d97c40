"""Errors raised by the data layer. Each message names the problem, where it is, and how to fix it.
"""
from __future__ import annotations



class SpecdraftDataError(ValueError):
    """Base class for data errors (a ``ValueError`` so callers can catch bad input generically)."""


class DataSourceError(SpecdraftDataError):
    """A data root or a data file is missing, or a hub dataset cannot be reached."""


class DataFormatError(SpecdraftDataError):
    """A data file exists but cannot be parsed (bad JSON/JSONL/CSV, missing field); names file and line."""


class UnknownDomainError(SpecdraftDataError):
    """A domain name that is not in the registry."""


class CheckpointError(ValueError):
    """A model directory that does not exist, is partial, or cannot be read; a ``specdraft.json`` that breaks its
    schema."""
