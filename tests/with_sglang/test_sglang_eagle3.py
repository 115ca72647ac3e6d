"""An EAGLE-3 draft directory written by specrl (`save_eagle3_draft`), read and run by SGLang 0.5.23.

1. SGLang's real ``LlamaForCausalLMEagle3`` built from the directory's config (SGLang's own
   ModelConfig, as its draft worker does) and filled by its own ``load_weights``: every parameter
   holds our tensors (q/k/v and gate/up fused), its ``hot_token_id`` is our draft vocabulary, and
   the target's ``set_eagle3_layers_to_capture`` with the ids our config carries taps our layers.
2. End to end, ``specrl serve --engine sglang --draft DIR`` (SGLang's EAGLE3 algorithm with the
   directory as ``speculative_draft_model_path``, chain drafting k = 3) over gRPC: GetInfo says
   eagle3, and greedy output equals the embedded
   engine's plain greedy output, and each sample's acceptance length equals the embedded engine's
   with the same draft — the two compute the same proposals. The draft is partly aligned and its
   q depends on which tap is which (`make_draft`), so a tap, name or vocabulary-map misread shows
   as another acceptance.

CPU here (``tools/test-sglang``; SGLang's CPU engine with ``tests/sglang_cpu_support/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from sidecar.client.client import SidecarClient
from sidecar.engine.sglang import names
from sidecar.engine.sglang.engine import SGLangEngineConfig, build_server_args
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.eagle3 import Eagle3Draft
from sidecar.model.eagle3_checkpoint import load_eagle3_draft, save_eagle3_draft
from sidecar.model.model import Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.engine_fixtures import aligned_eagle3
from tests.with_sglang.served import NEEDS_SGLANG, small_config, specrl_serve

pytestmark = NEEDS_SGLANG

K = 3
PROMPTS = [[1, 2, 3, 4], [17], [100, 101, 102, 103, 104, 105, 106], [250, 7]]
CONFIG = small_config("float32", num_hidden_layers=4, num_nextn_predict_layers=0)
DRAFT_VOCAB = [*range(0, 512, 2), 1, 3, 5, 7]


def make_target() -> Qwen3WithMTP:
    """A near-bigram 4-layer target without MTP layers (see engine_fixtures.eagle3_target)."""
    model = build_model(CONFIG, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.002)
            layer.mlp.down_proj.weight.mul_(0.002)
    return model


def make_draft(target: Qwen3WithMTP) -> Eagle3Draft:
    """`aligned_eagle3` with a reduced vocabulary, made to depend on which tap is which: fc = [-100 I,
    100 I, 0], so the fused state is layer 1's own (eps-scaled) output amplified, added to the
    draft's residual stream (values read the embedding only). Acceptance length ~1.3 at k = 3, and
    every permutation of the taps changes some sample's (checked with the embedded engine)."""
    draft = aligned_eagle3(target, sorted(DRAFT_VOCAB))
    h = CONFIG.hidden_size
    eye = torch.eye(h)
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([-100 * eye, 100 * eye, 0 * eye], dim=1))
        draft.midlayer.self_attn.v_proj.weight[:, h:] = 0
    return draft


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen3WithMTP, Path, Path]:
    """(target, its specrl checkpoint, the EAGLE-3 draft directory)."""
    root = tmp_path_factory.mktemp("eagle3")
    target = make_target()
    save_checkpoint(root / "ckpt", CONFIG, model_state_dict(target))
    save_eagle3_draft(root / "draft", make_draft(target))
    return target, root / "ckpt", root / "draft"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_specrl_serve_sglang_with_our_draft_generates_as_the_embedded_engine_does(
    dirs: tuple[Qwen3WithMTP, Path, Path],
) -> None:
    """`specrl serve --engine sglang --draft DIR`: SGLang's EAGLE3 with our directory, over gRPC."""
    target, ckpt, draft_dir = dirs
    request = GenerationRequest(prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=24))
    with (
        specrl_serve(ckpt, speculation_k=K, extra=("--draft", str(draft_dir))) as address,
        SidecarClient(address) as client,
    ):
        info = client.info().engine
        got = client.generate(request)
    assert (info.engine, info.speculation_method, info.speculation_k) == ("sglang", "eagle3", K)
    plain = TorchEngine(target, speculation_k=0).generate(request)
    ours = TorchEngine(target, speculation_k=K, draft=load_eagle3_draft(draft_dir)).generate(request)
    assert [s.token_ids for s in got] == [s.token_ids for s in plain] == [s.token_ids for s in ours]
    taus = [s.counters.acceptance_length for s in got]
    assert taus == pytest.approx([s.counters.acceptance_length for s in ours])  # the same proposals
    assert sum(taus) / len(taus) > 1.15  # the draft was used, and partly accepted


def test_sglangs_loader_fills_the_eagle3_model_with_our_tensors(dirs: tuple[Qwen3WithMTP, Path, Path]) -> None:
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.server_args import ServerArgs
    from sglang.test.layer_ut_utils import init_single_process_dist

    target, ckpt, draft_dir = dirs
    target_dir = names.write_sglang_checkpoint(CONFIG, model_state_dict(target), ckpt.parent / "layout").target_dir
    config = SGLangEngineConfig(
        model_path=str(target_dir), speculative_algorithm="EAGLE3", draft_model_path=str(draft_dir), speculation_k=K
    )
    sa = ServerArgs(**build_server_args(config))
    sa.resolve_once()
    init_single_process_dist()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sglang.srt.layers.rotary_embedding.base._is_cpu", True)
        draft_cfg = SGLangModelConfig.from_server_args(sa, model_path=str(draft_dir), is_draft_model=True)
        assert draft_cfg.hf_config.architectures == ["LlamaForCausalLMEagle3"]
        model = LlamaForCausalLMEagle3(draft_cfg.hf_config)
        sglang_target = Qwen3ForCausalLM(SGLangModelConfig.from_server_args(sa).hf_config)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    ours = load_file(str(draft_dir / "model.safetensors"))
    model.load_weights(list(ours.items()))
    params: dict[str, Any] = dict(model.named_parameters())
    for name, p in params.items():
        if name != "model.embed_tokens.weight":  # SGLang's draft worker sets the target's (set_embed)
            assert not p.isnan().any(), f"SGLang parameter {name} was not loaded"
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    qkv = torch.cat([ours[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(params[a + "qkv_proj.weight"], qkv)
    assert torch.equal(params[a + "o_proj.weight"], ours["midlayer.self_attn.o_proj.weight"])
    gate_up = torch.cat([ours["midlayer.mlp.gate_proj.weight"], ours["midlayer.mlp.up_proj.weight"]])
    assert torch.equal(params[m + "gate_up_proj.weight"], gate_up)
    assert torch.equal(params[m + "down_proj.weight"], ours["midlayer.mlp.down_proj.weight"])
    for sub in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        assert torch.equal(params[f"model.layers.0.{sub}.weight"], ours[f"midlayer.{sub}.weight"])
    for name in ("fc.weight", "norm.weight"):
        assert torch.equal(params["model." + name], ours[name])
    head = params["lm_head.weight"]  # SGLang pads its rows to a multiple of 64; the logits use the first ones
    assert torch.equal(head[: len(DRAFT_VOCAB)], ours["lm_head.weight"]) and not head[len(DRAFT_VOCAB) :].any()
    assert model.hot_token_id.tolist() == sorted(DRAFT_VOCAB)  # draft id -> target id
    # The target taps what our config says, read as SGLang's worker reads it (eagle_config, +1).
    ids = draft_cfg.hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    sglang_target.set_eagle3_layers_to_capture(ids)
    taps = load_eagle3_draft(draft_dir).config.aux_layers(CONFIG.num_hidden_layers)
    assert list(sglang_target.model.layers_to_capture) == list(taps)
