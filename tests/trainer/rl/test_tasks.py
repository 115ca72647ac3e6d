"""Synthetic tasks, rewards, user datasets and tokenizers, checked against Python's own
arithmetic and the `tokenizers` library."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from trainer.rl.rewards import Reward, exact_answer_reward, extract_answer, load_reward_fn
from trainer.rl.tasks import ArithmeticTask, DatasetTask, Problem, distinct_problems, split_of
from trainer.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer


@pytest.mark.parametrize("regime", ["zero", "think"])
@pytest.mark.parametrize("digits", [1, 2, 4])
def test_reference_solutions_are_correct_arithmetic(regime: str, digits: int) -> None:
    task = ArithmeticTask(regime=regime, digits=digits)  # type: ignore[arg-type]
    rng = random.Random(0)
    for _ in range(200):
        p = task.sample(rng)
        expression = p.prompt.removesuffix("=?\n")
        assert int(p.answer) == eval(expression)  # the oracle: Python evaluates the prompt
        assert task.reward(p, p.solution) == 1.0
        for line in re.split(r"[,\n]", p.solution.rpartition("#")[0]):
            if line:
                lhs, rhs = line.split("=")
                assert eval(lhs) == int(rhs), f"wrong scratchpad step {line!r} in {p.solution!r}"


def test_think_solutions_are_longer_than_zero() -> None:
    rng = random.Random(1)
    zero = [len(ArithmeticTask(regime="zero").sample(rng).solution) for _ in range(100)]
    think = [len(ArithmeticTask(regime="think").sample(rng).solution) for _ in range(100)]
    assert sum(think) > 1.5 * sum(zero)


def test_train_and_eval_splits_are_disjoint_and_deterministic() -> None:
    task = ArithmeticTask(digits=2, eval_fraction=0.2)
    train = {task.sample(random.Random(i), "train").prompt for i in range(300)}
    held = {task.sample(random.Random(i), "eval").prompt for i in range(300)}
    assert train and held and not (train & held)
    assert task.sample(random.Random(5)) == task.sample(random.Random(5))


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("1+2+0=3#3", 1.0), ("#3\n", 1.0), ("# 03", 1.0), ("#4", 0.0), ("3", 0.0), ("#3 extra", 0.0), ("#-3", 0.0)],
)
def test_exact_answer_reward(completion: str, reward: float) -> None:
    assert exact_answer_reward("1+2=?\n", completion, "3") == reward


def test_negative_answers_parse() -> None:
    assert extract_answer("5-9=-4\n#-4") == "-4"


def test_bad_task_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="regime"):
        ArithmeticTask(regime="hard")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)


def test_jsonl_task_with_user_reward(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(50)) + "\n")
    fn, batched = load_reward_fn("tests.trainer.rl.test_tasks:_contains_answer")
    task = DatasetTask(path=data, rewards=(Reward(name="contains", fn=fn, batched=batched),))
    p = task.sample(random.Random(0))
    assert isinstance(p, Problem) and task.reward(p, f"it is {p.answer}") == 1.0
    assert task.reward(p, "no idea") == 0.0


def _contains_answer(prompt: str, completion: str, answer: str) -> float:
    return float(answer in completion)


def _two_args(prompt: str, completion: str) -> float:
    return 0.0


def test_bad_datasets_and_reward_functions_fail_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no column 'answer'"):
        DatasetTask(path=bad)
    with pytest.raises(FileNotFoundError):
        DatasetTask(path=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="package.module:function"):
        load_reward_fn("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("tests.trainer.rl.test_tasks:nope")
    with pytest.raises(ValueError, match=r"must accept \(prompt, completion, answer\)"):
        load_reward_fn("tests.trainer.rl.test_tasks:_two_args")


def test_char_tokenizer_round_trips_task_text() -> None:
    tok = CharTokenizer()
    rng = random.Random(0)
    for regime in ("zero", "think"):
        p = ArithmeticTask(regime=regime).sample(rng)  # type: ignore[arg-type]
        text = p.prompt + p.solution
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and all(3 <= i < tok.vocab_size for i in ids[1:])
        assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text
    with pytest.raises(ValueError, match="not in the built-in tokenizer"):
        tok.encode("café")


def test_hf_tokenizer_json_through_tokenizers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    fast = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.Whitespace()
    fast.add_special_tokens(["</s>"])
    fast.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3] and tok.eos_id == 1 and tok.vocab_size == 4
    assert tok.decode([2, 3, 1]) == "hello world"
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "nowhere")


def test_distinct_problems_never_repeats_a_prompt_and_stops_at_the_split_size(tmp_path: Path) -> None:
    task = ArithmeticTask(regime="zero", digits=2)
    problems = distinct_problems(task, random.Random(3), "eval", 300)
    assert len(problems) == 300 and len({p.prompt for p in problems}) == 300
    assert all(split_of(p.prompt, task.eval_fraction) == "eval" for p in problems)
    assert problems == distinct_problems(task, random.Random(3), "eval", 300)  # fixed by the seed
    # 1-digit sums: 100 prompts in all, so the held-out split has far fewer than 500
    small = ArithmeticTask(regime="zero", digits=1, eval_fraction=0.3)
    everything = {f"{a}+{b}=?\n" for a in range(10) for b in range(10)}
    held_out = {p for p in everything if split_of(p, 0.3) == "eval"}
    got = distinct_problems(small, random.Random(0), "eval", 500)
    assert {p.prompt for p in got} == held_out and len(got) == len(held_out)
    with pytest.raises(ValueError, match="size"):
        distinct_problems(task, random.Random(0), "eval", 0)
