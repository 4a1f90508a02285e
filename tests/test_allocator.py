"""service.engine.allocator: the serving process keeps freed image-sized buffers for the next image."""

import subprocess
import sys

import pytest
from page_faults import fresh_faults

from service.engine.allocator import MMAP_THRESHOLD_MAX, keep_freed_memory

# Three 16 MiB blocks alive at once, freed, then allocated again (the shape of a 12 MP Pillow
# decode), in a worker thread as the server's executor runs it. Prints the page faults of the
# last round.
_PROGRAM = """
import ctypes, resource, sys, threading
from service.engine.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory(256 << 20)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rounds():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(16 << 20) for _ in range(3)]  # as Pillow allocates a large image
        for b in blocks:
            ctypes.memset(b, 1, 16 << 20)  # decoding writes every page
        for b in blocks:
            libc.free(b)
        faults[0] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults = [0]
t = threading.Thread(target=rounds); t.start(); t.join()
print(faults[0])
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True, check=True,
                         timeout=60)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    fresh = fresh_faults(3 * (16 << 20))  # 12,288 base pages; fewer faults with multi-size THP
    assert _faults("default") > fresh // 2  # glibc's defaults hand the blocks back every round
    assert _faults("tuned") < fresh // 20


def test_trim_threshold_below_mmap_threshold_is_refused():
    with pytest.raises(ValueError, match="trim_bytes"):
        keep_freed_memory(MMAP_THRESHOLD_MAX - 1)
