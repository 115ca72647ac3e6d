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
                f"  {'':>14} power: {p['rule']} in {p['fraction']:.0%} of rounds -> rejected in {p['rejected']} of "
                f"{p['runs']} simulated runs ({'detected' if p['detected'] else 'NOT detected'}; mean max TV "
                f"{p['max_tv']:.3f}, joint p {', '.join(f'{v:.1e}' for v in p['joint_p_values'])})"
            )
    lines += [
        "",
        "  What this proves: a correct sidecar fails each check with probability at most alpha (exact",
        "  p-values); the wrong-rule variants marked detected above are caught in at least the stated",
        "  share of simulated runs of the same size, on these weights, k, sampling settings and prompts.",
        "  Greedy outputs and log-probs were compared exactly. It is a finite-sample test: a smaller",
        "  deviation, or one that only shows on other prompts or longer outputs, can pass.",
    ]
    return "\n".join(lines)
