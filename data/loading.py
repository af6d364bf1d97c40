"""Load a domain's records into a ``datasets.DatasetDict`` with deterministic train/validation/test splits.

Columns: ``id`` (``"{domain}/{source}/{record_id}"``), ``source``, ``prompt``, ``completion`` (the plain
rendering) and ``messages`` (a chat record's conversation as JSON, ``""`` for others; :mod:`data.chat` renders it in
the target's chat template).
Files come from the data root (see :mod:`data.paths`); with ``data.source=hub`` from the Hugging Face hub.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import datasets

from .errors import DataFormatError, DataSourceError
from .paths import ENV_DATA_ROOT, resolve_data_root
from .readers import reader
from .domains import get_domain
from .registry import Domain, Example, Source
from .splits import SPLITS, assign_split, hash_unit

log = logging.getLogger(__name__)

SOURCE_MODES = ("root", "hub", "auto")
COLUMNS = ("id", "source", "prompt", "completion", "messages")


@dataclass(frozen=True)
class DataOptions:
    """How to find and split the data (mirrors the ``data`` config group)."""

    root: str | None = None
    source: str = "root"  # root | hub | auto (root, then hub for files that are missing)
    validation_fraction: float = 0.05
    test_fraction: float = 0.1


def _source_path(source: Source, root: Path | None) -> Path | None:
    """Where a source's file is: its own absolute path (user files), else relative to the data root."""
    if Path(source.file).is_absolute():
        return Path(source.file)
    return (root / source.file) if root else None


def _missing_file_error(source: Source, root: Path | None, domain: str, description: str = "") -> DataSourceError:
    if source.declaration and Path(source.file).is_absolute():  # a declared domain's own file
        return DataSourceError(
            f"missing data file for domain {domain!r}: {source.file} does not exist ({description}). Fix its path in "
            f"the domain's declaration (conf/domain/{domain}.yaml or data.declared_domains) or create the file.")
    where = f"data root {root}" if root else "no data root (data.root unset, $SPECDRAFT_DATA_ROOT unset, no ../shared/data)"
    hub = (
        f"or read it from the hub with data.source=hub (dataset {source.hub.path!r}"
        + (f", config {source.hub.name!r}" if source.hub.name else "") + ")"
        if source.hub
        else "(this source has no hub copy, so it must come from a data root)"
    )
    return DataSourceError(
        f"missing data file for domain {domain!r}: {source.file} (looked in {where}). Supply it either through a "
        f"data root that contains {source.file} (set data.root=/path/to/data or export {ENV_DATA_ROOT}=/path/to/data) "
        f"{hub}."
    )


def check_data_root(root: str | os.PathLike | None, source: str = "root") -> None:
    """Raise :class:`DataSourceError` when an explicitly set data root (``data.root`` or ``$SPECDRAFT_DATA_ROOT``)
    is not an existing folder (with ``data.source=hub`` no data root is read, so none is checked)."""
    if source == "hub":
        return
    explicit = root not in (None, "", "null")
    where = "data.root" if explicit else f"${ENV_DATA_ROOT}"
    value = root if explicit else os.environ.get(ENV_DATA_ROOT)
    if not value:
        return
    p = Path(str(value)).expanduser()
    if not p.is_dir():
        what = "is a file, not a folder" if p.exists() else "does not exist"
        raise DataSourceError(
            f"data root {p} ({where}) {what}. Set data.root=/path/to/data (or export {ENV_DATA_ROOT}=/path/to/data) "
            f"to the folder holding the domain files (its MANIFEST.md lists them; by default ../shared/data beside the "
            f"repository), or read from the hub with "
            f"data.source=hub."
        )


def _records_from_file(source: Source, path: Path) -> Iterable[tuple[Any, Any]]:
    if path.is_file() and path.stat().st_size == 0:
        raise DataFormatError(f"{path}: the file is empty. Replace it with the published file or remove the source.")
    try:
        n = 0
        for rec in reader(source.format)(path):
            n += 1
            yield rec
        if n == 0:
            raise DataFormatError(f"{path}: no records (the file holds only blank lines or an empty container). "
                                  f"Replace it with the published file or remove the source.")
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not valid UTF-8 (byte {e.object[e.start]:#04x} at byte offset {e.start}); "
                              f"re-save the file as UTF-8.") from None


def _records_from_hub(source: Source) -> Iterable[tuple[Any, Any]]:
    assert source.hub is not None
    try:
        ds = datasets.load_dataset(source.hub.path, source.hub.name, split=source.hub.split)
    except Exception as e:  # network, auth, missing dataset: all end the same way for the user
        raise DataSourceError(
            f"could not load {source.hub.path!r} from the hub for source {source.name!r} ({type(e).__name__}: {e}). "
            f"Check the network / HF_TOKEN, or use a data root with {source.file} (data.root or ${ENV_DATA_ROOT})."
        ) from e
    for i, row in enumerate(ds):
        yield i, (source.hub.to_local(row) if source.hub.to_local else row)


def format_records(domain: str, source: Source, records: Iterable[tuple[Any, Any]], origin: str) -> Iterable[Example]:
    """Turn raw ``(position, record)`` pairs into :class:`Example` s; field errors name ``origin`` and the line."""
    for pos, rec in records:
        where = f"{origin}:{pos}" if isinstance(pos, int) else f"{origin} (record {pos})"

        def get(name: str, _rec=rec, _where=where):
            if not isinstance(_rec, dict):
                raise DataFormatError(f"{_where}: expected a JSON object with field {name!r}, got "
                                      f"{type(_rec).__name__}.")
            if name not in _rec:
                raise DataFormatError(f"{_where}: field {name!r} is missing (record has: {sorted(_rec)}); add it or "
                                      f"configure the field that holds the text.")
            if _rec[name] is None:
                raise DataFormatError(f"{_where}: field {name!r} is null (not set); give it a value or remove the "
                                      f"record.")
            return _rec[name]

        try:
            formatted = source.format_record(rec, get)
        except DataFormatError as e:
            msg = str(e)
            raise DataFormatError(msg if msg.startswith(origin) else f"{where}: {msg}") from None
        if formatted is None:
            continue
        prompt, completion, *rest = formatted
        messages = tuple(tuple(m) for m in rest[0]) if rest and rest[0] else None
        if not (prompt or completion).strip():
            continue
        if source.record_id and isinstance(rec, dict) and rec.get(source.record_id) is not None:
            rid = str(rec[source.record_id])
        else:
            rid = str(pos)
        yield Example(f"{domain}/{source.name}/{rid}", prompt, completion, messages)


def iter_examples(domain: Domain | str, opts: DataOptions = DataOptions()) -> Iterable[tuple[Example, str]]:
    """Yield ``(example, split)`` for every record of every source of ``domain``.

    Raises:
        DataSourceError: a file is missing (message names the file and both ways to supply it).
        DataFormatError: a file cannot be parsed or lacks a field (message names file and line).
    """
    dom = get_domain(domain) if isinstance(domain, str) else domain
    if opts.source not in SOURCE_MODES:
        raise ValueError(f"data.source must be one of {SOURCE_MODES}, got {opts.source!r}")
    root = resolve_data_root(opts.root)
    for source in dom.sources:
        if not Path(source.file).is_absolute():  # user files (absolute paths) need no data root
            check_data_root(opts.root, opts.source)
        path = _source_path(source, root)
        if source.format == "hub":  # a declared hub-only source: read only when asked for
            if opts.source != "hub":
                raise DataSourceError(
                    f"domain {dom.name!r} file {source.file} is a hub dataset; it is read only with data.source=hub "
                    f"(or give a local copy as a file of the domain).")
            records, origin = _records_from_hub(source), f"hub:{source.hub.path}"
        elif opts.source == "hub" and source.hub is None and path is not None and path.exists():
            records, origin = _records_from_file(source, path), str(path)
        elif opts.source == "hub" or (opts.source == "auto" and (path is None or not path.exists()) and source.hub):
            if source.hub is None:
                raise _missing_file_error(source, root, dom.name, dom.description)
            records, origin = _records_from_hub(source), f"hub:{source.hub.path}"
        elif path is None or not path.exists():
            raise _missing_file_error(source, root, dom.name, dom.description)
        else:
            records, origin = _records_from_file(source, path), str(path)
        for ex in format_records(dom.name, source, records, origin):
            yield ex, assign_split(ex.id, opts.validation_fraction, opts.test_fraction, source.split_policy)


def order_key(record_id: str) -> float:
    """The position key of a record within its split: :func:`data.splits.hash_unit` of ``"order/<id>"``,
    independent of the hash that assigned the split (see :func:`load_domain`)."""
    return hash_unit("order/" + record_id)


def load_domain(domain: Domain | str, opts: DataOptions = DataOptions()) -> datasets.DatasetDict:
    """All of a domain's records as a ``DatasetDict`` with ``train``, ``validation`` and ``test`` splits.

    Rows in each split are ordered by a hash of their id salted apart from the split hash (a deterministic shuffle
    that depends neither on file order nor on how a record reached its split), so taking the first N gives a fixed,
    well-mixed sample. Ordering by the split hash itself put the records of fixed-split sources first: in medical's
    train split, MTS-Dialog's training file (split policy ``train``, its hashes uniform over [0, 1)) filled the
    hashes [0.05, 0.15) that the hash-split sources leave to test and validation, so 120 of the first 256 prompts were
    dialogue summaries (11 % of the split) against 108 questions (72 %).
    """
    from .chat import encode_messages

    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for ex, split in iter_examples(domain, opts):
        rows[split].append({"id": ex.id, "source": ex.id.split("/")[1], "prompt": ex.prompt, "completion": ex.completion,
                            "messages": encode_messages(ex.messages)})
    features = datasets.Features({k: datasets.Value("string") for k in COLUMNS})
    out = {}
    for s, r in rows.items():
        r.sort(key=lambda row: order_key(row["id"]))
        # from columns, not from_list: from_list([]) fails (no columns), and a split can be empty (test-only domains)
        out[s] = datasets.Dataset.from_dict({k: [row[k] for row in r] for k in features}, features=features)
    return datasets.DatasetDict(out)


def eval_prompts(domain: Domain | str, opts: DataOptions = DataOptions(), max_prompts: int | None = None,
                 tokenizer=None) -> list[Example]:
    """The evaluation prompts of a domain: the ``prompt`` part of its test records, in hash order; with
    ``tokenizer``, chat records are rendered in its chat template (:class:`data.chat.Renderer`).

    Raises:
        DataSourceError: the domain has no test records with a non-empty prompt.
    """
    from .chat import decode_messages, renderer

    render = renderer(tokenizer)
    ds = load_domain(domain, opts)["test"]
    out = []
    for r in ds:
        msgs = decode_messages(r["messages"])
        p, c = render(r["prompt"], r["completion"], msgs) if render else (r["prompt"], r["completion"])
        if p.strip():
            out.append(Example(r["id"], p, c, tuple(msgs) if msgs else None))
    if not out:
        name = domain if isinstance(domain, str) else domain.name
        raise DataSourceError(f"domain {name!r} has no test prompts; raise data.test_fraction or add a test file.")
    return out[:max_prompts] if max_prompts else out


def user_domain(name: str, path: str | os.PathLike, text_field: str, prompt_field: str | None = None,
                fmt: str | None = None, shape: str | None = None, field: str | None = None) -> Domain:
    """An ``eval.extra_domains`` file as a test-only domain; see :func:`data.declared.extra_domain`."""
    from .declared import extra_domain

    return extra_domain(name, path, text_field, prompt_field, fmt, shape, field)


def files_fingerprint(domain: Domain | str, opts: DataOptions = DataOptions()) -> str:
    """SHA-256 over the content of the domain's files under the data root (identifies the data a model saw)."""
    dom = get_domain(domain) if isinstance(domain, str) else domain
    root = resolve_data_root(opts.root)
    h = hashlib.sha256()
    for source in dom.sources:
        path = _source_path(source, root)
        h.update(source.name.encode())
        if source.declaration:  # a declared source: how its records are read is part of the data
            h.update(source.declaration.encode())
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path is not None and path.is_dir() else \
            [path] if path is not None and path.exists() else []
        for fp in files:  # a save_to_disk folder: every file in it
            with open(fp, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        if not files:
            h.update(f"hub:{source.hub.path if source.hub else None}".encode())
    return h.hexdigest()
