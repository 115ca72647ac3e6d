"""The trainer's Megatron policy of Qwen2 and Llama computes transformers' log-probs, and the
sidecar's after an export → push (DESIGN invariant 2, for every family).

Oracle: transformers' `Qwen2ForCausalLM` / `LlamaForCausalLM` on the checkpoints their
`save_pretrained` writes (`tests/family_fixtures.py`: random q/k/v biases and norms; Llama with
llama3 scaling, the sequences past its original context). The sidecar starts from another
checkpoint of the same shape, so only the push can make its log-probs the trainer's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sidecar.client.client import SidecarClient
from sidecar.model.checkpoint import load_checkpoint
from sidecar.types import ScoreRequest
from tests.family_fixtures import CASES, SHAPE, hf_model
from tests.sidecar_fixtures import start_sidecar
from trainer.policy.policy import Policy

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SEQ = 60  # past llama3's original context (32); within the test sidecar's prompt limit (64)


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainers_logprobs_are_transformers_and_the_sidecars_after_export_and_push(
    tmp_path: Path, case: str
) -> None:
    hf_model(case).save_pretrained(tmp_path / "model")
    hf_model(case, seed=1).save_pretrained(tmp_path / "other")
    config, tensors = load_checkpoint(tmp_path / "model")
    policy = Policy(config, Policy.Config(), tensors)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))

    got = policy.logprobs(tokens)  # (2, SEQ - 1)
    with torch.no_grad():
        logits = hf_model(case)(tokens).logits.float()
    want = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    exported = dict(policy.export_named_tensors())
    assert exported.keys() == tensors.keys()  # the checkpoint's names, biases included
    request = ScoreRequest(sequences=tokens.tolist(), start_indices=[1, 1])
    with start_sidecar(tmp_path / "other", speculation_k=0) as sc, SidecarClient(sc.address) as c:
        before = torch.tensor(c.score(request).logprobs)
        assert (before - got).abs().max() > 1e-2  # the test can fail: another model before the push
        c.push_weights(exported, version=1)
        served = torch.tensor(c.score(request).logprobs)
    torch.testing.assert_close(served, got, rtol=0, atol=1e-4)


def test_the_trainer_trains_mimos_draft_in_its_layout_and_pushes_keep_its_names(tmp_path: Path) -> None:
    """A MiMo checkpoint (`tests/sidecar/model/test_mimo.py`'s, written as the published one is): the
    policy's log-probs are transformers' Qwen2's, its draft is the engine's (`model.mtp_layers.*`),
    a training step moves the draft, and the push of its export, in the checkpoint's names, serves
    plain greedy at k = 3 with the trained draft."""
    from sidecar.model.model import build_model
    from sidecar.types import GenerationRequest, SamplingParams
    from tests.sidecar.model.test_mimo import mimo, write_mimo_checkpoint
    from trainer.policy.policy import TrainBatch

    path = write_mimo_checkpoint(tmp_path / "mimo")
    config, tensors = load_checkpoint(path)
    policy = Policy(config, Policy.Config(), tensors)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = mimo()[0](tokens).logits.float()
        engine = build_model(config)
        engine.load_state_dict(tensors, strict=True)
        want_draft = engine.mtp_logits(tokens, engine.hidden_states(tokens))
    want = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(policy.logprobs(tokens), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(policy.draft_logits(tokens), want_draft, rtol=0, atol=1e-4)
    assert sorted(policy.export_names()) == sorted(tensors)  # the checkpoint's own names

    mask = torch.ones(2, 39)
    policy.train_step(TrainBatch(tokens=tokens, mask=mask, advantages=torch.tensor([1.0, -1.0])))
    exported = dict(policy.export_named_tensors())
    moved = [n for n in exported if n.startswith("model.mtp_layers.") and not torch.equal(exported[n], tensors[n])]
    assert moved  # the draft trained, in MiMo's layout
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7]]
    with start_sidecar(path, speculation_k=3) as sc, SidecarClient(sc.address) as c:
        c.push_weights(exported, version=1)
        plain = [s.token_ids for s in c.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=0))]
        spec = c.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=3))
    assert [s.token_ids for s in spec] == plain and sum(s.counters.verify_steps for s in spec) > 0
