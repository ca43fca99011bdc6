import os

# gRPC's core logs at INFO, in its own format, each connection whose TLS handshake fails (a plaintext client or a
# port scanner at the TLS port: 9,681 lines a minute under a stream of them); its errors still show. An operator's
# own GRPC_VERBOSITY wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from server import memory

memory.reexec_with_malloc_settings()  # before gRPC, ONNX Runtime and numpy are loaded

from server.app import main  # noqa: E402

main()
