"""Routing replay: the trainer's forward takes the sampler's experts, and its log-probs become the sampler's.

Oracle: the sidecar's own model (`sidecar.model.moe.sequence_routes` over its forward gives each
token's experts in every sparse layer, as a sample's routes carry them; its log-softmax is the
sampler's log-prob). The trainer's router is then perturbed where the routing is near a tie (two
experts' router rows a hair apart, their order flipped in the trainer: the weights move by ~1e-5 of a logit,
the choices of every token that sits on the boundary between them flip), so live routing picks
other experts than the sampler and replay has something to fix. Also: the RL router defaults, a
frozen router, Muon on each expert on its own (closed forms), and the rollout side's two functions
against a fake fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon import HybridOptimizerConfig
from muon.newton_schulz import orthogonalize
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.model import build_model
from sidecar.model.moe import sequence_routes
from sidecar.types import Routes
from tests.sidecar.model.test_moe_models import hf_qwen3_moe
from trainer.policy import gpt, moe
from trainer.policy.moe import RouterConfig, batch_routes, routes_asked
from trainer.policy.policy import Policy, TrainBatch

pytestmark = pytest.mark.usefixtures("single_torch_thread")

B, S = 3, 32


@dataclass
class FakeSample:
    token_ids: list[int]
    routes: Routes | None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3moe")
    hf_qwen3_moe(path, norm_topk_prob=True, mlp_only_layers=[1])
    return path


def near_tie(tensors: dict[str, torch.Tensor], sign: float) -> dict[str, torch.Tensor]:
    """Router row 1 = row 0 + sign · 3e-6 · v in every sparse layer: experts 0 and 1 near-tied."""
    out = dict(tensors)
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        w = tensors[name].clone()
        w[1] = w[0] + sign * 3e-6 * torch.randn(w.shape[1], generator=gen)
        out[name] = w
    return out


def sampler(config: Any, tensors: dict[str, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sidecar model's (log-probs (B, S-1), routes (B, S, sparse layers, k)) of `ids`."""
    engine = build_model(config)
    engine.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        out: list[torch.Tensor] = []
        routes = sequence_routes(engine.model, lambda: out.append(engine(ids)), B, S)
    logp = out[0].float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return logp, routes.permute(1, 2, 0, 3)


def packed(routes: torch.Tensor) -> torch.Tensor:
    """The sampler's routes as samples carry them (P + T - 1 rows: the last token is never an
    input), through the trainer's packing (`batch_routes`)."""
    samples = [
        FakeSample(list(range(S)), Routes(expert_ids=r[: S - 1].to(torch.uint8), first_position=0)) for r in routes
    ]
    return batch_routes(samples, [S] * B, S)


def ids_() -> torch.Tensor:
    return torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(7))


def test_at_equal_weights_replay_reproduces_the_samplers_routes_on_every_token_and_layer(checkpoint: Path) -> None:
    config, tensors = load_checkpoint(checkpoint)  # decisive routers: no token near a tie
    ids = ids_()
    want, routes = sampler(config, tensors, ids)
    policy = Policy(config, Policy.Config(), tensors)
    live = policy.logprobs(ids)
    assert torch.equal(
        moe.last_routes(policy.replay_slots, B, live=True).sort(-1).values, routes.sort(-1).values.long()
    )
    replayed = policy.logprobs(ids, packed(routes))
    chosen = moe.last_routes(policy.replay_slots, B)
    assert torch.equal(chosen[:, : S - 1], routes[:, : S - 1].long())  # every given token, every layer
    torch.testing.assert_close(replayed, live, rtol=0, atol=0)
    torch.testing.assert_close(replayed, want, rtol=0, atol=1e-4)
    metrics = policy.backward(batch(ids, packed(routes), want))
    assert metrics["routing_agreement"] == 1.0


def batch(ids: torch.Tensor, routes: torch.Tensor | None, rollout: torch.Tensor) -> TrainBatch:
    return TrainBatch(
        tokens=ids,
        mask=torch.ones(B, S - 1),
        advantages=torch.tensor([1.0, -1.0, 0.5]),
        rollout_logprobs=rollout,
        routes=routes,
    )


def test_when_the_trainers_router_disagrees_replay_brings_the_gap_back_under_1e_4(checkpoint: Path) -> None:
    config, tensors = load_checkpoint(checkpoint)
    ids = ids_()
    want, routes = sampler(config, near_tie(tensors, +1.0), ids)
    policy = Policy(config, Policy.Config(), near_tie(tensors, -1.0))  # the near-tie's order flipped
    without = policy.backward(batch(ids, None, want))
    live_gap = (policy.logprobs(ids) - want).abs().max()
    with_replay = policy.backward(batch(ids, packed(routes), want))
    replay_gap = (policy.logprobs(ids, packed(routes)) - want).abs().max()
    print(f"agreement {with_replay['routing_agreement']:.4f} gap live {live_gap:.2e} replayed {replay_gap:.2e}")
    assert with_replay["routing_agreement"] < 1.0  # the live router does disagree somewhere
    assert live_gap > 1e-3 and without["mismatch_logprob_abs_max"] > 1e-3  # and it shows without replay
    assert replay_gap <= 1e-4 and with_replay["mismatch_logprob_abs_max"] <= 1e-4
    assert "routing_agreement" not in without  # no routes given, nothing compared


def test_a_dense_policy_with_replay_off_is_built_and_differentiated_as_before() -> None:
    """The dense path is today's: the same layer spec and rotary as before MoE existed, no replay
    slots, bit-identical logits and gradients against a GPTModel built the old way."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    import yarn.megatron
    from sidecar.model.model import ModelConfig
    from trainer.policy import platform
    from yarn import RopeConfig

    mc = ModelConfig.tiny(
        num_nextn_predict_layers=0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    )
    policy = Policy(mc, Policy.Config())
    assert policy.replay_slots == []
    hf = mc.to_hf_dict()
    config = gpt.transformer_config(hf)
    old = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf["max_position_embeddings"],
        share_embeddings_and_output_weights=False,
        **yarn.megatron.configure(config, RopeConfig.from_hf(hf)),
    ).to(platform.device())
    old.load_state_dict(policy.model.state_dict(), strict=False)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (policy.model, old):
        model.zero_grad(set_to_none=True)
        logits, _ = gpt.forward(model, ids)
        gpt.token_logprobs(logits[:, :-1], ids[:, 1:]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_the_rl_router_defaults_are_megatrons_switches_off(checkpoint: Path) -> None:
    config, _ = load_checkpoint(checkpoint)
    tc = gpt.transformer_config(config.to_hf_dict())
    assert tc.moe_aux_loss_coeff == 0.0 and tc.moe_router_load_balancing_type == "none"
    assert tc.moe_router_dtype == "fp32" and tc.moe_router_pre_softmax is False  # norm_topk_prob true
    with pytest.raises(ValueError, match="expert_bias_update_rate"):
        RouterConfig(expert_bias_update_rate=1e-3)
    aux = gpt.transformer_config(config.to_hf_dict(), router=RouterConfig(aux_loss_coeff=0.01))
    assert aux.moe_router_load_balancing_type == "aux_loss" and aux.moe_aux_loss_coeff == 0.01


def sgd_like() -> HybridOptimizerConfig:
    return HybridOptimizerConfig(lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False)


def test_a_frozen_router_stays_as_served_while_the_experts_train(checkpoint: Path) -> None:
    config, tensors = load_checkpoint(checkpoint)
    policy = Policy(config, Policy.Config(router=RouterConfig(frozen=True), optimizer=sgd_like()), tensors)
    ids = ids_()
    policy.train_step(TrainBatch(tokens=ids, mask=torch.ones(B, S - 1), advantages=torch.tensor([1.0, -1.0, 0.5])))
    after = dict(policy.export_named_tensors())
    routers = [n for n in tensors if n.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(after[n], tensors[n]) for n in routers)
    assert not torch.equal(
        after["model.layers.0.mlp.experts.0.gate_proj.weight"], tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]
    )


def test_muon_orthogonalises_each_expert_on_its_own_and_the_router_goes_to_adamw(checkpoint: Path) -> None:
    """Closed forms of one step from zero state (momentum 0, no decay): a Muon matrix moves by
    -lr · scale · NS(G) of its own gradient alone, so two experts given gradients A and 100 A move
    alike (Newton–Schulz is scale-invariant; orthogonalising them stacked would not give that);
    the router's first AdamW step is -lr · sign(G)."""
    config, tensors = load_checkpoint(checkpoint)
    policy = Policy(config, Policy.Config(optimizer=sgd_like()), tensors)
    params = dict(policy.model.named_parameters())
    e0, e1 = (f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in (0, 1))
    router = "decoder.layers.0.mlp.router.weight"
    assert e0 in policy.optimizer.muon_names and router in policy.optimizer.adamw_names
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(params[e0].shape, generator=gen)
    before = {n: p.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    params[e0].grad, params[e1].grad = a.clone(), 100 * a.clone()
    params[router].grad = torch.randn(params[router].shape, generator=gen)
    policy.optimizer.step()
    d0, d1 = params[e0].detach() - before[e0], params[e1].detach() - before[e1]
    torch.testing.assert_close(d0, d1, rtol=0, atol=1e-6)
    ns = orthogonalize(a, sgd_like().newton_schulz)
    cos = float((d0 * ns).sum() / (d0.norm() * ns.norm()))
    assert cos < -0.9999  # -lr · scale · NS(A): the update is NS of its own gradient
    torch.testing.assert_close(
        params[router].detach() - before[router], -0.1 * params[router].grad.sign(), rtol=0, atol=1e-5
    )


def test_the_rollout_asks_for_routes_only_with_replay_and_packs_them_per_sample() -> None:
    assert routes_asked("off") == "off" and routes_asked("rollout") == "sequence"
    ids = torch.randint(0, 8, (4, 2, 2), dtype=torch.uint8)
    got = batch_routes(
        [
            FakeSample([1] * 3, Routes(expert_ids=ids, first_position=0)),
            FakeSample([1] * 2, Routes(expert_ids=ids[:2], first_position=1)),
        ],
        [5, 4],
        6,
    )
    assert got.shape == (2, 6, 2, 2) and got.dtype == torch.long
    assert torch.equal(got[0, :4], ids.long()) and (got[0, 4:] == -1).all()
    assert (got[1, 0] == -1).all() and torch.equal(got[1, 1:3], ids[:2].long()) and (got[1, 3:] == -1).all()
    with pytest.raises(ValueError, match="carries no routes"):
        batch_routes([FakeSample([1], None)], [3], 3)
    with pytest.raises(ValueError, match="do not fit"):
        batch_routes([FakeSample([1], Routes(expert_ids=ids, first_position=0))], [3], 3)


def test_the_load_balancing_loss_stays_available_and_is_off_by_default(checkpoint: Path) -> None:
    """aux_loss_coeff > 0 moves the routers' gradients (Megatron's aux loss attached to the routing
    weights); at the default 0 they are the policy loss's alone, equal to a run that never built one."""
    config, tensors = load_checkpoint(checkpoint)
    ids = ids_()
    grads = {}
    for coeff in (0.0, 0.0, 0.5):
        policy = Policy(config, Policy.Config(router=RouterConfig(aux_loss_coeff=coeff)), tensors)
        policy.backward(TrainBatch(tokens=ids, mask=torch.ones(B, S - 1), advantages=torch.tensor([1.0, -1.0, 0.5])))
        grads.setdefault(coeff, []).append(
            {n: p.grad.clone() for n, p in policy.model.named_parameters() if moe.is_router_name(n)}
        )
    first, again = grads[0.0]
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all((grads[0.5][0][n] - first[n]).abs().max() > 1e-3 for n in first)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 6),
    layers=st.integers(1, 3),
    experts=st.integers(2, 6),
    data=st.data(),
)
def test_position_replay_takes_the_given_experts_in_megatrons_token_order(
    batch: int, seq: int, layers: int, experts: int, data: st.DataObject
) -> None:
    """Against an oracle written per token: Megatron flattens (S, B) sequence-major; a token with a
    route gets those experts and the live scores at them, one without keeps the live top-k; the
    agreement counts the given tokens whose live choice is the same set."""
    k = data.draw(st.integers(1, experts))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    routes = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(batch * seq * layers)])
    routes = routes.view(batch, seq, layers, k)
    live_only = torch.rand(batch, seq, generator=gen) < 0.3
    routes[live_only] = -1
    slots = [moe.PositionReplay() for _ in range(layers)]
    scores = torch.rand(layers, seq * batch, experts, generator=gen)

    def topk(
        x: torch.Tensor, k: int, num_groups: Any = None, group_topk: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(x, k, dim=1)

    with moe.replaying(slots, routes):
        out = [slot.get_replay_topk(scores[i], k, None, None, topk) for i, slot in enumerate(slots)]
    agreed, compared = moe.take_agreement(slots)
    want_agreed = 0
    for i in range(layers):
        probs, ids = out[i]
        for s in range(seq):
            for b in range(batch):
                row, live = s * batch + b, torch.topk(scores[i, s * batch + b], k).indices
                given_ids = routes[b, s, i]
                expect = live if bool(live_only[b, s]) else given_ids
                assert torch.equal(ids[row], expect)
                assert torch.equal(probs[row], scores[i, row][expect])
                if not bool(live_only[b, s]):
                    want_agreed += int(set(live.tolist()) == set(given_ids.tolist()))
    assert compared == layers * int((~live_only).sum()) and agreed == want_agreed
    assert all(slot.target is None for slot in slots)  # replay ends with the block
