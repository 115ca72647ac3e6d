"""The incremental weight-update session (sidecar/integrations/weight_session.py) against a real
sidecar: tensors sent one at a time, in any order and chunking, apply atomically; an aborted or
incomplete session applies nothing. Oracle: greedy decoding with the full forward pass of the
state the sidecar should serve (tests/sidecar_fixtures.greedy_reference)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.client.client import SidecarClient
from sidecar.integrations.weight_session import SessionConfig, WeightUpdateSession
from sidecar.model.checkpoint import target_tensor_names
from sidecar.types import WeightSelector
from tests.sidecar_fixtures import PROMPTS, greedy_reference, greedy_request, tiny_config, weights

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TARGET = target_tensor_names(tiny_config())


def serves(client: SidecarClient, state: dict[str, torch.Tensor]) -> bool:
    samples = sorted(client.generate(greedy_request()), key=lambda s: s.prompt_index)
    return all(
        s.token_ids == greedy_reference(state, p, len(s.token_ids)) for s, p in zip(samples, PROMPTS, strict=True)
    )


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(1, 1000),
    order=st.permutations(range(len(TARGET))),
    chunk_bytes=st.sampled_from([64, 1000, 4096, 1 << 20]),
    pending=st.integers(1, 3),
    abort_after=st.integers(0, len(TARGET) - 1),
)
def test_session_applies_all_or_nothing(
    client: SidecarClient,
    seed: int,
    order: list[int],
    chunk_bytes: int,
    pending: int,
    abort_after: int,
) -> None:
    before = client.info().weight_version
    current = weights(0) if before == 0 else None
    new = weights(seed)
    cfg = SessionConfig(chunk_bytes=chunk_bytes, max_pending_chunks=pending)

    # Aborted part-way (an exception in the framework's loop): nothing applied.
    session = WeightUpdateSession(client, version=before + 1, selector=WeightSelector.TARGET, config=cfg)
    with pytest.raises(RuntimeError, match="framework failed"), session as s:
        for i in order[:abort_after]:
            s.send(TARGET[i], new[TARGET[i]])
        raise RuntimeError("framework failed")
    assert client.info().weight_version == before
    if current is not None:
        assert serves(client, current)

    # Complete, in this example's order and chunking: the new target serves, the draft is kept.
    with WeightUpdateSession(client, version=before + 1, selector=WeightSelector.TARGET, config=cfg) as s:
        for i in order:
            s.send(TARGET[i], new[TARGET[i]])
    assert client.info().weight_version == before + 1
    expected = {n: (new[n] if n in TARGET else t) for n, t in weights(0).items()}
    assert serves(client, expected)


def test_incomplete_session_is_refused_before_the_commit(client: SidecarClient) -> None:
    before = client.info().weight_version
    new = weights(7)
    session = WeightUpdateSession(client, version=before + 1, selector=WeightSelector.TARGET)
    for name in TARGET[1:]:
        session.send(name, new[name])
    with pytest.raises(ValueError, match=f"lacks 1 tensor.*{TARGET[0]}"):
        session.commit()
    assert client.info().weight_version == before


def test_session_refuses_unknown_duplicate_and_misshapen_tensors(client: SidecarClient) -> None:
    before = client.info().weight_version
    new = weights(3)
    with WeightUpdateSession(client, version=before + 1, selector=WeightSelector.TARGET) as s:
        with pytest.raises(KeyError, match="not in this update's manifest"):
            s.send("mtp.layers.0.eh_proj.weight", new["mtp.layers.0.eh_proj.weight"])
        with pytest.raises(ValueError, match="has shape"):
            s.send(TARGET[0], torch.zeros(3))
        for name in TARGET:
            s.send(name, new[name].to(torch.float64))  # converted to the served dtype, one tensor at a time
        with pytest.raises(ValueError, match="already sent"):
            s.send(TARGET[0], new[TARGET[0]])
    assert client.info().weight_version == before + 1


def test_sidecar_refusal_surfaces_in_send_or_commit(client: SidecarClient) -> None:
    """A stale version is refused by the sidecar at the manifest; the session raises its error."""
    new = weights(5)
    if client.info().weight_version == 0:
        with WeightUpdateSession(client, version=1, selector=WeightSelector.TARGET) as s:
            for name in TARGET:
                s.send(name, new[name])
    served_version = client.info().weight_version
    with (
        pytest.raises(Exception, match="not newer"),
        WeightUpdateSession(
            client, version=served_version, selector=WeightSelector.TARGET, config=SessionConfig(chunk_bytes=64)
        ) as s,
    ):
        for name in TARGET:
            s.send(name, new[name])
    assert client.info().weight_version == served_version
