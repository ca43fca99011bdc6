"""Server configuration: one frozen dataclass, from CLI flags with EMBED_* environment defaults.

Every field ``some_name`` has the flag ``--some-name`` and the variable ``EMBED_SOME_NAME``; a flag
beats a variable, a variable beats the default. ``--model NAME=DIR`` is repeatable; its variable
``EMBED_MODEL`` holds the same pairs separated by commas.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from server.loops import EVENT_LOOPS

LOG_LEVELS = {name: logging.getLevelName(name) for name in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")}

# A model name travels in requests and Prometheus labels and names a Triton-style model: keep it plain.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def setting(default: Any, help: str) -> Any:
    """A ServerConfig field with its description: the one text `--help` and docs/configuration.md's table show."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("0.0.0.0", "gRPC bind address")
    port: int = setting(50051, "gRPC port (0 = any free port)")
    http_host: str = setting("0.0.0.0", "bind address of the HTTP API")
    http_port: int = setting(8080, "HTTP API port (0 = any free port, -1 = off)")
    http_header_timeout_seconds: float = setting(
        10.0,
        "request headers that take longer to arrive get 408 and the connection is closed; a connection to any "
        "port whose handshake (TLS, or gRPC's HTTP/2 preface) takes longer is closed",
    )
    http_body_timeout_seconds: float = setting(10.0, "a request body that takes longer to arrive in full gets 400")
    http_send_timeout_seconds: float = setting(
        10.0,
        "a client that takes none of its answer's bytes for this long has its connection closed (the answer is "
        "dropped); while answers waiting for their clients fill their share of memory, the slowest readers' "
        "connections are closed first",
    )
    auto_truncate: bool = setting(
        True, "HTTP: inputs over the model's max length are cut unless the request says `truncate: false`"
    )
    http_max_inputs: int = setting(
        2048,
        "inputs per `/v1/embeddings` request (OpenAI's limit); more than max_client_batch_size are embedded in "
        "parts of that size, one after another",
    )
    http_cors_origins: str = setting(
        "",
        "browser origins allowed to call the HTTP API (CORS): comma-separated `scheme://host[:port]`, or `*` for "
        "any; empty = none (browsers on other origins are refused by their own same-origin rule)",
    )
    metrics_host: str = setting("0.0.0.0", "bind address of `/metrics`")
    metrics_port: int = setting(9464, "Prometheus `/metrics` port (0 = any free port, -1 = off)")
    model_dir: str = setting(
        "artifacts",
        "folder with `model.onnx`, `tokenizer.json`, `manifest.json`; served under its manifest's `model_id`",
    )
    model: tuple[str, ...] = setting(
        (),
        "`NAME=DIR` or a bare `DIR` (named by its manifest's `model_id`), one per served model, the first the "
        "default; repeatable; when given, `--model-dir` is not used",
    )
    provider: str = setting(
        "auto",
        "`auto` (CUDA when the CUDA provider really loads, else CPU), `cpu`, `cuda` (fail if CUDA does not load)",
    )
    precision: str = setting(
        "fp32",
        "`fp32` (`model.onnx`; on the CPU `model.cpu.onnx` where the folder has it, the same outputs with ONNX "
        "Runtime's fused attention), `int8` (`model.int8.onnx`: faster on the CPU, but a text's embedding moves "
        "slightly with the texts batched beside it), `fp16` "
        "(`model.fp16.onnx`, for CUDA)",
    )
    max_batch_tokens: int = setting(16384, "padded tokens per batch (items x longest item), the most")
    max_batch_seconds: float = setting(
        0.1,
        "per model, `--max-batch-tokens` is lowered at warm-up until one batch runs within this long, and lowered "
        "further while batches run slower than at warm-up (cores shared under a flood), so a short request never "
        "waits long behind a running batch (0 = off)",
    )
    max_batch_size: int = setting(128, "items per batch")
    max_padding_ratio: float = setting(
        0.15, "most of a batch that may be padding; items that would raise it wait for the next batch"
    )
    max_delay_ms: float = setting(0.0, "how long a batch may wait to fill when the backend is idle (0 = leave at once)")
    max_queue_tokens: int = setting(65536, "queued tokens per model beyond which requests get `RESOURCE_EXHAUSTED`")
    max_client_batch_size: int = setting(64, "inputs per request")
    max_input_chars: int = setting(20000, "characters per input, checked before tokenization")
    max_message_bytes: int = setting(4 * 1024 * 1024, "largest gRPC message or HTTP body received, and message sent")
    max_streams: int = setting(64, "`EmbedStream` RPCs open at once; more get `RESOURCE_EXHAUSTED`")
    grpc_bdp_probe: bool = setting(
        False,
        "let gRPC grow its flow-control windows to the link's bandwidth-delay product; off keeps them at HTTP/2's "
        "initial 64 KiB, so a flood of large requests waits on the wire, not in the server's memory (turn on for "
        "large messages over long links)",
    )
    grpc_max_connection_age_seconds: float = setting(
        0.0,
        "a gRPC connection gets GOAWAY after about this long (calls in progress finish on it, within the grace "
        "period if one is set), so a client's channel reconnects and, balancing over DNS, finds replicas added "
        "since (0 = never)",
    )
    grpc_max_connection_age_grace_seconds: float = setting(
        0.0,
        "where a connection age is set: how long calls in progress may go on after GOAWAY before the "
        "connection is closed under them, so a client that stops reading its answers holds its calls' places for "
        "at most the age and this (0 = for as long as the calls last)",
    )
    max_concurrent_rpcs: int = setting(
        512, "calls in progress at once, both protocols together; more get `RESOURCE_EXHAUSTED` before being read"
    )
    memory_limit_mib: int = setting(
        0,
        "the memory limit the budgets derive from: the lower of this and the cgroup's (`memory.max`); 0 = the "
        "cgroup's, else the machine's memory. Peak RSS stays within 75% of it; `--workers N` gives each worker 1/N",
    )
    max_request_bytes: int = setting(
        0,
        "bytes of request bodies received and not yet tokenized; more are refused before parsing. 0 = derived "
        "from the memory limit (what is left of 75% of it once the models are warm, / 3)",
    )
    tls_cert: str = setting("", "PEM certificate chain: serve TLS (with `--tls-key`)")
    tls_key: str = setting("", "PEM private key of `--tls-cert`")
    tls_client_ca: str = setting("", "PEM CA bundle: require client certificates it signed (mutual TLS)")
    auth_token_file: str = setting(
        "", "file holding the bearer token every embedding call must present (an empty file refuses to start)"
    )
    auth_token: str = setting(
        "", "the token itself; prefer the variable or the file (a flag shows in `ps`); set but empty refuses to start"
    )
    drain_delay_seconds: float = setting(
        1.0,
        "on SIGTERM: health `NOT_SERVING` at once, requests served as usual for this long (load balancers move away)",
    )
    grace_seconds: float = setting(10.0, "then new calls are refused and calls in progress get this long to finish")
    health_host: str = setting("0.0.0.0", "bind address of the plaintext health-only port")
    health_port: int = setting(
        -1, "a plaintext port serving only `grpc.health.v1`, for probes when the main port serves TLS (-1 = off)"
    )
    backend_probe_seconds: float = setting(
        1.0, "while the backend is unhealthy (5 failed batches in a row), probe it this often"
    )
    intra_op_threads: int = setting(0, "ONNX Runtime threads per inference (0 = one per physical core)")
    intra_op_spinning: bool = setting(
        False,
        "let ONNX Runtime's threads busy-wait between operators; off leaves the cores to the event loop (single-text "
        "traffic on 2 cores: same or more texts/s for a quarter less CPU per request); turn on where compute dominates",
    )
    one_thread_batch_tokens: int = setting(
        -1,
        "batches of at most this many padded tokens run on a second, one-thread ONNX Runtime session on the CPU, "
        "where the main session's threads (or, on CUDA, each GPU run's fixed cost) cost more than they save "
        "(-1 = the most for which one thread measured no slower at warm-up, 0 = off)",
    )
    inline_batch_ms: float = setting(
        0.5,
        "a batch of one text short enough to run within this long (measured at warm-up), when nothing else is "
        "queued, runs on the event loop instead of the inference thread: at one client the hop there and back "
        "is a large share of a short text's wait (0 = off)",
    )
    idle_poll_us: int = setting(
        200,
        "once no request is in progress, the event loop polls its sockets this long before sleeping, so a lone "
        "client's next request finds it awake: at most this much of one core after each such answer, none under "
        "load (0 = sleep at once)",
    )
    tokenizer_threads: int = setting(2, "threads tokenizing off the event loop")
    workers: int = setting(1, "server processes sharing the port (SO_REUSEPORT); worker i serves metrics on port + i")
    reuse_port: bool = setting(False, "let several processes bind the port (set for each worker by `--workers`)")
    event_loop: str = setting("uvloop", "`uvloop` or `asyncio` (the standard library's)")
    log_level: str = setting(
        "INFO",
        "Python logging level: CRITICAL, ERROR, WARNING, INFO or DEBUG, in any case; lines are `time LEVEL logger: "
        "message` on stderr, uvicorn's too; gRPC's core writes only its errors, in its own format (`GRPC_VERBOSITY`, "
        "ERROR unless set)",
    )

    def __post_init__(self) -> None:
        problems = []
        if self.provider not in ("auto", "cpu", "cuda"):
            problems.append(f"provider must be auto, cpu or cuda, not {self.provider!r}")
        if self.precision not in ("fp32", "int8", "fp16"):
            problems.append(f"precision must be fp32, int8 or fp16, not {self.precision!r}")
        at_least_one = ("max_batch_tokens", "max_batch_size", "max_queue_tokens", "max_client_batch_size",
                        "max_input_chars", "max_message_bytes", "tokenizer_threads")  # fmt: skip
        for name in at_least_one:
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        if self.intra_op_threads < 0:
            problems.append("intra_op_threads must not be negative (0 = one per physical core)")
        if self.log_level.upper() not in LOG_LEVELS:
            problems.append(f"log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        if not 0.0 <= self.max_padding_ratio <= 1.0:
            problems.append("max_padding_ratio must be between 0 and 1")
        if self.max_delay_ms < 0 or self.grace_seconds < 0 or self.drain_delay_seconds < 0:
            problems.append("max_delay_ms, drain_delay_seconds and grace_seconds must not be negative")
        for name in ("grpc_max_connection_age_seconds", "grpc_max_connection_age_grace_seconds"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative")
        if self.grpc_max_connection_age_grace_seconds > 0 and self.grpc_max_connection_age_seconds == 0:
            problems.append("grpc_max_connection_age_grace_seconds needs grpc_max_connection_age_seconds (its age)")
        if self.backend_probe_seconds <= 0:
            problems.append("backend_probe_seconds must be positive")
        if self.max_concurrent_rpcs < 1:
            problems.append("max_concurrent_rpcs must be at least 1")
        if self.max_request_bytes and self.max_request_bytes < self.max_message_bytes:
            problems.append("max_request_bytes must hold at least one largest message (max_message_bytes)")
        if self.http_max_inputs < 1:
            problems.append("http_max_inputs must be at least 1")
        if min(self.http_body_timeout_seconds, self.http_header_timeout_seconds, self.http_send_timeout_seconds) <= 0:
            problems.append(
                "http_header_timeout_seconds, http_body_timeout_seconds and http_send_timeout_seconds must be positive"
            )
        if self.max_batch_seconds < 0 or self.memory_limit_mib < 0 or self.inline_batch_ms < 0:
            problems.append("max_batch_seconds, memory_limit_mib and inline_batch_ms must not be negative")
        for origin in self.cors_origins():
            if origin != "*" and not origin.startswith(("http://", "https://")):
                problems.append(f"http_cors_origins: {origin!r} is not * nor an origin such as https://app.example")
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
        if self.idle_poll_us < 0:
            problems.append("idle_poll_us must not be negative (0 = off)")
        if self.one_thread_batch_tokens < -1:
            problems.append("one_thread_batch_tokens must be -1 (measured), 0 (off) or a number of tokens")
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

    def cors_origins(self) -> tuple[str, ...]:
        return tuple(o.strip().rstrip("/") for o in self.http_cors_origins.split(",") if o.strip())

    @property
    def logging_level(self) -> int:
        return LOG_LEVELS[self.log_level.upper()]

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


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def _from_variable(parser: argparse.ArgumentParser, name: str, text: str, kind: Callable[[str], object]) -> object:
    """A variable's value of its setting's type; else the usage error argparse gives a flag's bad value."""
    try:
        return kind(text)
    except argparse.ArgumentTypeError as e:
        parser.error(f"{name}: {e}")
    except ValueError:
        parser.error(f"{name}: invalid {getattr(kind, '__name__', 'setting')} value: {text!r}")


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
                help=f"{_escaped(f.metadata['help'])} (env {env_name(f.name)}, comma-separated)",
            )
            continue
        kind: Callable[[str], object] = parse_bool if isinstance(f.default, bool) else type(f.default)
        if env_name(f.name) in environ:
            given[f.name] = _from_variable(parser, env_name(f.name), environ[env_name(f.name)], kind)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=argparse.SUPPRESS,
            help=f"{_escaped(f.metadata['help'])} (env {env_name(f.name)}; default {f.default})",
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


CONFIG_TABLE = ("<!-- configuration table: make config-table -->", "<!-- end of table -->")
CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def config_table() -> str:
    """The configuration reference's table, from the fields' own descriptions (as `--help` shows them)."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for f in fields(ServerConfig):
        default = f.default
        if isinstance(default, bool):
            shown = f"`{str(default).lower()}`"
        elif default in ("", ()):
            shown = "none"
        else:
            shown = f"`{default}`"
        rows.append(f"| `--{f.name.replace('_', '-')}` | `{env_name(f.name)}` | {shown} | {f.metadata['help']} |")
    return "\n".join(rows)


def with_config_table(document: str) -> str:
    """The document with the table between its markers replaced by ``config_table()``."""
    start, end = CONFIG_TABLE
    head, found, rest = document.partition(start)
    if not found or end not in rest:
        raise ValueError(f"the document has no {start} ... {end} block")
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{config_table()}\n{end}{tail}"


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Write the configuration table into its document.")
    cli.add_argument("--doc", type=Path, default=CONFIG_DOC)
    path = cli.parse_args().doc
    path.write_text(with_config_table(path.read_text()))
