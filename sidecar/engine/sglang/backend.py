"""The only code that touches SGLang objects: a thin, typed wrapper over ``sglang.Engine`` 0.5.23.

Everything `SGLangEngine` needs from SGLang goes through `SGLangBackend`, so the names and
signatures it relies on are in one place, and ``tests/with_sglang/`` checks each of them against
the installed SGLang (``tools/test-sglang``). SGLang is imported lazily: importing specrl
never requires it.

Calls and where they live in 0.5.23 (all on the Engine's own asyncio loop, ``Engine.loop``,
which only runs inside these calls — the sidecar's scheduler thread drives it):

- generation: ``Engine.async_generate(input_ids=, sampling_params=, return_logprob=, rid=)``;
- abort: ``Engine.tokenizer_manager.abort_request(rid=)``;
- pause / continue: ``tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=))`` and
  ``continue_generation(ContinueGenerationReqInput())`` (``Engine`` has no wrapper for them);
- weight sessions: ``Engine.begin_weight_update(selector)`` / ``Engine.end_weight_update()``;
- tensors: ``tokenizer_manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(...))``,
  built here because ``Engine.update_weights_from_tensor`` takes no ``selector`` and no
  ``weight_version`` (the request struct has both);
- checksums: ``tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum", ...))``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import torch

from sidecar.engine.torch_engine import sequence_seed
from sidecar.errors import SpecrlError
from sidecar.types import SamplingParams

INSTALL_HINT = (
    "install specrl[sglang] (SGLang 0.5.23, CUDA 13, torch 2.14.1): pip install 'specrl[sglang]'; on a CPU-only "
    "machine SGLang also needs its CPU build of sgl-kernel (tools/sglang-env sets up the test environment)"
)
SHARED_WITH_TARGET = ("embed_tokens", "lm_head")
"""Draft parameters that are the target's own tensors (set_embed_and_head): not draft-owned."""


class SGLangEngineError(SpecrlError, RuntimeError):
    """SGLang is missing, refused a call, or is unusable after a failed weight push."""


CPU_ENGINE_SWITCH = "SGLANG_USE_CPU_ENGINE"
"""SGLang's own switch for its CPU engine (``sglang.srt.utils.common.is_cpu``), read once at import."""


def import_sglang(device: str = "cuda") -> Any:
    """The ``sglang`` module, or SGLangEngineError with the install hint.

    For ``device="cpu"`` SGLang's CPU switch must be on before SGLang is first imported (its
    modules cache ``is_cpu()`` at import time), so it is set here, in this process and the
    scheduler processes SGLang spawns from it.
    """
    if device == "cpu":
        if "sglang" in sys.modules and os.environ.get(CPU_ENGINE_SWITCH) != "1":
            raise SGLangEngineError(
                f"SGLang was imported in this process before {CPU_ENGINE_SWITCH}=1 was set, so it cannot run "
                f"on CPU here; set {CPU_ENGINE_SWITCH}=1 in the environment before starting the process"
            )
        os.environ[CPU_ENGINE_SWITCH] = "1"
    try:
        return importlib.import_module("sglang")
    except ImportError as e:
        raise SGLangEngineError(f"SGLang is not importable ({e}); {INSTALL_HINT}") from e


def sampling_params_dict(sp: SamplingParams, *, prompt_index: int, sample_index: int) -> dict[str, Any]:
    """SGLang ``sampling_params`` of one sequence.

    top_k 0 (specrl: disabled) is SGLang's -1; temperature 0 is greedy in both. EOS handling is
    specrl's: stop only at ``stop_token_ids`` (the exported config has no EOS id; SGLang's
    ``ignore_eos`` would also ignore stop_token_ids). ``sampling_seed`` is the TorchEngine's
    per-sequence seed; SGLang 0.5.23 honours it only with ``enable_deterministic_inference``.
    """
    d: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "stop_token_ids": list(sp.stop_token_ids),
        "skip_special_tokens": False,
    }
    if sp.seed is not None:
        d["sampling_seed"] = sequence_seed(sp.seed, prompt_index, sample_index)
    return d


def _merge_checksums(ranks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """{parameter: checksum} of draft-owned parameters; role prefix removed, TP ranks joined."""
    merged: dict[str, list[str]] = {}
    for rank in ranks:
        for key, value in rank["checksums"].items():
            role, _, name = key.partition(".")
            if not role.startswith("draft"):
                continue  # target keys carry no prefix; only draft roles are asked for
            merged.setdefault(name, []).append(str(value))
    return {name: "|".join(values) for name, values in merged.items()}


class SGLangBackend:
    """A started ``sglang.Engine`` and the handful of calls specrl makes on it."""

    def __init__(self, engine: Any, *, tp_size: int, device: str = "cuda") -> None:
        self._engine = engine
        self._tp_size = tp_size
        self._device = device
        self._loop: asyncio.AbstractEventLoop = engine.loop
        io = importlib.import_module("sglang.srt.managers.io_struct")
        self._io = io
        self._serializer = importlib.import_module("sglang.srt.utils.common").MultiprocessingSerializer

    @classmethod
    def launch(cls, server_args: Mapping[str, Any]) -> SGLangBackend:
        """Start SGLang (scheduler and detokenizer processes; minutes on a large model)."""
        device = str(server_args.get("device") or "cuda")
        sglang = import_sglang(device)
        return cls(sglang.Engine(**server_args), tp_size=int(server_args.get("tp_size", 1)), device=device)

    # ---- generation ------------------------------------------------------------------------
    def start_generate(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> asyncio.Task[Any]:
        coro = self._engine.async_generate(input_ids=input_ids, sampling_params=params, return_logprob=True, rid=rid)
        return self._loop.create_task(coro)

    def wait_any(self, tasks: Sequence[asyncio.Task[Any]], timeout_s: float) -> None:
        """Run SGLang's loop until one of `tasks` is done or `timeout_s` passed."""
        self._run(asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED))

    def wait_all(self, tasks: Sequence[asyncio.Task[Any]], timeout_s: float) -> None:
        if tasks:
            self._run(asyncio.wait(tasks, timeout=timeout_s))

    def abort(self, rid: str) -> None:
        self._engine.tokenizer_manager.abort_request(rid=rid)

    # ---- weights -----------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop inference; running requests go back to SGLang's queue and lose their KV."""
        obj = self._io.PauseGenerationReqInput(mode="retract")
        self._run(self._engine.tokenizer_manager.pause_generation(obj))

    def resume(self) -> None:
        self._run(self._engine.tokenizer_manager.continue_generation(self._io.ContinueGenerationReqInput()))

    def begin(self, selector: str) -> None:
        self._check("begin_weight_update", self._engine.begin_weight_update(selector))

    def end(self) -> None:
        self._check("end_weight_update", self._engine.end_weight_update())

    def push(
        self, named: Mapping[str, torch.Tensor], *, selector: str, weight_version: str | None, flush_cache: bool
    ) -> None:
        """update_weights_from_tensor for one runner ("target" or "draft")."""
        items = list(named.items())
        obj = self._io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[self._serializer.serialize(items) for _ in range(self._tp_size)],
            flush_cache=flush_cache,
            weight_version=weight_version,
            selector=selector,
        )
        self._check(
            f"update_weights_from_tensor({selector})",
            self._run(self._engine.tokenizer_manager.update_weights_from_tensor(obj, None)),
        )

    def draft_checksums(self) -> dict[str, str]:
        """SGLang's checksum of every draft-owned parameter (shared embedding and head skipped)."""
        obj = self._io.CheckWeightsReqInput(
            action="checksum", selector="draft", skip_tensor_list=list(SHARED_WITH_TARGET)
        )
        success, message, ranks, _ = self._run(self._engine.tokenizer_manager.check_weights(obj, None))
        if not success or not ranks:
            raise SGLangEngineError(f"SGLang could not checksum the draft weights: {message}")
        return _merge_checksums(ranks)

    # ---- misc --------------------------------------------------------------------------------
    def device_name(self) -> str:
        """The accelerator SGLang runs on: the GPU's name, or "cpu"."""
        if self._device == "cpu":
            return "cpu"
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"

    def shutdown(self) -> None:
        self._engine.shutdown()

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self._loop.run_until_complete(coro)

    @staticmethod
    def _check(what: str, result: Any) -> None:
        success, message = result[0], result[1]
        if not success:
            raise SGLangEngineError(f"SGLang {what} failed: {message}")
