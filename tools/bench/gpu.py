#!/usr/bin/env python
"""The embedded engine on a GPU, in one command that fits a 10-minute device run; its output is a
cost table `specrl plan --costs FILE` reads.

    specrl bench gpu --device cuda --out /tmp/bench-gpu             # Qwen3-0.6B and -8B shapes
    specrl bench gpu --device cpu --tiny --out /tmp/bench-tiny      # a tiny shape, for tests

What it measures, each part under its own time limit (`--part-s`; a part out of time skips its
remaining cells and says so), every result written to OUT as soon as it is measured (a run cut
short keeps what it measured: OUT/costs.json is rewritten after each cell, OUT/log.jsonl gets a
line per cell, OUT/summary.md at the end of each part):

1. **weight-read limit**: a device-to-device copy of `--copy-mib` MiB timed (bandwidth = 2 x bytes
   / seconds: it reads and writes each byte), and each shape's weights read per plain step over
   it: the fastest a memory-bound decode step could be.
2. **engine**: per shape, random bf16 weights built directly on the device (no checkpoint, no host
   copy), `TorchEngine` through its public API (constructor, `submit`/`step`, a request's
   speculation k), greedy, prompt `--prompt` tokens: ms per decode round for plain (k = 0) and
   each k at each batch size. A round's time is the difference of two generations of
   `--new-tokens` and half as many tokens, over their difference in rounds (counted as `step()`
   calls after the admitting one): the prefill and the narrower last rounds (k shrinks to the
   tokens left) cancel. Random MTP draft weights accept ~0 drafts, so every round runs its full
   width (k draft steps and a (k+1)-token verify) and emits one token per row: the time of a round
   at k is what such a round costs whatever its acceptance, and the acceptance a plan sets
   against it is the user's (measured by their sidecars). The accepted fraction is reported; a
   round is not forced through a private hook. Also the prefill of B prompts. `--draft-vocab-sizes
   0,N`: engines whose MTP head scores N ids (`draft_vocab_size`) beside the full one, interleaved.
   On CUDA, the kernels of one round at each (B, k), counted by torch.profiler
   (`profile_rounds` below, also `specrl bench gpu profile`).
3. **HF transformers eager**: `Qwen3ForCausalLM` with random bf16 weights at the same shape,
   `generate` (greedy, no stop), ms per token step by the same difference of two lengths.
4. **SGLang** beside it, only where `import sglang` works (`load_format="dummy"` random weights,
   plain decoding).

Timing: wall clock with the device synchronised (CUDA); process CPU time on a CPU
(`common.bench_clock`). Medians of `--repeats`, configurations interleaved.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.decode_kernels import DecodeOps
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, SamplingParams
from tools.bench.common import bench_clock, device_problem, random_model, shape_config, subcommand
from trainer.planning.cost_table import cost_table_document
from trainer.planning.shapes import PRESETS

TAUS = (2.0, 2.8, 3.5)
"""Acceptances (tokens a round) at which the summary states what speculation would give."""


def weights_read_per_step(model: Qwen3WithMTP) -> int:
    """Bytes of the target a plain decode step reads: every trunk weight and the output head; not
    the input embedding (a gather of B rows) unless it is the tied head; not the MTP layers."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            continue
        if name == "model.embed_tokens.weight" and model.lm_head is not None:
            continue
        total += p.numel() * p.element_size()
    return total


class Output:
    """OUT/: costs.json (rewritten after every cell), log.jsonl (a line per cell), summary.md."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.tables: dict[str, dict[str, Any]] = {}
        self.reference: dict[str, Any] = {
            "copy": None,
            "hf_eager": {},
            "sglang": {},
            "weight_read_limit_ms": {},
            "kernels_a_round": {},  # table name -> "B/k" -> CUDA kernels of one round (torch.profiler)
        }
        self.skipped: list[str] = []
        (out / "log.jsonl").write_text("")
        self.flush()

    def log(self, record: dict[str, Any]) -> None:
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)

    def flush(self) -> None:
        doc = cost_table_document(
            [t for t in self.tables.values() if t["rounds"]],
            **self.meta,
            reference=self.reference,
            skipped=self.skipped,
        )
        tmp = self.out / "costs.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.out / "costs.json")


class Part:
    """A part of the run with its own deadline."""

    def __init__(self, name: str, limit_s: float, output: Output) -> None:
        self.name, self.deadline, self.output = name, time.monotonic() + limit_s, output

    def over(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.output.skipped.append(f"{self.name}: {what} (part time limit reached)")
        self.output.log({"part": self.name, "skipped": what})
        return True


def measure_copy(device: torch.device, mib: int, clock: Callable[[], float]) -> float:
    """Bytes per second of a device-to-device copy (each byte read and written)."""
    n = mib * 2**20 // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t = clock()
        for _ in range(4):
            dst.copy_(src)
        times.append((clock() - t) / 4)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def engine_part(args: argparse.Namespace, shape: str, device: torch.device, out: Output, clock) -> None:
    part = Part(f"engine {shape}", args.part_s, out)
    cfg = shape_config(shape)
    built = time.monotonic()
    model = random_model(cfg, device)
    out.log({"part": part.name, "built_s": round(time.monotonic() - built, 2)})
    read = weights_read_per_step(model)
    if out.reference["copy"]:
        out.reference["weight_read_limit_ms"][shape] = {
            "bytes": read,
            "ms": 1e3 * read / out.reference["copy"]["bytes_per_s"],
        }
    arms = [(mode, kern, n) for n in args.draft_vocab_sizes for mode in args.compile for kern in args.kernels]
    tables = {}
    for arm in arms:
        mode, kern, n = arm
        name = " ".join(
            [shape]
            + ([f"compile={mode}"] if mode != args.compile[0] else [])
            + ([f"kernels={kern}"] if kern != args.kernels[0] else [])
            + ([f"draft_vocab_size={n}"] if n != args.draft_vocab_sizes[0] else [])
        )
        tables[arm] = out.tables.setdefault(
            name,
            {
                "name": name,
                "device": out.meta["device"],
                "source": f"specrl bench gpu: TorchEngine (compile={mode}, kernels={kern}, draft_vocab_size={n}), "
                f"random bf16 weights, temperature {args.temperature}, prompt {args.prompt}",
                "date": out.meta["date"],
                "model": cfg.to_hf_dict(),
                "context_tokens": args.prompt + 3 * args.new_tokens // 4,
                "rounds": [],
                "prefill": [],
                "request_seconds": 0.0,
            },
        )
    # One engine per arm over the same weights; KV rows just long enough for the runs, so that
    # several engines' caches fit beside an 8B model. An engine's kernels are its own choice
    # ("auto") or torch's operators ("torch").
    engines: dict[tuple[str, str, int], TorchEngine] = {}
    for arm in arms:
        engines[arm] = TorchEngine(
            model,
            speculation_k=0,
            max_speculation_k=max(args.ks),
            max_batch_size=max(args.batches),
            max_context=args.prompt + args.new_tokens + 8,
            compile=arm[0],
            draft_vocab_size=arm[2],
        )
        if arm[1] == "torch":
            engines[arm].kernels = DecodeOps()
        out.log({"part": part.name, "arm": list(arm), "kernels": type(engines[arm].kernels).__name__})
    gen = torch.Generator().manual_seed(1)
    short = max(args.new_tokens // 2, 2)

    def run(arm: tuple[str, str, int], prompts: list[list[int]], k: int, new: int) -> tuple[float, int, float]:
        """Seconds, decode rounds and accepted fraction of drafts of one generation."""
        engine = engines[arm]
        before = engine.stats()[-1].counters
        drafted0, accepted0 = before.drafted_tokens, before.accepted_tokens
        sp = SamplingParams(temperature=args.temperature, max_new_tokens=new, seed=3)
        engine.submit(
            GenerationRequest(
                prompts=prompts, sampling=sp, speculation_k=k, request_id=f"b{k}-{new}-{time.monotonic_ns()}"
            )
        )
        calls, done = 0, 0
        t = clock()
        while done < len(prompts):
            done += len(engine.step())
            calls += 1
        seconds = clock() - t
        after = engine.stats()[-1].counters
        drafted = after.drafted_tokens - drafted0
        return seconds, calls - 1, (after.accepted_tokens - accepted0) / drafted if drafted else 0.0

    for batch in args.batches:
        prompts = torch.randint(0, cfg.vocab_size, (batch, args.prompt), generator=gen).tolist()
        if part.over(f"batch {batch} and beyond"):
            break
        for arm, engine in engines.items():  # warm up (and capture) this batch size's shapes
            captured, t = engine.runner.rounds.captured, time.monotonic()
            for k in args.ks:  # a whole long generation: every shape (and kernel build) of the timed runs
                run(arm, prompts, k, args.new_tokens)
            out.log({"part": part.name, "batch": batch, "arm": list(arm), "warmup_s": round(time.monotonic() - t, 3),
                     "graphs_captured": engine.runner.rounds.captured - captured})  # fmt: skip
        samples: dict[tuple[tuple[str, str, int], int], list[float]] = {(a, k): [] for a in engines for k in args.ks}
        prefills: dict[tuple[str, str, int], list[float]] = {a: [] for a in engines}
        accepted: dict[tuple[tuple[str, str, int], int], float] = {}
        for rep in range(args.repeats):
            if part.over(f"batch {batch}: repeats after {rep}"):
                break
            for arm in engines:
                prefills[arm].append(run(arm, prompts, 0, 1)[0])
                for k in args.ks:
                    long_s, long_r, acc = run(arm, prompts, k, args.new_tokens)
                    short_s, short_r, _ = run(arm, prompts, k, short)
                    if long_r > short_r:
                        samples[(arm, k)].append((long_s - short_s) / (long_r - short_r))
                    accepted[(arm, k)] = acc
        for (arm, k), xs in samples.items():
            if not xs:
                continue
            seconds = statistics.median(xs)
            tables[arm]["rounds"].append({"batch": batch, "k": k, "seconds": max(seconds, 1e-7), "samples": len(xs)})
            out.log({"part": part.name, "arm": list(arm), "batch": batch, "k": k, "round_ms": round(1e3 * seconds, 4),
                     "accepted_fraction": round(accepted.get((arm, k), 0.0), 3), "repeats": len(xs)})  # fmt: skip
        for arm, xs in prefills.items():
            if xs:
                tables[arm]["prefill"].append(
                    {"rows": batch, "prompt_tokens": args.prompt, "seconds": statistics.median(xs)}
                )
        # CUDA kernels; on a CPU (--tiny, the path tests run) the count is 0
        if (device.type == "cuda" or args.tiny) and not part.over(f"batch {batch}: kernels a round"):
            for arm, engine in engines.items():
                for k in args.ks:
                    n = profile_rounds(engine, batch, k, args.prompt, rounds=3)["kernels"]
                    out.reference["kernels_a_round"].setdefault(tables[arm]["name"], {})[f"{batch}/{k}"] = n
                    out.log({"part": part.name, "arm": list(arm), "batch": batch, "k": k, "kernels_a_round": n})
        out.flush()


def hf_part(args: argparse.Namespace, shape: str, device: torch.device, out: Output, clock) -> None:
    part = Part(f"hf eager {shape}", args.part_s, out)
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError as e:
        out.skipped.append(f"{part.name}: transformers not importable ({e})")
        return
    cfg = shape_config(shape)
    if cfg.moe is not None:
        out.skipped.append(f"{part.name}: an MoE shape (HF eager's per-expert loop is no reference for speed)")
        return
    hf_cfg = Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings", "rope_theta",
        "rms_norm_eps")})  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(1)
    short = max(args.new_tokens // 2, 2)

    def run(ids: torch.Tensor, new: int) -> float:
        t = clock()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        return clock() - t

    result = out.reference["hf_eager"].setdefault(
        shape, {"attention": getattr(model.config, "_attn_implementation", "?")}
    )
    for batch in args.batches:
        if part.over(f"batch {batch} and beyond"):
            break
        ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt), generator=gen).to(device)
        run(ids, 2)
        xs = []
        for _ in range(args.repeats):
            if part.over(f"batch {batch}: repeats after {len(xs)}"):
                break
            xs.append((run(ids, args.new_tokens) - run(ids, short)) / (args.new_tokens - short))
        if xs:
            result[str(batch)] = {"step_ms": 1e3 * statistics.median(xs), "repeats": len(xs)}
            out.log({"part": part.name, "batch": batch, "step_ms": round(1e3 * statistics.median(xs), 4)})
        out.flush()


def sglang_part(args: argparse.Namespace, shape: str, out: Output) -> None:
    """Plain decoding in SGLang at the same shape, random weights (`load_format="dummy"`)."""
    part = Part(f"sglang {shape}", args.part_s, out)
    try:
        import sglang  # type: ignore[import-not-found]
    except ImportError:
        out.skipped.append(f"{part.name}: sglang not importable here (install the sglang extra on a GPU node)")
        return
    config = shape_config(shape)
    cfg = config.to_hf_dict()
    cfg.update(architectures=[config.architectures[0]], torch_dtype="bfloat16")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        engine = sglang.Engine(model_path=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                               mem_fraction_static=0.6, cuda_graph_max_bs=max(args.batches))  # fmt: skip
        try:
            gen = torch.Generator().manual_seed(1)
            result = out.reference["sglang"].setdefault(shape, {})
            for batch in args.batches:
                if part.over(f"batch {batch} and beyond"):
                    break
                ids = torch.randint(0, cfg["vocab_size"], (batch, args.prompt), generator=gen).tolist()

                def run(new: int, ids: list[list[int]] = ids) -> float:
                    t = time.perf_counter()
                    engine.generate(
                        input_ids=ids, sampling_params={"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
                    )
                    return time.perf_counter() - t

                run(2)
                short = max(args.new_tokens // 2, 2)
                xs = [(run(args.new_tokens) - run(short)) / (args.new_tokens - short) for _ in range(args.repeats)]
                result[str(batch)] = {"step_ms": 1e3 * statistics.median(xs)}
                out.log({"part": part.name, "batch": batch, "step_ms": round(1e3 * statistics.median(xs), 4)})
                out.flush()
        finally:
            engine.shutdown()


def release(device: torch.device) -> None:
    """Give the finished part's model memory back before the next part builds its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summary(out: Output, args: argparse.Namespace) -> None:
    lines = [f"# specrl bench gpu — {out.meta['device']}, {out.meta['date']}", ""]
    copy = out.reference["copy"]
    if copy:
        lines.append(f"device copy: {copy['bytes_per_s'] / 1e12:.3f} TB/s ({args.copy_mib} MiB)")
    lines += ["", "| shape | B | " + " | ".join(f"k={k} round ms" for k in args.ks) + " | HF eager ms | SGLang ms | weight-read limit ms |",
              "|---|---|" + "---|" * (len(args.ks) + 3)]  # fmt: skip
    for name, table in out.tables.items():
        shape = name.split(" compile=")[0]
        cells = {(r["batch"], r["k"]): r["seconds"] for r in table["rounds"]}
        for b in sorted({r["batch"] for r in table["rounds"]}):
            ks = " | ".join(f"{1e3 * cells[(b, k)]:.3f}" if (b, k) in cells else "—" for k in args.ks)
            hf = out.reference["hf_eager"].get(shape, {}).get(str(b), {}).get("step_ms")
            sg = out.reference["sglang"].get(shape, {}).get(str(b), {}).get("step_ms")
            lim = out.reference["weight_read_limit_ms"].get(shape, {}).get("ms") if b == min(args.batches) else None
            fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
            lines.append(f"| {name} | {b} | {ks} | {fmt(hf)} | {fmt(sg)} | {fmt(lim)} |")
    lines += ["", "What speculation would give: tau (tokens a round) x plain round / k round, and the plain round",
              "against the weight-read limit (limit / round: 1 is the memory-bound ideal).", "",
              "| table | B | k | round ms | kernels | x plain | limit / plain round | at tau 2 | at tau 2.8 | at tau 3.5 |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, table in out.tables.items():
        shape = name.split(" compile=")[0]
        lim = out.reference["weight_read_limit_ms"].get(shape, {}).get("ms")
        cells = {(r["batch"], r["k"]): r["seconds"] for r in table["rounds"]}
        for b, k in sorted(cells):
            plain = cells.get((b, 0))
            if plain is None:
                continue
            ms = 1e3 * cells[(b, k)]
            frac = f"{lim / (1e3 * plain):.2f}" if lim and k == 0 else ""
            gains = " | ".join(f"{tau * plain / cells[(b, k)]:.2f}x" if k else "" for tau in TAUS)
            n = out.reference["kernels_a_round"].get(name, {}).get(f"{b}/{k}")
            kernels = "—" if n is None else f"{n:.0f}"
            lines.append(
                f"| {name} | {b} | {k} | {ms:.3f} | {kernels} | {cells[(b, k)] / plain:.2f} | {frac} | {gains} |"
            )
    if out.skipped:
        lines += ["", "skipped:"] + [f"- {s}" for s in out.skipped]
    (out.out / "summary.md").write_text("\n".join(lines) + "\n")


PROFILE_DOC = """Where one decode round's time goes: the host's work against the device's, per compile mode.

    specrl bench gpu profile --device cuda --shape qwen3-0.6b --batches 1,16 --ks 0,3
    specrl bench gpu profile --device cpu --shape tiny                      # the path, for tests
    specrl bench gpu profile --device cuda --compile on --kernels auto,torch # fused kernels against torch's

For each (compile mode, batch, k): the engine (random bf16 weights built on the device, as
specrl bench gpu) generates a warm-up request, then `--rounds` decode rounds run under
torch.profiler. Printed per round: the wall time of `step()` (median, device synchronised), the
device time (the kernels' durations summed, CUDA only), the kernels run and the CUDA-graph
launches. A round whose wall time is near its device time is device-bound; one far above it is
host-bound (launches, Python). Output also goes to OUT/profile.json when --out is given.
"""


def profile_rounds(engine: TorchEngine, batch: int, k: int, prompt: int, rounds: int) -> dict[str, float]:
    vocab = engine.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=rounds + 8, seed=3)
    for tag in ("warm", "run"):
        engine.submit(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k, request_id=f"{tag}{batch}-{k}"))
        engine.step()  # admission (prefill)
        if tag == "warm":
            while engine.has_work():
                engine.step()
    cuda = engine.device.type == "cuda"
    walls: list[float] = []
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for i in range(rounds):
            with torch.profiler.record_function(f"round{i}"):
                t = time.perf_counter()
                engine.step()
                if cuda:
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - t)
    while engine.has_work():
        engine.step()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in kernels)
    return {
        "batch": batch,
        "k": k,
        "wall_ms": 1e3 * statistics.median(walls),
        "device_ms": device_us / 1e3 / rounds,
        "kernels": len(kernels) / rounds,
        "graph_launches": sum(e.name == "cudaGraphLaunch" for e in events) / rounds,
    }


def profile_main(argv: list[str] | None = None) -> int:
    """`specrl bench gpu profile`: the options of the old profile_round.py."""
    ap = argparse.ArgumentParser(
        prog="specrl bench gpu profile", description=PROFILE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ks", default="0,3")
    ap.add_argument("--compile", default="on,off")
    ap.add_argument("--kernels", default="auto", help="auto (the engine's choice: Triton's on CUDA) and/or torch")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if problem := device_problem(args.device):
        ap.error(problem)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = random_model(shape_config(args.shape), device)
    ks = [int(k) for k in args.ks.split(",")]
    results = []
    if bad := [k for k in args.kernels.split(",") if k not in ("auto", "torch")]:
        ap.error(f"--kernels takes auto, torch; got {bad}")
    arms = [(m, kern) for m in args.compile.split(",") for kern in args.kernels.split(",")]
    for mode, kern in arms:
        engine = TorchEngine(
            model,
            speculation_k=0,
            max_speculation_k=max(ks),
            max_batch_size=max(int(b) for b in args.batches.split(",")),
            max_context=args.prompt + args.rounds + 16,
            compile=mode,
        )
        if kern == "torch":
            engine.kernels = DecodeOps()
        for batch in (int(b) for b in args.batches.split(",")):
            for k in ks:
                r = {"compile": mode, "decode_ops": type(engine.kernels).__name__, "shape": args.shape,
                     "layers": model.config.num_hidden_layers,
                     **profile_rounds(engine, batch, k, args.prompt, args.rounds)}  # fmt: skip
                results.append(r)
                print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in r.items()}), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    return 0


SUBCOMMANDS = {"profile": profile_main}


def main(argv: list[str] | None = None) -> int:
    merged = subcommand(argv, SUBCOMMANDS, "specrl bench gpu")
    if merged is not None:
        return merged
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommand: profile (kernels a round under torch.profiler: `specrl bench gpu profile --help`)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and short runs (tests, CPU)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ks", default="0,1,3,5")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--part-s", type=float, default=80.0, help="time limit of each part (seconds)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--kernels", default="auto",
                    help="decode kernels, side by side: auto (the engine's choice: Triton's on CUDA) and/or torch")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every generation")
    ap.add_argument("--compile", default="auto",
                    help="engine compile modes, side by side (e.g. on,off); the first one's table is named by the shape")  # fmt: skip
    ap.add_argument("--draft-vocab-sizes", default="0",
                    help="MTP head vocabularies, side by side (draft_vocab_size; 0: full, the first one's table "
                    "is named by the shape)")  # fmt: skip
    args = ap.parse_args(argv)
    if problem := device_problem(args.device):
        ap.error(problem)
    if args.tiny:
        args.shapes, args.batches, args.ks = "tiny", "1,4", "0,1,3"
        args.prompt, args.new_tokens, args.repeats, args.copy_mib = 8, 8, 1, 8
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.compile = args.compile.split(",")
    args.draft_vocab_sizes = [int(n) for n in args.draft_vocab_sizes.split(",")]
    if bad := [m for m in args.compile if m not in ("auto", "on", "off")]:
        ap.error(f"--compile takes auto, on, off; got {bad}")
    args.kernels = args.kernels.split(",")
    if bad := [m for m in args.kernels if m not in ("auto", "torch")]:
        ap.error(f"--kernels takes auto, torch; got {bad}")
    if 0 not in args.ks:
        ap.error("--ks must include 0: plain decoding is the baseline of a cost table")
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s != "tiny" and s not in PRESETS]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: tiny, {', '.join(PRESETS)}")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    clock, clock_name = bench_clock(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "clock": clock_name, "torch": torch.__version__, "command": " ".join(sys.argv)}  # fmt: skip
    out = Output(args.out, meta)
    part = Part("copy", args.part_s, out)
    if not part.over("device copy"):
        bw = measure_copy(device, args.copy_mib, clock)
        out.reference["copy"] = {"bytes_per_s": bw, "mib": args.copy_mib}
        out.log({"part": "copy", "tb_s": round(bw / 1e12, 4)})
    for shape in shapes:
        engine_part(args, shape, device, out, clock)
        release(device)
        summary(out, args)
    if not args.no_hf:
        for shape in shapes:
            hf_part(args, shape, device, out, clock)
            release(device)
            summary(out, args)
    if device.type == "cuda":
        for shape in shapes:
            sglang_part(args, shape, out)
    out.flush()
    summary(out, args)
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
