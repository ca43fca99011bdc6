from server import memory

memory.reexec_with_malloc_settings()  # before gRPC, ONNX Runtime and numpy are loaded

from server.app import main  # noqa: E402

main()
