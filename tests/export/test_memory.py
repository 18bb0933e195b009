"""Process memory (cohere_coreml.export.memory): freed heap handed back to the OS."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux); a no-op elsewhere")
def test_release_memory_returns_freed_heap_to_the_os():
    """Freed blocks below glibc's mmap threshold stay resident until `release_memory` trims the heap
    (holes between live blocks: what a freed model leaves); in a fresh process, so this test's heap
    is its own."""
    script = textwrap.dedent('''
        import numpy as np
        from cohere_coreml.export.memory import release_memory
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        big = np.ones(16 * 2**20 // 8); del big  # freeing a 16 MB mmapped block raises the mmap threshold
        blocks = [np.ones(2**20 // 2) for _ in range(300)]  # 300 x 4 MB, now from the heap
        kept = blocks[1::2]  # every other block stays alive: the freed ones are holes
        del blocks
        before = rss(); release_memory(); print(before, rss())
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    before, after = map(float, out.split())
    assert before > 1000 and before - after > 400, (before, after)  # 600 MB of holes given back
