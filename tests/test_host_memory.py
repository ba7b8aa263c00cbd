"""training/host_memory.py: with `keep_freed_memory`, a large block comes from malloc's heap and stays there when
freed; without it, glibc maps it apart and unmaps it. Each case runs in its own interpreter (the setting is
process-wide)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc/self/maps")

PROBE = """
import sys
from hf_linear_attn.training.host_memory import keep_freed_memory

def heap_bytes():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = line.split()[0].split("-")
            return int(end, 16) - int(start, 16)
    return 0

if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = heap_bytes()
block = bytearray(200 * 2**20)
grown = heap_bytes() - before
del block
print(grown // 2**20, (heap_bytes() - before) // 2**20)
"""


def heap_growth_mib(mode: str) -> tuple[int, int]:
    """MiB the heap grew by with a 200 MiB block allocated, and after it was freed."""
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    allocated, freed = map(int, out.split())
    return allocated, freed


def test_a_freed_large_block_stays_in_the_heap_only_when_kept():
    assert heap_growth_mib("default") == (0, 0)  # glibc maps a block over 32 MB apart, and unmaps it
    # the block comes from the heap, part of it from room the heap already had free (the package's imports leave
    # some), and stays there when freed
    allocated, freed = heap_growth_mib("keep")
    assert 190 <= allocated <= 200 and freed == allocated
