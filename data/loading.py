"""Load a domain's records into a ``datasets.DatasetDict`` with deterministic train/validation/test splits.

Columns: ``id`` (``"{domain}/{source}/{record_id}"``), ``source``, ``prompt``, ``completion`` (the plain
rendering) and ``messages`` (a chat record's conversation as JSON, ``""`` for others; :mod:`data.text` renders it in
the target's chat template).
Files come from the data root (see :mod:`data.loading`); with ``data.source=hub`` from the Hugging Face hub.

Where the data lives: the data root (``data.root`` / ``SPECDRAFT_DATA_ROOT`` / ``../shared/data``).

Domains declared in configuration (no Python): ``conf/domain/<name>.yaml`` or inline ``data.declared_domains``.

A declared domain is a list of files, each with a format and a record shape; its name then works wherever a
built-in domain does (``data.domain``, ``data.mixture``, ``eval.domains``, ``lora.domain``, teacher and on-policy
data), because :func:`data.loading.get_domain` falls back to it. ``eval.extra_domains`` entries are built here too
(:func:`extra_domain`), so one abstraction serves all three kinds. A declaration::

    description: our support chat logs            # optional
    root: /data/support                           # optional: relative file paths resolve here (else the data root)
    license: internal                             # optional, shown in the report's data sources
    files:
      - path: chats.jsonl
        format: jsonl        # jsonl | json | csv | parquet | text | disk | hub (default: from the suffix; a folder: disk)
        shape: messages      # text | prompt_completion | messages | conversations
        field: messages      # field holding the text / messages / conversations (default: text, messages, conversations)
        prompt_field: prompt           # shape prompt_completion
        completion_field: completion   # shape prompt_completion (a missing or null completion: a prompt only)
        as_chat: true        # prompt_completion: render as a user turn + assistant turn (false: raw text prompt)
        id_field: null       # field identifying a record (default: its line / row number)
        split: hash          # hash (deterministic split by record id) | train | validation | test (a split file)
        name: chats          # source name, part of every record id (default: the file's stem)
        disk_split: train    # format disk with a DatasetDict: which split to read
        hub: {path: org/dataset, name: null, split: train}   # format hub (read only with data.source=hub)

Shapes: ``text`` (one text field; a plain-text file's paragraphs): the whole text, used as training text and as
an evaluation prompt; ``prompt_completion``; ``messages`` (OpenAI: ``[{role, content}]``, roles system / user /
assistant, content a string or a list of ``{type: text, text}`` parts); ``conversations`` (ShareGPT:
``[{from, value}]``, from human / user / gpt / assistant / system). A conversation's last assistant turn is the
completion; the turns before it are the prompt (rendered with the target's chat template, :mod:`data.text`).

The one lookup of a domain name: a built-in domain (:mod:`data.registry`), else one declared in configuration
(:mod:`data.loading`). Everything that takes a domain name (``data.domain``, ``eval.domains``, ``lora.domain``,
mixtures, routing) resolves it here.

Deterministic train/validation/test splits by a hash of each record's id.

A record's split depends only on ``"{domain}/{source}/{record_id}"``, never on file order or on which other
files are present, so adding a file (or records) never moves an existing record to another split.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import datasets

from core.errors import DataFormatError, DataSourceError, UnknownDomainError, did_you_mean
from core.io import PROJECT_ROOT
from data.registry import (
    DOMAINS,  # noqa: F401  (re-exported: the name rule of domains)
    Domain,
    Example,
    HubSource,
    Source,
    check_report_name,
    reader,
    usable_name,
)
from data.text import ROLES, plain_render

ENV_DATA_ROOT = "SPECDRAFT_DATA_ROOT"


def default_data_root() -> Path | None:
    """The data root used when ``data.root`` is not set.

    Order: the environment variable ``SPECDRAFT_DATA_ROOT``; else the folder ``../shared/data`` next to the
    repository when it exists; else ``None`` (then only the hub can supply data).
    """
    env = os.environ.get(ENV_DATA_ROOT)
    if env:
        return Path(env).expanduser()
    beside = PROJECT_ROOT.parent / "shared" / "data"
    return beside if beside.is_dir() else None


def resolve_data_root(root: str | os.PathLike | None) -> Path | None:
    """``root`` if given (``~`` expanded), else :func:`default_data_root`."""
    if root not in (None, "", "null"):
        return Path(root).expanduser()
    return default_data_root()


log = logging.getLogger(__name__)

ENV_DOMAIN_DIRS = "SPECDRAFT_DOMAIN_DIRS"  # extra folders of <name>.yaml declarations (os.pathsep-separated)
FORMATS = ("jsonl", "json", "csv", "parquet", "text", "disk", "hub")
SHAPES = ("text", "prompt_completion", "messages", "conversations")
SPLIT_SOURCES = ("hash", "train", "validation", "test")
_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_DEFAULT_FIELD = {"text": "text", "messages": "messages", "conversations": "conversations"}
_FILE_KEYS = ("path", "format", "shape", "field", "prompt_field", "completion_field", "as_chat", "id_field", "split",
              "name", "disk_split", "hub")
_DOMAIN_KEYS = ("name", "description", "root", "license", "files")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bot": "assistant", "model": "assistant", "system": "system"}

_DECLARED: dict[str, Domain] = {}  # inline declarations (data.declared_domains) of this process


def domain_dirs() -> list[Path]:
    """Folders searched for ``<name>.yaml``: the project's ``conf/domain`` then ``$SPECDRAFT_DOMAIN_DIRS``."""
    extra = [Path(p).expanduser() for p in os.environ.get(ENV_DOMAIN_DIRS, "").split(os.pathsep) if p]
    return [PROJECT_ROOT / "conf" / "domain", *extra]


def declared_names() -> list[str]:
    names = set(_DECLARED)
    for d in domain_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


# --------------------------------------------------------------------------------------------- record shapes
def _content(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):  # OpenAI content parts
        texts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in texts) and texts:
            return "".join(texts)
    raise DataFormatError(f"{what} must be a string (or a list of {{type: text, text}} parts), got "
                          f"{type(value).__name__}")


def _turns(value: Any, field: str, role_key: str, content_key: str, roles: dict[str, str]) -> tuple:
    if not isinstance(value, list) or not value:
        raise DataFormatError(f"field {field!r} must be a non-empty list of turns, got "
                              f"{type(value).__name__ if not isinstance(value, list) else 'an empty list'}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise DataFormatError(f"field {field!r} turn {i}: expected an object with {role_key!r} and "
                                  f"{content_key!r}, got {m!r:.80}")
        role = roles.get(str(m[role_key]).lower())
        if role is None:
            raise DataFormatError(f"field {field!r} turn {i}: {role_key} {m[role_key]!r} is not one of "
                                  f"{', '.join(sorted(roles))}; fix the record or drop that turn")
        out.append((role, _content(m[content_key], f"field {field!r} turn {i} {content_key}")))
    if not any(r == "user" for r, _ in out):
        raise DataFormatError(f"field {field!r} has no user turn; a conversation needs at least one")
    return tuple(out)


def _formatter(shape: str, spec: dict):
    field = spec.get("field") or _DEFAULT_FIELD.get(shape)
    if shape == "text":
        def fmt(r, get):
            text = r if isinstance(r, str) else _content(get(field), f"field {field!r}")  # a number or a list: refused
            return (text.strip(), "") if text.strip() else None
    elif shape == "prompt_completion":
        pf, cf, as_chat = spec.get("prompt_field") or "prompt", spec.get("completion_field") or "completion", \
            spec.get("as_chat", True)

        def fmt(r, get):
            p = _content(get(pf), f"field {pf!r}")
            c = r.get(cf) if isinstance(r, dict) else None
            c = None if c is None else _content(c, f"field {cf!r}")
            if not as_chat:
                return p, c or ""
            messages = (("user", p),) + ((("assistant", c),) if c else ())
            return (*plain_render(messages), messages)
    elif shape in ("messages", "conversations"):
        keys = ("role", "content", {r: r for r in ROLES}) if shape == "messages" else ("from", "value", _SHAREGPT_ROLES)

        def fmt(r, get):
            messages = _turns(get(field), field, *keys)
            return (*plain_render(messages), messages)
    else:  # checked by the caller
        raise AssertionError(shape)
    return fmt


# --------------------------------------------------------------------------------------------- building
def _err(origin: str, msg: str) -> DataFormatError:
    return DataFormatError(f"{origin}: {msg}")


def _check_mapping(spec: Any, where: str, what: str, needs: str, keys: tuple) -> None:
    """``spec`` is a mapping whose keys are all in ``keys``, else a DataFormatError naming ``where`` and the fix."""
    if not isinstance(spec, dict):
        raise _err(where, f"{what} must be a mapping with {needs}, got {spec!r}")
    bad = [k for k in spec if k not in keys]
    if bad:
        raise _err(where, f"unknown key(s) {bad}; {what} has {', '.join(keys)}")


def build_domain(name: str, spec: dict, origin: str) -> Domain:
    """A :class:`Domain` from a declaration (a dict as in this module's docstring).

    Raises:
        DataFormatError: an unknown key, format, shape or split, no files, a hub file without ``hub.path``, each
            naming ``origin`` (the YAML file or the config key) and the fix.
    """
    check_report_name(name, f"domain declared in {origin}")
    _check_mapping(spec, origin, "a domain declaration", "'files'", _DOMAIN_KEYS)
    files = spec.get("files")
    if not files or not isinstance(files, list):
        raise _err(origin, "'files' must be a non-empty list of {path, format, shape, ...}")
    root = Path(str(spec["root"])).expanduser() if spec.get("root") else None
    sources, names = [], set()
    for i, f in enumerate(files):
        where = f"{origin} files[{i}]"
        _check_mapping(f, where, "a file entry", "path/format/shape", _FILE_KEYS)
        fmt = f.get("format")
        path = f.get("path")
        if fmt != "hub" and not path:
            raise _err(where, "'path' is missing; give the file (or a save_to_disk folder) to read")
        if fmt is None:
            p = Path(str(path))
            fmt = _SUFFIX.get(p.suffix.lower()) or ("disk" if p.suffix == "" else None)
            if fmt is None:
                raise _err(where, f"cannot tell the format of {path!r} from its suffix; set format: to one of "
                                  f"{', '.join(FORMATS)}")
        if fmt not in FORMATS:
            raise _err(where, f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        shape = f.get("shape") or ("text" if fmt == "text" else None)
        if shape not in SHAPES:
            raise _err(where, f"shape {shape!r} is not one of {', '.join(SHAPES)}; say how a record holds its text")
        if fmt == "text" and shape != "text":
            raise _err(where, "a plain-text file has shape text (one record per paragraph)")
        split = f.get("split", "hash")
        if split not in SPLIT_SOURCES:
            raise _err(where, f"split {split!r} is not one of {', '.join(SPLIT_SOURCES)}")
        hub = None
        if fmt == "hub":
            h = f.get("hub") or {}
            if not h.get("path"):
                raise _err(where, "format hub needs hub: {path: org/dataset, name: null, split: train}")
            hub = HubSource(str(h["path"]), h.get("name"), h.get("split") or "train")
            file = f"hub:{hub.path}"
        else:
            p = Path(str(path)).expanduser()
            file = str(p if p.is_absolute() else (root / p if root else p))
        sname = str(f.get("name") or (Path(str(path)).stem if path else hub.path.replace("/", "_")))
        if sname in names:
            sname = f"{sname}_{i}"
        names.add(sname)
        reader = {"json": "json_records", "disk": "disk", "parquet": "parquet"}.get(fmt, fmt)
        if fmt == "disk":
            reader = f"disk:{f.get('disk_split') or 'train'}"
        sources.append(Source(sname, file, reader, _formatter(shape, f), record_id=f.get("id_field"),
                              split_policy=split, hub=hub, license=str(spec.get("license") or "user data"),
                              declaration=json.dumps({**f, "file": file, "shape": shape}, sort_keys=True,
                                                     default=str)))
    return Domain(name, str(spec.get("description") or f"declared in {origin}"), tuple(sources), tags=("declared",))


def _load_yaml(path: Path) -> dict:
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(path)
        return OmegaConf.to_container(cfg, resolve=True)  # ${oc.env:...} works in a declaration
    except Exception as e:  # noqa: BLE001 - YAML syntax, a failing interpolation
        raise DataFormatError(f"{path}: cannot read the domain declaration ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]}); fix the YAML.") from None


def declare(name: str, spec: Any, origin: str | None = None) -> Domain:
    """Declare (or re-declare) domain ``name`` for this process (``data.declared_domains.<name>``)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(spec):
        spec = OmegaConf.to_container(spec, resolve=True)
    from data.registry import DOMAINS

    origin = origin or f"data.declared_domains.{name}"
    if name in DOMAINS:
        raise _err(origin, f"{name!r} is a built-in domain; declare yours under another name")
    dom = build_domain(name, dict(spec or {}), origin)
    _DECLARED[name] = dom
    return dom


def find_declared(name: str) -> Domain | None:
    """An inline declaration, else ``<name>.yaml`` in :func:`domain_dirs`, else None."""
    if name in _DECLARED:
        return _DECLARED[name]
    for d in domain_dirs():
        p = d / f"{name}.yaml"
        if p.is_file():
            spec = _load_yaml(p)
            if isinstance(spec, dict) and spec.get("name") not in (None, name):
                raise _err(str(p), f"declares name {spec['name']!r} but the file is {name}.yaml; make them agree")
            return build_domain(name, spec, str(p))
    return None


def extra_domain(name: str, path: str | os.PathLike, text_field: str, prompt_field: str | None = None,
                 fmt: str | None = None, shape: str | None = None, field: str | None = None) -> Domain:
    """An ``eval.extra_domains`` entry as a test-only declared domain (every record is an evaluation prompt).

    Without ``shape``: ``text_field`` alone is the prompt text (shape text); with ``prompt_field`` the record is
    prompt + completion (``text_field`` the completion), rendered as a chat turn.

    Raises:
        DataSourceError: the file does not exist. DataFormatError: an unsupported suffix / format / shape.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataSourceError(f"extra domain {name!r}: file {p} does not exist; fix its path in eval.extra_domains.")
    if fmt is None and p.is_file() and p.suffix.lower() not in _SUFFIX:
        raise DataFormatError(f"extra domain {name!r}: {p} must be .jsonl, .json, .csv, .parquet or .txt (or a "
                              f"save_to_disk folder), got {p.suffix!r}; or set its format.")
    if shape is None:
        shape = "prompt_completion" if prompt_field else "text"
    f = {"path": str(p.resolve()), "shape": shape, "split": "test", "name": name}
    if fmt:
        f["format"] = fmt
    if shape == "prompt_completion":
        f.update(prompt_field=prompt_field, completion_field=text_field if prompt_field else None)
    elif shape == "text":
        f["field"] = text_field
    elif field:
        f["field"] = field
    dom = build_domain(name, {"description": f"user file {p}", "files": [f]}, f"eval.extra_domains {name!r}")
    return dom


def unknown_domain_error(name: str, key: str = "eval.domains / data.domain") -> UnknownDomainError:
    """The error for an unknown domain ``name`` given under the config key ``key``: the known names and the fix."""
    from data.registry import DOMAINS

    dirs = " or ".join(str(d) for d in domain_dirs())
    usable = usable_name(name)
    known = [*DOMAINS, *declared_names()]
    starts = sorted(d for d in known if d.startswith(name)) if len(name) >= 3 else []
    hint = (f"did you mean one of {', '.join(starts)}?" if len(starts) > 1 else
            did_you_mean(name, known))  # specbench: the six specbench_* domains
    return UnknownDomainError(
        f"unknown domain {name!r}{f' ({hint})' if hint else ''}; known domains: "
        f"{', '.join(sorted(DOMAINS))}"
        + (f"; declared: {', '.join(declared_names())}" if declared_names() else "")
        + (f". Fix {key}, or declare it in {name}.yaml under {dirs} (see docs/own-traffic.md, "
           f"\"Train a draft for your own traffic\")." if usable else
           f". Fix {key} (a domain name is letters, digits and _ . + -, no spaces).")
    )


def get_domain(name: str, key: str = "eval.domains / data.domain") -> Domain:
    """Look up a domain: a built-in one, else one declared in configuration (:mod:`data.loading`:
    ``data.declared_domains.<name>`` or ``conf/domain/<name>.yaml``).

    Raises:
        UnknownDomainError: ``name`` is neither; the message names ``key``, lists the known names and how to
            declare one.
        DataFormatError: the declaration of ``name`` is invalid (names its file and the key).
    """
    if name in DOMAINS:
        return DOMAINS[name]
    dom = find_declared(name)
    if dom is None:
        raise unknown_domain_error(name, key) from None
    return dom


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



SOURCE_MODES = ("root", "hub", "auto")
COLUMNS = ("id", "source", "prompt", "completion", "messages")


@dataclass(frozen=True)
class DataOptions:
    """How to find and split the data (the ``data`` section of conf/config.yaml)."""

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
    except OSError as e:  # a folder where the file belongs, no read permission, an I/O error
        what, fix = (("a folder, not a file", "Replace the folder with") if path.is_dir() else
                     (f"cannot be read ({e.strerror or e})", "Make it readable, or replace it with"))
        raise DataFormatError(f"{path}: {what}. {fix} the published {path.name} (source {source.name!r}), or "
                              f"point data.root / ${ENV_DATA_ROOT} at a data root that has it.") from None


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
    """Turn raw ``(position, record)`` pairs into :class:`Example` s; field errors name ``origin`` and the line.

    Raises:
        DataFormatError: a record's field is missing, null or of the wrong type; every record of ``origin`` is
            blank (nothing would be read from it)."""
    seen = kept = 0
    for pos, rec in records:
        seen += 1
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
        kept += 1
        yield Example(f"{domain}/{source.name}/{rid}", prompt, completion, messages)
    if seen and not kept:
        raise DataFormatError(f"{origin}: all {seen} of its records are blank (empty or whitespace-only text): nothing "
                              "to read from it; fill them in, or drop the file")


def _where_to_read(dom: Domain, source: Source, opts: DataOptions, root: Path | None) -> tuple[str, Path | None]:
    """``("hub", None)`` or ``("file", path)``: where ``source`` of ``dom`` is read from under ``opts``.

    Raises:
        DataSourceError: the file is missing (or the data root is wrong) and no hub copy may be read."""
    if not Path(source.file).is_absolute():  # user files (absolute paths) need no data root
        check_data_root(opts.root, opts.source)
    path = _source_path(source, root)
    if source.format == "hub":  # a declared hub-only source: read only when asked for
        if opts.source != "hub":
            raise DataSourceError(
                f"domain {dom.name!r} file {source.file} is a hub dataset; it is read only with data.source=hub "
                f"(or give a local copy as a file of the domain).")
        return "hub", None
    if opts.source == "hub" and source.hub is None and path is not None and path.exists():
        return "file", path
    if opts.source == "hub" or (opts.source == "auto" and (path is None or not path.exists()) and source.hub):
        if source.hub is None:
            raise _missing_file_error(source, root, dom.name, dom.description)
        return "hub", None
    if path is None or not path.exists():
        raise _missing_file_error(source, root, dom.name, dom.description)
    return "file", path


def check_domain_files(domain: Domain | str, opts: DataOptions = DataOptions(), parse: bool = False) -> None:
    """Before any model loads: every source of ``domain`` can be read under ``opts`` (its file exists, or a hub copy
    is allowed), without reading it; with ``parse``, every local file is also parsed whole (hub copies are not
    fetched).

    Raises:
        DataSourceError: as :func:`iter_examples` would, naming the file and both ways to supply it.
        DataFormatError: (``parse``) a file that cannot be parsed or lacks a field, naming the file and line.
        UnknownDomainError: an unknown domain name."""
    for dom, source, where, path in _sources(domain, opts):
        if parse and where == "file":
            for _ in format_records(dom.name, source, _records_from_file(source, path), str(path)):
                pass


def _sources(domain: Domain | str, opts: DataOptions) -> Iterable[tuple[Domain, Source, str, Path | None]]:
    """``(domain, source, "hub" | "file", path)`` for every source of ``domain``, checked (:func:`_where_to_read`)."""
    dom = get_domain(domain) if isinstance(domain, str) else domain
    if opts.source not in SOURCE_MODES:
        raise ValueError(f"data.source must be one of {SOURCE_MODES}, got {opts.source!r}")
    root = resolve_data_root(opts.root)
    for source in dom.sources:
        yield (dom, source, *_where_to_read(dom, source, opts, root))


def has_prompts(domain: Domain | str, split: str, opts: DataOptions = DataOptions()) -> bool | None:
    """Whether ``split`` of ``domain`` holds a record with a non-empty prompt, reading its local files only as far
    as the first one (a plain-text corpus is read whole, about a second for 13 MB); None when a source would
    come from the hub (not fetched here).

    Raises:
        DataSourceError, DataFormatError: as :func:`iter_examples`."""
    if any(where == "hub" for _, _, where, _ in _sources(domain, opts)):
        return None
    return any(s == split and ex.prompt.strip() for ex, s in iter_examples(domain, opts))


def iter_examples(domain: Domain | str, opts: DataOptions = DataOptions()) -> Iterable[tuple[Example, str]]:
    """Yield ``(example, split)`` for every record of every source of ``domain``.

    Raises:
        DataSourceError: a file is missing (message names the file and both ways to supply it).
        DataFormatError: a file cannot be parsed or lacks a field (message names file and line).
    """
    for dom, source, where, path in _sources(domain, opts):
        if where == "hub":
            records, origin = _records_from_hub(source), f"hub:{source.hub.path}"
        else:
            records, origin = _records_from_file(source, path), str(path)
        for ex in format_records(dom.name, source, records, origin):
            yield ex, assign_split(ex.id, opts.validation_fraction, opts.test_fraction, source.split_policy)


def order_key(record_id: str) -> float:
    """The position key of a record within its split: :func:`data.loading.hash_unit` of ``"order/<id>"``,
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
    from data.text import encode_messages

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
    ``tokenizer``, chat records are rendered in its chat template (:class:`data.text.Renderer`).

    Raises:
        DataSourceError: the domain has no test records with a non-empty prompt.
    """
    from data.text import decode_messages, renderer

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
    """An ``eval.extra_domains`` file as a test-only domain; see :func:`data.loading.extra_domain`."""

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
