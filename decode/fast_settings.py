"""The settings of lean forwards (:mod:`decode.fast_llama`) built from now on, gathered in ONE object,
:data:`SETTINGS` (a :class:`LeanSettings`): ``decode.compile`` and the layout of the products on packed CPU
weights, with what this process compiled and measured under them. :func:`set_compile`, :func:`compile_enabled`,
:func:`compile_seconds`, :func:`set_row_layout` and :func:`row_layout_record` are its bound methods (re-exported by
:mod:`decode.fast_llama`). Also here: the weight-left products that the ``weight_left`` layout names
(:func:`rows_times`, :func:`rows_addmm`) and their timing.

``decode.block_threads``: CPU threads for forwards over more than one token (not public API beyond the setting).

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

INT8 drafts: dynamic int8 quantization of a draft's ``nn.Linear`` layers with PyTorch's own quantization
(in ``decode`` so that evaluation and training both reach it).

``draft.quantize=int8`` applies :func:`torch.ao.quantization.quantize_dynamic` (weights int8 per output channel,
stored once; activations quantized per batch at run time; Jacob et al. 2018, "Quantization and Training of Neural Networks
for Efficient Integer-Arithmetic-Only Inference", affine scheme r = S (q - Z)) to every ``nn.Linear`` of the draft,
the LM head included; embeddings and norms stay fp32.

How it is stored: a quantized module is not a ``from_pretrained``-able Hugging Face checkpoint, so an INT8 draft
directory holds the **fp32** Hugging Face checkpoint (config, safetensors, tokenizer) plus ``"quantize": "int8"`` in
its ``specdraft.json``. ``AutoModelForCausalLM.from_pretrained`` (and transformers' ``assistant_model``) gets the
fp32 draft; :func:`load_draft` (our evaluation and decoder) rebuilds the INT8 draft from it at load time, which is
deterministic (same fp32 weights -> same int8 weights).

Device: ``quantize_dynamic`` kernels (fbgemm / x86 / qnnpack) run on CPU only. On CUDA there is no int8 dynamic
path in PyTorch core, so :func:`quantize_draft` raises a clear error for a model on a GPU (decode on CPU, or use
``draft.quantize=none``). ``torch.ao.quantization`` is marked deprecated in favour of torchao; it still ships with
the installed torch and is the library the project uses until torchao is a dependency.

A trimmed draft head (:class:`models.vocab.TrimmedLMHead`, N kept rows) is quantized the same way: its
``quantized`` attribute holds the dynamic int8 Linear over its N rows, which its forward then uses (the fp32 rows
stay for saving). The lean decoder forward (``decode/fast_llama.py``) runs int8 drafts of the Llama-like families
without projection biases by calling the quantized modules in its own layer loop (the same fbgemm kernels and
packed weights as the Hugging Face forward, so on unpadded rows the two agree to float rounding); other quantized
models fall back to the Hugging Face forward. Activations are quantized with one scale per call over every row of
the batch, so a row's int8 logits depend on the other rows, pad positions included (which the two forwards fill
differently: a left-padded batch differs by about 1e-2 between them, also in its unpadded rows). Either way
speculative decoding stays lossless: the target alone decides every emitted token, and sampled decoding uses the
int8 draft's own q from the forward that proposed the token.
"""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

__all__ = [
    'set_block_threads', 'block_thread_count', 'resolved_block_threads', 'parse_block_threads',
    'block_threads_setting', 'available_cores', 'BlockThreads', 'free_cores', 'FreeCoreThreads',
    'following_free_cores', 'SETTINGS', 'LeanSettings', 'COMPILE_MODES', 'ROW_LAYOUTS', 'set_compile',
    'compile_enabled', 'compile_seconds', 'set_row_layout', 'row_layout_record', 'rows_times', 'rows_addmm',
    'graph_count', 'QUANTIZE_MODES', 'quantize_draft', 'is_quantized', 'check_quantize_meta',
    'check_quantize_device', 'load_draft', 'fuse_int8_rows',
]


log = logging.getLogger(__name__)


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
    rest. Measured on the 2-core development machine (docs/decisions.md, "Threads on a shared machine"): a
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


# ---------------------------------------------------------------------------------------------- decode.compile
# torch.compile of the lean forward's layers and head (FastKVState._core_impl) over its preallocated K/V buffers
# (dynamic shapes: one graph serves every cache length and block width; a graph per model layout and mask kind).
# Inductor on CPU, mode="reduce-overhead" (CUDA graphs where inductor can use them) on CUDA. "auto" = on for CUDA,
# off on CPU: on the 2-core AVX2 machine the first compile of the reference target's forward took 324 s (load
# average 9) and the compiled 1- and 5-position forwards were no faster than the uncompiled ones (12.2 / 20.0 ms
# against 12.6-17.9 / 22.9-31.1 ms in the same run; see docs/decoder.md), so compiling cannot pay back within an
# evaluation there.
COMPILE_MODES = ("auto", "on", "off")

# ---------------------------------------------------------------------------------------------- row layouts
# Which layout multiplies several rows is measured, not assumed: the best one is a property of the machine's BLAS
# kernels. On the 2-core AVX2 machine the weight-left form (:func:`rows_times`) made a 5-row forward of the reference
# target cost 1.2-1.4x a one-row forward instead of about 2x; on a 2-core AVX-512 (AMX) Xeon the same form is 2-5x
# slower than ``x @ W`` on the ``(in, out)`` copy for 2 to 33 rows (qkv projection, 2 rows: 86 against 15 us; head,
# 5 rows: 386 against 215 us), and the one-row layout there costs about what one row costs up to 5-9 rows.
# "auto" times both forms once per process on the model's own projection shapes (one layer's four and the head, 4
# and 16 rows, alternated, medians) at the thread count multi-row forwards run with, and keeps the faster; the two
# forms compute the same products (only the summation order inside the BLAS kernel may differ, as between a one-row
# and a several-row forward).
#
# One-row products (one-token forwards: target-only decoding, the draft's steps) multiply a vector with every weight
# of the model once, from memory. On the 2-core AMD EPYC (AVX-512) development machine, SmolLM2-135M-Instruct's
# one-position forward took 50.6 ms with ``x @ W`` on the (in, out) copies against 36.0 ms for a two-position forward
# with the weight-left form: the one-row layout read the weights at 10 GB/s, the weight-left one at 15 GB/s (28-31
# GB/s measured for a plain sum). So under ``auto`` the one-row layout is measured too, over all of the model's
# products in turn (its whole weight set, so the weights come from memory as in a real forward, not from a cache).
# The weight-left form multiplies one row as two, beside a zero row (:func:`rows_times`): a one-column product goes to
# MKL's matrix-vector kernel, 57 ms for SmolLM2's products on that machine, against 29 ms as two columns and 39 ms
# for ``x @ W``; measured so, the one-token forward went from 53-57 ms to 38-50 ms (session 18).
ROW_LAYOUTS = ("auto", "weight_left", "activation_left")


class LeanSettings:
    """``decode.compile`` and the row layout of lean forwards built from now on, and what this process compiled and
    measured under them (one instance, :data:`SETTINGS`).

    Attributes:
        compile_mode: one of :data:`COMPILE_MODES` (``decode.compile``).
        compile_time_s: seconds spent in lean-forward calls that compiled a new graph, since the process started.
        compiled: device type -> the compiled forward core (one per process, shared by every state).
        row_layout: one of :data:`ROW_LAYOUTS`: how several-row products multiply on packed CPU weights.
        row_layout_measured: ``(device type, dtype, shapes, threads) -> (chosen layout, times)`` for several rows.
        one_row_measured: ``(device type, dtype, shapes, layers, threads) -> (chosen layout, times)`` for one row.
    """

    def __init__(self):
        self.compile_mode = "auto"
        self.compile_time_s = 0.0
        self.compiled: dict[str, object] = {}
        self.row_layout = "auto"
        self.row_layout_measured: dict[tuple, tuple[str, dict]] = {}
        self.one_row_measured: dict[tuple, tuple[str, dict]] = {}

    # ------------------------------------------------------------------ decode.compile
    def set_compile(self, mode: str) -> None:
        """Set ``decode.compile`` for lean forwards built from now on: ``"auto"`` (on for CUDA, off on CPU),
        ``"on"``, ``"off"``. Raises ``ValueError`` for another value."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"decode.compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
        self.compile_mode = mode

    def compile_enabled(self, device) -> bool:
        """Whether a lean forward on ``device`` is compiled under the current ``decode.compile`` setting."""
        if self.compile_mode == "auto":
            return torch.device(device).type == "cuda"
        return self.compile_mode == "on"

    def compile_seconds(self) -> float:
        """Seconds spent in lean-forward calls that compiled a new graph (compile time), since the process
        started."""
        return self.compile_time_s

    def compiled_core(self, device, core):
        """``core`` (``FastKVState._core_impl``) compiled for ``device``'s type: built on first use, then shared
        by every state of the process."""
        kind = torch.device(device).type
        if kind not in self.compiled:
            import torch._dynamo as dynamo

            # target and draft layouts x (one-token, block) x dense / holes: more graphs than the default limit of 8
            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
            mode = None
            if kind == "cuda":
                import torch._inductor.config as inductor

                # CUDA graphs replay fixed shapes: a graph whose shapes follow the cache length would be re-recorded
                # at every length, so those run as plain inductor kernels (a static-shape forward is not built yet)
                inductor.triton.cudagraph_skip_dynamic_graphs = True
                mode = "reduce-overhead"
            self.compiled[kind] = torch.compile(core, dynamic=True, mode=mode)
        return self.compiled[kind]

    # ------------------------------------------------------------------ row layouts
    def set_row_layout(self, mode: str) -> None:
        """How lean forwards built from now on multiply several rows on CPU (packed weights): ``"auto"``
        (measured, see above), ``"weight_left"`` (``(W x^T)^T`` on the ``(out, in)`` copy) or ``"activation_left"``
        (``x W`` on the ``(in, out)`` copy, the one-row layout). Raises ``ValueError`` for another value."""
        if mode not in ROW_LAYOUTS:
            raise ValueError(f"row layout must be one of {', '.join(ROW_LAYOUTS)}, got {mode!r}")
        self.row_layout = mode

    def row_layout_record(self) -> dict:
        """What ``auto`` chose so far in this process, for reports: ``{"setting", "measured": [{"shapes",
        "threads", "chosen", "weight_left_us", "activation_left_us"}, ...], "one_row": [... the same for one-row
        products, with "layers"]}`` (microseconds for the timed set of products)."""
        return {"setting": self.row_layout,
                "measured": [{"shapes": [list(s) for s in key[2]], "threads": key[3], "chosen": chosen, **times}
                             for key, (chosen, times) in self.row_layout_measured.items()],
                "one_row": [{"shapes": [list(s) for s in key[2]], "layers": key[3], "threads": key[4],
                             "chosen": chosen, **times} for key, (chosen, times) in self.one_row_measured.items()]}

    def row_layout_for(self, layer: tuple, rows: tuple, lm: torch.Tensor, lm_rows: torch.Tensor,
                       device: torch.device) -> str:
        """The layout several-row products use for a model with this first layer's packed weights ``layer``
        (``(ln1, eps1, W_qkv, W_o, ln2, eps2, W_gu, W_down)``), their ``(out, in)`` twins ``rows`` and head ``lm`` /
        ``lm_rows``: the setting, or under ``auto`` the measured faster form (once per shapes, dtype and threads)."""
        if self.row_layout != "auto":
            return self.row_layout

        threads = resolved_block_threads(device) or torch.get_num_threads()
        pairs = [(layer[2], rows[0]), (layer[3], rows[1]), (layer[6], rows[2]), (layer[7], rows[3]), (lm, lm_rows)]
        key = (torch.device(device).type, str(lm.dtype), tuple(tuple(w.shape) for w, _ in pairs), threads)
        if key not in self.row_layout_measured:
            self.row_layout_measured[key] = _measure_row_layout(pairs, threads)
        return self.row_layout_measured[key][0]

    def one_row_layout_for(self, layers: list, rows_all: list, lm: torch.Tensor, device: torch.device) -> str:
        """The layout one-row products use: ``activation_left`` unless ``auto`` measured the weight-left form (one
        row as two) faster over the whole model (once per shapes, layer count, dtype and threads). No margin: on the
        AMD EPYC the two forms' sweeps differed by 3-30 % from one process to the next (the weight-left one always
        the faster in a whole forward: 38-50 against 53-58 ms), and a 5 % margin let a close measurement keep the
        slower form."""
        if self.row_layout != "auto":
            return "activation_left"
        pairs = [(layer[j], rows[k]) for layer, rows in zip(layers, rows_all[:-1])
                 for j, k in ((2, 0), (3, 1), (6, 2), (7, 3))]
        pairs.append((lm, rows_all[-1]))
        threads = torch.get_num_threads()
        key = (torch.device(device).type, str(lm.dtype),
               tuple(tuple(w.shape) for w, _ in pairs[:4]) + (tuple(lm.shape),), len(layers), threads)
        if key not in self.one_row_measured:
            self.one_row_measured[key] = _measure_one_row(pairs, threads)
        return self.one_row_measured[key][0]


SETTINGS = LeanSettings()
set_compile = SETTINGS.set_compile
compile_enabled = SETTINGS.compile_enabled
compile_seconds = SETTINGS.compile_seconds
set_row_layout = SETTINGS.set_row_layout
row_layout_record = SETTINGS.row_layout_record


def graph_count() -> int:
    """Graphs torch.compile has built in this process (a change across a call: that call compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------------- products
def _two_rows(x: torch.Tensor) -> torch.Tensor:
    """``x (1, K)`` -> ``(2, K)``: the row and a zero row, in one contiguous buffer (see :func:`rows_times`)."""
    return torch.cat([x, torch.zeros_like(x)])


def rows_times(x: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ w_rows^T`` -> ``(M, N)`` contiguous, for ``M >= 1`` rows and ``w_rows (N, K)`` contiguous.

    Computed as ``(w_rows @ x^T)^T``: with the weight as the left operand MKL streams it once and packs only the
    few rows of ``x``; ``x @ W`` on the ``(K, N)`` copy (the one-row layout) makes it pack the whole weight for
    every call. On the 2-core AVX2 machine, the reference target's 25 projections over 5 rows took 2.5 ms this way
    against 3.8 ms (4 rows: 1.9 against 6.3 ms, median of 4 alternated runs; one row stays faster on the ``(K, N)``
    copy: 2.4 ms), which is what made a verify forward cost about twice a one-token forward.

    One row (``M = 1``) is multiplied as two, beside a zero row: a one-column product goes to MKL's matrix-vector
    kernel, which on the 2-core AMD EPYC streamed SmolLM2-135M-Instruct's 538 MB of weights in 57 ms, against
    29 ms for the same products over two real rows (and 39 ms for ``x @ W`` on the ``(K, N)`` copies; medians of 7
    alternated sweeps). The second row's zeros cost no bandwidth, and row 0 is what a two-row product computes for
    it. Whether one-row forwards use this form is measured per machine (:meth:`LeanSettings.one_row_layout_for`).
    """
    if x.shape[0] == 1:
        return torch.mm(w_rows, _two_rows(x).t())[:, 0].unsqueeze(0).contiguous()  # (1, N): column 0 of (N, 2)
    return torch.mm(w_rows, x.t()).t().contiguous()


def rows_addmm(res: torch.Tensor, x: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """``res + x @ w_rows^T`` (``res (M, N)``, ``x (M, K)``) in one ``addmm``, the layout of :func:`rows_times`
    (one row multiplied as two, as there)."""
    if x.shape[0] == 1:
        return torch.addmm(_two_rows(res).t(), w_rows, _two_rows(x).t())[:, 0].unsqueeze(0).contiguous()
    return torch.addmm(res.t(), w_rows, x.t()).t().contiguous()


@torch.inference_mode()
def _measure_row_layout(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int, rounds: int = 9) -> tuple:
    """``("weight_left" | "activation_left", {"weight_left_us", "activation_left_us"})``: the summed median time of
    ``x @ W`` for every ``(W (in, out), W_rows (out, in))`` of ``pairs`` at 4 and 16 rows, the two forms alternated
    ``rounds`` times (the first round is warm-up) with ``threads`` threads."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [[torch.randn(m, w.shape[0], generator=gen).to(w.dtype) for m in (4, 16)] for w, _ in pairs]
        times = {"weight_left": [], "activation_left": []}
        for _ in range(rounds):
            for form in times:
                t0 = time.perf_counter()
                for (w, w_rows), x_m in zip(pairs, xs):
                    for x in x_m:
                        if form == "weight_left":
                            rows_times(x, w_rows)
                        else:
                            torch.matmul(x, w)
                times[form].append(time.perf_counter() - t0)
        med = {f"{form}_us": round(statistics.median(ts[1:]) * 1e6, 1) for form, ts in times.items()}
    finally:
        torch.set_num_threads(prev)
    return ("weight_left" if med["weight_left_us"] < med["activation_left_us"] else "activation_left"), med


@torch.inference_mode()
def _measure_one_row(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int, rounds: int = 7) -> tuple:
    """``("weight_left" | "activation_left", {"weight_left_us", "activation_left_us"})``: the median time of one
    sweep of one-row products over every ``(W (in, out), W_rows (out, in))`` of ``pairs`` in each form, the forms
    alternated ``rounds`` times after a warm-up round, with ``threads`` threads."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(1, w.shape[0], generator=gen).to(w.dtype) for w, _ in pairs]
        times = {"weight_left": [], "activation_left": []}
        for _ in range(rounds + 1):
            for form in times:
                t0 = time.perf_counter()
                for (w, w_rows), x in zip(pairs, xs):
                    rows_times(x, w_rows) if form == "weight_left" else torch.matmul(x, w)
                times[form].append(time.perf_counter() - t0)
        med = {f"{form}_us": round(statistics.median(ts[1:]) * 1e6, 1) for form, ts in times.items()}
    finally:
        torch.set_num_threads(prev)
    return ("weight_left" if med["weight_left_us"] < med["activation_left_us"] else "activation_left"), med


QUANTIZE_MODES = ("none", "int8")


def is_quantized(model: torch.nn.Module) -> bool:
    """True when ``model`` holds a dynamically quantized Linear module (a quantized trimmed head's included)."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    return any(isinstance(m, QLinear) for m in model.modules())


def quantize_draft(model: torch.nn.Module, mode: str = "int8") -> torch.nn.Module:
    """A copy of ``model`` (eval mode, CPU) whose ``nn.Linear`` layers are dynamic int8 (``mode="int8"``); the
    model itself when ``mode="none"``. The input model is not modified.

    Raises:
        ValueError: an unknown ``mode``; a model with parameters on a non-CPU device (dynamic int8 kernels are
            CPU-only in PyTorch); a model already int8, without any ``nn.Linear``, or not in float32.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"draft.quantize must be one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    if mode == "none":
        return model
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(f"draft.quantize=int8 uses torch.ao dynamic int8 quantization, whose kernels run on CPU only; "
                         f"the draft is on {sorted(devices)}. Decode on CPU, or set draft.quantize=none on a GPU.")
    if is_quantized(model):
        raise ValueError(f"draft.quantize=int8: {type(model).__name__} is already int8; quantize its fp32 draft "
                         f"(decode.fast_settings.load_draft does, from the draft directory)")
    if not any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        raise ValueError(f"draft.quantize=int8: {type(model).__name__} has no nn.Linear layer to quantize")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {torch.float32}:
        raise ValueError(f"draft.quantize=int8 takes a float32 draft (the int8 kernels compute in float32); this one "
                         f"is {', '.join(sorted(str(d)[6:] for d in dtypes))}: load it in float32 (model.float())")
    from models.vocab import trimmed_head

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.ao -> torchao migration notice
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        out = torch.ao.quantization.quantize_dynamic(model.eval(), _per_row_spec(), dtype=torch.qint8,
                                                     inplace=False).eval()
        head = trimmed_head(out)
        if head is not None:  # not an nn.Linear: quantize its N kept rows the same way
            lin = torch.nn.Linear(head.in_features, head.num_kept, bias=False)
            with torch.no_grad():
                lin.weight.copy_(head.weight)
            head.quantized = torch.ao.quantization.quantize_dynamic(
                torch.nn.Sequential(lin).eval(), _per_row_spec(), dtype=torch.qint8)[0]
    return out


def _per_row_spec() -> dict:
    """``quantize_dynamic``'s spec: every ``nn.Linear`` with int8 weights per output row (one scale per row, so the
    rows of several projections can be stacked into one module exactly: :func:`fuse_int8_rows`)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    return {torch.nn.Linear: per_channel_dynamic_qconfig}


def fuse_int8_rows(modules) -> torch.nn.Module | None:
    """One dynamic int8 Linear whose output rows are those of ``modules`` in order (e.g. q/k/v or gate/up
    projections that read the same input), or ``None`` when they cannot be stacked exactly (not all per-row int8
    without bias, or different input widths). Exact: each row keeps its int8 values and scale, and the activation
    is quantized from the same input, so ``fused(x)`` equals ``cat([m(x) for m in modules], -1)`` bit for bit
    (tested); one call instead of several saves the per-call activation quantization and dispatch (about 20 us a
    call on the 2-core development machine, a third of an int8 draft forward's products). The stacked module is a
    copy: while it is kept (``decode.fast_weights``), the stacked projections' int8 weights are held twice."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    if len(modules) < 2 or not all(isinstance(m, QLinear) and m._packed_params.dtype == torch.qint8 for m in modules):
        return None  # float16 dynamic modules (quantize_dynamic(dtype=torch.float16)) keep their own calls
    ws = [m.weight() for m in modules]
    if any(w.qscheme() != torch.per_channel_affine or w.q_per_channel_axis() != 0 for w in ws) \
            or any(m.bias() is not None for m in modules) or len({w.shape[1] for w in ws}) != 1:
        return None
    fused = torch._make_per_channel_quantized_tensor(
        torch.cat([w.int_repr() for w in ws]), torch.cat([w.q_per_channel_scales() for w in ws]).double(),
        torch.cat([w.q_per_channel_zero_points() for w in ws]).long(), 0)
    out = QLinear(ws[0].shape[1], fused.shape[0], bias_=False, dtype=torch.qint8)
    out.set_weight_bias(fused, None)
    return out


def check_quantize_meta(path: str | os.PathLike) -> str:
    """The ``quantize`` mode recorded in ``<path>/specdraft.json`` (``"none"`` when absent), checked without
    loading the model.

    Raises:
        models.checkpoints.CheckpointError: an unknown mode (names the file and the supported modes).
    """
    from models.checkpoints import CheckpointError, read_specdraft_meta

    mode = read_specdraft_meta(path).quantize_mode
    if mode not in QUANTIZE_MODES:
        raise CheckpointError(f"{path}/specdraft.json has quantize={mode!r}; supported: {', '.join(QUANTIZE_MODES)}")
    return mode


def check_quantize_device(path: str | os.PathLike, device, dtype: torch.dtype = torch.float32,
                          role: str = "draft") -> str:
    """The draft's ``quantize`` mode (:func:`check_quantize_meta`), checked against where it would run.

    Raises:
        models.checkpoints.CheckpointError: an int8 draft with ``device`` not the CPU or ``dtype`` not float32
            (dynamic int8 kernels are CPU / fp32 only); the message names both fixes.
    """
    from models.checkpoints import CheckpointError

    mode = check_quantize_meta(path)
    if mode == "int8" and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise CheckpointError(f"{role} at {path} is an int8 draft (specdraft.json quantize=int8), whose kernels run on "
                              f"CPU in float32, but the evaluation runs on {device} in {str(dtype)[6:]}; set "
                              f"eval.device=cpu eval.dtype=float32, or evaluate its fp32 draft instead")
    return mode


def load_draft(path: str | os.PathLike, role: str = "draft", dtype: torch.dtype = torch.float32, device=None,
               target=None):
    """``(model, tokenizer, meta)`` of a draft directory: the Hugging Face checkpoint in ``dtype`` on ``device``
    (``None``: CPU), quantized at load time when its ``specdraft.json`` says ``"quantize": "int8"`` (see the module
    doc); ``meta`` is that ``specdraft.json``. An EAGLE-3 head shares ``target``'s embedding when one is given (a
    head saved without ``embed_tokens.weight`` needs it).

    Raises:
        models.checkpoints.CheckpointError: unreadable checkpoint or ``specdraft.json``, an unknown ``quantize``
            value in it (names the file), or an int8 draft asked for a GPU or a dtype other than float32.
    """
    from models.checkpoints import load_causal_lm, load_tokenizer, read_specdraft_meta
    from models.eagle3 import is_eagle3_dir, load_eagle3

    if is_eagle3_dir(path):  # an EAGLE-3 head (models/eagle3.py): its own weights, the target's tokenizer
        head = load_eagle3(path, target=target, dtype=dtype, device=device, role=role)
        return head, load_tokenizer(path, role), read_specdraft_meta(path)
    mode = check_quantize_device(path, device or "cpu", dtype, role)
    meta = read_specdraft_meta(path)
    model, tok = load_causal_lm(path, role=role, dtype=dtype, device=device)
    return quantize_draft(model, mode), tok, meta
