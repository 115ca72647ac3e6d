"""A bad run fails early and clearly: config values parse as users write them, cross-field and
model checks run at load time before anything expensive, and every expected error reaches the
user as one CLI message (exit code 1, no traceback). CLI option defaults are the configs' own.

Oracles: the value a user means (3e-4 is a number), the field each CLI option sets, and what the
process did *not* do (no run directory, no sidecar log) when a check fails first.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from sidecar.config_io import from_mapping, merge_overrides, parse_override, yaml_load
from sidecar.engine.config import EngineConfig
from sidecar.security import SecurityConfig
from sidecar.serve_config import SECURITY_OPTIONS, ServeConfig
from tests.sidecar_fixtures import start_sidecar
from trainer.cli.commands import resolve_config
from trainer.cli.main import main
from trainer.rl.config import RLConfig, SidecarsConfig
from trainer.rl.rewards import Reward, RewardFunctionError
from trainer.rl.tasks import DatasetTask, Problem
from trainer.rl.warmup import DraftInitConfig, WarmupConfig, WarmupError


def _cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


# ---- values parse as users write them --------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [("3e-4", 3e-4), ("1E5", 1e5), ("-2.5e-3", -2.5e-3), (".5", 0.5), ("10", 10), ("0x1f", 31), ("true", True)],
)
def test_numbers_parse_as_yaml_1_2(text: str, value: object) -> None:
    assert parse_override(f"a={text}") == (["a"], value)
    assert yaml_load(f"a: {text}") == {"a": value}


@pytest.mark.parametrize("text", ["on", "no", "yes", "off", "1:30", "0777x"])
def test_yaml_1_1_oddities_stay_strings(text: str) -> None:
    # YAML 1.1 would make these booleans and the base-60 integer 90
    assert yaml_load(f"a: {text}") == {"a": text}


def test_lr_3e_minus_4_is_accepted_from_overrides_and_files(tmp_path: Path) -> None:
    cfg = resolve_config(None, ["model=ckpt", "optimizer.lr=3e-4", "draft.optimizer.lr=1e-3"])
    assert cfg.optimizer.lr == pytest.approx(3e-4) and cfg.draft.optimizer.lr == pytest.approx(1e-3)
    f = tmp_path / "run.yaml"
    f.write_text("model: ckpt\noptimizer: {lr: 3e-4}\nalgorithm: {std_eps: 1e-6}\n")
    cfg = resolve_config(f, [])
    assert cfg.optimizer.lr == pytest.approx(3e-4) and cfg.algorithm.std_eps == pytest.approx(1e-6)


# ---- cross-field checks and reachability of every policy knob --------------------------------
def test_a_reference_model_of_another_shape_is_rejected_before_anything_starts(
    tmp_path: Path, jsonl_run: tuple[Path, Path]
) -> None:
    ckpt, data = jsonl_run
    other = _checkpoint(tmp_path / "other", num_hidden_layers=1)
    args = _train_args(ckpt, data, tmp_path / "run", "--local-sidecars", "1", "--set", "algorithm.kl_coef=0.1")
    code, out = _cli([*args, "--set", f"reference_model={other}"])
    assert code == 1 and "reference_model" in out and "Traceback" not in out, out
    assert not (tmp_path / "run").exists()


def test_local_sidecar_devices_must_fit_their_count() -> None:
    with pytest.raises(ValueError, match="devices"):
        SidecarsConfig(local=3, devices=["cuda:0", "cuda:1"])
    assert SidecarsConfig(local=2, devices=["cuda:0", "cuda:1"]).device_of(1) == "cuda:1"
    assert SidecarsConfig(local=2, devices=["cuda:0"]).device_of(1) == "cuda:0"


def test_every_policy_config_field_is_reachable_from_the_run_config() -> None:
    from trainer.policy.policy import Policy
    from trainer.rl.run_setup import policy_config

    overrides = [
        "model=ckpt",
        "train.tensor_parallel=2",
        "train.data_parallel=2",
        "seed=7",
        "rollout.temperature=0.7",
        "algorithm.eps_low=0.1",
        "optimizer.lr=2e-3",
        "train.clip_grad=0.5",
        "draft.train=false",
        "draft.chain_depth=5",
        "draft.optimizer.lr=5e-3",
        "draft.clip_grad=0.25",
        "train.micro_batch_rows=4",
        "train.lr_schedule.warmup_steps=3",
        "draft.lr_schedule.decay=cosine",
        "train.epochs=2",  # total_updates = steps x epochs x mini_batches
        "train.expert_parallel=2",
        "train.router.frozen=true",
    ]
    got = policy_config(resolve_config(None, overrides))
    default = Policy.Config()
    unreachable = [
        f.name for f in dataclasses.fields(Policy.Config) if getattr(got, f.name) == getattr(default, f.name)
    ]
    assert not unreachable, f"Policy.Config fields not set from the run config: {unreachable}"


def test_print_config_round_trips() -> None:
    code, out = _cli(
        ["train", "--model", ".", "--set", "optimizer.lr=3e-4", "--set", "train.clip_grad=0.5", "--print-config"]
    )
    assert code == 0, out
    again = from_mapping(RLConfig, yaml.safe_load(out))
    assert again == resolve_config(None, ["model=.", "optimizer.lr=3e-4", "train.clip_grad=0.5"])


# ---- CLI defaults are the configs' defaults --------------------------------------------------
@pytest.mark.parametrize(("command", "config"), [("warmup", WarmupConfig()), ("draft-init", DraftInitConfig())])
def test_training_command_defaults_equal_their_configs(command: str, config: object) -> None:
    cmd = main.commands[command]
    fields = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    options = {p.name: p.default for p in cmd.params if p.name in fields}
    assert set(options) == fields, f"config fields without an option: {fields - set(options)}"
    assert options == {name: getattr(config, name) for name in options}


def test_serve_defaults_equal_serve_config_and_demo_steps_equal_demo_config() -> None:
    cfg = ServeConfig()
    params = {p.name: p.default for p in main.commands["serve"].params}
    fields = {f.name for f in dataclasses.fields(ServeConfig)} - {"model", "security", "engine"}
    assert fields <= set(params)
    assert {n: params[n] for n in fields} == {n: getattr(cfg, n) for n in fields}
    # the engine section: an option per field, its default (`tests/sidecar/server/test_serve_config.py` in full)
    engine = {EngineConfig.OPTION_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(EngineConfig)}
    assert {o: params[o] for o in engine} == {o: getattr(cfg.engine, n) for o, n in engine.items()}
    # the security section: an option per field (its name, its default) but the client-only tls
    security = {f.name for f in dataclasses.fields(SecurityConfig)} - {"tls"}
    assert set(SECURITY_OPTIONS) == security
    assert {n: params[n] for n in security} == {n: getattr(cfg.security, n) for n in security}
    assert "tls" not in params
    from trainer.cli.demo import DemoConfig

    assert {p.name: p.default for p in main.commands["demo"].params}["rl_steps"] == DemoConfig().rl_steps


def test_serve_takes_config_file_then_set_then_options(tmp_path: Path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text(f"model: {tmp_path}\nport: 7000\nengine: {{speculation_k: 2, device: cuda:1}}\nkeep_staging: false\n")
    code, out = _cli(
        [
            "serve",
            "--config",
            str(f),
            "--set",
            "port=0",
            "--set",
            "engine.max_batch_size=16",
            "--speculation-k",
            "4",
            "--print-config",
        ]
    )
    assert code == 0, out
    got = yaml.safe_load(out)
    assert got["port"] == 0 and got["engine"]["speculation_k"] == 4 and got["engine"]["max_batch_size"] == 16
    assert (
        got["engine"]["device"] == "cuda:1"
        and got["keep_staging"] is False
        and got["shutdown_grace_s"] == ServeConfig().shutdown_grace_s
    )
    token, other, ca = tmp_path / "token", tmp_path / "other-token", tmp_path / "ca.pem"
    for path in (token, other, ca):
        path.write_text("not read by --print-config\n")
    f.write_text(f"model: {tmp_path}\nsecurity: {{token_file: {token}}}\n")
    code, out = _cli(["serve", "--config", str(f), "--token-file", str(other), "--print-config"])
    assert code == 0, out
    assert yaml.safe_load(out)["security"] == {  # a flag overrides the file's security.* key
        "token_file": str(other),
        "cert": None,
        "key": None,
        "peer_ca": None,
        "tls": False,
    }
    code, out = _cli(["serve", "--model", str(tmp_path), "--peer-ca", str(ca), "--print-config"])
    assert code != 0 and "security.peer_ca" in out and "--cert" in out and "Traceback" not in out
    code, out = _cli(["serve", "--set", "no_such=1", "--model", str(tmp_path)])
    assert code != 0 and "no_such" in out and "Traceback" not in out


# ---- checks before anything expensive, and one clear message ---------------------------------
def _reward_module(tmp_path: Path, body: str) -> str:
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(body))
    return "my_rewards:score"


@pytest.fixture
def jsonl_run(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(40)))
    return _checkpoint(tmp_path / "ckpt"), data


def _checkpoint(path: Path, **shape: int) -> Path:
    """A tiny random model whose vocabulary holds the built-in character tokenizer's."""
    from sidecar.model.checkpoint import model_state_dict, save_checkpoint
    from sidecar.model.model import ModelConfig, build_model

    config = ModelConfig.tiny(**{"vocab_size": 128, "max_position_embeddings": 256, **shape})
    save_checkpoint(path, config, model_state_dict(build_model(config, seed=0)))
    return path


def _train_args(ckpt: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    args = ["train", "--model", str(ckpt), "--run-dir", str(run_dir), "--set", "task.kind=dataset"]
    return [*args, "--set", f"task.path={data}", "--set", "rollout.max_new_tokens=8", *extra]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("def score(prompt, completion, answer):\n    return 1.0 / 0\n", "ZeroDivisionError"),
        ("def score(prompt, completion, answer):\n    return 'high'\n", "return a float"),
        ("def score(prompt, completion):\n    return 1.0\n", "must accept"),
        ("x = 1\n", "cannot import"),
    ],
)
def test_a_bad_reward_function_fails_before_megatron_and_sidecars(
    tmp_path: Path, jsonl_run: tuple[Path, Path], body: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    spec = _reward_module(tmp_path, body)
    ckpt, data = jsonl_run
    run_dir = tmp_path / "run"
    code, out = _cli(_train_args(ckpt, data, run_dir, "--set", f"task.rewards=[{spec}]", "--local-sidecars", "1"))
    assert code == 1 and needle in out and "Traceback" not in out, out
    assert "reward" in out
    assert not run_dir.exists()  # nothing was started: no run directory, no sidecar logs


def test_an_unreachable_sidecar_is_named_before_anything_starts(tmp_path: Path, jsonl_run: tuple[Path, Path]) -> None:
    ckpt, data = jsonl_run
    code, out = _cli(
        _train_args(ckpt, data, tmp_path / "run", "--sidecar", "127.0.0.1:1", "--set", "sidecars.call_timeout_s=2")
    )
    assert code == 1 and "127.0.0.1:1" in out and "not reachable" in out and "Traceback" not in out, out
    assert not (tmp_path / "run").exists()


def test_a_sidecar_serving_another_model_is_a_clear_mismatch(tmp_path: Path, jsonl_run: tuple[Path, Path]) -> None:
    ckpt, data = jsonl_run
    with start_sidecar(_checkpoint(tmp_path / "other", num_hidden_layers=1)) as sidecar:
        code, out = _cli(_train_args(ckpt, data, tmp_path / "run", "--sidecar", sidecar.address))
    assert code == 1 and "different model shape" in out and "Traceback" not in out, out


def test_an_eagle3_draft_is_checked_against_the_model_and_the_sidecars(
    tmp_path: Path, jsonl_run: tuple[Path, Path]
) -> None:
    from sidecar.model.eagle3 import Eagle3Config, build_eagle3
    from sidecar.model.eagle3_checkpoint import load_eagle3_draft, save_eagle3_draft
    from sidecar.model.model import ModelConfig

    _, data = jsonl_run
    ckpt = _checkpoint(tmp_path / "target", num_hidden_layers=4, num_nextn_predict_layers=0)
    target = ModelConfig.tiny(
        vocab_size=128, max_position_embeddings=256, num_hidden_layers=4, num_nextn_predict_layers=0
    )
    draft = tmp_path / "draft"
    save_eagle3_draft(draft, build_eagle3(Eagle3Config.for_target(target, aux_layer_ids=[1, 2, 3]), seed=0))
    load_eagle3_draft(draft, target=target)  # a valid draft for this model
    # a directory that is not a draft, before anything starts
    code, out = _cli(
        _train_args(ckpt, data, tmp_path / "run", "--local-sidecars", "1", "--set", f"draft.eagle3={data}")
    )
    assert code == 1 and "draft.eagle3=" in out and "Traceback" not in out, out
    assert not (tmp_path / "run").exists()
    # a sidecar that serves the model without the draft: the pushes would carry tensors it lacks
    with start_sidecar(ckpt) as sidecar:
        code, out = _cli(
            _train_args(ckpt, data, tmp_path / "run", "--sidecar", sidecar.address, "--set", f"draft.eagle3={draft}")
        )
    assert code == 1 and "serve the run's EAGLE-3 draft there" in out and "Traceback" not in out, out


def test_draft_init_writes_an_eagle3_draft_directory_and_refuses_draft_vocab_for_mtp(tmp_path: Path) -> None:
    from sidecar.model.checkpoint import load_checkpoint
    from sidecar.model.eagle3_checkpoint import load_eagle3_draft

    ckpt = _checkpoint(tmp_path / "target", num_hidden_layers=4, num_nextn_predict_layers=0)
    small = ["--prompts", "8", "--steps", "2", "--batch-size", "4", "--max-new-tokens", "8"]
    args = ["draft-init", "--model", str(ckpt), "--out", str(tmp_path / "draft"), *small]
    code, out = _cli([*args, "--draft-kind", "eagle3", "--draft-vocab-size", "40"])
    assert code == 0 and "wrote" in out, out
    draft = load_eagle3_draft(tmp_path / "draft", target=load_checkpoint(ckpt)[0])
    assert draft.config.draft_vocab_size == 40 and draft.config.aux_layer_ids == [1, 2, 3]
    code, out = _cli([*args, "--draft-kind", "mtp", "--draft-vocab-size", "10"])
    assert code != 0 and "for kind 'eagle3' only" in out and "Traceback" not in out, out
    renamed = {"--draft": "--draft-kind", "--draft-vocab": "--draft-vocab-size"}  # glossary: refused here
    for (old, new), value in zip(renamed.items(), ("mtp", "10"), strict=True):
        code, out = _cli([*args, old, value])
        assert code == 2 and f"is now {new}" in out, out


def test_prompts_plus_new_tokens_must_fit_the_model(tmp_path: Path, jsonl_run: tuple[Path, Path]) -> None:
    ckpt, data = jsonl_run
    code, out = _cli(
        _train_args(ckpt, data, tmp_path / "run", "--local-sidecars", "1", "--set", "rollout.max_new_tokens=4000")
    )
    assert code == 1 and "max_position_embeddings" in out and "rollout.max_new_tokens" in out, out


@pytest.mark.parametrize(
    ("layout", "fix"),
    [
        ("train.data_parallel=2", "set train.data_parallel=1"),
        ("train.tensor_parallel=2", "not a multiple of train.tensor_parallel=2"),
    ],
)
def test_a_process_count_other_than_data_x_tensor_parallel_says_what_to_set(
    tmp_path: Path, jsonl_run: tuple[Path, Path], layout: str, fix: str
) -> None:
    ckpt, data = jsonl_run
    code, out = _cli(_train_args(ckpt, data, tmp_path / "run", "--local-sidecars", "1", "--set", layout))
    assert code == 1 and "1 processes but train.data_parallel=" in out and fix in out and "Traceback" not in out, out
    assert not (tmp_path / "run").exists()


def test_a_reward_function_failing_mid_run_names_its_input() -> None:
    def flaky(prompt: str, completion: str, answer: str) -> float:
        raise KeyError("judge")

    task = DatasetTask.__new__(DatasetTask)
    task.rewards = (Reward(name="flaky", fn=flaky),)
    with pytest.raises(RewardFunctionError, match=r"KeyError.*'1\+1='"):
        task.reward(Problem(prompt="1+1=", answer="2"), "3")


def test_a_local_sidecar_that_cannot_start_is_one_message(tmp_path: Path, jsonl_run: tuple[Path, Path]) -> None:
    """Engine and device reach the local `specrl serve` processes; a failed start is not a traceback."""
    ckpt, data = jsonl_run
    args = _train_args(
        ckpt, data, tmp_path / "run", "--local-sidecars", "1", "--set", "sidecars.devices=[nosuchdevice]"
    )
    code, out = _cli([*args, "--set", "steps=1", "--set", "eval_every=0", "--set", "sidecars.startup_timeout_s=60"])
    assert code == 1 and "SidecarStartError" in out and "Traceback (most recent call last)" not in out.split("log")[0]
    log_text = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("sidecar0.*.log"))
    assert "nosuchdevice" in log_text


def test_merge_overrides_keeps_strings_that_look_like_nothing() -> None:
    assert merge_overrides({}, ["run_dir=on", "tokenizer=no"]) == {"run_dir": "on", "tokenizer": "no"}


def _expected_errors() -> list[Exception]:
    from sidecar.client.fleet import NoLiveSidecarError
    from sidecar.config_io import ConfigError
    from trainer.policy.bridge import CheckpointMismatchError
    from trainer.rl.local_sidecars import SidecarStartError
    from trainer.rl.preflight import PreflightError

    return [
        NoLiveSidecarError("no live sidecar"),
        SidecarStartError("exited"),
        CheckpointMismatchError("shapes"),
        RewardFunctionError("raised"),
        ConfigError("bad key"),
        PreflightError("bad config"),
        WarmupError("no solutions"),
        FileExistsError("run dir taken"),
    ]


@pytest.mark.parametrize("error", _expected_errors(), ids=lambda e: type(e).__name__)
def test_every_expected_error_is_one_cli_message(error: Exception) -> None:
    import click

    from trainer.cli.commands import user_errors

    @click.command()
    def fails() -> None:
        with user_errors():
            raise error

    result = CliRunner().invoke(fails, [])
    assert result.exit_code == 1 and result.output == f"Error: {type(error).__name__}: {error}\n"


def test_a_bug_keeps_its_traceback() -> None:
    from trainer.cli.commands import user_errors

    with pytest.raises(ZeroDivisionError), user_errors():
        _ = 1 / 0


# ---- a model is trained as what it is: its config.json, its tokenizer, its draft, its data -------
def _hf_tokenizer(path: Path, words: list[str]) -> Path:
    """A word-level tokenizer.json (+ its eos) in `path`, as a checkpoint ships it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    fast = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>", *words])}, unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.Whitespace()
    fast.add_special_tokens(["</s>"])
    path.mkdir(parents=True, exist_ok=True)
    fast.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def _preflight(ckpt: Path, data: Path, **overrides: object):  # type: ignore[no-untyped-def]
    from trainer.rl.preflight import preflight

    cfg = resolve_config(None, [f"model={ckpt}", "task.kind=dataset", f"task.path={data}", "sidecars.local=1"])
    return preflight(dataclasses.replace(cfg, **overrides), probe_sidecars=False)  # type: ignore[arg-type]


def test_a_checkpoint_the_engine_does_not_implement_is_refused_before_megatron(
    tmp_path: Path, jsonl_run: tuple[Path, Path]
) -> None:
    import transformers

    _, data = jsonl_run
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    ckpt = tmp_path / "gelu"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=16, hidden_act="gelu")).save_pretrained(
        ckpt
    )
    code, out = _cli(
        _train_args(ckpt, data, tmp_path / "run", "--local-sidecars", "1", "--set", "rollout.speculation_k=0")
    )
    assert code == 1 and "hidden_act" in out and "PreflightError" in out and "Traceback" not in out, out
    assert not (tmp_path / "run").exists()


def test_the_default_tokenizer_is_the_models_own(tmp_path: Path, jsonl_run: tuple[Path, Path]) -> None:
    from trainer.rl.preflight import PreflightError
    from trainer.tokenizer import CharTokenizer, HFTokenizer

    plain, data = jsonl_run
    assert isinstance(_preflight(plain, data).tokenizer, CharTokenizer)  # built for it: no tokenizer files
    own = _hf_tokenizer(_checkpoint(tmp_path / "own"), ["1", "2", "+", "="])
    chosen = _preflight(own, data).tokenizer
    assert isinstance(chosen, HFTokenizer) and chosen.vocab() == HFTokenizer(own).vocab()
    with pytest.raises(PreflightError, match="ships its own tokenizer.json"):
        _preflight(own, data, tokenizer="builtin")
    other = _hf_tokenizer(tmp_path / "other", ["3", "4"])
    with pytest.raises(PreflightError, match="another vocabulary than the model's own"):
        _preflight(own, data, tokenizer=str(other))
    assert isinstance(_preflight(own, data, tokenizer=str(own)).tokenizer, HFTokenizer)  # the same one: fine
    # a model that ships no tokenizer but whose config names an end-of-sequence id of its own
    foreign = _checkpoint(tmp_path / "foreign")
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps(config | {"eos_token_id": 7}))
    with pytest.raises(PreflightError, match="ships no tokenizer.*set tokenizer=PATH"):
        _preflight(foreign, data)
    assert isinstance(_preflight(foreign, data, tokenizer=str(own)).tokenizer, HFTokenizer)


def test_speculating_without_a_draft_is_refused_in_preflight_naming_the_fixes(
    tmp_path: Path, jsonl_run: tuple[Path, Path]
) -> None:
    _, data = jsonl_run
    ckpt = _checkpoint(tmp_path / "plain", num_nextn_predict_layers=0)
    code, out = _cli(_train_args(ckpt, data, tmp_path / "run", "--local-sidecars", "1"))
    assert code == 1 and "rollout.speculation_k=3" in out and "Traceback" not in out, out
    assert "rollout.speculation_k=0" in out and "draft.eagle3=" in out and "draft-init" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": "", "answer": "3"}, "empty prompt: '' is empty"),
        ({"prompt": "1+2=", "answer": "1,000"}, "bad answer: '1,000' is not an integer"),
        ({"prompt": "1+2=", "answer": None}, "bad answer: None is not a string or a number"),
        ({"prompt": "1+2=", "answer": "twenty"}, "bad answer: 'twenty' is not an integer"),
        ({"prompt": "1+2="}, "no column 'answer'"),
        ({"prompt": "9" * 300, "answer": "9"}, "prompts of up to 301 tokens"),
        ({"prompt": "café", "answer": "1"}, "cannot be tokenized"),
    ],
)
def test_every_dataset_row_is_checked_and_named_by_file_and_line(
    tmp_path: Path, jsonl_run: tuple[Path, Path], row: dict[str, object], needle: str
) -> None:
    ckpt, _ = jsonl_run
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)]
    rows.insert(17, row)  # line 18: beyond the 16 problems a sampled check would see
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = _cli(_train_args(ckpt, data, tmp_path / "run", "--local-sidecars", "1"))
    assert code == 1 and needle in out and f"{data}:18" in out and "Traceback" not in out, out
    assert not (tmp_path / "run").exists()


def test_a_user_reward_reads_answers_the_default_reward_refuses(
    tmp_path: Path, jsonl_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    spec = _reward_module(tmp_path, "def score(prompt, completion, answer):\n    return float(answer in completion)\n")
    data = tmp_path / "words.jsonl"
    data.write_text(
        "".join(json.dumps(r) + "\n" for r in [{"prompt": "1+1=", "answer": "two"}, {"prompt": "2=", "answer": 3}])
    )
    with pytest.raises(ValueError, match=f"{data}:1: bad answer: 'two' is not an integer"):
        DatasetTask(path=data)  # the default reward compares integers
    ckpt, _ = jsonl_run
    cfg = resolve_config(None, [f"model={ckpt}", "sidecars.local=1", "task.kind=dataset", f"task.path={data}"])
    prepared = _preflight(ckpt, data, task=dataclasses.replace(cfg.task, rewards=(spec,)))
    assert isinstance(prepared.task, DatasetTask) and prepared.task.where == (f"{data}:1", f"{data}:2")
    assert [p.answer for p in prepared.task.problems] == ["two", "3"]


def test_warmup_and_draft_init_on_inputs_they_cannot_use_end_in_one_error_line(
    tmp_path: Path, jsonl_run: tuple[Path, Path]
) -> None:
    plain = _checkpoint(tmp_path / "plain", num_nextn_predict_layers=0)
    _, data = jsonl_run
    code, out = _cli(["warmup", "--model", str(plain), "--out", str(tmp_path / "w"), "--dataset", str(data)])
    assert code == 1 and "WarmupError" in out and "no reference solutions" in out and "Traceback" not in out, out
    code, out = _cli(["draft-init", "--model", str(plain), "--out", str(tmp_path / "d"), "--dataset", str(tmp_path)])
    assert code == 1 and "--dataset" in out and "Traceback" not in out, out  # a directory that is no saved dataset
    own = _hf_tokenizer(_checkpoint(tmp_path / "own"), ["1"])
    code, out = _cli(["warmup", "--model", str(own), "--out", str(tmp_path / "w"), "--tokenizer", "builtin"])
    assert code == 1 and "--tokenizer='builtin'" in out and "Traceback" not in out, out
    assert not (tmp_path / "w").exists() and not (tmp_path / "d").exists()


def test_a_warmed_checkpoint_keeps_the_tokenizer_it_was_warmed_with(tmp_path: Path) -> None:
    from trainer.tokenizer import HFTokenizer

    own = _hf_tokenizer(_checkpoint(tmp_path / "own", num_hidden_layers=1), [str(d) for d in range(10)])
    args = ["warmup", "--model", str(own), "--out", str(tmp_path / "warm"), "--steps", "1", "--batch-size", "2"]
    code, out = _cli(args)
    assert code == 0, out
    assert HFTokenizer(tmp_path / "warm").vocab() == HFTokenizer(own).vocab()
    assert (tmp_path / "warm" / "tokenizer_config.json").read_text() == (own / "tokenizer_config.json").read_text()


def test_retired_task_keys_name_their_new_spelling() -> None:
    import click

    with pytest.raises(click.ClickException, match="task.reward_fn is now task.rewards"):
        resolve_config(None, ["model=x", "sidecars.local=1", "task.reward_fn=my_rewards:score"])
    with pytest.raises(click.ClickException, match="dataset"):
        resolve_config(None, ["model=x", "sidecars.local=1", "task.kind=jsonl", "task.path=x.jsonl"])


def test_over_long_prompts_are_dropped_and_counted_when_filtering_is_asked_for(
    tmp_path: Path, jsonl_run: tuple[Path, Path]
) -> None:
    from trainer.rl.preflight import PreflightError

    ckpt, _ = jsonl_run
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)] + [{"prompt": "9" * 300, "answer": "9"}]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PreflightError, match=f"{data}:31"):
        _preflight(ckpt, data)
    cfg = resolve_config(None, [f"model={ckpt}", "sidecars.local=1", "task.kind=dataset", f"task.path={data}"])
    prepared = _preflight(ckpt, data, task=dataclasses.replace(cfg.task, filter_rows=True))
    assert isinstance(prepared.task, DatasetTask)
    assert len(prepared.task.problems) == 30 and prepared.task.dropped == {"over-long prompt": 1}
