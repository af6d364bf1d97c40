"""The project's one error hierarchy. Every error a user can cause is a :class:`SpecdraftError`; its message names
the problem, where it is, and how to fix it. Bad input is also a ``ValueError`` (exit code 2 on the command line,
:func:`core.cli.classify`), a failed write an ``OSError`` (exit code 3), a failed engine a ``RuntimeError``.

::

    SpecdraftError
    ├── SpecdraftDataError (ValueError): DataSourceError, DataFormatError, UnknownDomainError
    ├── CheckpointError (ValueError): GGUFTargetError, SpecdraftMetaError, GGUFExportError
    ├── TokenizerMismatchError, VocabMismatchError, RoutingError, LoraError, DeviceError, BenchError,
    │   PromptTooLongError, RunDirInUseError (ValueError)
    ├── ArtifactWriteError (OSError)
    └── EngineError (RuntimeError)
"""
from __future__ import annotations


class SpecdraftError(Exception):
    """Base class of every error specdraft raises on purpose (bad input, a failed write, a failed engine)."""


class SpecdraftDataError(SpecdraftError, ValueError):
    """Base class for data errors (a ``ValueError`` so callers can catch bad input generically)."""


class DataSourceError(SpecdraftDataError):
    """A data root or a data file is missing, or a hub dataset cannot be reached."""


class DataFormatError(SpecdraftDataError):
    """A data file exists but cannot be parsed (bad JSON/JSONL/CSV, missing field); names file and line."""


class UnknownDomainError(SpecdraftDataError):
    """A domain name that is not in the registry."""


class CheckpointError(SpecdraftError, ValueError):
    """A model directory that does not exist, is partial, or cannot be read; a ``specdraft.json`` that breaks its
    schema."""


class DeviceError(SpecdraftError, ValueError):
    """A device or dtype setting this machine cannot honour (a ValueError: exit code 2 on the command line)."""


class ArtifactWriteError(SpecdraftError, OSError):
    """An artifact could not be written (full disk, read-only or unwritable folder). Earlier artifacts are intact."""


class TokenizerMismatchError(SpecdraftError, ValueError):
    """Target and draft tokenizers differ; the message lists every difference and how to fix it."""


class GGUFTargetError(CheckpointError):
    """The GGUF target cannot be found, read or converted; the message names the fix."""


class SpecdraftMetaError(CheckpointError):
    """A ``specdraft.json`` that is not valid JSON, not an object, or has a field of the wrong type."""


class RoutingError(SpecdraftError, ValueError):
    """A routing table that is missing, not valid, or has no route for a domain."""


class EngineError(SpecdraftError, RuntimeError):
    """The engine is missing, failed to start, or answered with an error; the message names the fix."""


class GGUFExportError(CheckpointError):
    """A checkpoint cannot be written as GGUF (unsupported architecture, missing tensor, bad type); names the fix."""


class VocabMismatchError(SpecdraftError, ValueError):
    """The target's and draft's output vocabularies cannot be aligned over the tokenizer's ids."""


class LoraError(SpecdraftError, ValueError):
    """Bad LoRA input: target modules absent from the draft, a base draft that cannot be found."""


class BenchError(SpecdraftError, ValueError):
    """Input the benchmark cannot run on (a device this machine lacks, a model directory that does not load, two
    tokenizers that differ, prompts too long for a model's context); the message is one line naming the flag."""


class PromptTooLongError(SpecdraftError, ValueError):
    """A prompt longer than ``eval.max_prompt_tokens`` with ``eval.prompt_overflow=error``."""


class RunDirInUseError(SpecdraftError, ValueError):
    """The run directory already holds another run's artifacts and neither resume nor overwrite was asked for."""


def closest_names(name: str, options, n: int = 2, leaf: bool = False) -> list[str]:
    """The ``options`` within difflib ratio 0.6 of ``name`` and within 0.1 of the best match, best first (so a clear
    winner is named alone); ``leaf``: compare ``name`` with the last dotted part of each option (config keys)."""
    import difflib

    part = (lambda k: k.rpartition(".")[2]) if leaf else (lambda k: k)
    scored = sorted(((difflib.SequenceMatcher(None, name, part(k)).ratio(), k) for k in options),
                    key=lambda t: (-t[0], t[1].count("."), t[1]))
    if not scored or scored[0][0] < 0.6:
        return []
    return [k for r, k in scored if r >= max(0.6, scored[0][0] - 0.1)][:n]


def did_you_mean(name: str, options, render=str, n: int = 2) -> str:
    """``"did you mean X?"`` (or ``X or Y``) for the options closest to a misspelt ``name`` (:func:`closest_names`),
    each written by ``render`` (e.g. as the override that selects it); ``""`` when none is close."""
    close = closest_names(name, options, n)
    return f"did you mean {' or '.join(render(c) for c in close)}?" if close else ""

