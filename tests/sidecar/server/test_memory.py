"""The sidecar's allocator tuning (`sidecar.server.memory`), measured on the process's resident set
in a fresh interpreter: freed heap below a live block goes back to the OS only through
`release_freed_memory`, and after `prefer_mmap_for_large_buffers` a freed tensor-sized buffer goes
back at once, where glibc's dynamic threshold would otherwise keep it in the heap."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap

import pytest

try:
    ctypes.CDLL("libc.so.6").mallopt  # noqa: B018
    GLIBC = True
except (OSError, AttributeError):
    GLIBC = False

pytestmark = pytest.mark.skipif(not GLIBC, reason="the tuning is glibc's (a no-op elsewhere)")

MIB = 1 << 20

_PRELUDE = """
import ctypes, json, os
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def touched(n):
    p = libc.malloc(n)
    libc.memset(p, 1, n)
    return p
"""


def _run(body: str) -> dict[str, int]:
    code = _PRELUDE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def _fragmented_heap(release: bool) -> dict[str, int]:
    """64 MiB of 64 KiB blocks (heap, below the mmap threshold) freed under a live block on top."""
    return _run(f"""
        from sidecar.server.memory import release_freed_memory
        blocks = [touched(64 << 10) for _ in range(1024)]
        pin = touched(100 << 10)  # above them all: the heap cannot shrink from its top
        held = rss()
        for b in blocks:
            libc.free(b)
        if {release}:
            release_freed_memory()
        print(json.dumps({{"held": held, "after": rss()}}))
    """)


def test_release_freed_memory_returns_the_freed_heap() -> None:
    trimmed = _fragmented_heap(release=True)
    assert trimmed["held"] - trimmed["after"] > 48 * MIB, trimmed


def test_without_the_trim_the_freed_heap_stays() -> None:
    """The negative control: the same frees without the trim keep the pages resident."""
    kept = _fragmented_heap(release=False)
    assert kept["held"] - kept["after"] < 16 * MIB, kept


def _second_buffer(prefer_mmap: bool) -> dict[str, int]:
    """A 20 MiB buffer freed, then another: glibc's dynamic threshold grows past the first, so the
    second comes from the heap and stays resident after its free, unless mmap is preferred."""
    return _run(f"""
        from sidecar.server.memory import prefer_mmap_for_large_buffers
        ok = prefer_mmap_for_large_buffers() if {prefer_mmap} else True
        libc.free(touched(20 << 20))
        base = rss()
        libc.free(touched(20 << 20))
        print(json.dumps({{"ok": int(ok), "kept": rss() - base}}))
    """)


def test_prefer_mmap_returns_a_freed_buffer_at_once() -> None:
    tuned = _second_buffer(prefer_mmap=True)
    assert tuned["ok"] == 1 and tuned["kept"] < 4 * MIB, tuned


def test_without_the_tuning_a_freed_buffer_stays_in_the_heap() -> None:
    untuned = _second_buffer(prefer_mmap=False)
    assert untuned["kept"] > 16 * MIB, untuned
