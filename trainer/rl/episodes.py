"""Multi-turn episodes over the sidecars: every conversation's turns in order, many conversations at
once.

Turn 1 asks for G samples of each problem's prompt (one request; the G samples share the prompt's
KV blocks in the engine). Every later turn sends each live conversation's whole token history as
its prompt — the tokens as they were generated and the observations as they were tokenised, never
re-tokenised — in one batched request, so the sidecars decode all live conversations together.
A turn ends at one of the environment's stop tokens, at EOS or at `rollout.max_new_tokens`; the
environment answers it (`trainer.rl.environments.Feedback`); its observation is appended with loss
mask 0 and log-prob 0 (the policy did not sample it), the policy's tokens with mask 1 and the
engine's log-probs. An episode ends when the environment says so, after `task.max_turns` turns,
or when the conversation reaches `task.max_episode_tokens` (a turn or an observation past it is
cut there).

Every request names each prompt's session, one per problem (its G conversations share the prompt),
so a fleet runs every turn of a conversation on the sidecar that ran its first (`Fleet` sessions:
re-pinned only if that sidecar goes down); the sessions are ended with the episodes.

A conversation comes back as one `Sample` (its tokens after the prompt, turns and observations
interleaved; `weight_version` the oldest version that produced a turn's first token, so the
asynchronous lag bound holds for every turn) with its loss mask and return beside it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from sidecar.client.fleet import Fleet, derive_seed
from sidecar.types import FinishReason, GenerationRequest, Sample, SamplingParams, SpeculationCounters
from trainer.rl.environments import Environment, Episode, continuation_ids, stop_token_ids
from trainer.rl.tasks import Problem
from trainer.tokenizer import Tokenizer

_EPISODES = itertools.count()


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    """How long an episode may run."""

    max_turns: int
    """Policy turns per episode, >= 1."""
    max_tokens: int
    """Tokens of a whole conversation (prompt, turns and observations), > the prompt."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"task.max_turns must be >= 1, got {self.max_turns}")
        if self.max_tokens < 2:
            raise ValueError(f"task.max_episode_tokens must be >= 2, got {self.max_tokens}")


@dataclass(kw_only=True, slots=True)
class Episodes:
    """Every conversation of one call, as a `FleetResult` holds samples, with what only episodes have."""

    samples: list[Sample]
    """One a conversation, sorted by (prompt_index, sample_index) of the first turn's request."""
    loss_masks: list[list[int]]
    """Per sample, 1 on the policy's own tokens and 0 on the environment's observations."""
    returns: list[float]
    """Per sample, the sum of the environment's rewards."""
    turns: list[int]
    """Per sample, the policy turns it took."""
    tool_calls: list[int]
    """Per sample, the turns that ended at one of the environment's stop strings."""
    cut: int = 0
    """Episodes ended by a limit (turns or tokens) before the environment said done."""
    seconds: float = 0.0
    rerouted: int = 0
    regenerated: int = 0
    duplicates: int = 0
    nonfinite: int = 0
    pinned: int = 0
    """Turns sent to the sidecar their conversation is pinned to (`Fleet` sessions)."""
    repinned: int = 0
    """Conversations moved to another sidecar because theirs went down."""
    turn_seconds: list[float] = field(default_factory=list)
    """Per turn (first, second, ...), the seconds its requests took."""
    turn_prompt_tokens: list[int] = field(default_factory=list)
    """Per turn, the prompt tokens its requests sent (the histories the sidecars' prefills need)."""
    events: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class _Conversation:
    prompt: list[int]
    episode: Episode
    prompt_index: int
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    ret: float = 0.0
    done: bool = False
    cut: bool = False
    first_versions: list[int] = field(default_factory=list)
    last_versions: list[int] = field(default_factory=list)
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    request_id: str = ""
    finish: FinishReason = FinishReason.LENGTH

    def room(self, limits: EpisodeLimits) -> int:
        return limits.max_tokens - len(self.prompt) - len(self.tokens)

    def append(self, ids: list[int], logprobs: list[float], policy: bool, limits: EpisodeLimits) -> list[int]:
        """Add a turn (`policy`) or an observation, cut where the conversation reaches its limit;
        returns what was added."""
        keep = ids[: max(self.room(limits), 0)]
        self.tokens += keep
        self.logprobs += logprobs[: len(keep)]
        self.loss_mask += [int(policy)] * len(keep)
        return keep

    def end_at_limit(self, limits: EpisodeLimits) -> bool:
        if self.room(limits) > 0:
            return False
        self.done = self.cut = True
        self.finish = FinishReason.LENGTH
        return True

    def sample(self) -> Sample:
        return Sample(
            request_id=self.request_id,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.finish,
            weight_version=min(self.first_versions),
            last_weight_version=max(self.last_versions),
            counters=self.counters,
        )


def run_episodes(
    fleet: Fleet,
    env: Environment,
    tokenizer: Tokenizer,
    problems: list[Problem],
    prompts: list[list[int]],
    *,
    samples_per_prompt: int,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    speculation_k: int | None = None,
    min_weight_version: int = 0,
    rejoin: bool = True,
) -> Episodes:
    """`samples_per_prompt` episodes of each problem (its first observation `prompts[i]`), run to
    their end over `fleet` (see the module docstring). `sampling`: each turn's (its stop tokens
    gain the environment's; its seed, if any, is varied per turn)."""
    stops = stop_token_ids(env, tokenizer)
    episode = f"episode-{next(_EPISODES)}-{time.time_ns():x}"
    conversations = [
        _Conversation(prompt=prompt, episode=env.reset(problem), prompt_index=p, sample_index=g)
        for p, (problem, prompt) in enumerate(zip(problems, prompts, strict=True))
        for g in range(samples_per_prompt)
    ]
    for c in conversations:
        if c.room(limits) <= 0:
            raise ValueError(
                f"a prompt of {len(c.prompt)} tokens leaves no room in task.max_episode_tokens={limits.max_tokens}"
            )
    out = Episodes(samples=[], loss_masks=[], returns=[], turns=[], tool_calls=[])
    for turn in range(limits.max_turns):
        live = [c for c in conversations if not c.done]
        if not live:
            break
        # one request per turn length the conversations have room for (a prompt and its new tokens
        # must fit the context): usually one, a second for the conversations near their limit
        by_length: dict[int, list[_Conversation]] = {}
        for c in live:
            by_length.setdefault(min(sampling.max_new_tokens, c.room(limits)), []).append(c)
        out.turn_seconds.append(0.0)
        out.turn_prompt_tokens.append(0)
        for n, group in sorted(by_length.items(), reverse=True):
            turn_sampling = dataclasses.replace(
                sampling,
                stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *stops))),
                max_new_tokens=n,
                seed=None if sampling.seed is None else derive_seed(sampling.seed, turn, n),
            )
            taken = _turn(
                fleet,
                group,
                turn == 0,
                turn_sampling,
                samples_per_prompt,
                speculation_k,
                min_weight_version,
                rejoin,
                episode,
                out,
            )
            for c, s in taken:
                _take_turn(c, s, tokenizer, stops, limits)
    fleet.end_sessions([f"{episode}/{p}" for p in range(len(prompts))])
    for c in conversations:
        out.samples.append(c.sample())
        out.loss_masks.append(c.loss_mask)
        out.returns.append(c.ret)
        out.turns.append(c.turns)
        out.tool_calls.append(c.tool_calls)
        out.cut += int(c.cut)
    return out


def _turn(
    fleet: Fleet,
    group: list[_Conversation],
    first: bool,
    sampling: SamplingParams,
    samples_per_prompt: int,
    speculation_k: int | None,
    min_weight_version: int,
    rejoin: bool,
    episode: str,
    out: Episodes,
) -> list[tuple[_Conversation, Sample]]:
    """One turn of `group` in one request: its samples with their conversations (the fleet's
    counts added to `out`). The first turn asks G samples of each problem's prompt (a problem's G
    conversations share a session: their prompt's KV is shared); later turns one sample of each
    conversation's history."""
    if first:
        heads = group[::samples_per_prompt]  # the G conversations of a problem are adjacent
        prompts, per_prompt = [c.prompt for c in heads], samples_per_prompt
    else:
        heads, prompts, per_prompt = group, [c.prompt + c.tokens for c in group], 1
    request = GenerationRequest(
        prompts=prompts,
        sampling=sampling,
        samples_per_prompt=per_prompt,
        speculation_k=speculation_k,
        min_weight_version=min_weight_version,
        session_ids=[f"{episode}/{c.prompt_index}" for c in heads],
    )
    result = fleet.generate(request, rejoin=rejoin)
    out.seconds += result.seconds
    out.turn_seconds[-1] += result.seconds
    out.turn_prompt_tokens[-1] += sum(len(p) for p in prompts)
    out.rerouted += result.rerouted
    out.regenerated += result.regenerated
    out.duplicates += result.duplicates
    out.nonfinite += result.nonfinite
    out.pinned += result.pinned
    out.repinned += result.repinned
    out.events += result.events
    if first:
        return [(group[s.prompt_index * samples_per_prompt + s.sample_index], s) for s in result.samples]
    return [(group[s.prompt_index], s) for s in result.samples]


def _take_turn(
    c: _Conversation, s: Sample, tokenizer: Tokenizer, stops: tuple[int, ...], limits: EpisodeLimits
) -> None:
    c.request_id = c.request_id or s.request_id
    c.first_versions.append(s.weight_version)
    c.last_versions.append(s.last_weight_version)
    c.counters.add(s.counters)
    c.turns += 1
    c.finish = s.finish_reason
    kept = c.append(s.token_ids, s.logprobs, True, limits)
    c.tool_calls += int(bool(kept) and kept[-1] in stops and s.finish_reason == FinishReason.STOP)
    feedback = c.episode.step(tokenizer.decode(kept))  # every turn is answered, a cut one too
    c.ret += float(feedback.reward)
    if feedback.done:
        c.done = True
        return
    if c.end_at_limit(limits):
        return
    if c.turns >= limits.max_turns:  # no turn follows: the observation would be read by nobody
        c.done = c.cut = True
        return
    if feedback.observation:
        ids = continuation_ids(tokenizer, feedback.observation)
        c.append(ids, [0.0] * len(ids), False, limits)
        c.end_at_limit(limits)


def episode_metrics(episodes: Episodes) -> dict[str, float]:
    """What a step logs of its episodes: turns and tool calls per episode, episodes cut by a limit,
    the share of a conversation's tokens that the environment wrote, and each turn's seconds and
    prompt tokens (`time/turn_N`, `rollout/turn_N_prompt_tokens`, N from 1)."""
    n = len(episodes.samples)
    tokens = sum(len(m) for m in episodes.loss_masks)
    per_turn = {f"time/turn_{t + 1}": s for t, s in enumerate(episodes.turn_seconds)}
    per_turn |= {f"rollout/turn_{t + 1}_prompt_tokens": float(p) for t, p in enumerate(episodes.turn_prompt_tokens)}
    return per_turn | {
        "rollout/turns_mean": sum(episodes.turns) / n,
        "rollout/tool_calls_mean": sum(episodes.tool_calls) / n,
        "rollout/episodes_cut": float(episodes.cut),
        "rollout/sessions_repinned": float(episodes.repinned),
        "rollout/observation_token_share": (tokens - sum(map(sum, episodes.loss_masks))) / max(tokens, 1),
    }
