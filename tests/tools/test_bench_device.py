"""The benchmarks' `--device`: a device they cannot run on is refused up front, with what to pass
instead, before any model is built (tools/bench/common.py `device_problem`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tools.bench import adaptive as bench_adaptive
from tools.bench.common import device_problem


def test_cpu_is_fine_and_a_non_device_or_unsupported_kind_is_refused() -> None:
    assert device_problem("cpu") is None
    assert "not a torch device" in (device_problem("gpu") or "")
    assert "cpu or cuda only" in (device_problem("meta") or "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_cuda_without_a_gpu_is_refused_before_the_model_is_built(tmp_path: Path, capsys) -> None:
    assert "--device cpu" in (device_problem("cuda") or "")
    model = tmp_path / "model"
    with pytest.raises(SystemExit) as exc:
        bench_adaptive.main(["--device", "cuda", "--model", str(model)])
    assert exc.value.code == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert not model.exists()  # nothing built or written
