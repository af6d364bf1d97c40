"""Timing decodes on a shared machine: the one alternated-timing engine of the evaluation (:mod:`eval.evaluate`)
and the decoder benchmark (:mod:`eval.bench`, ``scripts/bench_decode.py``), the forward cost ratios c and v, and
the machine's load over a measurement.

Every measured decode is one call of a round: each compared method runs once on the same input, one after the
other, so slow drift of the machine (thermal state, other processes) hits all of them alike and each round gives
side-by-side times. A call is timed with ``time.perf_counter`` around it, the device synchronised before and after
(CUDA: its queued work counts in the call that queued it).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Hashable

import torch

from decode.common import sync
from decode.timing import block_forward_times_s, cost_ratio

__all__ = ["OTHER_LOAD_LIMIT", "LoadMeter", "alternated_rounds", "busy_cpu_seconds", "cpu_cores", "load_record",
           "measure_cost_ratio", "measure_verify_cost_ratio", "timed_call"]


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), wall seconds of the call)``, the device synchronised before and after (CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def alternated_rounds(calls: dict[Hashable, Callable[[], Any]], device: torch.device, rounds: int = 1, *,
                      rotate: bool = False, after: Callable[[Hashable], None] | None = None
                      ) -> tuple[dict[Hashable, list], dict[Hashable, list[float]]]:
    """``rounds`` rounds of every call in ``calls``, each call timed by :func:`timed_call`.

    Round r runs the calls in their dict order, or with ``rotate`` on odd rounds that order rotated left by one
    (the first call runs last), so neither the first method nor the others always run on a "fresh" machine; the
    evaluation passes target-only first. ``after(key)`` runs after each call, outside its time (a progress bar).

    Returns:
        ``(results, seconds)``: ``{key: [fn() of each round]}`` and ``{key: [wall seconds of each round]}``.
    """
    keys = list(calls)
    results: dict[Hashable, list] = {k: [] for k in keys}
    seconds: dict[Hashable, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[1:] + keys[:1] if rotate and r % 2 == 1 else keys
        for key in order:
            out, t = timed_call(calls[key], device)
            results[key].append(out)
            seconds[key].append(t)
            if after is not None:
                after(key)
    return results, seconds


@torch.inference_mode()
def measure_cost_ratio(target, draft, input_ids: torch.Tensor, trials: int = 20,
                       fast_path: bool | None = None) -> dict[str, float]:
    """Cost ratio c of ``draft`` against ``target`` on ``input_ids`` (1, T): ``{"cost_ratio", "target_forward_s",
    "draft_forward_s"}`` (seconds; medians of ``trials`` one-token cached forwards, the two models alternating,
    through the decoder's own forward path: :func:`decode.timing.cost_ratio`; ``fast_path`` False: the Hugging
    Face forward)."""
    device = next(target.parameters()).device
    return cost_ratio(target, draft, input_ids.to(device), steps=trials, fast_path=fast_path)


def measure_verify_cost_ratio(target, input_ids: torch.Tensor, draft_lengths, trials: int = 20,
                              fast_path: bool | None = None) -> dict[str, dict]:
    """Verify cost ratio v per draft length k: ``{str(k): {"verify_cost_ratio", "verify_forward_s",
    "target_forward_s"}}`` = (k + 1)-position target forward / one-position forward (seconds; medians of ``trials``,
    the decoder's own forward path, widths alternating: :func:`decode.block_forward_times_s`). ``draft_lengths``:
    every draft length (and token tree's mean node count) the decodes used, :func:`eval.evaluate.verified_lengths`;
    0 is skipped (v_0 = 1)."""
    device = next(target.parameters()).device
    ks = sorted({int(k) for k in draft_lengths if int(k) > 0})
    if not ks:
        return {}
    widths = sorted({1, *(k + 1 for k in ks)})
    t = block_forward_times_s(target, input_ids.to(device), widths, steps=trials, fast_path=fast_path)
    return {str(k): {"verify_cost_ratio": t[k + 1] / t[1], "verify_forward_s": t[k + 1], "target_forward_s": t[1]}
            for k in ks}


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity set; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


OTHER_LOAD_LIMIT = 0.25  # cores other processes may keep busy before a domain's timing counts as disturbed


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has spent busy since boot (``/proc/stat``'s first line: everything
    but idle and iowait), or None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_record(before, after, own_cores: float | None = None, other_cores: float | None = None) -> dict:
    """The machine's load around a measurement: ``{"loadavg_before": [1, 5, 15 min], "loadavg_after": [...],
    "cores": n, "own_cores", "other_load", "overloaded": bool}``.

    ``own_cores``: the cores this process kept busy while measuring (its CPU seconds / wall seconds, all threads).
    ``other_cores``: the cores every other process kept busy over the same interval (the machine's busy CPU
    seconds from ``/proc/stat`` minus this process's, per wall second): recorded as ``other_load``. Without it,
    ``other_load`` = the higher 1-minute load average minus ``own_cores`` (the load average counts this process's
    busy threads too, and lags by about a minute). Overloaded when ``other_load`` exceeds :data:`OTHER_LOAD_LIMIT`
    (a quarter of a core); without ``own_cores`` either (an older caller) when the load average exceeds the
    cores."""
    cores = cpu_cores()
    before, after = [round(float(x), 2) for x in before], [round(float(x), 2) for x in after]
    peak = max(before[0], after[0])
    if own_cores is None and other_cores is None:
        return {"loadavg_before": before, "loadavg_after": after, "cores": cores, "own_cores": None,
                "other_load": None, "overloaded": peak > cores}
    own = None if own_cores is None else round(float(own_cores), 2)
    other = round(max(0.0, float(other_cores) if other_cores is not None else peak - own), 2)
    return {"loadavg_before": before, "loadavg_after": after, "cores": cores, "own_cores": own,
            "other_load": other, "overloaded": other > OTHER_LOAD_LIMIT}


class LoadMeter:
    """The machine's load over a timed measurement (the evaluation's domains, the decoder benchmark):
    ``meter = LoadMeter().start()`` ... ``meter.stop()`` (or ``with LoadMeter() as meter:``) sets ``meter.record``
    to :func:`load_record` over that interval (``meter.seconds``: its wall seconds), this process's busy cores from
    its CPU time and every other process's from ``/proc/stat``."""

    record: dict | None = None

    def start(self) -> "LoadMeter":
        self._t, self._cpu, self._busy = time.perf_counter(), time.process_time(), busy_cpu_seconds()
        self._load = os.getloadavg()
        return self

    def stop(self) -> dict:
        wall, own = time.perf_counter() - self._t, time.process_time() - self._cpu
        busy = busy_cpu_seconds()
        self.seconds = wall
        self.record = load_record(self._load, os.getloadavg(), own / wall if wall > 0 else None,
                                  (busy - self._busy - own) / wall if wall > 0 and None not in (self._busy, busy)
                                  else None)
        return self.record

    def __enter__(self) -> "LoadMeter":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False
