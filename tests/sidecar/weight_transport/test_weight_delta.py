"""Sparse delta pushes (weights.proto, "Sparse deltas"): a delta is bit-exact or refused.

- the codec rebuilds exactly what was encoded and refuses malformed payloads;
- a property test against the sender's own served-dtype copy as the oracle: random sequences of
  sparse changes pushed as deltas give exactly the sender's tensors (sha256), receiver-level;
- on a live sidecar, per transport: 50 consecutive delta pushes serve exactly the sender's
  copy (sha256 of the engine's parameters), with far fewer bytes received than dense;
- every bad input (wrong base, positions out of range / unsorted / repeated, a rebuilt tensor
  that does not match the manifest CRC-32, a dropped, reordered or missing last part, a tensor
  the sidecar lacks), on every transport, is refused with its status and message and leaves the
  served weights and version exactly as they were, no region or group behind, and the base
  whole: the next push is applied as a delta;
- a refused delta push from the client is followed by a full push, on every transport.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.client.weight_sender import iter_push_requests
from sidecar.engine.torch_engine import TorchEngine
from sidecar.errors import DeltaBaseError, InvalidRequestError
from sidecar.server.process import Sidecar
from sidecar.server.weight_receiver import WeightReceiver
from sidecar.types import (
    DeltaEncoding,
    PushItem,
    TensorDelta,
    WeightChunk,
    WeightCommit,
    WeightPlaced,
    WeightSelector,
    WeightTransport,
)
from sidecar.weight_transport.checksum import crc32
from sidecar.weight_transport.delta import DeltaBase, PlannedPush, apply_delta, encode_delta, plan_push
from sidecar.weight_transport.tensors import spec_of, tensor_bytes
from tests.sidecar_fixtures import TRANSPORTS, start_sidecar, weights

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def sha(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensor_bytes(tensors[name]).tobytes())
    return h.hexdigest()


def served(sc: Sidecar) -> tuple[int, str]:
    engine = sc.scheduler._engine
    assert isinstance(engine, TorchEngine)
    return engine.weight_version, sha({n: p.detach() for n, p in engine.model.named_parameters()})


def sparse_step(state: dict[str, torch.Tensor], gen: torch.Generator, fraction: float) -> dict[str, torch.Tensor]:
    """A copy of `state` with about `fraction` of each tensor's elements nudged."""
    out = {}
    for name, t in state.items():
        t = t.clone()
        flat = t.view(-1)
        n = max(1, int(flat.numel() * fraction))
        where = torch.randint(0, flat.numel(), (n,), generator=gen)
        flat[where] += 0.01
        out[name] = t
    return out


# --- codec ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 300),
    changed=st.sets(st.integers(0, 299), max_size=300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_a_delta_rebuilds_exactly_the_new_tensor(numel: int, changed: set[int], dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g).to(dtype)
    new = base.clone()
    at = torch.tensor(sorted(i for i in changed if i < numel), dtype=torch.long)
    if at.numel():
        new[at] = torch.randn(at.numel(), generator=g).to(dtype) + 5
    enc = encode_delta(base, new)
    if enc is None:  # the dense bytes are no larger: sent in full
        return
    encoding, n, payload = enc
    spec = TensorDelta(encoding=encoding, changed=n, payload_length=payload.nbytes)
    rebuilt = apply_delta(base, spec, payload, "t")
    assert tensor_bytes(rebuilt).tobytes() == tensor_bytes(new).tobytes()


def _index_payload(positions: list[int], values: torch.Tensor) -> tuple[TensorDelta, np.ndarray]:
    payload = np.concatenate([np.array(positions, dtype="<u4").view(np.uint8), tensor_bytes(values.contiguous())])
    return TensorDelta(encoding=DeltaEncoding.INDEX, changed=len(positions), payload_length=payload.nbytes), payload


@pytest.mark.parametrize(
    ("positions", "message"),
    [([3, 100], "position 100"), ([5, 2], "unsorted"), ([4, 4], "repeated")],
    ids=["out-of-range", "unsorted", "duplicated"],
)
def test_malformed_positions_are_refused(positions: list[int], message: str) -> None:
    base = torch.zeros(10)
    spec, payload = _index_payload(positions, torch.ones(len(positions)))
    with pytest.raises(InvalidRequestError, match=message):
        apply_delta(base, spec, payload, "t")


def test_a_payload_of_the_wrong_length_or_a_dirty_bitmask_is_refused() -> None:
    base = torch.zeros(10)
    spec, payload = _index_payload([1, 2], torch.ones(2))
    with pytest.raises(InvalidRequestError, match="bytes but INDEX"):
        apply_delta(base, spec, payload[:-1], "t")
    mask = np.array([0b0000_0010, 0b1000_0000], dtype=np.uint8)  # bit 15: past the 10 elements
    bad = np.concatenate([mask, tensor_bytes(torch.ones(2))])
    spec = TensorDelta(encoding=DeltaEncoding.BITMASK, changed=2, payload_length=bad.nbytes)
    with pytest.raises(InvalidRequestError, match="padding bits"):
        apply_delta(base, spec, bad, "t")


# --- receiver-level property test (oracle: the sender's own served-dtype copy) ------------------


def _receiver(state: dict[str, torch.Tensor], version: list[int], keep_staging: bool = False) -> WeightReceiver:
    return WeightReceiver(
        model_specs=lambda _sel: [spec_of(n, t) for n, t in state.items()],
        served_version=lambda: version[0],
        keep_staging=keep_staging,
    )


def _corrupt_last_chunk(items: Iterator[PushItem]) -> Iterator[PushItem]:
    """The push with its last chunk's bytes damaged (a push the receiver must refuse)."""
    got = list(items)
    k = max(i for i, it in enumerate(got) if isinstance(it, WeightChunk))
    chunk = got[k]
    assert isinstance(chunk, WeightChunk) and len(chunk.data)
    got[k] = dataclasses.replace(chunk, data=bytes([chunk.data[0] ^ 1]) + bytes(chunk.data[1:]))
    return iter(got)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    fractions=st.lists(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 1.0]), min_size=50, max_size=50),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    keep_staging=st.booleans(),
    failures=st.sets(st.integers(2, 50), max_size=5),
)
def test_fifty_delta_pushes_serve_exactly_the_senders_copy(
    seed: int, fractions: list[float], dtype: torch.dtype, keep_staging: bool, failures: set[int]
) -> None:
    """Interleaved with damaged pushes (refused, nothing applied); the sender then forgets its
    base and pushes in full, as the client does."""
    g = torch.Generator().manual_seed(seed)
    sender_state = {
        "a": torch.randn(64, 48, generator=g).to(dtype),
        "b": torch.randn(48, generator=g).to(dtype),
        "c": torch.randn(7, 3, 5, generator=g).to(dtype),
    }
    served_state = {n: t.clone() for n, t in sender_state.items()}
    version = [0]
    receiver = _receiver(served_state, version, keep_staging)
    base = DeltaBase()
    deltas_sent = 0
    for step, fraction in enumerate([0.0, *fractions], 1):
        if step > 1:
            sender_state = sparse_step(sender_state, g, fraction)
        if step in failures:
            plan = plan_push(sender_state.items(), base)
            items = iter_push_requests(plan.wire, step, specs=plan.specs, base_version=plan.base_version)
            before = sha(served_state)
            with pytest.raises(InvalidRequestError):
                receiver.receive(_corrupt_last_chunk(items))
            assert sha(served_state) == before and version[0] == step - 1
            base.forget()
        plan = plan_push(sender_state.items(), base)
        deltas_sent += sum(s.delta is not None for s in plan.specs)
        items = iter_push_requests(plan.wire, step, specs=plan.specs, base_version=plan.base_version, chunk_bytes=1000)
        staged = receiver.receive(items)
        served_state.update({n: t.clone() for n, t in staged.tensors.items()})  # the engine copies at the swap
        version[0] = staged.version
        receiver.keep(staged)
        base.version, base.tensors = step, plan.full
    assert deltas_sent > 0  # the property covered deltas, not only full pushes
    assert version[0] == 51
    assert sha(served_state) == sha(sender_state)


# --- live sidecar ------------------------------------------------------------------------------


def delta_client(address: str, transport: WeightTransport = WeightTransport.GRPC) -> SidecarClient:
    return SidecarClient(address, ClientConfig(transports=TRANSPORTS[transport], timeout_s=30.0, sparse_deltas=True))


@pytest.mark.parametrize("transport", list(TRANSPORTS), ids=lambda t: t.value)
def test_fifty_delta_pushes_on_a_live_sidecar_serve_the_senders_copy(
    checkpoint: Path, transport: WeightTransport
) -> None:
    g = torch.Generator().manual_seed(1)
    state = weights(1)
    dense = sum(t.numel() * t.element_size() for t in state.values())
    with start_sidecar(checkpoint) as sc, delta_client(sc.address, transport) as c:
        first = c.push_weights(state, version=1)
        assert first.bytes_received == dense and first.transport is transport  # first contact: full
        received = []
        for v in range(2, 52):
            state = sparse_step(state, g, 0.002)
            result = c.push_weights(state, version=v)
            assert result.transport is transport
            received.append(result.bytes_received)
        assert served(sc) == (51, sha(state))
        assert max(received) * 10 <= dense  # every delta push moved >= 10x fewer bytes
        # asked for a full push: full bytes, same result
        state = sparse_step(state, g, 0.002)
        assert c.push_weights(state, version=52, full=True).bytes_received == dense
        assert served(sc) == (52, sha(state))


# --- bad input, on every transport -------------------------------------------------------------


@dataclasses.dataclass
class Live:
    """A sidecar shared by the bad-input cases of one transport. It serves `state`, which `c`
    pushed (so the sidecar holds a base and `c` sends deltas); each case ends with a good push."""

    transport: WeightTransport
    sc: Sidecar
    c: SidecarClient
    state: dict[str, torch.Tensor]
    gen: torch.Generator
    dense: int

    def __repr__(self) -> str:  # hypothesis prints its arguments
        return f"Live({self.transport.value}, version {self.c.delta_base.version})"


@pytest.fixture(scope="module", params=list(TRANSPORTS), ids=lambda t: t.value)
def live(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[Live]:
    transport: WeightTransport = request.param
    state = weights(1)
    dense = sum(t.numel() * t.element_size() for t in state.values())
    # keep_staging: as specrl serve runs it (pushes are staged into buffers the last one freed)
    with start_sidecar(checkpoint, keep_staging=True) as sc, delta_client(sc.address, transport) as c:
        assert c.push_weights(state, version=1).transport is transport
        yield Live(transport=transport, sc=sc, c=c, state=state, gen=torch.Generator().manual_seed(2), dense=dense)


def _delta_plan(live: Live) -> PlannedPush:
    """The client's own delta push of a sparse step (every sizeable tensor a delta)."""
    plan = plan_push(sparse_step(live.state, live.gen, 0.05).items(), live.c.delta_base)
    assert plan.base_version == live.c.delta_base.version
    assert all(s.delta is not None for s in plan.specs if s.byte_length > 64)
    return plan


def _bad_positions(kind: str) -> Callable[[PlannedPush], None]:
    """Replace the first sizeable delta's payload by an INDEX payload with malformed positions
    (its checksums consistent, so only the positions are wrong)."""

    def damage(plan: PlannedPush) -> None:
        i = next(k for k, s in enumerate(plan.specs) if s.delta is not None and s.byte_length > 4000)
        numel = plan.specs[i].byte_length // plan.specs[i].dtype.itemsize
        at = {"out of range": [1, numel], "unsorted": [9, 3], "duplicated": [4, 4]}[kind]
        payload = np.concatenate(
            [np.array(at, dtype="<u4").view(np.uint8), tensor_bytes(torch.ones(2, dtype=plan.specs[i].dtype))]
        )
        delta = TensorDelta(
            encoding=DeltaEncoding.INDEX, changed=2, payload_length=payload.nbytes, payload_crc32=crc32(payload)
        )
        plan.specs[i] = dataclasses.replace(plan.specs[i], delta=delta)
        plan.wire[i] = (plan.wire[i][0], torch.from_numpy(payload))

    return damage


def _wrong_base(plan: PlannedPush) -> None:
    plan.base_version += 7


def _rebuilt_mismatch(plan: PlannedPush) -> None:
    i = next(k for k, s in enumerate(plan.specs) if s.delta is not None and "mlp" in s.name)
    plan.specs[i] = dataclasses.replace(plan.specs[i], crc32=plan.specs[i].crc32 ^ 1)


def _unknown_tensor(plan: PlannedPush) -> None:
    i = next(k for k, s in enumerate(plan.specs) if s.delta is not None and "mlp" in s.name)
    plan.specs[i] = dataclasses.replace(plan.specs[i], name="model.layers.0.mlp.not_here.weight")
    plan.wire[i] = ("model.layers.0.mlp.not_here.weight", plan.wire[i][1])


PLAN_FAULTS: dict[str, tuple[Callable[[PlannedPush], None], grpc.StatusCode, str]] = {
    # name: (damage to the planned push, status, what the refusal says)
    "wrong base": (_wrong_base, grpc.StatusCode.FAILED_PRECONDITION, "computed against version {wrong} but this"),
    "out of range": (_bad_positions("out of range"), grpc.StatusCode.INVALID_ARGUMENT, "but the tensor has 4096 el"),
    "unsorted": (_bad_positions("unsorted"), grpc.StatusCode.INVALID_ARGUMENT, "unsorted positions (9 then 3"),
    "duplicated": (_bad_positions("duplicated"), grpc.StatusCode.INVALID_ARGUMENT, "repeated positions (4 then 4"),
    "rebuilt mismatch": (_rebuilt_mismatch, grpc.StatusCode.FAILED_PRECONDITION, "rebuilt from its delta has CRC"),
    "unknown tensor": (_unknown_tensor, grpc.StatusCode.NOT_FOUND, "no tensor 'model.layers.0.mlp.not_here.weight'"),
}

PART_FAULTS: dict[str, dict[str, str]] = {
    # name: what the refusal says when the parts are the stream's chunks / a transport's placed tensors
    "dropped": {"chunk": "starts at byte", "placed": "names tensor 1 but tensor 0 is next"},
    "reordered": {"chunk": "starts at byte", "placed": "names tensor 1 but tensor 0 is next"},
    "last dropped": {"chunk": "chunks but", "placed": "bytes at the commit"},
}


def _chunk_fault(items: Iterator[PushItem], fault: str) -> Iterator[PushItem]:
    """grpc: the parts are chunks; drop or swap two chunks of one tensor, or drop the last."""
    got = list(items)
    chunks = [k for k, it in enumerate(got) if isinstance(it, WeightChunk)]
    if fault == "last dropped":
        del got[chunks[-1]]
        return iter(got)
    k = next(k for k in chunks if k + 1 in chunks and got[k].tensor_index == got[k + 1].tensor_index)  # type: ignore[union-attr]
    if fault == "dropped":
        del got[k]
    else:
        got[k], got[k + 1] = got[k + 1], got[k]
    return iter(got)


def _placed_fault(items: Iterator[PushItem], fault: str) -> Iterator[PushItem]:
    """shm and collective: the parts are placed tensors; drop or swap the first two, or drop the
    last. Lazy (one item held back at most), so a collective sender broadcasts as it would."""
    held: WeightPlaced | None = None
    first = True
    for item in items:
        if isinstance(item, WeightPlaced):
            parts = list(item.tensors)
            if first and fault != "last dropped":
                assert len(parts) >= 2
                parts = parts[1:] if fault == "dropped" else [parts[1], parts[0], *parts[2:]]
            first = False
            if held is not None:
                yield held
            held = WeightPlaced(tensors=parts)
            continue
        if held is not None:
            if isinstance(item, WeightCommit) and fault == "last dropped":
                held = WeightPlaced(tensors=held.tensors[:-1])
            yield held
            held = None
        yield item


def _open_regions() -> tuple[int, int]:
    """(descriptors, mappings) of specrl shared-memory regions in this process (the client's
    region and any the in-process sidecar still has open)."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:specrl-")
        except OSError:
            continue
    maps = sum("/memfd:specrl-" in line for line in Path("/proc/self/maps").read_text().splitlines())
    return fds, maps


def _faulty_push(live: Live, fault: str) -> tuple[Iterator[PushItem], grpc.StatusCode, str]:
    """The client's next delta push with `fault` (a key of PLAN_FAULTS or PART_FAULTS), placed on
    its negotiated transport as the client places it; the status and message it must get."""
    c = live.c
    c.negotiate_transport()
    plan = _delta_plan(live)
    code, message = grpc.StatusCode.INVALID_ARGUMENT, ""
    if fault in PLAN_FAULTS:
        damage, code, message = PLAN_FAULTS[fault]
        damage(plan)
        message = message.format(wrong=plan.base_version)
    items = iter_push_requests(
        plan.wire,
        c.delta_base.version + 1,
        specs=plan.specs,
        base_version=plan.base_version,
        chunk_bytes=256,
        data_plane=c.transport_session.sender,
    )
    if fault in PART_FAULTS:
        if live.transport is WeightTransport.GRPC:
            items, message = _chunk_fault(items, fault), PART_FAULTS[fault]["chunk"]
        else:
            items, message = _placed_fault(items, fault), PART_FAULTS[fault]["placed"]
    return items, code, message


def _refused(live: Live, fault: str) -> None:
    """The faulty push is refused with its status and message; the served weights and version
    are exactly as they were, and the sidecar left no region open or mapped and no group usable."""
    sc, c = live.sc, live.c
    kept = sc.weights._receiver.regions  # regions the sidecar keeps mapped on purpose (bounded, expire)
    kept.close()
    before, regions = served(sc), _open_regions()
    assert c.info().weight_version == before[0] == c.delta_base.version
    items, code, message = _faulty_push(live, fault)
    with pytest.raises(SidecarCallError) as err:
        c.push_items(items, plane=c.transport_session.sender)
    assert err.value.code == code, err.value.details
    assert message in err.value.details, err.value.details
    assert served(sc) == before and c.info().weight_version == before[0]
    kept.close()
    assert all(a <= b for a, b in zip(_open_regions(), regions, strict=True))  # nothing else left open or mapped
    groups = sc.weights._receiver.groups
    assert not groups._groups  # the failed push's collective group is out of use, as on the sender
    assert len(groups._retired) <= 1  # and closed once the sender prepares its next group


def _applied(live: Live) -> None:
    """The sidecar keeps serving: it takes the next push as a delta against the version it
    kept, and serves exactly the client's copy."""
    sc, c = live.sc, live.c
    version = served(sc)[0]
    live.state = sparse_step(live.state, live.gen, 0.01)
    result = c.push_weights(live.state, version=version + 1)
    assert result.transport is live.transport and result.bytes_received * 10 <= live.dense
    assert served(sc) == (version + 1, sha(live.state))
    groups = sc.weights._receiver.groups
    assert not groups._retired and len(groups._groups) == (live.transport is WeightTransport.COLLECTIVE)


@pytest.mark.parametrize("fault", list(PLAN_FAULTS))
def test_a_bad_delta_is_refused_on_every_transport(live: Live, fault: str) -> None:
    """Wrong base, positions out of range / unsorted / repeated, a rebuilt tensor that does not
    match the manifest's CRC-32, a tensor the sidecar does not have: each placed on the data
    plane as the client would place it, then a good push."""
    _refused(live, fault)
    _applied(live)


@pytest.mark.parametrize("fault", list(PART_FAULTS))
def test_a_dropped_or_reordered_part_is_refused_on_every_transport(live: Live, fault: str) -> None:
    """Parts are the stream's chunks on grpc and the placed tensors on shm and collective."""
    _refused(live, fault)
    _applied(live)


@settings(max_examples=3, deadline=None)
@given(steps=st.lists(st.sampled_from(["good", *PLAN_FAULTS, *PART_FAULTS]), min_size=2, max_size=4))
def test_any_run_of_bad_and_good_pushes_serves_the_last_good_one(live: Live, steps: list[str]) -> None:
    """Oracle: the client's copy of its last applied push. Refusals back to back (each on a
    freshly prepared transport) and good pushes in any order: the sidecar always serves the
    oracle's weights and version and takes every good push as a delta."""
    for step in steps:
        if step == "good":
            _applied(live)
        else:
            _refused(live, step)
        assert served(live.sc) == (live.c.delta_base.version, sha(live.state))


def test_a_sidecar_without_a_base_refuses_and_the_client_pushes_in_full(checkpoint: Path) -> None:
    """A delta client whose base went stale (another sender pushed in between) is refused and
    sends the full tensors at once; the sidecar serves exactly the client's weights."""
    g = torch.Generator().manual_seed(6)
    state = weights(1)
    dense = sum(t.numel() * t.element_size() for t in state.values())
    with start_sidecar(checkpoint) as sc, delta_client(sc.address) as c, delta_client(sc.address) as other:
        c.push_weights(state, version=1)
        other.push_weights(weights(2), version=2)
        state = sparse_step(state, g, 0.01)
        result = c.push_weights(state, version=3)  # its base (version 1) is not served: refused, then full
        assert result.bytes_received == dense
        assert served(sc) == (3, sha(state))
        state = sparse_step(state, g, 0.01)
        assert c.push_weights(state, version=4).bytes_received < dense // 10  # deltas again
        assert served(sc) == (4, sha(state))


def test_receiver_refuses_a_delta_before_it_holds_a_base() -> None:
    state = {"w": torch.randn(40, 40)}
    receiver = _receiver({n: t.clone() for n, t in state.items()}, [0])
    new = {"w": state["w"].clone()}
    new["w"][0, 0] += 1
    plan = plan_push(new.items(), DeltaBase(version=0, tensors=state))
    assert plan.specs[0].delta is None  # no base version: the sender sends it in full
    plan = plan_push(new.items(), DeltaBase(version=3, tensors=state))
    assert plan.specs[0].delta is not None
    with pytest.raises(DeltaBaseError, match="serves version 0"):
        receiver.receive(iter_push_requests(plan.wire, 4, specs=plan.specs, base_version=3))


def test_the_run_config_turns_sparse_deltas_on_for_every_client(checkpoint: Path) -> None:
    from sidecar.client.fleet import Fleet, FleetConfig
    from sidecar.config_io import from_mapping
    from trainer.rl.config import RLConfig

    cfg = from_mapping(RLConfig, {"model": "m", "sidecars": {"local": 1, "weight_transport": {"sparse_deltas": True}}})
    assert (
        cfg.sidecars.weight_transport.sparse_deltas
        and not RLConfig(model=Path("m")).sidecars.weight_transport.sparse_deltas
    )
    state = weights(1)
    fleet_cfg = FleetConfig(client=ClientConfig(sparse_deltas=True))
    with start_sidecar(checkpoint) as sc, Fleet([sc.address], fleet_cfg) as orch:
        assert all(c.config.sparse_deltas for c in orch.clients)
        orch.push_weights(lambda: iter(state.items()), 1, names=list(state))
        assert orch.clients[0].delta_base.version == 1  # the next push can be a delta
        state = sparse_step(state, torch.Generator().manual_seed(7), 0.01)
        orch.push_weights(lambda: iter(state.items()), 2, names=list(state))
        assert served(sc) == (2, sha(state))


@pytest.mark.parametrize("fault", ["wrong-base", "rebuilt-mismatch"])
@pytest.mark.parametrize("transport", list(TRANSPORTS), ids=lambda t: t.value)
def test_a_refused_delta_on_any_transport_is_followed_by_a_full_push(
    checkpoint: Path, transport: WeightTransport, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's delta, damaged before it leaves (a base the sidecar does not serve, or a
    manifest CRC-32 its rebuilt tensor cannot match), is refused on every transport; the client
    then pushes in full and the sidecar serves exactly the client's weights."""
    import sidecar.client.client as client_module

    g = torch.Generator().manual_seed(8)
    state = weights(1)
    dense = sum(t.numel() * t.element_size() for t in state.values())
    plans: list[str] = []

    def damaged(pairs: object, base: DeltaBase) -> object:
        plan = plan_push(pairs, base)  # type: ignore[arg-type]
        if plan.base_version:
            plans.append("delta")
            if fault == "wrong-base":
                plan.base_version += 5
            else:
                i = next(k for k, s in enumerate(plan.specs) if s.delta is not None)
                plan.specs[i] = dataclasses.replace(plan.specs[i], crc32=plan.specs[i].crc32 ^ 1)
        else:
            plans.append("full")
        return plan

    with start_sidecar(checkpoint) as sc, delta_client(sc.address, transport) as c:
        c.push_weights(state, version=1)
        monkeypatch.setattr(client_module, "plan_push", damaged)
        state = sparse_step(state, g, 0.01)
        result = c.push_weights(state, version=2)
        assert plans == ["delta", "full"] and result.bytes_received == dense and result.transport is transport
        assert served(sc) == (2, sha(state))


def test_a_sidecar_that_does_not_accept_deltas_gets_full_pushes(checkpoint: Path) -> None:
    from sidecar.server.weight_receiver import TransportOffer

    g = torch.Generator().manual_seed(9)
    state = weights(1)
    dense = sum(t.numel() * t.element_size() for t in state.values())
    with (
        start_sidecar(checkpoint, transports=TransportOffer(sparse_deltas=False)) as sc,
        delta_client(sc.address) as c,
    ):
        for v in range(1, 4):
            state = sparse_step(state, g, 0.01)
            assert c.push_weights(state, version=v).bytes_received == dense
            assert c.delta_base.version == 0  # nothing kept for a sidecar that would refuse deltas
        assert served(sc) == (3, sha(state))


def test_a_delta_for_a_tensor_without_a_base_is_refused() -> None:
    """The sidecar applied a DRAFT-only push, so it holds a base of the draft tensors only: a
    delta of a trunk tensor is refused (nothing applied), a delta of a draft tensor is not."""
    state = {"trunk": torch.randn(30, 30), "mtp.w": torch.randn(30, 30)}
    version = [0]
    receiver = WeightReceiver(
        model_specs=lambda sel: [
            spec_of(n, t) for n, t in state.items() if sel is not WeightSelector.DRAFT or n.startswith("mtp.")
        ],
        served_version=lambda: version[0],
        keep_staging=False,
    )
    draft = {"mtp.w": state["mtp.w"] + 1}
    staged = receiver.receive(iter_push_requests(draft, 1, WeightSelector.DRAFT))
    version[0] = 1
    receiver.keep(staged)
    new = {n: t.clone() for n, t in {**state, **draft}.items()}
    new["trunk"][0, 0] += 1
    new["mtp.w"][0, 0] += 1
    plan = plan_push(new.items(), DeltaBase(version=1, tensors={**state, **draft}))
    assert all(s.delta is not None for s in plan.specs)
    with pytest.raises(DeltaBaseError, match="no base of tensor 'trunk'"):
        receiver.receive(iter_push_requests(plan.wire, 2, specs=plan.specs, base_version=1))
    assert version[0] == 1
    only_draft = plan_push([("mtp.w", new["mtp.w"])], DeltaBase(version=1, tensors=draft))
    staged = receiver.receive(
        iter_push_requests(only_draft.wire, 2, WeightSelector.DRAFT, specs=only_draft.specs, base_version=1)
    )
    assert torch.equal(staged.tensors["mtp.w"], new["mtp.w"])
