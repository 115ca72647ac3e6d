"""What would break a CUDA graph of a fixed-shape round, found on the CPU (issue 40).

A CUDA graph replays kernels only: a value read back to the host during capture, or a host value
copied to the device (a Python literal turned into a tensor, `t[i] = False`), is refused by the
capture or frozen into the graph. Both showed up only on a lent GPU before these tests. Here the
two phases a graph captures (`fixed_round.draft_phase`, `verify_phase`) run under a dispatch mode
that records every operator, through whole generations (MTP with one and two layers, EAGLE-3,
greedy and top-k/top-p rows, k = 0..3): none may create a tensor from host data (`lift_fresh`),
read one back (`.item()`, `int(t)`, `bool(t)`) or depend on values for its shape (`nonzero`). The
oracle is the capture failures seen on the H200. (`.tolist()` dispatches no operator, so this
recorder cannot see it; the traced phases' graphs are searched for it in
tests/engine/test_fixed_shape_forwards.py, `host_transfers`.)

And the host-side cache of a batch's padded form must follow the batch it was made for: keyed by
`id()`, a new batch that reuses a freed one's id read the old max_new_tokens (rows ran past their
budget on the GPU).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target
from torch.utils._python_dispatch import TorchDispatchMode

from sidecar.engine import fixed_round, round_graphs
from sidecar.engine.round_graphs import FixedRounds
from sidecar.engine.rows import BatchTensors, Sequence
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import ModelConfig
from sidecar.types import GenerationRequest, SamplingParams

FORBIDDEN = ("lift_fresh", "_local_scalar_dense", "item", "is_nonzero", "nonzero")
"""Host data made a tensor; a value read back (`.item()`, `int(t)`, `bool(t)`: `item` and
`is_nonzero` under inference mode, which the engine's step runs in); a shape read from values."""


class Recorder(TorchDispatchMode):
    def __init__(self, seen: Counter[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def recorded_phases(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    seen: Counter[str] = Counter()

    def wrap(phase: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with Recorder(seen):
                return phase(*args, **kwargs)

        return run

    monkeypatch.setattr(round_graphs, "draft_phase", wrap(fixed_round.draft_phase))
    monkeypatch.setattr(round_graphs, "verify_phase", wrap(fixed_round.verify_phase))
    yield seen


def traffic(engine: TorchEngine) -> None:
    sampled = SamplingParams(temperature=0.9, top_k=7, top_p=0.9, max_new_tokens=9, seed=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=7)
    engine.submit(GenerationRequest(prompts=[[1, 2, 3], [4]], sampling=sampled, speculation_k=3, request_id="a"))
    engine.step()
    engine.submit(GenerationRequest(prompts=[[5, 6, 7, 8]], sampling=greedy, speculation_k=1, request_id="b"))
    engine.submit(GenerationRequest(prompts=[[9]], sampling=greedy, speculation_k=0, request_id="c"))
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("draft", ["mtp", "mtp2", "eagle3"])
def test_the_captured_phases_neither_read_back_nor_copy_host_values(
    monkeypatch: pytest.MonkeyPatch, draft: str
) -> None:
    if draft == "eagle3":
        target = eagle3_target()
        engine = TorchEngine(target, speculation_k=3, draft=aligned_eagle3(target), compile="on")
    else:
        layers = 2 if draft == "mtp2" else 1
        model = aligned_draft_model(ModelConfig.tiny(num_nextn_predict_layers=layers), seed=3)
        engine = TorchEngine(model, speculation_k=3, compile="on")
    with recorded_phases(monkeypatch) as seen:
        traffic(engine)
    assert seen["aten.mm.default"] + seen["aten.matmul.default"] + seen["aten.addmm.default"] > 0  # it recorded
    assert {op: n for op, n in seen.items() if any(bad in op for bad in FORBIDDEN)} == {}


def test_the_recorder_sees_a_host_literal_and_a_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: the two patterns the GPU refused, put back into a phase."""
    original = fixed_round.draft_phase

    def leaky(*args: Any, **kwargs: Any) -> Any:
        drafts, q, u = original(*args, **kwargs)
        offsets = torch.tensor([0, 1], dtype=torch.int64)  # a host literal (the old counter-RNG offsets)
        return drafts + int(offsets.sum()) * int(u.numel() < 0), q, u  # and a value read back

    monkeypatch.setattr(fixed_round, "draft_phase", leaky)
    engine = TorchEngine(aligned_draft_model(ModelConfig.tiny(), seed=3), speculation_k=3, compile="on")
    with recorded_phases(monkeypatch) as seen:
        traffic(engine)
    read_back = seen["aten.item.default"] + seen["aten._local_scalar_dense.default"]
    assert seen["aten.lift_fresh.default"] > 0 and read_back > 0


def test_the_padded_batch_follows_its_batch_when_ids_are_reused() -> None:
    """Batches made and dropped in turn (CPython reuses a freed object's id ~15% of the time here):
    each padded form holds its own batch's budgets."""
    rounds = FixedRounds(capture=False)
    for n in range(1, 120):
        seq = Sequence(
            request_id="r",
            prompt_index=0,
            sample_index=0,
            prompt=[1],
            params=SamplingParams(max_new_tokens=n),
            k=0,
            auto=False,
            seed=n,
        )
        batch = BatchTensors.of([seq], torch.device("cpu"))
        padded = rounds._pad_batch(batch, 2)
        assert padded.max_new.tolist() == [n, n] and torch.equal(padded.keys[0], batch.keys[0])
        del batch, padded


def test_a_failed_capture_falls_back_to_uncaptured_rounds_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A capture refused mid-generation (here: the verify phase's, after the draft phase's was
    captured and replayed) leaves the engine generating correctly without graphs, with a warning."""
    from test_static_engine import oracle_greedy

    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    engine = TorchEngine(model, speculation_k=3, compile="on")
    rounds = engine._rounds
    assert isinstance(rounds, FixedRounds)
    rounds.capture = True  # as on CUDA; the capture itself is faked (no GPU here)
    captures: list[tuple[object, ...]] = []

    class Replayable:
        def __init__(self, fn: Callable[..., Any], by_reference: Any, static: Any) -> None:
            self.fn, self.by_reference, self.static = fn, by_reference, static
            self.outputs = fn(*by_reference, *static)

        def replay(self) -> None:  # recompute into the same output tensors, as a graph would
            for out, new in zip(self.outputs, self.fn(*self.by_reference, *self.static), strict=True):
                out.copy_(new)

    def capture(fn: Callable[..., Any], by_reference: Any, inputs: Any) -> Any:
        captures.append(by_reference)
        if by_reference:  # the verify phase (it reads the draft phase's outputs)
            raise RuntimeError("operation not permitted when stream is capturing")
        static = tuple(t.clone() for t in inputs)
        graph = Replayable(fn, by_reference, static)
        return round_graphs._Graph(graph=graph, inputs=static, outputs=tuple(graph.outputs))

    monkeypatch.setattr(rounds, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "device", lambda device: torch.device("cpu"))  # a no-op context
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    with caplog.at_level("WARNING", logger="sidecar.engine.round_graphs"):
        out = engine.generate(
            GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=10))
        )
    assert [s.token_ids for s in out] == [oracle_greedy(model, p, 10) for p in prompts]
    assert len(captures) == 2 and not rounds.capture  # one capture each phase, then no more attempts
    assert "CUDA graph capture failed" in caplog.text and "--compile off" in caplog.text
