"""A reduced draft vocabulary for the MTP head (`draft_vocab_size`, FR-Spec) against independent oracles.

- the subset: the `size` most frequent ids, ties to the smaller id — hypothesis draws counts, the
  oracle sorts (count, id) pairs in Python;
- the head: the full MTP head's logits (`Qwen3WithMTP.mtp_head`, the whole output weight) at the
  subset's ids, -inf elsewhere — hypothesis draws the subset and the states; re-choosing writes the
  same storages (a captured CUDA graph reads them where they were);
- the cadence: chosen after 1, 2, 4, ... counted tokens, then every RECHOOSE_TOKENS, and at the
  first round after a push, which halves the counts; a push's new output weight is re-gathered;
- greedy generation equals the plain full forward one token at a time (the target decides), on
  the eager and the fixed-shape round, with the subset changing between rounds and across a push;
- sampling: the chi-square harness of `test_speculative_distribution` (the exact joint of three
  tokens by enumeration) with the subset re-chosen every few tokens, eager and fixed-shape, and
  each wrong acceptance rule still rejected (power);
- the fixed-shape phases still trace whole with no host read (what CUDA-graph capture needs);
- the option: validated, and `specrl serve --draft-vocab-size` reaches the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.engine import draft_vocab, speculative
from sidecar.engine.draft_vocab import RECHOOSE_TOKENS, DraftVocab, most_frequent
from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.wrong_rules import WRONG_RULES, with_acceptance_rule
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.sidecar.engine.test_fixed_shape_forwards import (
    TRACE_PROMPTS,
    HostReadCheckingBackend,
    TracedRounds,
    traffic_run,
)
from tests.sidecar.engine.test_speculative_distribution import ALPHA, PROMPT, N, V, chi_square_pvalue, exact_joint
from tests.sidecar.engine.test_static_engine import oracle_greedy
from tests.sidecar.engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [9]]

# ---- the subset and the head ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 5), min_size=2, max_size=40), data=st.data())
def test_the_subset_is_the_most_frequent_ids_ties_to_the_smaller(counts: list[int], data: st.DataObject) -> None:
    size = data.draw(st.integers(1, len(counts) - 1))
    oracle = sorted(sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:size])
    assert most_frequent(torch.tensor(counts), size).tolist() == oracle


@pytest.fixture(scope="module")
def model() -> Qwen3WithMTP:
    return build_model(ModelConfig.tiny(num_hidden_layers=1), seed=7)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data(), rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_the_head_is_the_full_head_on_the_subset_and_minus_infinity_elsewhere(
    model: Qwen3WithMTP, data: st.DataObject, rows: int, seed: int
) -> None:
    v, h = model.config.vocab_size, model.config.hidden_size
    size = data.draw(st.integers(1, v - 1))
    vocab = DraftVocab(size, model.output_weight())
    addresses = (vocab.ids.data_ptr(), vocab.rows.data_ptr())
    counts = data.draw(st.lists(st.integers(0, 3), min_size=v, max_size=v))
    vocab.count(i for i, c in enumerate(counts) for _ in range(c))
    vocab.choose(model.output_weight())
    assert (vocab.ids.data_ptr(), vocab.rows.data_ptr()) == addresses  # changed in place
    out = torch.randn(rows, h, generator=torch.Generator().manual_seed(seed))
    got = vocab.logits(model.mtp_normed(0, out))
    full = model.mtp_head(0, out)  # the oracle: the whole output weight
    inside = torch.zeros(v, dtype=torch.bool)
    inside[most_frequent(torch.tensor(counts), size)] = True
    torch.testing.assert_close(got[:, inside], full[:, inside])
    assert bool((got[:, ~inside] == float("-inf")).all())


def test_the_subset_is_rechosen_after_doubling_counts_and_at_a_push(model: Qwen3WithMTP) -> None:
    weight = model.output_weight()
    vocab = DraftVocab(4, weight)
    assert vocab.ids.tolist() == [0, 1, 2, 3] and not vocab.due()  # deterministic before any count
    chosen_at = []
    for n in range(1, 3 * RECHOOSE_TOKENS + 1):
        vocab.count([n % 7])
        if vocab.due():
            vocab.choose(weight)
            chosen_at.append(n)
    doubling = [2**i for i in range(13) if 2**i <= RECHOOSE_TOKENS]
    assert chosen_at == [*doubling, *range(2 * RECHOOSE_TOKENS, 3 * RECHOOSE_TOKENS + 1, RECHOOSE_TOKENS)]
    before = vocab.counts.clone()
    vocab.on_weight_push()
    assert torch.equal(vocab.counts, before // 2) and not vocab.due()  # nothing new counted yet
    vocab.count([6])
    assert vocab.due()


def test_too_large_a_subset_and_eagle3_are_refused() -> None:
    model = build_model(ModelConfig.tiny(), seed=1)
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[0, 64\]"):
        TorchEngine(model, draft_vocab_size=65)
    assert TorchEngine(model, draft_vocab_size=64).drafter.vocab is None  # the whole vocabulary: full
    target = eagle3_target()
    with pytest.raises(ValueError, match="EAGLE-3 draft's is fixed in its checkpoint"):
        TorchEngine(target, draft=aligned_eagle3(target), draft_vocab_size=16)


# ---- greedy: the target decides ------------------------------------------------------------------


def greedy(engine: TorchEngine, k: int, new: int = 12) -> list[list[int]]:
    req = GenerationRequest(
        prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=new), speculation_k=k
    )
    return [s.token_ids for s in engine.generate(req)]


@pytest.mark.parametrize("compile_mode", ["off", "on"])  # on: the fixed-shape round a GPU captures
@pytest.mark.parametrize("size", [1, 8, 40])
def test_greedy_with_a_reduced_vocabulary_equals_plain_decoding_across_a_push(
    compile_mode: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_vocab, "RECHOOSE_TOKENS", 4)  # the subset changes between rounds
    model = aligned_draft_model(ModelConfig.tiny(), seed=2)
    engine = TorchEngine(model, speculation_k=3, draft_vocab_size=size, compile=compile_mode)
    vocab = engine.drafter.vocab
    assert vocab is not None
    addresses = (vocab.ids.data_ptr(), vocab.rows.data_ptr())
    assert greedy(engine, 3) == [oracle_greedy(model, p, 12) for p in PROMPTS]
    assert vocab.chosen >= 3
    pushed = model_state_dict(aligned_draft_model(ModelConfig.tiny(), seed=3))
    engine.update_weights({n: t.clone() for n, t in pushed.items()}, WeightSelector.ALL, version=1)
    assert greedy(engine, 3) == [oracle_greedy(model, p, 12) for p in PROMPTS]  # the pushed weights'
    torch.testing.assert_close(vocab.rows, model.output_weight()[vocab.ids], rtol=0, atol=0)  # re-gathered
    assert (vocab.ids.data_ptr(), vocab.rows.data_ptr()) == addresses


def test_a_subset_holding_the_policys_tokens_keeps_the_acceptance() -> None:
    """Greedy, a draft token is accepted iff it is the target's argmax; a reduced head's argmax is the
    full head's whenever that is in the subset, and may be the target's where the full one is not.
    So after one pass whose tokens are counted, a second identical pass drafting over the 24 ids
    those passes see (prompts and outputs) accepts at least as much as the full vocabulary (measured:
    3.64 against 3.53 here), while the engine's initial 24 ids (counting switched off) lose most."""
    model = aligned_draft_model(ModelConfig.tiny(), seed=2)

    def second_pass_tau(engine: TorchEngine) -> float:
        greedy(engine, 3, new=40)
        c = engine.stats()[0].counters
        generated, steps = c.generated_tokens, c.verify_steps
        greedy(engine, 3, new=40)
        return (c.generated_tokens - generated) / (c.verify_steps - steps)

    seen = {t for out in greedy(TorchEngine(model, speculation_k=0), 0, new=40) for t in out}
    assert len(seen | {t for p in PROMPTS for t in p}) == 24
    full = second_pass_tau(TorchEngine(model, speculation_k=3))
    reduced = second_pass_tau(TorchEngine(model, speculation_k=3, draft_vocab_size=24))
    frozen = TorchEngine(model, speculation_k=3, draft_vocab_size=24)
    frozen.drafter.observe = lambda tokens: None  # type: ignore[method-assign]
    assert reduced >= full > second_pass_tau(frozen) + 1.0


# ---- temperature > 0: the exact distribution -----------------------------------------------------


@pytest.fixture(scope="module")
def v8_model() -> Qwen3WithMTP:
    return aligned_draft_model(ModelConfig.tiny(vocab_size=V), seed=11, eps=0.1)


def reduced_counts(
    model: Qwen3WithMTP, sp: SamplingParams, k: int, compile_mode: str, rule: str | None = None
) -> tuple[torch.Tensor, float, int]:
    """Counts of (t1, t2, t3) over N samples with a 5-of-8 draft vocabulary re-chosen every 64 tokens
    (the first ones from the prompt: 4 distinct ids); acceptance rate; times the subset changed."""
    engine = TorchEngine(model, speculation_k=k, max_batch_size=500, compile=compile_mode, draft_vocab_size=5)
    vocab = engine.drafter.vocab
    assert vocab is not None
    changes = 0
    choose = vocab.choose

    def counting_choose(weight: torch.Tensor) -> bool:
        nonlocal changes
        changed = choose(weight)
        changes += changed
        return changed

    vocab.choose = counting_choose  # type: ignore[method-assign]
    if rule is not None:
        with_acceptance_rule(engine, WRONG_RULES[rule])
    samples = engine.generate(GenerationRequest(prompts=[PROMPT], sampling=sp, samples_per_prompt=N, speculation_k=k))
    cells = torch.tensor([(s.token_ids[0] * V + s.token_ids[1]) * V + s.token_ids[2] for s in samples])
    return torch.bincount(cells, minlength=V**3).double(), engine.stats()[0].counters.acceptance_rate, changes


SAMPLED = [
    (SamplingParams(temperature=1.0, max_new_tokens=4, seed=21), 2, "off"),
    (SamplingParams(temperature=1.0, max_new_tokens=4, seed=22), 3, "on"),
    (SamplingParams(temperature=0.8, top_k=5, top_p=0.85, max_new_tokens=4, seed=23), 3, "off"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("sp", "k", "compile_mode"), SAMPLED)
def test_reduced_vocabulary_samples_follow_the_exact_target_distribution(
    v8_model: Qwen3WithMTP, sp: SamplingParams, k: int, compile_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_vocab, "RECHOOSE_TOKENS", 64)
    counts, acceptance, changes = reduced_counts(v8_model, sp, k, compile_mode)
    assert changes >= 2  # the subset moved while rows were mid-sequence
    assert 0.2 < acceptance < 0.8  # both the accept and the residual paths carry mass
    assert chi_square_pvalue(counts, exact_joint(v8_model, sp)) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", sorted(WRONG_RULES))
def test_the_harness_rejects_wrong_acceptance_rules_with_a_reduced_vocabulary(
    v8_model: Qwen3WithMTP, wrong_rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_vocab, "RECHOOSE_TOKENS", 64)
    sp, k, compile_mode = SAMPLED[0]
    counts = reduced_counts(v8_model, sp, k, compile_mode, rule=wrong_rule)[0]
    assert chi_square_pvalue(counts, exact_joint(v8_model, sp)) < 1e-4


@pytest.mark.slow
def test_the_harness_rejects_a_draft_that_samples_the_subset_but_reports_the_full_q(
    v8_model: Qwen3WithMTP, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug a reduced head invites: drafts drawn over the subset, acceptance given the full
    vocabulary's q (mass outside the subset the draft never proposes). Rejected at p < 1e-4."""
    monkeypatch.setattr(draft_vocab, "RECHOOSE_TOKENS", 64)
    sp, k, _ = SAMPLED[0]
    engine = TorchEngine(v8_model, speculation_k=k, max_batch_size=500, compile="off", draft_vocab_size=5)
    vocab = engine.drafter.vocab
    assert vocab is not None
    monkeypatch.setattr(engine.drafter, "head", v8_model.mtp_head)  # q over the full vocabulary
    sample_from = speculative.sample_from

    def from_the_subset(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        inside = torch.zeros(q.shape[-1], dtype=torch.bool)
        inside[vocab.ids] = True
        return sample_from(q * inside, u)

    monkeypatch.setattr(speculative, "sample_from", from_the_subset)
    samples = engine.generate(GenerationRequest(prompts=[PROMPT], sampling=sp, samples_per_prompt=N, speculation_k=k))
    cells = torch.tensor([(s.token_ids[0] * V + s.token_ids[1]) * V + s.token_ids[2] for s in samples])
    assert chi_square_pvalue(torch.bincount(cells, minlength=V**3).double(), exact_joint(v8_model, sp)) < 1e-4


# ---- the fixed-shape round traces whole ----------------------------------------------------------


@pytest.mark.slow
def test_reduced_vocabulary_rounds_trace_whole_without_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed-shape phases with a reduced head, traced by dynamo (`fullgraph=True`) through the
    host-read checker, while the subset changes and across a push: no graph break, no host read,
    one graph per key (no retrace when only the subset's values change), tokens equal the untraced
    engine's and, greedy, the plain forward's."""
    monkeypatch.setattr(draft_vocab, "RECHOOSE_TOKENS", 8)
    torch._dynamo.reset()
    model = aligned_draft_model(ModelConfig.tiny(), seed=2)
    engine = TorchEngine(model, compile="on", draft_vocab_size=24)
    reference = TorchEngine(aligned_draft_model(ModelConfig.tiny(), seed=2), compile="on", draft_vocab_size=24)
    backend = HostReadCheckingBackend()
    engine.runner.rounds = traced = TracedRounds(backend)
    pushed = model_state_dict(aligned_draft_model(ModelConfig.tiny(), seed=3))
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        for push in (False, True):
            if push:
                for e in (engine, reference):
                    e.update_weights({n: t.clone() for n, t in pushed.items()}, WeightSelector.ALL, version=1)
            out, eager = traffic_run(engine, 3), traffic_run(reference, 3)
            assert [s.token_ids for s in out] == [s.token_ids for s in eager]
            greedy_rows = [s.token_ids for s in out if s.request_id == "b"]
            assert greedy_rows == [oracle_greedy(engine.model, p, 8) for p in TRACE_PROMPTS[:2]]
    vocab = engine.drafter.vocab
    assert vocab is not None and vocab.chosen >= 4
    assert backend.calls == len(traced.keys) and backend.host_reads == []
    assert backend.graphs == len(set(traced.keys))
    assert sum(s.counters.accepted_tokens for s in out) > 0
    torch._dynamo.reset()


# ---- the option ------------------------------------------------------------------------------------


def test_draft_vocab_size_is_validated_and_reaches_the_engine(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sidecar.engine.config import EngineConfig
    from sidecar.serve_config import ServeConfig
    from sidecar.server import cli
    from trainer.cli.main import main

    with pytest.raises(ValueError, match="draft_vocab_size must be >= 0"):
        ServeConfig(engine=EngineConfig(draft_vocab_size=-1))
    with pytest.raises(ValueError, match="bring their own draft vocabulary"):
        ServeConfig(engine=EngineConfig(kind="sglang", draft_vocab_size=8))
    config = ModelConfig.tiny()
    save_checkpoint(tmp_path, config, model_state_dict(build_model(config, seed=38)))
    engine = cli.load_engine(
        ServeConfig(
            model=tmp_path,
            engine=EngineConfig(speculation_k=2, max_speculation_k=4, max_batch_size=4, draft_vocab_size=16),
        )
    )
    assert isinstance(engine, TorchEngine) and engine.draft_vocab_size == 16
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--draft-vocab-size", "16", "--print-config"])
    assert result.exit_code == 0, result.output
    assert "draft_vocab_size: 16" in result.output
