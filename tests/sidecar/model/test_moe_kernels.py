"""The fused mixture-of-experts kernels (`moe_kernels`) against the torch reference (issue 58).

On a CPU the kernels run in Triton's interpreter (the root conftest sets `TRITON_INTERPRET=1`
before Triton is imported), in float32; on a GPU (`-m gpu`) compiled, in bfloat16. Oracles:

- `align_by_expert`: its definition written out (each expert's slots contiguous, in token order,
  padded to the block with the no-slot id, each block's expert, every slot once), over
  hypothesis-drawn routings (experts left unused, one token, k = E);
- `fused_experts`: `moe.experts_by_expert`, the gather-by-expert reference, over drawn shapes;
- a whole generation through the fused path (an MoE target whose MTP layer routes too, its experts
  joined, fixed-shape rounds): the plain full forward's greedy output, with the kernel really run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sidecar.model.test_moe_models import PROMPTS, _greedy_by_forward, engine_greedy, moe_target

pytest.importorskip("triton")

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model import moe_kernels
from sidecar.model.decode_kernels import DecodeKernels
from sidecar.model.moe import Expert, SparseMoE, experts_by_expert

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def routing(t: int, k: int, e: int, used: int, seed: int) -> torch.Tensor:  # (t, k) distinct ids < used
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(t)]).to(DEVICE)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 40), e=st.integers(1, 12), data=st.data())
def test_align_by_expert_is_its_definition(t: int, e: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, e))
    used = data.draw(st.integers(k, e))
    ids = routing(t, k, e, used, data.draw(st.integers(0, 1000)))
    bm = moe_kernels.BLOCK_M
    slots, block_expert = moe_kernels.align_by_expert(ids, e)
    slots, block_expert = slots.cpu().tolist(), block_expert.cpu().tolist()
    n = t * k
    assert len(slots) % bm == 0 and len(slots) >= n + 0 and len(block_expert) == len(slots) // bm
    flat = ids.reshape(-1).cpu().tolist()
    expected_slots: list[int] = []
    expected_blocks: list[int] = []
    for expert in range(e):
        mine = [s for s in range(n) if flat[s] == expert]  # token order
        if not mine:
            continue
        pad = -len(mine) % bm
        expected_slots += mine + [n] * pad
        expected_blocks += [expert] * ((len(mine) + pad) // bm)
    assert slots[: len(expected_slots)] == expected_slots
    assert all(s == n for s in slots[len(expected_slots) :])
    assert block_expert[: len(expected_blocks)] == expected_blocks
    assert all(b == -1 for b in block_expert[len(expected_blocks) :])


def experts_of(e: int, hidden: int, inter: int, seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    experts = torch.nn.ModuleList(Expert(hidden, inter) for _ in range(e))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    return experts.to(DEVICE)


def stacked(experts: torch.nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.stack([torch.cat([x.gate_proj.weight, x.up_proj.weight]) for x in experts])
    return w13.contiguous(), torch.stack([x.down_proj.weight for x in experts]).contiguous()


@settings(max_examples=12, deadline=None)
@given(
    t=st.integers(1, 33),
    e=st.integers(2, 10),
    hidden=st.sampled_from([16, 48, 80]),
    inter=st.sampled_from([8, 24, 72]),
    data=st.data(),
)
def test_fused_experts_equal_the_reference(t: int, e: int, hidden: int, inter: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, min(e, 4)))
    seed = data.draw(st.integers(0, 1000))
    experts = experts_of(e, hidden, inter, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(DEVICE)
    ids = routing(t, k, e, data.draw(st.integers(k, e)), seed)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    with torch.no_grad():
        expected = experts_by_expert(x, weights, ids, experts)
        got = moe_kernels.fused_experts(x, weights, ids, *stacked(experts))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.fixture
def kernels_everywhere(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Engines with fixed-shape rounds run the fused kernels on CPUs too (in the interpreter); yields
    the number of fused expert calls."""
    calls = [0]
    real = moe_kernels.fused_experts

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(DecodeKernels, "for_device", staticmethod(lambda device: DecodeKernels()))
    monkeypatch.setattr(moe_kernels, "fused_experts", counted)
    yield calls


@pytest.mark.skipif(CUDA, reason="CPU models through the kernels: Triton's interpreter, CPUs only")
@pytest.mark.slow
def test_greedy_through_the_fused_experts_equals_the_plain_forward(kernels_everywhere: list[int]) -> None:
    model = moe_target(num_nextn_predict_layers=1)
    model.join_projections()  # what TorchEngine does on CUDA: the experts stacked, the parameters views
    sparse = [layer.mlp for layer in [*model.model.layers, *model.mtp.layers] if isinstance(layer.mlp, SparseMoE)]
    assert sparse and all(m.joined_experts() is not None for m in sparse)
    engine = TorchEngine(model, speculation_k=2, compile="on", kv_block_size=4)
    assert isinstance(engine.kernels, DecodeKernels)
    out = engine_greedy(engine, PROMPTS[:3], 2, new=6)
    with torch.no_grad():
        assert out == [_greedy_by_forward(model, p, 6) for p in PROMPTS[:3]]
    assert kernels_everywhere[0] > 0  # the rounds ran the fused path


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fused_experts_in_bfloat16_on_a_gpu() -> None:
    experts = experts_of(8, 256, 128, 0).to(torch.bfloat16)
    x = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    ids = routing(64, 2, 8, 8, 1)
    weights = torch.rand(64, 2, device=DEVICE)
    with torch.no_grad():
        expected = experts_by_expert(x, weights, ids, experts)  # float32 weights (GLM-4.5's) in both
        got = moe_kernels.fused_experts(x, weights, ids, *stacked(experts))
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=2e-2)
