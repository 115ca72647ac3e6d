"""GLM-4.5-style checkpoints (`Glm4MoeForCausalLM`) against transformers' own forward (issue 58).

Oracle: transformers' `Glm4MoeForCausalLM` on tiny random checkpoints its `save_pretrained` writes:
sigmoid routing with the expert-score bias within 1 of 2 expert groups, a shared expert, the first
layer dense, partial rotary (half of each head), q/k/v biases as GLM-4.5 ships them (and the q/k
norm variant), routed_scaling_factor 2.5. Checked: float32 log-softmax within 1e-4 at every
position; greedy token for token (ragged prompts in one batch, paged KV over several blocks, both
compile modes); negative controls (the bias or the partial rotary dropped) caught.

The checkpoint's own MTP layer: transformers implements none (it skips `model.layers.{L}.*` on
load), so its tensors are added to the file under the DeepSeek-V3 names GLM-4.5 ships (the layer
copied from transformers' own layer names, with the embedding and output-head copies GLM-4.5
carries); served as the draft, speculation at k = 1..3 must equal plain greedy (lossless) and
transformers' greedy.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from sidecar.engine.torch_engine import TorchEngine
from sidecar.errors import CheckpointError
from sidecar.model.checkpoint import load_checkpoint, save_checkpoint
from sidecar.model.model import Qwen3WithMTP, build_model
from sidecar.model.moe import SparseMoE
from sidecar.types import WeightSelector
from tests.sidecar.model.test_moe_models import engine_greedy, hf_greedy, logprobs, scaled

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    partial_rotary_factor=0.5,
    max_position_embeddings=256,
    num_nextn_predict_layers=1,
)
VARIANTS = {"glm45": {"attention_bias": True, "use_qk_norm": False}, "qk_norm": {"use_qk_norm": True}}
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41]]
NEW = 12


def hf_glm(path: Path, **overrides: Any) -> transformers.Glm4MoeForCausalLM:
    torch.manual_seed(0)
    hf = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**(SHAPE | overrides))).eval()
    scaled(hf, seed=1)
    with torch.no_grad():
        for layer in hf.model.layers[SHAPE["first_k_dense_replace"] :]:
            gen = torch.Generator().manual_seed(2)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(SHAPE["n_routed_experts"], generator=gen) * 0.1)
    hf.save_pretrained(path)
    return hf


def add_native_mtp_layer(path: Path, seed: int = 3) -> None:
    """The checkpoint's MTP layer in GLM-4.5's layout, `model.layers.{L}.*`: enorm, hnorm, eh_proj,
    shared_head.norm, the copies of the embedding and the output head, and a full MoE decoder layer
    under transformers' own names (those of its last layer, new random values)."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    last, mtp = f"model.layers.{SHAPE['num_hidden_layers'] - 1}.", f"model.layers.{SHAPE['num_hidden_layers']}."
    gen = torch.Generator().manual_seed(seed)
    h = SHAPE["hidden_size"]
    added = {
        mtp + "enorm.weight": torch.rand(h, generator=gen) + 0.5,
        mtp + "hnorm.weight": torch.rand(h, generator=gen) + 0.5,
        mtp + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.2,
        mtp + "shared_head.norm.weight": torch.rand(h, generator=gen) + 0.5,
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
    }
    for name, t in tensors.items():
        if name.startswith(last):
            noise = torch.rand(t.shape, generator=gen) + 0.5 if name.endswith("norm.weight") else None
            added[mtp + name[len(last) :]] = (
                noise if noise is not None else t + torch.randn(t.shape, generator=gen) * 0.1
            )
    save_file(tensors | {n: t.contiguous() for n, t in added.items()}, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_glm(path, **VARIANTS[request.param])
    add_native_mtp_layer(path)
    return hf, path


def loaded(path: Path) -> Qwen3WithMTP:
    config, tensors = load_checkpoint(path)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    return model


def test_the_layout_is_glm45s(checkpoint: tuple[Any, Path]) -> None:
    hf, path = checkpoint
    model = loaded(path)
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [False, True, True]
    assert model.config.num_nextn_predict_layers == 1 and isinstance(model.mtp_layer(0).mlp, SparseMoE)
    assert model.config.rotary_dim == 8 and model.config.moe is not None and model.config.moe.n_shared_experts == 1
    assert model.config.attention_bias == hf.config.attention_bias and model.config.qk_norm == hf.config.use_qk_norm


def test_log_softmax_matches_transformers_at_every_position(checkpoint: tuple[Any, Path]) -> None:
    hf, path = checkpoint
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 64), generator=torch.Generator().manual_seed(2))
    assert (logprobs(loaded(path), ids) - logprobs(hf, ids)).abs().max() < 1e-4


@pytest.mark.parametrize("wrong", ["no_score_bias", "full_rotary", "unscaled"])
def test_each_part_of_the_forward_is_needed(checkpoint: tuple[Any, Path], wrong: str) -> None:
    """Negative controls: the same weights with one GLM-specific part dropped are caught by the
    comparison above."""
    hf, path = checkpoint
    config, tensors = load_checkpoint(path)
    assert config.moe is not None
    if wrong == "no_score_bias":
        tensors = {n: torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t for n, t in tensors.items()}
    if wrong == "full_rotary":
        config = dataclasses.replace(config, architectures=["Glm4MoeForCausalLM"], partial_rotary_factor=1.0)
    if wrong == "unscaled":
        config.moe = dataclasses.replace(config.moe, routed_scaling_factor=1.0)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(3))
    assert (logprobs(model, ids) - logprobs(hf, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_with_its_own_mtp_layer_equals_transformers_greedy(
    checkpoint: tuple[Any, Path], compile_mode: str
) -> None:
    hf, path = checkpoint
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    engine = TorchEngine.from_checkpoint(path, compile=compile_mode, kv_block_size=4, max_batch_size=4)
    assert engine.info().speculation_method == "mtp"
    assert engine_greedy(engine, PROMPTS, 0) == expected  # plain: batched, ragged, paged
    for k in (1, 2, 3):  # the checkpoint's own MTP layer drafts; lossless
        assert engine_greedy(engine, PROMPTS, k) == expected, k
    assert engine.stats()[0].counters.drafted_tokens > 0


def test_greedy_through_the_fused_kernels_equals_transformers_greedy(
    checkpoint: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fixed-shape rounds with the fused kernels (Triton's interpreter on CPUs, as on a GPU): the
    q/k kernel rotates whole heads, so GLM's partial rotary attends through torch's masked path
    while the other fused kernels run; greedy, plain and drafting, is transformers'."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU models through the kernels: Triton's interpreter, CPUs only")
    from sidecar.model.decode_kernels import DecodeKernels

    monkeypatch.setattr(DecodeKernels, "for_device", staticmethod(lambda device: DecodeKernels()))
    hf, path = checkpoint
    expected = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    engine = TorchEngine.from_checkpoint(path, compile="on", kv_block_size=4, max_batch_size=4)
    assert isinstance(engine.kernels, DecodeKernels)
    assert engine_greedy(engine, PROMPTS, 0) == expected
    assert engine_greedy(engine, PROMPTS, 2) == expected


def test_a_checkpoint_without_its_mtp_tensors_serves_plain(tmp_path: Path) -> None:
    """What transformers' save_pretrained writes: config.json announces the layer, no tensor holds it."""
    hf = hf_glm(tmp_path, **VARIANTS["glm45"])
    engine = TorchEngine.from_checkpoint(tmp_path)
    assert engine.info().model.num_mtp_layers == 0 and engine.max_speculation_k == 0
    assert engine_greedy(engine, PROMPTS[:2], 0) == [hf_greedy(hf, p, NEW) for p in PROMPTS[:2]]


def test_an_mtp_layer_with_its_own_output_head_is_refused(tmp_path: Path) -> None:
    hf_glm(tmp_path, **VARIANTS["glm45"])
    add_native_mtp_layer(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    tensors[f"model.layers.{SHAPE['num_hidden_layers']}.shared_head.head.weight"] += 1.0
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="shared_head.head.weight differs from lm_head.weight"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"q_lora_rank": 64, "kv_lora_rank": 32}, "multi-head latent attention"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_naming_the_architecture(
    tmp_path: Path, extra: dict[str, Any], needle: str
) -> None:
    hf_glm(tmp_path, **VARIANTS["glm45"])
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | extra))
    with pytest.raises(CheckpointError, match=needle) as caught:
        TorchEngine.from_checkpoint(tmp_path)
    assert "Glm4MoeForCausalLM" in str(caught.value) and "Supported:" in str(caught.value)


def test_save_checkpoint_writes_glms_layout_back(checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    """specrl's export of a GLM policy: the draft back at `model.layers.{L}.*`, loading as before."""
    _, path = checkpoint
    config, tensors = load_checkpoint(path)
    save_checkpoint(tmp_path, config, tensors)
    written = load_file(str(tmp_path / "model.safetensors"))
    assert f"model.layers.{SHAPE['num_hidden_layers']}.eh_proj.weight" in written
    assert not any(n.startswith("mtp.") for n in written)
    again, tensors_again = load_checkpoint(tmp_path)
    assert again == config and tensors_again.keys() == tensors.keys()
    assert all(torch.equal(tensors[n], tensors_again[n]) for n in tensors)


def test_a_push_of_glm_weights_and_its_draft_equals_a_fresh_load(checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    """Target and draft pushed together under the contract's names (the draft as `mtp.layers.0.*`,
    routers and the expert-score bias float32): the engine then serves what a fresh load serves."""
    _, path = checkpoint
    config, tensors = load_checkpoint(path)
    g = torch.Generator().manual_seed(9)
    pushed = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in tensors.items()}
    engine = TorchEngine.from_checkpoint(path, kv_block_size=4)
    specs = {s.name: s for s in engine.weight_specs(WeightSelector.DRAFT)}
    assert "mtp.layers.0.eh_proj.weight" in specs and "mtp.layers.0.mlp.gate.e_score_correction_bias" in specs
    assert specs["mtp.layers.0.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    before = engine_greedy(engine, PROMPTS, 2)
    engine.update_weights(pushed, WeightSelector.ALL, version=1)
    save_checkpoint(tmp_path, config, pushed)
    fresh = TorchEngine.from_checkpoint(tmp_path, kv_block_size=4)
    assert engine_greedy(engine, PROMPTS, 2) == engine_greedy(fresh, PROMPTS, 2) != before
    assert engine_greedy(engine, PROMPTS, 0) == engine_greedy(fresh, PROMPTS, 0)


def test_bfloat16_follows_transformers_bfloat16(tmp_path: Path) -> None:
    """In bf16, transformers keeps GLM-4.5's router float32 and multiplies each expert's output by its
    float32 weight before rounding; so does the engine (float32 routers, `weights_in_dtype`). Its
    log-softmax stays within bf16's reach of transformers' (a dense Qwen3 at these weights: ~0.12;
    rounding the weights to bf16 first had it 3.1 nats off)."""
    hf_glm(tmp_path / "f32", **VARIANTS["glm45"])
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16).eval()
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    hf.save_pretrained(tmp_path / "bf16")
    model = loaded(tmp_path / "bf16")
    assert model.config.torch_dtype == "bfloat16" and model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    assert (logprobs(model, ids) - logprobs(hf, ids)).abs().max() < 0.1
