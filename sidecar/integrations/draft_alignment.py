"""Keep a sidecar's draft (MTP layers or an EAGLE-3 draft) aligned with a policy that an outside
framework trains.

TRL (like most frameworks) trains only the policy. The sidecar's draft then keeps the weights it
started with while the policy drifts, and acceptance decays (BENCHMARKS.md, "TRL: τ when TRL
never updates the draft": τ 1.8 -> ~1.05 in 20 GRPO steps of the test model). `DraftAligner`
closes the loop on the trainer, without the framework's help: after each policy sync it fits
the draft to the *current* policy on the latest rollouts and pushes it (selector DRAFT).

Objective: the draft at position t predicts x_{t+2} from (h_t, x_{t+1}); it is fitted by forward
KL to the policy's own distribution for x_{t+2} at the rollout temperature (the quantity exact
rejection sampling accepts by: acceptance = 1 - TV(p, q)), on the policy's final-normed hidden
states computed without gradient (the detached-hidden-state objective of
`trainer.draft.objective`). The policy is never changed.

Memory: only the draft layers are held (read from the checkpoint's `mtp.*` tensors); the
embedding and output head are the policy's own modules, shared, not copied.

An EAGLE-3 draft (`DraftAligner(checkpoint, draft=DIR)`, the directory the sidecar serves with
`--draft`) is fitted the same way on its own inputs: the policy's hidden states entering the
tapped layers (Hugging Face's `output_hidden_states`: entry i is layer i's input), its teacher-
forced forward (`Eagle3Draft.forward`), and the policy's distribution restricted to the draft
vocabulary; it is pushed as `eagle3.*` (selector DRAFT), token maps unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from sidecar.model.checkpoint import CONFIG_FILE
from sidecar.model.eagle3 import PUSH_PREFIX, Eagle3Draft
from sidecar.model.eagle3_checkpoint import load_eagle3_draft
from sidecar.model.model import ModelConfig, MTPLayer, MTPStack, RMSNorm
from yarn.rope import RotaryEmbedding

MTP_PREFIX = "mtp."


@dataclass(kw_only=True, slots=True)
class DraftAlignConfig:
    """How often and how hard the draft is refitted."""

    every: int = 1
    """Refit after every `every`-th policy sync (1: every TRL step)."""
    steps: int = 20
    """Adam steps per refit, on the latest rollouts."""
    lr: float = 1e-3
    temperature: float = 1.0
    """Rollout temperature: the distributions the draft must match are softmax(logits / T)."""
    chain_depth: int = 3
    """EAGLE-3: chain steps fitted (its own outputs fed back, as it drafts; use the rollouts' k).
    The MTP draft fits its first layer, as before."""

    def __post_init__(self) -> None:
        for name in ("every", "steps", "chain_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"DraftAlignConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"DraftAlignConfig.lr must be > 0, got {self.lr}")
        if self.temperature <= 0:
            raise ValueError(
                f"DraftAlignConfig.temperature must be > 0 (greedy rollouts: use 1), got {self.temperature}"
            )


def read_draft_tensors(checkpoint: str | Path) -> dict[str, Tensor]:
    """Only the `mtp.*` tensors of a safetensors checkpoint (single file or sharded), by name."""
    path = Path(checkpoint)
    single = path / "model.safetensors"
    if single.is_file():
        files = [single]
    else:
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        files = sorted({path / f for n, f in index.items() if n.startswith(MTP_PREFIX)})
    out: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(MTP_PREFIX):
                    out[name] = st.get_tensor(name)
    if not out:
        raise ValueError(f"{path}: no {MTP_PREFIX}* tensors; the checkpoint has no MTP draft to align")
    return out


class DraftHead(nn.Module):
    """The draft layers (contract names `mtp.layers.{i}.*`) on top of a policy's embedding and
    output head. Forward mirrors `Qwen3WithMTP.mtp_logits` (layer 0)."""

    def __init__(self, config: ModelConfig, embed: nn.Module, output: nn.Module) -> None:
        super().__init__()
        self.mtp = MTPStack(config)
        self._shared = [embed, output]  # not submodules: never trained, never pushed
        self._rotary = RotaryEmbedding(config.rope_config())

    def forward(self, input_ids: Tensor, hidden: Tensor) -> Tensor:  # -> (B, T-1, V)
        """Draft logits; position t predicts x_{t+2}. The shared embedding and head are read
        without gradient, so fitting the draft never leaves gradients on the policy."""
        embed, output = self._shared
        b, t = input_ids.shape
        layer = cast(MTPLayer, self.mtp.layers[0])
        positions = torch.arange(1, t, device=input_ids.device).expand(b, t - 1)
        cos, sin = self._rotary(positions)
        with torch.no_grad():
            embedded = embed(input_ids[:, 1:])
        x = layer.combine(embedded, hidden[:, :-1])
        out = cast(Tensor, layer(x, cos, sin))
        weight = cast(Tensor, output.weight).detach()
        norm = cast(RMSNorm, layer.shared_head.norm)
        return F.linear(norm(out), weight)


class DraftAligner:
    """Refits the draft on rollouts and pushes it. `bind(policy)` first (a Hugging Face causal
    LM: `get_decoder()` gives final-normed hidden states, `get_output_embeddings()` the head)."""

    def __init__(
        self, checkpoint: str | Path, config: DraftAlignConfig | None = None, draft: str | Path | None = None
    ) -> None:
        """`checkpoint`: the policy's (its MTP layers are the draft); `draft`: an EAGLE-3 draft
        directory the sidecars serve instead (`specrl serve --draft`)."""
        self.config = config or DraftAlignConfig()
        self.model_config = ModelConfig.from_hf_dict(json.loads((Path(checkpoint) / CONFIG_FILE).read_text()))
        self.eagle3: Eagle3Draft | None = None
        self._tensors: dict[str, Tensor] = {}
        if draft is not None:
            self.eagle3 = load_eagle3_draft(draft, target=self.model_config)
            self._taps = self.eagle3.config.aux_layers(self.model_config.num_hidden_layers)
        elif self.model_config.num_nextn_predict_layers < 1:
            raise ValueError(
                f"{checkpoint}: num_nextn_predict_layers is 0; there is no draft to align "
                "(an EAGLE-3 draft: DraftAligner(checkpoint, draft=DIR))"
            )
        else:
            self._tensors = read_draft_tensors(checkpoint)
        self.head: DraftHead | None = None
        self._policy: Any = None
        self._syncs = 0
        self.losses: list[list[float]] = []
        """KL per Adam step of each refit."""

    def bind(self, policy: Any) -> None:
        self._policy = policy
        if self.eagle3 is not None:
            self.eagle3 = self.eagle3.to(policy.get_input_embeddings().weight.device)
            return
        head = DraftHead(self.model_config, policy.get_input_embeddings(), policy.get_output_embeddings())
        state = {n: t.to(self.model_config.dtype) for n, t in self._tensors.items()}
        head.load_state_dict(state, strict=True)
        device = policy.get_input_embeddings().weight.device
        self.head = head.to(device)

    def draft_tensors(self) -> list[tuple[str, Tensor]]:
        """What a DRAFT push carries: `mtp.*`, or the EAGLE-3 draft's `eagle3.*`."""
        if self.eagle3 is not None:
            return [(PUSH_PREFIX + n, p.detach()) for n, p in self.eagle3.named_parameters()]
        assert self.head is not None, "bind(policy) first"
        return [(n, p.detach()) for n, p in self.head.named_parameters()]

    def due(self, collapsed: bool = False) -> bool:
        """Count one policy sync; True when this one should refit: every `every`-th sync, and at
        once while the sidecar reports its draft collapsed (GetStats `draft_collapsed`: the served
        draft no longer predicts the policy, and every rollout until the next scheduled refit
        would run at tau ~1)."""
        self._syncs += 1
        return collapsed or self._syncs % self.config.every == 0

    def fit(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """Fit the draft to the bound policy on `sequences` (prompt + completion token ids)."""
        if self.head is None and (self.eagle3 is None or self._policy is None):
            raise RuntimeError("DraftAligner.bind(policy) must be called before fit")
        seqs = [list(s) for s in sequences if len(s) >= 3]
        if not seqs:
            return []
        device = self._policy.get_input_embeddings().weight.device
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        temperature = self.config.temperature
        was_training = self._policy.training
        self._policy.eval()
        try:
            with torch.no_grad():
                out = self._policy.get_decoder()(
                    input_ids=ids, attention_mask=mask, output_hidden_states=self.eagle3 is not None
                )
                hidden = out.last_hidden_state
                target = self._policy.get_output_embeddings()(hidden)[:, 1:].float() / temperature
                if self.eagle3 is not None:  # its inputs: the tapped layers' inputs; its outputs: its vocabulary
                    hidden = torch.cat([out.hidden_states[i] for i in self._taps], dim=-1)
                    if self.eagle3.config.draft_vocab_size < self.eagle3.config.vocab_size:
                        target = target.index_select(-1, self.eagle3.draft_to_target())
                log_p = F.log_softmax(target, dim=-1)  # (N, T-1, V): the policy's x_{t+2} distribution
        finally:
            self._policy.train(was_training)
        draft: nn.Module = self.eagle3 if self.eagle3 is not None else cast(DraftHead, self.head).mtp
        embed = self._policy.get_input_embeddings().weight.detach()
        params = list(draft.parameters())
        frozen = [p for p in params if not p.requires_grad]  # a loaded EAGLE-3 draft is served frozen
        for p in frozen:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=self.config.lr)
        losses = []
        try:
            for _ in range(self.config.steps):
                if self.eagle3 is not None:  # chain step j, entry t predicts x_{t+j+2}: log_p[:, t + j]
                    outs = self.eagle3.chain(ids, hidden, lambda x: F.embedding(x, embed), self.config.chain_depth)
                    steps = [(j, self.eagle3.draft_logits(out)) for j, out in enumerate(outs)]
                else:
                    steps = [(0, cast(DraftHead, self.head)(ids, hidden))]
                loss = log_p.new_zeros(())
                for j, logits in steps:
                    n = logits.shape[1]
                    log_q = F.log_softmax(logits.float() / temperature, dim=-1)
                    lp = log_p[:, j : j + n]
                    kl = (lp.exp() * (lp - log_q)).sum(-1)
                    ok = mask[:, j + 1 : j + 1 + n].float()  # the step's inputs are real tokens
                    loss = loss + (kl * ok).sum() / ok.sum().clamp_min(1.0) / len(steps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        finally:
            for p in frozen:
                p.requires_grad_(False)
                p.grad = None
        self.losses.append(losses)
        return losses
