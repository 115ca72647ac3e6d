"""Session fixtures of the engine tests (tiny models built from configs; no downloads)."""

from __future__ import annotations

import pytest
from engine_fixtures import aligned_draft_model

from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def random_model(tiny_config: ModelConfig) -> Qwen3WithMTP:
    """A random target with a random (misaligned) MTP layer."""
    return build_model(tiny_config, seed=1)


@pytest.fixture(scope="session")
def aligned_model(tiny_config: ModelConfig) -> Qwen3WithMTP:
    return aligned_draft_model(tiny_config, seed=2)
