"""The benchmarks' shared pieces: models, clocks, paired statistics, and the section registry.

- **Models**: `BENCH_CONFIG` and `ensure_bench_checkpoint` (the embedded-engine bench model: a
  synthetic target whose MTP draft is initialised from its bigram statistics), `shape_config` and
  `random_model` (a preset's shape with random weights, for the GPU benchmarks).
- **Clocks**: `bench_clock` (CPU seconds on a CPU, synchronised wall seconds on CUDA),
  `median_time`, `cpu_seconds` (other processes' CPU seconds, from /proc), `device_problem`.
- **The registry**: `SECTIONS`, each BENCHMARKS.md section (or docs page) and the module that
  measures it; `specrl bench SECTION` and `python -m tools.bench SECTION` dispatch through it
  (tools/bench/__init__.py).

## Paired statistics


A benchmark here runs every configuration once per repeat, next to each other, so the ratio of two
configurations within a repeat cancels the machine's drift between repeats. Two things still
mislead when one figure per run is quoted, and this module answers both:

- **Noise.** On the 2-core CPU box one repeat's ratio scatters by 5-10% (sampled output lengths,
  other tenants), so the median of 5-20 repeats moves by several percent between runs of the same
  code. `median_ratio` gives the median with a percentile-bootstrap interval over the repeats.
- **Winner's curse.** "Auto against the best static k" picks the best k from the same repeats it
  then compares on. Among several static k within noise of each other, the one picked is the one
  whose repeats ran luckiest, so the comparison is biased against the challenger even when it is
  as fast as the best k (`tests/tools/test_bench_stats.py` shows the bias on synthetic repeats).
  `against_best_held_out` picks the best configuration for each repeat from the *other* repeats
  (leave-one-out), which is what a user who tuned k on earlier runs gets.

"""

from __future__ import annotations

import inspect
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.model.moe import MoEConfig, Router
from trainer.draft.fit import DraftFitConfig, fit_draft, init_draft_from_embedding
from trainer.planning.shapes import PRESETS


@dataclass(frozen=True)
class Ratio:
    """A median of per-repeat ratios with its bootstrap interval (`level`, two-sided)."""

    median: float
    low: float
    high: float
    level: float
    repeats: int

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap_median(values: Sequence[float], *, level: float = 0.9, resamples: int = 2000, seed: int = 0) -> Ratio:
    """The median of `values` and a percentile-bootstrap interval for it (resampling the repeats)."""
    if not values:
        raise ValueError("no repeats: run the benchmark with --repeats >= 1")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[round((1 - tail) * (resamples - 1))]
    return Ratio(statistics.median(values), low, high, level, n)


def median_ratio(
    reference: Sequence[float],
    challenger: Sequence[float],
    *,
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> Ratio:
    """Median over repeats of reference[i] / challenger[i] (seconds: > 1 means the challenger is
    faster), with its bootstrap interval."""
    _same_length(reference, challenger)
    ratios = [r / c for r, c in zip(reference, challenger, strict=True)]
    return bootstrap_median(ratios, level=level, resamples=resamples, seed=seed)


def best_in_sample(times: Mapping[Hashable, Sequence[float]], candidates: Sequence[Hashable]) -> Hashable:
    """The candidate with the lowest median time over all repeats."""
    return min(candidates, key=lambda c: statistics.median(times[c]))


def held_out_choices(times: Mapping[Hashable, Sequence[float]], candidates: Sequence[Hashable]) -> list[Hashable]:
    """Per repeat i, the candidate with the lowest median time over the repeats other than i."""
    if not candidates:
        raise ValueError("no candidate configurations to choose the best from")
    n = len(times[candidates[0]])
    for c in candidates:
        _same_length(times[candidates[0]], times[c])
    if n < 2:
        raise ValueError("a held-out choice needs at least 2 repeats: run with --repeats >= 2")
    return [
        min(candidates, key=lambda c: statistics.median([t for j, t in enumerate(times[c]) if j != i]))
        for i in range(n)
    ]


def against_best_held_out(
    times: Mapping[Hashable, Sequence[float]],
    candidates: Sequence[Hashable],
    challenger: Hashable,
    *,
    reference: Callable[[Hashable, int], float] | None = None,
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> Ratio:
    """The challenger against the best candidate chosen without the repeat it is compared on.

    Per repeat i: best_i = the candidate fastest over the other repeats; the ratio is
    reference(best_i, i) / times[challenger][i], where reference defaults to times[best_i][i]
    (a caller can take, e.g., the faster of plain and best_i). Median over repeats, bootstrap
    interval over the per-repeat ratios (approximate: a repeat's ratio depends on the others
    through the choice, weakly once the choice is stable).
    """
    choices = held_out_choices(times, candidates)
    _same_length(times[candidates[0]], times[challenger])
    ref = reference or (lambda c, i: times[c][i])
    ratios = [ref(c, i) / times[challenger][i] for i, c in enumerate(choices)]
    return bootstrap_median(ratios, level=level, resamples=resamples, seed=seed)


def _same_length(a: Sequence[float], b: Sequence[float]) -> None:
    if len(a) != len(b):
        raise ValueError(f"paired repeats differ in number: {len(a)} against {len(b)}")


# ---- models ----

BENCH_CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    rope_theta=10_000.0,
    max_position_embeddings=1024,
    num_nextn_predict_layers=1,
)


RESIDUAL_SCALE = 0.08


def ensure_bench_checkpoint(path: Path, fit_steps: int = 0) -> None:
    """Build the bench checkpoint at `path` (seed 0) unless one is already there."""
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        build_bench_checkpoint(path, fit_steps)


def build_bench_checkpoint(path: Path, fit_steps: int) -> None:
    """The synthetic target and its MTP draft (bigram init, optionally self-distilled; see the module docstring)."""
    model = build_model(BENCH_CONFIG, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(math.sqrt(BENCH_CONFIG.hidden_size))  # unit-RMS embeddings
        for name, p in model.named_parameters():  # the trunk's residual branches (attention, MLP outputs)
            if name.startswith("model.layers.") and name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                p.mul_(RESIDUAL_SCALE)
        assert model.lm_head is not None
        model.lm_head.weight.mul_(4.0)
    init_draft_from_embedding(model)
    if fit_steps <= 0:
        save_checkpoint(path, BENCH_CONFIG, model_state_dict(model))
        return
    start = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 10 == 0:
            print(f"  fit step {step}/{fit_steps} loss {loss:.3f} ({time.perf_counter() - start:.0f}s)", flush=True)

    print(f"building the benchmark model into {path} (draft fit: {fit_steps} steps)", flush=True)
    fit_draft(model, DraftFitConfig(num_sequences=32, new_tokens=64, steps=fit_steps, lr=1e-3), progress)
    save_checkpoint(path, BENCH_CONFIG, model_state_dict(model))


def device_problem(device: str) -> str | None:
    """Why the benchmarks cannot run on `device` here, with what to pass instead; None if they can."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        return f"--device {device!r} is not a torch device: pass cpu, cuda or cuda:N"
    if kind not in ("cpu", "cuda"):
        return f"--device {device!r}: the benchmarks run on cpu or cuda only"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"--device {device!r}: torch {torch.__version__} sees no CUDA device here; pass --device cpu"
    return None


def bench_clock(device: torch.device | str) -> tuple[Callable[[], float], str]:
    """The clock a benchmark on `device` reads, and its name. CPU: process CPU seconds (robust to
    other tenants of a shared box). CUDA: wall seconds, the device synchronised first, so a reading
    includes the kernels launched before it (a CPU-time reading would count only the launches)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.process_time, "CPU"

    def wall() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return wall, "GPU wall"


def median_time(fn, repeats: int) -> float:
    """Median process CPU seconds of fn() (CPU time: robust to other tenants of a shared box)."""
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


TINY: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)  # fmt: skip


def shape_config(name: str) -> ModelConfig:
    """The engine's config at a preset's shape: bf16, one MTP layer, no stop tokens; a preset with
    experts (qwen3-30b-a3b, qwen3-235b-a22b) is a Qwen3-MoE (norm_topk_prob true, as released)."""
    base: dict[str, Any] = TINY if name == "tiny" else PRESETS[name]
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings")  # fmt: skip
    moe: MoEConfig | None = None
    extra: dict[str, Any] = {}
    if base.get("num_experts"):
        moe = MoEConfig(num_experts=base["num_experts"], num_experts_per_tok=base["num_experts_per_tok"],
                        moe_intermediate_size=base["moe_intermediate_size"], norm_topk_prob=True)  # fmt: skip
    return ModelConfig(
        **{k: base[k] for k in keys},
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        num_nextn_predict_layers=1,
        **(extra if moe is None else {"architectures": ["Qwen3MoeForCausalLM"], "moe": moe}),
    )


def random_model(cfg: ModelConfig, device: torch.device, seed: int = 0) -> Qwen3WithMTP:
    """Random weights created on `device` in the model's dtype (normal(0, 0.02); norms 1)."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)
    try:
        with torch.device(device):
            model = Qwen3WithMTP(cfg)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    for m in model.modules():
        if isinstance(m, Router):
            m.float()  # routers are float32 in every dtype (`checkpoint.ROUTER_SUFFIXES`)
    return model.eval().requires_grad_(False)


# ---- clocks ----


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes so far (/proc/PID/stat, clock-tick resolution)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


# ---- the section registry ----


@dataclass(frozen=True)
class Section:
    """One `specrl bench NAME`: the module whose `main(argv)` runs it, and where its figures are:
    BENCHMARKS.md headings (without the `## `), or a docs page (a path such as `docs/moe.md`)."""

    name: str
    module: str
    where: tuple[str, ...]
    summary: str

    @property
    def path(self) -> Path:
        return Path(__file__).resolve().parent / f"{self.module}.py"


PLANNING = "Planning: `specrl plan`"
SGLANG = "SGLang: adapter costs, and the engine on CPU"
DRAFT_VOCAB = "Draft vocabulary: MTP head over the most frequent tokens"
SECTIONS: tuple[Section, ...] = (
    Section(
        "rl", "rl", ("RL loop: the demo workload",), "k sweep of the demo's generations, static k against automatic"
    ),
    Section(
        "adaptive",
        "adaptive",
        ("Adaptive speculation (automatic k)",),
        "automatic k on the engine grid; subcommands: controller, sim, settle",
    ),
    Section(
        "engine",
        "engine",
        ("Embedded engine: speculative vs plain decoding", "Engine step, CPU"),
        "speculative against plain decoding on the bench model; subcommand: step (against a checkout)",
    ),
    Section("prefill", "prefill", ("Admission of a GRPO group, CPU",), "admitting a group: one shared prefill"),
    Section("kv", "kv", ("Paged KV cache, CPU",), "the paged KV cache against the static one"),
    Section(
        "gpu",
        "gpu",
        ("The engine on a GPU", DRAFT_VOCAB),
        "round times at a preset's shape on a GPU; subcommand: profile (kernels a round)",
    ),
    Section("moe", "moe", ("Mixture of experts, CPU",), "speculation on an MoE against a dense model"),
    Section("moe-trainer", "moe_trainer", ("docs/moe.md",), "the trainer's update on an MoE against a dense model"),
    Section("muon", "muon_step", ("Muon optimizer step",), "the Muon optimizer's step against AdamW"),
    Section("trainer", "trainer_step", ("Trainer step",), "the trainer's update step"),
    Section("cost-table", "cost_table", (PLANNING,), "measure the cost table `specrl plan` reads"),
    Section("validate-plan", "validate_plan", (PLANNING,), "the planner's predictions against measured runs"),
    Section("plan-study", "plan_study", (PLANNING,), "the planner fed the reference study's inputs"),
    Section(
        "data-parallel", "data_parallel", ("Trainer: data parallel",), "the trainer's step over data-parallel ranks"
    ),
    Section("sidecar", "sidecar_generate", ("Sidecar: generate throughput",), "a sidecar's generate and push"),
    Section(
        "control-plane",
        "control_plane",
        ("Sidecar control plane under open streams",),
        "control calls under open Generate streams",
    ),
    Section("transports", "transports", ("Weight transports: grpc, shm, collective",), "weight pushes per transport"),
    Section("weight-change", "weight_change", ("Sparse delta pushes",), "how much an RL step changes the weights"),
    Section(
        "session-memory",
        "session_memory",
        ("Weight update session: trainer-side memory",),
        "the trainer's memory during a weight update session",
    ),
    Section("fleet-split", "fleet_split", ("Fleet: one Generate per prompt",), "a fleet's Generate split per prompt"),
    Section("verify", "verify", ("Losslessness certificate: `specrl verify`",), "the losslessness certificate's power"),
    Section("trl-tau", "trl_tau", ("TRL: τ when TRL never updates the draft",), "τ under TRL without draft updates"),
    Section(
        "draft-kinds",
        "draft_kinds",
        ("Draft kinds: EAGLE-3 against MTP on the demo workload", DRAFT_VOCAB),
        "EAGLE-3 against MTP drafts, and draft vocabularies, on the demo workload",
    ),
    Section("sglang-adapter", "sglang_adapter", (SGLANG,), "what the SGLang adapter adds"),
    Section("sglang-serve", "sglang_serve", (SGLANG,), "`specrl serve --engine sglang` on CPU"),
    Section(
        "learning",
        "learning",
        ("Learning: held-out reward of the demo's RL phase", "Learning with and without speculation"),
        "held-out reward of the demo's RL phase, with and without speculation",
    ),
    Section("async", "async_rl", ("Asynchronous RL: policy lag 0 and 1",), "policy lag 0 against 1"),
    Section("soak", "soak", ("Soak",), "a local fleet under mixed traffic (tools/soak runs it)"),
    Section(
        "collapse-calibration", "collapse_calibration", ("docs/engine.md",), "the draft-collapse rule's false alarms"
    ),
    Section("graft-starts", "graft_starts", ("docs/checkpoints.md",), "MTP graft starting points against each other"),
    Section(
        "fit-draft",
        "fit_draft",
        ("README.md",),
        "fit a draft head to a checkpoint's own outputs (a tool, not a benchmark)",
    ),
)
BY_NAME = {s.name: s for s in SECTIONS}


def call_main(module: str, argv: list[str], prog: str) -> int:
    """Run `tools/bench/MODULE.py`'s `main` on `argv` with `prog` as its program name, whichever of
    the tools' shapes it has: a click command, an argparse `main(argv)`, or a `main()` that reads
    sys.argv. A missing module is a clear error naming the file."""
    import importlib

    import click

    try:
        mod = importlib.import_module(f"tools.bench.{module}")
    except ModuleNotFoundError as e:
        if e.name != f"tools.bench.{module}":
            raise
        raise SystemExit(
            f"{prog}: tools/bench/{module}.py is missing from this checkout (the registry in "
            "tools/bench/common.py names it): move the script there with git mv, or drop its entry"
        ) from None
    main = getattr(mod, "main", None)
    if main is None:
        raise SystemExit(f"{prog}: tools/bench/{module}.py has no `main`")
    saved = sys.argv
    sys.argv = [prog, *argv]  # argparse's usage line names `prog`
    try:
        if isinstance(main, click.Command):
            return int(main.main(args=list(argv), prog_name=prog, standalone_mode=False) or 0)
        if inspect.signature(main).parameters:
            return int(main(list(argv)) or 0)
        return int(main() or 0)
    finally:
        sys.argv = saved


def subcommand(
    argv: list[str] | None, subcommands: Mapping[str, str | Callable[[list[str]], int]], prog: str
) -> int | None:
    """For a section that merged several scripts: if argv starts with one of `subcommands` (name ->
    a module whose main runs it, or a `main(argv)` of the section's own), run it on the rest and
    return its status; else None (the section's own options follow)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in subcommands:
        run = subcommands[argv[0]]
        if callable(run):
            return int(run(list(argv[1:])) or 0)
        return call_main(run, argv[1:], f"{prog} {argv[0]}")
    return None
