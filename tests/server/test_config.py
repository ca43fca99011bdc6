from __future__ import annotations

import logging
import socket
from dataclasses import fields
from pathlib import Path

import pytest

from server.config import ServerConfig, parse_config
from tests.conftest import serve_exits


def test_defaults_follow_the_design_contract() -> None:
    config = parse_config([], environ={})
    assert config.port == 50051 and config.metrics_port == 9464
    assert config.provider == "auto" and config.model_dir == "artifacts"


def test_flags_beat_environment_which_beats_defaults() -> None:
    environ = {"EMBED_PORT": "6000", "EMBED_MAX_BATCH_TOKENS": "999", "EMBED_MAX_DELAY_MS": "2.5"}
    config = parse_config(["--port", "7000"], environ=environ)
    assert config.port == 7000
    assert config.max_batch_tokens == 999
    assert config.max_delay_ms == 2.5 and config.max_delay_seconds == 0.0025


def test_invalid_values_are_refused_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--provider", "tpu"], environ={})
    assert "provider must be auto, cpu or cuda" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_batch_size must be at least 1"):
        ServerConfig(max_batch_size=0)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--tokenizer-threads", "0"], "tokenizer_threads must be at least 1"),
        (["--max-input-chars", "0"], "max_input_chars must be at least 1"),
        (["--max-message-bytes", "0"], "max_message_bytes must be at least 1"),
        (["--intra-op-threads", "-2"], "intra_op_threads must not be negative"),
        (["--grpc-max-connection-age-seconds", "-1"], "grpc_max_connection_age_seconds must not be negative"),
        (
            ["--grpc-max-connection-age-seconds", "1", "--grpc-max-connection-age-grace-seconds", "-1"],
            "grpc_max_connection_age_grace_seconds must not be negative",
        ),
        (
            ["--grpc-max-connection-age-grace-seconds", "30"],
            "grpc_max_connection_age_grace_seconds needs grpc_max_connection_age_seconds (its age)",
        ),
        (["--log-level", "LOUD"], "log_level must be one of CRITICAL, ERROR, WARNING, INFO, DEBUG, not 'LOUD'"),
    ],
)
def test_settings_that_could_not_serve_are_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(flags, environ={})
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_the_log_level_is_read_in_any_case() -> None:
    assert parse_config(["--log-level", "debug"], environ={}).logging_level == logging.DEBUG
    assert parse_config([], environ={"EMBED_LOG_LEVEL": "Warning"}).logging_level == logging.WARNING


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("EMBED_MAX_BATCH_SIZE", "abc", "EMBED_MAX_BATCH_SIZE: invalid int value: 'abc'"),
        ("EMBED_MAX_DELAY_MS", "1ms", "EMBED_MAX_DELAY_MS: invalid float value: '1ms'"),
        ("EMBED_AUTO_TRUNCATE", "maybe", "EMBED_AUTO_TRUNCATE: not a boolean: 'maybe'"),
    ],
)
def test_a_variable_of_the_wrong_type_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], variable: str, value: str, said: str
) -> None:
    """As argparse refuses a flag's bad value: a usage error (exit 2) naming the variable, no traceback."""
    with pytest.raises(SystemExit) as exited:
        parse_config([], environ={variable: value})
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_models_are_named_pairs_from_flags_or_one_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config(["--model-dir", "x"], environ={}).model_dirs() == [(None, "x")]  # named by its manifest
    pairs = parse_config(["--model", "small=a", "--model", "big=b/c"], environ={"EMBED_MODEL": "other=z"})
    assert pairs.model_dirs() == [("small", "a"), ("big", "b/c")]  # flags beat the variable, order kept
    assert parse_config([], environ={"EMBED_MODEL": "small=a, big=b"}).model_dirs() == [("small", "a"), ("big", "b")]
    bare = parse_config(["--model", "artifacts", "--model", "mini=artifacts/minilm"], environ={})
    assert bare.model_dirs() == [(None, "artifacts"), ("mini", "artifacts/minilm")]  # a bare DIR: its manifest's id
    for bad, message in (
        (["--model", "small="], "--model takes NAME=DIR or DIR"),
        (["--model", "a/b=x"], "model name 'a/b'"),
        (["--model", "m=x", "--model", "m=y"], "model name 'm' given twice"),
    ):
        with pytest.raises(SystemExit):
            parse_config(bad, environ={})
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("what", "flag"),
    [
        ("gRPC", "--port"),
        ("HTTP", "--http-port"),
        ("metrics", "--metrics-port"),
        ("the health service", "--health-port"),
    ],
)
def test_a_port_in_use_is_refused_with_the_setting_that_names_it(what: str, flag: str) -> None:
    """`python -m server`: one line naming the port and its setting, exit 2, no traceback."""
    hosts = [f"--{name}host" for name in ("", "http-", "metrics-", "health-")]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [x for host in hosts for x in (host, "127.0.0.1")] + ["--health-port", "0", flag, str(port)]
        code, output = serve_exits(args, {})
    assert code == 2, output[-2000:]
    assert f"cannot listen for {what} on 127.0.0.1:{port} ({flag}, EMBED_" in output, output[-2000:]
    assert "Traceback" not in output and "Exception ignored" not in output, output[-2000:]
    assert "loading model" not in output  # refused before anything else ran


def test_a_port_that_cannot_be_bound_leaves_nothing_listening(tmp_path: Path) -> None:
    """In-process: the gRPC port bound before the HTTP port failed is free again once start() raises."""
    import asyncio

    from server.app import CannotListen, EmbeddingServer
    from tests.conftest import server_config

    async def start_with_busy_http() -> int:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            server = EmbeddingServer(server_config(tmp_path, http_port=busy.getsockname()[1], metrics_port=-1))
            with pytest.raises(CannotListen, match=r"cannot listen for HTTP on 127\.0\.0\.1:\d+ \(--http-port"):
                await server.start()
            return server.port

    grpc_port = asyncio.run(start_with_busy_http())
    assert grpc_port > 0
    with socket.socket() as again:  # gRPC listens with SO_REUSEPORT; a socket without it binds only a free port
        again.bind(("127.0.0.1", grpc_port))


@pytest.mark.parametrize(("http_port", "metrics_port"), [(0, 0), (-1, -1)])
def test_the_start_line_names_each_port_as_bound_or_says_it_is_off(
    tmp_path: Path, http_port: int, metrics_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from server.app import EmbeddingServer
    from tests.conftest import server_config

    async def started() -> EmbeddingServer:
        server = EmbeddingServer(server_config(tmp_path, http_port=http_port, metrics_port=metrics_port))
        await server.start()
        await server.stop(0)
        return server

    with caplog.at_level(logging.INFO, logger="server"):
        server = asyncio.run(started())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().endswith("loading model"))
    assert f"gRPC on 127.0.0.1:{server.port}," in line and server.port > 0
    if http_port < 0:
        assert "HTTP off, metrics off," in line
    else:
        assert f"HTTP on 127.0.0.1:{server.http_port}, metrics on 127.0.0.1:{server.metrics_port}," in line
        assert server.http_port > 0 and server.metrics_port > 0


def test_cuda_asked_for_where_it_does_not_load_stops_the_server_with_exit_2(tiny_artifacts: Path) -> None:
    from server.backend.ort import OnnxRuntime, ProviderUnavailable, RuntimeOptions

    try:
        OnnxRuntime(tiny_artifacts, RuntimeOptions(provider="cuda"), pad_id=0)
        pytest.skip("the CUDA execution provider loads here: the refusal needs a machine where it does not")
    except ProviderUnavailable:
        pass
    args = ["--model-dir", str(tiny_artifacts), "--provider", "cuda", "--drain-delay-seconds", "0"]
    code, output = serve_exits(args, {})
    assert code == 2, output[-2000:]
    assert "--provider cuda asked, but the CUDA execution provider did not load" in output
    assert "Traceback" not in output, output[-2000:]


@pytest.mark.parametrize("content", ["", "  \n\t\n"], ids=["empty", "whitespace"])
def test_an_empty_token_file_refuses_to_start(tmp_path: Path, content: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)  # an empty secret mount
    code, output = serve_exits(["--auth-token-file", str(token_file)], {})
    assert code != 0
    assert f"auth_token_file {token_file} is empty: refusing to serve without a token" in output
    assert "gRPC on" not in output  # it never started listening


@pytest.mark.parametrize("value", ["", "   "], ids=["empty", "blank"])
def test_an_empty_token_variable_or_flag_refuses_to_start(value: str) -> None:
    code, output = serve_exits([], {"EMBED_AUTH_TOKEN": value})
    assert code != 0 and "set but empty: refusing to serve without a token" in output
    code, output = serve_exits(["--auth-token", value], {})
    assert code != 0 and "set but empty: refusing to serve without a token" in output
    with pytest.raises(ValueError, match="auth_token is blank"):
        ServerConfig(auth_token="  ")


def test_intra_op_spinning_reaches_the_onnx_runtime_session(tiny_artifacts: Path) -> None:
    from server.loading import load_model

    for flag, expected in (("false", "0"), ("true", "1")):
        config = parse_config(
            ["--model-dir", str(tiny_artifacts), "--provider", "cpu", "--intra-op-spinning", flag], environ={}
        )
        options = load_model(config.model_dir, config).runtime.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == expected
    assert ServerConfig().intra_op_spinning is False  # the default: leave the cores to the event loop


@pytest.mark.parametrize(
    ("args", "loop"), [([], "uvloop"), (["--event-loop", "asyncio"], "asyncio"), (["--event-loop", "uvloop"], "uvloop")]
)
def test_the_server_runs_on_the_event_loop_it_is_given_uvloop_by_default(args: list[str], loop: str) -> None:
    """The startup log names the loop really running, before the (missing) model stops the server."""
    code, output = serve_exits(args, {})
    assert code == 2 and f"event loop {loop}; loading model" in output, output[-2000:]


def test_an_unknown_event_loop_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--event-loop", "trio"], environ={})
    assert "event_loop must be one of uvloop, asyncio, not 'trio'" in capsys.readouterr().err


def test_the_configuration_table_is_the_one_the_settings_describe() -> None:
    """docs/configuration.md's table is generated from the fields' descriptions: rerun `make config-table` after
    changing a setting, or this fails."""
    from server.config import CONFIG_DOC, CONFIG_TABLE, config_table, with_config_table

    document = CONFIG_DOC.read_text()
    assert with_config_table(document) == document
    table = document.split(CONFIG_TABLE[0])[1].split(CONFIG_TABLE[1])[0]
    assert table.strip() == config_table()
    assert table.count("\n| `--") == len(fields(ServerConfig))  # one row per setting


def test_help_shows_each_settings_own_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--help"], environ={})
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in fields(ServerConfig):
        assert f.metadata["help"], f.name
        assert " ".join(f.metadata["help"].split()) in shown, f.name
