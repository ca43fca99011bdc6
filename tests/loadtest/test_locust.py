"""A short real Locust run (the same command `make loadtest` runs) against a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loadtest.run import free_port, run_locust
from tests.conftest import ServerThread, server_config

ROOT = Path(__file__).resolve().parents[2]


def summary(reports: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((reports / "loadtest_summary.json").read_text())


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m loadtest.run` (what `make loadtest` runs), with these variables added to the environment."""
    return subprocess.run(
        [sys.executable, "-m", "loadtest.run", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_short_locust_run_exercises_every_task_without_failures(tiny_artifacts: Path, tmp_path: Path) -> None:
    done = run(
        "--model-dir",
        str(tiny_artifacts),
        "--users",
        "4",
        "--spawn-rate",
        "4",
        "--duration",
        "5s",
        "--reports",
        str(tmp_path),
        "--model-infer",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tasks = summary(tmp_path)["tasks"]
    log = done.stdout[-3000:] + done.stderr[-6000:]  # Locust's own account, should a task be missing
    for task in ("Embed 1 short", "Embed 8 mixed", "Embed 2 long", "EmbedStream 5x2", "ModelInfer 4 mixed"):
        assert task in tasks and tasks[task]["requests"] > 0 and tasks[task]["failures"] == 0, (task, tasks, log)
    # response sizes are reported: 8 embeddings of 32 floats outweigh 1
    assert tasks["Embed 8 mixed"]["avg_response_bytes"] > 4 * tasks["Embed 1 short"]["avg_response_bytes"] > 0
    assert (tmp_path / "loadtest.html").stat().st_size > 1000
    assert (tmp_path / "loadtest_stats.csv").is_file()


def test_failed_calls_show_as_failures_and_fail_the_run(tmp_path: Path) -> None:
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there: every call is UNAVAILABLE
    done = run("--target", nobody, "--users", "2", "--spawn-rate", "2", "--duration", "2s", "--reports", str(tmp_path))
    assert done.returncode != 0
    result = summary(tmp_path)
    assert result["total"]["failures"] == result["total"]["requests"] > 0
    assert all(error.startswith("UNAVAILABLE: ") for error in result["errors"]), result["errors"]
    assert "ModelInfer 4 mixed" not in result["tasks"]  # optional: off unless --model-infer


def test_the_http_user_runs_beside_the_grpc_user(tiny_artifacts: Path, tmp_path: Path) -> None:
    done = run(
        *("--model-dir", str(tiny_artifacts), "--users", "4", "--spawn-rate", "4", "--duration", "5s"),
        *("--reports", str(tmp_path), "--protocol", "both"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tasks = summary(tmp_path)["tasks"]
    for task in ("POST /v1/embeddings 1 short", "POST /v1/embeddings 8 mixed", "Embed 1 short"):
        assert tasks[task]["requests"] > 0 and tasks[task]["failures"] == 0, task


def test_a_start_up_slower_than_the_run_time_still_runs_for_the_run_time(tmp_path: Path) -> None:
    """On a loaded machine Locust's start-up (imports, the text pool) can outlast --run-time; the run must still
    last its run time, not end as it begins."""
    locustfile = tmp_path / "slow_start.py"
    locustfile.write_text(
        "import gevent\n"
        "from gevent.monkey import get_original\n"
        "gevent.get_hub()\n"
        "get_original('time', 'sleep')(3)  # blocks the hub, as a starved start-up does\n"
        "from loadtest.locustfile import EmbeddingUser\n"
    )
    nobody = f"127.0.0.1:{free_port()}"  # every call fails at once: the run's length is Locust's alone
    run_locust(nobody, users=2, spawn_rate=2, duration="2s", reports=tmp_path, locustfile=locustfile)
    result = summary(tmp_path)
    assert result["total"]["requests"] > 0
    assert result["seconds"] > 1.5, result["seconds"]


def test_both_users_present_the_bearer_token_a_protected_server_asks_for(tiny_artifacts: Path, tmp_path: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, auth_token="s3cret"))
    try:
        http = f"http://127.0.0.1:{server.server.http_port}"
        done = run(
            *("--target", server.target, "--http-target", http, "--protocol", "both", "--model-infer"),
            *("--users", "4", "--spawn-rate", "4", "--duration", "4s", "--reports", str(tmp_path)),
            env={"EMBED_AUTH_TOKEN": "s3cret"},
        )
    finally:
        server.stop()
    result = summary(tmp_path)
    assert done.returncode == 0 and result["total"]["failures"] == 0, (result["errors"], done.stderr[-3000:])
    for task in ("Embed 1 short", "EmbedStream 5x2", "ModelInfer 4 mixed", "POST /v1/embeddings 1 short"):
        assert result["tasks"][task]["requests"] > 0, (task, result["tasks"])
