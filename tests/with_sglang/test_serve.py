"""`specrl serve --engine sglang` end to end over gRPC: SGLang really generates, speculates and
takes weight pushes (CPU in CI-like machines, the same on a GPU).

Oracle: specrl's embedded `TorchEngine` without speculation on the same weights (itself tested
against plain full-forward greedy decoding), float32 so both sides compute the same numbers.
One sidecar per module (SGLang's start-up costs tens of seconds on a 2-core machine), driven
through `SidecarClient` like the trainer drives it. Tests run in file order: the push tests come
last and leave the sidecar serving other weights.

On a machine without CUDA this runs SGLang's CPU engine with the accommodations of
``tests/sglang_cpu_support/`` (reference attention and speculative ops).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import build_model
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.sidecar.engine_fixtures import aligned_draft_model
from tests.with_sglang.served import DEVICE, END_TO_END, small_config, specrl_serve

pytestmark = END_TO_END

K = 3
NEW = 24
PROMPTS = [[1, 2, 3, 4], [17], [100, 101, 102, 103, 104, 105, 106], [250, 7]]
CONFIG = small_config("float32")


def greedy(prompts: list[list[int]] = PROMPTS) -> GenerationRequest:
    return GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW))


def oracle(state: dict[str, torch.Tensor]) -> list[list[int]]:
    """Greedy continuations of PROMPTS by the embedded engine (no speculation) on `state`."""
    model = build_model(CONFIG).to(DEVICE)
    model.load_state_dict(state, strict=True)
    engine = TorchEngine(model, speculation_k=0)
    return [s.token_ids for s in engine.generate(greedy())]


def weights(seed: int) -> dict[str, torch.Tensor]:
    """A policy whose MTP draft is aligned with its target (high acceptance)."""
    return {n: t.clone() for n, t in model_state_dict(aligned_draft_model(CONFIG, seed=seed)).items()}


def part(state: dict[str, torch.Tensor], draft: bool) -> dict[str, torch.Tensor]:
    return {n: t for n, t in state.items() if n.startswith("mtp.") == draft}


def mean_tau(samples: list) -> float:
    return sum(s.counters.acceptance_length for s in samples) / len(samples)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sglang-serve") / "ckpt"
    save_checkpoint(path, CONFIG, weights(5))
    return path


@pytest.fixture(scope="module")
def client(ckpt: Path) -> Iterator[SidecarClient]:
    with specrl_serve(ckpt, speculation_k=K) as address, SidecarClient(address) as c:
        yield c


def test_info_says_sglang_on_this_device(client: SidecarClient) -> None:
    info = client.info()
    assert info.engine.engine == "sglang" and info.engine.engine_version == "0.5.23"
    assert info.engine.device_kind == DEVICE and info.engine.speculation_k == K
    assert info.engine.model.dtype == "float32" and info.weight_version == 0


def test_greedy_output_equals_the_embedded_engine(client: SidecarClient) -> None:
    got = client.generate(greedy())
    assert [s.token_ids for s in got] == oracle(weights(5))
    assert all(s.weight_version == 0 and len(s.logprobs) == NEW for s in got)


def test_aligned_draft_is_accepted(client: SidecarClient) -> None:
    samples = client.generate(greedy())
    for s in samples:
        assert s.counters.drafted_tokens > 0
        assert s.counters.drafted_per_position == [s.counters.verify_steps - 1] * K  # minus the prefill step
    assert mean_tau(samples) > 2.0, [s.counters for s in samples]


@pytest.mark.skipif(DEVICE != "cpu", reason="the refusal concerns SGLang's CPU verify path")
def test_sampling_with_speculation_is_refused_on_cpu(client: SidecarClient) -> None:
    """SGLang 0.5.23 verifies greedily on CPU, so T > 0 would not be lossless (test_sglang_sampling.py)."""
    request = GenerationRequest(prompts=[[1, 2]], sampling=SamplingParams(temperature=0.7, max_new_tokens=4))
    with pytest.raises(SidecarCallError, match="verifies drafts greedily") as err:
        client.generate(request)
    assert err.value.code.name == "INVALID_ARGUMENT"


def test_a_rejected_push_leaves_the_served_model_untouched(client: SidecarClient) -> None:
    before = [s.token_ids for s in client.generate(greedy())]
    bad = weights(9)
    name = "model.layers.0.mlp.up_proj.weight"
    bad[name] = bad[name][:-1]  # wrong shape: refused before SGLang is touched
    with pytest.raises((SidecarCallError, ValueError), match="shape"):
        client.push_weights(bad, 1)
    assert client.info().weight_version == 0
    assert [s.token_ids for s in client.generate(greedy())] == before


def test_pushes_of_target_draft_and_both_change_what_is_served(client: SidecarClient) -> None:
    # target only: the new trunk decides the tokens (the old draft stays aligned: by construction it
    # copies the target's next-token prediction through the target's own embedding and head)
    new = weights(6)
    client.push_weights(part(new, draft=False), 1, WeightSelector.TARGET)
    after_target = client.generate(greedy())
    assert [s.token_ids for s in after_target] == oracle(part(new, draft=False) | part(weights(5), draft=True))
    assert [s.token_ids for s in after_target] != oracle(weights(5))
    assert all(s.weight_version == 1 for s in after_target) and client.info().weight_version == 1

    # draft only: the new policy's own draft — same tokens (the target decides)
    client.push_weights(part(new, draft=True), 2, WeightSelector.DRAFT)
    after_draft = client.generate(greedy())
    assert [s.token_ids for s in after_draft] == [s.token_ids for s in after_target]
    assert mean_tau(after_draft) > 2.0
    assert all(s.weight_version == 2 for s in after_draft)

    # a random draft: tokens unchanged, acceptance collapses — the served draft really changed
    random_draft = part(model_state_dict(build_model(CONFIG, seed=7)), draft=True)
    client.push_weights(random_draft, 3, WeightSelector.DRAFT)
    after_random = client.generate(greedy())
    assert [s.token_ids for s in after_random] == [s.token_ids for s in after_target]
    assert mean_tau(after_random) < mean_tau(after_draft) - 0.5

    # both at once: a new aligned policy
    newer = weights(8)
    result = client.push_weights(newer, 4, WeightSelector.ALL)
    assert result.version == 4 and result.previous_version == 3
    after_all = client.generate(greedy())
    assert [s.token_ids for s in after_all] == oracle(newer)
    assert mean_tau(after_all) > 2.0
    assert all(s.weight_version == 4 for s in after_all)
    stats = client.stats()
    assert stats.weight_version == 4 and {v.weight_version for v in stats.versions} >= {0, 1, 2, 3, 4}
