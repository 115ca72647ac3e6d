"""A user's model and data: datasets in the formats `datasets` reads, chat-templated prompts, the
rewards RL users use, and supervised warm-up on their conversations.

Oracles: transformers' own `apply_chat_template` (the ids a prompt must become), math-verify (what
the math reward must say), the same rows written in every format (the problems they must give),
and transformers' forward of the checkpoint (the assistant-turn NLL warm-up must report).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.rl.config import TaskConfig
from trainer.rl.rewards import (
    Reward,
    format_reward,
    gsm8k_reward,
    load_reward_fn,
    math_reward,
    rewards_from_specs,
    score,
)
from trainer.rl.tasks import DatasetFields, DatasetTask, prompt_ids, split_of
from trainer.tokenizer import HFTokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gsm8k_rows(n: int = 40) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        a, b = i % 7 + 2, i // 7 + 3
        rows.append(
            {
                "question": f"Tom has {a} boxes of {b} apples. How many apples?",
                "answer": f"He has {a} * {b} = {a * b} apples.\n#### {a * b}",
            }
        )
    return rows


def bpe_model(path: Path, *, chat_template: str | None = CHATML, layers: int = 1) -> Path:
    """A tiny Qwen3 checkpoint written by transformers' save_pretrained, with a byte-level BPE
    tokenizer.json trained here and a ChatML chat template in tokenizer_config.json."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [r["question"] + " " + r["answer"] for r in gsm8k_rows()] + ["system user assistant \\boxed{12}"]
    tok.train_from_iterator(corpus * 4, trainer)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    hf = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    transformers.Qwen3ForCausalLM(hf).save_pretrained(path)
    return path


def _write(rows: list[dict[str, Any]], path: Path) -> Path:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        ds.to_parquet(str(path))
    elif path.suffix == ".json":
        ds.to_json(str(path), lines=False)
    elif path.suffix == ".csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.save_to_disk(str(path))
    return path


# ---- rewards ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (r"so the answer is \boxed{22}", "22", 1.0),
        ("22", "22", 1.0),
        ("The answer is 22", "22", 1.0),
        ("22.0", "22", 1.0),
        ("1,000", "1000", 1.0),
        ("1,000", "22", 0.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        ("Nine, I think", "22", 0.0),
        ("He has 3 * 4 = 12 apples.\n#### 12", "He has 3 * 4 = 12 apples.\n#### 12", 1.0),
    ],
)
def test_the_math_reward_is_what_math_verify_says(completion: str, gold: str, expected: float) -> None:
    from math_verify import parse, verify

    reference = gold.rsplit("####", 1)[-1].strip()
    assert math_reward("q", completion, gold) == float(verify(parse(reference), parse(completion))) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("4 * 3 = 12\n#### 12", "He has 12.\n#### 12", 1.0),
        ("#### 1,000", "#### 1000", 1.0),
        ("#### $72.0", "72", 1.0),
        ("#### 7 then #### 8", "8", 1.0),
        ("the answer is 12", "12", 0.0),
        ("#### 13", "#### 12", 0.0),
    ],
)
def test_the_gsm8k_reward_reads_the_last_four_hashes(completion: str, gold: str, expected: float) -> None:
    assert gsm8k_reward("q", completion, gold) == expected


def test_format_weights_batched_and_file_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert [format_reward("", c, "") for c in (r"\boxed{3}", "#### 3", "so #3", "3")] == [1.0, 1.0, 1.0, 0.0]
    # a user file named like one of specrl's packages, loaded by path: no PYTHONPATH, no shadowing
    (tmp_path / "trainer.py").write_text(
        "def batch(prompts, completions, answers):\n    return [float(len(c) > 3) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    rewards = rewards_from_specs(["gsm8k", "trainer.py:batch"], [1.0, 0.5])
    assert [r.batched for r in rewards] == [False, True]
    totals, parts = score(rewards, ["p", "p"], ["#### 4", "no"], ["4", "4"])
    assert parts == {"gsm8k": [1.0, 0.0], "trainer.py:batch": [1.0, 0.0]} and totals == [1.5, 0.0]
    import trainer.cli.main  # noqa: F401  (the package still imports: the user's trainer.py did not shadow it)

    with pytest.raises(ValueError, match="does not exist"):
        load_reward_fn("nowhere.py:fn")
    with pytest.raises(ValueError, match="reward_weights has 1 weights for 2"):
        rewards_from_specs(["math", "format"], [1.0])


# ---- datasets -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["data.jsonl", "data.parquet", "data.json", "data.csv", "saved"])
def test_every_format_gives_the_same_problems_through_the_field_mapping(tmp_path: Path, name: str) -> None:
    rows = gsm8k_rows(12)
    task = TaskConfig(
        kind="dataset",
        path=str(_write(rows, tmp_path / name)),
        fields=DatasetFields(prompt="question"),
        rewards=("gsm8k",),
    ).build()
    assert isinstance(task, DatasetTask)
    assert [p.prompt for p in task.problems] == [r["question"] for r in rows]
    assert [p.answer for p in task.problems] == [r["answer"] for r in rows]
    assert [p.solution for p in task.problems] == [r["answer"] for r in rows]  # GSM8K's worked solutions
    assert task.reward(task.problems[3], f"#### {rows[3]['answer'].rsplit(' ', 1)[1]}") == 1.0
    assert task.where[0] == (f"{tmp_path / name}:1" if name.endswith(".jsonl") else f"{tmp_path / name} row 1")


def test_an_eval_file_and_filtered_rows(tmp_path: Path) -> None:
    rows = gsm8k_rows(10)
    bad = [{"question": "", "answer": "#### 1"}, {"question": "What?", "answer": None}]
    train = _write(rows + bad, tmp_path / "train.parquet")
    held = _write(gsm8k_rows(14)[10:], tmp_path / "eval.jsonl")
    fields = DatasetFields(prompt="question")
    with pytest.raises(ValueError, match=r"train.parquet row 11: empty prompt.*train.parquet row 12: bad answer"):
        DatasetTask(path=train, fields=fields, rewards=rewards_from_specs(["math"], []))
    task = DatasetTask(
        path=train, fields=fields, eval_path=held, filter_rows=True, rewards=rewards_from_specs(["math"], [])
    )
    assert len(task.problems) == 10 and task.dropped == {"empty prompt": 1, "bad answer": 1}
    rng = random.Random(0)
    assert {task.sample(rng, "eval").prompt for _ in range(50)} == {r["question"] for r in gsm8k_rows(14)[10:]}
    assert {task.sample(rng, "train").prompt for _ in range(200)} == {r["question"] for r in rows}


# ---- prompts through the model's chat template -------------------------------------------------------
def test_prompts_are_the_ids_transformers_apply_chat_template_gives(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = bpe_model(tmp_path / "model")
    tok, reference = HFTokenizer(model), AutoTokenizer.from_pretrained(model)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many apples?"}]
    rows = [
        {"messages": conversation, "answer": "12"},
        {"messages": [{"role": "user", "content": "Hi"}], "answer": "1"},
    ]
    convo = DatasetTask(path=_write(rows, tmp_path / "chat.jsonl"), fields=DatasetFields(messages="messages"))
    plain = DatasetTask(
        path=_write([{"prompt": "How many apples?", "answer": "12"}], tmp_path / "plain.jsonl"),
        system_prompt="Be brief.",
    )

    def expected(messages: list[dict[str, str]]) -> list[int]:
        out = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    assert prompt_ids(convo, tok, convo.problems[0]) == expected(conversation)
    assert prompt_ids(convo, tok, convo.problems[1]) == expected(rows[1]["messages"])
    assert prompt_ids(plain, tok, plain.problems[0]) == expected(conversation)  # system prompt + user turn
    assert convo.problems[0].prompt == "How many apples?"  # what rewards and the held-out split see
    raw = DatasetTask(path=plain.path, chat_template=False)
    assert prompt_ids(raw, tok, raw.problems[0]) == tok.encode("How many apples?")
    no_template = HFTokenizer(bpe_model(tmp_path / "bare", chat_template=None))
    assert prompt_ids(plain, no_template, plain.problems[0]) == no_template.encode("Be brief.\nHow many apples?")


# ---- RL and warm-up on a user's model and data ------------------------------------------------------
@pytest.mark.slow
def test_rl_on_a_parquet_gsm8k_file_with_the_math_reward_and_a_chat_template(tmp_path: Path) -> None:
    from trainer.cli.commands import resolve_config
    from trainer.rl.loop import train

    model = bpe_model(tmp_path / "model")
    data = _write(gsm8k_rows(), tmp_path / "gsm8k.parquet")
    cfg = resolve_config(
        None,
        [
            f"model={model}",
            "task.kind=dataset",
            f"task.path={data}",
            "task.fields.prompt=question",
            "task.rewards=[math, format]",
            "task.reward_weights=[1.0, 0.1]",
            "task.system_prompt=Answer with #### N.",
            "rollout.speculation_k=0",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "rollout.max_new_tokens=8",
            "sidecars.local=1",
            "steps=5",
            "eval_every=0",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    history = train(cfg, progress=False)
    assert len(history) == 5
    for m in history:
        assert 0.0 <= m["reward/math_mean"] <= 1.0 and 0.0 <= m["reward/format_mean"] <= 1.0
        assert math.isclose(m["reward/train_mean"], m["reward/math_mean"] + 0.1 * m["reward/format_mean"], abs_tol=1e-6)
        assert m["mismatch/logprob_abs_max"] < 1e-4  # the sidecar's log-probs are the trainer's


@pytest.mark.slow
def test_warm_up_on_conversations_trains_the_assistant_turn_alone(tmp_path: Path) -> None:
    import transformers

    from trainer.rl.warmup import WarmupConfig, solution_ids, supervised_warmup

    model = bpe_model(tmp_path / "model")
    rows = [
        {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
        for r in gsm8k_rows()
    ]
    task = DatasetTask(
        path=_write(rows, tmp_path / "sft.jsonl"), fields=DatasetFields(messages="messages"), needs_answers=False
    )
    tok = HFTokenizer(model)
    problem = task.problems[0]
    # the completion trained on is exactly the assistant turn as the template writes it
    completion = solution_ids(task, tok, problem)
    assert tok.decode_all(completion) == rows[0]["messages"][1]["content"] + "<|im_end|>\n"

    def assistant_nll(checkpoint: Path, problems: list[Any]) -> float:
        """Closed form: transformers' forward, -log p of the assistant tokens only, averaged."""
        hf = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        total, count = 0.0, 0
        for p in problems:
            prompt, target = prompt_ids(task, tok, p), solution_ids(task, tok, p)
            ids = torch.tensor([prompt + target])
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
            picked = logp[len(prompt) - 1 :].gather(1, torch.tensor(target)[:, None])
            total, count = total - float(picked.sum()), count + len(target)
        return total / count

    held_out = [p for p in task.problems if split_of(p.prompt, task.eval_fraction) == "eval"]
    assert held_out  # never drawn by warm-up, which trains on the training split
    before = assistant_nll(model, held_out)
    cfg = WarmupConfig(steps=30, batch_size=16, lr=3e-3, seed=0)
    rng = random.Random(cfg.seed)
    first_batch = [task.sample(rng, "train") for _ in range(cfg.batch_size)]  # what warm-up's step 0 draws
    nll = supervised_warmup(model, tmp_path / "warm", task, tok, cfg)
    assert math.isclose(nll[0], assistant_nll(model, first_batch), rel_tol=1e-4)
    assert assistant_nll(tmp_path / "warm", held_out) < 0.8 * before
    assert (tmp_path / "warm" / "tokenizer.json").is_file()  # the warmed model keeps its tokenizer


def test_a_reward_term_carries_its_own_name_into_the_metrics() -> None:
    from trainer.rl.step_metrics import reward_metric_name

    assert [reward_metric_name(n) for n in ("math", "rewards.py:score", "pkg.mod:fn")] == [
        "math",
        "rewards_py_score",
        "pkg_mod_fn",
    ]
    assert Reward(name="x", fn=format_reward).weight == 1.0


def test_the_first_prompt_is_shown_as_the_model_sees_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.rl.preflight import announce_task

    model = bpe_model(tmp_path / "model")
    rows = [{"question": "", "answer": "#### 1"}, *gsm8k_rows(3)]
    task = DatasetTask(
        path=_write(rows, tmp_path / "d.jsonl"),
        fields=DatasetFields(prompt="question"),
        rewards=rewards_from_specs(["gsm8k"], []),
        filter_rows=True,
    )
    announce_task(task, HFTokenizer(model))
    shown = capsys.readouterr().err
    assert "dropped 1 row(s): {'empty prompt': 1}" in shown
    assert "<|im_start|>user\n" in shown and shown.rstrip().endswith("<|im_start|>assistant")


@pytest.mark.slow
def test_warmup_on_a_users_parquet_file_through_its_field_mapping(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from trainer.cli.main import main

    model = bpe_model(tmp_path / "model")
    data = _write(gsm8k_rows(), tmp_path / "gsm8k.parquet")
    args = ["warmup", "--model", str(model), "--out", str(tmp_path / "warm"), "--dataset", str(data)]
    result = CliRunner().invoke(main, [*args, "--steps", "2", "--batch-size", "4"])
    assert result.exit_code != 0 and "no column 'prompt'" in result.output and "task.fields" in result.output
    result = CliRunner().invoke(main, [*args, "--fields", "prompt=question", "--steps", "2", "--batch-size", "4"])
    assert result.exit_code == 0, result.output  # GSM8K's worked answers are the reference solutions
    assert (tmp_path / "warm" / "tokenizer.json").is_file()
    result = CliRunner().invoke(main, [*args, "--fields", "question=prompt"])
    assert result.exit_code != 0 and "keys are ['prompt', 'answer', 'solution', 'messages']" in result.output
