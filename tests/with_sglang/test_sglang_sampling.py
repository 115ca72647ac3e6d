"""SGLang at temperature > 0, and SGLang's side of a failed weight push (the stale-draft proof).

Losslessness. The chi-square harness the embedded engine passes (tests/sidecar/engine/
test_speculative_distribution.py: the exact joint law of the first three tokens of a V = 8 model
with a partly aligned draft, enumerated through the plain forward and Hugging Face's warpers)
is run against SGLang:

- plain sampling (no speculation), through `specrl serve --engine sglang` over gRPC: it must
  follow the exact distribution (and greedy output must equal the embedded engine's). Top-k and
  top-p TOGETHER are refused on CPU: SGLang's PyTorch sampler (``sampler.py``,
  ``top_k_top_p_min_p_sampling_from_probs_torch``) applies top-p to the mass before top-k
  renormalisation, specrl's definition (Hugging Face's warpers) after it; the harness showed
  continuations of probability 0 under specrl's law (top-k 5 + top-p 0.85 at T = 0.8);
- SGLang's speculative sampling on the path this machine runs. On CPU SGLang 0.5.23 verifies
  drafts GREEDILY whatever the temperature (``eagle_utils._verify_uses_greedy`` returns True
  for ``is_cpu``): every token after a verify step is the target's argmax. The harness detects
  this (p < 1e-4), which is why `SGLangEngine` refuses temperature > 0 with speculation on CPU
  (test_serve.py). On a GPU the same test instead requires SGLang's sampling verification to
  pass — not run here (no GPU in this project's sessions so far).

The stale-draft proof (`SGLangEngine._prove_draft_changed`) runs in-process on the same
speculative engine: a push whose draft names SGLang skips must fail, leave SGLang paused and
refusing work, and a correct push must clear it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.engine.sglang import SGLangEngine, SGLangEngineError, StaleDraftError, names
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector

# the harness itself: one piece of code for both engines
from tests.sidecar.engine.test_speculative_distribution import PROMPT, V, chi_square_pvalue, exact_joint
from tests.sidecar.engine_fixtures import aligned_draft_model
from tests.with_sglang.served import DEVICE, END_TO_END, specrl_serve, start_sglang_engine

pytestmark = END_TO_END

N = 2000
ALPHA = 1e-3
K = 2
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=3)
TOP_K = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=3)
TOP_P = SamplingParams(temperature=0.8, top_p=0.85, max_new_tokens=3)
CONFIG = ModelConfig.tiny(vocab_size=V, head_dim=64, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def model() -> Qwen3WithMTP:
    return aligned_draft_model(CONFIG, seed=11, eps=0.1)


@pytest.fixture(scope="module")
def ckpt(model: Qwen3WithMTP, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sglang-sampling") / "ckpt"
    save_checkpoint(path, CONFIG, model_state_dict(model))
    return path


def cells(token_ids: list[list[int]]) -> torch.Tensor:  # (V**3,) counts of (t1, t2, t3)
    idx = torch.tensor([(t[0] * V + t[1]) * V + t[2] for t in token_ids])
    return torch.bincount(idx, minlength=V**3).double()


# ---- plain sampling over gRPC ----------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> Iterator[SidecarClient]:
    with specrl_serve(ckpt, speculation_k=0) as address, SidecarClient(address) as c:
        yield c


@pytest.mark.skipif(DEVICE != "cpu", reason="concerns SGLang's PyTorch sampler (the CPU default)")
def test_top_k_with_top_p_is_refused_on_cpu(plain: SidecarClient) -> None:
    sp = SamplingParams(temperature=0.8, top_k=5, top_p=0.85, max_new_tokens=3)
    with pytest.raises(SidecarCallError, match="top-p to the probabilities before top-k"):
        plain.generate(GenerationRequest(prompts=[PROMPT], sampling=sp))


def test_greedy_without_speculation_equals_the_embedded_engine(plain: SidecarClient, model: Qwen3WithMTP) -> None:
    prompts = [PROMPT, [1], [2, 3, 4, 5, 6, 7, 0, 1, 2]]
    request = GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=16))
    want = [s.token_ids for s in TorchEngine(model, speculation_k=0).generate(request)]
    got = plain.generate(GenerationRequest(prompts=prompts, sampling=request.sampling))
    assert [s.token_ids for s in got] == want
    assert all(s.counters.drafted_tokens == 0 for s in got)


@pytest.mark.parametrize("sp", [SAMPLING, TOP_K, TOP_P], ids=["T=1", "T=0.8,top-k 5", "T=0.8,top-p 0.85"])
def test_plain_sampling_follows_the_exact_distribution(
    plain: SidecarClient, model: Qwen3WithMTP, sp: SamplingParams
) -> None:
    samples = plain.generate(GenerationRequest(prompts=[PROMPT], sampling=sp, samples_per_prompt=N), timeout_s=600)
    assert chi_square_pvalue(cells([s.token_ids for s in samples]), exact_joint(model, sp)) > ALPHA


# ---- SGLang's speculative engine in-process ------------------------------------------------------


@pytest.fixture(scope="module")
def speculative(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    engine = start_sglang_engine(ckpt, tmp_path_factory.mktemp("sglang-dirs"), speculation_k=K, max_running_requests=64)
    yield engine
    engine.close()


def raw_samples(engine: SGLangEngine, sp: SamplingParams, n: int) -> list[dict[str, Any]]:
    """n SGLang outputs for PROMPT with speculation, straight from SGLang (past the adapter's refusal)."""
    from sidecar.engine.sglang.backend import sampling_params_dict

    backend = engine._backend
    params = sampling_params_dict(sp, prompt_index=0, sample_index=0)
    tasks = [backend.start_generate(f"chi2-{id(sp)}-{i}", list(PROMPT), params) for i in range(n)]
    backend.wait_all(tasks, 600.0)
    return [t.result() for t in tasks]


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU SGLang verifies by sampling; see the GPU test below")
def test_cpu_speculative_sampling_is_greedy_verification_not_lossless(
    speculative: SGLangEngine, model: Qwen3WithMTP
) -> None:
    outs = raw_samples(speculative, SAMPLING, N // 2)
    assert sum(int(o["meta_info"].get("spec_verify_ct", 0) or 0) for o in outs) > 0  # drafts were verified
    p = chi_square_pvalue(cells([o["output_ids"] for o in outs]), exact_joint(model, SAMPLING))
    # the Monte Carlo p-value cannot go below ~1e-5 (its replicates); 1e-4 is ten times below the harness's α
    assert p < 1e-4, f"SGLang's CPU speculative sampling now passes (p={p}): lift the refusal in SGLangEngine"
    # ...because every verified token is the target's argmax given its prefix
    greedy_next = TorchEngine(model, speculation_k=0)
    first_two = {tuple(o["output_ids"][:1]) for o in outs}
    for prefix in first_two:
        want = greedy_next.generate(
            GenerationRequest(
                prompts=[PROMPT + list(prefix)], sampling=SamplingParams(temperature=0.0, max_new_tokens=2)
            )
        )[0].token_ids
        got = {tuple(o["output_ids"][1:3]) for o in outs if tuple(o["output_ids"][:1]) == prefix}
        assert got == {tuple(want)}, (prefix, got, want)


@pytest.mark.skipif(DEVICE == "cpu", reason="needs SGLang's GPU sampling verification kernels")
def test_gpu_speculative_sampling_follows_the_exact_distribution(
    speculative: SGLangEngine, model: Qwen3WithMTP
) -> None:
    outs = raw_samples(speculative, SAMPLING, N)
    assert chi_square_pvalue(cells([o["output_ids"] for o in outs]), exact_joint(model, SAMPLING)) > ALPHA


def test_stale_draft_proof_fires_and_leaves_sglang_paused(
    speculative: SGLangEngine, model: Qwen3WithMTP, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = speculative
    greedy = GenerationRequest(prompts=[PROMPT], sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
    before = [s.token_ids for s in eng.generate(greedy)]
    version = eng.weight_version

    # A broken export: dense MLP names sent to SGLang's MoE draft shim, which skips them silently.
    real = names.draft_names

    def dense_mlp_names(name: str, *, num_experts: int) -> list[str]:
        return ["mtp.layers.0." + name.split(".", 3)[3]] if ".mlp." in name else real(name, num_experts=num_experts)

    monkeypatch.setattr(names, "draft_names", dense_mlp_names)
    draft = {n: t * 0.5 for n, t in model_state_dict(build_model(CONFIG, seed=3)).items() if n.startswith("mtp.")}
    with pytest.raises(StaleDraftError, match="gate_up_proj"):  # the skipped MLP parameters are named
        eng.update_weights(draft, WeightSelector.DRAFT, version + 1)
    assert eng.weight_version == version
    with pytest.raises(SGLangEngineError, match="unusable after a failed weight push"):
        eng.generate(greedy)

    # The fixed export: the same push now passes the proof and SGLang serves again.
    monkeypatch.setattr(names, "draft_names", real)
    eng.update_weights(draft, WeightSelector.DRAFT, version + 1)
    assert eng.weight_version == version + 1
    after = eng.generate(greedy)
    assert [s.token_ids for s in after] == before  # the target decides the tokens
    assert after[0].weight_version == version + 1
