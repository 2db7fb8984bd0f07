"""serve's garbage collector (gradient/runtime/heap.py): startup frozen, young collections widened."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from gradient.runtime import heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


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
