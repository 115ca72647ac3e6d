"""Tensors as the bytes every transport carries: C-contiguous, little-endian."""

from __future__ import annotations

import sys

import numpy as np
import torch

from sidecar.types import TensorSpec
from sidecar.weight_transport.checksum import crc32

if sys.byteorder != "little":  # the wire format is little-endian; so is every supported host
    raise ImportError(
        "sidecar.weight_transport needs a little-endian host (the specrl.v1 tensor bytes are little-endian)"
    )


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The C-contiguous little-endian bytes of a CPU tensor, as a uint8 array view (no copy when
    the tensor is already contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 (zlib polynomial) of a tensor's C-contiguous little-endian bytes: the checksum of
    `TensorSpec.crc32`, of a push manifest and of DescribeWeights(include_checksums)."""
    return crc32(tensor_bytes(tensor))


def is_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in `tensor` (integer tensors always are). One reduction that keeps
    NaN and infinities (its min and max), with no temporary the size of the tensor: on CPU about
    half the speed of the CRC-32 every pushed byte already gets (BENCHMARKS, "Weight transports")."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))
