"""Multi-turn episodes (`trainer.rl.episodes`, `trainer.rl.environments`) against hand-built oracles.

A scripted fleet plays the policy: its next turn is a function of the conversation so far, so the
conversation, its log-probs and its loss mask can be written out by hand and compared exactly;
the calculator's sandbox is checked against Python's arithmetic and against what it must refuse.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.client.fleet import FleetResult
from sidecar.types import FinishReason, GenerationRequest, Sample, SamplingParams
from trainer.policy.losses import GRPOConfig, policy_loss
from trainer.policy.policy import TrainBatch
from trainer.rl.environments import (
    CalculatorEnvironment,
    CalculatorError,
    Feedback,
    calculate,
    continuation_ids,
    stop_token_ids,
)
from trainer.rl.episodes import EpisodeLimits, episode_metrics, run_episodes
from trainer.rl.tasks import Problem
from trainer.tokenizer import CharTokenizer

TOK = CharTokenizer()
PROBLEM = Problem(prompt="12*34+5=?\n", answer="413")
PROMPT = TOK.encode(PROBLEM.prompt)


def ids(text: str) -> list[int]:
    return continuation_ids(TOK, text)


def logprob(position: int) -> float:
    """The scripted policy's log-prob of the token at `position` of the whole conversation."""
    return -0.01 * (position + 1)


@dataclass
class ScriptFleet:
    """Plays the policy: the turn after a conversation is `script[its text after the prompt]`,
    ending at the request's stop tokens (the stop kept) or with EOS, cut at max_new_tokens. Every
    call serves the next weight version, so a conversation's turns come from different versions."""

    script: dict[str, str]
    context: int = 10_000
    """The model's context: a prompt plus max_new_tokens beyond it is refused, as a sidecar does."""
    version: int = 0
    requests: list[GenerationRequest] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)

    def end_sessions(self, session_ids: list[str]) -> None:
        self.ended += session_ids

    def generate(self, request: GenerationRequest, *, rejoin: bool = True) -> FleetResult:
        self.requests.append(request)
        self.version += 1
        samples = []
        for p, prompt in enumerate(request.prompts):
            for g in range(request.samples_per_prompt):
                assert len(prompt) + request.sampling.max_new_tokens <= self.context, "the sidecar refuses this"
                history = TOK.decode(prompt).split("\n", 1)[1]  # after the problem's one line
                turn = [*ids(self.script[history]), TOK.eos_id]
                stop = next((i for i, t in enumerate(turn) if t in request.sampling.stop_token_ids), len(turn))
                turn = turn[: stop + 1]
                reason = FinishReason.STOP
                if len(turn) > request.sampling.max_new_tokens:
                    turn, reason = turn[: request.sampling.max_new_tokens], FinishReason.LENGTH
                samples.append(
                    Sample(
                        request_id="r",
                        prompt_index=p,
                        sample_index=g,
                        token_ids=turn,
                        logprobs=[logprob(len(prompt) + i) for i in range(len(turn))],
                        finish_reason=reason,
                        weight_version=self.version,
                        last_weight_version=self.version,
                    )
                )
        return FleetResult(samples=samples, seconds=0.5 * len(self.requests))  # call n takes n/2 seconds


SOLVES = {"": "[12*34]", "[12*34]=408\n": "[408+5]", "[12*34]=408\n[408+5]=413\n": "#413"}
"""Calls the calculator twice, then answers."""


def run(  # type: ignore[no-untyped-def]
    fleet: ScriptFleet, limits: EpisodeLimits, samples: int = 1, max_new_tokens: int = 32, problems=(PROBLEM,)
):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=(TOK.eos_id,), seed=7)
    return run_episodes(
        fleet,  # type: ignore[arg-type]
        CalculatorEnvironment(),
        TOK,
        list(problems),
        [TOK.encode(p.prompt) for p in problems],
        samples_per_prompt=samples,
        sampling=sampling,
        limits=limits,
    )


def test_an_episode_is_its_turns_and_observations_in_order_with_only_the_policy_tokens_trained() -> None:
    fleet = ScriptFleet(SOLVES)
    out = run(fleet, EpisodeLimits(max_turns=8, max_tokens=200), samples=2)
    policy = [ids("[12*34]"), ids("[408+5]"), [*ids("#413"), TOK.eos_id]]
    observations = [ids("=408\n"), ids("=413\n")]
    want = policy[0] + observations[0] + policy[1] + observations[1] + policy[2]
    mask = [1] * len(policy[0]) + [0] * len(observations[0]) + [1] * len(policy[1]) + [0] * len(observations[1])
    mask += [1] * len(policy[2])
    start = len(PROMPT)
    want_logprobs = [logprob(start + i) if m else 0.0 for i, m in enumerate(mask)]
    assert len(out.samples) == 2
    for sample, loss_mask in zip(out.samples, out.loss_masks, strict=True):
        assert sample.token_ids == want
        assert loss_mask == mask
        assert sample.logprobs == want_logprobs
        assert (sample.weight_version, sample.last_weight_version) == (1, 3)  # turns from versions 1, 2, 3
        assert sample.finish_reason == FinishReason.STOP
    assert out.returns == [1.0, 1.0] and out.turns == [3, 3] and out.tool_calls == [2, 2] and out.cut == 0
    # turn 1 asks G samples of the prompt; later turns send each conversation's whole history
    assert [len(r.prompts) for r in fleet.requests] == [1, 2, 2]
    assert fleet.requests[0].samples_per_prompt == 2
    assert fleet.requests[2].prompts[0] == PROMPT + policy[0] + observations[0] + policy[1] + observations[1]
    assert set(fleet.requests[1].sampling.stop_token_ids) == {TOK.eos_id, *ids("]")}
    assert len({r.sampling.seed for r in fleet.requests}) == 3  # a fresh stream per turn
    # one session per problem, named on every turn, ended with the episodes
    sessions = [r.session_ids for r in fleet.requests]
    assert sessions[0] == sessions[1][:1] == sessions[2][:1] and len(set(sessions[1])) == 1
    assert fleet.ended == sessions[0]
    # per turn: the seconds of its request, the prompt tokens it sent (G prompts once, then histories)
    assert out.turn_seconds == [0.5, 1.0, 1.5]
    assert out.turn_prompt_tokens == [len(PROMPT)] + [2 * len(r.prompts[0]) for r in fleet.requests[1:]]
    m = episode_metrics(out)
    assert (m["time/turn_1"], m["time/turn_3"], m["rollout/turn_2_prompt_tokens"]) == (
        0.5,
        1.5,
        float(out.turn_prompt_tokens[1]),
    )


def test_the_turn_limit_ends_an_episode_without_a_trailing_observation() -> None:
    out = run(ScriptFleet(SOLVES), EpisodeLimits(max_turns=2, max_tokens=200))
    assert out.samples[0].token_ids == ids("[12*34]") + ids("=408\n") + ids("[408+5]")
    assert out.loss_masks[0] == [1] * 7 + [0] * 5 + [1] * 7
    assert out.returns == [0.0] and out.cut == 1 and out.tool_calls == [2]


@pytest.mark.parametrize("max_tokens", [len(PROMPT) + 3, len(PROMPT) + 9, len(PROMPT) + 20])
def test_the_token_limit_cuts_a_turn_or_an_observation_where_it_falls(max_tokens: int) -> None:
    out = run(ScriptFleet(SOLVES), EpisodeLimits(max_turns=8, max_tokens=max_tokens))
    full = ids("[12*34]") + ids("=408\n") + ids("[408+5]") + ids("=413\n")
    full_mask = [1] * 7 + [0] * 5 + [1] * 7 + [0] * 5
    n = max_tokens - len(PROMPT)
    assert out.samples[0].token_ids == full[:n]
    assert out.loss_masks[0] == full_mask[:n]
    assert out.samples[0].finish_reason == FinishReason.LENGTH
    # a turn cut inside its first tool call is still answered: the calculator takes it for the
    # (wrong) answer and ends the episode; a cut observation ends it at the limit
    assert out.cut == int(n > 7) and out.returns == [0.0]
    assert len(PROMPT) + len(out.samples[0].token_ids) == max_tokens


def test_no_conversation_is_asked_for_more_tokens_than_it_has_room_for() -> None:
    """Conversations of one turn differ in room: each is asked for at most what it has (a sidecar
    refuses a prompt whose new tokens would pass the context), in one request per length."""
    longer = Problem(prompt="12*34+5=?  \n", answer="413")  # two tokens longer
    limit = len(PROMPT) + 21  # after turn 1 and its answer (12 tokens): room for 9 and for 7
    fleet = ScriptFleet(SOLVES, context=limit)
    out = run(fleet, EpisodeLimits(max_turns=8, max_tokens=limit), max_new_tokens=8, problems=(PROBLEM, longer))
    assert [len(PROMPT) + len(out.samples[0].token_ids), len(PROMPT) + 2 + len(out.samples[1].token_ids)] == [
        limit,
        limit,
    ]
    assert out.cut == 2
    assert [r.sampling.max_new_tokens for r in fleet.requests] == [8, 8, 7]  # turn 2: one request a length


def test_a_turn_cut_at_max_new_tokens_is_still_answered() -> None:
    out = run(ScriptFleet({"": "[12*34]"}), EpisodeLimits(max_turns=8, max_tokens=200), max_new_tokens=4)
    assert out.samples[0].token_ids == ids("[12*")
    assert out.samples[0].finish_reason == FinishReason.LENGTH
    assert out.turns == [1] and out.tool_calls == [0] and out.returns == [0.0] and out.cut == 0  # judged: done


def test_a_stop_string_that_is_not_one_token_is_refused_by_name() -> None:
    class Tagged(CalculatorEnvironment):
        pass

    env = Tagged()
    env.stop = ("</tool>",)
    with pytest.raises(ValueError, match=r"stop string '</tool>' is 7 tokens"):
        stop_token_ids(env, TOK)


def test_the_masked_loss_is_the_loss_of_the_policy_tokens_alone() -> None:
    """GRPO's token-level and sequence-level losses over a conversation with its loss mask equal the
    closed form computed over the policy's tokens only (the observations dropped from the row)."""
    torch.manual_seed(0)
    prompt, turns = [5, 6, 7], [[8, 9], [10, 11, 12], [13]]
    observations = [[20, 21, 22], [23]]
    response = turns[0] + observations[0] + turns[1] + observations[1] + turns[2]
    mask = [1, 1, 0, 0, 0, 1, 1, 1, 0, 1]
    batch = TrainBatch.from_sequences([prompt], [response], torch.tensor([0.7]), loss_masks=[mask])
    t = batch.mask.shape[1]
    logp, old = -torch.rand(1, t), -torch.rand(1, t)
    on = batch.mask[0].bool()
    assert int(on.sum()) == 6 and bool((batch.mask[0, : len(prompt) - 1] == 0).all())
    for token_level in (True, False):
        cfg = GRPOConfig(token_level=token_level, eps_low=0.2, eps_high=0.28)
        got = policy_loss(logp, old, batch.advantages, batch.mask, cfg).loss
        ratio = torch.exp(logp[0, on] - old[0, on])
        per_token = -torch.minimum(ratio * 0.7, ratio.clamp(0.8, 1.28) * 0.7)
        assert torch.allclose(got, per_token.mean(), atol=1e-7)  # one row: both aggregations are the mean


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-999, 999), st.sampled_from("+-*")), min_size=1, max_size=5), st.integers(-999, 999)
)
def test_the_calculator_agrees_with_python_on_integer_arithmetic(terms: list[tuple[int, str]], last: int) -> None:
    expression = "".join(f"({a}){op}" for a, op in terms) + f"({last})"
    assert calculate(expression) == eval(expression)  # the oracle: Python's own arithmetic on the same text


@pytest.mark.parametrize(
    "expression", ["__import__('os')", "2**99", "a+1", "1/2", "[1]", "(1).real", "1;2", "9" * 65, "1.5+1", "True+1"]
)
def test_the_calculator_refuses_what_is_not_integer_arithmetic(expression: str) -> None:
    with pytest.raises(CalculatorError):
        calculate(expression)


def test_the_calculator_environment_answers_tool_calls_and_judges_the_answer() -> None:
    env = CalculatorEnvironment(digits=3)
    problem = env.sample(random.Random(0))
    episode = env.reset(problem)
    a, rest = problem.prompt.split("*", 1)
    b = rest[: next(i for i, ch in enumerate(rest) if ch in "+-")]
    assert episode.step(f"[{a}*{b}]") == Feedback(observation=f"={int(a) * int(b)}\n")
    assert episode.step("[1/0]").observation.startswith("=error")
    assert episode.step("oops]").observation.startswith("=error")  # any turn ending at ']' is a call
    assert episode.step("7*6]") == Feedback(observation="=42\n")
    assert episode.step(f"#{problem.answer}") == Feedback(reward=1.0, done=True)
    assert env.reset(problem).step("#0") == Feedback(reward=0.0 if problem.answer != "0" else 1.0, done=True)
    # its reference solution, played back, earns the reward
    solution = problem.solution.split("\n")
    replay = env.reset(problem)
    for line in solution[:-1]:
        call = line[: line.index("]") + 1]
        assert replay.step(call).observation == line[len(call) :] + "\n"
    assert replay.step(solution[-1]).reward == 1.0


USER_ENVIRONMENT = """
from trainer.rl.environments import Feedback
from trainer.rl.tasks import Problem

class Echo:
    name = "echo"
    stop = ("]",)

    def sample(self, rng, split="train"):
        return Problem(prompt=f"say {rng.randrange(10)}\\n", answer="")

    def reset(self, problem):
        return self

    def step(self, turn):
        return Feedback(reward=1.0, done=True)

class NeedsArguments(Echo):
    def __init__(self, size):
        pass

class NotAnEnvironment:
    pass
"""


def test_a_user_environment_is_built_from_its_file_and_bad_names_are_refused_clearly(tmp_path: Path) -> None:
    from trainer.rl.config import TaskConfig
    from trainer.rl.environments import EnvironmentLoadError, load_environment

    file = tmp_path / "envs.py"
    file.write_text(USER_ENVIRONMENT)
    env = TaskConfig(kind="environment", environment=f"{file}:Echo").build()
    assert env.name == "echo" and env.reset(PROBLEM).step("x") == Feedback(reward=1.0, done=True)
    cases = {
        f"{file}:Missing": "cannot import task.environment",
        f"{tmp_path / 'nowhere.py'}:Echo": "does not exist",
        "no_such_package_xyz:Env": "cannot import task.environment",
        "Echo": "name it as 'package.module:name'",
        f"{file}:NeedsArguments": "building it with no arguments failed: TypeError",
        f"{file}:NotAnEnvironment": "lacks ['name', 'stop', 'sample', 'reset']",
    }
    for spec, message in cases.items():
        with pytest.raises(EnvironmentLoadError, match=re.escape(message)):
            load_environment(spec)
    with pytest.raises(ValueError, match="task.kind=environment"):
        TaskConfig(kind="calculator", environment=f"{file}:Echo")
    with pytest.raises(ValueError, match="task.environment must name a class"):
        TaskConfig(kind="environment")
    with pytest.raises(ValueError, match="rewards its own episodes"):
        TaskConfig(kind="calculator", rewards=("exact",))
