"""Our exported checkpoints through SGLang 0.5.23's REAL model classes, loaders and checksums (CPU).

SGLang's ``Qwen3ForCausalLM`` (target) and ``Qwen3MoeForCausalLMMTP`` (draft) are built on CPU
from SGLang's own ModelConfig of the directories `write_sglang_checkpoint` writes, then:
- their ``load_weights`` consume our tensor names and fill EVERY parameter with the right values
  (fused q/k/v and gate/up, the MoE experts of the shim, the MTP fusion tensors);
- SGLang's ``WeightChecker`` checksum keys are exactly `names.runtime_parameter`'s names;
- `SGLangEngine.update_weights` runs against these real loaders and real checksums (a
  `LoaderBackend` does what SGLang's model runner does for ``update_weights_from_tensor``:
  ``model.load_weights(named_tensors)``): a correct push passes the stale-draft proof, and a
  push whose draft names SGLang silently skips (dense MLP names sent to the MoE shim) fails it.

No forward pass runs here (that needs SGLang's GPU kernels: test_gpu.py). One concession to
CPU: SGLang chooses its rotary kernel when a layer is built and, with neither CUDA nor its CPU
kernel package, would import vLLM's; the fixture sets that module's ``_is_cpu`` flag so the
native rotary path is chosen. It changes no parameter and no name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.engine.sglang import names
from sidecar.engine.sglang.backend import SHARED_WITH_TARGET, _merge_checksums
from sidecar.engine.sglang.engine import (
    SGLangEngine,
    SGLangEngineConfig,
    StaleDraftError,
    build_server_args,
    tensor_digest,
)
from sidecar.model.checkpoint import load_checkpoint, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.types import WeightSelector
from tests.with_sglang.served import NEEDS_SGLANG

pytestmark = NEEDS_SGLANG


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=512, head_dim=64, torch_dtype="bfloat16")
    path = tmp_path_factory.mktemp("real") / "ckpt"
    save_checkpoint(path, cfg, {n: p.detach() for n, p in build_model(cfg, seed=4).named_parameters()})
    return path


@pytest.fixture(scope="module")
def layout(ckpt: Path) -> names.SGLangCheckpoint:
    model, tensors = load_checkpoint(ckpt)
    return names.write_sglang_checkpoint(model, tensors, ckpt / "sglang")


@pytest.fixture(scope="module")
def sglang_models(layout: names.SGLangCheckpoint) -> Iterator[tuple[Any, Any]]:
    """(target, draft): SGLang's model objects for our two directories, parameters set to NaN."""
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.models.qwen3_moe_mtp import Qwen3MoeForCausalLMMTP
    from sglang.srt.server_args import ServerArgs
    from sglang.test.layer_ut_utils import init_single_process_dist

    cfg = SGLangEngineConfig(model_path=str(layout.target_dir), draft_model_path=str(layout.draft_dir), speculation_k=2)
    sa = ServerArgs(**build_server_args(cfg), device="cpu")
    sa.resolve_once()
    init_single_process_dist()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sglang.srt.layers.rotary_embedding.base._is_cpu", True)
        target = Qwen3ForCausalLM(SGLangModelConfig.from_server_args(sa).hf_config)
        draft_cfg = SGLangModelConfig.from_server_args(sa, model_path=str(layout.draft_dir), is_draft_model=True)
        assert draft_cfg.hf_config.architectures == [names.DRAFT_CLASS]
        draft = Qwen3MoeForCausalLMMTP(draft_cfg.hf_config)
    with torch.no_grad():
        for m in (target, draft):
            for p in m.parameters():
                p.fill_(float("nan"))
    yield target, draft


def test_loaders_fill_every_parameter_with_our_values(ckpt: Path, sglang_models: tuple[Any, Any]) -> None:
    target, draft = sglang_models
    model, tensors = load_checkpoint(ckpt)
    t, d = names.split_contract(model, tensors)
    target.load_weights(list(names.to_sglang_target(t).items()))
    draft.load_weights(list(names.to_sglang_draft(d, hidden_size=model.hidden_size, num_experts=1).items()))
    tp = dict(target.named_parameters())
    dp = dict(draft.named_parameters())
    for name, p in tp.items():
        assert not p.isnan().any(), f"SGLang target parameter {name} was not loaded"
    for name, p in dp.items():
        if not any(s in name for s in SHARED_WITH_TARGET):  # set from the target by set_embed_and_head
            assert not p.isnan().any(), f"SGLang draft parameter {name} was not loaded"
    a = "model.layers.1."
    assert torch.equal(
        tp[a + "self_attn.qkv_proj.weight"],
        torch.cat([t[a + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
    )
    assert torch.equal(
        tp[a + "mlp.gate_up_proj.weight"], torch.cat([t[a + "mlp.gate_proj.weight"], t[a + "mlp.up_proj.weight"]])
    )
    m = "mtp.layers.0."
    assert torch.equal(dp["fc.weight"], d[m + "eh_proj.weight"])
    assert torch.equal(dp["pre_fc_norm_embedding.weight"], d[m + "enorm.weight"])
    assert torch.equal(dp["pre_fc_norm_hidden.weight"], d[m + "hnorm.weight"])
    assert torch.equal(dp["model.norm.weight"], d[m + "shared_head.norm.weight"])
    assert torch.equal(dp["model.layers.0.self_attn.k_norm.weight"], d[m + "self_attn.k_norm.weight"])
    w13 = dp["model.layers.0.mlp.experts.w13_weight"][0]
    assert torch.equal(w13, torch.cat([d[m + "mlp.gate_proj.weight"], d[m + "mlp.up_proj.weight"]]))
    assert torch.equal(dp["model.layers.0.mlp.experts.w2_weight"][0], d[m + "mlp.down_proj.weight"])
    assert not dp["model.layers.0.mlp.gate.weight"].any()


def checksums(model: Any, role: str) -> dict[str, str]:
    """SGLang's own checksum path: WeightChecker per runner, merged as its scheduler merges them."""
    from sglang.srt.managers.scheduler_components.weight_updater import _merge_checksum_payloads
    from sglang.srt.utils.weight_checker import WeightChecker

    payload = WeightChecker(get_model=lambda: model).handle(
        action="checksum", skip_tensor_list=list(SHARED_WITH_TARGET), role=role
    )
    return _merge_checksums([_merge_checksum_payloads([(role, payload)])])


def test_checksum_keys_are_our_runtime_names(ckpt: Path, sglang_models: tuple[Any, Any]) -> None:
    _, draft = sglang_models
    model, tensors = load_checkpoint(ckpt)
    _, d = names.split_contract(model, tensors)
    ours = {names.runtime_parameter(n, draft=True) for n in names.to_sglang_draft(d, hidden_size=256, num_experts=1)}
    assert set(checksums(draft, "draft")) == ours


class LoaderBackend:
    """SGLangBackend's weight calls on real SGLang model objects on CPU (no generation)."""

    def __init__(self, target: Any, draft: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.models = {"target": target, "draft": draft}
        self.calls: list[str] = []

    def push(
        self, named: Mapping[str, torch.Tensor], *, selector: str, weight_version: str | None, flush_cache: bool
    ) -> None:
        self.calls.append(f"push {selector}")
        self.models[selector].load_weights(list(named.items()))  # what update_weights_from_tensor runs

    def draft_checksums(self) -> dict[str, str]:
        return checksums(self.models["draft"], "draft")

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def begin(self, selector: str) -> None:
        self.calls.append(f"begin {selector}")

    def end(self) -> None:
        self.calls.append("end")

    def device_name(self) -> str:
        return "cpu"

    def shutdown(self) -> None:
        self.loop.close()


def test_push_through_real_loaders_and_the_stale_draft_proof(
    ckpt: Path, layout: names.SGLangCheckpoint, sglang_models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = sglang_models
    model, tensors = load_checkpoint(ckpt)
    t, d = names.split_contract(model, tensors)
    target.load_weights(list(names.to_sglang_target(t).items()))  # what SGLang loaded at launch
    draft.load_weights(list(names.to_sglang_draft(d, hidden_size=model.hidden_size, num_experts=1).items()))
    cfg = SGLangEngineConfig(model_path=str(layout.target_dir), draft_model_path=str(layout.draft_dir), speculation_k=2)
    backend = LoaderBackend(target, draft)
    eng = SGLangEngine(
        cfg,
        model,
        backend=backend,
        draft_digests={n: tensor_digest(x) for n, x in d.items()},  # type: ignore[arg-type]
    )
    new = {n: (x * 1.5 if n.startswith("mtp.") else x) for n, x in tensors.items()}
    eng.update_weights(new, WeightSelector.ALL, 1)
    assert eng.weight_version == 1 and backend.calls[-1] == "resume"
    assert torch.equal(dict(draft.named_parameters())["fc.weight"], new["mtp.layers.0.eh_proj.weight"])

    # a broken export: dense MLP names sent to the MoE shim are skipped by SGLang without a word
    real = names.draft_names

    def dense_mlp_names(name: str, *, num_experts: int) -> list[str]:
        return ["mtp.layers.0." + name.split(".", 3)[3]] if ".mlp." in name else real(name, num_experts=num_experts)

    monkeypatch.setattr(names, "draft_names", dense_mlp_names)
    newer = {n: x * 0.5 for n, x in new.items() if n.startswith("mtp.")}
    with pytest.raises(StaleDraftError, match="gate_up_proj"):
        eng.update_weights(newer, WeightSelector.DRAFT, 2)
    assert eng.weight_version == 1 and backend.calls[-1] == "end"  # left paused, never resumed
