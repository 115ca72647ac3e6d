"""Verifiable tasks for RL: built-in synthetic arithmetic, and user datasets.

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

A user dataset (`DatasetTask`) is any file or directory the `datasets` library reads (parquet,
JSON, CSV, arrow, a `save_to_disk` directory, or a hub id where there is a network; JSONL is read
line by line so that every message names its line), with a mapping of its columns onto the prompt
(a string, or a conversation), the answer, and optionally a reference solution or a conversation
ending in the assistant's turn (for supervised warm-up). Its prompts are rendered with the
model's own chat template (`Tokenizer.render_chat`). Rewards: `trainer.rl.rewards`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from trainer.rl.rewards import Reward, exact_answer_reward, score
from trainer.tokenizer import Tokenizer

RewardFn = Callable[[str, str, str], float]
Split = Literal["train", "eval"]
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
    """The question (a conversation's last user turn); what the held-out split is hashed on and
    what reward functions get as `prompt`."""
    answer: str
    solution: str = ""
    """A reference completion (for supervised warm-up and draft initialisation); "" if unknown."""
    messages: tuple[Message, ...] = ()
    """The conversation the policy answers (its chat-template input) when the row holds one; ()
    for a plain prompt."""


Message = dict[str, str]
"""One chat turn, {"role": "system" | "user" | "assistant", "content": str}."""


class ProblemSource(Protocol):
    """What draws problems: a task, or a multi-turn environment (`trainer.rl.environments`)."""

    @property
    def name(self) -> str: ...

    def sample(self, rng: random.Random, split: Split = "train") -> Problem: ...


class Task(ProblemSource, Protocol):
    """A source of problems and their reward."""

    def reward(self, problem: Problem, completion: str) -> float: ...


def draw_in_split(draw: Callable[[], Problem], split: Split, eval_fraction: float) -> Problem:
    """Problems from `draw` until one falls in `split` (about 1/eval_fraction draws at most)."""
    for _ in range(10_000):
        problem = draw()
        if split_of(problem.prompt, eval_fraction) == split:
            return problem
    raise RuntimeError(f"no {split} problem in 10000 draws; eval_fraction={eval_fraction} is too extreme")


def split_of(prompt: str, eval_fraction: float) -> Split:
    """ "eval" for the share `eval_fraction` of prompts (by a hash of the text), else "train"."""
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
        return draw_in_split(
            lambda: self._zero(rng) if self.regime == "zero" else self._think(rng), split, self.eval_fraction
        )

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_answer_reward(problem.prompt, completion, problem.answer)

    def prompt_ids(self, problem: Problem, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(problem.prompt)

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


def distinct_problems(task: ProblemSource, rng: random.Random, split: Split, size: int) -> list[Problem]:
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


def prompt_ids(task: ProblemSource, tokenizer: Tokenizer, problem: Problem) -> list[int]:
    """The token ids of `problem`'s prompt as the policy sees it (the task's rendering, e.g. through
    the model's chat template; a task without one encodes the prompt text)."""
    render = getattr(task, "prompt_ids", None)
    return render(problem, tokenizer) if render is not None else tokenizer.encode(problem.prompt)


def score_completions(
    task: Task, problems: list[Problem], completions: list[str]
) -> tuple[list[float], dict[str, list[float]]]:
    """Each completion's reward and, for a task with several reward terms, each term's values by name
    (batched where the task scores in batches)."""
    batched = getattr(task, "score", None)
    if batched is not None:
        return batched(problems, completions)
    return [task.reward(p, c) for p, c in zip(problems, completions, strict=True)], {}


class ColumnError(ValueError):
    """A dataset row lacks a column the field mapping names (never filtered: the mapping is wrong)."""


@dataclass(kw_only=True, slots=True)
class DatasetFields:
    """Which column of a dataset holds what (a column named "" is not read)."""

    prompt: str = "prompt"
    """The question: a string, or a conversation (a list of {"role", "content"} turns, TRL's
    conversational format)."""
    answer: str = "answer"
    """The reference answer the reward compares with (a string or a number; GSM8K's "… #### 72" is
    read as 72 by the gsm8k and math rewards, and is the reference solution when `solution` is "")."""
    solution: str = ""
    """A reference completion for supervised warm-up (`specrl warmup`)."""
    messages: str = ""
    """A conversation column: the prompt is every turn before a final assistant turn, which is the
    reference solution (warm-up trains on that turn alone). Used instead of `prompt` when set."""


def read_rows(source: str | Path, split: str = "train") -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a dataset and where each is written ("file:line" for JSONL, "file row N" else).

    JSONL files are read line by line (a bad line is named); parquet, JSON, CSV and arrow files, a
    `save_to_disk` directory (a DatasetDict's `split`) and otherwise a hub id (`split`) go through
    the `datasets` library."""
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_file():
        rows, where, bad = [], [], []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
                where.append(f"{path}:{line_no}")
            except json.JSONDecodeError as e:
                bad.append(f"{path}:{line_no}: not valid JSON ({e})")
        if bad:
            raise ValueError(rows_message(bad, "fix or remove them"))
        return rows, where
    import datasets

    builders = {".parquet": "parquet", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"{path} has splits {sorted(loaded)}, not {split!r}: set task.split")
                loaded = loaded[split]
        elif path.is_file():
            if path.suffix not in builders:
                raise ValueError(f"{path}: cannot read {path.suffix!r} files; use {sorted(builders)} or .jsonl")
            loaded = datasets.load_dataset(builders[path.suffix], data_files=str(path), split="train")
        else:
            loaded = datasets.load_dataset(str(source), split=split)
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise ValueError(f"dataset {source}: not a file, a saved dataset directory or a reachable hub id ({e})") from e
    rows = [dict(r) for r in loaded]
    return rows, [f"{path} row {i + 1}" for i in range(len(rows))]


@dataclass(kw_only=True, slots=True)
class DatasetTask:
    """A user dataset (see the module docstring), with its rewards and how its prompts are rendered.

    Every row is checked when the dataset is read, and every bad row is named with where it is
    written: a prompt must be a non-blank string or a conversation, an answer a string or a number;
    with the `exact` reward (which compares integers) an answer must be an integer (`-12`, not
    `1,000`, `twenty` or `3.5`: use the `math` or `gsm8k` reward for those). With `filter_rows` bad
    rows are dropped and counted (`dropped`) instead."""

    path: str | Path
    """A file, a `save_to_disk` directory, or a hub id."""
    fields: DatasetFields = field(default_factory=DatasetFields)
    rewards: tuple[Reward, ...] = (Reward(name="exact", fn=exact_answer_reward),)
    eval_path: str | Path | None = None
    """A held-out dataset of its own; None: `eval_fraction` of `path`'s problems, split by prompt hash."""
    split: str = "train"
    eval_split: str = ""
    eval_fraction: float = 0.1
    system_prompt: str = ""
    """A system turn put before every plain prompt (through the chat template, or as a first line)."""
    chat_template: bool | None = None
    """Render plain prompts with the model's chat template: None when the tokenizer has one."""
    filter_rows: bool = False
    needs_answers: bool = True
    """Rows must hold an answer (RL rewards them); False for warm-up only datasets."""
    problems: tuple[Problem, ...] = ()
    where: tuple[str, ...] = ()
    """Where each problem is written (for messages that name a row)."""
    eval_problems: tuple[Problem, ...] = ()
    eval_where: tuple[str, ...] = ()
    dropped: dict[str, int] = field(default_factory=dict)
    """With `filter_rows`: how many rows were dropped, by reason."""

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if isinstance(self.path, Path) and not self.path.exists():
            raise FileNotFoundError(f"dataset {self.path} does not exist")
        self.problems, self.where = self._read(self.path, self.split)
        if self.eval_path is not None:
            self.eval_problems, self.eval_where = self._read(self.eval_path, self.eval_split or self.split)

    @property
    def name(self) -> str:
        return Path(str(self.path)).stem

    def _read(self, source: str | Path, split: str) -> tuple[tuple[Problem, ...], tuple[str, ...]]:
        rows, where = read_rows(source, split)
        problems, kept, bad = [], [], []
        for row, at in zip(rows, where, strict=True):
            try:
                problems.append(self._problem(row))
                kept.append(at)
            except ValueError as e:
                if self.filter_rows and not isinstance(e, ColumnError):
                    reason = str(e).split(":")[0]
                    self.dropped[reason] = self.dropped.get(reason, 0) + 1
                else:
                    bad.append(f"{at}: {e}")
        if bad:
            raise ValueError(rows_message(bad, "fix or remove them, or set task.filter_rows=true to drop them"))
        if not problems:
            raise ValueError(f"{source} holds no problems")
        return tuple(problems), tuple(kept)

    def _column(self, row: dict[str, Any], name: str) -> Any:
        if name not in row:
            raise ColumnError(f"no column {name!r} (columns: {sorted(row)}): map it with task.fields")
        return row[name]

    def _problem(self, row: object) -> Problem:
        if not isinstance(row, dict):
            raise ValueError("expected a JSON object (a row of columns)")
        f = self.fields
        solution = ""
        if f.messages:
            turns = _conversation(self._column(row, f.messages), f.messages)
            if turns and turns[-1]["role"] == "assistant":
                solution, turns = turns[-1]["content"], turns[:-1]
            messages = tuple(turns)
            users = [t["content"] for t in messages if t["role"] == "user"]
            if not users or not users[-1].strip():
                raise ValueError(f"empty prompt: the conversation in {f.messages!r} has no user turn")
            prompt = users[-1]
        else:
            value = self._column(row, f.prompt)
            if isinstance(value, list):
                messages = tuple(_conversation(value, f.prompt))
                users = [t["content"] for t in messages if t["role"] == "user"]
                prompt = users[-1] if users else ""
            else:
                messages, prompt = (), value
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"empty prompt: {prompt!r} is empty or not a string")
        answer = ""
        if f.answer and (self.needs_answers or f.answer in row):  # warm-up reads GSM8K's worked answers
            value = self._column(row, f.answer)
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                if self.needs_answers:
                    raise ValueError(f"bad answer: {value!r} is not a string or a number")
                value = ""
            answer = str(value)
            if (
                self.needs_answers
                and any(r.fn is exact_answer_reward for r in self.rewards)
                and not _INTEGER.fullmatch(answer.strip())
            ):
                raise ValueError(
                    f"bad answer: {answer!r} is not an integer, which the exact reward compares with the '#<int>' "
                    "a completion ends with: write it as one (1000, not 1,000), or use task.rewards=[math] (or "
                    "gsm8k, or a reward of your own)"
                )
        if f.solution:
            value = row.get(f.solution) or ""
            solution = str(value)
        elif not solution and "####" in answer:
            solution = answer  # GSM8K: the worked solution ends with its answer
        return Problem(prompt=prompt, answer=answer, solution=solution, messages=messages)

    def located(self) -> list[tuple[str, Problem]]:
        """Every problem (training and held-out) with where it is written."""
        return [*zip(self.where, self.problems, strict=True), *zip(self.eval_where, self.eval_problems, strict=True)]

    def drop(self, where: set[str]) -> None:
        """Drop the problems written at `where` (preflight's filtering of over-long prompts)."""
        for attr, at_attr in (("problems", "where"), ("eval_problems", "eval_where")):
            kept = [(p, w) for p, w in zip(getattr(self, attr), getattr(self, at_attr), strict=True) if w not in where]
            setattr(self, attr, tuple(p for p, _ in kept))
            setattr(self, at_attr, tuple(w for _, w in kept))
        if not self.problems:
            raise ValueError(f"{self.path}: every problem was dropped")

    def sample(self, rng: random.Random, split: Split = "train") -> Problem:
        if self.eval_problems:
            pool = list(self.eval_problems if split == "eval" else self.problems)
        else:
            pool = [p for p in self.problems if split_of(p.prompt, self.eval_fraction) == split]
        return rng.choice(pool or list(self.problems))

    def reward(self, problem: Problem, completion: str) -> float:
        return self.score([problem], [completion])[0][0]

    def score(self, problems: list[Problem], completions: list[str]) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted reward of each completion and each term's values (by reward name)."""
        totals, parts = score(self.rewards, [p.prompt for p in problems], completions, [p.answer for p in problems])
        return totals, parts if len(self.rewards) > 1 else {}

    def conversation(self, problem: Problem, tokenizer: Tokenizer) -> list[Message] | None:
        """The chat-template input for `problem` (None: the prompt is used as plain text)."""
        if problem.messages:
            turns = list(problem.messages)
            if self.system_prompt and turns[0]["role"] != "system":
                turns.insert(0, {"role": "system", "content": self.system_prompt})
            return turns
        use = self.chat_template if self.chat_template is not None else tokenizer.chat_template is not None
        if not use:
            return None
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": problem.prompt}]

    def prompt_ids(self, problem: Problem, tokenizer: Tokenizer) -> list[int]:
        turns = self.conversation(problem, tokenizer)
        if turns is None:
            text = f"{self.system_prompt}\n{problem.prompt}" if self.system_prompt else problem.prompt
            return tokenizer.encode(text)
        return tokenizer.render_chat(turns, add_generation_prompt=True)

    def solution_ids(self, problem: Problem, tokenizer: Tokenizer) -> list[int] | None:
        """The reference solution's tokens as the completion of `prompt_ids` (through the chat
        template: the assistant turn as the template writes it, its end-of-turn included), or None
        where the prompt is plain text (the caller appends end-of-sequence)."""
        turns = self.conversation(problem, tokenizer)
        if turns is None:
            return None
        prompt = tokenizer.render_chat(turns, add_generation_prompt=True)
        full = tokenizer.render_chat([*turns, {"role": "assistant", "content": problem.solution}])
        if full[: len(prompt)] != prompt:
            raise ValueError(
                "the chat template renders the conversation with its answer differently from the prompt it "
                "gives for generation, so the assistant turn cannot be separated: warm up without the template "
                "(task.chat_template=false)"
            )
        return full[len(prompt) :]


def _conversation(value: object, column: str) -> list[Message]:
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in value
    ):
        raise ValueError(f"bad conversation: column {column!r} must be a list of {{'role', 'content'}} turns")
    return [{"role": t["role"], "content": t["content"]} for t in value]
