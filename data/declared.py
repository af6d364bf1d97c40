"""Domains declared in configuration (no Python): ``conf/domain/<name>.yaml`` or inline ``data.declared_domains``.

A declared domain is a list of files, each with a format and a record shape; its name then works wherever a
built-in domain does (``data.domain``, ``data.mixture``, ``eval.domains``, ``lora.domain``, teacher and on-policy
data), because :func:`data.registry.get_domain` falls back to it. ``eval.extra_domains`` entries are built here too
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
completion; the turns before it are the prompt (rendered with the target's chat template, :mod:`data.chat`).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .chat import ROLES, plain_render
from .errors import DataFormatError, DataSourceError, UnknownDomainError
from .paths import PROJECT_ROOT
from .registry import Domain, HubSource, Source, check_report_name, usable_name

log = logging.getLogger(__name__)

ENV_DOMAIN_DIRS = "SPECDRAFT_DOMAIN_DIRS"  # extra folders of <name>.yaml declarations (os.pathsep-separated)
FORMATS = ("jsonl", "json", "csv", "parquet", "text", "disk", "hub")
SHAPES = ("text", "prompt_completion", "messages", "conversations")
SPLITS = ("hash", "train", "validation", "test")
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
            text = r if isinstance(r, str) else get(field)
            return (str(text).strip(), "") if str(text).strip() else None
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
        if split not in SPLITS:
            raise _err(where, f"split {split!r} is not one of {', '.join(SPLITS)}")
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
    from .registry import DOMAINS

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


def unknown_domain_error(name: str) -> UnknownDomainError:
    from .registry import DOMAINS

    dirs = " or ".join(str(d) for d in domain_dirs())
    usable = usable_name(name)
    return UnknownDomainError(
        f"unknown domain {name!r}; known domains: {', '.join(sorted(DOMAINS))}"
        + (f"; declared: {', '.join(declared_names())}" if declared_names() else "")
        + (f". Fix eval.domains / data.domain, or declare it in {name}.yaml under {dirs} (see docs/own-traffic.md, "
           f"\"Train a draft for your own traffic\")." if usable else
           ". Fix eval.domains / data.domain (a domain name is letters, digits and _ . + -, no spaces).")
    )
