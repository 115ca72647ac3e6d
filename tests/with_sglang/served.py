"""Helpers of the SGLang end-to-end tests: a small specrl model and `specrl serve --engine sglang`.

Sized for a 2-core CPU shared with other jobs: SGLang's KV cache is capped at a few thousand
tokens (it would otherwise take a fraction of RAM), one scheduler thread, CUDA graphs off and
torch.compile off (SGLang compiles a speculative helper on first use: ~100 s on such a machine,
and it needs a C++ compiler). The same options work on a GPU; there `device` is "cuda".
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from sidecar.engine.sglang import SGLangEngine
from sidecar.model.model import ModelConfig

# Runs only where SGLang is installed (tools/test-sglang); elsewhere reported as skipped without
# importing SGLang (the modules import it only inside fixtures). A namespace package is not
# SGLang: with tests/ on sys.path a directory named "sglang" would look like one.
_SGLANG = importlib.util.find_spec("sglang")
HAVE_SGLANG = _SGLANG is not None and _SGLANG.origin is not None
NEEDS_SGLANG = pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed here; run tools/test-sglang")
END_TO_END = [NEEDS_SGLANG, pytest.mark.slow, pytest.mark.timeout(900)]
"""The marks of a module that runs SGLang itself (start-up costs tens of seconds on 2 cores)."""

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_TOKENS = 4096
"""SGLang's KV-cache size in tokens (``max_total_tokens``): plenty for these prompts."""
START_TIMEOUT_S = 300.0


def small_config(dtype: str = "float32", **overrides: object) -> ModelConfig:
    """specrl's tiny config widened to shapes every SGLang attention kernel accepts (head_dim 64)."""
    fields: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        torch_dtype=dtype,
        num_nextn_predict_layers=1,
    )
    fields.update(overrides)
    return ModelConfig.tiny(**fields)  # type: ignore[arg-type]


def sglang_test_args(*, max_running_requests: int = 16) -> dict[str, object]:
    """SGLang ServerArgs for tests: small KV cache, no CUDA graphs, bounded batch."""
    return {
        "max_total_tokens": KV_TOKENS,
        "chunked_prefill_size": 1024,
        "max_prefill_tokens": 1024,
        "disable_cuda_graph": True,
        "max_running_requests": max_running_requests,
    }


def start_sglang_engine(
    checkpoint: Path, work_dir: Path, *, speculation_k: int, max_running_requests: int = 16
) -> SGLangEngine:
    """An in-process SGLangEngine on `checkpoint` with the test ServerArgs (close it after)."""
    args = sglang_test_args(max_running_requests=max_running_requests)
    batch = int(args.pop("max_running_requests"))  # type: ignore[call-overload]
    return SGLangEngine.from_checkpoint(
        checkpoint,
        device=DEVICE,
        speculation_k=speculation_k,
        max_batch_size=batch,
        work_dir=work_dir,
        extra_server_args=args,
    )


def sglang_test_env() -> dict[str, str]:
    """Environment of processes that run SGLang in tests (the sidecar and its scheduler)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        TORCHDYNAMO_DISABLE="1",  # no torch.compile of SGLang's helpers (see the module docstring)
        SGLANG_CPU_OMP_THREADS_BIND="all",  # SGLang's default (no per-rank core binding), stated explicitly
    )
    return env


@contextmanager
def specrl_serve(
    checkpoint: Path, *, speculation_k: int, extra: tuple[str, ...] = (), engine: str = "sglang"
) -> Iterator[str]:
    """Run ``specrl serve --engine ENGINE`` on `checkpoint` (port 0); yield its address; SIGTERM it after."""
    specrl = Path(sys.executable).parent / "specrl"
    cmd = [
        str(specrl),
        "serve",
        "--model",
        str(checkpoint),
        "--engine",
        engine,
        "--device",
        DEVICE,
        "--port",
        "0",
        "--speculation-k",
        str(speculation_k),
        "--max-speculation-k",
        str(speculation_k),
        "--max-batch-size",
        "16",
        "--shutdown-grace-s",
        "1",
        "--log-level",
        "WARNING",
    ]
    for key, value in sglang_test_args().items():
        if key != "max_running_requests" and engine == "sglang":  # --max-batch-size sets it
            cmd += ["--sglang-arg", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    cmd += list(extra)
    log = checkpoint.parent / f"serve-{engine}-k{speculation_k}.log"
    with open(log, "w+") as err:
        proc = subprocess.Popen(cmd, stderr=err, stdout=subprocess.DEVNULL, env=sglang_test_env(), text=True)
        try:
            address = _wait_for_address(proc, log)
            yield address
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def _wait_for_address(proc: subprocess.Popen[str], log: Path) -> str:
    import time

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "listening on" in line:
                return line.rsplit(" ", 1)[-1].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"specrl serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"specrl serve did not listen within {START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")
