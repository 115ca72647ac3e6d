"""Shared helpers of the sidecar tests: a tiny real checkpoint, a real sidecar on port 0 around
the real TorchEngine, the weight transports a client can be configured with, test certificates,
and the independent oracle — plain greedy decoding with the model's full forward pass (no KV
cache, no speculation, no server).

Plain functions and constants only: the fixtures built from them (one torch thread, the
module's checkpoint, a served sidecar and its client, a pair of sidecars, the certificates) are
in tests/conftest.py, where pytest finds them without an import."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.client.client import SidecarClient
from sidecar.client.transport import CollectiveConfig, TransportConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.server.grpc_server import ServerConfig
from sidecar.server.process import Sidecar, SidecarConfig
from sidecar.server.scheduler import SchedulerConfig
from sidecar.types import GenerationRequest, RequestLimits, SamplingParams, WeightTransport

DEADLINE = 20.0
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]
NEW_TOKENS = 8


CONTEXT = 256  # pinned: the bad-input tests exceed it within the request limits

GLOO = CollectiveConfig(host="127.0.0.1", timeout_s=20.0, bucket_bytes=64 << 10)
TRANSPORTS = {
    WeightTransport.GRPC: TransportConfig(shm=False),
    WeightTransport.SHM: TransportConfig(),
    WeightTransport.COLLECTIVE: TransportConfig(shm=False, collective=GLOO),
}
"""A client's transport configuration that selects each weight transport on a local sidecar."""


def tiny_config() -> ModelConfig:
    return ModelConfig.tiny(max_position_embeddings=CONTEXT)


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A full state dict (contract names) of the tiny model with a seeded random init."""
    return {n: t.clone() for n, t in model_state_dict(build_model(tiny_config(), seed=seed)).items()}


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    save_checkpoint(path, tiny_config(), weights(seed))
    return path


def greedy_reference(
    state: dict[str, torch.Tensor],
    prompt: list[int],
    n: int,
    *,
    config: ModelConfig | None = None,
    stop: int | None = None,
) -> list[int]:
    """Plain greedy decoding with the full forward pass: the oracle for temperature 0. `config`
    is the model's (default: the tiny one of `tiny_config`); decoding ends after `stop`, if given."""
    model = build_model(config or tiny_config())
    model.load_state_dict(state, strict=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == stop:
                break
    return ids[len(prompt) :]


def hf_qwen3_config(config: ModelConfig, **overrides: object) -> Any:
    """Hugging Face's Qwen3Config of the same model (for transformers' Qwen3 as an independent
    reference), with `overrides`; skips the test where transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    keys = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
    ]
    kwargs: dict[str, Any] = {k: getattr(config, k) for k in keys}
    if config.rope_scaling is not None:
        kwargs["rope_scaling"] = dict(config.rope_scaling)
    return transformers.Qwen3Config(**(kwargs | overrides))


def greedy_oracle(seed: int = 0, prompts: list[list[int]] = PROMPTS, n: int = NEW_TOKENS) -> list[list[int]]:
    """What a sidecar serving `weights(seed)` must answer to `greedy_request(prompts, n)`."""
    state = weights(seed)
    return [greedy_reference(state, p, n) for p in prompts]


def greedy_request(prompts: list[list[int]] | None = None, n: int = NEW_TOKENS, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        prompts=prompts or PROMPTS,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=n),
        **kw,  # type: ignore[arg-type]
    )


def greedy_tokens(
    client: SidecarClient, prompts: list[list[int]] | None = None, n: int = NEW_TOKENS
) -> list[list[int]]:
    """The token ids a sidecar answers to `greedy_request(prompts, n)`, one list a prompt."""
    return [s.token_ids for s in client.generate(greedy_request(prompts, n))]


def start_sidecar(
    checkpoint: Path,
    *,
    speculation_k: int = 2,
    max_batch_size: int = 64,
    limits: RequestLimits | None = None,
    scheduler: SchedulerConfig | None = None,
    max_message_mib: int = 64,
    draft: Path | None = None,
    engine_options: dict[str, Any] | None = None,
    **config: object,
) -> Sidecar:
    engine = TorchEngine.from_checkpoint(
        checkpoint, speculation_k=speculation_k, max_batch_size=max_batch_size, draft=draft, **(engine_options or {})
    )
    cfg = SidecarConfig(
        server=ServerConfig(port=0, max_message_mib=max_message_mib),
        limits=limits or RequestLimits(max_prompts=64, max_samples=256, max_prompt_tokens=64, max_new_tokens=250),
        scheduler=scheduler or SchedulerConfig(max_live_sequences=512),
        shutdown_grace_s=1.0,
        **config,  # type: ignore[arg-type]
    )
    return Sidecar(engine, cfg).start()


def make_pki(directory: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, made by the
    openssl CLI in `directory` (ca.pem, server.pem/.key, client.pem/.key)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=specrl-test-ca")
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=specrl-{name}")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", *ext,
        )  # fmt: skip
    return directory


def wait_until(condition: Callable[[], bool], timeout_s: float = DEADLINE, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
