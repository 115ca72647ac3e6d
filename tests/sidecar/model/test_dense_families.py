"""Qwen2 and Llama served exactly: the engine against transformers' own forward.

Oracle: transformers' `Qwen2ForCausalLM` and `LlamaForCausalLM` on tiny random checkpoints their
`save_pretrained` writes (no hub downloads), with random q/k/v biases and norms (transformers
initialises biases to zero, which would hide a missing bias). Checked at float32: log-softmax
within 1e-4 at every position, greedy tokens identical to transformers' greedy (batched, ragged,
both compile modes, paged KV), speculation with an EAGLE-3 draft (`draft=`, what `--draft` loads)
lossless, a push (full, then sparse deltas) of new weights biases included serving what
transformers computes with them; and a negative control per family (a dropped q bias, a changed
llama3 factor) that the same comparison catches.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from sidecar.client.client import ClientConfig, SidecarClient
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.eagle3_checkpoint import save_eagle3_draft
from sidecar.model.model import Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams, ScoreRequest
from tests.family_fixtures import CASES, LLAMA3, SHAPE, hf_model
from tests.sidecar.engine_fixtures import aligned_eagle3
from tests.sidecar_fixtures import start_sidecar

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61], [7], [11, 12, 13, 14, 15, 16]]
NEW = 24  # past llama3's original context of 32 for the longest prompt


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for case in CASES:
        path = tmp_path_factory.mktemp(case)
        hf_model(case).save_pretrained(path)
        out[case] = path
    return out


def ours(path: Path) -> Qwen3WithMTP:
    config, tensors = load_checkpoint(path)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    return model


@functools.cache
def hf_greedy(case: str, seed: int = 0) -> list[list[int]]:
    """transformers' greedy decoding: argmax of its full forward, one token at a time."""
    hf, out = hf_model(case, seed), []
    with torch.no_grad():
        for prompt in PROMPTS:
            seq = list(prompt)
            for _ in range(NEW):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(prompt) :])
    return out


def greedy(engine: TorchEngine, k: int = 0) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    return [s.token_ids for s in engine.generate(GenerationRequest(prompts=PROMPTS, sampling=sp, speculation_k=k))]


def hf_log_softmax(case: str, ids: torch.Tensor, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(case, seed)(ids).logits.float().log_softmax(-1)


IDS = torch.randint(0, SHAPE["vocab_size"], (3, 80), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", list(CASES))
def test_log_softmax_at_every_position_equals_transformers(checkpoints: dict[str, Path], case: str) -> None:
    model = ours(checkpoints[case])
    with torch.no_grad():
        got = model(IDS).float().log_softmax(-1)
    torch.testing.assert_close(got, hf_log_softmax(case, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen2-untied", "qwen2-tied"])
def test_a_dropped_q_bias_is_caught_by_the_same_comparison(checkpoints: dict[str, Path], case: str) -> None:
    """Negative control: the comparison above fails for Qwen2 served without its q bias."""
    model = ours(checkpoints[case])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.zero_()
        got = model(IDS).float().log_softmax(-1)
    assert (got - hf_log_softmax(case, IDS)).abs().max() > 1e-3


@pytest.mark.parametrize("factor", [4.0, 16.0])
def test_a_changed_llama3_factor_is_caught(checkpoints: dict[str, Path], factor: float) -> None:
    """Negative control: the comparison fails for Llama rotated with another llama3 factor, and the
    checkpoint really is llama3-scaled (the sequences run past its original context of 32)."""
    path = checkpoints["llama-tied"]
    config, tensors = load_checkpoint(path)
    assert config.rope_config().rope_type == "llama3" and IDS.shape[1] > LLAMA3["original_max_position_embeddings"]
    other = dataclasses.replace(config, rope_scaling={**(config.rope_scaling or {}), "factor": factor})
    model = build_model(other)
    model.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        got = model(IDS).float().log_softmax(-1)
    assert (got - hf_log_softmax("llama-tied", IDS)).abs().max() > 1e-3


@pytest.mark.parametrize("compile", ["off", "on"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers_greedy(checkpoints: dict[str, Path], case: str, compile: str) -> None:
    """Ragged prompts in one batch, paged KV in small blocks (a row spans several)."""
    engine = TorchEngine.from_checkpoint(checkpoints[case], compile=compile, max_batch_size=8, kv_block_size=8)
    samples = engine.generate(
        GenerationRequest(prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW))
    )
    assert [s.token_ids for s in samples] == hf_greedy(case)
    for prompt, s in zip(PROMPTS, samples, strict=True):  # the reported log-probs are transformers'
        ids = torch.tensor([prompt + s.token_ids])
        want = hf_log_softmax(case, ids)[0, len(prompt) - 1 : -1].gather(-1, torch.tensor(s.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(s.logprobs), want[:, 0], atol=1e-4, rtol=0)
    assert engine.info().model.family == case.split("-")[0]


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_with_an_eagle3_draft_equals_transformers_greedy(
    checkpoints: dict[str, Path], case: str, tmp_path: Path
) -> None:
    save_eagle3_draft(tmp_path / "draft", aligned_eagle3(ours(checkpoints[case])))
    engine = TorchEngine.from_checkpoint(checkpoints[case], draft=tmp_path / "draft", speculation_k=3)
    assert greedy(engine, 3) == hf_greedy(case)
    assert engine.stats()[0].counters.drafted_tokens > 0  # it speculated


def test_pushes_and_sparse_deltas_of_biases_serve_what_transformers_computes(checkpoints: dict[str, Path]) -> None:
    """A push of another model's weights (every bias new): the sidecar's greedy output is
    transformers' with them. Then sparse deltas that change only q and k biases: the sidecar's
    log-probs (Score) are transformers' with those weights, within 1e-4 at every position."""
    case = "qwen2-untied"
    hf = hf_model(case, seed=1)
    state = {n: p.detach().clone() for n, p in hf.named_parameters()}
    dense = sum(t.numel() * t.element_size() for t in state.values())
    sequences = [p + [3] * 20 for p in PROMPTS]
    with (
        start_sidecar(checkpoints[case], speculation_k=0) as sc,
        SidecarClient(sc.address, ClientConfig(timeout_s=30.0, sparse_deltas=True)) as c,
    ):
        request = GenerationRequest(prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW))
        assert hf_greedy(case, 1) != hf_greedy(case, 0)  # the test can fail
        c.push_weights(state, version=1)
        assert [s.token_ids for s in c.generate(request)] == hf_greedy(case, 1)
        gen = torch.Generator().manual_seed(7)
        for version in (2, 3):
            before = [token_logprobs(hf, q) for q in sequences]
            for name, t in state.items():
                if name.endswith(("q_proj.bias", "k_proj.bias")):
                    t[::5] += torch.randn(t[::5].shape, generator=gen)
            result = c.push_weights(state, version=version)
            assert result.bytes_received * 10 < dense  # a sparse delta, not the whole model
            hf = transformers.Qwen2ForCausalLM(hf.config).eval()
            hf.load_state_dict(state)
            scored = c.score(ScoreRequest(sequences=sequences, start_indices=[1] * len(sequences)))
            for q, got, old in zip(sequences, scored.logprobs, before, strict=True):
                want = token_logprobs(hf, q)
                torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)
                assert (old - want).abs().max() > 1e-3  # the delta changed the distribution


def token_logprobs(hf: Any, seq: list[int]) -> torch.Tensor:  # (len(seq) - 1,) log p(seq[t] | seq[:t]), t >= 1
    with torch.no_grad():
        lp = hf(torch.tensor([seq])).logits.float().log_softmax(-1)[0, :-1]
    return lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
