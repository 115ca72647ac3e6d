"""Allocator tuning for processes that receive weight pushes (glibc only; no-ops elsewhere)."""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    A push allocates a model-sized set of staging tensors, most of them below glibc's mmap
    threshold, so without a trim a sidecar would keep ~1x the model of dead heap after every
    push (the next push reuses it, so the peak is unaffected; the idle footprint is not).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def prefer_mmap_for_large_buffers(threshold_bytes: int = 8 << 20) -> bool:
    """Make glibc serve every allocation >= `threshold_bytes` with its own mmap (returned to the
    OS on free) instead of letting its dynamic threshold grow past tensor-sized buffers, which
    would then fragment the heap during every push. The default, 8 MiB, stays above the 4 MiB
    chunk messages, whose heap blocks are reused from one message to the next (an mmap per
    message would page-fault every received byte twice). Process-wide: call it once
    from the process's entry point (`specrl serve` does). Returns False where unsupported."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    m_mmap_threshold = -3
    return bool(mallopt is not None and mallopt(m_mmap_threshold, threshold_bytes) == 1)
