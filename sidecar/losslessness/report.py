"""A certificate as text for people and as JSON for machines (the same facts in both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sidecar.losslessness.certificate import Certificate


def certificate_to_json(cert: Certificate) -> dict[str, Any]:
    """Plain JSON-able dict: verdict, exit status, what was tested, every check's evidence."""
    return {
        "verdict": cert.verdict.value,
        "exit_status": cert.exit_status,
        "sidecar": cert.sidecar,
        "engine": cert.engine,
        "weight_version": cert.weight_version,
        "checksums": cert.checksums,
        "prompts": cert.prompts,
        "config": cert.config,
        "seconds": cert.seconds,
        "checks": [
            {"name": c.name, "verdict": c.verdict.value, "summary": c.summary, "details": c.details}
            for c in cert.checks
        ],
    }


def write_json(cert: Certificate, path: Path) -> None:
    path.write_text(json.dumps(certificate_to_json(cert), indent=2) + "\n")


def format_certificate(cert: Certificate) -> str:
    """The human-readable report."""
    e = cert.engine
    lines = [
        f"specrl losslessness certificate for {cert.sidecar}: {cert.verdict.value.upper()}",
        f"  engine {e['engine']} {e['engine_version']} on {e['device']}, model {e['model']!r} "
        f"(vocab {e['vocab_size']}, {e['num_mtp_layers']} MTP layers), weight version {cert.weight_version}",
        f"  k {cert.config['ks']}, temperatures {cert.config['temperatures']}, top-p {cert.config['top_p']}, "
        f"top-k {cert.config['top_k']}, alpha {cert.config['alpha']}, {len(cert.prompts)} prompts "
        f"(token ids in the JSON), {cert.seconds:.0f} s",
        "",
    ]
    for c in cert.checks:
        lines.append(f"  [{c.verdict.value:>12}] {c.name}: {c.summary}")
        for p in c.details.get("power", []):
            lines.append(
                f"  {'':>14} power: {p['rule']} in {p['fraction']:.0%} of rounds -> "
                f"{'rejected' if p['rejected'] else 'NOT rejected'} (joint p {p['joint_p_value']:.1e}, "
                f"min per-position p {p['min_position_p_value']:.1e}, max TV {p['max_tv']:.3f})"
            )
    lines += [
        "",
        "  What this proves: on these weights, k, sampling settings and prompts, no deviation from the",
        "  target distribution as large as the rejected wrong-rule variants above went undetected (alpha",
        "  per check); greedy outputs and log-probs were compared exactly. It is a finite-sample test: a",
        "  smaller deviation, or one that only shows on other prompts or longer outputs, can pass.",
    ]
    return "\n".join(lines)
