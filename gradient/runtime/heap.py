"""The garbage collector of a `serve` process, set for a long-lived server that allocates per message.

CPython's cyclic collector runs a young collection every 700 container allocations net and, now and
then, a full one over every tracked object. A serve holds a few hundred thousand of them (Django, the
app's modules, the book's payloads, the sessions): a full collection took about 190 ms there, with the
GIL held, so every socket and every batch of the process stood still that long, about once every two
seconds under load (measured with bench/handout.py: 12 full collections, 2.3 s of 16 s of serve's CPU,
and the p99 of RequestJob -> AssignJob). What the hot path allocates per message is short-lived and
nearly all freed by reference counting; cycles are rare.

`tune_for_serving`, once the process has started (its modules, settings and startup recovery loaded):

- collects once and freezes what is there (`gc.freeze`): the objects of startup are never scanned again;
- lets the young generation grow to GEN0_THRESHOLD allocations before a collection (a young collection
  of that many is a few milliseconds, and what survives it is what the process keeps);
- hands the GIL on after SWITCH_INTERVAL_SECS instead of CPython's 5 ms. The lanes' threads need little
  CPU but need it at once: each round trip of a claim or report batch ends with its thread waiting for
  the GIL, held by the event loop or by another lane (a fleet's first offers: ~80 ms of Python), up to
  the interval each time. At 1 ms, bench/handout.py (100 clients, 5 000 builds, two pairs run
  alternately) had RequestJob -> AssignJob p99 140 and 116 ms against 161 and 194 ms at 5 ms.

Memory is still freed: reference counting frees almost everything at once, and collections still run,
less often. GRADIENT_GC_GEN0_THRESHOLD = 0 leaves CPython's defaults.
"""

from __future__ import annotations

import gc
import logging
import sys

from django.conf import settings

log = logging.getLogger("gradient.runtime")

GEN0_THRESHOLD = 50_000  # the default of GRADIENT_GC_GEN0_THRESHOLD
GEN1_THRESHOLD = 20
GEN2_THRESHOLD = 20
SWITCH_INTERVAL_SECS = 0.001  # the default of GRADIENT_SWITCH_INTERVAL_SECS


def tune_for_serving() -> tuple[int, int, int]:
    """Freeze what startup made, widen the young generation and shorten the GIL's switch interval;
    returns the thresholds now in force."""
    interval = float(getattr(settings, "GRADIENT_SWITCH_INTERVAL_SECS", SWITCH_INTERVAL_SECS))
    if interval > 0:
        sys.setswitchinterval(interval)
    gen0 = int(getattr(settings, "GRADIENT_GC_GEN0_THRESHOLD", GEN0_THRESHOLD))
    if gen0 <= 0:
        return gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0, GEN1_THRESHOLD, GEN2_THRESHOLD)
    log.info(
        "garbage collector: %d objects of startup frozen; thresholds %s",
        gc.get_freeze_count(),
        gc.get_threshold(),
    )
    return gc.get_threshold()
