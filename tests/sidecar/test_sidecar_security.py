"""TLS, mutual TLS and the bearer token, with certificates made at test time by the openssl
CLI (no key is checked in)."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.security import TOKEN_ENV, SecurityConfig
from sidecar.server.process import SidecarConfig
from tests.sidecar_fixtures import DEADLINE, greedy_oracle, greedy_request, start_sidecar, weights

pytestmark = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates"),
    pytest.mark.usefixtures("single_torch_thread"),
]
Code = grpc.StatusCode


def test_tls_round_trip_and_plaintext_is_refused(pki: Path, checkpoint: Path) -> None:
    security = SecurityConfig(cert=pki / "server.pem", key=pki / "server.key")
    with start_sidecar(checkpoint, security=security) as sc:
        with SidecarClient(sc.address, ClientConfig(security=SecurityConfig(peer_ca=pki / "ca.pem"), retries=0)) as c:
            assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle()
            assert c.info().engine.engine == "torch"
        with SidecarClient(sc.address, ClientConfig(retries=0, timeout_s=3)) as plain:
            with pytest.raises(SidecarCallError) as err:
                plain.info()
            assert err.value.code == Code.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate(pki: Path, checkpoint: Path) -> None:
    security = SecurityConfig(cert=pki / "server.pem", key=pki / "server.key", peer_ca=pki / "ca.pem")
    with start_sidecar(checkpoint, security=security) as sc:
        mtls = ClientConfig(
            security=SecurityConfig(peer_ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key")
        )
        with SidecarClient(sc.address, mtls) as c:
            assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle()
            assert c.push_weights(weights(1), 1).version == 1
        with SidecarClient(
            sc.address, ClientConfig(security=SecurityConfig(peer_ca=pki / "ca.pem"), retries=0, timeout_s=3)
        ) as anonymous:
            with pytest.raises(SidecarCallError) as err:
                anonymous.info()
            assert err.value.code == Code.UNAVAILABLE  # the TLS handshake fails


def test_the_token_is_required_on_every_rpc_but_health(checkpoint: Path) -> None:
    with start_sidecar(checkpoint, token="s3cret") as sc:
        for token, expect in ((None, "missing bearer token"), ("wrong", "wrong bearer token")):
            with SidecarClient(sc.address, ClientConfig(token=token)) as c:
                calls = [
                    c.info,
                    c.stats,
                    c.describe_weights,
                    lambda c=c: c.generate(greedy_request()),
                    lambda c=c: c.push_weights(weights(1), 1),
                    lambda c=c: c.abort("x"),
                    c.pause,
                    lambda c=c: c.set_speculation(1),
                ]
                for call in calls:
                    with pytest.raises(SidecarCallError) as err:
                        call()
                    assert err.value.code == Code.UNAUTHENTICATED and expect in err.value.details
                assert c.health()  # probes carry no token: health stays open
        with SidecarClient(sc.address, ClientConfig(token="s3cret")) as c:
            assert c.info().weight_version == 0  # the refused push changed nothing
            assert not c.info().paused
            assert [s.token_ids for s in c.generate(greedy_request())] == greedy_oracle()
            assert c.push_weights(weights(1), 1).version == 1


def test_health_is_open_without_a_token_and_reflection_is_not(checkpoint: Path) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with (
        start_sidecar(checkpoint, token="s3cret") as sc,
        grpc.insecure_channel(sc.address) as ch,
    ):
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=DEADLINE
                )
            )
        assert err.value.code() == Code.UNAUTHENTICATED


def test_security_config_checks_its_fields(pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cert and key go together"):
        SecurityConfig(cert=pki / "server.pem")
    with pytest.raises(ValueError, match=r"security.peer_ca \(mutual TLS.*needs TLS"):
        SidecarConfig(security=SecurityConfig(peer_ca=pki / "ca.pem"))
    with pytest.raises(ValueError, match="security.tls is a client setting"):
        SidecarConfig(security=SecurityConfig(tls=True))
    with pytest.raises(ValueError, match="whitespace"):
        SidecarConfig(token="a b")
    with pytest.raises(ValueError, match=r"where.peer_ca: .*absent is not a readable file"):
        SecurityConfig(peer_ca=tmp_path / "absent").check_files("where")
    # the token: given, else the file's first line, else $SPECRL_TOKEN; never in a repr
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    (tmp_path / "token").write_text("from-file\nignored\n")
    assert SecurityConfig().read_token() == "from-env"
    assert SecurityConfig(token_file=tmp_path / "token").read_token() == "from-file"
    assert SecurityConfig().read_token("given") == "given"
    with pytest.raises(ValueError, match="not both"):
        SecurityConfig(token_file=tmp_path / "token").read_token("given")
    assert "s3cret" not in repr(ClientConfig(token="s3cret")) + repr(SidecarConfig(token="s3cret"))


def test_a_client_reads_its_token_file_when_it_is_created(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    with start_sidecar(checkpoint, token="s3cret") as sc:
        config = ClientConfig(security=SecurityConfig(token_file=tmp_path / "token"), retries=0)
        with SidecarClient(sc.address, config) as c:
            assert c.info().weight_version == 0
