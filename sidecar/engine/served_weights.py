"""The torch engine's served weights: what a push addresses, its checks, and how it is swapped in.

Split from `torch_engine.py` (a mixin `TorchEngine` inherits): the names and shapes a weight
selector covers (the checkpoint's, plus an EAGLE-3 draft's `eagle3.*`), their checksums, and an
update landing between engine steps — copied into the parameters, or, when adopting, the pushed
tensors becoming the parameters' storage where nothing else shares it. Captured CUDA graphs read
the weights where they were captured: a copy keeps them there; an adoption moves them, and the
engine's rounds notice the new addresses (`round_graphs.FixedRounds.check_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sidecar.engine.drafters import Drafter
from sidecar.engine.validation import check_weights
from sidecar.engine.version_ledger import VersionLedger
from sidecar.model.checkpoint import draft_tensor_shapes, target_tensor_shapes
from sidecar.model.model import ModelConfig, Qwen3WithMTP
from sidecar.speculation.controller import SpeculationPolicy
from sidecar.types import TensorSpec, WeightSelector
from sidecar.weight_sync.tensors import tensor_crc32


class ServedWeights:
    """The weight side of `TorchEngine` (see the module docstring)."""

    model: Qwen3WithMTP
    config: ModelConfig
    drafter: Drafter
    _version: int
    _stats: VersionLedger
    _policy: SpeculationPolicy | None
    _swaps: int

    def _selected_shapes(self, selector: WeightSelector) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        if selector in (WeightSelector.ALL, WeightSelector.TARGET):
            shapes |= target_tensor_shapes(self.config)
        if selector in (WeightSelector.ALL, WeightSelector.DRAFT):
            shapes |= draft_tensor_shapes(self.config)
            shapes |= {n: tuple(p.shape) for n, p in self.drafter.pushed_parameters().items()}
        return shapes

    def weight_specs(self, selector: WeightSelector) -> list[TensorSpec]:
        return [
            TensorSpec(name=n, dtype=self.config.dtype, shape=s) for n, s in self._selected_shapes(selector).items()
        ]

    def weight_checksums(self, selector: WeightSelector) -> dict[str, int]:
        params = dict(self.model.named_parameters()) | self.drafter.pushed_parameters()
        return {name: tensor_crc32(params[name]) for name in self._selected_shapes(selector)}

    def update_weights(self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int) -> None:
        self._check_update(tensors, selector, version)
        self._swap_in(tensors, adopt=False)
        self._served(version)

    def adopt_weights(
        self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int
    ) -> dict[str, torch.Tensor]:
        """Serve `tensors` themselves where they can be the parameters' storage (same device,
        contiguous, and a parameter that shares its storage with nothing else); copy the rest.
        Returns the displaced storages (and the copied-from tensors), which nothing here holds
        any more."""
        self._check_update(tensors, selector, version)
        free = self._swap_in(tensors, adopt=True)
        self._served(version)
        return free

    def _check_update(self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int) -> None:
        check_weights(
            tensors,
            selector=selector,
            version=version,
            served_version=self._version,
            expected=self._selected_shapes(selector),
            all_names=set(self._selected_shapes(WeightSelector.ALL)),
            dtype=self.config.dtype,
        )

    def _swap_in(self, tensors: Mapping[str, torch.Tensor], *, adopt: bool) -> dict[str, torch.Tensor]:
        self._swaps += 1  # captured rounds check the weights' addresses again (`TorchEngine._decode`)
        params = dict(self.model.named_parameters()) | self.drafter.pushed_parameters()
        shared = self._shared_storages() if adopt else set()
        free: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in tensors.items():
                p = params[name]
                # dtype and shape are the parameter's already (`_check_update`)
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

    def _served(self, version: int) -> None:
        self._version = version
        self._stats.serve(version)
        self.drafter.on_weight_push()
        if self._policy is not None:
            self._policy.on_weight_version()
