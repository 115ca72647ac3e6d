"""The SGLang engine: specrl's `Engine` over SGLang 0.5.23 (``sglang.Engine``).

One package, one concern per module:

- `engine`: `SGLangEngine` (submit / step / abort / update_weights) and its launch config;
- `backend`: the only code that touches SGLang objects (`SGLangBackend`);
- `meta`: SGLang's per-request ``meta_info`` → specrl's `Sample` and speculation counters;
- `names`: specrl's checkpoint contract → the two directories SGLang's model classes load.

Importing this package does not import SGLang; launching an engine does.
"""

from __future__ import annotations

from sidecar.engine.sglang.backend import SGLangEngineError
from sidecar.engine.sglang.engine import (
    SGLANG_VERSION,
    SGLangEngine,
    SGLangEngineConfig,
    StaleDraftError,
    build_server_args,
)

__all__ = [
    "SGLANG_VERSION",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangEngineError",
    "StaleDraftError",
    "build_server_args",
]
