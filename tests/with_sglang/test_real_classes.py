"""The SGLang adapter against SGLang 0.5.23's REAL classes (CPU is enough; tools/test-sglang).

What is checked here, against the installed package rather than our reading of it:
- the server arguments `build_server_args` produces construct SGLang's own `ServerArgs`, and
  pass its resolution pipeline (``resolve_once``: model config, NEXTN → EAGLE, draft path,
  draft-token count) and ``check_server_args`` — with ``device="cpu"`` added, because without
  an accelerator SGLang's device detection stops resolution at its first step; the
  CUDA-specific choices (attention backends, CUDA graphs, memory sizing) are not exercised;
- SGLang's own ModelConfig turns our draft directory into ``Qwen3MoeForCausalLMMTP`` and our
  target into ``Qwen3ForCausalLM`` without EOS ids, and its registry resolves both classes;
- every Engine / TokenizerManager method the adapter calls exists with the parameters it passes,
  and every request struct has the fields it sets (selector literals included);
- the tensor serializer round-trips, SGLang's SamplingParams accepts our sampling dicts;
- the meta_info keys and formulas `sidecar.engine.sglang.meta` relies on, and the weight-loader name rules
  `names.runtime_parameter` encodes, are present in the installed source.

Not checked here (needs a GPU): anything that runs a forward pass — see test_gpu.py.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.engine.sglang import names
from sidecar.engine.sglang.backend import SGLangBackend, sampling_params_dict
from sidecar.engine.sglang.engine import SGLANG_VERSION, SGLangEngineConfig, build_server_args
from sidecar.model.model import ModelConfig, build_model
from sidecar.types import SamplingParams
from tests.with_sglang.served import NEEDS_SGLANG

K = 3

pytestmark = NEEDS_SGLANG


@pytest.fixture(scope="module")
def sglang() -> Any:
    import sglang

    return sglang


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> names.SGLangCheckpoint:
    cfg = ModelConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=512, head_dim=64, torch_dtype="bfloat16")
    state = {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}
    return names.write_sglang_checkpoint(cfg, state, tmp_path_factory.mktemp("sgl"))


@pytest.fixture(scope="module")
def server_args(layout: names.SGLangCheckpoint) -> dict[str, Any]:
    cfg = SGLangEngineConfig(model_path=str(layout.target_dir), draft_model_path=str(layout.draft_dir), speculation_k=K)
    return build_server_args(cfg)


@pytest.fixture(scope="module")
def resolved(sglang: Any, server_args: dict[str, Any]) -> Any:
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(**server_args, device="cpu")
    sa.resolve_once()
    sa.check_server_args()
    return sa


def source(module: str) -> str:
    import importlib

    return inspect.getsource(importlib.import_module(module))


def params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_pinned_version(sglang: Any) -> None:
    assert sglang.__version__ == SGLANG_VERSION


def test_server_args_construct_and_unknown_keys_fail(sglang: Any, server_args: dict[str, Any]) -> None:
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(**server_args)
    for key, value in server_args.items():
        assert getattr(sa, key) == value, key
    with pytest.raises(TypeError):
        ServerArgs(**server_args, speculative_num_stepz=3)


def test_server_args_pass_sglang_resolution_and_checks(resolved: Any, layout: names.SGLangCheckpoint) -> None:
    from sglang.srt.arg_groups.overrides import resolution_result

    def r(field: str) -> Any:
        return resolution_result(resolved, field)

    assert r("speculative_algorithm") == "EAGLE"  # SGLang resolves NEXTN to its EAGLE worker
    assert r("speculative_num_steps") == K
    assert r("speculative_eagle_topk") == 1
    assert r("speculative_num_draft_tokens") == K + 1
    assert r("speculative_draft_model_path") == str(layout.draft_dir)
    assert r("skip_tokenizer_init") is True and r("weight_version") == "0"


def test_sglang_model_config_maps_our_directories(resolved: Any, layout: names.SGLangCheckpoint) -> None:
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig
    from sglang.srt.models.registry import ModelRegistry

    draft = SGLangModelConfig.from_server_args(resolved, model_path=str(layout.draft_dir), is_draft_model=True)
    assert draft.hf_config.architectures == [names.DRAFT_CLASS]
    assert draft.hf_config.num_nextn_predict_layers == 1 and draft.hf_config.num_experts == 1
    target = SGLangModelConfig.from_server_args(resolved)
    assert target.hf_config.architectures == [names.TARGET_ARCHITECTURE]
    assert not target.hf_eos_token_id  # specrl stops only at the request's stop_token_ids
    for arch in (names.TARGET_ARCHITECTURE, names.DRAFT_CLASS):
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        assert cls.__name__ == arch


def test_engine_methods_the_adapter_calls(sglang: Any) -> None:
    from sglang.srt.entrypoints.engine import Engine as eng

    assert sglang.Engine._load() is eng  # `sglang.Engine(**kw)` (a lazy import) builds this class
    assert {"input_ids", "sampling_params", "return_logprob", "rid"} <= set(params(eng.async_generate))
    assert inspect.iscoroutinefunction(eng.async_generate)
    assert params(eng.begin_weight_update) == ["self", "selector"]
    assert params(eng.end_weight_update) == ["self"]
    assert params(eng.shutdown) == ["self"]
    # Engine.update_weights_from_tensor has no selector / version: why the adapter builds the struct
    assert "selector" not in params(eng.update_weights_from_tensor)
    init = inspect.getsource(eng.__init__)
    assert "self.loop = " in init and "self.tokenizer_manager = tokenizer_manager" in init


def test_tokenizer_manager_methods(sglang: Any) -> None:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager as TM

    assert params(TM.abort_request)[:2] == ["self", "rid"]
    for name, want in [
        ("pause_generation", ["self", "obj"]),
        ("continue_generation", ["self", "obj"]),
        ("update_weights_from_tensor", ["self", "obj", "request"]),
        ("check_weights", ["self", "obj", "request"]),
    ]:
        fn = getattr(TM, name)
        assert inspect.iscoroutinefunction(fn), name
        assert params(fn) == want, name
    mixin = source("sglang.srt.managers.tokenizer_control_mixin")
    assert "return success, message, ranks, per_engine_checksum" in mixin
    assert "self._update_weight_version_if_provided(obj.weight_version)" in mixin


def test_request_structs(sglang: Any) -> None:
    import msgspec
    from sglang.srt.managers import io_struct as io

    selector = typing.Literal["target", "draft", "all"]
    assert io.PauseGenerationReqInput(mode="retract").mode == "retract"
    io.ContinueGenerationReqInput()
    for cls, fields in [
        (io.UpdateWeightsFromTensorReqInput, {"serialized_named_tensors", "flush_cache", "weight_version", "selector"}),
        (io.BeginWeightUpdateReqInput, {"selector"}),
        (io.CheckWeightsReqInput, {"action", "selector", "skip_tensor_list"}),
    ]:
        have = {f.name: f for f in msgspec.structs.fields(cls)}
        assert fields <= set(have), cls
        assert typing.get_type_hints(cls)["selector"] == selector, cls
    hints = typing.get_type_hints(io.PauseGenerationReqInput)
    assert "retract" in typing.get_args(hints["mode"])
    obj = io.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[b"x"], flush_cache=False, weight_version="3", selector="draft"
    )
    assert (obj.selector, obj.weight_version, obj.flush_cache) == ("draft", "3", False)


def test_backend_wires_to_real_modules_and_serializer_round_trips(sglang: Any) -> None:
    loop = asyncio.new_event_loop()
    backend = SGLangBackend(types.SimpleNamespace(loop=loop), tp_size=2)
    named = [("mtp.fc.weight", torch.randn(4, 8)), ("mtp.norm.weight", torch.ones(4))]
    blob = backend._serializer.serialize(named)
    back = backend._serializer.deserialize(blob)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(back, named, strict=True):
        assert torch.equal(a, b)
    loop.close()


def test_sglang_accepts_our_sampling_params(sglang: Any) -> None:
    from sglang.srt.sampling.sampling_params import TOP_K_ALL
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    for sp in (
        SamplingParams(temperature=0.0, max_new_tokens=4),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(2, 3), seed=5, max_new_tokens=9),
        SamplingParams(temperature=1.0, top_k=20, max_new_tokens=1),
    ):
        sgl = SGLangSamplingParams(**sampling_params_dict(sp, prompt_index=1, sample_index=2))
        sgl.verify(512)
        assert sgl.max_new_tokens == sp.max_new_tokens and sgl.stop_token_ids == (set(sp.stop_token_ids) or None)
        if sp.temperature == 0:
            assert sgl.top_k == 1  # SGLang's greedy
        else:
            assert sgl.top_k == (sp.top_k or TOP_K_ALL) and sgl.temperature == sp.temperature


META_KEYS = [
    "spec_verify_ct",
    "spec_accept_length",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_correct_drafts_histogram",
    "output_token_logprobs",
    "completion_tokens",
]


def test_meta_info_keys_and_formulas_in_sglang_source(sglang: Any) -> None:
    tm = source("sglang.srt.managers.tokenizer_manager")
    for key in META_KEYS:
        assert re.search(rf'meta_info\["{key}"\]\s*=|"{key}":', tm), key
    assert '"weight_version": self.config_value("weight_version")' in tm
    assert '"num_retractions": recv_obj.retraction_counts[i]' in tm
    # the definitions counters_from_meta_info relies on
    assert (
        "num_proposed_drafts = recv_obj.spec_verify_ct[i] * (\n                get_spec().speculative_num_draft_tokens - 1"
        in tm
    )
    wv = source("sglang.srt.utils.weight_versions")
    assert 'meta_info["weight_versions"]' in wv and 'meta_info["weight_version"] = visible[-1].version' in wv
    sb = source("sglang.srt.managers.schedule_batch")
    for kind in ("stop", "length", "abort"):
        assert f'"type": "{kind}"' in sb
    assert "self.spec_correct_drafts_histogram[num_correct_drafts] += 1" in sb


def test_checkpoint_and_checksum_names_follow_sglangs_loaders(sglang: Any) -> None:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    qwen3 = source("sglang.srt.models.qwen3")
    for part, fused in [("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj")]:
        assert f'("{fused}", "{part}", "{part[0]}")' in qwen3
    assert '("gate_up_proj", "gate_proj", 0)' in qwen3 and '("gate_up_proj", "up_proj", 1)' in qwen3
    moe = source("sglang.srt.models.qwen3_moe")
    for fusion in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        assert f'"{fusion}"' in moe
    assert 'name = name.replace("mtp.", "")' in moe and 'name = name.replace("mtp", "model")' in moe
    # expert names: apply SGLang's own expert mapping table to our draft names
    n = 2
    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj", num_experts=n
    )
    for e in range(n):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            ours = f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"
            param_name, weight_name = next((p, w) for p, w, eid, _ in mapping if eid == e and w.endswith(f".{proj}."))
            sglang_param = ours.replace("mtp", "model").replace(weight_name, param_name)
            assert names.runtime_parameter(ours, draft=True) == sglang_param
    mtp = source("sglang.srt.models.qwen3_moe_mtp")
    assert "self.fc = nn.Linear(2 * config.hidden_size" in mtp
    assert "torch.cat((input_embeds, hidden_states), dim=-1)" in mtp  # embedding first, like the contract
    updater = source("sglang.srt.managers.scheduler_components.weight_updater")
    assert 'key = name if role == "target" else f"{role}.{name}"' in updater
    assert "update_weights_from_tensor must run between" in updater  # sessions are mandatory


def test_server_args_without_speculation(sglang: Any, layout: names.SGLangCheckpoint) -> None:
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import ServerArgs

    cfg = SGLangEngineConfig(model_path=str(layout.target_dir), speculative_algorithm=None, speculation_k=0)
    sa = ServerArgs(**build_server_args(cfg), device="cpu")
    sa.resolve_once()
    sa.check_server_args()
    assert resolution_result(sa, "speculative_algorithm") is None
    assert Path(resolution_result(sa, "model_path")) == layout.target_dir


@pytest.mark.parametrize("seed", range(3))
def test_meta_info_built_by_sglangs_own_code(resolved: Any, seed: int) -> None:
    """SGLang's real meta_info builders, fed a known run, give the counters of a direct count."""
    import random

    from sglang.srt import runtime_context
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_TOKEN, Req
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    from sidecar.engine.sglang.meta import sample_from_meta_info
    from sidecar.types import FinishReason

    rng = random.Random(seed)
    steps = [rng.randint(0, K) for _ in range(rng.randint(1, 20))]  # drafts accepted per verify step
    n = 1 + sum(a + 1 for a in steps)  # the prefill token, then accepted drafts + 1 per step
    ids = [rng.randrange(512) for _ in range(n)]
    req = types.SimpleNamespace(spec_correct_drafts_histogram=[])
    for a in steps:
        Req.update_spec_correct_drafts_histogram(req, a)  # what the scheduler does per verify step
    recv = types.SimpleNamespace(
        spec_verify_ct=[len(steps)],
        spec_num_correct_drafts=[sum(steps)],
        spec_correct_drafts_histogram=[req.spec_correct_drafts_histogram],
        completion_tokens=[n],
    )
    meta: dict[str, Any] = {"finish_reason": FINISH_MATCHED_TOKEN(ids[-1]).to_json(), "num_retractions": 0}
    runtime_context.publish(resolved, role="test")
    try:
        TokenizerManager._calculate_spec_decoding_metrics(object(), meta, recv, 0)
    finally:
        runtime_context.reset_context()
    push_at = rng.randint(1, n - 1)
    spans = compute_weight_version_spans(
        [WeightVersionEvent(old_version="4", num_output_tokens=push_at)], current_version="5", num_output_tokens=n
    )
    add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n)
    lps = [-rng.random() for _ in ids]
    meta["output_token_logprobs"] = TokenizerManager.detokenize_logprob_tokens(object(), lps, ids, False)

    s = sample_from_meta_info(
        {"output_ids": ids, "meta_info": meta}, request_id="r", prompt_index=0, sample_index=0, speculation_k=K
    )
    assert s.token_ids == ids and s.logprobs == lps and s.finish_reason is FinishReason.STOP
    assert (s.weight_version, s.last_weight_version) == (4, 5)
    c = s.counters
    assert c.verify_steps == len(steps) + 1 and c.generated_tokens == n
    assert c.drafted_tokens == K * len(steps) and c.accepted_tokens == sum(steps)
    assert c.accepted_per_position == [sum(1 for a in steps if a > i) for i in range(K)]
    assert meta["spec_accept_length"] == pytest.approx(n / len(steps))  # SGLang's tau omits the prefill
