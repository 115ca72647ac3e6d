"""Sessions pinned to their sidecar (`Fleet`, `GenerationRequest.session_ids`), against an oracle.

Scripted sidecars (as in tests/sidecar/client/test_fleet_policy.py) take multi-turn traffic: conversations of
several turns, sidecars going down between turns. The oracle is the rule itself, replayed from
what each sidecar was asked: every request of a session goes to one sidecar while that sidecar
is live; a session moves only when its sidecar went down, and then to a live one; new sessions
fill the sidecar with the fewest; samples are what a lone sidecar gives whoever serves them.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.client.test_fleet_policy import Script, expected_token, fleet_of


def turn(conversations: list[str], seed: int) -> GenerationRequest:
    return GenerationRequest(
        prompts=[[1 + i] for i in range(len(conversations))],
        sampling=SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed),
        session_ids=conversations,
    )


def served_by(fakes: list, start: list[int]) -> dict[str, str]:  # type: ignore[type-arg]
    """Session -> sidecar address of every call since `start` (calls per fake)."""
    out: dict[str, str] = {}
    for fake, n in zip(fakes, start, strict=True):
        for call in fake.calls[n:]:
            for session in call.session_ids:
                assert out.setdefault(session, fake.address) == fake.address, f"{session} split over two sidecars"
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sidecars=st.integers(1, 4),
    conversations=st.integers(1, 12),
    turns=st.integers(1, 4),
    downs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=3),
    seed=st.integers(0, 2**40),
)
def test_a_session_stays_on_its_sidecar_until_that_one_goes_down(
    sidecars: int, conversations: int, turns: int, downs: list[tuple[int, int]], seed: int
) -> None:
    fleet, fakes = fleet_of([Script() for _ in range(sidecars)])
    sessions = [f"c{i}" for i in range(conversations)]
    pinned: dict[str, str] = {}
    for t in range(turns):
        for at_turn, which in downs:  # a sidecar goes down before this turn (never the last live one)
            if at_turn == t and which < sidecars and len(fleet.live()) > 1:
                fakes[which].script = Script(failure="drop")
                fleet._mark_down(fakes[which], "scripted", [])  # type: ignore[arg-type]
        live = {c.address for c in fleet.live()}
        start = [len(f.calls) for f in fakes]
        result = fleet.generate(turn(sessions, seed + t), rejoin=False)
        now = served_by(fakes, start)
        assert set(now) == set(sessions) and set(now.values()) <= live
        for s in sessions:
            if s in pinned and pinned[s] in live:
                assert now[s] == pinned[s], f"turn {t}: {s} left its live sidecar"
            assert fleet.session_sidecar(s) == now[s]
        moved = sum(1 for s in sessions if s in pinned and pinned[s] not in live)
        assert result.repinned == moved
        assert result.pinned == sum(1 for s in sessions if s in pinned and pinned[s] in live)
        if t == 0 or not pinned:  # new sessions spread evenly
            counts = [sum(1 for a in now.values() if a == address) for address in live]
            assert max(counts) - min(counts) <= 1
        pinned = now
        # the samples are what a lone sidecar gives, whoever served them
        assert [s.token_ids for s in result.samples] == [[expected_token(seed + t, p, 0)] for p in range(len(sessions))]


def test_ended_sessions_are_forgotten_and_prompts_without_one_round_robin() -> None:
    fleet, fakes = fleet_of([Script(), Script()])
    fleet.generate(turn(["a", "b", "c"], 1))
    assert {fleet.session_sidecar(s) for s in "abc"} == {f.address for f in fakes}
    fleet.end_sessions(["a", "b"])
    assert fleet.session_sidecar("a") is None and fleet.session_sidecar("c") is not None
    before = [len(f.calls) for f in fakes]
    plain = GenerationRequest(prompts=[[1], [2], [3], [4]], sampling=SamplingParams(max_new_tokens=2, seed=3))
    fleet.generate(plain)
    assert [len(f.calls) - n for f, n in zip(fakes, before, strict=True)] == [2, 2]
    assert all(not call.session_ids for f in fakes for call in f.calls[-2:])


def test_the_fleet_remembers_at_most_max_sessions_least_recent_first() -> None:
    fleet, _ = fleet_of([Script(), Script()], max_sessions=3)
    fleet.generate(turn(["a", "b", "c"], 1))
    fleet.generate(turn(["a"], 2))  # a is the most recent now
    fleet.generate(turn(["d"], 3))
    assert fleet.session_sidecar("b") is None
    assert all(fleet.session_sidecar(s) is not None for s in "acd")
