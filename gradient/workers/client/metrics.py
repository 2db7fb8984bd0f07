"""The worker's hardware, its startup CPU benchmark and the heartbeat's metrics (psutil)."""

from __future__ import annotations

import hashlib
import time

import psutil

from gradient.core.protocol import WorkerMetrics

MIB = 1024 * 1024


def hardware() -> tuple[int, int]:
    """(cpu_count, ram_total_mb)."""
    return psutil.cpu_count(logical=True) or 1, psutil.virtual_memory().total // MIB


def cpu_core_benchmark(seconds: float = 0.2) -> int:
    """Relative single-core speed: SHA-256 over 4 KiB blocks for `seconds`, in blocks per 10 ms."""
    block = b"\x5a" * 4096
    count = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(64):
            hashlib.sha256(block).digest()
        count += 64
    elapsed = time.perf_counter() - start
    return max(1, int(count / elapsed / 100))


def prime_cpu_usage() -> None:
    """psutil measures CPU use since the previous call: make the first heartbeat's figure meaningful."""
    psutil.cpu_percent(interval=None)


def collect_metrics(*, build_peak_ram_mb: int | None = None) -> WorkerMetrics:
    """The heartbeat. Disk and network speeds are not measured (unknown to scoring)."""
    return WorkerMetrics(
        cpu_usage_pct=float(psutil.cpu_percent(interval=None)),
        ram_free_mb=int(psutil.virtual_memory().available // MIB),
        build_peak_ram_mb=build_peak_ram_mb,
    )
