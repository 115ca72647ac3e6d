"""`specrl export` and the export at the end of `specrl train`: a run's policy and draft, out as a
Hugging Face checkpoint.

Oracles: transformers' own `Qwen3ForCausalLM.from_pretrained` forward of the exported directory
(against the trainer's Megatron policy restored from the run's checkpoint); the sidecar that
served the run, still serving the last weights the run pushed to it (greedy tokens, plain and
speculative); plain greedy decoding for the exported draft; the SGLang/vLLM loaders' EAGLE-3
layout written out as literals (`tests/eagle3_layout.py`).

The export is `trainer/rl/export.py`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from muon import HybridOptimizerConfig
from sidecar.client.client import SidecarClient
from sidecar.engine.config import EngineConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.eagle3_checkpoint import load_eagle3_draft
from sidecar.model.model import ModelConfig
from sidecar.serve_config import ServeConfig
from sidecar.types import GenerationRequest, Sample, SamplingParams
from tests.eagle3_layout import LAYOUT
from trainer.cli.main import main
from trainer.draft.objective import DraftConfig
from trainer.policy import gpt
from trainer.policy.policy import Policy
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig, TaskConfig
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.loop import train
from trainer.rl.run_setup import policy_config
from trainer.rl.tasks import ArithmeticTask
from trainer.rl.warmup import DraftInitConfig, WarmupConfig, draft_init, make_model, supervised_warmup
from trainer.tokenizer import CharTokenizer

TASK = ArithmeticTask(regime="zero", digits=2)
TOK = CharTokenizer()
GENERATION_CONFIG = {"eos_token_id": TOK.eos_id, "max_new_tokens": 16}
"""A file `copy_tokenizer_files` carries from the starting model into every checkpoint written from it."""


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(7)
    return [TOK.encode(TASK.sample(rng, "eval").prompt) for _ in range(n)]


def _greedy(k: int) -> GenerationRequest:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(TOK.eos_id,))
    return GenerationRequest(prompts=_prompts(), sampling=sampling, speculation_k=k, request_id=f"greedy-{k}")


def _tokens(samples: list[Sample]) -> list[list[int]]:
    return [s.token_ids for s in sorted(samples, key=lambda s: s.prompt_index)]


@dataclass
class Trained:
    cfg: RLConfig
    served: dict[int, list[list[int]]]
    """Greedy tokens of the run's sidecar after the run, by speculation k (0: plain)."""


def _run(root: Path, start: Path, steps: int, eagle3: Path | None = None) -> Trained:
    """`steps` RL steps from `start` against a sidecar this test owns, so that after the run it
    still serves the weights the run pushed last."""
    (start / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    with LocalSidecars(start, 1, root / "logs", serve=ServeConfig(engine=EngineConfig(draft=eagle3))) as local:
        cfg = RLConfig(
            model=start,
            task=TaskConfig(kind="arithmetic", regime="zero", digits=2),
            rollout=RolloutConfig(
                prompts_per_step=4, samples_per_prompt=4, temperature=1.0, max_new_tokens=16, speculation_k=3
            ),
            optimizer=HybridOptimizerConfig(lr=1e-3),
            draft=DraftConfig(eagle3=eagle3),
            sidecars=SidecarsConfig(addresses=local.start()),
            steps=steps,
            eval_every=0,
            checkpoint_every=1,
            run_dir=root / "run",
        )
        train(cfg, progress=False)
        with SidecarClient(local.addresses[0]) as client:
            assert client.info().weight_version == steps + 1  # the first push, then one a step
            served = {k: _tokens(client.generate(_greedy(k))) for k in (0, 3)}
    return Trained(cfg=cfg, served=served)


def tiny(**overrides: object) -> ModelConfig:
    shape: dict[str, object] = {"hidden_size": 64, "intermediate_size": 192, "max_position_embeddings": 128}
    return ModelConfig.tiny(vocab_size=TOK.vocab_size, tie_word_embeddings=True, **(shape | overrides))


@pytest.fixture(scope="module")
def mtp_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """Two RL steps of a tiny model with an MTP layer, warmed up until it earns some reward (so
    the trunk moves in RL, not only the draft)."""
    root = tmp_path_factory.mktemp("mtp-run")
    torch.set_num_threads(1)
    make_model(root / "init", tiny(), seed=0)
    supervised_warmup(root / "init", root / "start", TASK, TOK, WarmupConfig(steps=80, batch_size=32, lr=3e-3))
    yield _run(root, root / "start", steps=2)


def _restored(cfg: RLConfig, step: int) -> Policy:
    """The trainer's policy as the run left it at `step` (Megatron, restored as a resume does)."""
    model_config, tensors = load_checkpoint(cfg.model)
    policy = Policy(model_config, policy_config(cfg), tensors)
    policy.load(cfg.run_dir / "checkpoints" / f"step_{step}")
    return policy


@pytest.mark.slow
def test_the_export_loads_in_transformers_with_the_trainers_logits(mtp_run: Trained, tmp_path: Path) -> None:
    import transformers

    run = mtp_run.cfg.run_dir
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "last")])
    assert result.exit_code == 0, result.output
    assert f"export: step 2 of {run} -> {tmp_path / 'last'}" in result.output
    result = CliRunner().invoke(main, ["export", str(run), "--step", "1", "--out", str(tmp_path / "first")])
    assert result.exit_code == 0, result.output

    tokens = torch.tensor([TOK.encode("12+34=?\n46"), TOK.encode("98+76=?\n17")])  # prompt + completion
    for step, out in ((2, tmp_path / "last"), (1, tmp_path / "first"), (2, run / "export")):
        hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf(tokens).logits
        ours = gpt.forward(_restored(mtp_run.cfg, step).model, tokens)[0]
        assert (theirs - ours).abs().max() < 1e-4, (out, float((theirs - ours).abs().max()))
        assert json.loads((out / "generation_config.json").read_text()) == GENERATION_CONFIG
        assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # the run trained its trunk: the two steps' exports differ, and differ from where it started
    first, last, start = (load_checkpoint(p)[1] for p in (tmp_path / "first", tmp_path / "last", mtp_run.cfg.model))
    trunk = [n for n in start if not n.startswith("mtp.")]
    assert any(not torch.equal(first[n], last[n]) for n in trunk)
    assert any(not torch.equal(start[n], first[n]) for n in trunk)
    assert any(not torch.equal(start[n], last[n]) for n in last if n.startswith("mtp."))  # and its draft


@pytest.mark.slow
def test_the_export_serves_the_tokens_the_runs_sidecar_served_last(mtp_run: Trained) -> None:
    export = mtp_run.cfg.run_dir / "export"  # what `specrl train` wrote at its end
    for k in (0, 3):
        engine = TorchEngine.from_checkpoint(export, speculation_k=k)
        assert _tokens(engine.generate(_greedy(k))) == mtp_run.served[k], k
    assert mtp_run.served[3] == mtp_run.served[0]  # speculative greedy is plain greedy


def test_a_missing_run_or_step_is_one_line_that_says_what_exists(mtp_run: Trained, tmp_path: Path) -> None:
    run = mtp_run.cfg.run_dir
    cases = [
        ([str(tmp_path / "nowhere")], "is not a run directory (it has no config.yaml)"),
        ([str(run), "--step", "7"], "has no checkpoint of step 7; kept steps: 1, 2"),
        ([str(run), "--out", str(run)], "already exists and is not empty"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(
            main, ["export", *args] + ([] if "--out" in args else ["--out", str(tmp_path / "x")])
        )
        assert result.exit_code == 1, result.output
        assert result.output.startswith("Error: ExportError: ") and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "x").exists()
    # a tensor-parallel run's shards are restored by as many processes: the command says how
    tp = tmp_path / "tp-run"
    (tp / "checkpoints" / "step_1").mkdir(parents=True)
    config = (run / "config.yaml").read_text()
    (tp / "config.yaml").write_text(config.replace("tensor_parallel: 1", "tensor_parallel: 2", 1))
    result = CliRunner().invoke(main, ["export", str(tp), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and "train.tensor_parallel=2" in result.output, result.output
    assert f"torchrun --nproc-per-node 2 -m trainer.cli.main export {tp} --out" in result.output


@pytest.fixture(scope="module")
def eagle3_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """One RL step of a 4-layer model without MTP layers that trains an EAGLE-3 draft online
    (the shape of tests/eagle3_layout.py's literal: hidden 64, heads 4 x 16, draft vocabulary 35)."""
    root = tmp_path_factory.mktemp("eagle3-run")
    torch.set_num_threads(1)
    make_model(
        root / "start",
        tiny(num_hidden_layers=4, num_nextn_predict_layers=0, intermediate_size=128, num_key_value_heads=4),
        seed=0,
    )
    cfg = DraftInitConfig(prompts=16, steps=2, batch_size=8, kind="eagle3", draft_vocab_size=35)
    draft_init(root / "start", root / "draft", TASK, TOK, cfg)
    yield _run(root, root / "start", steps=1, eagle3=root / "draft")


@pytest.mark.slow
def test_an_eagle3_run_exports_its_trained_draft_in_the_sglang_vllm_layout(eagle3_run: Trained, tmp_path: Path) -> None:
    run = eagle3_run.cfg.run_dir
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"specrl serve --model {tmp_path / 'out'} --draft {tmp_path / 'out' / 'eagle3'}" in result.output
    for out in (tmp_path / "out", run / "export"):
        draft_dir = out / "eagle3"
        tensors = load_file(str(draft_dir / "model.safetensors"))
        expected = LAYOUT | {"t2d": ((TOK.vocab_size,), torch.bool)}  # the literal's target vocabulary is 64
        assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == expected
        config = json.loads((draft_dir / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
        assert (config["vocab_size"], config["draft_vocab_size"], config["hidden_size"]) == (TOK.vocab_size, 35, 64)
        assert config["tie_word_embeddings"] is False and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        # the draft is the one the run trained, not the one it started from; the target has no MTP layers
        model_config, _ = load_checkpoint(out)
        assert model_config.num_nextn_predict_layers == 0
        trained = load_eagle3_draft(draft_dir, target=model_config)
        started = load_eagle3_draft(eagle3_run.cfg.draft.eagle3)  # type: ignore[arg-type]
        assert not torch.equal(trained.fc.weight, started.fc.weight)
        # served with its draft, the export decodes as the run's sidecar did, and as plain greedy
        for k in (0, 3):
            engine = TorchEngine.from_checkpoint(out, speculation_k=k, draft=draft_dir)
            assert _tokens(engine.generate(_greedy(k))) == eagle3_run.served[k] == eagle3_run.served[0], k


@pytest.mark.slow
def test_a_users_model_exports_with_its_own_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """A transformers checkpoint with its own BPE tokenizer and ChatML template, trained on a parquet
    GSM8K-style file (`tests/trainer/rl/test_user_data.py`'s fixtures): the export is that tokenizer, unchanged,
    and the trained weights."""
    import transformers

    from tests.trainer.rl.test_user_data import _write, bpe_model, gsm8k_rows
    from trainer.cli.commands import resolve_config

    model = bpe_model(tmp_path / "model")
    data = _write(gsm8k_rows(), tmp_path / "gsm8k.parquet")
    sets = ["task.kind=dataset", f"task.path={data}", "task.fields.prompt=question", "task.rewards=[math]"]
    sets += ["rollout.speculation_k=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"]
    sets += ["rollout.max_new_tokens=8", "algorithm.filter_equal_groups=false", "optimizer.lr=1e-3"]
    cfg = resolve_config(None, [f"model={model}", *sets, "sidecars.local=1", "steps=2", "eval_every=0"])
    cfg.run_dir = tmp_path / "run"
    train(cfg, progress=False)
    export = tmp_path / "run" / "export"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (model / name).read_bytes(), name
    messages = [{"role": "user", "content": "Tom has 2 boxes of 3 apples. How many apples?"}]

    def rendered(directory: Path) -> list[int]:  # the prompt ids transformers renders from that directory
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    assert rendered(export) == rendered(model)
    tokens = torch.tensor([rendered(export)])
    hf = transformers.Qwen3ForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = gpt.forward(_restored(cfg, 2).model, tokens)[0]
    assert (theirs - ours).abs().max() < 1e-4, float((theirs - ours).abs().max())
    _, start = load_checkpoint(model)
    _, exported = load_checkpoint(export)
    assert any(not torch.equal(start[n], exported[n]) for n in start)  # the trained weights, not the start's
