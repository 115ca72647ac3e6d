"""The client side: a fleet routing around a stopped sidecar, a client built from the .proto
files alone (no specrl import), property-based fuzzing of request messages, and `specrl serve`
as a real process with graceful shutdown on SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.client.client import ClientConfig, SidecarClient
from sidecar.client.fleet import Fleet, FleetConfig, NoLiveSidecarError
from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import rollout_pb2, weights_pb2
from sidecar.server.process import Sidecar
from sidecar.types import KVUsage
from tests.sidecar_fixtures import DEADLINE, PROMPTS, greedy_oracle, greedy_request, start_sidecar, weights
from trainer.cli.main import main

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ROOT = Path(__file__).resolve().parents[3]
Code = grpc.StatusCode


def test_the_fleet_spreads_prompts_and_routes_around_a_stopped_sidecar(pair: tuple[Sidecar, Sidecar]) -> None:
    a, b = pair
    prompts = [[i + 1, 2 * i + 1] for i in range(6)]
    expected = greedy_oracle(0, prompts)
    config = FleetConfig(client=ClientConfig(retries=0, timeout_s=5))
    with Fleet([a.address, b.address], config) as fleet:
        samples = fleet.generate(greedy_request(prompts)).samples
        assert [s.token_ids for s in samples] == expected
        assert [s.prompt_index for s in samples] == list(range(6))
        assert all(a.control.stats().total.generated_tokens > 0 for a in (a, b))  # both served
        assert set(fleet.push_weights(weights(0), 1).results) == {a.address, b.address}
        b.stop(0.2)
        result = fleet.generate(greedy_request(prompts))
        assert [s.token_ids for s in result.samples] == expected
        assert fleet.down() == [b.address] and any(b.address in e for e in result.events)
        report = fleet.push_weights(weights(0), 2)  # the live one takes it; the fleet moves on
        assert set(report.results) == {a.address} and fleet.version == 2
        a.stop(0.2)
        with pytest.raises(NoLiveSidecarError, match="no live sidecar"):
            fleet.generate(greedy_request(prompts))


FOREIGN_CLIENT = textwrap.dedent(
    """
    import json, sys
    import grpc
    from specrl.v1 import control_pb2, control_pb2_grpc, rollout_pb2, rollout_pb2_grpc
    address, prompts = sys.argv[1], json.loads(sys.argv[2])
    with grpc.insecure_channel(address) as ch:
        info = control_pb2_grpc.ControlServiceStub(ch).GetInfo(control_pb2.GetInfoRequest(), timeout=20)
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts],
            sampling=rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=8),
        )
        stream = rollout_pb2_grpc.RolloutServiceStub(ch).Generate(request, timeout=20)
        samples = sorted((r.sample.prompt_index, list(r.sample.token_ids)) for r in stream)
    assert not any(m.startswith("sidecar") for m in sys.modules), "must not use specrl's own code"
    print(json.dumps({"vocab": info.model.vocab_size, "protocol": info.protocol, "tokens": [t for _, t in samples]}))
    """
)


@pytest.mark.slow
def test_a_client_generated_from_the_proto_files_alone(sidecar: Sidecar, tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", *protos],
        check=True, timeout=120,
    )  # fmt: skip
    script = tmp_path / "foreign_client.py"
    script.write_text(FOREIGN_CLIENT)
    out = subprocess.run(
        [sys.executable, str(script), sidecar.address, json.dumps(PROMPTS)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["vocab"] == 64 and reply["protocol"] == "specrl.v1"
    assert reply["tokens"] == greedy_oracle(0, PROMPTS)


token_ids = st.integers(min_value=0, max_value=2**32 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def generate_requests(draw: st.DrawFn) -> rollout_pb2.GenerateRequest:
    sampling = rollout_pb2.SamplingParams(
        temperature=draw(st.one_of(floats, st.sampled_from([0.0, 0.7, 1.0]))),
        max_new_tokens=draw(st.one_of(st.integers(0, 6), st.integers(251, 2**32 - 1))),
        stop_token_ids=draw(st.lists(token_ids, max_size=3)),
    )
    if draw(st.booleans()):
        sampling.top_p = draw(floats)
    if draw(st.booleans()):
        sampling.top_k = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    msg = rollout_pb2.GenerateRequest(
        request_id=draw(st.text(max_size=8)),
        prompts=[rollout_pb2.Prompt(token_ids=p) for p in draw(st.lists(st.lists(token_ids, max_size=5), max_size=3))],
        samples_per_prompt=draw(st.integers(0, 3)),
        min_weight_version=draw(st.integers(0, 2)),
    )
    if draw(st.booleans()):
        msg.sampling.CopyFrom(sampling)
    if draw(st.booleans()):
        msg.speculation_k = draw(st.integers(0, 12))
    return msg


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=generate_requests())
def test_fuzzed_generate_requests_never_crash_the_server(sidecar: Sidecar, msg: rollout_pb2.GenerateRequest) -> None:
    with grpc.insecure_channel(sidecar.address) as ch:
        try:
            list(services.RolloutStub(ch).Generate(msg, timeout=DEADLINE))
        except grpc.RpcError as e:
            assert e.code() in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION), (e.code(), e.details())
    with SidecarClient(sidecar.address) as c:
        assert c.health()


names = st.sampled_from(["model.norm.weight", "model.embed_tokens.weight", "mtp.layers.0.enorm.weight", "x", ""])


@st.composite
def push_messages(draw: st.DrawFn) -> weights_pb2.PushWeightsRequest:
    kind = draw(st.sampled_from(["manifest", "chunk", "commit", "empty"]))
    if kind == "manifest":
        tensors = [
            weights_pb2.TensorSpec(
                name=draw(names),
                dtype=draw(st.integers(0, 5)),
                shape=draw(st.lists(st.integers(0, 2**40), max_size=3)),
                byte_length=draw(st.integers(0, 2**40)),
                crc32=draw(st.integers(0, 2**32 - 1)),
            )
            for _ in range(draw(st.integers(0, 3)))
        ]
        manifest = weights_pb2.WeightManifest(version=draw(st.integers(0, 3)), selector=draw(st.integers(0, 5)))
        manifest.tensors.extend(tensors)
        return weights_pb2.PushWeightsRequest(manifest=manifest)
    if kind == "chunk":
        data = draw(st.binary(max_size=64))
        return weights_pb2.PushWeightsRequest(
            chunk=weights_pb2.WeightChunk(
                tensor_index=draw(st.integers(0, 4)),
                offset=draw(st.integers(0, 128)),
                data=data,
                crc32=draw(st.integers(0, 2**32 - 1)),
            )
        )
    if kind == "commit":
        return weights_pb2.PushWeightsRequest(commit=weights_pb2.WeightCommit(chunk_count=draw(st.integers(0, 5))))
    return weights_pb2.PushWeightsRequest()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(push_messages(), max_size=6))
def test_fuzzed_push_streams_never_crash_or_change_the_model(
    sidecar: Sidecar, messages: list[weights_pb2.PushWeightsRequest]
) -> None:
    with grpc.insecure_channel(sidecar.address) as ch:
        with pytest.raises(grpc.RpcError) as err:  # random bytes never make a complete model
            services.WeightStub(ch).PushWeights(iter(messages), timeout=DEADLINE)
        assert err.value.code() in (Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION), (
            err.value.code(),
            err.value.details(),
        )
    with SidecarClient(sidecar.address) as c:
        assert c.health() and c.info().weight_version == 0


def test_serve_with_sglang_fails_clearly(checkpoint: Path) -> None:
    # Without SGLang installed (CI) it says what to install, on CPU and on CUDA alike.
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here; tests/with_sglang/ serves with it")
    for device in ("cpu", "cuda"):
        result = CliRunner().invoke(
            main, ["serve", "--model", str(checkpoint), "--engine", "sglang", "--device", device]
        )
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert "specrl[sglang]" in result.output, result.output
    # Options of one engine are refused for another.
    result = CliRunner().invoke(main, ["serve", "--model", str(checkpoint), "--sglang-arg", "max_total_tokens=64"])
    assert result.exit_code == 2 and "--engine sglang only" in result.output, result.output


def test_serve_states_the_size_of_the_kv_pool_it_pages() -> None:
    from sidecar.server.cli import kv_pool_line

    assert kv_pool_line(KVUsage()) is None  # an engine that pages no KV itself (SGLang) says nothing
    pool = KVUsage(block_size=16, blocks_total=2048, blocks_used=5, blocks_shared=1, preemptions=2)
    assert kv_pool_line(pool) == "KV cache: 2048 blocks of 16 tokens (32768 tokens)"


@pytest.mark.slow
def test_specrl_serve_runs_and_stops_gracefully_on_sigterm(checkpoint: Path) -> None:
    specrl = Path(sys.executable).parent / "specrl"
    proc = subprocess.Popen(
        [
            str(specrl),
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
            "--speculation-k",
            "2",
            "--shutdown-grace-s",
            "1",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        address = None
        for _ in range(200):  # log lines until the bound address
            line = proc.stderr.readline()
            if not line:
                break
            if "listening on" in line:
                address = line.rsplit(" ", 1)[-1].strip()
                break
        assert address, "serve never logged its address"
        with SidecarClient(address) as c:
            assert c.info().engine.speculation_k == 2
            assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(0, PROMPTS)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_new_client_reaches_a_restarted_sidecar_at_once(checkpoint: Path) -> None:
    """A client made after a sidecar came back on its old port connects at once: it does not
    inherit the reconnect back-off of an earlier client's failed connection to that address
    (gRPC shares subchannels between channels unless told not to), which the fleet's rejoin
    relies on."""
    from sidecar.engine.torch_engine import TorchEngine
    from sidecar.server.grpc_server import ServerConfig
    from sidecar.server.process import SidecarConfig

    first = start_sidecar(checkpoint)
    address, port = first.address, first.port
    first.stop(0.0)
    config = ClientConfig(timeout_s=2.0, retries=0)
    engine = TorchEngine.from_checkpoint(checkpoint, speculation_k=2)  # the slow part, before the race
    with SidecarClient(address, config) as old:
        assert not old.health()  # connection refused: this address's connection now backs off
        again = Sidecar(engine, SidecarConfig(server=ServerConfig(port=port), shutdown_grace_s=0.5)).start()
        try:
            with SidecarClient(address, config) as fresh:
                assert fresh.health()
        finally:
            again.stop(0.0)
