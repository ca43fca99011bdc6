"""`loadtest.run.local_server`, which the benchmark and the subprocess tests start servers with."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from embedding.v1 import embedding_pb2_grpc
from loadtest import run
from tests.conftest import ServerThread, request, server_config


def test_a_local_server_is_its_own_process_not_whoever_answers_on_its_port(
    tiny_artifacts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port free_port chose can be taken before the server binds it. Another server answering SERVING there
    must not pass for ours: local_server waits for its own process, which cannot listen there and exits 2,
    then starts again on other ports."""
    other = ServerThread(server_config(tiny_artifacts))
    try:
        handed = [other.port]  # the first port local_server is handed is the other server's
        real_free_port = run.free_port
        monkeypatch.setattr(run, "free_port", lambda: handed.pop() if handed else real_free_port())
        with run.local_server(str(tiny_artifacts)) as server:
            port = int(server.target.rsplit(":", 1)[1])
            assert port != other.port and not handed
            assert run.listens_on(server.process.pid, port) and not run.listens_on(server.process.pid, other.port)
            with grpc.insecure_channel(server.target) as channel:
                assert len(embedding_pb2_grpc.EmbedderStub(channel).Embed(request("ours"), timeout=30).embeddings) == 1
        assert server.process.returncode == 0
    finally:
        other.stop()


def test_a_server_that_exits_before_serving_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(run.ServerExited) as exited, run.local_server(str(tmp_path / "no-model-here")):
        pass
    assert exited.value.code == 2  # missing artifacts: the configuration cannot run here


def test_make_loadtest_without_a_model_says_so_and_exits_with_the_servers_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run.main(["--model-dir", str(tmp_path / "no-model-here"), "--reports", str(tmp_path / "reports")])
    assert code == 2
    err = capsys.readouterr().err
    assert "loadtest: the server exited with code 2 before it served" in err and "Traceback" not in err


def test_waiting_for_workers_names_the_ones_that_never_loaded() -> None:
    try:
        run.wait_workers_loaded(run.free_port(), 2, timeout=0.5)
    except TimeoutError as e:
        assert "workers [0, 1] not ready" in str(e)
    else:
        raise AssertionError("no worker answers on those ports, yet the wait returned")
