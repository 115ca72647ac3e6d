"""Joined q|k|v and gate|up parameters: the decode path reads the weights without copies (issue 40).

On a CUDA device the engine stores each layer's q, k, v (and gate, up) weights as row blocks of one
tensor (`Qwen3WithMTP.join_projections`), so `DecodeWeights` multiplies by the parameters themselves
instead of fused copies (which took ~70% of each layer's weights again: ~11 GB at Qwen3-8B in bf16).
CPUs keep their (in, out) copies, so here the GPU layout is chosen explicitly
(`decode_by_columns = False`) to run the same code. Oracles: the plain full forward (greedy), the
pushed weights' plain forward after a copying or an adopting push, and the parameters' storages
(no copy made, none swapped).

The joined rows are `sidecar/model/decode_weights.py`'s layout of a layer's weights.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import WeightSelector
from tests.sidecar.engine.test_static_engine import NEW, PROMPTS, greedy, oracle_greedy
from tests.sidecar.engine_fixtures import aligned_draft_model


def joined(model: Qwen3WithMTP) -> Qwen3WithMTP:
    model.decode_by_columns = False  # the CUDA layout, on this CPU
    model.join_projections()
    return model


def private_copy_bytes(model: Qwen3WithMTP) -> int:
    """Bytes of decode weights stored apart from every parameter."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(
        t.numel() * t.element_size()
        for w in model.decode_weights()
        for t in (w.qkv, w.gate_up, w.o, w.down)
        if t.untyped_storage().data_ptr() not in params
    )


def test_joining_keeps_the_values_and_the_decode_path_then_copies_nothing() -> None:
    model = aligned_draft_model(ModelConfig.tiny(), seed=2)
    before = {n: t.clone() for n, t in model_state_dict(model).items()}
    model.decode_by_columns = False
    copies = private_copy_bytes(model)
    layer = model.model.layers[0]
    assert copies > 0  # fused copies of separate parameters
    joined(model)
    assert all(torch.equal(before[n], t) for n, t in model_state_dict(model).items())
    attn = layer.self_attn
    storages = {p.weight.untyped_storage().data_ptr() for p in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(storages) == 1
    assert private_copy_bytes(model) == 0  # qkv, gate_up, o, down are the parameters themselves
    w = model.decode_weights()[0]
    assert w.qkv.data_ptr() == attn.q_proj.weight.data_ptr()
    assert w.gate_up.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
    joined(model)  # idempotent: already joined
    assert model.decode_weights()[0].qkv.data_ptr() == attn.q_proj.weight.data_ptr()


@pytest.mark.parametrize("compile_mode", ["off", "on"])
@pytest.mark.parametrize("k", [0, 3])
def test_greedy_on_joined_projections_equals_the_plain_forward(compile_mode: str, k: int) -> None:
    reference = aligned_draft_model(ModelConfig.tiny(), seed=2)
    engine = TorchEngine(joined(aligned_draft_model(ModelConfig.tiny(), seed=2)), speculation_k=k, compile=compile_mode)
    assert greedy(engine, k) == [oracle_greedy(reference, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("adopt", [False, True])
def test_a_push_lands_in_the_joined_storage_and_generation_follows_it(adopt: bool, architecture: str) -> None:
    """Qwen2: the q/k/v biases' decode copy is refreshed in place (a captured graph reads it)."""
    config = ModelConfig.tiny(architectures=[architecture])
    model = joined(build_model(config, seed=31))
    engine = TorchEngine(model, speculation_k=3, compile="on")
    before = greedy(engine, 3)
    attn = model.model.layers[1].self_attn
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    bias = model.decode_weights()[1].qkv_bias
    pushed = build_model(config, seed=32)
    tensors = {n: t.clone() for n, t in model_state_dict(pushed).items()}
    if adopt:
        engine.adopt_weights(tensors, WeightSelector.ALL, version=1)
    else:
        engine.update_weights(tensors, WeightSelector.ALL, version=1)
    after = greedy(engine, 3)
    assert after == [oracle_greedy(pushed, p, NEW) for p in PROMPTS] and after != before
    # copied into the shared storage (never swapped): still joined, still no decode copies
    assert {p.weight.untyped_storage().data_ptr() for p in (attn.q_proj, attn.k_proj, attn.v_proj)} == {storage}
    assert private_copy_bytes(model) == 0
    if config.attention_bias:
        assert bias is not None and model.decode_weights()[1].qkv_bias is bias  # the same storage, new values
        assert torch.equal(bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))


def test_joining_again_keeps_the_decode_weights_another_engines_graphs_read() -> None:
    """A second engine on the same CUDA model joins nothing new: the decode weights (and the copies
    whose addresses the first engine's graphs captured, such as the q/k norm table) stay as they
    are. Rebuilding them moved those copies, and the first engine recaptured every graph (found on
    an H200: tests/sidecar/engine/test_cuda_graphs.py)."""
    model = joined(build_model(ModelConfig.tiny(), seed=3))
    before = [t.data_ptr() for w in model.decode_weights() for t in w.tensors()]
    model.join_projections()  # what a second TorchEngine on a CUDA model does
    assert [t.data_ptr() for w in model.decode_weights() for t in w.tensors()] == before
