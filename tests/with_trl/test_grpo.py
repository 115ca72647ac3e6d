"""Real TRL GRPOTrainer (trl==1.16.0) on CPU against a real `specrl serve` with an MTP draft, k = 2.

The oracle is TRL's own: `sampling/sampling_logp_difference/max`, the largest |log-prob the
sidecar reported - log-prob GRPOTrainer recomputes with the model it trains| over the step's
completion tokens. With weights synced every step it stays at float32 rounding (≤ 1e-5); the
negative control never pushes weights, so the sidecar samples from the initial policy while
TRL trains, and the same metric grows. That is what makes the positive test able to fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="the TRL target needs .venv-trl: run tools/test-trl")

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from sidecar.client.client import SidecarClient
from sidecar.integrations.draft_alignment import DraftAlignConfig, DraftAligner
from sidecar.integrations.trl import (
    SidecarGenerationConfig,
    SpecrlGRPOTrainer,
    SpecrlVLLMClient,
    UnsupportedBySidecar,
    check_trl_seam,
)
from sidecar.types import WeightSelector
from tests.with_trl.serve import ServeProcess

STEPS = 3
MISMATCH = "sampling/sampling_logp_difference/max"


def reward_w7(completions: list[str], **_: Any) -> list[float]:
    """Reward the word w7: enough variance within a group for GRPO to move the policy."""
    return [c.split().count("w7") / max(len(c.split()), 1) for c in completions]


def prompts() -> Dataset:
    rows = [" ".join(f"w{3 + (i * 7 + j * 5) % 60}" for j in range(3 + i % 3)) for i in range(16)]
    return Dataset.from_dict({"prompt": rows})


class NoSyncClient(SpecrlVLLMClient):
    """Negative control: consumes TRL's weight stream but never pushes it."""

    def update_named_params(self, metadata: Any, named_params: Any) -> None:
        for _ in named_params:
            pass


def train(
    checkpoint: Path,
    client: SpecrlVLLMClient,
    out: Path,
    lr: float = 3e-3,
    steps: int = STEPS,
    draft_aligner: DraftAligner | None = None,
) -> SpecrlGRPOTrainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    args = GRPOConfig(
        output_dir=str(out),
        use_vllm=True,
        vllm_mode="server",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=steps,
        learning_rate=lr,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        beta=0.0,
        seed=0,
        temperature=1.0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = SpecrlGRPOTrainer(
        model=model,
        reward_funcs=reward_w7,
        args=args,
        train_dataset=prompts(),
        processing_class=tokenizer,
        sidecar=client,
        draft_aligner=draft_aligner,
    )
    trainer.train()
    return trainer


def per_step(trainer: SpecrlGRPOTrainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


pytestmark = pytest.mark.usefixtures("single_torch_thread")  # tests/conftest.py


def test_seam_matches_pinned_trl() -> None:
    check_trl_seam()


def test_grpo_through_sidecar_is_lossless_and_synced(checkpoint: Path, serve: ServeProcess, tmp_path: Path) -> None:
    client = SpecrlVLLMClient(serve.address, SidecarGenerationConfig(seed=0))
    trainer = train(checkpoint, client, tmp_path)

    mismatch = per_step(trainer, MISMATCH)
    assert len(mismatch) == STEPS, trainer.state.log_history
    assert all(m <= 1e-5 for m in mismatch), f"TRL's sampling log-prob mismatch per step: {mismatch}"

    versions = [r.version for r in client.push_results]
    assert versions == list(range(1, STEPS + 1)), f"one push per TRL step, versions {versions}"
    with SidecarClient(serve.address) as direct:
        assert direct.info().weight_version == STEPS

    taus = [c.acceptance_length for c in client.counters]
    assert len(taus) == STEPS
    assert all(c.drafted_tokens > 0 for c in client.counters), "speculation was not used"
    assert all(t > 1.5 for t in taus), f"τ per TRL step: {taus}"
    print(f"\nmismatch per step {mismatch}\nτ per step {taus}\nversions {versions}")


def test_negative_control_without_weight_sync_diverges(checkpoint: Path, serve: ServeProcess, tmp_path: Path) -> None:
    client = NoSyncClient(serve.address, SidecarGenerationConfig(seed=0))
    trainer = train(checkpoint, client, tmp_path)
    mismatch = per_step(trainer, MISMATCH)
    assert len(mismatch) == STEPS
    assert mismatch[0] <= 1e-5, "before any optimizer step the served weights are TRL's"
    assert mismatch[-1] > 1e-3 and mismatch[-1] > 100 * max(mismatch[0], 1e-7), f"mismatch per step: {mismatch}"
    with SidecarClient(serve.address) as direct:
        assert direct.info().weight_version == 0
    print(f"\nno-sync mismatch per step {mismatch}")


def test_unsupported_vllm_features_are_refused_by_name(serve: ServeProcess) -> None:
    client = SpecrlVLLMClient(serve.address)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"min_p": 0.05}, "min_p"),
        ({"logprobs": 5}, "logprobs=5"),
        ({"structured_outputs_regex": "w3+"}, "structured outputs"),
        ({"generation_kwargs": {"presence_penalty": 0.5}}, "presence_penalty"),
        ({"features": [None]}, "image features"),
    ]
    for kwargs, named in cases:
        with pytest.raises(UnsupportedBySidecar, match=named):
            client.generate([[5, 6, 7]], **kwargs)
    with pytest.raises(UnsupportedBySidecar, match="text prompts"):
        client.generate(["w5 w6"])
    with pytest.raises(UnsupportedBySidecar, match="weight_update"):
        client.update_named_param("model.norm.weight", torch.ones(64))
    with pytest.raises(UnsupportedBySidecar, match="top_logprobs=5"):
        client.get_sequence_logprobs([[5, 6, 7]], [1], top_logprobs=5)
    # The sidecar still serves after the refusals.
    out = client.generate([[5, 6, 7]], n=2, max_tokens=4)
    assert len(out["completion_ids"]) == 2


def test_get_sequence_logprobs_scores_what_generate_sampled(serve: ServeProcess) -> None:
    """Teacher scoring (RolloutService.Score) gives the log-probs Generate reported for the same tokens."""
    client = SpecrlVLLMClient(serve.address, SidecarGenerationConfig(seed=1))
    out = client.generate([[5, 6, 7], [9, 10]], n=2, max_tokens=8, generation_kwargs={"ignore_eos": True})
    prompts = [p for p in out["prompt_ids"] for _ in range(2)]
    seqs = [p + c for p, c in zip(prompts, out["completion_ids"], strict=True)]
    scored = client.get_sequence_logprobs(seqs, [len(p) for p in prompts], top_logprobs=0)
    for got, want in zip(scored["actual_logprobs"], out["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-5, rtol=0)
    assert scored["actual_token_ids"] == out["logprob_token_ids"]


def test_weight_update_session_is_atomic(checkpoint: Path, serve: ServeProcess) -> None:
    """weight_update() + update_named_param: all tensors -> one new version; a missing tensor
    or an exception -> nothing applied, the served version unchanged."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    client = SpecrlVLLMClient(serve.address)
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="lacks 1 tensor"), client.weight_update():
        for name, p in params[:-1]:
            client.update_named_param(name, p.data)
    with pytest.raises(RuntimeError, match="boom"), client.weight_update():
        client.update_named_param(*params[0])
        raise RuntimeError("boom")
    with SidecarClient(serve.address) as direct:
        assert direct.info().weight_version == 0
    with client.weight_update():
        for name, p in reversed(params):  # any tensor order
            client.update_named_param(name, p.data)
    assert client.weight_version == 1
    with SidecarClient(serve.address) as direct:
        assert direct.info().weight_version == 1


def test_draft_aligner_keeps_tau_where_the_stale_draft_decays(checkpoint: Path, tmp_path: Path) -> None:
    """TRL never trains the draft: at lr 1e-2 τ falls towards 1 within ~8 steps. With DraftAligner
    (refit on the latest rollouts after every sync, pushed as DRAFT) it stays up, and rollouts stay
    lossless (the draft never changes the sampled distribution)."""
    steps, late = 8, slice(4, 8)
    taus = {}
    for align in (False, True):
        serve = ServeProcess(checkpoint, speculation_k=2)
        try:
            client = SpecrlVLLMClient(serve.address, SidecarGenerationConfig(seed=0))
            aligner = DraftAligner(checkpoint, DraftAlignConfig(steps=20)) if align else None
            trainer = train(checkpoint, client, tmp_path / str(align), lr=1e-2, steps=steps, draft_aligner=aligner)
            assert all(m <= 1e-5 for m in per_step(trainer, MISMATCH))
            taus[align] = [c.acceptance_length for c in client.counters]
            # Policy pushes at every step; with the aligner a draft push follows each one that had rollouts.
            pushes = steps + (steps - 1 if align else 0)
            assert [r.version for r in client.push_results] == list(range(1, pushes + 1))
        finally:
            serve.stop()
    stale = sum(taus[False][late]) / 4
    aligned = sum(taus[True][late]) / 4
    print(f"\nτ per step, stale draft {taus[False]}\nτ per step, aligned draft {taus[True]}")
    assert aligned > 1.5 and aligned > stale + 0.3, (stale, aligned)


def test_a_lost_draft_is_reported_once_and_the_aligner_refits_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sidecar's draft weights are lost (zeroed, as a sleep/wake that did not restore them
    would): the client warns once (GetStats `draft_collapsed`) however often it generates, and a
    DraftAligner whose next scheduled refit is 10 syncs away refits at the next policy sync and
    pushes the draft, after which the alarm clears. The model: a draft aligned with its target by
    construction, the output head sharpened (on the flat tiny model any draft is accepted half
    the time at temperature 1, a zeroed one included)."""
    import logging

    from sidecar.model.checkpoint import model_state_dict, save_checkpoint
    from sidecar.model.model import ModelConfig
    from tests.sidecar.engine_fixtures import aligned_draft_model

    config = ModelConfig.tiny(vocab_size=256)
    aligned = aligned_draft_model(config, seed=3)
    with torch.no_grad():
        aligned.output_weight().mul_(10.0)
    save_checkpoint(tmp_path / "aligned", config, model_state_dict(aligned))
    serve = ServeProcess(tmp_path / "aligned", speculation_k=2)
    caplog.set_level(logging.WARNING)
    try:
        client = SpecrlVLLMClient(serve.address, SidecarGenerationConfig(seed=0))
        prompts = [[1 + i, (7 * i) % 256, (3 * i + 5) % 256] for i in range(48)]

        def generate() -> None:
            client.generate(prompts, max_tokens=32, temperature=1.0, generation_kwargs={"ignore_eos": True})

        generate()  # version 0: the checkpoint's working draft
        assert client.draft_collapse is None
        with SidecarClient(serve.address) as direct:
            specs, _ = direct.describe_weights(WeightSelector.DRAFT)
            zeros = {s.name: torch.zeros(s.shape) for s in specs}
            direct.push_weights(zeros, version=1, selector=WeightSelector.DRAFT)
        for _ in range(3):
            generate()
        assert client.draft_collapse is not None and client.draft_collapse.weight_version == 1
        warned = [r for r in caplog.records if r.name == "sidecar.client.draft_alarm"]
        assert len(warned) == 1 and "weight version 1" in warned[0].getMessage()

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "aligned", dtype=torch.float32)
        aligner = DraftAligner(tmp_path / "aligned", DraftAlignConfig(every=10, steps=5))
        aligner.bind(model)
        client.draft_aligner = aligner
        client._version = 1  # the direct push above moved the served version past the client's
        client.update_model_params(model)  # policy sync (version 2); the alarm makes the refit due now
        assert [r.version for r in client.push_results] == [2, 3]  # the draft followed at once
        generate()
        assert client.draft_collapse is None
    finally:
        serve.stop()
