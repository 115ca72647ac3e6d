"""An EAGLE-3 draft's checkpoint directory: the SGLang/vLLM layout, a round trip, serving it.

Oracles: the names, shapes and dtypes the SGLang (`LlamaForCausalLMEagle3.load_weights`) and vLLM
(`Eagle3LlamaForCausalLM.load_weights`) loaders read, written out here as literals; d2t's meaning
(target id = draft id + d2t) against the draft vocabulary it was built from; after a round trip,
greedy output equal to the target's plain greedy decoding and to the draft before saving.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from sidecar.client.client import SidecarClient
from sidecar.engine.config import EngineConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.errors import CheckpointError
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.eagle3 import Eagle3Config, Eagle3Draft
from sidecar.model.eagle3_checkpoint import load_eagle3_draft, save_eagle3_draft
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.serve_config import ServeConfig
from sidecar.server.cli import load_engine
from sidecar.types import GenerationRequest, SamplingParams
from tests.eagle3_layout import LAYOUT
from tests.sidecar.engine_fixtures import aligned_eagle3, eagle3_target
from tests.sidecar_fixtures import start_sidecar
from trainer.cli.main import main

REDUCED = sorted({*range(0, 64, 2), 1, 3, 5})


@pytest.fixture(scope="module")
def target() -> Qwen3WithMTP:
    return eagle3_target()


@pytest.fixture(scope="module")
def draft(target: Qwen3WithMTP) -> Eagle3Draft:
    return aligned_eagle3(target, REDUCED)


@pytest.fixture
def dirs(tmp_path: Path, target: Qwen3WithMTP, draft: Eagle3Draft) -> tuple[Path, Path]:
    save_checkpoint(tmp_path / "target", target.config, model_state_dict(target))
    save_eagle3_draft(tmp_path / "draft", draft)
    return tmp_path / "target", tmp_path / "draft"


def greedy(engine: TorchEngine, k: int = 3) -> list[list[int]]:
    req = GenerationRequest(
        prompts=[[1, 2, 3], [7, 8, 9, 10]], sampling=SamplingParams(temperature=0.0, max_new_tokens=12), speculation_k=k
    )
    return [s.token_ids for s in engine.generate(req)]


def test_the_draft_is_written_in_the_sglang_vllm_layout_and_reads_back_the_same(
    target: Qwen3WithMTP, draft: Eagle3Draft, dirs: tuple[Path, Path]
) -> None:
    _, path = dirs
    tensors = load_file(str(path / "model.safetensors"))
    assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == LAYOUT
    assert (torch.arange(len(REDUCED)) + tensors["d2t"]).tolist() == REDUCED  # target id = draft id + d2t
    assert tensors["t2d"].nonzero()[:, 0].tolist() == REDUCED
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert (config["vocab_size"], config["draft_vocab_size"], config["hidden_size"]) == (64, 35, 64)
    assert config["tie_word_embeddings"] is False and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    loaded = load_eagle3_draft(path, target=target.config)
    assert loaded.config == draft.config
    for (n, a), (m, b) in zip(draft.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
    plain = greedy(TorchEngine(target), k=0)
    assert greedy(TorchEngine(target, draft=loaded)) == greedy(TorchEngine(target, draft=draft)) == plain


def test_taps_are_written_in_both_loaders_conventions_and_read_from_sglangs(
    tmp_path: Path, target: Qwen3WithMTP
) -> None:
    cfg = Eagle3Config.for_target(target.config, aux_layer_ids=[1, 2, 3])
    save_eagle3_draft(tmp_path / "d", Eagle3Draft(cfg))
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: layer inputs
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # SGLang: layer outputs
    del raw["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    assert load_eagle3_draft(tmp_path / "d").config.aux_layers(4) == (1, 2, 3)


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_a_bad_draft_directory_is_one_clear_error(
    tmp_path: Path, target: Qwen3WithMTP, dirs: tuple[Path, Path]
) -> None:
    target_dir, path = dirs
    with pytest.raises(CheckpointError, match="does not exist"):
        load_eagle3_draft(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not an EAGLE-3 draft"):
        load_eagle3_draft(target_dir)  # a specrl checkpoint given as --draft
    other = build_model(ModelConfig.tiny(num_hidden_layers=4, num_nextn_predict_layers=0, hidden_size=32)).config
    with pytest.raises(CheckpointError, match="does not fit the target: .*hidden_size"):
        load_eagle3_draft(path, target=other)
    _edit_config(path, intermediate_size=96)
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight has shape"):
        load_eagle3_draft(path)
    _edit_config(path, intermediate_size=128)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["t2d"][11] = True  # id 11 is not in the draft vocabulary's d2t
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="inconsistent token maps"):
        load_eagle3_draft(path)


def test_serving_a_draft_reports_its_kind_and_names_a_mismatch(tmp_path: Path, dirs: tuple[Path, Path]) -> None:
    target_dir, path = dirs
    engine = load_engine(
        ServeConfig(
            model=target_dir, engine=EngineConfig(speculation_k=2, max_speculation_k=4, max_batch_size=8, draft=path)
        )
    )
    assert engine.info().speculation_method == "eagle3" and engine.info().speculation_k == 2
    mtp_dir = tmp_path / "mtp"
    config = ModelConfig.tiny(num_hidden_layers=4)
    save_checkpoint(mtp_dir, config, model_state_dict(build_model(config, seed=1)))
    with pytest.raises(click.ClickException, match="one draft kind"):
        load_engine(
            ServeConfig(
                model=mtp_dir, engine=EngineConfig(speculation_k=2, max_speculation_k=4, max_batch_size=8, draft=path)
            )
        )
    assert (
        ServeConfig(engine=EngineConfig(kind="sglang", draft=path)).engine.draft == path
    )  # SGLang's EAGLE3 (tests/with_sglang)
    out = CliRunner().invoke(main, ["serve", "--model", str(target_dir), "--draft", str(path), "--print-config"])
    assert out.exit_code == 0 and f"draft: {path}" in out.output, out.output
    out = CliRunner().invoke(
        main, ["serve", "--model", str(target_dir), "--draft", str(tmp_path / "no"), "--print-config"]
    )
    assert out.exit_code == 2 and "--draft" in out.output


def test_getinfo_over_grpc_reports_the_eagle3_draft(dirs: tuple[Path, Path]) -> None:
    target_dir, path = dirs
    with start_sidecar(target_dir, speculation_k=2, draft=path) as sc, SidecarClient(sc.address) as c:
        info = c.info()
        assert info.engine.speculation_method == "eagle3" and info.engine.speculation_k == 2
        samples = c.generate(
            GenerationRequest(prompts=[[1, 2, 3]], sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
        )
        assert samples[0].counters.drafted_tokens > 0
