"""`specrl verify`: certify that a running sidecar's speculative decoding is lossless.

Prints the certificate (see `certificate.py` for what each check does), optionally writes it
as JSON, and exits with the verdict's status: 0 pass, 1 fail, 3 underpowered; 2 is a usage
error (click's) and 4 means no certificate could be made (sidecar unreachable, bad --model).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


class CannotVerify(click.ClickException):
    """No certificate could be made: exit status 4, apart from a failed certificate's 1."""

    exit_code = 4


def _floats(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers, e.g. 0,0.7,1.0") from None


def _ints(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers, e.g. 1,3") from None


def _prompts(path: Path) -> list[list[int]]:
    import json

    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)
        except json.JSONDecodeError as e:
            raise click.BadParameter(f"{path}:{n}: not JSON ({e}); write one list of token ids per line") from None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise click.BadParameter(f"{path}:{n}: expected a non-empty list of token ids, e.g. [12, 5, 7]")
        prompts.append(ids)
    if not prompts:
        raise click.BadParameter(f"{path} holds no prompts; write one JSON list of token ids per line")
    return prompts


@click.command()
@click.option("--sidecar", "address", required=True, help="HOST:PORT of the sidecar to certify.")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="The checkpoint the sidecar serves (proven by CRC-32); without it only the greedy comparison runs.",
)
@click.option(
    "--draft",
    "draft_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="The EAGLE-3 draft directory the sidecar serves beside --model (for the power simulation).",
)
@click.option("--k", "ks", default=None, help="Draft lengths to certify, e.g. 1,3 (default: the sidecar's k).")
@click.option("--temperature", "temperatures", default="0,1.0", show_default=True, help="0: greedy check.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True)
@click.option("--samples", type=click.IntRange(1), default=500, show_default=True, help="Samples per prompt.")
@click.option("--prompts", "num_prompts", type=click.IntRange(1), default=4, show_default=True)
@click.option(
    "--prompts-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSON lines of token-id prompts (default: prompts drawn from the target itself).",
)
@click.option(
    "--first-token",
    type=click.IntRange(0),
    default=None,
    help="Drawn prompts start with this id (your tokenizer's BOS: in-distribution prompts); default random.",
)
@click.option("--prompt-length", type=click.IntRange(1), default=6, show_default=True, help="Tokens per drawn prompt.")
@click.option("--tokens", "sample_tokens", type=click.IntRange(1), default=None, help="Tokens per sample (2k+3).")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=1e-3, show_default=True)
@click.option("--logprob-tolerance", type=click.FloatRange(0), default=1e-4, show_default=True)
@click.option("--power-fractions", default="1,0.5,0.25", show_default=True, help="Wrong rules in these fractions.")
@click.option(
    "--power-runs",
    type=click.IntRange(1),
    default=5,
    show_default=True,
    help="Simulated runs per wrong rule and fraction; detected = rejected in >= 80% of them.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--token", default=None, help="Bearer token (or --token-file / $SPECRL_TOKEN).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option(
    "--tls/--no-tls", default=False, show_default=True, help="TLS verified by the system roots (implied by --peer-ca)."
)
@click.option(
    "--peer-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="PEM CA bundle of the sidecar's certificate (turns TLS on).",
)
@click.option(
    "--cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="PEM certificate to present for mutual TLS (with --key).",
)
@click.option(
    "--key", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None, help="Key of --cert."
)
def verify(
    address: str,
    model_dir: Path | None,
    draft_dir: Path | None,
    ks: str | None,
    temperatures: str,
    top_p: float,
    top_k: int,
    samples: int,
    num_prompts: int,
    prompts_file: Path | None,
    first_token: int | None,
    prompt_length: int,
    sample_tokens: int | None,
    alpha: float,
    logprob_tolerance: float,
    power_fractions: str,
    power_runs: int,
    seed: int,
    json_out: Path | None,
    token: str | None,
    token_file: Path | None,
    tls: bool,
    peer_ca: Path | None,
    cert: Path | None,
    key: Path | None,
) -> None:
    """Certify that a sidecar's speculative decoding is lossless (greedy, distribution, log-probs, weights)."""
    import grpc

    from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
    from sidecar.errors import SpecrlError
    from sidecar.losslessness.certificate import VerifyConfig, verify_sidecar
    from sidecar.losslessness.exact_target import load_model
    from sidecar.losslessness.report import format_certificate, write_json
    from sidecar.security import SecurityConfig

    try:
        config = VerifyConfig(
            ks=_ints(ks) if ks else None,
            temperatures=_floats(temperatures),
            top_p=top_p,
            top_k=top_k,
            prompts=_prompts(prompts_file) if prompts_file else None,
            num_prompts=num_prompts,
            first_token=first_token,
            prompt_length=prompt_length,
            samples_per_prompt=samples,
            sample_tokens=sample_tokens,
            alpha=alpha,
            logprob_tolerance=logprob_tolerance,
            power_fractions=_floats(power_fractions),
            power_runs=power_runs,
            seed=seed,
        )
        security = SecurityConfig(token_file=token_file, cert=cert, key=key, peer_ca=peer_ca, tls=tls)
        client_config = ClientConfig(security=security, token=security.read_token(token))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    model = None
    if model_dir is not None:
        try:
            model = load_model(model_dir)
        except (SpecrlError, FileNotFoundError, ValueError) as e:
            raise CannotVerify(f"cannot load --model {model_dir}: {e}") from None
    draft = None
    if draft_dir is not None:
        from sidecar.model.eagle3_checkpoint import load_eagle3_draft

        if model is None:
            raise click.UsageError("--draft needs --model (the target it drafts for)")
        try:
            draft = load_eagle3_draft(draft_dir, target=model.config)
        except SpecrlError as e:
            raise CannotVerify(f"cannot load --draft {draft_dir}: {e}") from None

    def progress(line: str) -> None:
        click.echo(line, err=True)

    with SidecarClient(address, client_config) as client:
        try:
            certificate = verify_sidecar(client, model, config, progress, draft)
        except SidecarCallError as e:
            hint = f"; is a sidecar serving on {address}?" if e.code == grpc.StatusCode.UNAVAILABLE else ""
            raise CannotVerify(f"{e}{hint}") from None
    click.echo(format_certificate(certificate))
    if json_out is not None:
        write_json(certificate, json_out)
        click.echo(f"certificate written to {json_out}", err=True)
    sys.exit(certificate.exit_status)
