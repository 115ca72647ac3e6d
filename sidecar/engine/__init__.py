"""Model servers behind one interface (`sidecar.engine.base.Engine`).

`create_engine` builds one by name; the SGLang engine is imported only when asked for, so
specrl never needs SGLang installed unless it serves with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.engine.base import Engine

ENGINE_KINDS = ("torch", "sglang")


def create_engine(kind: str, model_path: str | Path, **options: Any) -> Engine:
    """The engine `kind` ("torch" or "sglang") serving the specrl checkpoint at `model_path`.

    `options` go to the engine's ``from_checkpoint``: both take ``device``, ``speculation_k``,
    ``max_speculation_k`` and ``max_batch_size``; the SGLang engine also takes ``work_dir``
    and any `SGLangEngineConfig` field (e.g. ``tp_size``, ``mem_fraction_static``).
    """
    if kind == "torch":
        from sidecar.engine.torch_engine import TorchEngine

        return TorchEngine.from_checkpoint(model_path, **options)
    if kind == "sglang":
        from sidecar.engine.sglang_engine import SGLangEngine

        return SGLangEngine.from_checkpoint(model_path, **options)
    raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}")
