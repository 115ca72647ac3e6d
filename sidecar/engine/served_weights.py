"""The engine's served weights: what a push addresses, its checks, and how it is swapped in.

The names and shapes a weight selector covers (the checkpoint's, plus an EAGLE-3 draft's
`eagle3.*`), their checksums, and an update landing between engine steps — copied into the
parameters, or, when adopting, the pushed tensors becoming the parameters' storage where nothing
else shares it. Captured CUDA graphs read the weights where they were captured: a copy keeps them
there; an adoption moves them, and the engine's rounds notice the new addresses
(`round_graphs.FixedRounds.check_weights`, after `swaps` moved). A part `TorchEngine` holds
(`engine.weights`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sidecar.engine.drafters import Drafter
from sidecar.engine.validation import check_weights
from sidecar.model.checkpoint import draft_tensor_shapes, target_tensor_shapes
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import TensorSpec, WeightSelector
from sidecar.weight_transport.tensors import tensor_crc32


class ServedWeights:
    """The weights a push may address, and their version (see the module docstring)."""

    def __init__(self, model: Qwen3WithMTP, drafter: Drafter) -> None:
        self.model, self.drafter, self.config = model, drafter, model.config
        self.version = 0
        """The weight version served."""
        self.swaps = 0
        """Weight updates swapped in (captured rounds check the weights' addresses after one)."""

    def selected_shapes(self, selector: WeightSelector) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        if selector in (WeightSelector.ALL, WeightSelector.TARGET):
            shapes |= target_tensor_shapes(self.config)
        if selector in (WeightSelector.ALL, WeightSelector.DRAFT):
            shapes |= draft_tensor_shapes(self.config)
            shapes |= {n: tuple(p.shape) for n, p in self.drafter.pushed_parameters().items()}
        return shapes

    def specs(self, selector: WeightSelector) -> list[TensorSpec]:
        dtypes = self._dtypes()
        return [TensorSpec(name=n, dtype=dtypes[n], shape=s) for n, s in self.selected_shapes(selector).items()]

    def _dtypes(self) -> dict[str, torch.dtype]:
        """Each pushable tensor's dtype: the parameter's (the model's dtype; a router's float32)."""
        params = dict(self.model.named_parameters()) | self.drafter.pushed_parameters()
        return {n: p.dtype for n, p in params.items()}

    def checksums(self, selector: WeightSelector) -> dict[str, int]:
        params = dict(self.model.named_parameters()) | self.drafter.pushed_parameters()
        return {name: tensor_crc32(params[name]) for name in self.selected_shapes(selector)}

    def check_update(self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int) -> None:
        check_weights(
            tensors,
            selector=selector,
            version=version,
            served_version=self.version,
            expected=self.selected_shapes(selector),
            all_names=set(self.selected_shapes(WeightSelector.ALL)),
            dtype=self._dtypes(),
        )

    def swap_in(self, tensors: Mapping[str, torch.Tensor], *, adopt: bool) -> dict[str, torch.Tensor]:
        """Copy `tensors` into the parameters, or with `adopt` serve them as the parameters' storage
        where that can be (same device, contiguous, a storage nothing else shares). Returns the
        displaced storages (and the copied-from tensors), which nothing here holds any more."""
        self.swaps += 1
        params = dict(self.model.named_parameters()) | self.drafter.pushed_parameters()
        shared = self._shared_storages() if adopt else set()
        free: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in tensors.items():
                p = params[name]
                # dtype and shape are the parameter's already (`check_update`)
                if (
                    adopt
                    and t.device == p.device
                    and t.is_contiguous()
                    and p.is_contiguous()
                    and p.untyped_storage().data_ptr() not in shared
                ):
                    free[name], p.data = p.data, t
                else:
                    p.copy_(t)
                    free[name] = t
        self.model.weights_changed()  # an adopted buffer may sit where one it saw before did
        return free

    def _shared_storages(self) -> set[int]:
        """Storages that more than one parameter or buffer uses: those are copied into, never
        swapped, so what shares them keeps sharing them."""
        seen: set[int] = set()
        shared: set[int] = set()
        for t in [*self.model.parameters(), *self.model.buffers()]:
            ptr = t.untyped_storage().data_ptr()
            (shared if ptr in seen else seen).add(ptr)
        return shared

    def read_tensors(self) -> list[torch.Tensor]:
        """Every tensor a round's forwards read (a captured graph holds their addresses). Read after
        a push or a rebuild of the decode weights only: in between nothing here moves them (writes
        into parameters in place, and `DecodeWeights.refresh`, keep every address)."""
        fused = [t for w in self.model.decode_weights() for t in w.tensors()]
        return [
            *self.model.parameters(),
            *self.drafter.pushed_parameters().values(),
            *fused,
            *self.drafter.head_tensors(),
        ]
