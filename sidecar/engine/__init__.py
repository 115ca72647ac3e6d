"""Model servers behind one interface (`sidecar.engine.base.Engine`), found by name.

`ENGINES` maps an engine kind to the ``module:Class`` that serves it; `create_engine` imports
that module only when asked for, so specrl never needs SGLang installed unless it serves with
it. A new engine registers one line here (its class needs a ``from_checkpoint``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sidecar.engine.base import Engine

ENGINES: dict[str, str] = {
    "torch": "sidecar.engine.torch_engine:TorchEngine",
    "sglang": "sidecar.engine.sglang.engine:SGLangEngine",
}
"""Engine kind → ``module:Class`` (imported lazily by `create_engine`)."""

ENGINE_KINDS = tuple(ENGINES)


def engine_class(kind: str) -> type[Engine]:
    """The Engine class registered as `kind` (imports its module)."""
    try:
        target = ENGINES[kind]
    except KeyError:
        raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}") from None
    module, _, name = target.partition(":")
    cls: type[Engine] = getattr(importlib.import_module(module), name)
    return cls


def create_engine(kind: str, model_path: str | Path, **options: Any) -> Engine:
    """The engine `kind` (a key of `ENGINES`) serving the specrl checkpoint at `model_path`.

    `options` go to the engine's ``from_checkpoint``: both take ``device``, ``speculation_k``,
    ``max_speculation_k`` and ``max_batch_size``; the SGLang engine also takes ``work_dir``
    and any `SGLangEngineConfig` field (e.g. ``tp_size``, ``mem_fraction_static``).
    """
    cls = engine_class(kind)
    engine: Engine = cls.from_checkpoint(model_path, **options)  # type: ignore[attr-defined]
    return engine
