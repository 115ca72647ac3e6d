"""MiMo (`MiMoForCausalLM`): a Qwen2 trunk and its own MTP layers, served as the MTP draft from their layout.

Oracle for the draft: a test-only transcription of the published MTP forward, `MiMoMTPLayers.forward`
in XiaomiMiMo's `modeling_mimo.py` (github.com/XiaomiMiMo/MiMo, file `modeling_mimo.py` at commit
051d98d073eee95ada84581d5a9ca55249bf45e2; the `trust_remote_code` file of the MiMo-7B checkpoints):

    input_embeds = self.token_layernorm(input_embeds)
    previous_hidden_states = self.hidden_layernorm(hidden_states)
    hidden_states = self.input_proj(torch.cat([previous_hidden_states, input_embeds], dim=-1))
    residual = hidden_states; hidden_states = self.input_layernorm(hidden_states)
    hidden_states = self.self_attn(hidden_states, ...)        # a Qwen2Attention
    hidden_states = residual + hidden_states
    residual = hidden_states; hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)                    # a Qwen2MLP
    hidden_states = residual + hidden_states
    hidden_states = self.final_layernorm(hidden_states)

built here from transformers' own `Qwen2Attention`, `Qwen2MLP` and `Qwen2RMSNorm` (transformers has no
MiMo class), fed the trunk's final-normed hidden state h_t (what vLLM's and SGLang's MiMo MTP read)
and the embedding of x_{t+1}, and projected by the shared output head. The trunk's oracle is
transformers' `Qwen2ForCausalLM`. The checkpoint is written as MiMo's is: transformers' Qwen2
tensors plus `model.mtp_layers.{j}.*`, config.json `architectures: ["MiMoForCausalLM"]`,
`model_type: "mimo"`, `attention_bias: true`, `num_nextn_predict_layers: 2`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm, Qwen2RotaryEmbedding

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import draft_tensor_names, load_checkpoint
from sidecar.model.model import build_model
from sidecar.types import GenerationRequest, SamplingParams
from tests.family_fixtures import SHAPE, randomise

pytestmark = pytest.mark.usefixtures("single_torch_thread")

LAYERS = 2  # MiMo-7B ships two MTP layers


class MiMoMTPReference(nn.Module):
    """The transcription (see the module docstring): parameter names as in the published file."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.token_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_proj = nn.Linear(config.hidden_size * 2, config.hidden_size, bias=False)
        self.final_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, layer_idx=0)
        self.mlp = Qwen2MLP(config)

    def forward(self, input_embeds: Tensor, hidden_states: Tensor, position_embeddings: Any, mask: Tensor) -> Tensor:
        input_embeds = self.token_layernorm(input_embeds)
        previous_hidden_states = self.hidden_layernorm(hidden_states)
        hidden_states = self.input_proj(torch.cat([previous_hidden_states, input_embeds], dim=-1))
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return self.final_layernorm(hidden_states)


@functools.cache
def mimo(seed: int = 0) -> tuple[Any, nn.ModuleList]:
    """transformers' Qwen2 trunk and the reference MTP layers, random (biases and norms too)."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**SHAPE)
    config._attn_implementation = "eager"
    trunk = transformers.Qwen2ForCausalLM(config).eval()
    layers = nn.ModuleList(MiMoMTPReference(config) for _ in range(LAYERS)).eval()
    for module in (trunk, layers):
        randomise(module, seed)
    return trunk, layers


def write_mimo_checkpoint(path: Path, seed: int = 0) -> Path:
    trunk, layers = mimo(seed)
    trunk.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw |= {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True}
    raw["num_nextn_predict_layers"] = LAYERS
    (path / "config.json").write_text(json.dumps(raw))
    mtp = {f"model.mtp_layers.{n}": p.detach().contiguous() for n, p in layers.named_parameters()}
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")  # shards, as the 7B's are
    save_file(mtp, str(path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n, _ in trunk.named_parameters()}}
    index["weight_map"] |= {n: "model-00002-of-00002.safetensors" for n in mtp}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mimo_checkpoint(tmp_path_factory.mktemp("mimo"))


def reference_draft_logits(ids: Tensor, j: int) -> Tensor:  # (B, T) -> (B, T - 1, V): position t predicts x_{t+2}
    trunk, layers = mimo()
    b, t = ids.shape
    mask = torch.full((t - 1, t - 1), float("-inf")).triu(1)[None, None]  # causal, additive
    with torch.no_grad():
        hidden = trunk.model(ids).last_hidden_state  # h_t after the trunk's final norm
        positions = torch.arange(1, t)[None].expand(b, t - 1)  # the MTP position t + 1 (its own attention: relative)
        rope = Qwen2RotaryEmbedding(trunk.config)(hidden, positions)
        out = layers[j](trunk.model.embed_tokens(ids[:, 1:]), hidden[:, :-1], rope, mask)
        return trunk.lm_head(out)


IDS = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(9))


def test_a_mimo_checkpoint_loads_in_its_own_layout(checkpoint: Path) -> None:
    config, tensors = load_checkpoint(checkpoint)
    assert (config.family, config.mtp_layout, config.attention_bias, config.qk_norm) == ("mimo", "mimo", True, False)
    assert config.num_nextn_predict_layers == LAYERS
    names = draft_tensor_names(config)
    assert names[:3] == [
        f"model.mtp_layers.0.{n}" for n in ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight")
    ]
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)  # the module tree is the checkpoint's names
    assert not any(n.startswith("mtp.") for n, _ in model.named_parameters())


@pytest.mark.parametrize("j", range(LAYERS))
def test_the_draft_logits_equal_the_published_mtp_forward(checkpoint: Path, j: int) -> None:
    config, tensors = load_checkpoint(checkpoint)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), mimo()[0](IDS).logits, atol=1e-4, rtol=0)  # the Qwen2 trunk
        got = model.mtp_logits(IDS, model.hidden_states(IDS), layer=j)
    torch.testing.assert_close(got, reference_draft_logits(IDS, j), atol=1e-5, rtol=0)


def test_the_transcription_tells_the_order_of_the_fused_input(checkpoint: Path) -> None:
    """Negative control: the DeepSeek-V3 order (embedding first) is caught by the comparison."""
    config, tensors = load_checkpoint(checkpoint)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    h = config.hidden_size
    with torch.no_grad():
        w = model.mtp_layer(0).proj.weight
        w.copy_(torch.cat([w[:, h:], w[:, :h]], dim=1))  # swap the halves: as if the embedding came first
        got = model.mtp_logits(IDS, model.hidden_states(IDS), layer=0)
    assert (got - reference_draft_logits(IDS, 0)).abs().max() > 1e-3


PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61], [7], [11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("compile", ["off", "on"])
def test_greedy_with_the_mimo_draft_at_k_1_to_3_equals_plain_greedy(checkpoint: Path, compile: str) -> None:
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine = TorchEngine.from_checkpoint(checkpoint, compile=compile, speculation_k=3, kv_block_size=8)
    assert engine.info().model.family == "mimo" and engine.info().speculation_method == "mtp"
    plain = [s.token_ids for s in engine.generate(GenerationRequest(prompts=PROMPTS, sampling=sp, speculation_k=0))]
    trunk = mimo()[0]
    with torch.no_grad():  # plain greedy is transformers' Qwen2 greedy
        for prompt, tokens in zip(PROMPTS, plain, strict=True):
            seq = list(prompt)
            for _ in range(16):
                seq.append(int(trunk(torch.tensor([seq])).logits[0, -1].argmax()))
            assert tokens == seq[len(prompt) :]
    for k in (1, 2, 3):
        request = GenerationRequest(prompts=PROMPTS, sampling=sp, speculation_k=k)
        assert [s.token_ids for s in engine.generate(request)] == plain, k
    assert engine.stats()[0].counters.drafted_tokens > 0
