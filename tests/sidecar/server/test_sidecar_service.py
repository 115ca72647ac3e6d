"""A real sidecar (TorchEngine, tiny model, port 0) against a real client: every bad input gets
its documented status code and leaves the served model untouched (greedy output before and
after equals the plain-decoding oracle); control RPCs and stats behave as documented.

The Prometheus counters are `sidecar/server/metrics.py`'s.
"""

from __future__ import annotations

import threading
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

import sidecar.protocol.convert as convert
from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.client.weight_sender import iter_push_requests
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import rollout_pb2, weights_pb2
from sidecar.server.process import Sidecar
from sidecar.server.scheduler import SchedulerConfig
from sidecar.types import FinishReason, GenerationRequest, KVUsage, RequestLimits, SamplingParams, WeightSelector
from tests.sidecar_fixtures import (
    DEADLINE,
    PROMPTS,
    greedy_oracle,
    greedy_request,
    greedy_tokens,
    start_sidecar,
    wait_until,
    weights,
)

Code = grpc.StatusCode

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def oracle() -> list[list[int]]:
    return greedy_oracle()


@pytest.fixture(scope="module")
def sidecar_settings() -> dict[str, Any]:
    """The bad-input matrix's sidecar: a 1 MiB message limit (the oversized cases) and metrics."""
    return dict(max_message_mib=1, metrics_port=0)


def push_raw(address: str, messages: list[weights_pb2.PushWeightsRequest]) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        services.WeightStub(ch).PushWeights(iter(messages), timeout=DEADLINE)
    return err.value


def good_messages(version: int = 1, tensors: dict[str, torch.Tensor] | None = None) -> list:  # type: ignore[type-arg]
    items = iter_push_requests(tensors if tensors is not None else weights(1), version, chunk_bytes=4096)
    return [convert.push_item_to_pb(i) for i in items]


def first_chunk(msgs: list) -> weights_pb2.WeightChunk:  # type: ignore[type-arg]
    return next(m.chunk for m in msgs if m.WhichOneof("item") == "chunk")


def flip_chunk(msgs: list) -> list:  # type: ignore[type-arg]
    c = first_chunk(msgs)
    c.data = bytes([c.data[0] ^ 1]) + c.data[1:]
    c.crc32 = zlib.crc32(c.data) ^ 1
    return msgs


def flip_tensor_crc(msgs: list) -> list:  # type: ignore[type-arg]
    last = next(m.chunk for m in msgs if m.WhichOneof("item") == "chunk" and m.chunk.HasField("tensor_crc32"))
    last.tensor_crc32 ^= 1
    return msgs


def with_dtype(msgs: list, dtype: int) -> list:  # type: ignore[type-arg]
    msgs[0].manifest.tensors[0].dtype = dtype
    return msgs


PUSH_CASES = [
    ("chunk before manifest", lambda: good_messages()[1:], Code.INVALID_ARGUMENT),
    ("two manifests", lambda: [good_messages()[0], *good_messages()], Code.INVALID_ARGUMENT),
    ("missing commit (truncated)", lambda: good_messages()[:-1], Code.INVALID_ARGUMENT),
    ("chunk after commit", lambda: [*good_messages(), good_messages()[1]], Code.INVALID_ARGUMENT),
    ("message with no item", lambda: [good_messages()[0], weights_pb2.PushWeightsRequest()], Code.INVALID_ARGUMENT),
    ("empty stream", lambda: [], Code.INVALID_ARGUMENT),
    ("chunk checksum mismatch", lambda: flip_chunk(good_messages()), Code.INVALID_ARGUMENT),
    ("tensor checksum mismatch", lambda: flip_tensor_crc(good_messages()), Code.INVALID_ARGUMENT),
    ("unknown dtype", lambda: with_dtype(good_messages(), weights_pb2.D_TYPE_UNSPECIFIED), Code.INVALID_ARGUMENT),
    ("unknown tensor", lambda: good_messages(tensors={**weights(1), "model.extra": torch.zeros(3)}), Code.NOT_FOUND),
    (
        "wrong dtype",
        lambda: good_messages(tensors={n: t.half() for n, t in weights(1).items()}),
        Code.FAILED_PRECONDITION,
    ),
    (
        "wrong shape",
        lambda: good_messages(tensors={**weights(1), "model.norm.weight": torch.ones(3)}),
        Code.FAILED_PRECONDITION,
    ),
    (
        "missing tensor",
        lambda: good_messages(tensors={n: t for n, t in weights(1).items() if n != "model.norm.weight"}),
        Code.FAILED_PRECONDITION,
    ),
    ("version 0 (not newer)", lambda: _version0(), Code.FAILED_PRECONDITION),
    ("oversize chunk message", lambda: _oversize(), Code.RESOURCE_EXHAUSTED),
]


def _version0() -> list:  # type: ignore[type-arg]
    msgs = good_messages()
    msgs[0].manifest.version = 0
    return msgs


def _oversize() -> list:  # type: ignore[type-arg]
    msgs = good_messages()
    data = b"\0" * (2 << 20)  # 2 MiB > the 1 MiB message limit of this server
    msgs.insert(1, weights_pb2.PushWeightsRequest(chunk=weights_pb2.WeightChunk(data=data, crc32=zlib.crc32(data))))
    return msgs


@pytest.mark.parametrize(("name", "make", "code"), PUSH_CASES, ids=[c[0] for c in PUSH_CASES])
def test_bad_pushes_get_their_status_and_change_nothing(  # type: ignore[no-untyped-def]
    sidecar: Sidecar, client: SidecarClient, oracle: list[list[int]], name: str, make, code: Code
) -> None:
    before = client.info().weight_version
    assert greedy_tokens(client) == oracle
    err = push_raw(sidecar.address, make())
    assert err.code() == code, err.details()
    assert err.details()  # every refusal says what was wrong
    assert client.info().weight_version == before
    assert greedy_tokens(client) == oracle  # nothing half-applied


def _generate_error(client: SidecarClient, msg: rollout_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(services.RolloutStub(client.channel).Generate(msg, timeout=DEADLINE))
    return err.value


def _req(prompts: list[list[int]] | None = None, **sampling: object) -> rollout_pb2.GenerateRequest:
    params = {"temperature": 0.0, "max_new_tokens": 4} | sampling
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=p) for p in (prompts if prompts is not None else [[1, 2]])],
        sampling=rollout_pb2.SamplingParams(**params),  # type: ignore[arg-type]
    )


def _with(msg: rollout_pb2.GenerateRequest, **fields: object) -> rollout_pb2.GenerateRequest:
    for k, v in fields.items():
        setattr(msg, k, v)
    return msg


GENERATE_CASES = [
    ("no prompts", lambda: _req([]), Code.INVALID_ARGUMENT),
    ("empty prompt", lambda: _req([[1], []]), Code.INVALID_ARGUMENT),
    ("out-of-vocab id", lambda: _req([[1, 64]]), Code.INVALID_ARGUMENT),
    (
        "no sampling",
        lambda: rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[1])]),
        Code.INVALID_ARGUMENT,
    ),
    ("max_new_tokens 0", lambda: _req(max_new_tokens=0), Code.INVALID_ARGUMENT),
    ("negative temperature", lambda: _req(temperature=-1.0), Code.INVALID_ARGUMENT),
    ("top_p 0", lambda: _req(top_p=0.0), Code.INVALID_ARGUMENT),
    ("k beyond max", lambda: _with(_req(), speculation_k=99), Code.INVALID_ARGUMENT),
    ("beyond the context", lambda: _req([[1] * 60], max_new_tokens=200), Code.INVALID_ARGUMENT),
    ("too many prompts", lambda: _req([[1]] * 65), Code.INVALID_ARGUMENT),
    ("too many samples", lambda: _with(_req([[1]] * 2), samples_per_prompt=200), Code.INVALID_ARGUMENT),
    ("prompt over the limit", lambda: _req([[1] * 65]), Code.INVALID_ARGUMENT),
    ("max_new_tokens over the limit", lambda: _req(max_new_tokens=251), Code.INVALID_ARGUMENT),
    ("oversize message", lambda: _req([[2**31] * 300_000]), Code.RESOURCE_EXHAUSTED),
    ("weights too old", lambda: _with(_req(), min_weight_version=10**6), Code.FAILED_PRECONDITION),
]


@pytest.mark.parametrize(("name", "make", "code"), GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_bad_generate_requests_get_their_status(  # type: ignore[no-untyped-def]
    client: SidecarClient, oracle: list[list[int]], name: str, make, code: Code
) -> None:
    err = _generate_error(client, make())
    assert err.code() == code, err.details()
    assert err.details()
    assert greedy_tokens(client) == oracle


def test_control_rpcs_refuse_bad_values(client: SidecarClient) -> None:
    with pytest.raises(SidecarCallError) as err:
        client.set_speculation(99)
    assert err.value.code == Code.INVALID_ARGUMENT and "max_speculation_k" in err.value.details
    with pytest.raises(grpc.RpcError) as raw:
        services.WeightStub(client.channel).DescribeWeights(
            weights_pb2.DescribeWeightsRequest(selector=42), timeout=DEADLINE
        )
    assert raw.value.code() == Code.INVALID_ARGUMENT
    with pytest.raises(SidecarCallError) as err:
        client.abort("")
    assert err.value.code == Code.INVALID_ARGUMENT
    assert client.abort("no-such-request") == (False, 0)


def test_a_concurrent_push_is_aborted(sidecar: Sidecar, client: SidecarClient, oracle: list[list[int]]) -> None:
    release = threading.Event()
    msgs = good_messages(version=7)

    def slow() -> Iterator[weights_pb2.PushWeightsRequest]:
        yield msgs[0]
        release.wait(DEADLINE)

    with grpc.insecure_channel(sidecar.address) as ch:
        first = services.WeightStub(ch).PushWeights.future(slow(), timeout=DEADLINE)
        wait_until(lambda: sidecar.control.stats() is not None and _push_busy(sidecar), what="push")
        err = push_raw(sidecar.address, good_messages(version=8))
        assert err.code() == Code.ABORTED and "another weight push" in err.details()
        first.cancel()  # the first client goes away mid-push
        release.set()
    wait_until(lambda: not _push_busy(sidecar), what="push lock release")
    assert client.info().weight_version == 0
    assert greedy_tokens(client) == oracle


def _push_busy(sc: Sidecar) -> bool:
    lock = sc.weights._receiver._lock  # type: ignore[attr-defined]
    return bool(lock.locked())


def test_describe_weights_lists_the_selected_part(client: SidecarClient) -> None:
    every, version = client.describe_weights(WeightSelector.ALL)
    target, _ = client.describe_weights(WeightSelector.TARGET)
    draft, _ = client.describe_weights(WeightSelector.DRAFT)
    state = weights(0)
    assert version == 0
    assert {s.name for s in every} == set(state)
    assert {s.name for s in draft} == {n for n in state if n.startswith("mtp.layers.")}
    assert {s.name for s in target} | {s.name for s in draft} == set(state)
    assert all(tuple(state[s.name].shape) == s.shape and s.dtype == torch.float32 for s in every)


def test_info_stats_and_metrics_agree_with_the_samples(sidecar: Sidecar, client: SidecarClient) -> None:
    info = client.info()
    assert info.engine.engine == "torch" and info.engine.model.vocab_size == 64
    assert info.engine.speculation_method == "mtp" and info.engine.speculation_k == 2
    assert info.protocol == "specrl.v1" and info.gpus == []  # no GPU here: NVML cleanly absent
    assert info.limits.max_new_tokens == 250
    before = client.stats()
    samples = client.generate(greedy_request(samples_per_prompt=2))
    after = client.stats()
    delta = after.total.minus(before.total)
    assert delta.generated_tokens == sum(len(s.token_ids) for s in samples)
    assert delta.verify_steps == sum(s.counters.verify_steps for s in samples)
    assert delta.drafted_tokens == sum(s.counters.drafted_tokens for s in samples) > 0
    assert after.weight_version == 0 and after.uptime_seconds > 0
    assert [v.weight_version for v in after.versions] == [0]
    assert after.versions[0].busy_seconds > 0
    prompts = {tuple(p) for p in PROMPTS}  # each prompt's two samples share one prefill
    (was,), (now,) = before.versions, after.versions
    assert now.prompt_tokens - was.prompt_tokens == 2 * sum(len(p) for p in PROMPTS)
    assert now.prefill_tokens - was.prefill_tokens == sum(len(p) for p in prompts)
    body = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=DEADLINE).read()
    text = body.decode()
    total = client.stats().total
    assert f"specrl_generated_tokens_total {float(total.generated_tokens)}" in text
    assert f"specrl_prefill_tokens_total {float(client.stats().versions[0].prefill_tokens)}" in text
    assert "specrl_weight_version 0.0" in text
    assert 'specrl_position_acceptance_rate{position="0"}' in text


def test_the_engines_kv_blocks_reach_getstats_and_prometheus_each_step(
    sidecar: Sidecar, client: SidecarClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever `Engine.kv_usage()` says at an engine step is what GetStats (over gRPC) and the
    Prometheus text report: the figures are planted in the engine, then changed between requests."""
    figures = [
        KVUsage(block_size=16, blocks_total=900, blocks_used=37, blocks_shared=5, preemptions=3, blocks_cached=9),
        KVUsage(
            block_size=16,
            blocks_total=900,
            blocks_used=12,
            blocks_shared=0,
            preemptions=4,
            blocks_cached=20,
            prefix_cache_evictions=6,
        ),
    ]
    engine_now = {"kv": KVUsage()}
    monkeypatch.setattr(sidecar.scheduler._engine, "kv_usage", lambda: engine_now["kv"])
    for kv in figures:
        engine_now["kv"] = kv
        client.generate(greedy_request())
        # the stream ends as its last sample leaves, a moment before the step's snapshot refresh
        wait_until(lambda kv=kv: client.stats().kv == kv, what="the engine's KV blocks in GetStats")
        url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=DEADLINE).read().decode()
        assert "specrl_kv_block_size 16.0" in text and "specrl_kv_blocks_total 900.0" in text
        assert f"specrl_kv_blocks_used {float(kv.blocks_used)}" in text
        assert f"specrl_kv_blocks_shared {float(kv.blocks_shared)}" in text
        assert "# TYPE specrl_preemptions_total counter" in text
        assert f"specrl_preemptions_total {float(kv.preemptions)}" in text
        assert f"specrl_kv_blocks_cached {float(kv.blocks_cached)}" in text
        assert f"specrl_prefix_cache_evictions_total {float(kv.prefix_cache_evictions)}" in text


def test_speculation_off_gives_the_same_greedy_output(client: SidecarClient, oracle: list[list[int]]) -> None:
    assert client.set_speculation(0) == 2
    try:
        before = client.stats().total
        assert greedy_tokens(client) == oracle
        assert client.stats().total.minus(before).drafted_tokens == 0
    finally:
        client.set_speculation(2)


def test_automatic_speculation_over_grpc_is_lossless_and_says_why(
    sidecar: Sidecar, client: SidecarClient, oracle: list[list[int]]
) -> None:
    assert not client.info().engine.speculation_status.speculation_auto
    assert client.set_speculation(3, speculation_auto=True) == 2
    try:
        info = client.info()
        assert info.engine.speculation_status.speculation_auto and info.engine.speculation_k == 3
        assert greedy_tokens(client) == oracle  # whatever k the controller picks per step
        status = client.stats().speculation
        assert status.speculation_auto and status.reason in ("model", "probe", "guard") and status.batch_size >= 1
        assert len(status.acceptance) == 3 and status.detail
        body = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=DEADLINE)
        text = body.read().decode()
        assert "specrl_speculation_auto 1.0" in text
        assert f'specrl_speculation_reason{{reason="{status.reason}"}} 1.0' in text
        assert "specrl_speculation_guard_trips_total" in text
    finally:
        client.set_speculation(2)
    assert client.stats().speculation.reason == "fixed" and not client.info().engine.speculation_status.speculation_auto


def test_abort_returns_partial_samples(checkpoint: Path) -> None:
    with start_sidecar(checkpoint) as sc, SidecarClient(sc.address) as c:
        c.pause()  # hold the request so the abort surely finds it live
        request = greedy_request([[1, 2]], n=64, request_id="to-abort", samples_per_prompt=3)
        got: list = []  # type: ignore[type-arg]
        t = threading.Thread(target=lambda: got.extend(c.stream_generate(request)))
        t.start()
        wait_until(lambda: c.stats().queued_sequences + c.stats().running_sequences == 3, what="admission")
        assert c.abort("to-abort") == (True, 3)
        t.join(DEADLINE)
        assert len(got) == 3 and all(s.finish_reason == FinishReason.ABORT for s in got)
        assert c.resume() is True


def test_an_abort_that_overtakes_its_request_still_answers_every_sample(checkpoint: Path) -> None:
    """An Abort handled before the Generate it names reaches the engine (the abort was queued on
    the scheduler first: the two calls raced) still ends that stream with every sample, as ABORT
    samples without tokens (rollout.proto: "Its unfinished samples are streamed with
    FINISH_REASON_ABORT"), never with an OK stream short of samples. Found by tools/soak."""
    with start_sidecar(checkpoint) as sc:
        scheduler = sc.scheduler
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:  # keeps the scheduler thread between two commands
            holding.set()
            release.wait(DEADLINE)

        scheduler._schedule(hold)
        assert holding.wait(DEADLINE)
        answer: list[tuple[bool, int]] = []
        aborter = threading.Thread(target=lambda: answer.append(scheduler.abort("overtaken")))
        aborter.start()
        wait_until(lambda: scheduler._commands.qsize() == 1, what="the abort queued")
        handle = scheduler.submit(greedy_request([[1, 2], [3]], n=8, request_id="overtaken", samples_per_prompt=2))
        release.set()
        aborter.join(DEADLINE)
        got = []
        while (sample := handle.get(DEADLINE)) is not None:
            got.append(sample)
        assert answer == [(True, 4)]
        assert sorted((s.prompt_index, s.sample_index) for s in got) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(s.finish_reason is FinishReason.ABORT and s.token_ids == [] for s in got)
        assert all(s.weight_version == s.last_weight_version == scheduler._engine.weight_version for s in got)
        assert not scheduler._live


def test_pause_holds_work_and_resume_finishes_it(checkpoint: Path, oracle: list[list[int]]) -> None:
    with start_sidecar(checkpoint) as sc, SidecarClient(sc.address) as c:
        assert c.pause() is False and c.info().paused
        got: list = []  # type: ignore[type-arg]
        t = threading.Thread(target=lambda: got.extend(c.generate(greedy_request())))
        t.start()
        wait_until(lambda: c.stats().queued_sequences == len(PROMPTS), what="queued")
        t.join(0.3)
        assert got == []
        assert c.resume() is True and not c.info().paused
        t.join(DEADLINE)
        assert [s.token_ids for s in got] == oracle


def test_overload_is_refused_and_a_disconnect_frees_the_slots(checkpoint: Path, oracle: list[list[int]]) -> None:
    limits = RequestLimits(max_prompts=8, max_samples=4, max_prompt_tokens=16, max_new_tokens=64)
    with (
        start_sidecar(checkpoint, limits=limits, scheduler=SchedulerConfig(max_live_sequences=4)) as sc,
        SidecarClient(sc.address) as c,
    ):
        c.pause()
        leaver = SidecarClient(sc.address)
        errors: list[SidecarCallError] = []

        def hold() -> None:
            try:
                leaver.generate(greedy_request([[1]] * 4, n=64))
            except SidecarCallError as e:
                errors.append(e)

        holder = threading.Thread(target=hold)
        holder.start()
        wait_until(lambda: c.stats().queued_sequences == 4, what="first request admitted")
        with pytest.raises(SidecarCallError) as err:
            c.generate(greedy_request([[2]]))
        assert err.value.code == Code.RESOURCE_EXHAUSTED and "retry" in err.value.details
        leaver.close()  # the client goes away: its slots are freed
        holder.join(DEADLINE)
        assert errors and errors[0].code == Code.CANCELLED
        wait_until(lambda: c.stats().queued_sequences + c.stats().running_sequences == 0, what="slots freed")
        c.resume()
        assert [s.token_ids for s in c.generate(greedy_request(PROMPTS[:1]))] == oracle[:1]


def test_a_duplicate_live_request_id_is_refused(checkpoint: Path) -> None:
    with start_sidecar(checkpoint) as sc, SidecarClient(sc.address) as c:
        c.pause()
        holder = threading.Thread(target=lambda: c.generate(greedy_request([[1]], request_id="same")))
        holder.start()
        wait_until(lambda: c.stats().queued_sequences == 1, what="admission")
        with pytest.raises(SidecarCallError) as err:
            c.generate(greedy_request([[1]], request_id="same"))
        assert err.value.code == Code.INVALID_ARGUMENT and "already live" in err.value.details
        c.resume()
        holder.join(DEADLINE)


def test_sampling_with_a_seed_is_reproducible_and_reports_logprobs(client: SidecarClient) -> None:
    request = GenerationRequest(
        prompts=[[3, 4]], sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=123), samples_per_prompt=2
    )
    a, b = client.generate(request), client.generate(request)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert all(len(s.logprobs) == len(s.token_ids) and all(lp <= 0 for lp in s.logprobs) for s in a)


def test_a_pool_worth_four_full_rows_serves_32_short_requests_at_once(tmp_path: Path) -> None:
    """Issue 48: a KV budget that a cache reserving whole rows would have split into 4 rows of a
    1024-token context serves 32 concurrent short requests together — none refused, each equal to
    itself run alone — and GetStats and Prometheus show them running at once in a few blocks."""
    config = ModelConfig.tiny(max_position_embeddings=1024)
    path = tmp_path / "long"
    save_checkpoint(path, config, model_state_dict(build_model(config, seed=5)))
    per_token = TorchEngine.from_checkpoint(path, max_batch_size=1).drafter.token_bytes()
    budget = 4 * (1024 + 8 + 2) * per_token  # 4 rows of max_context + max_speculation_k + 2 slots
    prompts = [[1 + i % 50, 2 + i % 7, 3] for i in range(32)]
    alone = TorchEngine.from_checkpoint(path, speculation_k=2)
    want = [alone.generate(greedy_request([p], n=24))[0].token_ids for p in prompts]
    with (
        start_sidecar(path, max_batch_size=32, engine_options={"kv_cache_gib": budget / 2**30}, metrics_port=0) as sc,
        SidecarClient(sc.address) as c,
    ):
        c.pause()  # all 32 queue first, so that they are admitted together
        got: dict[int, list[int]] = {}
        errors: list[Exception] = []

        def call(i: int) -> None:
            try:
                got[i] = c.generate(greedy_request([prompts[i]], n=24, request_id=f"short-{i}"))[0].token_ids
            except Exception as e:  # a refusal fails the test below
                errors.append(e)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        wait_until(lambda: c.stats().queued_sequences == 32, what="32 queued")
        c.resume()
        peak_rows = peak_blocks = 0
        while any(t.is_alive() for t in threads):
            stats = c.stats()
            peak_rows = max(peak_rows, stats.running_sequences)
            peak_blocks = max(peak_blocks, stats.kv.blocks_used)
        for t in threads:
            t.join(DEADLINE)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{sc.metrics_port}/metrics", timeout=DEADLINE).read()
        kv = c.stats().kv
    assert errors == []
    assert [got[i] for i in range(32)] == want
    assert peak_rows == 32  # all at once, where whole-row reservations would have run 4
    assert 32 <= peak_blocks <= kv.blocks_total and kv.blocks_total * kv.block_size <= 4 * (1024 + 10)
    assert kv.blocks_used == 0 and kv.preemptions == 0
    assert f"specrl_kv_blocks_total {float(kv.blocks_total)}".encode() in metrics
