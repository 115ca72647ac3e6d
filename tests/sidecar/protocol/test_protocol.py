"""The specrl.v1 protocol: stubs match the protos, lint passes, every message round-trips,
and the domain conversion is lossless in both directions."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from google.protobuf import descriptor, json_format
from hypothesis import given
from hypothesis import strategies as st

from sidecar.errors import InvalidRequestError
from sidecar.model.moe import packed_routes
from sidecar.protocol import convert, convert_stats
from sidecar.protocol.specrl.v1 import common_pb2, control_pb2, rollout_pb2, weights_pb2
from sidecar.types import (
    ROUTE_REQUESTS,
    DraftCollapse,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    GpuTelemetry,
    KVUsage,
    ModelInfo,
    RequestLimits,
    Routes,
    Sample,
    SamplingParams,
    SidecarInfo,
    SidecarStats,
    SpeculationCounters,
    TensorSpec,
    VersionStats,
    WeightSelector,
)

ROOT = Path(__file__).resolve().parents[3]
FILES = (common_pb2, rollout_pb2, weights_pb2, control_pb2)
FD = descriptor.FieldDescriptor


def test_generated_stubs_match_the_protos() -> None:
    result = subprocess.run(
        [sys.executable, "tools/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_passes() -> None:
    buf = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
    assert buf, "buf not found: install the dev extra (buf-bin) with tools/setup-env"
    result = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _all_messages() -> list[descriptor.Descriptor]:
    found: list[descriptor.Descriptor] = []

    def walk(d: descriptor.Descriptor) -> None:
        found.append(d)
        for nested in d.nested_types:
            walk(nested)

    for module in FILES:
        for d in module.DESCRIPTOR.message_types_by_name.values():
            walk(d)
    return found


def _fill(msg, depth: int = 0) -> None:
    """Set every field of `msg` to a non-default value (one oneof member at a time is kept)."""
    for i, field in enumerate(msg.DESCRIPTOR.fields):
        value: object
        if field.type == FD.TYPE_MESSAGE:
            if depth > 3:
                continue
            if field.is_repeated:
                for _ in range(2):
                    _fill(getattr(msg, field.name).add(), depth + 1)
            else:
                _fill(getattr(msg, field.name), depth + 1)
                if not getattr(msg, field.name).ByteSize():  # empty messages: mark present
                    getattr(msg, field.name).SetInParent()
            continue
        if field.type == FD.TYPE_ENUM:
            value = field.enum_type.values[-1].number
        elif field.type == FD.TYPE_STRING:
            value = f"{field.name}-é"
        elif field.type == FD.TYPE_BYTES:
            value = bytes(range(i, i + 7))
        elif field.type == FD.TYPE_BOOL:
            value = True
        elif field.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            value = 0.5 + i
        else:
            value = 3 + i
        if field.is_repeated:
            getattr(msg, field.name).extend([value, value])
        else:
            setattr(msg, field.name, value)


@pytest.mark.parametrize("desc", _all_messages(), ids=lambda d: d.full_name)
def test_every_message_round_trips(desc: descriptor.Descriptor) -> None:
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(desc)
    msg = cls()
    _fill(msg)
    assert cls.FromString(msg.SerializeToString()) == msg
    assert json_format.Parse(json_format.MessageToJson(msg), cls()) == msg
    if desc.fields:  # the filler really populated it (the round trip is not of an empty message)
        assert msg.ListFields()


# --- domain <-> protobuf conversion ------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**63)
finite = st.floats(0, 1e6, width=32)
counters = st.builds(
    SpeculationCounters,
    verify_steps=u64,
    drafted_tokens=u64,
    accepted_tokens=u64,
    generated_tokens=u64,
    drafted_per_position=st.lists(u64, max_size=8),
    accepted_per_position=st.lists(u64, max_size=8),
)
sampling = st.builds(
    SamplingParams,
    # 0 (greedy) or a servable temperature: SamplingParams refuses 0 < T < 1e-5 (issue 14).
    temperature=st.just(0.0) | st.floats(2**-15, 1e6, width=32),
    top_p=st.floats(0.015625, 1.0, width=32),
    top_k=u32,
    max_new_tokens=st.integers(1, 2**32 - 1),
    stop_token_ids=st.lists(u32, max_size=4).map(tuple),
    seed=st.none() | u64,
)


@given(sampling, st.lists(st.lists(u32, min_size=1, max_size=5), min_size=1, max_size=4), st.integers(1, 64))
def test_generation_request_round_trips(params: SamplingParams, prompts: list[list[int]], g: int) -> None:
    for k, routes in zip((None, 0, 3), ROUTE_REQUESTS, strict=True):
        request = GenerationRequest(
            prompts=prompts,
            sampling=params,
            samples_per_prompt=g,
            request_id="r",
            min_weight_version=7,
            speculation_k=k,
            routes=routes,
        )
        assert convert.generation_request_from_pb(convert.generation_request_to_pb(request)) == request


def test_routes_requests_are_named_and_checked() -> None:
    msg = convert.generation_request_to_pb(GenerationRequest(prompts=[[1]], routes="sequence"))
    assert msg.routes == rollout_pb2.ROUTE_REQUEST_SEQUENCE
    assert convert.generation_request_to_pb(GenerationRequest(prompts=[[1]])).routes == rollout_pb2.ROUTE_REQUEST_OFF
    msg.routes = 7  # an enum value this version does not know
    with pytest.raises(InvalidRequestError, match="not a known RouteRequest"):
        convert.generation_request_from_pb(msg)
    with pytest.raises(ValueError, match="routes must be one of 'off', 'generated', 'sequence', got 'all'"):
        GenerationRequest(prompts=[[1]], routes="all")


@st.composite
def routes_of(draw: st.DrawFn) -> Routes:
    experts = draw(st.sampled_from([8, 256, 257, 4096]))
    shape = (draw(st.integers(0, 6)), draw(st.integers(0, 4)), draw(st.integers(1, 8)))
    seed = draw(st.integers(0, 2**16))
    ids = torch.randint(0, experts, shape, generator=torch.Generator().manual_seed(seed))
    return Routes(expert_ids=packed_routes(ids, experts), first_position=draw(st.integers(0, 2**20)))


@given(routes_of())
def test_routes_round_trip_in_a_sample(routes: Routes) -> None:
    sample = Sample(
        request_id="req",
        prompt_index=0,
        sample_index=0,
        token_ids=[1, 2],
        logprobs=[-0.5, -0.25],
        finish_reason=FinishReason.LENGTH,
        weight_version=1,
        last_weight_version=1,
        routes=routes,
    )
    back = convert.sample_from_pb(convert.sample_to_pb(sample))
    assert back == sample and back.routes is not None and back.routes.expert_ids.dtype == routes.expert_ids.dtype


def test_routes_travel_row_major_and_little_endian() -> None:
    """The wire layout by hand (the oracle): ids of (positions, layers, top_k) in C order, 1 byte
    each up to 256 experts, 2 little-endian bytes beyond."""
    small = convert.routes_to_pb(
        Routes(expert_ids=torch.tensor([[[1, 2]], [[3, 255]]], dtype=torch.uint8), first_position=4)
    )
    assert (small.expert_ids, small.positions, small.sparse_layers, small.top_k) == (bytes([1, 2, 3, 255]), 2, 1, 2)
    assert (small.id_bytes, small.first_position) == (1, 4)
    wide = convert.routes_to_pb(Routes(expert_ids=torch.tensor([[[258, 7]]], dtype=torch.int16), first_position=0))
    assert (wide.expert_ids, wide.id_bytes) == (bytes([2, 1, 7, 0]), 2)
    wide.expert_ids = wide.expert_ids[:3]
    with pytest.raises(InvalidRequestError, match=r"3 bytes do not hold \(1, 1, 2\) ids of id_bytes=2"):
        convert.routes_from_pb(wide)
    small.id_bytes = 4
    with pytest.raises(InvalidRequestError, match="id_bytes=4"):
        convert.routes_from_pb(small)
    with pytest.raises(ValueError, match="uint8 or int16"):
        Routes(expert_ids=torch.zeros(1, 1, 1, dtype=torch.int64), first_position=0)


@given(counters, st.sampled_from(list(FinishReason)), st.lists(u32, max_size=6))
def test_sample_round_trips(c: SpeculationCounters, reason: FinishReason, tokens: list[int]) -> None:
    sample = Sample(
        request_id="req",
        prompt_index=3,
        sample_index=1,
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),  # exactly representable in float32
        finish_reason=reason,
        weight_version=4,
        last_weight_version=5,
        counters=c,
    )
    assert convert.sample_from_pb(convert.sample_to_pb(sample)) == sample


@given(
    st.builds(
        KVUsage,
        block_size=u32,
        blocks_total=u32,
        blocks_used=u32,
        blocks_shared=u32,
        preemptions=u64,
        blocks_cached=u32,
        prefix_cache_evictions=u64,
    )
)
def test_kv_usage_round_trips_in_getstats(kv: KVUsage) -> None:
    stats = SidecarStats(versions=[], total=SpeculationCounters(), weight_version=0, kv=kv)
    assert convert_stats.stats_from_pb(convert_stats.stats_to_pb(stats)) == stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_spec_round_trips(dtype: torch.dtype) -> None:
    spec = TensorSpec(name="model.norm.weight", dtype=dtype, shape=(3, 5), crc32=0xDEADBEEF)
    msg = convert.tensor_spec_to_pb(spec)
    assert msg.byte_length == 15 * torch.empty((), dtype=dtype).element_size()
    assert convert.tensor_spec_from_pb(msg) == spec


def test_tensor_spec_with_wrong_byte_length_is_rejected() -> None:
    msg = convert.tensor_spec_to_pb(TensorSpec(name="w", dtype=torch.float32, shape=(2, 2)))
    msg.byte_length = 15
    with pytest.raises(InvalidRequestError, match="byte_length 15 does not match"):
        convert.tensor_spec_from_pb(msg)
    msg.dtype = weights_pb2.D_TYPE_UNSPECIFIED
    with pytest.raises(InvalidRequestError, match="dtype"):
        convert.tensor_spec_from_pb(msg)


def test_selector_unspecified_means_all() -> None:
    assert convert.selector_from_pb(common_pb2.WEIGHT_SELECTOR_UNSPECIFIED) is WeightSelector.ALL
    for s in WeightSelector:
        assert convert.selector_from_pb(convert.selector_to_pb(s)) is s
    with pytest.raises(InvalidRequestError, match="not a WeightSelector"):
        convert.selector_from_pb(99)


def test_bad_sampling_from_the_wire_is_an_invalid_request() -> None:
    msg = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=[1])], sampling=rollout_pb2.SamplingParams(max_new_tokens=0)
    )
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be > 0"):
        convert.generation_request_from_pb(msg)
    msg.sampling.max_new_tokens = 4
    msg.sampling.top_p = 0.0
    with pytest.raises(InvalidRequestError, match="top_p"):
        convert.generation_request_from_pb(msg)
    with pytest.raises(InvalidRequestError, match="sampling is missing"):
        convert.generation_request_from_pb(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[1])]))
    with pytest.raises(InvalidRequestError, match=r"prompts\[0\] is empty"):
        convert.generation_request_from_pb(
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt()], sampling=rollout_pb2.SamplingParams(max_new_tokens=1)
            )
        )


def _info() -> SidecarInfo:
    return SidecarInfo(
        engine=EngineInfo(
            model=ModelInfo(
                name="tiny",
                architecture="Qwen3ForCausalLM",
                vocab_size=64,
                hidden_size=32,
                num_layers=2,
                max_position_embeddings=128,
                rope_type="yarn",
                rope_factor=4.0,
                num_mtp_layers=1,
                dtype="float32",
                family="qwen3",
            ),
            engine="torch",
            engine_version="0.1.0",
            device_kind="cpu",
            device_name="x86",
            speculation_method="mtp",
            speculation_k=3,
            max_speculation_k=8,
        ),
        weight_version=9,
        paused=True,
        limits=RequestLimits(max_prompts=2, max_samples=3, max_prompt_tokens=4, max_new_tokens=5),
        gpus=[GpuTelemetry(index=0, name="H100", memory_total_bytes=80, memory_used_bytes=1, power_watts=250.5)],
        specrl_version="0.1.0",
    )


def test_info_and_stats_round_trip() -> None:
    info = _info()
    assert convert.info_from_pb(convert.info_to_pb(info)) == info
    c = SpeculationCounters(verify_steps=10, drafted_tokens=30, accepted_tokens=20, generated_tokens=30)
    stats = SidecarStats(
        versions=[
            VersionStats(
                weight_version=1,
                counters=c,
                samples_finished=4,
                busy_seconds=1.5,
                prompt_tokens=96,
                prefill_tokens=12,
                prefix_cache_hit_tokens=40,
            )
        ],
        total=c,
        weight_version=1,
        queued_sequences=2,
        running_sequences=3,
        uptime_seconds=9.25,
        kv=KVUsage(block_size=16, blocks_total=4096, blocks_used=300, blocks_shared=40, preemptions=2),
    )
    assert convert_stats.stats_from_pb(convert_stats.stats_to_pb(stats)) == stats
    assert not convert_stats.stats_to_pb(stats).HasField("draft_collapsed")  # absent while no alarm is raised
    stats.draft_collapsed = DraftCollapse(
        weight_version=7, latest_version=9, reference_version=6, tau_before=2.5, tau_after=1.0, verify_steps=640
    )
    stats.draft_collapses = 2
    assert convert_stats.stats_from_pb(convert_stats.stats_to_pb(stats)) == stats


def test_counter_arithmetic_against_hand_counts() -> None:
    # Two verify steps with k=3: accepted 2 then 0 drafts -> generated 3 + 1 tokens.
    a = SpeculationCounters(
        verify_steps=2,
        drafted_tokens=6,
        accepted_tokens=2,
        generated_tokens=4,
        drafted_per_position=[2, 2, 2],
        accepted_per_position=[1, 1, 0],
    )
    total = SpeculationCounters()
    total.add(a)
    total.add(a)
    assert total.drafted_per_position == [4, 4, 4] and total.accepted_per_position == [2, 2, 0]
    assert total.minus(a) == a
    assert a.acceptance_length == 2.0 and a.acceptance_rate == pytest.approx(1 / 3)
    assert SpeculationCounters().acceptance_length == 0.0
