"""Data parallelism: two replicas make the update one process makes on the same batch.

Oracles: the single-process update of the whole batch (gradients, weights after a Muon/AdamW
step, metrics), within the micro-batch test's float32 tolerance, since splitting rows over
replicas only changes the order in which per-token terms are summed; an exhaustive search for
the best split (the greedy balance is within Graham's 4/3 bound of it); the uncropped forward.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import distributed as dist

from muon import HybridOptimizerConfig
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, build_model
from tests.spawn_workers import join_group, leave_group, spawn
from trainer.draft.objective import DraftConfig
from trainer.policy.data_parallel import balanced_rows, reduce_mismatch, row_lengths
from trainer.policy.losses import GRPOConfig, mismatch_metrics
from trainer.policy.policy import Policy, TrainBatch

MC = ModelConfig.tiny(max_position_embeddings=64)
ATOL, RTOL = 1e-6, 1e-5  # tests/trainer/policy/test_trainer_updates.py: the micro-batch test's float32 standard
FAST = HybridOptimizerConfig(lr=1e-2, weight_decay=0.0)  # a wrong reduction would move weights ~1e-2
# Weights after the step: AdamW's first step is lr * g / (|g| + eps), so an element whose gradient
# is near eps turns a float32 summation-order difference of the gradient into up to ~1e-6 of
# weight (measured 2.2e-6 on one of 4096 elements); tests/trainer/policy/test_trainer_bridge.py's standard.
WEIGHT_ATOL = 2e-5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=3, max_size=8), st.integers(2, 3))
def test_balanced_rows_partition_within_graham_bound(lengths: list[int], parts: int) -> None:
    split = balanced_rows(lengths, parts)
    assert sorted(r for rows in split for r in rows) == list(range(len(lengths)))
    assert all(rows and rows == sorted(rows) for rows in split)
    assert balanced_rows(lengths, parts) == split  # deterministic: every rank computes the same split
    best = min(
        max(sum(lengths[r] for r in range(len(lengths)) if assign[r] == p) for p in range(parts))
        for assign in itertools.product(range(parts), repeat=len(lengths))
    )
    worst = max(sum(lengths[r] for r in rows) for rows in split)
    assert worst <= (4 / 3 - 1 / (3 * parts)) * best + 1e-9


def test_balanced_rows_refuses_more_replicas_than_rows() -> None:
    with pytest.raises(ValueError, match="every replica needs a row"):
        balanced_rows([3, 4], 3)


def _batch(rows: int = 7, seq: int = 24, seed: int = 0) -> TrainBatch:
    """Rows of very different lengths (right padding), one filtered row, perturbed old log-probs."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MC.vocab_size, (rows, seq), generator=gen)
    mask = torch.zeros(rows, seq - 1)
    for i in range(rows):
        start = 3 + i % 4
        mask[i, start : start + 2 + (5 * i) % (seq - start - 2)] = 1.0
    generated = mask.clone()
    mask[2] = 0.0
    return TrainBatch(
        tokens=tokens,
        mask=mask,
        generated=generated,
        advantages=torch.randn(rows, generator=gen),
        rollout_logprobs=-torch.rand(rows, seq - 1, generator=gen),
    )


def test_shares_partition_the_rows_and_keep_their_log_probs() -> None:
    batch = _batch()
    policy = Policy(MC, Policy.Config(), model_state_dict(build_model(MC, seed=3)))
    full = policy.logprobs(batch.tokens)
    lengths = row_lengths(batch.generated)  # type: ignore[arg-type]
    split = balanced_rows(lengths, 2)
    shares = [batch.data_parallel_share(r, 2) for r in (0, 1)]
    assert min(s.tokens.shape[1] for s in shares) < batch.tokens.shape[1]  # one share is cropped
    for rows, share in zip(split, shares, strict=True):
        seq = share.tokens.shape[1]
        assert torch.equal(share.tokens, batch.tokens[rows, :seq])
        assert torch.equal(share.mask.sum(1), batch.mask[rows].sum(1))  # no counted token is cropped away
        torch.testing.assert_close(policy.logprobs(share.tokens), full[rows, : seq - 1], atol=1e-6, rtol=0)
    assert batch.data_parallel_share(0, 1) is batch


def _policy(state: dict[str, torch.Tensor], replicas: int, token_level: bool) -> Policy:
    cfg = Policy.Config(
        data_parallel=replicas,
        seed=5,
        micro_batch_rows=2,
        grpo=GRPOConfig(token_level=token_level),
        optimizer=FAST,
        draft=DraftConfig(optimizer=FAST),
    )
    return Policy(MC, cfg, {k: v.clone() for k, v in state.items()})


def _grads(policy: Policy) -> dict[str, torch.Tensor]:
    modules = {"trunk": policy.model, "draft": policy.draft}
    return {
        f"{m}.{n}": p.grad.clone()
        for m, mod in modules.items()
        for n, p in mod.named_parameters()  # type: ignore[union-attr]
        if p.grad is not None
    }


def _update(policy: Policy, batch: TrainBatch) -> dict[str, object]:
    """Gradients and metrics of one backward, then the weights after the step."""
    batch.old_logprobs = policy.logprobs(batch.tokens) + 0.05 * torch.randn(
        batch.mask.shape, generator=torch.Generator().manual_seed(1)
    )  # ratios != 1, so clipping and its metrics are exercised
    metrics = policy.backward(batch)
    grads = _grads(policy)
    metrics.update(policy.step())
    return {"grads": grads, "metrics": metrics, "weights": dict(policy.export_named_tensors())}


def _worker(rank: int, port: int, state_path: str, out: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, 2, port)
    state = torch.load(state_path, weights_only=True)
    result = {}
    for level in (True, False):
        policy = _policy(state, 2, level)
        result[level] = _update(policy, _batch())
    policy.save(Path(f"{out}.ckpt"))  # replica 0 writes; any data_parallel resumes from it
    torch.save(result, f"{out}.{rank}")
    leave_group()


@pytest.mark.slow
def test_two_replicas_make_the_one_process_update(tmp_path: Path) -> None:
    state = model_state_dict(build_model(MC, seed=11))
    torch.save(state, tmp_path / "state.pt")
    spawn(_worker, (str(tmp_path / "state.pt"), str(tmp_path / "out")), nprocs=2, timeout_s=240)
    two = [torch.load(tmp_path / f"out.{r}", weights_only=True) for r in (0, 1)]
    for level in (True, False):
        one = _update(_policy(state, 1, level), _batch())
        for replica in two:
            got = replica[level]
            assert got["grads"].keys() == one["grads"].keys() and any(k.startswith("draft.") for k in got["grads"])
            for name, g in one["grads"].items():
                torch.testing.assert_close(
                    got["grads"][name], g, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}"
                )
            for name, w in one["weights"].items():
                torch.testing.assert_close(
                    got["weights"][name], w, atol=WEIGHT_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
                )
            for key, value in one["metrics"].items():
                assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (level, key)
        # the replicas step on the same reduced gradient: their weights agree bit for bit
        for name, w in two[0][level]["weights"].items():
            assert torch.equal(w, two[1][level]["weights"][name]), name
    # the checkpoint of the two-replica run resumes in one process (the last, sample-level update)
    assert sorted(p.name for p in (tmp_path / "out.ckpt").glob("*.pt")) == ["rank00000.pt"]
    resumed = _policy(state, 1, False)
    resumed.load(tmp_path / "out.ckpt")
    for name, w in resumed.export_named_tensors():
        assert torch.equal(w, two[0][False]["weights"][name]), name
    assert resumed.step_count == 1


MC_EAGLE3 = ModelConfig.tiny(max_position_embeddings=64, num_hidden_layers=4, num_nextn_predict_layers=0)


def _eagle3_policy(state: dict[str, torch.Tensor], replicas: int) -> Policy:
    from sidecar.model.eagle3 import Eagle3Config

    cfg = Policy.Config(
        data_parallel=replicas, seed=5, micro_batch_rows=2, optimizer=FAST, draft=DraftConfig(optimizer=FAST)
    )
    draft = Eagle3Config.for_target(MC_EAGLE3, aux_layer_ids=[1, 2, 3], draft_vocab_size=48)
    return Policy(MC_EAGLE3, cfg, {k: v.clone() for k, v in state.items()}, eagle3=draft)


def _eagle3_worker(rank: int, port: int, state_path: str, out: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, 2, port)
    state = torch.load(state_path, weights_only=True)
    torch.save(_update(_eagle3_policy(state, 2), _batch()), f"{out}.{rank}")
    leave_group()


@pytest.mark.slow
def test_two_replicas_train_an_eagle3_draft_like_one_process(tmp_path: Path) -> None:
    state = model_state_dict(build_model(MC_EAGLE3, seed=11))
    torch.save(state, tmp_path / "state.pt")
    spawn(_eagle3_worker, (str(tmp_path / "state.pt"), str(tmp_path / "out")), nprocs=2, timeout_s=240)
    one = _update(_eagle3_policy(state, 1), _batch())
    for rank in (0, 1):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        assert got["grads"].keys() == one["grads"].keys() and any(k.startswith("draft.fc") for k in got["grads"])
        for name, g in one["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        for name, w in one["weights"].items():  # eagle3.* included: the pushed draft
            torch.testing.assert_close(
                got["weights"][name], w, atol=WEIGHT_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )


def _mismatch_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random batches (train, rollout, mask) of 2-9 rows: heavy-tailed gaps (a few whole nats among
    1e-6-sized ones, as a flipped expert makes them), rows without a response token, a replica's
    share with none at all (case 0)."""
    cases = []
    for case in range(12):
        gen = torch.Generator().manual_seed(100 + case)
        rows, seq = 2 + case % 8, 5 + (7 * case) % 30
        rollout = -5 * torch.rand(rows, seq, generator=gen)
        gap = 1e-6 * torch.randn(rows, seq, generator=gen)
        gap += torch.where(torch.rand(rows, seq, generator=gen) < 0.03, 3 * torch.randn(rows, seq, generator=gen), 0.0)
        mask = (torch.rand(rows, seq, generator=gen) < 0.6).float()
        if case == 0:
            mask[: rows // 2] = 0.0  # replica 0's share has nothing to compare
        cases.append((rollout + gap, rollout, mask))
    return cases


def _mismatch_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, 2, port)
    results = []  # the world group is the data-parallel group of the two replicas here
    for train, rollout, mask in _mismatch_cases():
        half = train.shape[0] // 2
        rows = slice(0, half) if rank == 0 else slice(half, None)  # replica 0 the first rows, 1 the rest
        results.append(reduce_mismatch(train[rows], rollout[rows], mask[rows], dist.group.WORLD))  # type: ignore[arg-type]
    torch.save(results, f"{out}.{rank}")
    leave_group()


@pytest.mark.slow
def test_two_replicas_report_the_one_process_mismatch_exactly(tmp_path: Path) -> None:
    """`reduce_mismatch` over two replicas' rows = `mismatch_metrics` of the whole batch, the p99
    included (gathered per-token gaps: the same float64 values in the same order, so equal to the
    last bit); a per-replica p99 averaged (what a sum/max reduction could give) would not be."""
    spawn(_mismatch_worker, (str(tmp_path / "out"),), nprocs=2, timeout_s=120)
    two = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in (0, 1)]
    averaged_differs = 0
    for i, (train, rollout, mask) in enumerate(_mismatch_cases()):
        one = mismatch_metrics(train, rollout, mask)
        assert two[0][i] == one and two[1][i] == one, (i, one, two[0][i])
        half = train.shape[0] // 2
        shares = [mismatch_metrics(train[r], rollout[r], mask[r]) for r in (slice(0, half), slice(half, None))]
        averaged = sum(s["mismatch_logprob_abs_p99"] for s in shares) / 2
        averaged_differs += int(abs(averaged - one["mismatch_logprob_abs_p99"]) > 1e-9)
    assert averaged_differs >= 6  # negative control: the reduction's exactness is not automatic
