"""Weight pushes against a live, loaded sidecar: a push changes greedy output to exactly what
plain decoding with the new weights gives; a push during 32 concurrent Generate streams
completes without failing any stream and every sample records the versions that produced it;
a client killed mid-push leaves the old version serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

import sidecar.protocol.convert as convert
from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.client.weight_sender import iter_push_requests
from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import weights_pb2
from sidecar.types import Sample, WeightSelector
from tests.sidecar_fixtures import (
    DEADLINE,
    greedy_oracle,
    greedy_request,
    start_sidecar,
    wait_until,
    weights,
)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_a_push_serves_exactly_the_new_weights(checkpoint: Path) -> None:
    with start_sidecar(checkpoint) as sc, SidecarClient(sc.address) as c:
        old, new = greedy_oracle(0), greedy_oracle(1)
        assert old != new  # the test can fail: different weights give different greedy text
        assert [s.token_ids for s in c.generate(greedy_request())] == old
        result = c.push_weights(weights(1), version=1, chunk_bytes=1000)
        assert (result.version, result.previous_version) == (1, 0)
        assert result.bytes_received == sum(t.numel() * 4 for t in weights(1).values())
        assert result.tensors_updated == len(weights(1))
        samples = c.generate(greedy_request())
        assert [s.token_ids for s in samples] == new
        assert all(s.weight_version == s.last_weight_version == 1 for s in samples)
        with pytest.raises(SidecarCallError) as err:  # the same version again is stale
            c.push_weights(weights(2), version=1)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in err.value.details
        assert [s.token_ids for s in c.generate(greedy_request())] == new
        stats = c.stats()
        assert [v.weight_version for v in stats.versions] == [0, 1] and stats.weight_version == 1


def test_selector_pushes_replace_only_their_part(checkpoint: Path) -> None:
    with start_sidecar(checkpoint) as sc, SidecarClient(sc.address) as c:
        draft_names = {s.name for s in c.describe_weights(WeightSelector.DRAFT)[0]}
        # The draft never changes greedy output (lossless), the target does.
        w1 = weights(1)
        c.push_weights({n: t for n, t in w1.items() if n in draft_names}, 1, WeightSelector.DRAFT)
        assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(0)
        c.push_weights({n: t for n, t in w1.items() if n not in draft_names}, 2, WeightSelector.TARGET)
        assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(1)
        # A generator of tensors streams with the specs from DescribeWeights.
        w2 = weights(2)
        specs, _ = c.describe_weights()
        c.push_weights(((s.name, w2[s.name]) for s in specs), 3)
        assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(2)


@pytest.mark.slow
def test_a_push_during_32_generate_streams(checkpoint: Path) -> None:
    n_new = 24
    prompts = [[(7 * i) % 60 + 1, (3 * i) % 50 + 2] for i in range(32)]
    old, new = greedy_oracle(0, prompts, n_new), greedy_oracle(1, prompts, n_new)
    with start_sidecar(checkpoint, max_batch_size=64) as sc, SidecarClient(sc.address) as c:
        results: dict[int, list[Sample]] = {}
        failures: list[BaseException] = []

        def stream(i: int) -> None:
            try:
                results[i] = c.generate(greedy_request([prompts[i]], n=n_new))
            except BaseException as e:
                failures.append(e)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        wait_until(lambda: c.stats().total.generated_tokens >= 64, what="streams running")
        pushed = c.push_weights(weights(1), version=1)
        pushed_at = time.monotonic()
        late = c.generate(greedy_request(prompts[:4], n=n_new))  # submitted after the push returned
        for t in threads:
            t.join(DEADLINE * 3)
        assert not failures, failures
        assert pushed.version == 1 and pushed_at > 0
        spanning = 0
        for i in range(32):
            (s,) = results[i]
            assert len(s.token_ids) == n_new
            assert s.weight_version in (0, 1) and s.last_weight_version in (0, 1)
            assert s.weight_version <= s.last_weight_version
            if s.last_weight_version == 0:  # entirely before the swap: the old model's greedy text
                assert s.token_ids == old[i]
            elif s.weight_version == 1:  # entirely after: the new model's
                assert s.token_ids == new[i]
            else:
                spanning += 1
                assert s.token_ids[:1] == old[i][:1]  # its first token came from the old weights
        assert spanning > 0  # the push really landed while streams were running
        assert all(s.weight_version == s.last_weight_version == 1 for s in late)
        assert [s.token_ids for s in late] == new[:4]


def test_a_client_killed_mid_push_leaves_the_old_version_serving(checkpoint: Path) -> None:
    with start_sidecar(checkpoint) as sc, SidecarClient(sc.address) as c:
        old = greedy_oracle(0)
        messages = [convert.push_item_to_pb(i) for i in iter_push_requests(weights(1), 1, chunk_bytes=512)]
        sent = threading.Event()
        never = threading.Event()

        def dying() -> Iterator[weights_pb2.PushWeightsRequest]:
            yield from messages[: len(messages) // 2]
            sent.set()
            never.wait(DEADLINE)  # the client hangs mid-stream, then is killed

        for kill in ("cancel", "close channel"):
            ch = grpc.insecure_channel(sc.address)
            call = services.WeightStub(ch).PushWeights.future(dying(), timeout=DEADLINE)
            assert sent.wait(DEADLINE)
            wait_until(lambda: sc.weights._receiver._lock.locked(), what="push in progress")
            if kill == "cancel":
                call.cancel()
            else:
                ch.close()
            wait_until(lambda: not sc.weights._receiver._lock.locked(), what="the server to drop the push")
            sent.clear()
            ch.close()
            assert c.info().weight_version == 0
            assert [s.token_ids for s in c.generate(greedy_request())] == old
        never.set()
        # The receiver is free again: a complete push succeeds.
        assert c.push_weights(weights(1), 1).version == 1
        assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(1)


def test_the_sender_aborts_a_push_whose_tensor_does_not_match(checkpoint: Path) -> None:
    with start_sidecar(checkpoint) as sc, SidecarClient(sc.address) as c:
        specs, _ = c.describe_weights()
        bad = ((s.name, torch.zeros(2)) for s in specs)
        with pytest.raises(ValueError, match="manifest announced"):
            c.push_weights(bad, 1, specs=specs)
        wait_until(lambda: not sc.weights._receiver._lock.locked(), what="push dropped")
        assert c.info().weight_version == 0


def test_kept_staging_buffers_never_leak_into_the_served_model(checkpoint: Path) -> None:
    with start_sidecar(checkpoint, keep_staging=True) as sc, SidecarClient(sc.address) as c:
        for version, seed in ((1, 1), (2, 2)):
            c.push_weights(weights(seed), version)
            assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(seed)
        kept = {n: t.data_ptr() for n, t in sc.weights._receiver._spare.items()}
        assert len(kept) == len(weights(0))  # the next push reuses these buffers
        # The engine serves the staged tensors themselves (no copy at the swap) and handed back
        # the ones they replaced: no spare buffer is a served parameter's storage.
        served_ptrs = {p.data_ptr() for p in sc.scheduler._engine.model.parameters()}
        assert not served_ptrs & set(kept.values())
        specs, _ = c.describe_weights()
        w0 = weights(0)
        half = ((s.name, w0[s.name] if i < len(specs) // 2 else torch.zeros(1)) for i, s in enumerate(specs))
        with pytest.raises(ValueError):  # dies halfway, after overwriting half the kept buffers
            c.push_weights(half, 3, specs=specs)
        wait_until(lambda: not sc.weights._receiver._lock.locked(), what="push dropped")
        assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(2)  # still version 2's model
        c.push_weights(weights(0), 3)
        assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle(0)
        assert c.info().weight_version == 3
