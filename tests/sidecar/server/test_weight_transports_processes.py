"""The weight transports across real processes: a `specrl serve` subprocess receives over a
gloo group and over shared memory exactly the model pushed (greedy output equals the oracle);
a sidecar killed mid-broadcast fails the push within the group's bounded wait, the group is
dropped and rebuilt for the restarted sidecar; a sender process killed mid-transfer, on every
transport, leaves the old weights and version serving and the next push goes through."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.client.transport import CollectiveConfig, TransportConfig
from sidecar.engine.config import EngineConfig
from sidecar.serve_config import ServeConfig
from sidecar.types import WeightTransport
from tests.sidecar_fixtures import greedy_oracle, greedy_tokens, make_checkpoint, start_sidecar, weights
from trainer.rl.local_sidecars import LocalSidecars

pytestmark = pytest.mark.usefixtures("single_torch_thread")
ROOT = Path(__file__).resolve().parents[3]
GLOO = CollectiveConfig(host="127.0.0.1", timeout_s=20.0, bucket_bytes=16 << 10)


def test_collective_and_shm_deliver_to_a_sidecar_process_and_survive_its_death(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "tiny", seed=0)
    with LocalSidecars(model, 1, tmp_path / "logs", serve=ServeConfig(engine=EngineConfig(speculation_k=2))) as local:
        (address,) = local.start()
        config = ClientConfig(timeout_s=30.0, transports=TransportConfig(shm=False, collective=GLOO))
        with SidecarClient(address, config) as c:
            result = c.push_weights(weights(1), version=1)
            assert result.transport is WeightTransport.COLLECTIVE
            assert greedy_tokens(c) == greedy_oracle(1)

            # The sidecar dies while the sender is between buckets: the push fails within the
            # group's timeout, naming the failure, and the group is dropped.
            specs, _ = c.describe_weights()
            w2 = weights(2)

            def slow() -> Iterator[tuple[str, object]]:
                for n, s in enumerate(specs):
                    if n == len(specs) // 2:
                        local.kill(0)
                    yield s.name, w2[s.name]

            started = time.monotonic()
            with pytest.raises(SidecarCallError):
                c.push_weights(slow(), version=2, specs=specs)  # type: ignore[arg-type]
            assert time.monotonic() - started < GLOO.timeout_s + 30  # bounded (generous)
            assert c.transport_session.choice is None  # dropped: the next push negotiates again

        # The restarted sidecar gets a new group; the old weights were never half-applied.
        address = local.restart(0)
        with SidecarClient(address, config) as c:
            assert c.info().weight_version == 0
            assert c.push_weights(weights(3), version=1).transport is WeightTransport.COLLECTIVE
            assert greedy_tokens(c) == greedy_oracle(3)
        with SidecarClient(address, ClientConfig(timeout_s=30.0)) as c:  # default: shm, proven
            assert c.push_weights(weights(4), version=2).transport is WeightTransport.SHM
            assert greedy_tokens(c) == greedy_oracle(4)


_SENDER = """
import sys, time
from sidecar.client.client import ClientConfig, SidecarClient
from sidecar.client.transport import CollectiveConfig, TransportConfig
from tests.sidecar_fixtures import weights

address, transport = sys.argv[1], sys.argv[2]
transports = {
    "grpc": TransportConfig(shm=False),
    "shm": TransportConfig(),
    "collective": TransportConfig(shm=False, collective=CollectiveConfig(host="127.0.0.1", bucket_bytes=16 << 10)),
}[transport]
with SidecarClient(address, ClientConfig(transports=transports)) as c:
    choice = c.negotiate_transport()
    assert choice.transport.value == transport, choice
    specs, version = c.describe_weights()
    w = weights(5)

    def tensors():
        for n, s in enumerate(specs):
            if n == len(specs) // 2:
                print("HALF", flush=True)
                time.sleep(120)
            yield s.name, w[s.name]

    c.push_weights(tensors(), version=version + 1, specs=specs, chunk_bytes=4096)
"""


@pytest.mark.parametrize("transport", ["grpc", "shm", "collective"])
def test_a_sender_killed_mid_transfer_leaves_the_old_weights_serving(tmp_path: Path, transport: str) -> None:
    model = make_checkpoint(tmp_path / "tiny", seed=0)
    with start_sidecar(model) as sc:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        sender = subprocess.Popen(
            [sys.executable, "-c", _SENDER, sc.address, transport],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert sender.stdout is not None
            line = sender.stdout.readline()
            assert line.strip() == "HALF", line + sender.stdout.read()
            time.sleep(0.3)  # let the first half reach the sidecar
        finally:
            sender.kill()
            sender.wait(30)
        config = TransportConfig(shm=transport == "shm", collective=GLOO if transport == "collective" else None)
        with SidecarClient(sc.address, ClientConfig(timeout_s=30.0, transports=config)) as c:
            deadline = time.monotonic() + 60
            while sc.weights._receiver._lock.locked() and time.monotonic() < deadline:
                time.sleep(0.05)  # the sidecar notices the dead sender (stream or group)
            assert c.info().weight_version == 0
            assert greedy_tokens(c) == greedy_oracle(0)
            # The next sender gets through on the same transport (a new group for collective).
            assert c.push_weights(weights(6), version=1).transport.value == transport
            assert greedy_tokens(c) == greedy_oracle(6)
