"""CRC-32 of tensor bytes, and combining the CRC-32s of consecutive pieces.

The checksum is CRC-32 with the zlib polynomial: ISA-L's `isal_zlib.crc32` (a dependency; ~10x
faster than zlib's, identical values), or `zlib.crc32` where isal cannot be imported. A tensor's checksum is
not recomputed over its bytes when they arrive in pieces: it is combined from the piece
checksums the receiver computes anyway (`crc32_combine`, zlib's GF(2) operator method, which
Python's zlib does not expose), so each byte is checksummed once on each side.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

try:  # ISA-L's SIMD CRC-32: the same polynomial and values as zlib's, ~10x faster
    from isal.isal_zlib import crc32
except ImportError:  # isal has no build for this platform
    from zlib import crc32

__all__ = ["copy_and_checksum", "crc32", "crc32_combine"]

_BLOCK = 256 << 10
"""Copy-then-checksum block: small enough that the checksum reads the block back from L2 (the copy
touches twice the block). Measured on the project's EPYC VM with ISA-L, 1 GiB fused copy+CRC:
0.100 s with 256 KiB blocks against 0.112-0.120 s with 1 MiB, and 0.081 s for a bare copy."""

_CRC_POLY = 0xEDB88320


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: Sequence[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


_ZERO_BYTE_POWERS: list[tuple[int, ...]] = []  # [n]: the operator for 2**n zero bytes
_POWERS_LOCK = threading.Lock()


def _zeros_power(n: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC-32 register over 2**n zero bytes (built once)."""
    with _POWERS_LOCK:
        if not _ZERO_BYTE_POWERS:
            op = [_CRC_POLY] + [1 << i for i in range(31)]  # one zero bit
            for _ in range(3):  # 2, 4, 8 zero bits = one zero byte
                op = _gf2_square(op)
            _ZERO_BYTE_POWERS.append(tuple(op))
        while len(_ZERO_BYTE_POWERS) <= n:
            _ZERO_BYTE_POWERS.append(tuple(_gf2_square(_ZERO_BYTE_POWERS[-1])))
        return _ZERO_BYTE_POWERS[n]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B).

    Advances crc1 over len2 zero bytes with one precomputed operator per set bit of len2
    (a few microseconds), then adds crc2: CRC-32 is linear over GF(2).
    """
    n = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_zeros_power(n), crc1)
        len2 >>= 1
        n += 1
    return crc1 ^ crc2


def copy_and_checksum(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy `src` into `dst` (flat uint8 arrays of one length) and return the CRC-32 of the
    copied bytes, block by block, so each block is checksummed while it is still in cache:
    one pass over memory instead of two. Checksumming the copy, not the source, is the point
    on a receiver: what is verified is what will be applied."""
    crc = 0
    for at in range(0, dst.nbytes, _BLOCK):
        block = dst[at : at + _BLOCK]
        np.copyto(block, src[at : at + _BLOCK])
        crc = crc32(block, crc)
    return crc
