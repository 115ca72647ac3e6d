"""What would break a CUDA graph of a fixed-shape round, found on the CPU (issue 40).

A CUDA graph replays kernels only: a value read back to the host during capture, or a host value
copied to the device (a Python literal turned into a tensor, `t[i] = False`), is refused by the
capture or frozen into the graph. Both showed up only on a lent GPU before these tests. Here the
two phases a graph captures (`decode_round.draft_phase`, `verify_phase`) run under a dispatch mode
that records every operator, through whole generations (MTP with one and two layers, EAGLE-3,
greedy and top-k/top-p rows, k = 0..3): none may create a tensor from host data (`lift_fresh`),
read one back (`.item()`, `int(t)`, `bool(t)`) or depend on values for its shape (`nonzero`). The
oracle is the capture failures seen on the H200. (`.tolist()` dispatches no operator, so this
recorder cannot see it; the traced phases' graphs are searched for it in
tests/sidecar/engine/test_fixed_shape_forwards.py, `host_transfers`.)

And the host-side cache of a batch's padded form must follow the batch it was made for: keyed by
`id()`, a new batch that reuses a freed one's id read the old max_new_tokens (rows ran past their
budget on the GPU).

The capture bookkeeping, with `Replayable` standing in for a CUDA graph (it recomputes into its
captured output tensors): a round at a fixed k is one graph, and where automatic k times the draft
phase two, the second reading the first's inputs; weights' addresses checked after pushes only,
graphs kept over a copying push and captured again after an adopting one; a refused capture falls
back to uncaptured rounds with a warning; `warm_up` (what `specrl serve` runs first) captures every batch bucket. Oracle: the
plain full forward's greedy tokens. The real capture runs in tests/sidecar/engine/test_cuda_graphs.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sidecar.engine import decode_round, round_graphs
from sidecar.engine.round_graphs import FixedRounds
from sidecar.engine.rows import BatchTensors, Sequence
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.sidecar.engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target

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

    monkeypatch.setattr(round_graphs, "draft_phase", wrap(decode_round.draft_phase))
    monkeypatch.setattr(round_graphs, "verify_phase", wrap(decode_round.verify_phase))
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
    original = decode_round.draft_phase

    def leaky(*args: Any, **kwargs: Any) -> Any:
        drafts, q, u = original(*args, **kwargs)
        offsets = torch.tensor([0, 1], dtype=torch.int64)  # a host literal (the old counter-RNG offsets)
        return drafts + int(offsets.sum()) * int(u.numel() < 0), q, u  # and a value read back

    monkeypatch.setattr(decode_round, "draft_phase", leaky)
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
            speculation_auto=False,
            seed=n,
        )
        batch = BatchTensors.of([seq], torch.device("cpu"))
        padded = rounds._pad_batch(batch, 2)
        assert padded.max_new.tolist() == [n, n] and torch.equal(padded.keys[0], batch.keys[0])
        del batch, padded


class Replayable:
    """A stand-in for a CUDA graph on the CPU: "captures" by running the phase once on its own
    input tensors, and replays by recomputing into the same output tensors."""

    def __init__(self, fn: Callable[..., Any], by_reference: Any, static: Any) -> None:
        self.fn, self.by_reference, self.static = fn, by_reference, static
        self.outputs = fn(*by_reference, *static)

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn(*self.by_reference, *self.static), strict=True):
            out.copy_(new)


def faked_capture(
    monkeypatch: pytest.MonkeyPatch, engine: TorchEngine, fail_verify: bool = False
) -> tuple[FixedRounds, list[tuple[object, ...]]]:
    """Turn `engine`'s fixed rounds to capturing, with `Replayable` graphs (no GPU here); returns
    the rounds and the list of captures (each the phase's by-reference inputs: empty for the draft
    phase). `fail_verify`: the verify phase's capture raises as a CUDA capture refusal does."""
    rounds = engine.runner.rounds
    assert isinstance(rounds, FixedRounds)
    rounds.capture = True
    captures: list[tuple[object, ...]] = []

    def capture(fn: Callable[..., Any], by_reference: Any, inputs: Any) -> Any:
        captures.append(by_reference)
        if fail_verify and by_reference:
            raise RuntimeError("operation not permitted when stream is capturing")
        static = tuple(t.clone() for t in inputs)
        graph = Replayable(fn, by_reference, static)
        return round_graphs._Graph(graph=graph, inputs=static, outputs=tuple(graph.outputs))

    monkeypatch.setattr(rounds, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "device", lambda device: torch.device("cpu"))  # a no-op context
    return rounds, captures


def test_captured_rounds_check_the_weights_after_pushes_only_and_recapture_after_new_storage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weights' addresses are read on the first round and after each push, not every round; a
    copying push keeps every graph, an adopting one drops them (captured again), and generation
    after either equals the pushed weights' plain forward."""
    from tests.sidecar.engine.test_static_engine import oracle_greedy

    old, new = (aligned_draft_model(ModelConfig.tiny(), seed=s) for s in (3, 4))
    engine = TorchEngine(old, speculation_k=3, compile="on")
    rounds, captures = faked_capture(monkeypatch, engine)
    checks: list[int] = []
    check = rounds.check_weights
    monkeypatch.setattr(rounds, "check_weights", lambda tensors: (checks.append(1), check(tensors)))
    prompts = [[1, 2, 3], [7, 8, 9, 10]]

    def greedy() -> list[list[int]]:
        sp = SamplingParams(temperature=0.0, max_new_tokens=10)
        return [s.token_ids for s in engine.generate(GenerationRequest(prompts=prompts, sampling=sp))]

    assert greedy() == [oracle_greedy(old, p, 10) for p in prompts]
    assert len(checks) == 1 and captures  # one check for a whole generation
    captured = len(captures)
    assert greedy() == [oracle_greedy(old, p, 10) for p in prompts] and len(captures) == captured
    tensors = {n: t.clone() for n, t in model_state_dict(new).items()}
    engine.update_weights(tensors, WeightSelector.ALL, version=1)
    assert greedy() == [oracle_greedy(new, p, 10) for p in prompts]
    assert len(checks) == 2 and len(captures) == captured  # checked again; replayed, nothing recaptured
    engine.adopt_weights({n: t.clone() for n, t in model_state_dict(old).items()}, WeightSelector.ALL, version=2)
    assert greedy() == [oracle_greedy(old, p, 10) for p in prompts]
    assert len(checks) == 3 and len(captures) > captured  # new storage: the graphs were captured again


def test_a_rounds_inputs_are_copied_once_and_the_verify_graph_reads_the_draft_graphs_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The verify graph has no inputs of its own: it reads this round's inputs in the draft graph's
    tensors (what the draft replay copied them into), so a round copies each input once. Greedy
    output still equals the plain forward while the graphs replay."""
    from tests.sidecar.engine.test_static_engine import oracle_greedy

    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    engine = TorchEngine(model, speculation_k=3, speculation_auto=True, compile="on")  # the controller times drafts
    rounds, _ = faked_capture(monkeypatch, engine)
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    out = [s.token_ids for s in engine.generate(GenerationRequest(prompts=prompts, sampling=sp))]
    assert out == [oracle_greedy(model, p, 10) for p in prompts]
    verify = {key: g for key, g in rounds._graphs.items() if key[0] == "verify"}
    assert verify
    for key, graph in verify.items():
        draft = rounds._graphs[key[1]]
        assert graph.inputs == ()
        assert all(a is b for a, b in zip(graph.graph.by_reference[3:], draft.inputs, strict=True))


def test_replays_copy_only_the_inputs_that_changed_and_equal_uncaptured_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay copies an input only when it is a new tensor (the batch's sampling settings and a
    plain round's refresh zeros come again unchanged). Requests of different sampling settings,
    plain and speculative, one after another at the same shapes, sample exactly what uncaptured
    fixed-shape rounds sample (the oracle: the same engine without capture)."""
    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    settings = [
        SamplingParams(temperature=1.0, max_new_tokens=8, seed=1),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=8, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=8),
        SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=8, seed=3),
    ]

    def run(engine: TorchEngine) -> list[tuple[list[int], list[float]]]:
        return [
            (s.token_ids, s.logprobs)
            for sp in settings
            for k in (0, 3)
            for s in engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k))
        ]

    want = run(TorchEngine(model, speculation_k=3, compile="on"))
    engine = TorchEngine(model, speculation_k=3, compile="on")
    rounds, captures = faked_capture(monkeypatch, engine)
    copies: list[int] = []
    real_run = rounds._run

    def counting_run(key: Any, fn: Any, inputs: Any, **kw: Any) -> Any:
        graph = rounds._graphs.get(key)
        if graph is not None:
            copies.append(sum(1 for i, t in enumerate(inputs) if i >= len(graph.sources) or graph.sources[i] is not t))
        return real_run(key, fn, inputs, **kw)

    monkeypatch.setattr(rounds, "_run", counting_run)
    assert run(engine) == want and captures
    assert copies and min(copies) < len(rounds._graphs[next(iter(rounds._graphs))].inputs)  # some not copied


def test_rounds_at_a_fixed_k_are_one_graph_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nothing times the draft phase (k fixed), a round is one graph, draft and verify phases
    together; greedy output equals the plain forward and the same shapes replay, capturing nothing."""
    from tests.sidecar.engine.test_static_engine import oracle_greedy

    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    engine = TorchEngine(model, speculation_k=3, compile="on")
    rounds, captures = faked_capture(monkeypatch, engine)
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)

    def greedy() -> list[list[int]]:
        return [s.token_ids for s in engine.generate(GenerationRequest(prompts=prompts, sampling=sp))]

    assert greedy() == [oracle_greedy(model, p, 10) for p in prompts]
    assert rounds._graphs and {key[0] for key in rounds._graphs} == {"round"}
    captured = len(captures)
    assert greedy() == [oracle_greedy(model, p, 10) for p in prompts] and len(captures) == captured


def test_a_failed_capture_falls_back_to_uncaptured_rounds_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A capture refused mid-generation (here: the verify phase's, after the draft phase's was
    captured and replayed) leaves the engine generating correctly without graphs, with a warning."""
    from tests.sidecar.engine.test_static_engine import oracle_greedy

    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    engine = TorchEngine(model, speculation_k=3, speculation_auto=True, compile="on")  # two graphs a round
    rounds, captures = faked_capture(monkeypatch, engine, fail_verify=True)
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    with caplog.at_level("WARNING", logger="sidecar.engine.round_graphs"):
        out = engine.generate(
            GenerationRequest(prompts=prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=10))
        )
    assert [s.token_ids for s in out] == [oracle_greedy(model, p, 10) for p in prompts]
    assert len(captures) == 2 and not rounds.capture  # one capture each phase, then no more attempts
    assert "CUDA graph capture failed" in caplog.text and "--compile off" in caplog.text


def test_warm_up_captures_every_batch_bucket_before_serving_and_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`TorchEngine.warm_up` (what `specrl serve` runs before listening): every batch bucket, plain
    and at the default k, captured; progress reported per shape; no statistics left; the first
    request after it replays (captures nothing at those shapes) and equals the plain forward; an
    engine with requests refuses it; eager rounds have nothing to warm up."""
    from tests.sidecar.engine.test_static_engine import oracle_greedy

    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    assert TorchEngine(model, speculation_k=3).warm_up() == 0  # compile auto on a CPU: eager rounds
    engine = TorchEngine(model, speculation_k=3, max_batch_size=12, compile="on")
    rounds, captures = faked_capture(monkeypatch, engine)
    progress: list[tuple[int, int]] = []
    captured = engine.warm_up(lambda done, total: progress.append((done, total)))
    assert progress == [(i, 10) for i in range(1, 11)]  # buckets 1, 2, 4, 8, 12 x k in {0, 3}
    assert captured == len(captures) == rounds.captured >= 10  # one graph per shape at least (k pinned)
    stats = engine.stats()
    assert len(stats) == 1 and stats[0].counters.generated_tokens == 0 and stats[0].samples_finished == 0
    sp = SamplingParams(temperature=0.0, max_new_tokens=1 + 1)
    out = engine.generate(GenerationRequest(prompts=[[5, 6]], sampling=sp, speculation_k=3))
    assert out[0].token_ids == oracle_greedy(model, [5, 6], 2) and len(captures) == captured
    engine.submit(GenerationRequest(prompts=[[1]], sampling=sp, request_id="busy"))
    with pytest.raises(RuntimeError, match="before serving"):
        engine.warm_up()


def test_warm_up_in_auto_mode_captures_the_two_graph_rounds_auto_requests_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Automatic k times the draft phase, so its rounds are two graphs: an engine in auto mode warms
    those up (one graph a round would leave its first requests capturing), and an auto request
    after the warm-up captures nothing at the warmed shapes."""
    from tests.sidecar.engine.test_static_engine import oracle_greedy

    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    engine = TorchEngine(model, speculation_k=3, speculation_auto=True, max_batch_size=4, compile="on")
    rounds, captures = faked_capture(monkeypatch, engine)
    captured = engine.warm_up()
    assert captured > 0 and {key[0] for key in rounds._graphs} == {"draft", "verify"}
    out = engine.generate(
        GenerationRequest(prompts=[[5, 6]], sampling=SamplingParams(temperature=0.0, max_new_tokens=2))
    )
    assert out[0].token_ids == oracle_greedy(model, [5, 6], 2) and len(captures) == captured


def test_serve_warms_up_behind_a_progress_bar_and_skips_engines_without_warm_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sidecar.server.cli import warm_up

    model = aligned_draft_model(ModelConfig.tiny(), seed=3)
    warm_up(TorchEngine(model, speculation_k=3, max_batch_size=2, compile="on"))
    assert "warm-up: decode rounds" in capsys.readouterr().err  # buckets 1, 2 x k in {0, 3}
    warm_up(TorchEngine(model, speculation_k=3))  # eager rounds: nothing to warm up, no bar
    warm_up(object())  # type: ignore[arg-type]  # an engine without warm_up (SGLang)
    assert capsys.readouterr().err == ""
