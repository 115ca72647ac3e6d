"""`DraftAligner` refits either draft kind against a Hugging Face policy and its push is served.

The policy is transformers' `Qwen3ForCausalLM` holding the same weights as the sidecar's target
(an independent forward); the aligner fits on the policy's own samples, its tensors are pushed
with the DRAFT selector into an engine serving the draft, and the acceptance length rises. For
EAGLE-3, the taps it reads from `output_hidden_states` are checked against the engine model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.integrations.draft_alignment import DraftAlignConfig, DraftAligner
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.eagle3 import Eagle3Config, build_eagle3
from sidecar.model.eagle3_checkpoint import load_eagle3_draft, save_eagle3_draft
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.sidecar_fixtures import hf_qwen3_config


def _confident(mc: ModelConfig, seed: int) -> Qwen3WithMTP:
    """A target whose next token depends mostly on the last one, with a sharp distribution: a
    draft can learn it in a few steps; an untrained one cannot guess it."""
    model = build_model(mc, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        model.output_weight().mul_(4.0)
    return model


def _hf(mc: ModelConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3ForCausalLM(hf_qwen3_config(mc)).eval()
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")})
    assert not missing and not unexpected
    return model


def _tau(engine: TorchEngine, prompts: list[list[int]]) -> float:
    samples = engine.generate(
        GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=1.0, max_new_tokens=24, seed=4))
    )
    return sum(s.counters.generated_tokens for s in samples) / sum(s.counters.verify_steps for s in samples)


def _rollouts(target: Qwen3WithMTP, n: int) -> list[list[int]]:
    prompts = torch.randint(0, target.config.vocab_size, (n, 4), generator=torch.Generator().manual_seed(7)).tolist()
    engine = TorchEngine(target, speculation_k=0)
    request = GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=1.0, max_new_tokens=24, seed=8))
    return [
        p + s.token_ids
        for p, s in zip(prompts, sorted(engine.generate(request), key=lambda s: s.prompt_index), strict=True)
    ]


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_a_refit_draft_pushed_with_the_draft_selector_accepts_more(kind: str, tmp_path: Path) -> None:
    mc = ModelConfig.tiny(num_hidden_layers=4, num_nextn_predict_layers=1 if kind == "mtp" else 0)
    target = _confident(mc, seed=11)
    state = model_state_dict(target)
    save_checkpoint(tmp_path / "policy", mc, state)
    draft_dir = None
    if kind == "eagle3":
        draft_dir = tmp_path / "draft"
        save_eagle3_draft(draft_dir, build_eagle3(Eagle3Config.for_target(mc, aux_layer_ids=[1, 2, 3]), seed=3))
    aligner = DraftAligner(tmp_path / "policy", DraftAlignConfig(steps=60, lr=1e-2), draft=draft_dir)
    policy = _hf(mc, state)
    aligner.bind(policy)

    served = build_model(mc)
    served.load_state_dict(state)
    engine = TorchEngine(
        served, speculation_k=3, draft=None if draft_dir is None else load_eagle3_draft(draft_dir, target=mc)
    )
    assert {n for n, _ in aligner.draft_tensors()} == {s.name for s in engine.weight_specs(WeightSelector.DRAFT)}
    held_out = torch.randint(0, mc.vocab_size, (8, 4), generator=torch.Generator().manual_seed(9)).tolist()
    before = _tau(engine, held_out)

    sequences = _rollouts(target, 16)
    if kind == "eagle3":  # the taps it reads are the engine model's own (an independent forward)
        ids = torch.tensor(sequences[:2])
        with torch.no_grad():
            hf_states = policy.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
            aux: list[torch.Tensor] = []
            target.hidden_states(ids, aux_layers=(1, 2, 3), aux=aux)
        for mine, theirs in zip(aux, [hf_states[i] for i in (1, 2, 3)], strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    losses = aligner.fit(sequences)
    assert losses[-1] < 0.5 * losses[0], losses
    engine.update_weights(dict(aligner.draft_tensors()), WeightSelector.DRAFT, version=1)
    after = _tau(engine, held_out)
    assert after > before + 0.3, (before, after)
    assert all(not p.requires_grad for p in engine.drafter.pushed_parameters().values())
