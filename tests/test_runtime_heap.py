"""serve's garbage collector and GIL (gradient/runtime/heap.py): startup frozen, young collections widened,
the switch interval shortened."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest

from gradient.runtime import heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    before, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
        sys.setswitchinterval(interval)


def test_serving_freezes_startup_and_widens_the_young_generation(restored_gc: None, settings) -> None:
    settings.GRADIENT_GC_GEN0_THRESHOLD = 40_000
    kept = [[object()] for _ in range(100)]  # containers alive at "startup"
    thresholds = heap.tune_for_serving()
    assert thresholds == (40_000, heap.GEN1_THRESHOLD, heap.GEN2_THRESHOLD) == gc.get_threshold()
    assert gc.get_freeze_count() >= len(kept)  # they are never scanned again
    # Cycles made afterwards are still collected.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_a_threshold_of_zero_keeps_cpythons_collector(restored_gc: None, settings) -> None:
    settings.GRADIENT_GC_GEN0_THRESHOLD = 0
    gc.set_threshold(700, 10, 10)
    assert heap.tune_for_serving() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


def test_serving_hands_the_gil_on_sooner_unless_told_not_to(restored_gc: None, settings) -> None:
    sys.setswitchinterval(0.005)
    settings.GRADIENT_SWITCH_INTERVAL_SECS = 0.002
    heap.tune_for_serving()
    assert sys.getswitchinterval() == pytest.approx(0.002)
    sys.setswitchinterval(0.005)
    settings.GRADIENT_SWITCH_INTERVAL_SECS = 0
    heap.tune_for_serving()
    assert sys.getswitchinterval() == pytest.approx(0.005)
