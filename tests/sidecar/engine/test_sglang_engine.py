"""The SGLang adapter's pure parts and its protocol with SGLang, on CPU without SGLang.

Oracles: the issue's server-argument spec (k + 1 draft tokens, top-k 1); SGLang 0.5.23's
meta-info definitions replayed from an explicit list of per-verify-step acceptance counts
(specrl's counters computed directly from that list); Hugging Face's Qwen3-MoE sparse block
(the draft shim must compute our dense MLP exactly); and SGLang's documented weight-update
order (pause → begin → update target → update draft → end → continue) on a recording
backend whose method signatures are checked against the real `SGLangBackend`.

The same adapter against SGLang's REAL classes: tests/with_sglang/ (tools/test-sglang).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from sidecar.engine import ENGINE_KINDS, create_engine, engine_class
from sidecar.engine.config import EngineConfig
from sidecar.engine.sglang import names
from sidecar.engine.sglang.backend import SGLangBackend, SGLangEngineError, sampling_params_dict
from sidecar.engine.sglang.engine import (
    SGLangEngine,
    SGLangEngineConfig,
    StaleDraftError,
    build_server_args,
    tensor_digest,
)
from sidecar.engine.sglang.meta import MetaInfoError, counters_from_meta_info, sample_from_meta_info
from sidecar.errors import InvalidRequestError, StaleVersionError, UnknownTensorError, WeightMismatchError
from sidecar.model.checkpoint import draft_tensor_names, load_checkpoint, save_checkpoint, target_tensor_names
from sidecar.model.model import ModelConfig, build_model
from sidecar.types import FinishReason, GenerationRequest, SamplingParams, WeightSelector

# ---- server arguments ----------------------------------------------------------------------


def test_server_args_speculative_nextn() -> None:
    cfg = SGLangEngineConfig(model_path="/m/target", draft_model_path="/m/draft", speculation_k=4, tp_size=2, seed=7)
    args = build_server_args(cfg)
    assert args["model_path"] == "/m/target"
    assert args["speculative_algorithm"] == "NEXTN"
    assert args["speculative_draft_model_path"] == "/m/draft"
    assert args["speculative_num_steps"] == 4
    assert args["speculative_eagle_topk"] == 1
    assert args["speculative_num_draft_tokens"] == 5
    assert args["skip_tokenizer_init"] is True
    assert args["tp_size"] == 2 and args["random_seed"] == 7 and args["weight_version"] == "0"
    assert "speculative_use_rejection_sampling" not in args


def test_server_args_without_draft_and_overrides() -> None:
    cfg = SGLangEngineConfig(
        model_path="/m", speculative_algorithm=None, speculation_k=0, extra_server_args={"log_level": "info"}
    )
    args = build_server_args(cfg)
    assert not any(k.startswith("speculative_") for k in args)
    assert args["log_level"] == "info"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(speculative_algorithm="MEDUSA", draft_model_path="/d"), "speculative_algorithm"),
        (dict(speculation_k=0, draft_model_path="/d"), "speculation_k"),
        (dict(), "draft_model_path"),
        (dict(draft_model_path="/d", mem_fraction_static=1.5), "mem_fraction_static"),
        (dict(draft_model_path="/d", tp_size=0), "tp_size"),
        (dict(draft_model_path="/d", step_wait_s=0.0), "step_wait_s"),
    ],
)
def test_config_rejects(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SGLangEngineConfig(model_path="/m", **kwargs)


def test_sampling_params() -> None:
    sp = SamplingParams(temperature=0.0, top_k=0, top_p=0.9, max_new_tokens=5, stop_token_ids=(3, 4), seed=1)
    d = sampling_params_dict(sp, prompt_index=0, sample_index=1)
    assert d["top_k"] == -1 and d["temperature"] == 0.0 and d["stop_token_ids"] == [3, 4]
    assert d["sampling_seed"] != sampling_params_dict(sp, prompt_index=0, sample_index=0)["sampling_seed"]


# ---- meta_info → Sample --------------------------------------------------------------------


def sglang_meta(accepted_per_step: list[int], k: int, *, version: str = "3", retractions: int = 0) -> dict[str, Any]:
    """meta_info the way SGLang 0.5.23 builds it from per-verify-step accepted-draft counts."""
    completion = 1 + retractions + sum(a + 1 for a in accepted_per_step)  # prefills + one per step
    meta: dict[str, Any] = {
        "finish_reason": {"type": "length", "length": completion},
        "weight_version": version,
        "weight_versions": [{"version": version, "start": 0, "end": completion}],
        "completion_tokens": completion,
        "num_retractions": retractions,
    }
    if accepted_per_step:
        hist = [0] * (max(accepted_per_step) + 1)
        for a in accepted_per_step:
            hist[a] += 1
        vct = len(accepted_per_step)
        meta |= {
            "spec_verify_ct": vct,
            "spec_num_correct_drafts": sum(accepted_per_step),
            "spec_num_proposed_drafts": vct * k,
            "spec_accept_length": completion / vct,
            "spec_correct_drafts_histogram": hist,
        }
    return meta


@pytest.mark.parametrize("seed", range(5))
def test_counters_match_a_direct_count(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(1, 5)
    steps = [rng.randint(0, k) for _ in range(rng.randint(1, 30))]
    retractions = rng.randint(0, 2)
    meta = sglang_meta(steps, k, retractions=retractions)
    c = counters_from_meta_info(meta, num_tokens=meta["completion_tokens"], speculation_k=k)
    assert c.verify_steps == len(steps) + 1 + retractions
    assert c.generated_tokens == meta["completion_tokens"]
    assert c.drafted_tokens == k * len(steps) and c.accepted_tokens == sum(steps)
    assert c.drafted_per_position == [len(steps)] * k
    assert c.accepted_per_position == [sum(1 for a in steps if a > i) for i in range(k)]
    # tau counts the prefill forward; SGLang's spec_accept_length does not
    assert c.acceptance_length == pytest.approx(meta["completion_tokens"] / (len(steps) + 1 + retractions))


def test_counters_plain_decoding_and_inconsistency() -> None:
    c = counters_from_meta_info(sglang_meta([], 3), num_tokens=1, speculation_k=3)
    assert (c.verify_steps, c.generated_tokens, c.drafted_tokens) == (1, 1, 0)
    bad = sglang_meta([1, 2], 3) | {"spec_num_proposed_drafts": 5}
    with pytest.raises(MetaInfoError, match="speculative_num_steps=3"):
        counters_from_meta_info(bad, num_tokens=6, speculation_k=3)
    bad = sglang_meta([1, 2], 3) | {"spec_correct_drafts_histogram": [1, 1]}
    with pytest.raises(MetaInfoError, match="histogram"):
        counters_from_meta_info(bad, num_tokens=6, speculation_k=3)


def test_sample_from_meta_info() -> None:
    meta = sglang_meta([2, 0], 2) | {
        "finish_reason": {"type": "stop", "matched": 9},
        "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}],
        "weight_version": "4",
    }
    ids = [5, 6, 7, 8, 9]
    meta["output_token_logprobs"] = [(-0.5 * i, t, None) for i, t in enumerate(ids)]
    s = sample_from_meta_info(
        {"output_ids": ids, "meta_info": meta}, request_id="r", prompt_index=1, sample_index=2, speculation_k=2
    )
    assert s.token_ids == ids and s.logprobs == [-0.0, -0.5, -1.0, -1.5, -2.0]
    assert s.finish_reason is FinishReason.STOP
    assert (s.weight_version, s.last_weight_version) == (3, 4)
    assert s.counters.verify_steps == 3 and s.counters.accepted_tokens == 2
    meta["output_token_logprobs"][1] = (-0.5, 99, None)
    with pytest.raises(MetaInfoError, match="return_logprob"):
        sample_from_meta_info(
            {"output_ids": ids, "meta_info": meta}, request_id="r", prompt_index=0, sample_index=0, speculation_k=2
        )
    with pytest.raises(MetaInfoError, match="finish"):
        sample_from_meta_info(
            {"output_ids": [], "meta_info": {"finish_reason": None, "weight_version": "0"}},
            request_id="r",
            prompt_index=0,
            sample_index=0,
            speculation_k=2,
        )


# ---- names and the Qwen3-MoE draft shim ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.tiny(tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_state(tiny: ModelConfig) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(tiny, seed=3).named_parameters()}


@pytest.mark.parametrize("experts", [1, 2])
def test_sglang_checkpoint_layout(
    tmp_path: Path, tiny: ModelConfig, tiny_state: dict[str, torch.Tensor], experts: int
) -> None:
    layout = names.write_sglang_checkpoint(tiny, tiny_state, tmp_path, num_experts=experts)
    target = load_file(str(layout.target_dir / "model.safetensors"))
    assert sorted(target) == sorted(target_tensor_names(tiny))
    tcfg = json.loads((layout.target_dir / "config.json").read_text())
    assert tcfg["architectures"] == ["Qwen3ForCausalLM"] and "eos_token_id" not in tcfg
    assert layout.draft_dir is not None
    draft = load_file(str(layout.draft_dir / "model.safetensors"))
    assert all(n.startswith("mtp.") for n in draft)
    assert torch.equal(draft["mtp.fc.weight"], tiny_state["mtp.layers.0.eh_proj.weight"])
    assert torch.equal(draft["mtp.norm.weight"], tiny_state["mtp.layers.0.shared_head.norm.weight"])
    assert torch.equal(
        draft["mtp.layers.0.self_attn.q_norm.weight"], tiny_state["mtp.layers.0.self_attn.q_norm.weight"]
    )
    for e in range(experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            got = draft[f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"]
            assert torch.equal(got, tiny_state[f"mtp.layers.0.mlp.{proj}.weight"])
    # every contract draft tensor is represented, plus the router
    assert len(draft) == len(draft_tensor_names(tiny)) + 3 * (experts - 1) + 1


@pytest.mark.parametrize("experts", [1, 2, 4])
def test_moe_shim_computes_the_dense_mlp(tiny: ModelConfig, tiny_state: dict[str, torch.Tensor], experts: int) -> None:
    """Hugging Face's Qwen3-MoE block, configured and loaded as the shim, equals our dense MLP."""
    sg = names.to_sglang_draft(
        {n: t for n, t in tiny_state.items() if n.startswith("mtp.")}, hidden_size=tiny.hidden_size, num_experts=experts
    )
    hf = Qwen3MoeConfig(**{k: v for k, v in names.draft_hf_config(tiny, num_experts=experts).items() if k != "dtype"})
    block = Qwen3MoeSparseMoeBlock(hf)
    with torch.no_grad():
        block.gate.weight.copy_(sg["mtp.layers.0.mlp.gate.weight"])
        for e in range(experts):
            p = f"mtp.layers.0.mlp.experts.{e}."
            block.experts.gate_up_proj[e] = torch.cat([sg[p + "gate_proj.weight"], sg[p + "up_proj.weight"]])
            block.experts.down_proj[e] = sg[p + "down_proj.weight"]
    dense = build_model(tiny, seed=3).mtp.layers[0].mlp
    x = torch.randn(2, 5, tiny.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(block(x), dense(x), rtol=1e-6, atol=1e-6)


def test_runtime_parameter_names() -> None:
    assert names.runtime_parameter("model.layers.3.self_attn.k_proj.weight", draft=False) == (
        "model.layers.3.self_attn.qkv_proj.weight"
    )
    assert names.runtime_parameter("model.layers.0.mlp.up_proj.weight", draft=False) == (
        "model.layers.0.mlp.gate_up_proj.weight"
    )
    assert names.runtime_parameter("mtp.fc.weight", draft=True) == "fc.weight"
    assert names.runtime_parameter("mtp.norm.weight", draft=True) == "model.norm.weight"
    assert names.runtime_parameter("mtp.layers.0.mlp.experts.1.up_proj.weight", draft=True) == (
        "model.layers.0.mlp.experts.w13_weight"
    )
    assert names.runtime_parameter("mtp.layers.0.mlp.experts.0.down_proj.weight", draft=True) == (
        "model.layers.0.mlp.experts.w2_weight"
    )
    assert names.runtime_parameter("mtp.layers.0.mlp.gate.weight", draft=True) == "model.layers.0.mlp.gate.weight"


def test_two_mtp_layers_are_refused(tmp_path: Path) -> None:
    cfg = ModelConfig.tiny(num_nextn_predict_layers=2)
    state = {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}
    with pytest.raises(ValueError, match="exactly one MTP layer"):
        names.write_sglang_checkpoint(cfg, state, tmp_path)


# ---- the adapter's protocol with SGLang, on a recording backend ---------------------------


class RecordingBackend:
    """Plays SGLang's side: finished outputs per rid, parameters keyed as SGLang names them.

    `skip_draft` drops draft tensors whose name contains the substring (SGLang's loaders skip
    unknown names silently) — the stale-draft failure the adapter must catch.
    """

    def __init__(self, k: int, skip_draft: str | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.k = k
        self.calls: list[tuple[Any, ...]] = []
        self.params: dict[tuple[str, str], str] = {}
        self.skip_draft = skip_draft
        self.fail_push: str | None = None
        self.version = "0"
        self.aborted: set[str] = set()

    def start_generate(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> asyncio.Task[Any]:
        self.calls.append(("generate", rid))
        n = params["max_new_tokens"]
        ids = [(input_ids[-1] + i + 1) % 64 for i in range(n)]
        meta = sglang_meta([min(self.k, 1)] * ((n - 1) // 2), self.k, version=self.version)
        meta["completion_tokens"] = n
        meta["output_token_logprobs"] = [(-0.1, t, None) for t in ids]

        async def run() -> dict[str, Any]:
            await asyncio.sleep(0)
            if rid in self.aborted:  # SGLang returns what it has, with reason "abort"
                cut = {"finish_reason": {"type": "abort"}, "output_token_logprobs": meta["output_token_logprobs"][:1]}
                return {"output_ids": ids[:1], "meta_info": {**sglang_meta([], self.k), **cut}}
            return {"output_ids": ids, "meta_info": meta}

        return self.loop.create_task(run())

    def wait_any(self, tasks: list[asyncio.Task[Any]], timeout_s: float) -> None:
        self.loop.run_until_complete(asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED))

    def wait_all(self, tasks: list[asyncio.Task[Any]], timeout_s: float) -> None:
        if tasks:
            self.loop.run_until_complete(asyncio.wait(tasks, timeout=timeout_s))

    def abort(self, rid: str) -> None:
        self.calls.append(("abort", rid))
        self.aborted.add(rid)

    def pause(self) -> None:
        self.calls.append(("pause",))

    def resume(self) -> None:
        self.calls.append(("resume",))

    def begin(self, selector: str) -> None:
        self.calls.append(("begin", selector))

    def end(self) -> None:
        self.calls.append(("end",))

    def push(
        self, named: dict[str, torch.Tensor], *, selector: str, weight_version: str | None, flush_cache: bool
    ) -> None:
        self.calls.append(("push", selector, weight_version, flush_cache))
        if self.fail_push == selector:
            raise SGLangEngineError(f"SGLang update_weights_from_tensor({selector}) failed: boom")
        self.load(
            selector,
            {n: t for n, t in named.items() if not (selector == "draft" and self.skip_draft and self.skip_draft in n)},
        )
        if weight_version is not None:
            self.version = weight_version

    def load(self, role: str, named: dict[str, torch.Tensor]) -> None:
        """What SGLang's load_weights does to its (fused) parameters, as content digests."""
        parts: dict[str, list[str]] = {}
        for n, t in named.items():
            contract = role == "target" or n.startswith("mtp.")  # EAGLE drafts keep their own names
            param = names.runtime_parameter(n, draft=role == "draft") if contract else n
            parts.setdefault(param, []).append(tensor_digest(t))
        self.params.update({(role, p): "".join(sorted(d)) for p, d in parts.items()})

    def draft_checksums(self) -> dict[str, str]:
        self.calls.append(("checksums",))
        return {p: digest for (role, p), digest in self.params.items() if role == "draft"}

    def device_name(self) -> str:
        return "recording"

    def shutdown(self) -> None:
        self.loop.close()


def test_recording_backend_has_the_real_backends_signatures() -> None:
    for name, member in inspect.getmembers(SGLangBackend, inspect.isfunction):
        if name.startswith("_") or name == "launch":
            continue
        fake = getattr(RecordingBackend, name)
        assert inspect.signature(fake).parameters.keys() == inspect.signature(member).parameters.keys(), name


@pytest.fixture
def ckpt(tmp_path: Path, tiny: ModelConfig, tiny_state: dict[str, torch.Tensor]) -> Path:
    save_checkpoint(tmp_path / "ckpt", tiny, tiny_state)
    return tmp_path / "ckpt"


def make_engine(ckpt: Path, backend: RecordingBackend, k: int = 2, device: str = "cuda") -> SGLangEngine:
    model, tensors = load_checkpoint(ckpt)
    layout = names.write_sglang_checkpoint(model, tensors, ckpt / "sglang")
    cfg = SGLangEngineConfig(
        model_path=str(layout.target_dir),
        draft_model_path=str(layout.draft_dir),
        speculation_k=k,
        step_wait_s=0.01,
        device=device,
    )
    digests = {n: tensor_digest(t) for n, t in tensors.items() if n.startswith("mtp.")}
    eng = SGLangEngine(cfg, model, backend=backend, draft_digests=digests)  # type: ignore[arg-type]
    # SGLang loaded the directories at launch: mirror that in the recording backend
    target, draft = names.split_contract(model, tensors)
    backend.load("target", names.to_sglang_target(target))
    backend.load("draft", names.to_sglang_draft(draft, hidden_size=model.hidden_size, num_experts=1))
    backend.calls.clear()
    return eng


def test_cpu_refuses_what_sglang_cpu_does_not_sample_exactly(ckpt: Path) -> None:
    """SGLang 0.5.23 on CPU: greedy draft verification; top-p before top-k renormalisation."""
    eng = make_engine(ckpt, RecordingBackend(k=2), device="cpu")
    assert eng.info().device_kind == "cpu"
    with pytest.raises(InvalidRequestError, match="verifies drafts greedily"):
        eng.validate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(temperature=0.5)))
    eng.validate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(temperature=0.0)))
    model, _ = load_checkpoint(ckpt)
    cfg = SGLangEngineConfig(model_path=str(ckpt), speculative_algorithm=None, speculation_k=0, device="cpu")
    plain = SGLangEngine(cfg, model, backend=RecordingBackend(k=0))  # type: ignore[arg-type]
    plain.validate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(temperature=0.5, top_k=5)))
    with pytest.raises(InvalidRequestError, match="top-p to the probabilities before top-k"):
        plain.validate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(temperature=0.5, top_k=5, top_p=0.9)))
    gpu = make_engine(ckpt, RecordingBackend(k=2))
    gpu.validate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(temperature=0.5, top_k=5, top_p=0.9)))
    assert gpu.info().device_kind == "cuda"


def test_generate_collects_samples(ckpt: Path) -> None:
    be = RecordingBackend(k=2)
    eng = make_engine(ckpt, be)
    req = GenerationRequest(prompts=[[1, 2], [3]], samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=7))
    samples = eng.generate(req)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert samples[0].token_ids == [3, 4, 5, 6, 7, 8, 9] and samples[2].token_ids[0] == 4
    assert not eng.has_work()
    total = eng.stats()[0]
    assert total.samples_finished == 4 and total.counters.verify_steps == 4 * (3 + 1)
    assert eng.info().engine == "sglang" and eng.info().max_speculation_k == 2


def test_requests_sglang_cannot_serve_are_refused(ckpt: Path) -> None:
    eng = make_engine(ckpt, RecordingBackend(k=2))
    with pytest.raises(InvalidRequestError, match="fixed at launch"):
        eng.validate(GenerationRequest(prompts=[[1]], speculation_k=0, sampling=SamplingParams(max_new_tokens=8)))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.validate(GenerationRequest(prompts=[[1000]], sampling=SamplingParams(max_new_tokens=8)))
    with pytest.raises(ValueError, match="fixed at 2"):
        eng.set_speculation_k(3)
    eng.set_speculation_k(2)


def test_abort_returns_abort_samples(ckpt: Path) -> None:
    be = RecordingBackend(k=2)
    eng = make_engine(ckpt, be)
    eng.submit(GenerationRequest(prompts=[[1], [2]], request_id="x", sampling=SamplingParams(max_new_tokens=3)))
    out = eng.abort("x")
    assert sorted(s.prompt_index for s in out) == [0, 1]
    assert all(s.finish_reason is FinishReason.ABORT and s.token_ids == [s.prompt_index + 2] for s in out)
    assert [c[0] for c in be.calls].count("abort") == 2
    assert eng.abort("x") == [] and not eng.has_work()


def perturbed(
    ckpt: Path, prefix: str, delta: float = 0.01, selector: WeightSelector = WeightSelector.ALL
) -> dict[str, torch.Tensor]:
    """The checkpoint's `selector` part, with the tensors under `prefix` shifted by `delta`."""
    _, tensors = load_checkpoint(ckpt)
    keep = {
        WeightSelector.ALL: lambda n: True,
        WeightSelector.TARGET: lambda n: not n.startswith("mtp."),
        WeightSelector.DRAFT: lambda n: n.startswith("mtp."),
    }[selector]
    return {n: (t + delta if n.startswith(prefix) else t) for n, t in tensors.items() if keep(n)}


def test_weight_push_follows_sglangs_session_protocol(ckpt: Path) -> None:
    be = RecordingBackend(k=2)
    eng = make_engine(ckpt, be)
    eng.update_weights(perturbed(ckpt, "mtp."), WeightSelector.ALL, 1)
    assert be.calls == [
        ("checksums",),
        ("pause",),
        ("begin", "all"),
        ("push", "target", None, False),
        ("push", "draft", "1", True),
        ("end",),
        ("checksums",),
        ("resume",),
    ]
    assert eng.weight_version == 1
    # a push whose draft is unchanged needs no proof
    be.calls.clear()
    eng.update_weights(perturbed(ckpt, "model.norm", selector=WeightSelector.TARGET), WeightSelector.TARGET, 2)
    assert [c[0] for c in be.calls] == ["pause", "begin", "push", "end", "resume"]
    assert be.calls[2] == ("push", "target", "2", True)


def test_invalid_pushes_touch_nothing(ckpt: Path, tiny_state: dict[str, torch.Tensor]) -> None:
    be = RecordingBackend(k=2)
    eng = make_engine(ckpt, be)
    good = perturbed(ckpt, "mtp.")
    with pytest.raises(StaleVersionError):
        eng.update_weights(good, WeightSelector.ALL, 0)
    with pytest.raises(UnknownTensorError):
        eng.update_weights(good | {"mtp.layers.1.enorm.weight": torch.ones(64)}, WeightSelector.ALL, 1)
    with pytest.raises(WeightMismatchError):
        eng.update_weights(good | {"model.norm.weight": torch.ones(3)}, WeightSelector.ALL, 1)
    with pytest.raises(UnknownTensorError, match="selector"):
        eng.update_weights(good, WeightSelector.DRAFT, 1)
    with pytest.raises(WeightMismatchError, match="lacks"):
        eng.update_weights(perturbed(ckpt, "mtp.", selector=WeightSelector.TARGET), WeightSelector.ALL, 1)
    assert be.calls == [] and eng.weight_version == 0


def test_stale_draft_fails_the_push_and_blocks_generation(ckpt: Path) -> None:
    be = RecordingBackend(k=2, skip_draft="experts")
    eng = make_engine(ckpt, be)
    with pytest.raises(StaleDraftError, match="w13_weight|w2_weight"):
        eng.update_weights(perturbed(ckpt, "mtp.", selector=WeightSelector.DRAFT), WeightSelector.DRAFT, 1)
    assert ("resume",) not in be.calls and eng.weight_version == 0
    with pytest.raises(SGLangEngineError, match="unusable"):
        eng.submit(GenerationRequest(prompts=[[1]], request_id="y"))
    be.skip_draft = None
    eng.update_weights(perturbed(ckpt, "mtp.", 0.02, WeightSelector.DRAFT), WeightSelector.DRAFT, 2)
    assert eng.weight_version == 2
    assert eng.generate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(max_new_tokens=2)))[0].token_ids == [
        2,
        3,
    ]


def test_sglang_failure_mid_push_is_loud(ckpt: Path) -> None:
    be = RecordingBackend(k=2)
    eng = make_engine(ckpt, be)
    be.fail_push = "draft"
    with pytest.raises(SGLangEngineError, match="boom"):
        eng.update_weights(perturbed(ckpt, "mtp."), WeightSelector.ALL, 1)
    with pytest.raises(SGLangEngineError, match=r"\['draft', 'target'\]"):
        eng.step()
    be.fail_push = None
    eng.update_weights(perturbed(ckpt, "mtp.", 0.03, WeightSelector.DRAFT), WeightSelector.DRAFT, 2)
    with pytest.raises(SGLangEngineError, match=r"\['target'\]"):  # a draft push cannot repair the target
        eng.step()
    eng.update_weights(perturbed(ckpt, "mtp.", 0.04), WeightSelector.ALL, 3)
    assert eng.step() == [] and eng.weight_version == 3


def test_eagle_draft_is_pushed_under_its_own_names(ckpt: Path, tmp_path: Path) -> None:
    """EAGLE/EAGLE3: a separate draft checkpoint; specs come from its safetensors header."""
    from safetensors.torch import save_file

    model, _ = load_checkpoint(ckpt)
    eagle = {"fc.weight": torch.randn(64, 128), "midlayer.self_attn.q_proj.weight": torch.randn(64, 64)}
    save_file(eagle, str(tmp_path / "model.safetensors"))
    cfg = SGLangEngineConfig(
        model_path=str(ckpt), speculative_algorithm="EAGLE", draft_model_path=str(tmp_path), speculation_k=3
    )
    be = RecordingBackend(k=3)
    be.load("draft", eagle)
    eng = SGLangEngine(cfg, model, backend=be, draft_digests={n: tensor_digest(t) for n, t in eagle.items()})  # type: ignore[arg-type]
    assert {(s.name, s.shape) for s in eng.weight_specs(WeightSelector.DRAFT)} == {
        ("fc.weight", (64, 128)),
        ("midlayer.self_attn.q_proj.weight", (64, 64)),
    }
    eng.update_weights({n: t + 1 for n, t in eagle.items()}, WeightSelector.DRAFT, 1)
    assert ("push", "draft", "1", True) in be.calls and eng.weight_version == 1
    be.skip_draft = "fc"  # SGLang skips one tensor: the aggregate checksum still changed (q_proj did)
    eng.update_weights({n: t + 2 for n, t in eagle.items()}, WeightSelector.DRAFT, 2)
    be.skip_draft = "."  # SGLang skips everything: caught
    with pytest.raises(StaleDraftError, match="unchanged"):
        eng.update_weights({n: t + 3 for n, t in eagle.items()}, WeightSelector.DRAFT, 3)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_says_how_to_install(ckpt: Path) -> None:
    model, _ = load_checkpoint(ckpt)
    cfg = SGLangEngineConfig(model_path=str(ckpt), speculative_algorithm=None, speculation_k=0)
    with pytest.raises(SGLangEngineError, match=r"install specrl\[sglang\] \(SGLang 0.5.23, CUDA 13, torch 2.14.1\)"):
        SGLangEngine(cfg, model)


def test_create_engine_dispatch(ckpt: Path) -> None:
    assert set(ENGINE_KINDS) == {"torch", "sglang"} and engine_class("sglang") is SGLangEngine
    with pytest.raises(ValueError, match="engine.kind must be one of torch, sglang"):
        create_engine(ckpt, EngineConfig(kind="vllm"))  # type: ignore[arg-type]
    assert create_engine(ckpt, EngineConfig(device="cpu")).info().engine == "torch"


def test_device_config() -> None:
    cpu = build_server_args(
        SGLangEngineConfig(model_path="/m", speculative_algorithm=None, speculation_k=0, device="cpu")
    )
    assert cpu["device"] == "cpu" and cpu["disable_cuda_graph"] is True and "attention_backend" not in cpu
    gpu1 = build_server_args(
        SGLangEngineConfig(model_path="/m", speculative_algorithm=None, speculation_k=0, device="cuda:1")
    )
    assert gpu1["base_gpu_id"] == 1 and "device" not in gpu1
    with pytest.raises(ValueError, match="device must be"):
        SGLangEngineConfig(model_path="/m", speculative_algorithm=None, speculation_k=0, device="tpu")


def test_routes_are_refused_clearly(ckpt: Path) -> None:
    """The adapter serves dense Qwen3 only (an MoE is refused at start, naming the torch engine), so
    a routes request meets a model without experts and is refused naming that."""
    import dataclasses

    from sidecar.model.moe import MoEConfig

    model, _ = load_checkpoint(ckpt)
    cfg = SGLangEngineConfig(model_path=str(ckpt), speculative_algorithm=None, speculation_k=0, device="cpu")
    eng = SGLangEngine(cfg, model, backend=RecordingBackend(k=0))  # type: ignore[arg-type]
    eng.validate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(temperature=0.0)))
    with pytest.raises(InvalidRequestError, match="without experts.*send routes 'off'"):
        eng.validate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(temperature=0.0), routes="sequence"))
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="serve it with --engine torch"):
        SGLangEngine(cfg, dataclasses.replace(model, moe=moe, architectures=["Qwen3MoeForCausalLM"]))  # type: ignore[arg-type]
