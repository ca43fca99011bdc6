"""TLS, mutual TLS and the bearer token, with certificates made here by `cryptography`."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import tritonclient.grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from client import EmbeddingClient, Security
from embedding.v1 import embedding_pb2, embedding_pb2_grpc
from loadtest.run import free_port, wait_serving
from tests.conftest import LOG_LINE, ROOT, ServerThread, counter, serve_exits, server_config


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_name: str, issuer_key, ca: bool = False, server: bool = False):  # type: ignore[no-untyped-def]
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> str:  # type: ignore[no-untyped-def]
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key, server_key, client_key, stranger_key = (_key() for _ in range(5))
    ca = _cert("test CA", ca_key, "test CA", ca_key, ca=True)
    rogue = _cert("rogue CA", rogue_key, "rogue CA", rogue_key, ca=True)
    return {
        "ca": _write(d / "ca.pem", cert=ca),
        "server_cert": _write(d / "server.pem", cert=_cert("server", server_key, "test CA", ca_key, server=True)),
        "server_key": _write(d / "server.key", key=server_key),
        "client_cert": _write(d / "client.pem", cert=_cert("client", client_key, "test CA", ca_key)),
        "client_key": _write(d / "client.key", key=client_key),
        "stranger_cert": _write(d / "stranger.pem", cert=_cert("stranger", stranger_key, "rogue CA", rogue_key)),
        "stranger_key": _write(d / "stranger.key", key=stranger_key),
        "rogue_ca": _write(d / "rogue.pem", cert=rogue),
    }


def refused(client: EmbeddingClient) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        client.embed(["hello"])
    return error.value.code()


def test_tls_serves_tls_clients_and_refuses_plaintext(tiny_artifacts: Path, pki: dict[str, str]) -> None:
    server = ServerThread(server_config(tiny_artifacts, tls_cert=pki["server_cert"], tls_key=pki["server_key"]))
    try:
        with EmbeddingClient(server.target, 5, Security(tls_ca=pki["ca"])) as client:
            assert len(client.embed(["over TLS"]).embeddings) == 1
        with EmbeddingClient(server.target, 5) as plaintext:
            assert refused(plaintext) == grpc.StatusCode.UNAVAILABLE
        with EmbeddingClient(server.target, 5, Security(tls_ca=pki["rogue_ca"])) as wrong_trust:
            assert refused(wrong_trust) == grpc.StatusCode.UNAVAILABLE  # the server's cert is not trusted
        # The HTTP port speaks TLS with the same files.
        https = f"https://127.0.0.1:{server.server.http_port}/v1/embeddings"
        answer = httpx.post(https, json={"input": "over TLS"}, verify=ssl.create_default_context(cafile=pki["ca"]))
        assert answer.status_code == 200 and len(answer.json()["data"]) == 1
        with pytest.raises(httpx.TransportError):
            httpx.post(https.replace("https", "http", 1), json={"input": "plaintext"})
        with pytest.raises(httpx.ConnectError):  # the server's cert is not trusted
            httpx.post(https, json={"input": "x"}, verify=ssl.create_default_context(cafile=pki["rogue_ca"]))
    finally:
        server.stop()


@pytest.mark.parametrize("tls", [True, False])
def test_a_client_that_connects_and_never_handshakes_is_closed_after_the_header_timeout(
    tiny_artifacts: Path, pki: dict[str, str], tls: bool
) -> None:
    """Without a bound of the server's, asyncio waits 60 s for a TLS hello on the HTTP port, and gRPC 60 s for
    HTTP/2's preface and 120 s for a TLS handshake on its port: a silent client held its connection that long."""
    files = {"tls_cert": pki["server_cert"], "tls_key": pki["server_key"]} if tls else {}
    config = server_config(tiny_artifacts, http_header_timeout_seconds=0.5, health_port=0, **files)  # type: ignore[arg-type]
    server = ServerThread(config)
    try:
        for port in (server.server.http_port, server.server.port, server.server.health_port):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
                started = time.monotonic()
                while silent.recv(4096):  # gRPC's own settings frame, in plaintext; then the close
                    pass
                assert time.monotonic() - started < 10, port  # recv times out (fails) at 30 s
        security = Security(tls_ca=pki["ca"]) if tls else Security()
        with EmbeddingClient(server.target, 5, security) as client:  # a client that handshakes is served
            assert len(client.embed(["handshaken"]).embeddings) == 1
    finally:
        server.stop()


def test_failed_tls_handshakes_leave_the_log_in_the_servers_format(tiny_artifacts: Path, pki: dict[str, str]) -> None:
    """gRPC's core logged each failed handshake at INFO in a format of its own: one line per plaintext call."""
    port, health_port = free_port(), free_port()
    flags = ["--model-dir", str(tiny_artifacts), "--port", str(port), "--health-port", str(health_port)]
    flags += ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"], "--http-port", "-1"]
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    process = subprocess.Popen(
        [sys.executable, "-m", "server", *flags, "--metrics-port", "-1", "--drain-delay-seconds", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_serving(f"127.0.0.1:{health_port}", process=process)
        for _ in range(3):
            with EmbeddingClient(f"127.0.0.1:{port}", 5) as plaintext:
                assert refused(plaintext) == grpc.StatusCode.UNAVAILABLE
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    log = process.stdout.read() if process.stdout else ""
    assert "stopped:" in log and "Handshake failed" not in log, log[-2000:]
    assert all(LOG_LINE.match(line) for line in log.splitlines()), log[-2000:]


def test_mutual_tls_refuses_clients_without_a_cert_from_the_client_ca(
    tiny_artifacts: Path, pki: dict[str, str]
) -> None:
    config = server_config(
        tiny_artifacts, tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"]
    )
    server = ServerThread(config)
    try:
        good = Security(tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
        with EmbeddingClient(server.target, 5, good) as client:
            assert len(client.embed(["mutual"]).embeddings) == 1
        with EmbeddingClient(server.target, 5, Security(tls_ca=pki["ca"])) as no_cert:
            assert refused(no_cert) == grpc.StatusCode.UNAVAILABLE
        stranger = Security(tls_ca=pki["ca"], tls_cert=pki["stranger_cert"], tls_key=pki["stranger_key"])
        with EmbeddingClient(server.target, 5, stranger) as unknown:
            assert refused(unknown) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_bearer_token_guards_embedder_but_not_health(tiny_artifacts: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    server = ServerThread(server_config(tiny_artifacts, auth_token_file=str(token_file)))
    metrics = server.server.metrics
    try:
        batches_before = counter(metrics.batches)
        for security in (Security(), Security(token="wrong")):
            with EmbeddingClient(server.target, 5, security) as client:
                with pytest.raises(grpc.RpcError) as error:
                    client.embed(["no entry"])
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as error:
                    client.info()
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub = server.stub()
        with pytest.raises(grpc.RpcError) as error:
            list(stub.EmbedStream(iter([]), metadata=[("authorization", "Bearer nope")]))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert counter(metrics.batches) == batches_before  # refused calls cost no inference
        assert counter(metrics.rejections, "unauthenticated") == 5
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        with EmbeddingClient(server.target, 5, Security(token="s3cret-token")) as client:
            assert len(client.embed(["welcome"]).embeddings) == 1
        # The Open Inference Protocol is guarded by the same token.
        with tritonclient.grpc.InferenceServerClient(server.target) as triton:
            with pytest.raises(InferenceServerException) as refused:
                triton.get_model_metadata("wordnet-encoder")
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
            metadata = triton.get_model_metadata("wordnet-encoder", headers={"authorization": "Bearer s3cret-token"})
            assert metadata.name == "wordnet-encoder"
    finally:
        server.stop()


def test_with_tls_a_plaintext_health_port_answers_probes_and_serves_nothing_else(
    tiny_artifacts: Path, pki: dict[str, str]
) -> None:
    config = server_config(tiny_artifacts, tls_cert=pki["server_cert"], tls_key=pki["server_key"], health_port=0)
    server = ServerThread(config)
    plaintext = grpc.insecure_channel(f"127.0.0.1:{server.server.health_port}")
    try:
        assert server.server.health_port not in (0, server.port)
        health = health_pb2_grpc.HealthStub(plaintext)  # what a Kubernetes gRPC probe does: no TLS
        for service in ("", "embedding.v1.Embedder"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:  # the health port carries no data plane
            embedding_pb2_grpc.EmbedderStub(plaintext).Embed(embedding_pb2.EmbedRequest(inputs=["x"]), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with EmbeddingClient(server.target, 5) as no_tls:  # the main port still refuses plaintext
            assert refused(no_tls) == grpc.StatusCode.UNAVAILABLE
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        server.call(server.server.health.enter_graceful_shutdown())  # what a drain does first
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        plaintext.close()
        server.stop()


def test_without_a_health_port_none_is_opened(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts))
    try:
        assert server.server.health_server is None and server.server.health_port == 0
    finally:
        server.stop()


def test_tls_files_that_cannot_serve_stop_the_server_with_the_setting_named(pki: dict[str, str]) -> None:
    """A wrong file in a TLS setting: one line naming it and exit 2, before anything listens. gRPC's core
    would only log the cause and refuse the port."""
    readme = str(ROOT / "README.md")
    server = ["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"]]
    cases = [
        (["--tls-cert", readme, "--tls-key", readme], "(--tls-cert, --tls-key) are not a PEM certificate chain"),
        ([*server[:2], "--tls-key", pki["client_key"]], "are not a PEM certificate chain and its private key"),
        ([*server, "--tls-client-ca", readme], f"TLS: {readme} (--tls-client-ca) is not a PEM CA bundle"),
        (["--tls-cert", "/nonexistent.pem", *server[2:]], "TLS: /nonexistent.pem (--tls-cert) is not a file"),
    ]
    for args, message in cases:
        code, output = serve_exits(args, {})
        assert code == 2 and message in output, output[-2000:]
        assert "Traceback" not in output and "cannot listen" not in output and "gRPC on" not in output, output[-2000:]
