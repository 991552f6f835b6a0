"""What every actor shares (actors/common.py) that needs no Ray: how a learner's process allocates."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

LIBC, LIBC_VERSION = platform.libc_ver()
GLIBC_2_33 = LIBC == "glibc" and tuple(int(x) for x in LIBC_VERSION.split(".")[:2]) >= (2, 33)


FREED_MEMORY_PROBE = """
import ctypes, sys
import torch
from actors.common import reuse_freed_memory

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
before = libc.mallinfo2()
x = torch.ones(64 << 20, dtype=torch.uint8)
during = libc.mallinfo2()
del x
after = libc.mallinfo2()
print(during.hblkhd - before.hblkhd, after.fordblks - before.fordblks)
"""


@pytest.mark.skipif(not GLIBC_2_33, reason="glibc's malloc settings, and mallinfo2 (glibc 2.33) to read them")
def test_a_learners_process_keeps_a_freed_array_for_the_next_instead_of_unmapping_it():
    """`reuse_freed_memory` (which a learner's and a critic's actor call: it changes every
    allocation of their process, so here in a process of its own): a 64 MB array comes from the
    heap, and once freed stays there, free, for the next allocation; by default it has a mapping
    of its own, unmapped when freed."""

    def mapped_and_kept(mode: str) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", FREED_MEMORY_PROBE, mode], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent.parent, timeout=120,
        )  # fmt: skip
        return [int(v) for v in out.stdout.split()]

    size = 64 << 20
    mapped, kept = mapped_and_kept("default")
    assert mapped >= size and kept < size
    mapped, kept = mapped_and_kept("reuse")
    assert mapped == 0 and kept >= size
