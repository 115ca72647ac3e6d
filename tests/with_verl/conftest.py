"""Fixtures of the verl target (tools/test-verl): a tiny checkpoint with a chat template, real
`specrl serve` processes around it, and a local Ray cluster for verl's actors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.with_trl.serve import ServeProcess
from tests.with_trl.tiny_model import EOS, PAD, UNK, VOCAB, build_tiny_checkpoint

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""verl's agent loop applies the chat template to each prompt: the content, as is."""
NEWLINE = VOCAB - 1


def qwen_like_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The tiny word-level vocabulary with what verl's Qwen chat handling requires of a Qwen
    tokenizer (`QwenContinuousTokenBuilder`): EOS spelled <|im_end|>, and "\n" one token (the
    last word's id; prompts never use it)."""
    from tokenizers import Regex, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(3, NEWLINE)}
    vocab = {"<pad>": PAD, "<|im_end|>": EOS, "<unk>": UNK, **words, "\n": NEWLINE}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Split(Regex(" +"), behavior="removed")
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )
    out.chat_template = CHAT_TEMPLATE
    return out


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-mtp"))
    qwen_like_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def serve(checkpoint: Path) -> Iterator[ServeProcess]:
    """A fresh sidecar per test (weight version 0, k = 2)."""
    process = ServeProcess(checkpoint, speculation_k=2)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def ray_cluster() -> Iterator[None]:
    """A fresh local Ray per test: verl's resource pools keep their placement groups (1 CPU each)
    for the life of the cluster, and two of them fill the 2 CPUs."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    try:
        yield
    finally:
        ray.shutdown()
