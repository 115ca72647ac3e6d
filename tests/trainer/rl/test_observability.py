"""Seeing a run while it runs: TensorBoard and W&B (offline) receive every logged row, read back
through each library's own file format; plots (per-position acceptance, generation share,
speedups) are redrawn as the run goes, so an interrupted run keeps them; the slow phases say so.
"""

from __future__ import annotations

import contextlib
import glob
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.rl.loop_fakes import TOK, FakeFleet, RecordingPolicy, RuleTask
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig
from trainer.rl.run_dir import RunDir, plot_metrics
from trainer.rl.trackers import TrackersConfig, open_trackers

ROWS = [{"reward/train_mean": 0.25 * i, "spec/accept_pos0": 0.9, "nan": float("nan")} for i in range(3)]


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """History rows of an offline W&B run, decoded with wandb's own protobuf schema from its
    record log (LevelDB log framing: 32 KiB blocks of [crc32c u32, length u16, type u8] records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if length == 0 and kind == 0:  # block padding
            pos += left - 7
            continue
        buf += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST fragment
            records.append(buf)
            buf = b""
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_tensorboard_and_offline_wandb_receive_every_row(tmp_path: Path) -> None:
    cfg = TrackersConfig(tensorboard=True, wandb=True)
    run_dir = RunDir(tmp_path, trackers=open_trackers(cfg, tmp_path, {"steps": 3}))
    for step, row in enumerate(ROWS):
        run_dir.log(step, row)
    run_dir.close()
    assert len(run_dir.read_metrics()) == 3  # metrics.jsonl stays
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["reward/train_mean"] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert "nan" not in scalars
    history = _wandb_history(tmp_path)
    assert [(r["_step"], r["reward/train_mean"]) for r in history] == [(0, 0), (1, 0.25), (2, 0.5)]
    assert all("nan" not in r for r in history)


def test_a_missing_tracker_package_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from trainer.rl.trackers import check_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    (problem,) = check_trackers(TrackersConfig(wandb=True, tensorboard=True))
    assert "trackers.wandb" in problem and "specrl[track]" in problem


def test_plots_show_per_position_acceptance_generation_share_and_speedups(tmp_path: Path) -> None:
    rows = [
        {
            "step": s,
            "spec/accept_pos0": 0.9,
            "spec/accept_pos1": 0.7,
            "spec/accept_pos2": 0.5,
            "time/generation_share": 0.6,
            "speedup/generation": 1.5,
            "speedup/step": 1.2,
        }
        for s in range(1, 4)
    ]
    names = {p.name for p in plot_metrics(rows, tmp_path)}
    assert names == {"acceptance_per_position.png", "generation_share.png", "speedup.png"}


@contextlib.contextmanager
def _fake_fleet(fleet: FakeFleet) -> Iterator[tuple[FakeFleet, None]]:
    yield fleet, None


def test_an_interrupted_run_keeps_its_plots_rows_and_tracker_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The loop's own `train` with an in-memory fleet that is interrupted (Ctrl-C) in step 3."""
    from trainer.rl import loop as rl_loop
    from trainer.rl import run_setup
    from trainer.rl.preflight import Prepared

    fleet = FakeFleet(fail_on_call=4)  # eval, step 1, step 2, then step 3's generation
    cfg = RLConfig(
        model=Path("unused"),
        rollout=RolloutConfig(prompts_per_step=3, samples_per_prompt=2, max_new_tokens=4, refill_rounds=0),
        sidecars=SidecarsConfig(addresses=["fake:1"]),
        steps=5,
        eval_every=5,
        eval_size=4,
        run_dir=tmp_path / "run",
        trackers=TrackersConfig(tensorboard=True),
    )
    monkeypatch.setattr(
        rl_loop, "preflight", lambda c, **kw: Prepared(model_config=None, tokenizer=TOK, task=RuleTask())
    )  # type: ignore[arg-type]
    monkeypatch.setattr(run_setup, "check_sidecars", lambda c, m: None)
    monkeypatch.setattr(rl_loop, "build_policy", lambda c: RecordingPolicy())
    monkeypatch.setattr(rl_loop, "sidecar_fleet", lambda c, root: _fake_fleet(fleet))
    with pytest.raises(KeyboardInterrupt):
        rl_loop.train(cfg, progress=True)
    run = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert {"reward.png", "step_time.png", "generation_share.png"} <= {p.name for p in (run / "plots").iterdir()}
    assert [s for s, _ in _tensorboard_scalars(run / "tensorboard")["reward/train_mean"]] == [1, 2]
    err = capsys.readouterr().err
    for phase in ("connecting to 1 sidecar", "first weight push", "evaluating on 4 held-out problems"):
        assert f"{phase}" in err and "done in" in err, err
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/eval_stderr" in row
