"""The command line: what both entry points share around Hydra (preflight, one-line errors, exit codes). Where
models run (device, dtype, threads) is :mod:`core.runtime`.

What the entry points (``python -m train``, ``python -m eval``) share around Hydra: checking a command before
Hydra creates or touches the run directory, and turning errors into one clear line and an exit code.

Hydra writes ``.hydra/*.yaml`` and its log file into the run directory before the task function runs, so a bad
value rejected only inside the task would still have rewritten files of an existing run. :func:`preflight`
composes the same config with Hydra's compose API from the command line, runs the entry point's checks (typed
config, paths, tokenizers, the run-directory policy) and a write probe, and exits with the message before
``@hydra.main`` starts. The task function checks everything again (library users call ``run`` directly).

Exit codes (docs/faults.md):

* 2 (:data:`EXIT_BAD_INPUT`): bad config, data, checkpoint, tokenizer or run directory.
* 3 (:data:`EXIT_WRITE_FAULT`): an artifact could not be written (full disk, read-only folder); earlier ones intact.
* 4 (:data:`EXIT_DIVERGED`): training loss became NaN/inf; the last good checkpoint is kept.
* 130: interrupted (Ctrl-C); rerun with ``trainer.resume=true``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from core.errors import closest_names, did_you_mean
from core.groups import _keys_of_other_options, _override_key, group_misuse

EXIT_BAD_INPUT = 2
EXIT_WRITE_FAULT = 3
EXIT_DIVERGED = 4
EXIT_INTERRUPTED = 130

log = logging.getLogger("specdraft")


class _DropMessages(logging.Filter):
    """Drop log records whose message contains one of ``phrases`` (known-benign library chatter; accelerate
    prefixes its messages with ``[RANK n]``, so this matches anywhere in the message)."""

    def __init__(self, *phrases: str):
        super().__init__()
        self.phrases = phrases

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(p in msg for p in self.phrases)


def quiet_libraries() -> None:
    """Keep a run's output to progress and what matters; called by both entry points before any library loads.

    * DeepSpeed (imported by accelerate) warns "Setting accelerator to CPU. If you have GPU ..." on every CPU-only
      run; with no CUDA device we name its accelerator ourselves (``DS_ACCELERATOR=cpu``, unless the user set one).
    * accelerate warns "Removed shared tensor {'lm_head.weight'} while saving" at every checkpoint of a draft with
      tied embeddings: safetensors stores the tied matrix once and ``from_pretrained`` re-ties it, as intended.
    * gguf warns "Unknown separator token '<s>' in TemplateProcessing<pair>" at every GGUF export of a draft whose
      tokenizer's sentence-pair template puts BOS between the two texts: that template only sets llama.cpp's
      ``add_sep`` for pair inputs (embeddings, reranking), never used in generation.
    """
    import torch

    if "DS_ACCELERATOR" not in os.environ and torch.cuda.device_count() == 0:
        os.environ["DS_ACCELERATOR"] = "cpu"
    logging.getLogger("accelerate.utils.other").addFilter(_DropMessages("Removed shared tensor"))
    logging.getLogger("gguf.vocab").addFilter(_DropMessages("Unknown separator token"))


def classify(e: BaseException) -> tuple[int, str] | None:
    """``(exit code, message)`` for an error the user can act on, ``None`` for a bug (left as a traceback)."""
    from core.io import write_error

    if isinstance(e, FloatingPointError):
        return EXIT_DIVERGED, str(e)
    if isinstance(e, ValueError):  # bad config / data / checkpoint / tokenizer (their messages say what to fix)
        return EXIT_BAD_INPUT, str(e)
    from hydra.errors import HydraException

    if isinstance(e, HydraException):  # unknown experiment / group option, bad override (some are OSErrors)
        return EXIT_BAD_INPUT, _one_line_hydra(str(e))
    err = write_error(e, getattr(e, "filename", None) or "an artifact") if isinstance(e, Exception) else None
    if err is not None:
        return EXIT_WRITE_FAULT, err.strerror or str(err)
    if isinstance(e, OSError):
        return EXIT_BAD_INPUT, str(e)
    return None


def _one_line_hydra(msg: str) -> str:
    """Hydra's multi-line composition error as one line: the problem and the available options, without the
    config search path."""
    msg = msg.split("Config search path:")[0].strip()
    head, _, options = msg.partition("\n\n")
    opts = [o.strip() for o in options.splitlines()[1:] if o.strip()] if options.startswith("Available") else []
    head = " ".join(line.strip() for line in head.splitlines())
    if opts:
        return f"{head}. {options.splitlines()[0].strip().rstrip(':')}: {', '.join(opts)}"
    return " ".join(line.strip() for line in msg.splitlines() if line.strip())


def _close_progress_bars() -> None:
    """Close every open tqdm bar: an open bar redraws itself at exit, after the last message we print."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except Exception:  # noqa: BLE001  (cosmetic only)
        pass


def interrupted(message: str) -> NoReturn:
    """Ctrl-C: close the progress bars, print ``interrupted: <message>`` last on stderr, exit 130."""
    _close_progress_bars()
    sys.stdout.flush()
    print(f"interrupted: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_INTERRUPTED)


def fail(code: int, message: str) -> NoReturn:
    """Print ``error: <message>`` as the last thing on stderr (and log it to the run's log file when Hydra's
    logging is set up), then exit with ``code``."""
    _close_progress_bars()
    # the run's log file keeps the error; the console gets it once, as the line below (not also as a log line)
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if files:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
        for handler in files:
            handler.handle(record)
    sys.stdout.flush()
    sys.stderr.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def exit_on_error(e: BaseException) -> None:
    """Exit with the classified code and message; return (so the caller re-raises) for an unexpected error."""
    known = classify(e)
    if known is not None:
        fail(*known)


def _overrides(argv: list[str]) -> list[str] | None:
    """The Hydra overrides of a plain ``KEY=VALUE ...`` command line; ``None`` when it uses Hydra flags
    (``--multirun``, ``--cfg``, ``--help``, ...), which are left to Hydra itself."""
    if any(a.startswith("-") for a in argv):
        return None
    return list(argv)


def _mapping_literal(arg: str) -> bool:
    """``KEY={...}``: a plain assignment (no ``+``/``~``) of a mapping literal."""
    return "=" in arg and not arg.startswith(("+", "~", "-")) and arg.split("=", 1)[1].lstrip().startswith("{")


def _schema_type(schema, key: str):
    """The annotation of dotted ``key`` in the typed ``schema`` (a dataclass), ``Optional[X]`` read as ``X``; None
    when the schema does not declare the key (or no schema is given)."""
    import dataclasses
    import types
    import typing

    def unwrap(t):
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(t) if a is not type(None)]
            return args[0] if len(args) == 1 else t
        return t

    node = schema
    for part in key.split(".") if schema is not None else ():
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints:
            return None
        node = unwrap(hints[part])
    return node


def _is_named_mapping(schema, key: str) -> bool:
    """Whether the typed ``schema`` declares ``key`` as a ``dict[...]`` field: a mapping of names the user chooses
    (``eval.drafts``, ``data.mixture``, ``data.declared_domains``), not a config section."""
    import typing

    node = _schema_type(schema, key)
    return node is dict or typing.get_origin(node) is dict


def replace_mapping_overrides(argv: list[str], schema) -> list[str]:
    """``argv`` with every ``KEY={...}`` whose key the typed ``schema`` declares as a mapping of names
    (:func:`_is_named_mapping`: ``eval.drafts``, ``data.mixture``, ``data.declared_domains``) preceded by
    ``KEY=null``, so that the mapping the user typed *replaces* the one the config or experiment holds.

    Hydra merges a mapping override into an existing mapping: names the config lacks are refused ("Could not
    override") and names it has but the user left out stay, so ``eval.drafts={mine: path}`` after an experiment that
    names four drafts would evaluate five. Setting the key to null first makes the mapping a plain assignment (also
    with Hydra flags such as ``--cfg job``). Config sections (``trainer``, ``eval.deployment``, ...) keep Hydra's
    merge: a partial section must not reset the keys left out. One entry alone: ``KEY.NAME=VALUE``."""
    out = []
    for a in argv:
        if _mapping_literal(a) and _is_named_mapping(schema, a.split("=", 1)[0]):
            out.append(f"{a.split('=', 1)[0]}=null")
        out.append(a)
    return out


def compose(argv: list[str], config_dir: str | os.PathLike, config_name: str = "config"):
    """``(cfg without the hydra node, run directory)`` composed exactly as ``@hydra.main`` will, or ``None`` when
    ``argv`` uses Hydra flags.

    Raises:
        hydra.errors.HydraException: an unknown config group option (e.g. experiment) or a bad override.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    overrides = _overrides(argv)
    if overrides is None:
        return None
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = hydra_compose(config_name, overrides=overrides, return_hydra_config=True)
    run_dir = Path(str(cfg.hydra.run.dir)).expanduser()
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, run_dir


def probe_writable(run_dir: Path) -> None:
    """Check that ``run_dir`` can be written without leaving anything behind: a temporary file is created and
    removed in ``run_dir`` when it exists, else in its nearest existing parent (Hydra creates the folder itself,
    possibly under another timestamp, so none is created here).

    Raises:
        ArtifactWriteError: the folder (or the parent it would be created in) is read-only, full, not writable,
            or a parent is a regular file.
    """
    import errno

    from core.errors import ArtifactWriteError
    from core.io import write_error

    where = Path(os.path.abspath(run_dir))
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(where))
        fd, probe = tempfile.mkstemp(dir=where, prefix=".specdraft-write-probe-")
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        err = write_error(e, run_dir)
        raise err if err is not None else ArtifactWriteError(
            e.errno, f"cannot write the run directory {run_dir}: {e.strerror}; choose a writable "
                     f"hydra.run.dir") from e


_QUOTE_EXAMPLE = "'eval.extra_domains=[{name: mine, path: /data/mine.jsonl, text_field: text}]'"


def _split_by_shell(argv: list[str]) -> bool:
    """Signs that the shell split or brace-expanded one override into several arguments: a key given twice, or an
    argument that is not ``KEY=VALUE`` at all (``x,`` / ``path:`` left over from ``[{name: x, path: ...}]``)."""
    def balanced_literal(a: str) -> bool:  # a whole list / mapping in one argument: quoted, not split
        v = a.split("=", 1)[1].strip()
        return v[:1] in "[{" and v[-1:] in "]}" and sum(v.count(c) for c in "[{") == sum(v.count(c) for c in "]}")

    keys = [_override_key(a) for a in argv if "=" in a and not a.startswith("~") and not balanced_literal(a)]
    return len(keys) != len(set(keys)) or any("=" not in a and not a.startswith("~") for a in argv)


def _rejoined_override(argv: list[str]) -> str | None:
    """The override the shell split at spaces, put back together: from the first ``KEY=`` argument holding ``[``
    or ``{`` through the arguments until its brackets balance (``None`` when no argument opens a bracket or the
    first one already closes it)."""
    start = next((i for i, a in enumerate(argv) if "=" in a and any(ch in a.split("=", 1)[1] for ch in "[{")), None)
    if start is None:
        return None
    parts, depth = [], 0
    for a in argv[start:]:
        parts.append(a)
        depth += sum(a.count(ch) for ch in "[{") - sum(a.count(ch) for ch in "]}")
        if depth <= 0:
            break
    if depth > 0:  # never closed: no complete override to show
        return None
    return " ".join(parts) if len(parts) > 1 else None  # one argument: not split at spaces (brace expansion?)


def quoting_hint(argv: list[str]) -> str:
    """The fix for a list/dict value that reached Hydra in pieces (the user's own override, rejoined and quoted,
    when it can be told apart), or ``""`` when the command shows no such sign."""
    if not _split_by_shell(argv) and not any(ch in a for a in argv for ch in "[{"):
        return ""
    rejoined = _rejoined_override(argv)
    example = f"'{rejoined}'" if rejoined and "'" not in rejoined else _QUOTE_EXAMPLE
    return (f". A list or dict value must reach Hydra as one argument: put the whole override in single quotes, "
            f"e.g. {example} (unquoted, the shell splits it at spaces and expands {{a,b}})")


def _unknown_override_key(msg: str) -> str | None:
    import re

    m = re.search(r"Could not override '([^']+)'", msg)
    return m.group(1) if m else None


def unknown_key_message(key: str, argv: list[str], config_dir: str | os.PathLike, schema=None) -> str:
    """One line for an override of a key the config does not have: the closest valid key(s) (composed without the
    bad override, so the experiment's own keys count) with the value shaped as each takes it (a list, a mapping;
    from the typed root ``schema`` when given), and why Hydra's ``+key`` suggestion does not help."""

    value = next((a.split("=", 1)[1] for a in argv if _override_key(a) == key and "=" in a), "...")
    group = Path(config_dir) / key
    misuse = group_misuse(argv, config_dir)  # a folder of conf/ that is no config group (accelerate, domain)
    if misuse is not None:
        return misuse
    if group.is_dir():  # a config group the defaults do not select: Hydra needs the '+' to add it
        options = sorted(p.stem for p in group.glob("*.yaml"))
        return (f"invalid config: '{key}' is a config group the default config does not select: add it with "
                f"+{key}={value} (note the '+'); options: {', '.join(options)}")
    rest = [a for a in argv if _override_key(a) != key]
    parent, _, entry = key.rpartition(".")
    if parent and schema is not None and _schema_type(schema, parent) is not None \
            and _key_kind(None, schema, parent) == "dict":  # eval.drafts.x=... while eval.drafts is null here
        if value.strip() == "null":
            return (f"invalid config: {parent} holds no mapping in this config (null), so there is no entry {entry!r} "
                    f"to leave out; to keep only some entries, give them: {parent}='{{name: value, ...}}'")
        return (f"invalid config: {parent} holds no mapping in this config (null), so it has no entry {entry!r} to "
                f"change: add one with +{key}={value}, or give the whole mapping: {parent}='{{{entry}: {value}}}'")
    try:
        composed = compose(rest, config_dir)
    except Exception:  # noqa: BLE001  (another bad override: suggest from the defaults alone)
        composed = compose([a for a in rest if a.startswith("+experiment=")], config_dir)
    close = closest_keys(composed[0], key) if composed else []
    leaf = key.rpartition(".")[2]
    others = _keys_of_other_options(config_dir, leaf)
    elsewhere = [(o, k) for o, k in others if k == key] or (  # lora.name under lora=none: lora=default has it
        [] if "." in key or any(k.rpartition(".")[2] == leaf for k in close) else others)  # target_layers=...
    hint = f"; did you mean {' or '.join(f'{o} {k}={value}' for o, k in elsewhere[:2])}?" if elsewhere else \
        f"; did you mean {' or '.join(f'{k}={_shaped(composed[0], schema, k, value)}' for k in close)}?" if close else \
        "; see docs/configuration.md for the keys"
    return (f"invalid config: unknown key '{key}' (the config has no such key){hint} (Hydra's '+{key}=...' would "
            f"add the key, and the typed config would then reject it)")


def _key_kind(cfg, schema, key: str) -> str | None:
    """``"list"`` / ``"dict"`` when key ``key`` takes a list / mapping: from the typed ``schema`` (a dataclass: the
    annotation, so a null default still tells), else from the composed ``cfg``'s value; ``None`` for a scalar."""
    import types
    import typing

    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = _schema_type(schema, key)
    union = typing.get_origin(node) in (typing.Union, types.UnionType)
    origins = {typing.get_origin(a) or a for a in (typing.get_args(node) if union else (node,))} \
        if node is not None else set()
    if origins & {list, tuple}:
        return "list"
    if dict in origins:
        return "dict"
    if cfg is None:  # the schema alone
        return None
    value = OmegaConf.select(cfg, key, throw_on_missing=False)
    return "list" if isinstance(value, ListConfig) else "dict" if isinstance(value, DictConfig) else None


def field_example(schema, key: str, what: str = "example") -> str | None:
    """The ``example`` metadata of the typed config field at dotted ``key`` of ``schema`` (a dataclass), e.g.
    ``draft.eagle3.target_layers``: ``[2, 15, 27]`` (three layers: a one-item list built from the user's value
    would be wrong as written), or its ``what`` metadata (``example_note``: what the example depends on); None when
    the field gives none."""
    owner = schema
    for part in key.split("."):
        f = next((f for f in dataclasses.fields(owner) if f.name == part), None) if dataclasses.is_dataclass(owner) \
            else None
        if f is None:
            return None
        owner, last = (f.default_factory if f.default_factory is not dataclasses.MISSING else f.type), f
    return last.metadata.get(what)


def _shaped(cfg, schema, key: str, value: str) -> str:
    """``value`` written the way key ``key`` takes it: a list key gets ``'[value]'``, a mapping key
    ``'{name: value}'`` (quoted for the shell), so that a suggestion of another type is not wrong as written."""
    v = value.strip()
    kind = _key_kind(cfg, schema, key)
    if kind == "list" and not v.startswith("["):
        return f"'[{v}]'"
    if kind == "dict" and not v.startswith("{"):
        return f"'{{name: {v}}}'"
    return value


def _merge_shape_message(e: BaseException) -> str | None:
    """Hydra's "Error merging override k=[a]" for a key that holds a mapping (or ``k={a: 1}`` for a list) names
    neither the key's shape nor the fix; its cause (OmegaConf's ``ConfigTypeError``) carries the key."""
    cause = e.__cause__
    text = str(cause).split("\n")[0] if cause is not None else ""
    key = getattr(cause, "full_key", None)
    if not (str(e).startswith("Error merging override") and key and text.startswith("Cannot merge")):
        return None
    value = str(e).split("=", 1)[1].strip() if "=" in str(e) else ""
    if value.startswith("{"):  # a mapping given: the key takes a list (OmegaConf words both cases alike)
        return f"invalid config: {key} is a list, not a mapping: {key}='[a, b]' (quoted for the shell)"
    if value.startswith("[") or text.startswith("Cannot merge DictConfig"):
        return (f"invalid config: {key} is a mapping, not a list: set its keys ({key}.<key>=<value>) or give a "
                f"mapping: {key}='{{name: value}}' (quoted for the shell)")
    return f"invalid config: {key} is a list, not a mapping: {key}='[a, b]' (quoted for the shell)"


def preflight(argv: list[str], config_dir: str | os.PathLike, check: Callable[[Any, Path], None],
              schema=None, typed: list[str] | None = None) -> None:
    """Compose the command's config, run ``check(cfg, run_dir)`` and the write probe; on a user error print it and
    exit before Hydra creates or writes anything. A command with Hydra flags is not pre-checked, except for the
    misused config groups of :func:`core.groups.group_misuse`.

    An unknown key names the closest valid key(s); a list or dict value the shell split into pieces gets the
    quoting fix. ``schema``: the entry point's typed root config (a dataclass), for the shape of suggested values.
    ``typed``: the command line as the user typed it, when ``argv`` is its rewrite
    (:func:`replace_mapping_overrides`): messages quote what was typed."""
    typed = list(argv) if typed is None else list(typed)
    misuse = None if any(a in ("-h", "--help", "--hydra-help") for a in typed) else group_misuse(typed, config_dir)
    if misuse is not None:  # also with Hydra flags (--multirun, --cfg): Hydra's own error does not name the fix
        fail(EXIT_BAD_INPUT, misuse)
    try:
        composed = compose(argv, config_dir)
        if composed is None:
            return
        cfg, run_dir = composed
        check(cfg, run_dir)
        probe_writable(run_dir)
    except Exception as e:  # noqa: BLE001  (classified; anything else keeps its traceback)
        known = classify(e)
        if known is None:
            raise
        code, msg = known
        msg = _option_hint(msg)
        shape = _merge_shape_message(e)
        if shape is not None:
            fail(EXIT_BAD_INPUT, shape)
        key = _unknown_override_key(str(e))
        if key is not None and not _split_by_shell(typed):
            msg = unknown_key_message(key, argv, config_dir, schema)
        elif code == EXIT_BAD_INPUT and ("Invalid type assigned" in msg or "no viable alternative" in msg
                                         or "mismatched input" in msg or "extraneous input" in msg
                                         or _split_by_shell(typed)):
            hint = quoting_hint(typed)
            msg = msg.rstrip(".") + hint if hint else msg
        fail(code, msg)


def _option_hint(msg: str) -> str:
    """Hydra's ``Could not find 'experiment/smok'. Available options in 'experiment': a, b`` with the closest
    option(s) appended (``; did you mean +experiment=smoke?``); other messages as they are."""
    import re

    m = re.search(r"Could not find '([\w.-]+)/([^']+)'\. Available options in '[\w.-]+': (.+)", msg)
    if m is None:
        return msg
    group, name, options = m.group(1), m.group(2), [o.strip() for o in m.group(3).split(",")]
    plus = "+" if group == "experiment" else ""
    hint = did_you_mean(name, options, lambda c: f"{plus}{group}={c}")
    return f"{msg.rstrip('.')}; {hint}" if hint else msg


def run_command(run_dir: Path, module: str, extra: tuple[str, ...] = (), experiment_name: str | None = None,
                sections: Iterable[str] | None = None) -> str:
    """``python -m <module>`` with the overrides of the command that made the run in ``run_dir`` (Hydra's
    ``.hydra/overrides.yaml``; without it ``+experiment=`` the run's ``experiment_name`` from
    ``resolved_config.json``, else ``experiment_name``), then ``extra``, shell-quoted and pointed at ``run_dir``:
    ``module="eval"`` re-evaluates the run as it was evaluated, ``module="train", extra=("trainer.resume=true",)``
    resumes it with the settings it was started with. ``sections``: keep only the overrides of these top-level
    keys (and ``+experiment=``), for a module that reads no others (:func:`ignored_overrides`)."""
    import json
    import shlex

    import yaml

    from core.io import PROJECT_ROOT

    overrides: list[str] = []
    try:
        overrides = [str(o) for o in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []]
    except (OSError, yaml.YAMLError, TypeError):
        try:  # no record of the command: the run's own experiment name
            experiment_name = json.loads((run_dir / "resolved_config.json").read_text()).get("experiment_name")
        except (OSError, ValueError, AttributeError):
            pass
        if experiment_name and (PROJECT_ROOT / "conf" / "experiment" / f"{experiment_name}.yaml").is_file():
            overrides = [f"+experiment={experiment_name}"]
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "overwrite=", "trainer.resume="))]
    if sections is not None:
        keep = [o for o in keep if o not in ignored_overrides([o], sections)]
    return " ".join([f"python -m {module}", *map(shlex.quote, [*keep, *extra, f"hydra.run.dir={run_dir}"])])


def ignored_overrides(argv: list[str], sections: Iterable[str]) -> list[str]:
    """The overrides of ``argv`` that set or select a top-level key outside ``sections`` (``+experiment=``, Hydra's
    own and flags excepted): ``python -m eval`` passes its sections, so ``draft=small`` or ``trainer.lr=1e-3``, which
    it never reads, can be named instead of being dropped silently."""
    keep = {*sections, "experiment", "hydra", "overwrite"}
    return [a for a in argv if not a.startswith("-") and "=" in a
            and a.lstrip("+~").split("=", 1)[0].split(".", 1)[0].split("@", 1)[0] not in keep]


def _dotted_keys(node: Any, prefix: str = "", depth: int = 4) -> list[str]:
    """Every dotted key of a config tree (mappings only; list items are not addressed)."""
    out = []
    if depth == 0 or not OmegaConf.is_dict(node):
        return out
    for k in node.keys():
        full = f"{prefix}{k}"
        out.append(full)
        try:
            child = node._get_node(k)
        except Exception:  # noqa: BLE001
            continue
        if OmegaConf.is_dict(child):
            out += _dotted_keys(child, f"{full}.", depth - 1)
    return out


def closest_keys(cfg: Any, key: str, n: int = 3) -> list[str]:
    """The valid dotted keys of ``cfg`` closest to the unknown ``key`` (``trainer.max_step`` -> ``trainer.max_steps``;
    ``max_steps`` -> ``trainer.max_steps``): first the siblings under the same parent, else keys anywhere in the
    tree whose last part is close (difflib ratio >= 0.6)."""
    keys = _dotted_keys(cfg)
    sections = {k for k in keys if "." not in k and OmegaConf.is_dict(cfg._get_node(k))}
    keys = [k for k in keys if k not in sections]  # target_layers -> not the target section: a key, not a group
    parent, _, leaf = key.rpartition(".")
    close = closest_names(leaf, [k for k in keys if k.rpartition(".")[0] == parent], n, leaf=True)
    return close or closest_names(leaf, keys, n, leaf=True)


@dataclass
class PathsConfig:
    project_root: str = "."
    output_root: str = "outputs"
    reference_target: str = "models/assets/reference_target"
    general_draft: str = "models/assets/general_draft"  # the committed general draft lora_med / adapt_domains adapt


def _container_mismatch(schema_cfg: DictConfig, cfg: Any, prefix: str = "") -> tuple[str | None, str | None]:
    """The first dotted key where ``cfg`` gives a list and ``schema_cfg`` a mapping (``"dict"``), or the other way
    round (``"list"``); ``(None, None)`` if there is none. OmegaConf's "Cannot merge DictConfig with ListConfig" names
    no key."""
    if not isinstance(cfg, (DictConfig, dict)):
        return None, None
    for k, v in (cfg.items_ex(resolve=False) if isinstance(cfg, DictConfig) else cfg.items()):
        node = schema_cfg._get_node(k) if isinstance(schema_cfg, DictConfig) and k in schema_cfg else None
        if node is None:
            continue
        ref = str(getattr(node._metadata, "ref_type", ""))
        is_dict = isinstance(node, DictConfig) or ref.startswith(("typing.Dict", "dict"))
        is_list = isinstance(node, ListConfig) or ref.startswith(("typing.List", "list"))
        full = f"{prefix}{k}"
        if is_dict and isinstance(v, (ListConfig, list)):
            return full, "dict"
        if is_list and isinstance(v, (DictConfig, dict)):
            return full, "list"
        if isinstance(node, DictConfig) and not node._is_none() and isinstance(v, (DictConfig, dict)):
            found = _container_mismatch(node, v, full + ".")
            if found[0]:
                return found
    return None, None


def _section_path(schema: type, class_name: str) -> str:
    """The dotted key of the section of ``schema`` typed ``class_name`` (``LookupConfig`` -> ``decode.lookup``);
    else the class name without ``Config``, lowercased."""
    import typing

    def find(cls, prefix: str) -> str | None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001  (annotations that do not resolve: search no deeper)
            return None
        for f in dataclasses.fields(cls):
            kind = hints.get(f.name)
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                hit = prefix + f.name if kind.__name__ == class_name else find(kind, f"{prefix}{f.name}.")
                if hit:
                    return hit
        return None

    return (find(schema, "") if dataclasses.is_dataclass(schema) else None) or \
        class_name.removesuffix("Config").lower()


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
        if not key and msg.startswith("Cannot merge") and "Config with" in msg:  # names no key: find it
            key, wants = _container_mismatch(OmegaConf.structured(schema), cfg)
            if key:
                msg = "got a list, which is not a DictConfig" if wants == "dict" else "got a mapping, which is not a ListConfig"
        if key and key not in msg:
            msg = f"{key}: {msg}"
        if key and isinstance(e, (ConfigKeyError, ConfigAttributeError)) and " not in " in msg:
            owner = getattr(e, "object_type", None)
            if dataclasses.is_dataclass(owner) and owner is not schema and "." not in str(key):
                # a key inside a list item (eval.extra_domains[i]): OmegaConf names only the item's class, so the
                # suggestion comes from that class's own fields
                fields = [f.name for f in dataclasses.fields(owner)]
                close = closest_names(str(key), fields, 3)
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
            shown = field_example(schema, str(key)) or f"[{example}]"  # a list of fixed length: its own example
            note = field_example(schema, str(key), "example_note")
            msg += f"; {key} takes a list: {key}='{shown}' (quoted for the shell{f'; {note}' if note else ''})"
        elif key and ("is not a DictConfig" in msg or ("Cannot assign" in msg and "to Dict[" in msg)):
            msg += f"; {key} takes a mapping: {key}='{{name: value}}' (quoted for the shell)"
        elif "is not a subclass of" in msg and "value:" in msg:  # `distill=forward_kl`: a section set to a word
            section = key or _section_path(schema, msg.split(" is not a subclass of ")[1].split(".")[0])
            msg += (f"; '{section}' is a section of conf/config.yaml, not a config group with options: set its keys "
                    f"instead ({section}.<key>=<value>; the keys: docs/configuration.md)")
        raise ValueError(f"invalid config: {msg}") from None
