"""Where and in what precision models run, and the record of it.

``eval.device`` / ``eval.dtype`` resolved and checked, and the runtime
record every report carries (device, dtype, threads, torch / CUDA versions, GPU name).

``null`` (or ``auto``) picks the GPU when torch sees one (``cuda``, in ``bfloat16``) and the CPU otherwise (in
``float32``). An explicit device that this machine cannot provide is refused before any model loads, with one line
naming the key, what was found and the fix.
"""
from __future__ import annotations

import contextlib
import platform
from typing import Iterator

import torch

from core.errors import DeviceError


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | None, key: str = "eval.device") -> torch.device:
    """``name`` (``cpu``, ``cuda``, ``cuda:N``, or ``None`` / ``auto``: ``cuda`` when available, else ``cpu``) as a
    :class:`torch.device`, checked against this machine.

    Raises:
        DeviceError: an unknown device type; ``cuda`` when ``torch.cuda.is_available()`` is False (CPU-only torch
            or no visible GPU); ``cuda:N`` with N >= ``torch.cuda.device_count()``.
    """
    if name is None or str(name).strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(str(name).strip())
    except (RuntimeError, ValueError):
        raise DeviceError(f"{key}={name!r} is not a device; use cpu, cuda, cuda:N or null (the GPU when there is "
                          f"one)") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DeviceError(f"{key}={name} is not supported; use cpu, cuda, cuda:N or null (the GPU when there is one)")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"{key}={name} but no CUDA device is available (torch {torch.__version__}, {build}, "
                          f"torch.cuda.is_available() is False); set {key}=cpu or run on a GPU machine")
    n = torch.cuda.device_count()
    index = 0 if dev.index is None else dev.index
    if index >= n:
        raise DeviceError(f"{key}={name} but this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1}); pick one of "
                          f"them or set {key}=cpu")
    return torch.device("cuda", index)


def resolve_dtype(name: str | None, device: torch.device, key: str = "eval.dtype") -> torch.dtype:
    """``name`` (``float32``, ``bfloat16``, ``float16``, or ``None`` / ``auto``: ``bfloat16`` on a GPU that supports
    it, else ``float32``) as a :class:`torch.dtype` for models on ``device``.

    Raises:
        DeviceError: an unknown dtype name (lists the accepted ones).
    """
    if name is None or str(name).strip().lower() == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if str(name) not in DTYPES:
        raise DeviceError(f"{key}={name!r} is not supported; use one of {', '.join(DTYPES)} or null (bfloat16 on a "
                          f"GPU, float32 on CPU)")
    return DTYPES[str(name)]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def runtime_record(device: torch.device, dtype: torch.dtype, threads: int | None = None) -> dict:
    """What a report needs to say where its numbers come from: ``{"device", "dtype", "threads", "torch",
    "cuda", "gpu", "cpu"}``; ``threads`` defaults to ``torch.get_num_threads()``; ``cuda`` / ``gpu`` are null on
    a CPU-only run (``cuda`` is torch's CUDA build version, ``gpu`` the device's name)."""
    device = torch.device(device)
    return {"device": str(device), "dtype": dtype_name(dtype),
            "threads": int(threads if threads is not None else torch.get_num_threads()),
            "torch": torch.__version__, "cuda": torch.version.cuda if device.type == "cuda" else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cpu": platform.processor() or platform.machine()}


def describe_runtime(r: dict) -> str:
    """One report line from :func:`runtime_record`'s dict, e.g. ``cpu, float32, 2 torch threads, torch 2.x``."""
    where = f"{r['device']} ({r['gpu']}, CUDA {r['cuda']})" if r.get("gpu") else r["device"]
    blocks = r.get("block_threads")  # decode.block_threads, where the caller recorded it
    threads = f"{r['threads']} torch CPU threads" + (
        f" ({blocks} for forwards over more than one token: decode.block_threads)" if blocks and blocks != r["threads"]
        else "")
    return f"{where}, {r['dtype']}, {threads}, torch {r['torch']}"


PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # trainer.mixed_precision -> dtype


def run_precision(mixed_precision: str, device: torch.device | str):
    """The context that runs frozen forwards (teacher, cached-teacher pass, teacher data generation, validation
    losses) in the run's precision (``trainer.mixed_precision``): ``torch.autocast`` in bf16 / fp16 on ``device``'s
    type, a no-op for ``no`` (fp32).

    Raises:
        DeviceError: an unknown ``mixed_precision`` (lists the accepted values).
    """
    import contextlib

    if mixed_precision not in PRECISIONS:
        raise DeviceError(f"trainer.mixed_precision={mixed_precision!r} is not supported; use {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[mixed_precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch CPU threads, restoring the previous count after. ``None`` or ``0`` leaves
    torch's setting unchanged (``eval.num_threads: null``, ``trainer.num_threads: 0``)."""
    prev = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(prev)
