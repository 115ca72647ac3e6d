"""End to end, DESIGN invariant 2: the log-probs the embedded engine reports while decoding
speculatively (KV cache, MTP drafts, rejection sampling) equal the Megatron policy's recomputation
of the same tokens from the same checkpoint; the trainer's mismatch metric sees |ratio - 1| ~ 0."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.types import GenerationRequest, SamplingParams
from trainer.policy.losses import mismatch_metrics
from trainer.policy.policy import Policy, TrainBatch


def test_engine_rollout_logprobs_equal_policy_recomputation(tmp_path: Path) -> None:
    mc = ModelConfig.tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    save_checkpoint(tmp_path, mc, model_state_dict(build_model(mc, seed=21)))
    engine = TorchEngine.from_checkpoint(tmp_path, speculation_k=2)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    request = GenerationRequest(
        prompts=prompts,
        samples_per_prompt=2,
        # 5 + 27 = 32 positions: four times the original YaRN context of 8 (factor 4).
        sampling=SamplingParams(temperature=0.8, max_new_tokens=27, seed=7),
        request_id="r0",
    )
    engine.submit(request)
    samples = []
    for _ in range(400):  # bounded: 4 samples x 27 tokens need far fewer steps
        samples += engine.step()
        if not engine.has_work():
            break
    assert len(samples) == 4 and all(len(s.token_ids) == 27 for s in samples)
    assert all(all(math.isfinite(x) for x in s.logprobs) for s in samples)
    assert sum(s.counters.drafted_tokens for s in samples) > 0  # speculation really ran

    policy = Policy.from_checkpoint(tmp_path, Policy.Config(temperature=0.8))
    batch = TrainBatch.from_sequences(
        [prompts[s.prompt_index] for s in samples],
        [s.token_ids for s in samples],
        torch.zeros(len(samples)),
        rollout_logprobs=[s.logprobs for s in samples],
    )
    ours = policy.logprobs(batch.tokens)
    m = batch.mask.bool()
    assert batch.rollout_logprobs is not None
    torch.testing.assert_close(ours[m], batch.rollout_logprobs[m], rtol=0, atol=1e-4)
    assert mismatch_metrics(ours, batch.rollout_logprobs, batch.mask)["mismatch_abs_ratio_max"] < 1e-4
