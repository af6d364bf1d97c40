"""Threads that follow the free cores (decode/fast_settings.py): ``free_cores`` counts the cores other processes leave,
``FreeCoreThreads`` re-measures between steps and sets torch's thread count to it."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

import decode.fast_settings as threads
from decode.fast_settings import FreeCoreThreads, available_cores

N = available_cores()
shared_cpu = pytest.mark.skipif(N < 2 or not os.path.exists("/proc/stat"), reason="needs 2+ cores and /proc/stat")


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10000))


class _Busy:
    """Another process holding one core while the block runs."""

    def __enter__(self):
        self.stop = multiprocessing.Event()
        self.proc = multiprocessing.Process(target=_spin, args=(self.stop,), daemon=True)
        self.proc.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.proc.join(5)


def test_free_cores_bounds_and_fallback(monkeypatch):
    assert 1 <= threads.free_cores(0.2) <= N
    monkeypatch.setattr(threads, "_core_times", lambda: None)
    assert threads.free_cores(0.0) == N  # /proc/stat unreadable: every core of the mask


@shared_cpu
def test_free_cores_does_not_count_a_core_another_process_holds():
    with _Busy():
        assert threads.free_cores(0.5) < N


@shared_cpu
def test_threads_follow_the_cores_left_while_this_process_works():
    """This process's own busy threads count as free (they are ours); another process's do not."""
    if threads.free_cores(0.5) < N:
        pytest.skip("another process holds a core already: the counts below need an idle machine")
    prev = torch.get_num_threads()
    follow = FreeCoreThreads(window_s=0.3, every_s=0.0)
    try:
        assert follow.threads == torch.get_num_threads()
        x = torch.randn(512, 512)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.6:  # our own work on every thread
            x @ x
        assert follow.update() == N
        with _Busy():
            follow.update()  # the interval before the busy process started
            time.sleep(0.6)
            assert follow.update() < N and torch.get_num_threads() == follow.threads
        time.sleep(0.6)
        after = follow.update()
        if after < N and threads.free_cores(0.5) < N:
            pytest.skip("a process outside the test started holding a core: the last count needs an idle machine")
        assert after == N  # the other process is gone
        assert [n for _, n in follow.changes] == [N, N - 1, N]
    finally:
        follow.close()
    assert torch.get_num_threads() == prev


def test_update_is_rate_limited():
    follow = FreeCoreThreads(window_s=0.0, every_s=3600)
    try:
        n = follow.threads
        assert follow.update() == n and len(follow.changes) == 1
    finally:
        follow.close()
