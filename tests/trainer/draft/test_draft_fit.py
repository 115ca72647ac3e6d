"""Engine-side draft self-distillation trains with the trainer's objective and only the draft.

Oracle for "it learned": the engine's own acceptance rate on fresh prompts, before and after.
"""

from __future__ import annotations

import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import ModelConfig, build_model
from sidecar.types import GenerationRequest, SamplingParams
from trainer.draft.fit import DraftFitConfig, fit_draft, init_draft_from_embedding


def acceptance(model, k: int = 2) -> float:
    engine = TorchEngine(model, speculation_k=k)
    prompts = torch.randint(0, model.config.vocab_size, (8, 4), generator=torch.Generator().manual_seed(99)).tolist()
    engine.generate(GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=24)))
    return engine.stats()[0].counters.acceptance_rate


def test_fit_draft_uses_the_trainers_kl_objective_and_trains_only_the_draft() -> None:
    model = build_model(ModelConfig.tiny(), seed=4)
    init_draft_from_embedding(model)
    trunk = {n: p.clone() for n, p in model.named_parameters() if not n.startswith("mtp.")}
    before = acceptance(model)
    cfg = DraftFitConfig(num_sequences=16, prompt_length=4, new_tokens=16, steps=30, lr=3e-3, chain_depth=2)
    losses = fit_draft(model, cfg)
    assert losses[-1] < 0.5 * losses[0]  # KL(p || q) >= 0 falls
    assert all(torch.equal(p, trunk[n]) for n, p in model.named_parameters() if not n.startswith("mtp."))
    assert not any(p.requires_grad for p in model.parameters())
    assert acceptance(model) > before + 0.04  # a random tiny target: 0.01 -> ~0.09 here
