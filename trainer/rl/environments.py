"""Multi-turn environments: the policy writes a turn, the environment answers (a tool's output, a
judge's verdict), and the conversation goes on until the environment says it is done.

An environment is a task whose episodes have several turns. It draws problems as a task does
(`sample`, `prompt_ids`), and `reset(problem)` starts one episode; the episode's `step(turn)` takes
the policy's turn as text and returns `Feedback`: the observation appended to the conversation
(tokenised once, never re-tokenising what came before, and never trained on), a reward (an
episode's return is the sum of its rewards) and whether the episode is done. A policy turn ends at
one of the environment's `stop` strings (a tool call's end tag: each must be one token of the
model's tokenizer, as Qwen's `</tool_call>` is), at the end-of-sequence token, or at
`rollout.max_new_tokens`. `trainer.rl.episodes` runs the conversations; the losses see only the
policy's own tokens (the per-token loss mask of `TrainBatch`).

The built-in `CalculatorEnvironment` is arithmetic too long to do in one's head, with a
calculator the policy calls by writing an expression in brackets: `[12*34]` stops the turn and the
environment answers `=408` on a line of its own. User environments are classes named as
"package.module:Class" or "path/to/file.py:Class" (`task.environment`), built with no arguments.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from trainer.rl.rewards import exact_answer_reward, import_named
from trainer.rl.tasks import Problem, ProblemSource, Split, draw_in_split
from trainer.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Feedback:
    """What an environment answers to one policy turn."""

    observation: str = ""
    """Text appended to the conversation after the turn (the tool's output); "" for none."""
    reward: float = 0.0
    """Added to the episode's return."""
    done: bool = False
    """The episode ends here (the policy answered, or gave up)."""


class Episode(Protocol):
    """One conversation's state, from `Environment.reset`."""

    def step(self, turn: str) -> Feedback:
        """The policy's turn (its decoded text, ending at a stop string, EOS or the length cap)."""
        ...


@runtime_checkable
class Environment(ProblemSource, Protocol):
    """A task whose episodes have several turns (see the module docstring)."""

    @property
    def stop(self) -> tuple[str, ...]:
        """Strings that end a policy turn and hand it to the environment (one token each)."""
        ...

    def reset(self, problem: Problem) -> Episode: ...


def continuation_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of `text` as it continues a sequence: without the BOS a tokenizer puts first."""
    ids = tokenizer.encode(text)
    if tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id]:
        ids = ids[1:]
    return ids


def stop_token_ids(env: Environment, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The token of each of `env.stop`; ValueError naming a stop string that is not one token."""
    out = []
    for stop in env.stop:
        ids = continuation_ids(tokenizer, stop)
        if len(ids) != 1:
            raise ValueError(
                f"environment {env.name}: its stop string {stop!r} is {len(ids)} tokens in this tokenizer, but a "
                "turn ends at one token: use a tag the tokenizer holds as one token (e.g. Qwen's '</tool_call>')"
            )
        out.append(ids[0])
    return tuple(out)


# ---- the built-in calculator environment -----------------------------------------------------

_OPS: dict[type, Callable[[int, int], int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_EXPRESSION_CHARS = 64
"""The calculator refuses longer expressions (its answers stay short, its work bounded)."""


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (anything but integers, + - * and brackets)."""


def calculate(expression: str) -> int:
    """The value of an integer expression of + - * and parentheses: a sandbox, since it parses the
    expression with `ast` and evaluates only those nodes (no names, calls, attributes or powers)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an expression") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise CalculatorError(f"{type(node).__name__} is not integer arithmetic")

    return value(tree.body)


@dataclass(kw_only=True, slots=True)
class CalculatorEpisode:
    problem: Problem

    def step(self, turn: str) -> Feedback:
        call = turn.rstrip()
        if call.endswith("]"):  # the turn stopped at the calculator's stop string: a call
            try:
                result = str(calculate(call[call.rfind("[") + 1 : -1]))
            except CalculatorError as e:
                result = f"error ({e})"
            return Feedback(observation=f"={result}\n")
        return Feedback(reward=exact_answer_reward(self.problem.prompt, turn, self.problem.answer), done=True)


@dataclass(kw_only=True, slots=True)
class CalculatorEnvironment:
    """Products and sums of `digits`-digit numbers, e.g. "123*45+678=?": the policy may call the
    calculator ("[123*45]" → "=5535"; a turn ending in ']' is a call, of what follows its last '[',
    and a malformed one is answered "=error (...)") as often as it likes, then answers "#6213"
    (reward 1 for the right integer after the last '#', as the arithmetic task's)."""

    digits: int = 3
    """Digits per operand (1..6)."""
    eval_fraction: float = 0.1
    """Share of all problems reserved for the held-out split (by prompt hash)."""

    stop: tuple[str, ...] = ("]",)

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits must be in 1..6, got {self.digits}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    @property
    def name(self) -> str:
        return f"calculator-{self.digits}d"

    def sample(self, rng: random.Random, split: Split = "train") -> Problem:
        return draw_in_split(lambda: self._draw(rng), split, self.eval_fraction)

    def _draw(self, rng: random.Random) -> Problem:
        lo = 10 ** (self.digits - 1) if self.digits > 1 else 0
        a, b, c = (rng.randrange(lo, 10**self.digits) for _ in range(3))
        op = rng.choice("+-")
        product = a * b
        value = product + c if op == "+" else product - c
        solution = f"[{a}*{b}]={product}\n[{product}{op}{c}]={value}\n#{value}"
        return Problem(prompt=f"{a}*{b}{op}{c}=?\n", answer=str(value), solution=solution)

    def reset(self, problem: Problem) -> CalculatorEpisode:
        return CalculatorEpisode(problem=problem)


# ---- user environments -----------------------------------------------------------------------


class EnvironmentLoadError(ValueError):
    """`task.environment` names no class that builds an environment."""


def load_environment(spec: str) -> Environment:
    """The environment class named by "package.module:Class" or "path/to/file.py:Class", built with
    no arguments; EnvironmentLoadError saying what is missing."""
    try:
        cls = import_named(spec, "task.environment")
    except ValueError as e:
        raise EnvironmentLoadError(str(e)) from None
    try:
        env = cls()
    except Exception as e:  # user code: whatever it raises is reported
        raise EnvironmentLoadError(
            f"task.environment={spec!r}: building it with no arguments failed: {type(e).__name__}: {e}"
        ) from None
    missing = [m for m in ("name", "stop", "sample", "reset") if not hasattr(env, m)]
    if missing:
        raise EnvironmentLoadError(
            f"task.environment={spec!r}: {getattr(cls, '__name__', cls)!r} lacks {missing}; an environment has name, stop, sample(rng, split) "
            "and reset(problem) -> an episode with step(turn) -> Feedback (trainer.rl.environments)"
        )
    return env
