"""The EAGLE-3 draft kind: its cached engine path against uncached forwards, and greedy speculation
with it against plain decoding.

Oracles: the draft's whole-sequence forward (`Eagle3Draft.forward` over the plain target's taps,
no KV cache: the path a trainer uses) for the engine's refreshed draft distribution, a plain
uncached run of the draft layer for a chained step, and a naive greedy loop over the target's
plain full forward for speculative greedy output (k = 1..3, ragged batches, an aligned, a random
and a reduced-vocabulary draft).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sidecar.engine.attention_lengths import HostLengths
from sidecar.engine.drafters import Drafter, Eagle3Drafter
from sidecar.engine.sampling import RowSampling
from sidecar.engine.speculative import DraftInput, draft
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.eagle3 import Eagle3Config, Eagle3Draft, build_eagle3, default_aux_layers, target_taps
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.engine.test_speculative_greedy import naive_greedy
from tests.sidecar.engine_fixtures import TAPS, aligned_eagle3, eagle3_target

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [40, 41]]
NEW = 20
N = 12  # tokens of the sequence the draft-path tests read
REDUCED = sorted({*range(0, 64, 2), 1, 3, 5})  # 35 of the 64 target ids


@pytest.fixture(scope="module")
def target() -> Qwen3WithMTP:
    return eagle3_target()


@pytest.fixture(scope="module")
def drafts(target: Qwen3WithMTP) -> dict[str, Eagle3Draft]:
    shaped = Eagle3Config.for_target(target.config, num_key_value_heads=1, head_dim=8, aux_layer_ids=TAPS)
    random = build_eagle3(shaped, seed=3)
    reduced = build_eagle3(
        Eagle3Config.for_target(target.config, draft_vocab_size=len(REDUCED), aux_layer_ids=TAPS), seed=4
    )
    reduced.set_draft_vocab(torch.tensor(REDUCED))
    return {
        "aligned": aligned_eagle3(target),
        "random": random,
        "reduced": reduced,
        "aligned-reduced": aligned_eagle3(target, REDUCED),
    }


def run(
    engine: TorchEngine, k: int, prompts: list[list[int]] = PROMPTS, new: int = NEW
) -> tuple[list[list[int]], float]:
    """Every prompt as its own request, all in one batch; outputs and the acceptance rate."""
    for i, p in enumerate(prompts):
        engine.submit(
            GenerationRequest(
                prompts=[p],
                sampling=SamplingParams(temperature=0.0, max_new_tokens=new),
                speculation_k=k,
                request_id=f"r{i}",
            )
        )
    out: dict[str, list[int]] = {}
    for _ in range(10 * new):
        out |= {s.request_id: s.token_ids for s in engine.step()}
        if not engine.has_work():
            break
    return [out[f"r{i}"] for i in range(len(prompts))], engine.stats()[-1].counters.acceptance_rate


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["aligned", "random", "reduced", "aligned-reduced"])
def test_greedy_speculation_with_an_eagle3_draft_equals_plain_decoding(
    target: Qwen3WithMTP, drafts: dict[str, Eagle3Draft], kind: str
) -> None:
    oracle = [naive_greedy(target, p, NEW) for p in PROMPTS]
    assert run(TorchEngine(target, speculation_k=0), 0)[0] == oracle
    for k in (1, 2, 3):
        engine = TorchEngine(target, speculation_k=k, draft=drafts[kind])
        out, acceptance = run(engine, k)
        assert out == oracle, (kind, k)
        if kind == "aligned":
            assert acceptance > 0.6  # long accepted runs and bonus tokens were exercised
        if kind == "random":
            assert acceptance < 0.3  # mostly rejections: rollback of the draft and target caches


def plain_layer(
    draft: Eagle3Draft, hidden: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:  # (1, T, h)
    """The draft layer over entries (states (1, T, h), tokens (1, T)) at rotary `positions` (T,), no cache."""
    cos, sin = draft._rotary[0](positions[None])
    layer = draft.midlayer
    x = layer.attention_input(F.embedding(tokens, embed), hidden)
    return layer.finish(hidden, layer.self_attn(x, cos, sin))


@pytest.mark.parametrize(("cached", "window"), [(0, N - 1), (6, 5), (3, 2)])
@torch.inference_mode()
def test_the_engine_draft_path_equals_the_uncached_forwards(
    target: Qwen3WithMTP, drafts: dict[str, Eagle3Draft], cached: int, window: int
) -> None:
    """q_1 after a refresh (following `cached` prefilled positions; a gap in the draft's cache when
    cached + window < N - 1) and q_2 of the chain, against plain runs of the draft layer over the
    entries the cache holds, and q_1 against the whole-sequence forward when there is no gap."""
    d = drafts["reduced"]
    drafter = Eagle3Drafter(target, d)
    ids = torch.randint(0, 64, (1, N), generator=torch.Generator().manual_seed(7))
    cache = drafter.target_cache(1, N + 4)
    _, states = drafter.target_step(ids, cache, cache.plan([N], width=N))  # (1, N, h) fused taps
    dcache = drafter.new_cache(1, N + 8)
    if cached:
        drafter.prefill([dcache], ids[:, : cached + 1], states[:, : cached + 1], [cached])
    t = torch.arange(N - 1 - window, N - 1)
    out = draft(
        drafter,
        [dcache],
        DraftInput(
            refresh_tokens=ids[:, t + 1],
            refresh_hidden=states[:, t],
            num_refresh=torch.tensor([window]),
            refresh_positions=t[None],
            next_position=torch.tensor([N - 1]),
            num_draft=torch.tensor([2]),
            uniforms=torch.tensor([[0.3, 0.6]]),
        ),
        RowSampling.of([SamplingParams(temperature=1.0)]),
        HostLengths(num_refresh=[window], num_new=[]),
    )
    assert dcache.lengths == [cached + window]  # the refresh stays cached, the chain does not
    embed = target.model.embed_tokens.weight
    seen = torch.tensor([*range(cached), *t.tolist()])  # the entries the draft attends to
    taps = target_taps(target, ids, drafter.taps)  # the plain forward's
    fused = d.fuse(taps)[:, seen]
    torch.testing.assert_close(states[:, seen], fused, atol=1e-5, rtol=1e-5)
    g = plain_layer(d, fused, ids[:, seen + 1], embed, seen + 1)
    q1 = d.target_logits(g[0, -1]).softmax(-1)
    torch.testing.assert_close(out.probs[0, 0], q1, atol=1e-5, rtol=1e-4)
    if cached + window == N - 1:  # no gap: the trainer's teacher-forced forward gives the same q_1
        full = d(taps, ids, embed)[0, -1].softmax(-1)  # (draft_vocab,)
        torch.testing.assert_close(out.probs[0, 0], torch.zeros(64).index_copy(0, torch.tensor(REDUCED), full))
    outside = [i for i in range(64) if i not in REDUCED]
    assert float(out.probs[0, :, outside].sum()) == 0.0 and set(out.tokens[0].tolist()) <= set(REDUCED)
    # the chain: entry n - 1 reads the previous output and the drafted token, at rotary position N
    hidden = torch.cat([fused, g[:, -1:]], dim=1)
    tokens = torch.cat([ids[:, seen + 1], out.tokens[:, :1]], dim=1)
    q2 = d.target_logits(plain_layer(d, hidden, tokens, embed, torch.cat([seen + 1, torch.tensor([N])]))[0, -1])
    torch.testing.assert_close(out.probs[0, 1], q2.softmax(-1), atol=1e-5, rtol=1e-4)


def test_the_taps_default_to_the_loaders_layers_and_config_checks_name_the_field() -> None:
    assert default_aux_layers(36) == (2, 18, 33)  # Qwen3-8B: SGLang's / vLLM's default
    cfg = ModelConfig.tiny(num_hidden_layers=4, num_nextn_predict_layers=0)
    assert Eagle3Config.for_target(cfg).aux_layers(7) == (2, 3, 4)
    assert Eagle3Config.for_target(cfg, aux_layer_ids=TAPS).aux_layers(4) == (1, 2, 3)
    for taps in ([1, 2, 4], [2, 1, 3], [1, 1, 2], [0, 1, 2]):  # past the end, not ascending, repeated, layer 0
        with pytest.raises(ValueError, match="aux_layer_ids"):
            Eagle3Config.for_target(cfg, aux_layer_ids=taps).aux_layers(4)
    with pytest.raises(ValueError, match="default taps"):
        Eagle3Config.for_target(cfg).aux_layers(4)  # (2, 2, 1): SGLang would capture two states
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.for_target(cfg, draft_vocab_size=65)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Eagle3Config.for_target(cfg, num_key_value_heads=3)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):  # llama3 needs all four values
        Eagle3Config.for_target(cfg, rope_scaling=llama3)
    llama3["original_max_position_embeddings"] = 64  # a Llama 3.1 target's draft rotates as its target does
    assert Eagle3Config.for_target(cfg, rope_scaling=llama3).rope_config().rope_type == "llama3"
    with pytest.raises(ValueError, match="does not understand"):
        Eagle3Config.for_target(cfg, rope_scaling=llama3 | {"beta_fast": 32.0})
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        Eagle3Config.for_target(cfg, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="hidden_size"):
        Eagle3Config.for_target(cfg, hidden_size=32).check_target(cfg)
    draft = build_eagle3(Eagle3Config.for_target(cfg, draft_vocab_size=4))
    with pytest.raises(ValueError, match="distinct ascending"):
        draft.set_draft_vocab(torch.tensor([0, 2, 2, 5]))


def test_a_draft_is_refused_beside_mtp_layers_and_an_engine_reports_its_draft_kind(
    target: Qwen3WithMTP, drafts: dict[str, Eagle3Draft]
) -> None:
    mtp = build_model(ModelConfig.tiny(num_hidden_layers=4), seed=0)
    with pytest.raises(ValueError, match="one draft kind"):
        TorchEngine(mtp, draft=drafts["aligned"])
    assert TorchEngine(mtp).info().speculation_method == Drafter(mtp).name == "mtp"
    info = TorchEngine(target, draft=drafts["aligned"]).info()
    assert (info.speculation_method, info.model.num_mtp_layers) == ("eagle3", 0)
    plain = TorchEngine(target)
    assert plain.info().speculation_method == "" and plain.speculation_k == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_eagle3_draft_on_cuda_matches_cpu_greedy_and_acceptance(
    target: Qwen3WithMTP, drafts: dict[str, Eagle3Draft]
) -> None:
    cuda_target = build_model(target.config, device="cuda")
    cuda_target.load_state_dict(target.state_dict())
    cuda_draft = build_eagle3(drafts["aligned-reduced"].config, device="cuda")
    cuda_draft.load_state_dict(drafts["aligned-reduced"].state_dict())
    cpu = run(TorchEngine(target, speculation_k=3, draft=drafts["aligned-reduced"]), 3)
    gpu_engine = TorchEngine(cuda_target, speculation_k=3, draft=cuda_draft)
    assert gpu_engine.info().device_kind == "cuda"
    gpu = run(gpu_engine, 3)
    assert gpu[0] == cpu[0] == [naive_greedy(target, p, NEW) for p in PROMPTS]
    assert gpu[1] == pytest.approx(cpu[1], abs=0.05)  # the same drafts, up to rounding near ties
