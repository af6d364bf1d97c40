"""``decode.block_threads``: CPU threads for forwards over more than one token (not public API beyond the setting).

On a CPU a one-token forward of a small model is a chain of matrix-vector products and small element-wise ops:
extra threads add fork/join cost and buy nothing. A forward over several tokens (the target's verify block of
gamma + 1 positions, a prefill, a batch of rows) multiplies small matrices, which MKL runs at a fraction of the
core's peak with few rows; there a second thread pays. Measured on the 2-core development machine (reference
target, 100 cached tokens, the two settings interleaved in one process, medians of 380 calls): one-token forward
3.75 ms at 1 thread and 3.60 ms at 2; five-token forward 6.87 ms at 1 thread and 5.16 ms at 2, so the verify cost
ratio v (five-token / one-token forward) falls from 1.83 to 1.38.

The setting (``decode.block_threads``):

* ``auto`` (default): the caller's ``torch.get_num_threads()`` for every forward, capped at the cores this process
  may use. The decoder never raises the thread count on its own: a user who set 1 thread because another job holds
  the other core gets 1 thread in verify blocks and prefills too. Measured on the 2-core EPYC machine with
  SmolLM2-135M-Instruct, a caller at 1 thread and a busy loop on the other core: when ``auto`` still meant "every
  core", verify blocks and prefills ran 6-17x and 8x slower per call than at the caller's 1 thread (two threads
  fighting one free core), and target-only decoding fell below transformers' ``generate``.
* a thread count ``n``: forwards whose ``batch x positions > 1`` run with ``n`` threads (at most the cores), and
  one-token forwards (draft steps, target-only decoding) keep the caller's; the caller's count is restored
  afterwards. For an idle machine where the caller keeps one-token forwards on fewer threads.
* ``off``: the caller's count, uncapped.

Lossless either way: the same ops, only the matrix products are split over threads. The decoders' KV states
(:class:`decode.common.KVState`, :class:`decode.fast_llama.FastKVState`), the distillation's one-off teacher
passes and the top-k cache's batched forward follow the setting; training steps keep ``trainer.num_threads``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

log = logging.getLogger(__name__)

__all__ = ["set_block_threads", "block_thread_count", "resolved_block_threads", "parse_block_threads",
           "block_threads_setting", "available_cores", "BlockThreads", "free_cores", "FreeCoreThreads",
           "following_free_cores"]

_setting = "auto"
_threads: int | None = None  # the count _setting resolves to on a CPU (None: off); set with the setting, not per forward


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where that is not available)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def parse_block_threads(value) -> str | int:
    """``"auto"``, ``"off"`` or a positive thread count (int or its string, as Hydra / OmegaConf pass it).

    Raises:
        ValueError: anything else, naming ``decode.block_threads`` and the accepted values.
    """
    if isinstance(value, bool):  # YAML true / false are not thread counts
        value = repr(value)
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return text
    if text.isascii() and text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"decode.block_threads must be auto, off or a positive number of threads, got {value!r} "
                     f"(e.g. decode.block_threads=2)")


def set_block_threads(value) -> None:
    """Set ``decode.block_threads`` for forwards from now on: ``"auto"`` (the caller's ``torch.get_num_threads()``,
    capped at the cores the process may use), ``"off"`` (the caller's, uncapped) or a thread count (at most the cores the process may
    use: more threads than cores only contend for them, so a larger count is capped, with a warning). Raises
    ``ValueError`` otherwise."""
    global _setting, _threads
    _setting = parse_block_threads(value)
    cores = available_cores()
    if isinstance(_setting, int) and _setting > cores:
        log.warning("decode.block_threads=%d exceeds the %d CPU cores this process may use: using %d", _setting,
                    cores, cores)
    _threads = None if _setting in ("off", "auto") else min(_setting, cores)


def block_threads_setting() -> str | int:
    """The current ``decode.block_threads`` setting (``"auto"``, ``"off"`` or a thread count)."""
    return _setting


def resolved_block_threads(device) -> int | None:
    """Threads that forwards over more than one token on ``device`` use under the current setting; ``None``: the
    caller's (not a CPU, ``auto`` or ``off``). For records (metrics.json ``context.decode_block_threads``)."""
    if _threads is None or torch.device(device).type != "cpu":
        return None
    return _threads


def block_thread_count(device) -> int | None:
    """Threads to switch to for a forward over more than one token on ``device``; ``None``: keep the current setting
    (not a CPU, ``off``, or already that many)."""
    if _setting == "auto" and torch.device(device).type == "cpu":  # the caller's count, never above the cores
        cores = available_cores()
        return cores if torch.get_num_threads() > cores else None
    n = resolved_block_threads(device)
    return None if n is None or n == torch.get_num_threads() else n


class BlockThreads:
    """``with BlockThreads(device, tokens):`` runs the body with :func:`block_thread_count` threads when ``tokens``
    (batch x positions) > 1, and restores the caller's thread count on exit (also on errors)."""

    __slots__ = ("n", "prev")

    def __init__(self, device, tokens: int):
        self.n = block_thread_count(device) if tokens > 1 else None
        self.prev = None

    def __enter__(self):
        if self.n is not None:
            self.prev = torch.get_num_threads()
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.set_num_threads(self.prev)
        return False


set_block_threads(_setting)  # resolve the default once, at import


def _core_times() -> dict[str, tuple[int, int]] | None:
    """cpuN -> (idle jiffies, total jiffies) from /proc/stat, or None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        parts = line.split()
        if parts and parts[0].startswith("cpu") and parts[0] != "cpu":
            v = [int(x) for x in parts[1:]]
            out[parts[0]] = (v[3] + (v[4] if len(v) > 4 else 0), sum(v))
    return out


def free_cores(window_s: float = 0.5) -> int:
    """How many of this process's cores are free now: the idle capacity, in cores, of a ``window_s`` sample of
    /proc/stat (summed over cores, rounded down unless within 0.3 of the next whole core), at least 1, at most the
    affinity mask's count. llama.cpp's threads spin-wait for each other, so a
    thread placed on a core another process holds stalls every step: on 2 cores with one busy, 2 threads ran
    several times slower than 1 (docs/engine.md); torch's OpenMP threads spin-wait likewise
    (:class:`FreeCoreThreads`). Where /proc/stat cannot be read: every core of the mask."""
    cores = available_cores()
    a = _core_times()
    if a is None:
        return cores
    time.sleep(window_s)
    b = _core_times() or {}
    idle = sum((i1 - a[k][0]) / (t1 - a[k][1]) for k, (i1, t1) in b.items() if k in a and t1 > a[k][1])
    return max(1, min(cores, int(idle + 0.3)))  # idle capacity in cores (a busy process that moves between
    # cores still takes one), rounded down unless nearly whole

class FreeCoreThreads:
    """Torch threads that follow the cores other processes leave free, re-measured between steps.

    ``update()`` (call it between training steps or teacher batches) measures, since the previous call, the idle
    capacity of this process's cores (/proc/stat) plus this process's own CPU time (``time.process_time``, all its
    threads): what other processes leave. It sets ``torch.set_num_threads`` to that many cores (rounded down unless
    within 0.3 of the next, at least 1, at most the affinity mask) and returns the count. Why: torch's OpenMP
    threads wait for each other at every parallel region; one thread on a core another process holds stalls the
    rest. Measured on the 2-core development machine (docs/results.md, "Throughput on a shared machine"): a
    distillation step at 2 threads with another process on one core ran many times slower than at 1 thread.

    The first count comes from a ``window_s`` sample at construction. Checks are at most every ``every_s`` seconds
    (a shorter interval returns the current count unchanged). Restores the previous thread count on ``close()``.
    """

    def __init__(self, window_s: float = 0.2, every_s: float = 5.0):
        self._clock = time.monotonic
        self.every_s = every_s
        self.prev = torch.get_num_threads()
        self.threads = free_cores(window_s)
        self.changes: list[tuple[float, int]] = [(0.0, self.threads)]
        self._t0 = self._clock()
        self._mark()
        torch.set_num_threads(self.threads)

    def _mark(self) -> None:
        self._last = (self._clock(), _core_times(), time.process_time())

    def update(self) -> int:
        t_last, cores_last, own_last = self._last
        now = self._clock()
        if now - t_last < self.every_s or cores_last is None:
            return self.threads
        cores_now = _core_times() or {}
        own = time.process_time() - own_last
        idle = sum((i1 - cores_last[k][0]) / (t1 - cores_last[k][1])
                   for k, (i1, t1) in cores_now.items() if k in cores_last and t1 > cores_last[k][1])
        left = idle + own / max(now - t_last, 1e-9)  # cores idle plus the ones this process kept busy
        n = max(1, min(available_cores(), int(left + 0.3)))
        self._mark()
        if n != self.threads:
            log.info("torch threads %d -> %d (cores other processes leave free)", self.threads, n)
            self.threads = n
            self.changes.append((round(now - self._t0, 1), n))
            torch.set_num_threads(n)
        return n

    def close(self) -> None:
        torch.set_num_threads(self.prev)


@contextlib.contextmanager
def following_free_cores(every_s: float = 5.0) -> Iterator[Callable[[], int]]:
    """A block whose torch threads follow the free cores: yields :meth:`FreeCoreThreads.update` (call it between
    batches); the previous count is restored after."""
    follow = FreeCoreThreads(every_s=every_s)
    try:
        yield follow.update
    finally:
        follow.close()
