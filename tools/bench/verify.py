#!/usr/bin/env python3
"""Does `specrl verify` pass a correct sidecar and fail a wrong one, over many seeds?

The certificate (`verify_sidecar`, what `specrl verify` runs) against a sidecar served in this
process — the engine `specrl serve` would build for `--model` (its defaults: k = 3, max k 8,
batch 64), behind the real gRPC server and client — once per seed, the seed choosing the
prompts (drawn from the target) and every random stream. `--rule` serves an engine whose
acceptance rule is wrong (`sidecar.losslessness.wrong_rules.WRONG_RULES`, in `--fraction` of the
rounds) instead. `--no-power` skips the certificate's power simulation (its verdict is then at
best "underpowered"; the distribution test's own pass/fail is what is counted). Prints one line
per seed (with its wall and CPU seconds: the CPU of this process, so the verifier's and the
in-process sidecar's together) and the verdict counts; `--json` keeps every certificate.

    OMP_NUM_THREADS=1 specrl bench verify --model DEMO/policy --seeds 0-19 --k 0 --tokens 9
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path
from typing import Any

import torch

from sidecar.client.client import SidecarClient
from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.certificate import VerifyConfig, verify_sidecar
from sidecar.losslessness.cli import _prompts
from sidecar.losslessness.exact_target import load_model
from sidecar.losslessness.report import certificate_to_json
from sidecar.losslessness.wrong_rules import WRONG_RULES, in_fraction_of_rounds, with_acceptance_rule
from sidecar.serve_config import ServeConfig
from sidecar.server.grpc_server import ServerConfig
from sidecar.server.process import Sidecar, SidecarConfig


def seeds(text: str) -> list[int]:
    """ "0-19" or "1,4,9"."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the checkpoint to serve and certify")
    parser.add_argument("--seeds", type=seeds, default=seeds("0-19"))
    parser.add_argument("--k", type=int, default=None, help="draft length to certify (default: the sidecar's, 3)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per sample (default: 2k + 3)")
    parser.add_argument("--samples", type=int, default=VerifyConfig().samples_per_prompt)
    parser.add_argument("--power-runs", type=int, default=VerifyConfig().power_runs)
    parser.add_argument("--no-power", action="store_true", help="skip the power simulation")
    parser.add_argument("--rule", choices=sorted(WRONG_RULES), default=None, help="serve this wrong acceptance rule")
    parser.add_argument("--fraction", type=float, default=1.0, help="of the rounds the wrong rule is applied in")
    parser.add_argument("--prompts-file", type=Path, default=None, help="as specrl verify's (default: drawn)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model)
    engine = TorchEngine(load_model(args.model), ServeConfig().engine)  # a sidecar's defaults
    if args.rule:
        engine = with_acceptance_rule(engine, in_fraction_of_rounds(WRONG_RULES[args.rule], args.fraction, seed=1))
    verdicts: collections.Counter[str] = collections.Counter()
    failed_distribution = 0
    kept: list[dict[str, Any]] = []
    with Sidecar(engine, SidecarConfig(server=ServerConfig(port=0))) as sidecar, SidecarClient(sidecar.address) as c:
        for seed in args.seeds:
            config = VerifyConfig(
                ks=(args.k,) if args.k is not None else None,
                prompts=_prompts(args.prompts_file) if args.prompts_file else None,
                samples_per_prompt=args.samples,
                sample_tokens=args.tokens,
                power_runs=args.power_runs,
                wrong_rules=() if args.no_power else VerifyConfig().wrong_rules,
                seed=seed,
            )
            started, cpu_started = time.perf_counter(), time.process_time()
            cert = verify_sidecar(c, model, config)
            seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
            verdicts[cert.verdict.value] += 1
            parts = []
            for check in cert.checks:
                if check.name.startswith("distribution"):
                    d = check.details
                    failed_distribution += check.verdict.value == "fail"
                    parts.append(
                        f"{check.name}: {check.verdict.value}, joint p {d.get('joint_p_value', 1.0):.2e}, min "
                        f"position p {d.get('min_position_p_value', 1.0):.2e}, max TV {d.get('max_tv', 0):.3f} "
                        f"(noise {d.get('max_tv_noise', 0):.3f}), acceptance {d['acceptance_rate']:.2f}"
                    )
                    for p in d.get("power", []):
                        parts.append(
                            f"  power {p['rule']} {p['fraction']:.0%}: {p['rejected']}/{p['runs']} "
                            f"(mean max TV {p['max_tv']:.3f})"
                        )
                elif check.verdict.value != "pass":
                    parts.append(f"{check.name}: {check.verdict.value}: {check.summary}")
            print(
                f"seed {seed}: {cert.verdict.value.upper()} ({seconds:.0f} s wall, {cpu_seconds:.0f} s CPU); "
                + "; ".join(parts),
                flush=True,
            )
            kept.append(certificate_to_json(cert))
    print(
        f"{len(args.seeds)} seeds: "
        + ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items()))
        + f"; distribution check failed in {failed_distribution}",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(kept, indent=1) + "\n")


if __name__ == "__main__":
    main()
