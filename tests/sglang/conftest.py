"""tests/sglang/ runs only where SGLang is installed (tools/test-sglang builds .venv-sglang).

Elsewhere (the CPU CI environment) every test here is reported as skipped without importing
anything heavy: the check is `importlib.util.find_spec`, and the test modules import SGLang
only inside fixtures.
"""

from __future__ import annotations

import importlib.util

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP = pytest.mark.skip(reason="SGLang is not installed here; run tools/test-sglang (its own .venv-sglang)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_SGLANG:
        return
    for item in items:
        if "tests/sglang/" in str(item.path).replace("\\", "/"):
            item.add_marker(SKIP)
