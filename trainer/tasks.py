"""Verifiable tasks and rewards for RL: built-in synthetic arithmetic, and user datasets.

Two built-in families are generated on the fly from a seed, like the two regimes of the
reference study:

- ``zero``: two-operand addition with a short written-out scratchpad (one line per digit, with
  the carry), then the answer: short completions, the "RL-zero" regime.
- ``think``: a chain of 3–5 additions and subtractions solved step by step, one line per
  operation: longer completions with more text per verify step, the "thinking" regime.

Every completion ends with ``#<answer>``; the reward is 1.0 when the integer after the last
``#`` equals the answer, else 0.0 (binary and verifiable, as in GRPO/DAPO).

A problem belongs to the training or the held-out split by a hash of its prompt, so the
held-out set never appears in training, whatever the seed.

User datasets are JSONL files with one ``{"prompt": str, "answer": str}`` object per line; a user
reward function is any importable callable ``reward(prompt: str, completion: str, answer: str)
-> float`` named as ``"package.module:function"``.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from sidecar.errors import SpecrlError

RewardFn = Callable[[str, str, str], float]
Split = Literal["train", "eval"]
_ANSWER = re.compile(r"#\s*(-?\d+)\s*$")
_INTEGER = re.compile(r"-?\d+")


def rows_message(bad: list[str], fix: str) -> str:
    """One message for bad dataset rows: the first few named, and how many in all."""
    shown = "; ".join(bad[:5])
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    return f"{len(bad)} bad row(s): {shown}{more}; {fix}"


@dataclass(frozen=True, slots=True)
class Problem:
    """One task instance."""

    prompt: str
    answer: str
    solution: str = ""
    """A reference completion (for supervised warm-up and draft initialisation); "" if unknown."""


class Task(Protocol):
    """A source of problems and their reward."""

    @property
    def name(self) -> str: ...

    def sample(self, rng: random.Random, split: Split = "train") -> Problem: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def extract_answer(completion: str) -> str | None:
    """The integer after the last '#' at the end of the completion, or None."""
    match = _ANSWER.search(completion.strip())
    return match.group(1) if match else None


def exact_answer_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion ends with '#<answer>' (integers compared by value), else 0.0."""
    got = extract_answer(completion)
    return 1.0 if got is not None and int(got) == int(answer) else 0.0


def _split_of(prompt: str, eval_fraction: float) -> Split:
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") / 2**64 < eval_fraction else "train"


@dataclass(kw_only=True, slots=True)
class ArithmeticTask:
    """Synthetic arithmetic with a written-out solution (see the module docstring)."""

    regime: Literal["zero", "think"] = "zero"
    """"zero": short scratchpad addition; "think": multi-step chains."""
    digits: int = 2
    """Digits per operand (1..6)."""
    eval_fraction: float = 0.1
    """Share of all problems reserved for the held-out split."""

    def __post_init__(self) -> None:
        if self.regime not in ("zero", "think"):
            raise ValueError(f"regime must be 'zero' or 'think', got {self.regime!r}")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits must be in 1..6, got {self.digits}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    @property
    def name(self) -> str:
        return f"arithmetic-{self.regime}-{self.digits}d"

    def sample(self, rng: random.Random, split: Split = "train") -> Problem:
        """Draw problems until one falls in `split` (about 1/eval_fraction draws at most)."""
        for _ in range(10_000):
            problem = self._zero(rng) if self.regime == "zero" else self._think(rng)
            if _split_of(problem.prompt, self.eval_fraction) == split:
                return problem
        raise RuntimeError(f"no {split} problem in 10000 draws; eval_fraction={self.eval_fraction} is too extreme")

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_answer_reward(problem.prompt, completion, problem.answer)

    def _operand(self, rng: random.Random) -> int:
        return rng.randrange(10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits)

    def _zero(self, rng: random.Random) -> Problem:
        a, b = self._operand(rng), self._operand(rng)
        lines, carry = [], 0
        da, db = str(a)[::-1], str(b)[::-1]
        for i in range(max(len(da), len(db))):
            x = int(da[i]) if i < len(da) else 0
            y = int(db[i]) if i < len(db) else 0
            s = x + y + carry
            lines.append(f"{x}+{y}+{carry}={s}")
            carry = s // 10
        return Problem(prompt=f"{a}+{b}=?\n", answer=str(a + b), solution=",".join(lines) + f"#{a + b}")

    def _think(self, rng: random.Random) -> Problem:
        n = rng.randint(3, 5)
        values = [self._operand(rng) for _ in range(n)]
        ops = [rng.choice("+-") for _ in range(n - 1)]
        expr = str(values[0]) + "".join(f"{op}{v}" for op, v in zip(ops, values[1:], strict=True))
        steps, acc = [], values[0]
        for op, v in zip(ops, values[1:], strict=True):
            new = acc + v if op == "+" else acc - v
            steps.append(f"{acc}{op}{v}={new}")
            acc = new
        return Problem(prompt=f"{expr}=?\n", answer=str(acc), solution="\n".join(steps) + f"\n#{acc}")


def distinct_problems(task: Task, rng: random.Random, split: Split, size: int) -> list[Problem]:
    """`size` problems of `split` with distinct prompts, drawn in order from `rng`; fewer (all the
    split has) when the split holds fewer than `size` distinct prompts. A held-out set with repeats
    would count a problem twice and understate its standard error."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    seen: set[str] = set()
    problems: list[Problem] = []
    misses = 0
    while len(problems) < size and misses < 20 * size + 1000:  # ~ the coupon collector's bound
        problem = task.sample(rng, split)
        if problem.prompt in seen:
            misses += 1
            continue
        seen.add(problem.prompt)
        problems.append(problem)
    return problems


class RewardFunctionError(SpecrlError, TypeError):
    """A user reward function that raised or returned something other than a finite number."""


def load_reward_fn(spec: str) -> RewardFn:
    """Import `"package.module:function"` and check it takes (prompt, completion, answer)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {spec!r} must be written 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import reward function {spec!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer")
    except TypeError as e:
        raise ValueError(f"reward function {spec!r} must accept (prompt, completion, answer): {e}") from e
    return fn


@dataclass(kw_only=True, slots=True)
class JsonlTask:
    """A user dataset: JSONL lines {"prompt": str, "answer": str}, with a reward function.

    Every row is checked when the file is read, and every bad row is named with its file and line:
    a prompt must be a non-blank string, an answer a string or a number; with the default reward
    (`exact_answer_reward`, which compares integers) an answer must be an integer (`-12`, not
    `1,000`, `twenty` or `3.5`: write those for a reward function of your own, `task.reward_fn`)."""

    path: Path
    reward_fn: RewardFn = exact_answer_reward
    eval_fraction: float = 0.1
    problems: tuple[Problem, ...] = ()
    lines: tuple[int, ...] = ()
    """The file's line number of each problem (for messages that name a row)."""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not self.path.is_file():
            raise FileNotFoundError(f"dataset {self.path} does not exist")
        problems, lines, bad = [], [], []
        for line_no, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                problem = self._row(json.loads(line))
            except (json.JSONDecodeError, ValueError) as e:
                bad.append(f"{self.path}:{line_no}: {e}")
                continue
            problems.append(problem)
            lines.append(line_no)
        if bad:
            raise ValueError(rows_message(bad, "fix or remove them"))
        if not problems:
            raise ValueError(f"{self.path} holds no problems")
        self.problems, self.lines = tuple(problems), tuple(lines)

    def _row(self, row: object) -> Problem:
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise ValueError("expected a JSON object with 'prompt' and 'answer'")
        prompt, answer = row["prompt"], row["answer"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt {prompt!r} is empty or not a string")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"answer {answer!r} is not a string or a number")
        answer = str(answer)
        if self.reward_fn is exact_answer_reward and not _INTEGER.fullmatch(answer.strip()):
            raise ValueError(
                f"answer {answer!r} is not an integer, which the default reward compares with the '#<int>' a "
                "completion ends with: write it as one (1000, not 1,000), or set task.reward_fn to a reward "
                "that reads it"
            )
        return Problem(prompt=prompt, answer=answer)

    def located(self) -> list[tuple[str, Problem]]:
        """Every problem with where it is written ("file:line")."""
        return [(f"{self.path}:{n}", p) for n, p in zip(self.lines, self.problems, strict=True)]

    @property
    def name(self) -> str:
        return self.path.stem

    def sample(self, rng: random.Random, split: Split = "train") -> Problem:
        pool = [p for p in self.problems if _split_of(p.prompt, self.eval_fraction) == split] or list(self.problems)
        return rng.choice(pool)

    def reward(self, problem: Problem, completion: str) -> float:
        try:
            value = self.reward_fn(problem.prompt, completion, problem.answer)
        except Exception as e:  # user code: whatever it raises is reported with its input
            raise RewardFunctionError(
                f"reward function {getattr(self.reward_fn, '__qualname__', self.reward_fn)!r} raised "
                f"{type(e).__name__}: {e} (prompt {problem.prompt[:40]!r}, completion {completion[:40]!r})"
            ) from e
        if not isinstance(value, int | float) or value != value:
            raise RewardFunctionError(
                f"reward function returned {value!r} for prompt {problem.prompt[:40]!r}; return a float"
            )
        return float(value)
