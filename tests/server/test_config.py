from __future__ import annotations

import pytest

from server.config import ServerConfig, parse_config


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
