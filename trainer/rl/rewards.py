"""Verifiable rewards: the ones RL users use, user rewards from a module or a file, and weighted sums.

Built in, by name (`task.rewards`):

- ``exact``: 1.0 when the completion ends with ``#<integer>`` equal to the answer (the built-in
  arithmetic task's format).
- ``gsm8k``: the number after the completion's last ``####`` (commas and ``$`` ignored) equals the
  answer's number (GSM8K's convention: a reference answer "… #### 72" is read as 72).
- ``math``: the completion's final answer is mathematically equivalent to the answer (``\\boxed{}``,
  LaTeX, plain numbers, fractions, sets ...), decided by Hugging Face's `math-verify`, the verifier
  TRL's and open-r1's accuracy rewards use; a reference answer with ``####`` is read as above.
- ``format``: 1.0 when the completion gives a final answer in a recognised format (``\\boxed{...}``,
  ``#### N`` or a trailing ``#N``), else 0.0.

A user reward is ``"package.module:function"`` (importable) or ``"path/to/rewards.py:function"``
(loaded from that file, no PYTHONPATH needed, under a module name of its own so it never shadows
a package). It takes ``(prompt, completion, answer) -> float``, or, batched, ``(prompts,
completions, answers) -> list[float]`` (recognised by its first parameter's name, ``prompts``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.errors import SpecrlError

RewardFn = Callable[[str, str, str], float]
BatchedRewardFn = Callable[[list[str], list[str], list[str]], Sequence[float]]

_EXACT = re.compile(r"#\s*(-?\d+)\s*$")
_GSM8K = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_FORMAT = re.compile(r"\\boxed\{.+\}|####\s*\S|#\s*-?\d+\s*$", re.DOTALL)


class RewardFunctionError(SpecrlError, TypeError):
    """A reward function that raised or returned something other than a finite number."""


def extract_answer(completion: str) -> str | None:
    """The integer after the last '#' at the end of the completion, or None."""
    match = _EXACT.search(completion.strip())
    return match.group(1) if match else None


def exact_answer_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion ends with '#<answer>' (integers compared by value), else 0.0."""
    got = extract_answer(completion)
    return 1.0 if got is not None and int(got) == int(answer) else 0.0


def reference_answer(answer: str) -> str:
    """The answer a reference holds: what follows its last '####' (GSM8K's worked solutions), else all of it."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def gsm8k_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the number after the completion's last '####' equals the reference answer's number."""
    found = _GSM8K.findall(completion)
    got, want = (_number(found[-1]) if found else None), _number(reference_answer(answer))
    return 1.0 if got is not None and want is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-9) else 0.0


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer equivalent to the reference answer."""
    from math_verify import parse, verify

    # No signal-based timeouts: they only work in the main thread, and rewards may be computed in
    # asynchronous RL's producer thread.
    gold = parse(reference_answer(answer), parsing_timeout=None)
    target = parse(completion, parsing_timeout=None)
    return 1.0 if gold and target and verify(gold, target, timeout_seconds=None) else 0.0


def format_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion states a final answer as \\boxed{...}, '#### N' or a trailing '#N'."""
    return 1.0 if _FORMAT.search(completion.strip()) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact": exact_answer_reward,
    "gsm8k": gsm8k_reward,
    "math": math_reward,
    "format": format_reward,
}


def _import_from_file(path: Path) -> Any:
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    name = f"specrl_user_rewards_{path.stem}_{digest}"  # never shadows an installed package
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module


def import_named(spec: str, what: str) -> Any:
    """What "package.module:name" or "path/to/file.py:name" names (user code: a reward function, an
    environment class); ValueError saying what is missing, `what` naming it."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: name it as 'package.module:name' or 'path/to/file.py:name'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"cannot load {what} {spec!r}: {path} does not exist")
            module = _import_from_file(path)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise ValueError(f"cannot import {what} {spec!r}: {e}") from e


def load_reward_fn(spec: str) -> tuple[Callable[..., Any], bool]:
    """The reward function `spec` names and whether it is batched: a built-in name, an importable
    "package.module:function", or "path/to/file.py:function". ValueError naming the problem."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec], False
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(
            f"reward {spec!r} is not one of {sorted(BUILTIN_REWARDS)}, 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    fn = import_named(spec, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    try:
        signature = inspect.signature(fn)
        signature.bind("prompt", "completion", "answer")
    except TypeError as e:
        raise ValueError(f"reward function {spec!r} must accept (prompt, completion, answer): {e}") from e
    params = list(signature.parameters)
    return fn, bool(params) and params[0] == "prompts"


@dataclass(frozen=True, slots=True)
class Reward:
    """One term of a task's reward."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False


def rewards_from_specs(specs: Sequence[str], weights: Sequence[float]) -> tuple[Reward, ...]:
    """The terms `task.rewards` / `task.reward_weights` name (weights default to 1 each)."""
    if weights and len(weights) != len(specs):
        raise ValueError(f"task.reward_weights has {len(weights)} weights for {len(specs)} task.rewards")
    out = []
    for i, spec in enumerate(specs):
        fn, batched = load_reward_fn(spec)
        out.append(Reward(name=spec, fn=fn, weight=float(weights[i]) if weights else 1.0, batched=batched))
    return tuple(out)


def _checked(name: str, value: object, prompt: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardFunctionError(
            f"reward {name!r} returned {value!r} for prompt {prompt[:40]!r}; return a float (a finite one)"
        )
    return float(value)


def score(
    rewards: Sequence[Reward], prompts: list[str], completions: list[str], answers: list[str]
) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum of every term for each completion, and each term's own values by name."""
    parts: dict[str, list[float]] = {}
    for r in rewards:
        try:
            if r.batched:
                values = list(r.fn(prompts, completions, answers))
                if len(values) != len(completions):
                    raise RewardFunctionError(
                        f"batched reward {r.name!r} returned {len(values)} values for {len(completions)} completions"
                    )
            else:
                values = [r.fn(p, c, a) for p, c, a in zip(prompts, completions, answers, strict=True)]
        except RewardFunctionError:
            raise
        except Exception as e:  # user code: whatever it raises is reported with its input
            raise RewardFunctionError(
                f"reward function {r.name!r} raised {type(e).__name__}: {e} (prompt {prompts[0][:40]!r}, "
                f"completion {completions[0][:40]!r})"
            ) from e
        parts[r.name] = [_checked(r.name, v, p) for v, p in zip(values, prompts, strict=True)]
    totals = [sum(r.weight * parts[r.name][i] for r in rewards) for i in range(len(completions))]
    return totals, parts
