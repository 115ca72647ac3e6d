"""Tokenizers: a built-in character tokenizer for the synthetic tasks, and Hugging Face
`tokenizer.json` files (through the `tokenizers` library) for real checkpoints.

The rollout protocol is token-level, so the tokenizer lives with the trainer alone: it turns
task prompts into ids for `Generate` and completions back into text for the reward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Protocol

BUILTIN = "builtin"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""Files a Hugging Face checkpoint ships its tokenizer in (any of them: the model has its own)."""
_BESIDE_WEIGHTS = (*TOKENIZER_FILES, "generation_config.json")


class Tokenizer(Protocol):
    """What the trainer needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (None: it has none)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
        """The token ids of `messages` through the chat template (transformers' apply_chat_template)."""
        ...


class CharTokenizer:
    """One token per printable ASCII character (plus newline) and three special tokens.

    Ids: 0 <pad>, 1 <bos>, 2 <eos>, then "\\n" and the 95 printable ASCII characters: 99 in
    all. Tiny models for tests and the demo use it, so their embedding tables stay small.
    `encode` prepends <bos>; `decode` drops special tokens.
    """

    PAD, BOS, EOS = 0, 1, 2
    _CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self) -> None:
        self._index = {ch: i + 3 for i, ch in enumerate(self._CHARS)}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self._CHARS)

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    def encode(self, text: str) -> list[int]:
        ids = [self.BOS]
        for pos, ch in enumerate(text):
            try:
                ids.append(self._index[ch])
            except KeyError:
                raise ValueError(
                    f"character {ch!r} at position {pos} is not in the built-in tokenizer "
                    f"(printable ASCII and newline only); use a tokenizer.json for other text"
                ) from None
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self._CHARS[i - 3] for i in ids if 3 <= i < self.vocab_size)

    @property
    def chat_template(self) -> str | None:
        return None

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
        raise ValueError("the built-in character tokenizer has no chat template: use plain prompts")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (fast tokenizer) through the `tokenizers` library.

    Special tokens come from `tokenizer_config.json` / `generation_config.json` beside it
    when present (eos: `eos_token` / `eos_token_id`; pad falls back to eos).
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Fast

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {file}; point --tokenizer at a checkpoint directory")
        self._tok = _Fast.from_file(str(file))
        config = _read_json(file.parent / "tokenizer_config.json")
        eos_token = config.get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        eos = self._tok.token_to_id(eos_token) if isinstance(eos_token, str) else None
        if eos is None:
            gen = _read_json(file.parent / "generation_config.json").get("eos_token_id")
            eos = gen[0] if isinstance(gen, list) else gen
        if eos is None:
            raise ValueError(
                f"cannot find the end-of-sequence token for {file}: set eos_token in tokenizer_config.json"
            )
        self._eos = int(eos)
        bos_token = config.get("bos_token")
        if isinstance(bos_token, dict):
            bos_token = bos_token.get("content")
        self._bos = self._tok.token_to_id(bos_token) if isinstance(bos_token, str) else None
        self._dir = file.parent
        template = config.get("chat_template")
        if template is None and (file.parent / "chat_template.jinja").is_file():
            template = (file.parent / "chat_template.jinja").read_text()
        self._template = template if isinstance(template, str) else None
        self._chat: Any = None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._eos

    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def decode_all(self, ids: list[int]) -> str:
        """`decode` with the special tokens written out (what a chat template put around a prompt)."""
        return str(self._tok.decode(ids, skip_special_tokens=False))

    @property
    def chat_template(self) -> str | None:
        return self._template

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
        """transformers' own `apply_chat_template` over this directory's tokenizer (its template, special
        tokens and semantics exactly, rather than a copy of them), then the text encoded as is: the
        template writes the special tokens (no BOS is added twice)."""
        if self._template is None:
            raise ValueError(
                f"{self._dir} has no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
            )
        if self._chat is None:
            from transformers import PreTrainedTokenizerFast

            self._chat = PreTrainedTokenizerFast.from_pretrained(str(self._dir))
        text = self._chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`"builtin"` for the character tokenizer, else a path to a tokenizer.json or its directory."""
    if str(spec) == BUILTIN:
        return CharTokenizer()
    return HFTokenizer(spec)


class TokenizerMismatchError(ValueError):
    """The tokenizer asked for is not the model's; the message says which to use."""


def model_tokenizer(spec: str | Path | None, model_dir: str | Path, eos_token_id: list[int]) -> Tokenizer:
    """The tokenizer to run the checkpoint in `model_dir` with, `spec` being what the user asked for
    (None: the model's own).

    - A checkpoint that ships a tokenizer (`TOKENIZER_FILES`) is run with it: `spec` None means its
      `tokenizer.json`; `builtin` is refused (it would feed the model character ids it was never
      trained on); another tokenizer.json is refused unless its vocabulary is the model's.
    - A checkpoint that ships none is one specrl built for its character tokenizer (the demo's, the
      tests'), recognised by what its config.json says it needs: no end-of-sequence id, or the built-in
      one's (`CharTokenizer.EOS`). `spec` None means `builtin` there; a model whose config names another
      end-of-sequence id needs `spec` (the path of its tokenizer.json).
    Raises TokenizerMismatchError naming the fix, or what `load_tokenizer` raises for a bad path.
    """
    model_dir = Path(model_dir)
    shipped = [f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    own = model_dir / "tokenizer.json"
    if not shipped:  # built by specrl for the character tokenizer, unless its config says otherwise
        if spec is not None:
            return load_tokenizer(spec)
        if any(t != CharTokenizer.EOS for t in eos_token_id):
            raise TokenizerMismatchError(
                f"the model {model_dir} ships no tokenizer (no tokenizer.json) and its config.json's eos_token_id "
                f"{eos_token_id} is not the built-in character tokenizer's ({CharTokenizer.EOS}), so it was not built "
                "for it: set tokenizer=PATH (the model's tokenizer.json)"
            )
        return CharTokenizer()
    if not own.is_file():  # a tokenizer in a format specrl does not read
        if spec is None:
            raise TokenizerMismatchError(
                f"{model_dir} ships its tokenizer as {shipped} but no tokenizer.json, the format specrl reads: write "
                "one with transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) or set tokenizer=PATH"
            )
        return load_tokenizer(spec)
    if spec is None:
        return HFTokenizer(own)
    if str(spec) == BUILTIN:
        raise TokenizerMismatchError(
            f"the model {model_dir} ships its own tokenizer.json; the built-in character tokenizer would feed it "
            "ids it was never trained on: remove tokenizer (the default is the model's own)"
        )
    chosen = HFTokenizer(spec)
    if chosen.vocab() != HFTokenizer(own).vocab():
        raise TokenizerMismatchError(
            f"tokenizer={spec} has another vocabulary than the model's own {own}: remove tokenizer to use the "
            "model's, or give a checkpoint built for this tokenizer"
        )
    return chosen


def copy_tokenizer_files(source: str | Path, out: str | Path) -> None:
    """Copy the tokenizer (and generation_config.json) that the checkpoint `source` ships into `out`,
    so that a checkpoint written from it (warm-up, draft-init, a run's policy) keeps its tokenizer."""
    source, out = Path(source), Path(out)
    if source.resolve() == out.resolve():
        return
    for name in _BESIDE_WEIGHTS:
        if (source / name).is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, out / name)
