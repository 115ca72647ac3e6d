"""The weight fan-out (`Fleet.push_weights`) against two real in-process sidecars.

Oracles: plain greedy decoding with the full forward pass of the pushed weights (what both
sidecars must then produce); the version each sidecar reports; and weak references to the
tensors the source hands out (how many are still alive when the next one is made).

A fleet's push runs through `sidecar/client/weight_fanout.py` (one stream read once, sent to every sidecar).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from sidecar.client.client import ClientConfig
from sidecar.client.fleet import Fleet, FleetConfig, NoLiveSidecarError
from sidecar.server.process import Sidecar
from sidecar.server.weight_receiver import TransportOffer
from sidecar.types import GenerationRequest, SamplingParams, WeightTransport
from sidecar.weight_transport.shm import ShmRegion
from tests.sidecar_fixtures import greedy_reference, make_checkpoint, start_sidecar, weights

pytestmark = pytest.mark.usefixtures("single_torch_thread")
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


class Source:
    """The weights of `seed` in reversed contract order (not the sidecars' manifest order), each
    tensor a fresh copy; records how many earlier tensors are still alive at every hand-out."""

    def __init__(self, seed: int, fail_after: int | None = None) -> None:
        self.state = weights(seed)
        self.names = list(reversed(self.state))
        self.fail_after = fail_after
        self.alive_at_handout: list[int] = []
        self._refs: list[weakref.ref[torch.Tensor]] = []

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, name in enumerate(self.names):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("export failed half-way")
            self.alive_at_handout.append(sum(r() is not None for r in self._refs))
            tensor = self.state[name].clone()
            self._refs.append(weakref.ref(tensor))
            yield name, tensor
            del tensor


def served(orch: Fleet) -> list[list[list[int]]]:
    """What each sidecar generates greedily for PROMPTS (one request to each, not spread)."""
    out = []
    for c in orch.clients:
        sub = Fleet([c.address])
        sub.version = orch.version
        samples = sub.generate(GenerationRequest(prompts=PROMPTS, sampling=GREEDY, speculation_k=0)).samples
        out.append([s.token_ids for s in samples])
        sub.close()
    return out


def test_a_streamed_push_reaches_both_sidecars_and_holds_few_tensors(pair: tuple[Sidecar, Sidecar]) -> None:
    a, b = pair
    source = Source(seed=1)
    want = [greedy_reference(source.state, p, 6) for p in PROMPTS]
    assert want != [greedy_reference(weights(0), p, 6) for p in PROMPTS]  # the push must show
    with Fleet([a.address, b.address], FleetConfig(stream_bytes=1)) as orch:  # one queued tensor
        orch.push_weights(source, 1, names=source.names)
        assert orch.served_versions() == {a.address: 1, b.address: 1}
        assert served(orch) == [want, want]
        # one queued per sidecar, plus what each sidecar's stream and the producer hold
        assert max(source.alive_at_handout) <= 1 + 2 + 1, source.alive_at_handout

        gathered = Source(seed=2)  # the dict path keeps every tensor alive: the measure can tell
        orch.push_weights(gathered, 2)
        assert served(orch) == [[greedy_reference(gathered.state, p, 6) for p in PROMPTS]] * 2
        assert max(gathered.alive_at_handout) == len(gathered.names) - 1


def test_a_source_that_fails_half_way_changes_no_sidecar(pair: tuple[Sidecar, Sidecar]) -> None:
    a, b = pair
    before = [greedy_reference(weights(0), p, 6) for p in PROMPTS]
    with Fleet([a.address, b.address]) as orch:
        broken = Source(seed=1, fail_after=len(weights(0)) // 2)
        with pytest.raises(RuntimeError, match="export failed half-way"):
            orch.push_weights(broken, 1, names=broken.names)
        assert orch.version == 0 and orch.live() == orch.clients  # the trainer's fault, not theirs
        assert orch.served_versions() == {a.address: 0, b.address: 0}
        assert served(orch) == [before, before]
        good = Source(seed=1)
        orch.push_weights(good, 1, names=good.names)  # the same version goes through afterwards
        assert orch.served_versions() == {a.address: 1, b.address: 1}


def test_names_that_do_not_match_the_served_model_are_an_error_not_a_dead_fleet(
    pair: tuple[Sidecar, Sidecar],
) -> None:
    a, b = pair
    source = Source(seed=1)
    with Fleet([a.address, b.address]) as orch:
        with pytest.raises(ValueError, match="missing \\['model.norm.weight'\\]"):
            orch.push_weights(source, 1, names=[n for n in source.names if n != "model.norm.weight"])
        assert orch.live() == orch.clients and orch.served_versions() == {a.address: 0, b.address: 0}


def test_a_stopped_sidecar_is_marked_down_and_the_other_takes_the_version(pair: tuple[Sidecar, Sidecar]) -> None:
    a, b = pair
    source = Source(seed=1)
    with Fleet([a.address, b.address], FleetConfig(client=ClientConfig(timeout_s=2.0, retries=1))) as orch:
        b.stop(0.2)
        orch.push_weights(source, 1, names=source.names)
        assert [c.address for c in orch.live()] == [a.address]
        assert orch.served_versions() == {a.address: 1}
        a.stop(0.2)
        with pytest.raises(NoLiveSidecarError, match="no sidecar accepted weight version 2"):
            orch.push_weights(Source(seed=2), 2, names=source.names)


def _count_region_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the region each ShmRegion.write goes to (the sender's copy + CRC of one tensor)."""
    writes: list[str] = []
    original = ShmRegion.write

    def counting(self: ShmRegion, offset: int, data: np.ndarray) -> int:
        writes.append(self.name)
        return original(self, offset, data)

    monkeypatch.setattr(ShmRegion, "write", counting)
    return writes


@pytest.mark.parametrize("share", [True, False], ids=["shared region", "a region per sidecar"])
def test_local_sidecars_read_one_region_the_fleet_writes_once(
    pair: tuple[Sidecar, Sidecar], share: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    writes = _count_region_writes(monkeypatch)
    source = Source(seed=1)
    tensors = sum(1 for t in source.state.values() if t.numel())
    with Fleet([a.address, b.address], FleetConfig(share_shm=share)) as orch:
        report = orch.push_weights(source, 1, names=source.names)  # negotiates: a probe region each
        assert {r.transport for r in report.results.values()} == {WeightTransport.SHM}
        assert served(orch) == [[greedy_reference(source.state, p, 6) for p in PROMPTS]] * 2
        writes.clear()
        second = Source(seed=2)
        orch.push_weights(second, 2, names=second.names)
        assert served(orch) == [[greedy_reference(second.state, p, 6) for p in PROMPTS]] * 2
        if share:  # each tensor copied and checksummed once for both sidecars, which both read it
            assert orch._fanout.region is not None and writes == [orch._fanout.region.name] * tensors
            assert a.weights._receiver.regions.kept == b.weights._receiver.regions.kept == [orch._fanout.region.name]
        else:  # once per sidecar, into its own region
            assert len(writes) == 2 * tensors and len(set(writes)) == 2


def test_a_fleet_of_local_and_stream_only_sidecars_serves_one_model(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt", seed=0)
    local, remote = start_sidecar(checkpoint), start_sidecar(checkpoint, transports=TransportOffer(shm=False))
    try:
        with Fleet([local.address, remote.address]) as orch:
            for version, seed in ((1, 1), (2, 2)):
                source = Source(seed=seed)
                report = orch.push_weights(source, version, names=source.names)
                assert report.results[local.address].transport is WeightTransport.SHM
                assert report.results[remote.address].transport is WeightTransport.GRPC
                assert served(orch) == [[greedy_reference(source.state, p, 6) for p in PROMPTS]] * 2
    finally:
        local.stop(0.2)
        remote.stop(0.2)


def test_a_tensor_that_is_not_its_spec_commits_on_no_sidecar(pair: tuple[Sidecar, Sidecar]) -> None:
    a, b = pair
    source = Source(seed=1)
    bad = source.names[len(source.names) // 2]

    def wrong() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in source():
            yield name, (tensor.double() if name == bad else tensor)

    with Fleet([a.address, b.address]) as orch:
        with pytest.raises(ValueError, match="manifest announced"):
            orch.push_weights(wrong, 1, names=source.names)
        assert orch.live() == orch.clients and orch.served_versions() == {a.address: 0, b.address: 0}
        good = Source(seed=1)
        orch.push_weights(good, 1, names=good.names)
        assert served(orch) == [[greedy_reference(good.state, p, 6) for p in PROMPTS]] * 2
