"""Model servers behind one interface (`sidecar.engine.base.Engine`), found by name.

`ENGINES` maps an engine kind to the ``module:Class`` that serves it; `create_engine` imports
that module only when asked for, so specrl never needs SGLang installed unless it serves with
it. A new engine registers one line here (its class needs a ``from_config``) and its kind in
`EngineConfig.kind`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.engine.config import ENGINE_KINDS, EngineConfig

if TYPE_CHECKING:
    from sidecar.engine.base import Engine

ENGINES: dict[str, str] = {
    "torch": "sidecar.engine.torch_engine:TorchEngine",
    "sglang": "sidecar.engine.sglang.engine:SGLangEngine",
}
"""Engine kind → ``module:Class`` (imported lazily by `create_engine`)."""

assert tuple(ENGINES) == ENGINE_KINDS  # `EngineConfig.kind` names these


def engine_class(kind: str) -> type[Engine]:
    """The Engine class registered as `kind` (imports its module)."""
    try:
        target = ENGINES[kind]
    except KeyError:
        raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}") from None
    module, _, name = target.partition(":")
    cls: type[Engine] = getattr(importlib.import_module(module), name)
    return cls


def create_engine(model_path: str | Path, config: EngineConfig, **options: Any) -> Engine:
    """The engine `config.kind` (a key of `ENGINES`) serving the specrl checkpoint at `model_path`
    as `config` says. `options` go to the engine's ``from_config`` beside it: the SGLang engine takes
    ``work_dir`` and any `SGLangEngineConfig` field (e.g. ``tp_size``, ``extra_server_args``)."""
    cls = engine_class(config.kind)
    engine: Engine = cls.from_config(model_path, config, **options)  # type: ignore[attr-defined]
    return engine
