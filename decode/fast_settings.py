"""The settings of lean forwards (:mod:`decode.fast_llama`) built from now on, gathered in ONE object,
:data:`SETTINGS` (a :class:`LeanSettings`): ``decode.compile`` and the layout of the products on packed CPU
weights, with what this process compiled and measured under them. :func:`set_compile`, :func:`compile_enabled`,
:func:`compile_seconds`, :func:`set_row_layout` and :func:`row_layout_record` are its bound methods (re-exported by
:mod:`decode.fast_llama`). Also here: the weight-left products that the ``weight_left`` layout names
(:func:`rows_times`, :func:`rows_addmm`) and their timing.
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["SETTINGS", "LeanSettings", "COMPILE_MODES", "ROW_LAYOUTS", "set_compile", "compile_enabled",
           "compile_seconds", "set_row_layout", "row_layout_record", "rows_times", "rows_addmm", "graph_count"]

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
        from .threads import resolved_block_threads

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
