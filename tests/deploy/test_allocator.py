"""C2's causes and their remedies: glibc raises its mmap threshold after a large block is freed, so the large
buffers of a later burst come from the heap and stay resident, and small blocks freed among live ones stay with the
heap until malloc_trim. The worker fixes the threshold at start (`EXPORTS_MALLOC_MMAP_THRESHOLD_BYTES`) and gives
free pages back every `EXPORTS_MALLOC_TRIM_INTERVAL_SECONDS` (activities/process/allocator.py). `make bench`'s C2
row measures the worker under a real flood; these show each mechanism on its own and that the worker applies the
settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers.support import run_command

ROOT = Path(__file__).resolve().parents[2]

# One large block freed (which raises glibc's threshold), then 32 blocks of 2 MiB, each followed by a 16 KiB block
# that stays: the pattern of one large activation decoded among the worker's other allocations. Prints how many
# MB stay resident once the large blocks are freed.
_BURST = """
import ctypes, sys
from activities.process.allocator import configure_allocator
configure_allocator(int(sys.argv[1]), 0)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block
libc.free(touched(8 << 20))
before = rss()
large, small = [], []
for _ in range(32):
    large.append(touched(2 << 20))
    small.append(touched(16 << 10))
for block in large:
    libc.free(block)
print(round(rss() - before))
"""


async def _resident_after_burst(threshold: int) -> int:
    ran = await run_command(sys.executable, "-c", _BURST, str(threshold), cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, bound=60)
    assert ran.code == 0, ran
    return int(ran.stdout.strip())


async def test_glibcs_own_threshold_keeps_a_freed_burst_and_a_fixed_one_gives_it_back():
    # The first is what the worker did before the setting: the burst's 64 MB stay.
    assert await _resident_after_burst(0) >= 48
    assert await _resident_after_burst(1024 * 1024) <= 8


# 40 MB of small blocks (below any mmap threshold), every 64th kept: the rest is freed among live ones, in pages
# only malloc_trim gives back. Prints how many MB stay resident 1.5 s after the frees.
_SCATTERED = """
import gc, sys, time
from activities.process.allocator import configure_allocator
configure_allocator(1 << 20, float(sys.argv[1]))
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
gc.disable()
before = rss()
blocks = [bytearray(4000) for _ in range(10_000)]
kept = blocks[::64]
del blocks
time.sleep(1.5)
print(round(rss() - before))
"""


async def test_small_blocks_freed_among_live_ones_stay_resident_until_the_worker_gives_them_back():
    async def resident(interval: str) -> int:
        ran = await run_command(sys.executable, "-c", _SCATTERED, interval, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, bound=60)
        assert ran.code == 0, ran
        return int(ran.stdout.strip())

    assert await resident("0") >= 30  # never given back: what the worker did before the setting
    assert await resident("0.2") <= 8


@pytest.mark.parametrize(("setting", "value", "said"), [
    ("MALLOC_MMAP_THRESHOLD_BYTES", None, "glibc's mmap and trim thresholds fixed at 1048576 bytes"),
    ("MALLOC_MMAP_THRESHOLD_BYTES", "0", "the C allocator's own mmap threshold"),
    ("MALLOC_MMAP_THRESHOLD_BYTES", "33554433", None),
    ("MALLOC_TRIM_INTERVAL_SECONDS", None, "free heap pages given back every 10 s"),
    ("MALLOC_TRIM_INTERVAL_SECONDS", "0", "free heap pages are not given back"),
    ("MALLOC_TRIM_INTERVAL_SECONDS", "-1", None),
])
async def test_the_worker_applies_the_allocator_settings_at_start_and_refuses_bad_ones(tmp_path, setting, value,
                                                                                       said):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "TEMPORAL_"))}
    env.update(TEMPORAL_PROFILE="nowhere", EXPORTS_WORK_DIR=str(tmp_path / "work"))
    if value is not None:
        env[f"EXPORTS_{setting}"] = value
    # A profile that does not exist stops the worker at its first connection, after the allocator's lines.
    ran = await run_command(sys.executable, "-m", "worker", env=env, cwd=ROOT, bound=60)
    assert ran.code == 2, ran
    if said is None:
        assert setting.lower() in ran.stderr.lower() and "memory:" not in ran.stderr, ran
    else:
        assert f"memory: {said}" in ran.stderr, ran
