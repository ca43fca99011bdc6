"""Optional transport security: TLS / mutual TLS credentials and a bearer-token check.

Both are off by default. The token check guards the Embedder and Open Inference Protocol services;
health and reflection stay open so that probes and tools work without the secret. A refused call
never reaches the servicer, so it costs no tokenization and no inference.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from server.core.errors import Unauthenticated


def check_tls_files(cert: str, key: str, client_ca: str = "") -> None:
    """ValueError naming the setting when a file is not what it should be: gRPC's core would only log it and
    refuse the port, and uvicorn would fail later with an SSL error."""
    for path, setting in ((cert, "--tls-cert"), (key, "--tls-key"), (client_ca, "--tls-client-ca")):
        if path and not Path(path).is_file():
            raise FileNotFoundError(f"TLS: {path} ({setting}) is not a file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(
            f"TLS: {cert} and {key} (--tls-cert, --tls-key) are not a PEM certificate chain and its private key "
            f"({e.reason or e})"
        ) from e
    if client_ca:
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as e:
            raise ValueError(f"TLS: {client_ca} (--tls-client-ca) is not a PEM CA bundle ({e.reason or e})") from e


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS with the server's certificate and key; with client_ca, clients must present a cert it signed."""
    check_tls_files(cert, key, client_ca)
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())], root_certificates=ca, require_client_auth=ca is not None
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        token: str,
        protected_prefixes: tuple[str, ...],  # method paths that need the token, e.g. "/embedding.v1.Embedder/"
        status_for: Callable[[Unauthenticated], grpc.StatusCode],
        on_reject: Callable[[str], None],  # called with the refused method's name, e.g. "Embed"
    ) -> None:
        self._expected = f"Bearer {token}".encode()
        self._prefixes = protected_prefixes
        self._status_for = status_for
        self._on_reject = on_reject

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)  # constant time: no timing oracle
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if not handler_call_details.method.startswith(self._prefixes) or self._authorized(
            handler_call_details.invocation_metadata
        ):
            return handler
        self._on_reject(handler_call_details.method.rsplit("/", 1)[-1])
        error = Unauthenticated("missing or invalid bearer token (metadata 'authorization: Bearer <token>')")
        code = self._status_for(error)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, str(error))

        if handler is None:
            return handler
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
