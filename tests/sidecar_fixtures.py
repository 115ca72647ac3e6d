"""Shared helpers of the sidecar tests: a tiny real checkpoint, a real sidecar on port 0 around
the real TorchEngine, and the independent oracle — plain greedy decoding with the model's full
forward pass (no KV cache, no speculation, no server)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.server.grpc_server import ServerConfig
from sidecar.server.process import Sidecar, SidecarConfig
from sidecar.server.scheduler import SchedulerConfig
from sidecar.types import GenerationRequest, RequestLimits, SamplingParams

DEADLINE = 20.0
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]
NEW_TOKENS = 8


CONTEXT = 256  # pinned: the bad-input tests exceed it within the request limits


@pytest.fixture(autouse=False)
def single_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads; on a 2-core box those threads' spinning
    starves the server's RPC threads (a 2 s test took 13 s). Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config() -> ModelConfig:
    return ModelConfig.tiny(max_position_embeddings=CONTEXT)


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A full state dict (contract names) of the tiny model with a seeded random init."""
    return {n: t.clone() for n, t in model_state_dict(build_model(tiny_config(), seed=seed)).items()}


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    save_checkpoint(path, tiny_config(), weights(seed))
    return path


def greedy_reference(state: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the full forward pass: the oracle for temperature 0."""
    model = build_model(tiny_config())
    model.load_state_dict(state, strict=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def greedy_request(prompts: list[list[int]] | None = None, n: int = NEW_TOKENS, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        prompts=prompts or PROMPTS,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=n),
        **kw,  # type: ignore[arg-type]
    )


def start_sidecar(
    checkpoint: Path,
    *,
    spec_k: int = 2,
    max_batch_size: int = 64,
    limits: RequestLimits | None = None,
    scheduler: SchedulerConfig | None = None,
    max_message_mib: int = 64,
    **config: object,
) -> Sidecar:
    engine = TorchEngine.from_checkpoint(checkpoint, speculation_k=spec_k, max_batch_size=max_batch_size)
    cfg = SidecarConfig(
        server=ServerConfig(port=0, max_message_mib=max_message_mib),
        limits=limits or RequestLimits(max_prompts=64, max_samples=256, max_prompt_tokens=64, max_new_tokens=250),
        scheduler=scheduler or SchedulerConfig(max_live_sequences=512),
        shutdown_grace_s=1.0,
        **config,  # type: ignore[arg-type]
    )
    return Sidecar(engine, cfg).start()


def wait_until(condition: Callable[[], bool], timeout_s: float = DEADLINE, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
