"""A tiny Qwen3 checkpoint with an MTP draft and a word-level tokenizer, built here (no hub).

The same directory loads as a specrl sidecar (`specrl serve --model DIR`) and as a Hugging
Face model (`AutoModelForCausalLM.from_pretrained(DIR)`, which ignores the `mtp.*` tensors) with
its tokenizer (`AutoTokenizer.from_pretrained(DIR)`), which is what a TRL user has.

The draft is made to agree with the target so that speculation pays (τ > 1.5 at k = 2): the
trunk's attention and MLP outputs are scaled down (the next token then depends mostly on the
current one) and the MTP layer starts as the "bigram" draft
(`trainer.draft.fit.init_draft_from_embedding`). Training moves the trunk away from that,
which is what the τ-decay measurement watches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from trainer.draft.fit import init_draft_from_embedding

VOCAB = 64
PAD, EOS, UNK = 0, 1, 2
WORDS = [f"w{i}" for i in range(3, VOCAB)]


def tiny_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK} | {w: i for i, w in enumerate(WORDS, start=3)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_checkpoint(path: Path, *, seed: int = 0, mixing: float = 0.1, hidden: int = 64) -> Path:
    """Write config.json, model.safetensors and the tokenizer to `path`; returns `path`."""
    config = ModelConfig.tiny(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        eos_token_id=[EOS],
    )
    model = build_model(config, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.") and name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(mixing)
    init_draft_from_embedding(model)
    save_checkpoint(path, config, model_state_dict(model))
    tiny_tokenizer().save_pretrained(path)
    return path
