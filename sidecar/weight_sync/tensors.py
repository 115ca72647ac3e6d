"""Tensors as the bytes every transport carries: C-contiguous, little-endian."""

from __future__ import annotations

import sys

import numpy as np
import torch

from sidecar.types import TensorSpec

if sys.byteorder != "little":  # the wire format is little-endian; so is every supported host
    raise ImportError("sidecar.weight_sync needs a little-endian host (the specrl.v1 tensor bytes are little-endian)")


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The C-contiguous little-endian bytes of a CPU tensor, as a uint8 array view (no copy when
    the tensor is already contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))
