"""The folders of ``conf/`` on the command line: which config groups the defaults select, how each folder is
meant to be used (``+experiment=NAME``, ``draft=NAME``, ``conf/accelerate/`` and ``conf/domain/`` read by name
elsewhere), and the one-line message for an override that names one the way Hydra cannot take it, or misspells it
(:func:`group_misuse`; :func:`core.cli.preflight` runs it before Hydra starts)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from core.errors import closest_names


def _override_key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def load_yaml(path: str | os.PathLike) -> dict:
    """A config file of ``conf/`` as a mapping; ``{}`` when it is missing, unreadable, not YAML or not a mapping
    (Hydra reports those in its own words when it composes)."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _keys_of_other_options(config_dir: str | os.PathLike, leaf: str) -> list[tuple[str, str]]:
    """``(group=option, dotted key)`` for each option file of a selectable config group (target, draft, trainer,
    lora, logger) that has a key named ``leaf``: ``target_layers`` is ``draft.eagle3.target_layers`` under
    ``draft=eagle3``, a key the composed config lacks because another option is selected."""
    def walk(node, prefix):
        for k, v in (node.items() if isinstance(node, dict) else ()):
            yield f"{prefix}{k}"
            yield from walk(v, f"{prefix}{k}.")

    out = []
    for group in sorted(_selected_groups(config_dir)):
        for f in sorted((Path(config_dir) / group).glob("*.yaml")):
            out += [(f"{group}={f.stem}", f"{group}.{k}") for k in walk(load_yaml(f), "")
                    if k.rpartition(".")[2] == leaf and k != "defaults"]
    return out


def _selected_groups(config_dir: str | os.PathLike) -> dict[str, str]:
    """``group -> option`` of the root config's defaults list (conf/config.yaml: target, draft, trainer, ...)."""
    doc = load_yaml(Path(config_dir) / "config.yaml")
    return {str(k): str(v) for d in doc.get("defaults") or [] if isinstance(d, dict) for k, v in d.items()}


def _global_group(folder: Path) -> bool:
    """Whether the options of config group ``folder`` are ``# @package _global_`` files (the experiments: added with
    ``+experiment=NAME``, they set keys anywhere in the config)."""
    first = next(iter(sorted(folder.glob("*.yaml"))), None)
    return first is not None and "@package _global_" in "".join(first.read_text().splitlines(True)[:3])


def _program() -> str:
    """The entry point this process runs (``train`` / ``eval`` for ``python -m train`` / ``python -m eval``)."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return script.parent.name if script.name == "__main__.py" and script.parent.name else "train"


def _deleted_section(arg: str, config_dir: Path) -> str | None:
    """The error for ``~name`` (or ``~name=value``) deleting a whole section or config group of conf/config.yaml
    (``~draft``, ``~trainer``): Hydra drops it and the typed config fills in built-in defaults that no config file
    shows, so the run would go on with settings nobody chose. None for any other argument (``~a.b`` resets one key)."""
    import re

    m = re.fullmatch(r"~([A-Za-z_]\w*)(?:=.*)?", arg, re.S)
    if m is None:
        return None
    name = m.group(1)
    doc = load_yaml(config_dir / "config.yaml")
    folder = config_dir / name
    if name not in _selected_groups(config_dir) and not isinstance(doc.get(name), dict):
        return None  # not a section (~seed, ~experiment, a typo): a single key resets, or Hydra names the miss
    options = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    pick = f"pick an option ({name}=NAME with NAME one of {', '.join(options)}) or " if options else ""
    return (f"{arg} deletes the {name} section, and the run would go on with built-in defaults that no config file "
            f"shows: {pick}set its keys instead ({name}.<key>=<value>; docs/configuration.md)")


def group_misuse(typed: list[str], config_dir: str | os.PathLike) -> str | None:
    """The one-line error for an override that names a folder of ``conf/`` the way Hydra cannot take it, or None.

    ``+draft=small`` (a group the defaults already select: Hydra's "appears more than once"; ``draft=small`` replaces
    the option), ``++experiment=NAME`` (Hydra cannot force-add a group; ``+experiment=NAME`` adds it), and any
    override of ``accelerate`` or ``domain``: ``--help`` lists them as groups, but their files are read by name
    elsewhere (``conf/accelerate/NAME.yaml`` by ``accelerate launch --config_file``, ``conf/domain/NAME.yaml`` when
    ``data.domain`` or ``eval.domains`` names the domain), so the typed config rejects them as root keys. Each
    message names the command that works: the user's other arguments with the override as it must be written."""
    import re
    import shlex

    config_dir = Path(config_dir)
    for arg in typed:
        deleted = _deleted_section(arg, config_dir)
        if deleted is not None:
            return f"invalid config: {deleted}"
    for i, arg in enumerate(typed):
        m = re.fullmatch(r"(\+{0,2})([A-Za-z_]\w*)=(.*)", arg, re.S)
        if m and (config_dir / m.group(2)).is_dir() and "," in m.group(3) and not m.group(3).startswith(("[", "{")) \
                and not any(a in ("-m", "--multirun") for a in typed):
            msg = (f"{arg} lists several {m.group(2)} options, a sweep: add -m to run each in turn "
                   f"({shlex.join(['python', '-m', _program(), '-m', *typed])}), or pick one")
        elif m and (config_dir / m.group(2)).is_dir():
            msg = _misused_group(*m.groups(), typed[:i] + typed[i + 1:], config_dir)
        else:
            msg = _misspelt_group(*m.groups(), config_dir) if m else None
        if msg is not None:
            return f"invalid config: {msg}"
    return None


def _misspelt_group(plus: str, key: str, option: str, config_dir: Path) -> str | None:
    """``+experimnt=smoke``: a root override whose name is closer to a selectable config group of ``conf/`` than to
    any root key of ``conf/config.yaml``, and whose value is (close to) one of that group's options; the message
    names the override that selects it. Anything else is left to the unknown-key message."""
    groups = sorted(p.name for p in config_dir.iterdir() if p.is_dir() and p.name not in ("accelerate", "domain"))
    roots = [k for k in load_yaml(config_dir / "config.yaml") if k != "defaults"]
    if key in groups or key in roots:
        return None
    best = closest_names(key, [*groups, *(k for k in roots if k not in groups)], 1)
    if not best or best[0] not in groups:
        return None
    group = best[0]
    options = sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
    chosen = option if option in options else next(iter(closest_names(option, options, 1)), None)
    if chosen is None:  # target_layers=[1,2,3], lora_rank=8: a key meant elsewhere, not an option of the group
        return None
    fix = f"{'' if group in _selected_groups(config_dir) else '+'}{group}={chosen}"
    return f"'{plus}{key}' is no config key or config group; did you mean {fix}?"


def _misused_group(plus: str, group: str, option: str, rest: list[str], config_dir: Path) -> str | None:
    """:func:`group_misuse` for one override ``{plus}{group}={option}``; ``rest``: the other arguments."""
    import shlex

    folder, prog = config_dir / group, _program()
    options = sorted(p.stem for p in folder.glob("*.yaml"))
    selected = _selected_groups(config_dir)

    def command(*extra: str, prefix: tuple[str, ...] = ("python", "-m", prog), args=rest) -> str:
        return shlex.join([*prefix, *args, *extra])

    known = option in options or "," in option  # a multirun sweep lists several
    if group in selected:
        if not plus:
            return None  # group=option: Hydra's own message names the options of a wrong one
        fix = f"{group}={option}" if known else f"{group}=NAME with NAME one of {', '.join(options)}"
        return (f"use {fix} (no '{plus}'): the default config already selects a {group} option "
                f"({group}={selected[group]}), and {group}=NAME replaces it" +
                (f": {command(fix)}" if known else ""))
    if _global_group(folder):
        if plus != "++":
            return None  # +experiment=NAME is right; experiment=NAME gets unknown_key_message's hint
        return (f"use +{group}={option} (one '+'): Hydra cannot force-add a config group ('++'), and '+' adds the "
                f"{group}: {command(f'+{group}={option}')}")
    if group == "accelerate":
        path = f"conf/accelerate/{option}.yaml"
        what = f"{path} is a launch config of accelerate, not an option of the run's config ({plus}{group}= cannot " \
               f"select it)"
        if not known:
            return (f"conf/accelerate/ holds the launch configs of accelerate ({', '.join(options)}), not options of "
                    f"the run's config, and has no {option}.yaml: launch with accelerate launch --config_file "
                    f"conf/accelerate/NAME.yaml -m train ... trainer=NAME")
        if prog != "train":
            return f"{what}: drop it; python -m {prog} runs in one process: {command()}"
        if option == "single":
            return f"{what}: drop it; one process is what plain python -m train runs: {command()}"
        others = [a for a in rest if _override_key(a) != "trainer"]  # trainer= must match the launch config
        launch = ("accelerate", "launch", "--config_file", path, "-m", prog)
        return (f"{what}: launch the run with it and the trainer of the same name: "
                f"{command(f'trainer={option}', prefix=launch, args=others)}")
    if group == "domain":
        if prog == "train":
            return (f"'domain' is not a config group: a domain (conf/domain/NAME.yaml or a built-in one) is named by "
                    f"data.domain (the draft's training domain) or eval.domains (the evaluated ones): "
                    f"{command(f'data.domain={option}')}")
        return (f"'domain' is not a config group: a domain (conf/domain/NAME.yaml or a built-in one) is named by "
                f"eval.domains: {command(f'eval.domains=[{option}]')}")
    groups = sorted(selected) + [d.name for d in sorted(config_dir.iterdir()) if d.is_dir() and _global_group(d)]
    return (f"conf/{group}/ is not a config group of the run's config ({plus}{group}={option} cannot select "
            f"{group}/{option}.yaml); the groups: {', '.join(groups)} (docs/configuration.md)")
