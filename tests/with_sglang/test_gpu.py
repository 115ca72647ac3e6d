"""SGLang end to end on a GPU: a real ``sglang.Engine`` serving a small specrl model.

Skipped without CUDA (and without SGLang). Shows, for the same weights:
1. greedy output equals the embedded TorchEngine's (oracle: TorchEngine, itself tested against
   plain full-forward greedy decoding);
2. acceptance length > 1 with an aligned draft (a draft that copies the target's next-token
   prediction by construction, as in tests/engine/conftest.py);
3. a weight push changes the outputs AND the draft: SGLang's draft checksums change, and
   pushing a random draft drops acceptance back towards 1.

The model is specrl's tiny config widened to shapes SGLang's attention kernels accept
(head_dim 64), in bfloat16, saved in the checkpoint contract layout and exported with
`names.write_sglang_checkpoint` (Qwen3ForCausalLM target + Qwen3-MoE MTP shim draft).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sidecar.engine.checkpoint import load_checkpoint, model_state_dict, save_checkpoint
from sidecar.engine.model import ModelConfig, build_model
from sidecar.engine.sglang.engine import SGLangEngine
from sidecar.engine.torch_engine import TorchEngine
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.engine.engine_fixtures import aligned_draft_model

# Runs only where SGLang is installed (tools/test-sglang); elsewhere reported as skipped without
# importing SGLang (the modules import it only inside fixtures). A namespace package is not
# SGLang: with tests/ on sys.path a directory named "sglang" would look like one. The aligned
# draft comes from tests/engine/engine_fixtures.py, shared with the embedded engine's tests.
_SGLANG = importlib.util.find_spec("sglang")
HAVE_SGLANG = _SGLANG is not None and _SGLANG.origin is not None
NEEDS_SGLANG = pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed here; run tools/test-sglang")
pytestmark = [
    NEEDS_SGLANG,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and SGLang): run tools/test-sglang on a GPU"),
]

K = 3
NEW = 32
PROMPTS = [[1, 2, 3, 4], [17], [100, 101, 102, 103, 104, 105, 106], [250, 7]]


def small_config() -> ModelConfig:
    return ModelConfig.tiny(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        torch_dtype="bfloat16",
        num_nextn_predict_layers=1,
    )


def greedy(prompts: list[list[int]]) -> GenerationRequest:
    return GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sglang-gpu") / "ckpt"
    config = small_config()
    save_checkpoint(path, config, model_state_dict(aligned_draft_model(config, seed=5)))
    return path


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Iterator[SGLangEngine]:
    eng = SGLangEngine.from_checkpoint(
        ckpt,
        speculation_k=K,
        max_batch_size=8,
        mem_fraction_static=0.3,
        disable_cuda_graph=True,
        extra_server_args={"attention_backend": "triton"},
    )
    yield eng
    eng.close()


def test_greedy_equals_the_torch_engine(ckpt: Path, engine: SGLangEngine) -> None:
    ours = TorchEngine.from_checkpoint(ckpt, device="cuda", speculation_k=0)
    want = [s.token_ids for s in ours.generate(greedy(PROMPTS))]
    got = [s.token_ids for s in engine.generate(greedy(PROMPTS))]
    assert got == want


def test_aligned_draft_is_accepted(engine: SGLangEngine) -> None:
    samples = engine.generate(greedy(PROMPTS))
    for s in samples:
        assert s.counters.drafted_tokens > 0
        assert s.counters.acceptance_length > 1.5, s.counters
        assert s.counters.drafted_per_position == [s.counters.verify_steps - 1] * K


def test_push_changes_outputs_and_draft(ckpt: Path, engine: SGLangEngine) -> None:
    eng = engine
    config, _ = load_checkpoint(ckpt)
    before_out = [s.token_ids for s in eng.generate(greedy(PROMPTS))]
    before_draft = eng._backend.draft_checksums()

    # a new policy (a different aligned model) with its matching draft: outputs change
    new = model_state_dict(aligned_draft_model(config, seed=6))
    eng.update_weights(new, WeightSelector.ALL, 1)
    after = eng.generate(greedy(PROMPTS))
    assert [s.token_ids for s in after] != before_out
    assert all(s.weight_version == 1 for s in after)
    assert eng._backend.draft_checksums() != before_draft
    tau_aligned = sum(s.counters.acceptance_length for s in after) / len(after)

    # a random draft (target unchanged): the served draft really changed, so acceptance drops
    rand = model_state_dict(build_model(config, seed=7))
    eng.update_weights({n: t for n, t in rand.items() if n.startswith("mtp.")}, WeightSelector.DRAFT, 2)
    rnd = eng.generate(greedy(PROMPTS))
    assert [s.token_ids for s in rnd] == [s.token_ids for s in after]  # lossless: the target decides
    tau_random = sum(s.counters.acceptance_length for s in rnd) / len(rnd)
    assert tau_random < tau_aligned - 0.5, (tau_random, tau_aligned)
