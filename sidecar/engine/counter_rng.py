"""Counter-based uniforms on the device: each one a pure function of (row seed, position, role, index).

Why: a row's random numbers must not depend on which rows share its batch (batched == unbatched),
and a decode round must draw them without per-row host work (no per-row `torch.Generator`, no
Python loop, no host copy), so that it stays fixed-shape device work that can be compiled or
captured. A counter-based generator gives both: the uniform for key (seed, position, role, index)
is a hash of the key, computed elementwise by ordinary integer tensor operations.

The hash: two 32-bit lanes (64 bits of state, so distinct keys of one row collide with
probability ~2^-64), each absorbing the key words through Chris Wellons' "lowbias32" mixer
(xor-shift, multiply, xor-shift, multiply, xor-shift; a bijection of 32-bit words with low bias),
then the lanes are folded into one word whose top 24 bits make the uniform: u = h / 2^24 in
[0, 1), the resolution of torch.rand's float32 uniforms. All arithmetic is exact in int64
(products of a 32-bit word and a constant below 2^31 stay below 2^63), so CPU, CUDA, eager and
compiled code agree bit for bit.

The engine's keys: the row seed (63 bits, from the request seed, prompt index and sample index),
the round's *output position* n (tokens the row had emitted when the round started: rounds start
at strictly increasing n, so no key is ever drawn twice), a role (draft sample, acceptance test,
final token) and the index within the round. `tests/sidecar/engine/test_counter_rng.py` checks uniformity
and pairwise independence with calibrated chi-square tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sidecar.engine.config import MAX_SPECULATION_K

_M32 = 0xFFFFFFFF
_LANE_A = (0x21F0AAAD, 0x735A2D97)
_LANE_B = (0x7FEB352D, 0x2C1B3C6D)  # below 2^31 (exact int64 products), odd

ROLE_DRAFT, ROLE_ACCEPT, ROLE_FINAL = 0, 1, 2
MAX_INDEX = MAX_SPECULATION_K + 1
"""Indices per role and position (the engine's maximum speculation k is MAX_INDEX - 1)."""


def _mix(x: Tensor, c: tuple[int, int]) -> Tensor:
    """lowbias32 on int64 tensors holding 32-bit words."""
    x = x ^ (x >> 16)
    x = (x * c[0]) & _M32
    x = x ^ (x >> 15)
    x = (x * c[1]) & _M32
    return x ^ (x >> 15)


def row_keys(seeds: Tensor) -> Tensor:
    """(B,) int64 seeds in [0, 2^63) -> (B, 2) int64 lane states after absorbing the seed."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    a = _mix(_mix(lo ^ 0x9E3779B9, _LANE_A) ^ hi, _LANE_A)
    b = _mix(_mix(hi ^ 0x85EBCA6B, _LANE_B) ^ lo, _LANE_B)
    return torch.stack([a, b], dim=-1)


def uniforms(keys: Tensor, words: Tensor) -> Tensor:
    """keys (B, 2) from `row_keys`, words (B, N) int64 -> (B, N) float32 uniforms in [0, 1)."""
    a = _mix(keys[:, :1] ^ words, _LANE_A)
    b = _mix(keys[:, 1:] ^ words, _LANE_B)
    h = _mix(a ^ (((b << 16) | (b >> 16)) & _M32), _LANE_A)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def round_words(positions: Tensor, k: int) -> Tensor:
    """(B,) output positions -> (B, 2k + 1) words of one round: k draft samples, k acceptance
    tests, the final token (the column layout the engine's round uses). The word of (position,
    role, index) is position * 256 + role * 64 + index, made as one product and one sum."""
    i = torch.arange(k, dtype=torch.int64, device=positions.device)  # made on the device: no host copy
    final = torch.full((1,), ROLE_FINAL * MAX_INDEX, dtype=torch.int64, device=positions.device)
    offsets = torch.cat([ROLE_DRAFT * MAX_INDEX + i, ROLE_ACCEPT * MAX_INDEX + i, final])
    return positions[:, None] * 256 + offsets
