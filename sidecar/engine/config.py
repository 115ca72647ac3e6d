"""The engine's settings as one typed config: the only place each of them has a default and a check.

`EngineConfig` is what an engine is built from (`create_engine`), nested in `specrl serve`'s
`ServeConfig` as its `engine` section, which the trainer's `sidecars.serve` section nests in turn:
a setting written in a run config, a serve config, `--set` or a `specrl serve` option (the options
are generated from these fields, `sidecar.server.cli`) reaches the engine through this record
alone. torchtitan's shape: a `@dataclass(kw_only=True, slots=True)`, a docstring under every
field, checks in `__post_init__` that name the field and the fix.

It imports nothing heavy (no torch): the CLI builds its options from it before an engine exists.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar, Literal

MAX_SPECULATION_K = 63
"""Largest k a round can draw keyed uniforms for (`counter_rng.MAX_INDEX` - 1)."""

MIN_READ = 256
"""Smallest KV read width of a fixed-shape forward (slots), and so the largest KV block."""

COMPILE_MODES = ("auto", "on", "off")

ENGINE_KINDS = ("torch", "sglang")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """One engine: its kind, its speculation, its batch and its KV cache."""

    kind: Literal["torch", "sglang"] = "torch"
    """"torch": the embedded PyTorch engine; "sglang": SGLang (GPU nodes, the sglang extra).
    Option --engine."""
    device: str = "cpu"
    """torch device: cpu, cuda, cuda:1 ..."""
    speculation_k: int = 3
    """Default draft length (0: plain decoding); with `speculation_auto`, the largest k the engine
    may choose. Without a draft (no MTP layers, no EAGLE-3 draft) the engine serves k = 0."""
    speculation_auto: bool = False
    """Automatic k: the engine chooses k in 0..speculation_k for every step from its measured
    costs and acceptance (lossless; at temperature > 0 not bit-reproducible from the seed:
    requests that pin k are)."""
    max_speculation_k: int = 8
    """Largest k a request or SetSpeculation may ask for (the torch engine sizes its scratch for it;
    SGLang fixes k at launch and ignores it)."""
    max_batch_size: int = 64
    """Most sequences decoded together in one engine step (rows of the torch engine's KV block
    table; the memory they take is the blocks their tokens fill)."""
    max_context: int | None = None
    """Tokens (prompt + max_new_tokens) one sequence may hold (torch engine; None: the model's
    max_position_embeddings). Longer requests, and requests whose blocks the whole KV pool could
    not hold, are refused with RESOURCE_EXHAUSTED."""
    kv_cache_gib: float | None = None
    """Memory of the torch engine's paged KV pool, allocated once (None: 90% of the free memory on
    CUDA, capped at what max_batch_size full rows need; on CPU what they need). Rows hold only the
    blocks their tokens fill, a prompt's samples share its full blocks; when the pool runs out
    mid-generation the latest admitted rows are preempted and resume later, unchanged."""
    kv_block_size: int = 16
    """Tokens a KV block holds (torch engine; a power of two, at most 256): the pool's unit of
    allocation and sharing."""
    prefix_cache: bool = True
    """Torch engine: keep the full KV blocks of finished and preempted sequences, within one
    weight version, for later requests that start with the same tokens (a multi-turn
    conversation's next turn): their prefill computes only the rest. The target's and the draft's
    KV together; idle cached blocks are free for admission and evicted least recently used; a
    push drops them all. Greedy tokens are those of a full prefill, log-probs within float
    rounding (docs/engine.md, "Prefix cache")."""
    compile: Literal["auto", "on", "off"] = "auto"
    """How the torch engine runs a decode round's forwards: "on" at fixed shapes captured as CUDA
    graphs (on a CPU run eagerly; fused Triton kernels on CUDA where Triton is installed), "off"
    eagerly at the batch's own shapes (the reference path), "auto" on for CUDA devices and off on
    CPUs (where fixed shapes only add work)."""
    draft: Path | None = None
    """An EAGLE-3 draft directory (SGLang/vLLM layout, `sidecar.model.eagle3_checkpoint`) served
    beside a model without MTP layers (torch engine; SGLang's EAGLE3 with kind sglang); None: the
    model's own MTP layers, if any."""
    draft_vocab_size: int = 0
    """Torch engine, MTP draft: score only this many token ids in the draft's output head, the most
    frequent of the engine's own prompts and samples, re-chosen at every weight push and every 4096
    tokens (FR-Spec; 0: the full vocabulary). Exact for any subset (q is 0 outside it); it saves
    the head's weight reads per draft token at some acceptance, and at temperature > 0 a sample
    then depends on what the engine generated before (see docs/engine.md)."""

    OPTION_NAMES: ClassVar[dict[str, str]] = {"kind": "engine"}
    """`specrl serve` options named otherwise than their field (`--engine` sets `engine.kind`)."""

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engine.kind must be one of {', '.join(ENGINE_KINDS)}, got {self.kind!r}")
        if not self.device:
            raise ValueError("engine.device is empty: name a torch device, e.g. cpu or cuda:0")
        if not 0 <= self.max_speculation_k <= MAX_SPECULATION_K:
            raise ValueError(
                f"engine.max_speculation_k must be in [0, {MAX_SPECULATION_K}], got {self.max_speculation_k}"
            )
        if not 0 <= self.speculation_k <= self.max_speculation_k:
            raise ValueError(
                f"engine.speculation_k must be in [0, max_speculation_k={self.max_speculation_k}], got "
                f"{self.speculation_k}: lower it, or raise max_speculation_k"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"engine.max_context must be >= 2 or unset (the model's context), got {self.max_context}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"engine.kv_cache_gib must be > 0 or unset, got {self.kv_cache_gib}")
        if not 1 <= self.kv_block_size <= MIN_READ or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(
                f"engine.kv_block_size must be a power of two in [1, {MIN_READ}], got {self.kv_block_size}"
            )
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"engine.compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.draft_vocab_size < 0:
            raise ValueError(
                f"engine.draft_vocab_size must be >= 0 (0: the full vocabulary), got {self.draft_vocab_size}"
            )
        if self.draft_vocab_size and (self.kind != "torch" or self.draft is not None):
            raise ValueError(
                "engine.draft_vocab_size reduces the torch engine's MTP head; SGLang and EAGLE-3 drafts "
                "(engine.draft) bring their own draft vocabulary: leave it at 0"
            )
        if self.kind != "torch":
            self._check_torch_only()

    def _check_torch_only(self) -> None:
        """The settings only the torch engine reads stay at their defaults on another kind."""
        changed = {f.name for f in fields(self) if getattr(self, f.name) != f.default}
        if "prefix_cache" in changed:
            raise ValueError("engine.prefix_cache is the torch engine's; SGLang keeps its own radix cache")
        if "compile" in changed:
            raise ValueError("engine.compile chooses how the torch engine runs its forwards; SGLang runs its own")
        if changed & {"max_context", "kv_cache_gib", "kv_block_size"}:
            raise ValueError(
                "engine.max_context, kv_cache_gib and kv_block_size size the torch engine's KV cache; "
                "SGLang sizes its own"
            )

    @property
    def kv_cache_bytes(self) -> int | None:
        """`kv_cache_gib` in bytes (None: the engine sizes the pool)."""
        return None if self.kv_cache_gib is None else int(self.kv_cache_gib * 2**30)
