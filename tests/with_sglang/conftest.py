"""tests/with_sglang/ runs only where SGLang is installed (tools/test-sglang builds .venv-sglang).

Elsewhere (the CPU CI environment) every test here is reported as skipped without importing
anything heavy: the check is `importlib.util.find_spec`, and the test modules import SGLang
only inside fixtures. (The directory is not called ``tests/sglang``: with ``tests/`` on
sys.path, as pytest puts it, that directory would be importable as a namespace package named
``sglang``.)
"""

from __future__ import annotations

import importlib.util

import pytest

_spec = importlib.util.find_spec("sglang")
HAVE_SGLANG = _spec is not None and _spec.origin is not None  # a namespace package is not SGLang
SKIP = pytest.mark.skip(reason="SGLang is not installed here; run tools/test-sglang (its own .venv-sglang)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_SGLANG:
        return
    for item in items:
        if "tests/with_sglang/" in str(item.path).replace("\\", "/"):
            item.add_marker(SKIP)
