"""Server configuration: one frozen dataclass, from CLI flags with EMBED_* environment defaults.

Every field ``some_name`` has the flag ``--some-name`` and the variable ``EMBED_SOME_NAME``; a flag
beats a variable, a variable beats the default. ``--model NAME=DIR`` is repeatable; its variable
``EMBED_MODEL`` holds the same pairs separated by commas.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from server.loops import EVENT_LOOPS

# A model name travels in requests and Prometheus labels and names a Triton-style model: keep it plain.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"  # gRPC bind address
    port: int = 50051  # gRPC port; 0 picks a free one (tests)
    http_host: str = "0.0.0.0"  # bind address of the HTTP API (/v1/embeddings)
    http_port: int = 8080  # HTTP API port; 0 picks a free one; -1 turns it off
    http_header_timeout_seconds: float = 10.0  # request headers that take longer to arrive get 408, connection closed
    http_body_timeout_seconds: float = 10.0  # a request body that takes longer to arrive gets 400
    auto_truncate: bool = True  # HTTP: inputs over the model's max length are cut unless a request says truncate=false
    metrics_host: str = "0.0.0.0"  # bind address of the Prometheus /metrics endpoint
    metrics_port: int = 9464  # 0 picks a free one; -1 turns the endpoint off
    model_dir: str = "artifacts"  # folder with model.onnx, tokenizer.json and manifest.json
    # NAME=DIR pairs (or a bare DIR: named by its manifest's model_id), one per served model, the first the
    # default; when given, model_dir is not used. Empty: one model from model_dir, named by its model_id.
    model: tuple[str, ...] = ()
    provider: str = "auto"  # auto (CUDA when it really loads, else CPU) | cpu | cuda
    precision: str = "fp32"  # fp32 (model.onnx) | int8 (model.int8.onnx) | fp16 (model.fp16.onnx, CUDA)
    max_batch_tokens: int = 16384  # padded tokens per batch: items x longest item (the most; see max_batch_seconds)
    # Per model, max_batch_tokens is lowered at warm-up until one batch runs within this long, so a short
    # request never waits long behind a batch in the backend; 0 keeps max_batch_tokens as it is.
    max_batch_seconds: float = 0.1
    max_batch_size: int = 128  # items per batch
    max_padding_ratio: float = 0.15  # most of a batch that may be padding; longer/shorter items wait
    max_delay_ms: float = 0.0  # how long a batch may wait to fill while the backend is idle
    max_queue_tokens: int = 65536  # queued real tokens beyond which requests are refused (RESOURCE_EXHAUSTED)
    max_client_batch_size: int = 64  # inputs per request
    max_input_chars: int = 20000  # characters per input, checked before tokenization
    max_message_bytes: int = 4 * 1024 * 1024  # largest gRPC message received or sent
    max_streams: int = 64  # EmbedStream RPCs open at once; more get RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int = 512  # calls in progress at once; more get RESOURCE_EXHAUSTED before being read
    # The memory budgets derive from the cgroup's memory.max; without one, from this (MiB); 0: the machine's.
    memory_limit_mib: int = 0
    # Bytes of request bodies received and not yet tokenized; more are refused before parsing. 0: derived
    # from the memory limit (what is left of 75% of it once the models are warm, / 3).
    max_request_bytes: int = 0
    tls_cert: str = ""  # PEM certificate chain: serve TLS (with tls_key)
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates it signed (mutual TLS)
    auth_token_file: str = ""  # file holding the bearer token Embedder calls must present
    auth_token: str = ""  # the token itself; prefer EMBED_AUTH_TOKEN or the file (a flag shows in `ps`)
    drain_delay_seconds: float = 1.0  # on SIGTERM: keep serving (health NOT_SERVING) while load balancers stop sending
    grace_seconds: float = 10.0  # then: gRPC refuses new calls and in-flight ones get this long to finish
    health_host: str = "0.0.0.0"  # bind address of the plaintext health-only port
    health_port: int = -1  # plaintext grpc.health.v1 only, for probes when --tls-cert is set; -1 = off
    backend_probe_seconds: float = 1.0  # while the backend is unhealthy, probe it this often
    intra_op_threads: int = 0  # ONNX Runtime threads per inference; 0 = one per physical core
    # ONNX Runtime's threads spin after each op waiting for the next; off, they sleep and leave the cores to
    # the event loop (single-text traffic on 2 cores: same or more texts/s for a quarter less CPU per request,
    # docs/benchmarks.md). On for models where compute dominates.
    intra_op_spinning: bool = False
    tokenizer_threads: int = 2  # threads tokenizing off the event loop
    workers: int = 1  # server processes sharing the port (SO_REUSEPORT); see server/workers.py
    reuse_port: bool = False  # let several processes bind the port; set for workers by --workers
    event_loop: str = "uvloop"  # uvloop | asyncio (server/loops.py)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        problems = []
        if self.provider not in ("auto", "cpu", "cuda"):
            problems.append(f"provider must be auto, cpu or cuda, not {self.provider!r}")
        if self.precision not in ("fp32", "int8", "fp16"):
            problems.append(f"precision must be fp32, int8 or fp16, not {self.precision!r}")
        for name in ("max_batch_tokens", "max_batch_size", "max_queue_tokens", "max_client_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        if not 0.0 <= self.max_padding_ratio <= 1.0:
            problems.append("max_padding_ratio must be between 0 and 1")
        if self.max_delay_ms < 0 or self.grace_seconds < 0 or self.drain_delay_seconds < 0:
            problems.append("max_delay_ms, drain_delay_seconds and grace_seconds must not be negative")
        if self.backend_probe_seconds <= 0:
            problems.append("backend_probe_seconds must be positive")
        if self.max_concurrent_rpcs < 1:
            problems.append("max_concurrent_rpcs must be at least 1")
        if self.max_request_bytes and self.max_request_bytes < self.max_message_bytes:
            problems.append("max_request_bytes must hold at least one largest message (max_message_bytes)")
        if self.http_body_timeout_seconds <= 0 or self.http_header_timeout_seconds <= 0:
            problems.append("http_header_timeout_seconds and http_body_timeout_seconds must be positive")
        if self.max_batch_seconds < 0 or self.memory_limit_mib < 0:
            problems.append("max_batch_seconds and memory_limit_mib must not be negative")
        if self.auth_token and not self.auth_token.strip():
            problems.append("auth_token is blank: give a real token or none")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            problems.append("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.event_loop not in EVENT_LOOPS:
            problems.append(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, not {self.event_loop!r}")
        if self.workers < 1:
            problems.append("workers must be at least 1")
        if self.max_streams < 1:
            problems.append("max_streams must be at least 1")
        problems.extend(_model_problems(self.model))
        if problems:
            raise ValueError("; ".join(problems))

    def model_dirs(self) -> list[tuple[str | None, str]]:
        """(name, folder) per served model, the default first; name None: the manifest's model_id."""
        if not self.model:
            return [(None, self.model_dir)]
        pairs = (pair.partition("=") for pair in self.model)
        return [(name, folder) if sep else (None, name) for name, sep, folder in pairs]

    def bearer_token(self) -> str:
        """The token callers must present, or "" when auth is off. Raises ValueError for an empty file."""
        if self.auth_token_file:
            token = Path(self.auth_token_file).read_text().strip()
            if not token:
                # An empty secret mount must not silently turn authentication off.
                raise ValueError(f"auth_token_file {self.auth_token_file} is empty: refusing to serve without a token")
            return token
        return self.auth_token.strip()

    @property
    def max_delay_seconds(self) -> float:
        return self.max_delay_ms / 1000.0


def _model_problems(pairs: tuple[str, ...]) -> list[str]:
    problems, names = [], set()
    for pair in pairs:
        name, sep, folder = pair.partition("=")
        if not sep:
            if not name:
                problems.append("--model takes NAME=DIR or DIR, not an empty string")
            continue  # a bare folder: named by its manifest, checked for clashes once loaded
        if not folder:
            problems.append(f"--model takes NAME=DIR or DIR, not {pair!r}")
        elif not MODEL_NAME.fullmatch(name):
            problems.append(f"model name {name!r}: letters, digits, '_', '.', '-', at most 64, starting alnum")
        elif name in names:
            problems.append(f"model name {name!r} given twice")
        names.add(name)
    return problems


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def env_name(field_name: str) -> str:
    return "EMBED_" + field_name.upper()


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="python -m server", description="Serve text embeddings over gRPC and HTTP.")
    given: dict[str, object] = {}  # what the operator set, by variable or flag; the rest keeps its default
    for f in fields(ServerConfig):
        if isinstance(f.default, tuple):  # repeatable: --model a=x --model b=y, or EMBED_MODEL=a=x,b=y
            if env_name(f.name) in environ:
                given[f.name] = tuple(p.strip() for p in environ[env_name(f.name)].split(",") if p.strip())
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                action="append",
                default=argparse.SUPPRESS,
                help=f"repeatable (env {env_name(f.name)}, comma-separated)",
            )
            continue
        kind: Callable[[str], object] = parse_bool if isinstance(f.default, bool) else type(f.default)
        if env_name(f.name) in environ:
            given[f.name] = kind(environ[env_name(f.name)])
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=argparse.SUPPRESS,
            help=f"(env {env_name(f.name)}; default {f.default})",
        )
    flags = vars(parser.parse_args(argv))
    given.update({name: tuple(v) if isinstance(v, list) else v for name, v in flags.items()})
    if "auth_token" in given and not str(given["auth_token"]).strip():
        # Set but empty (an empty secret): that is a broken deployment, not a request to turn auth off.
        parser.error(f"--auth-token / {env_name('auth_token')} is set but empty: refusing to serve without a token")
    try:
        return ServerConfig(**given)  # type: ignore[arg-type]
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
