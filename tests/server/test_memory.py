"""The memory limit, the budgets derived from it, and requests refused before their body is read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from embedding.v1 import embedding_pb2
from server.memory import (
    MEMORY_PER_BODY_BYTE,
    MIB,
    TARGET_SHARE,
    UNACCOUNTED_SHARE,
    UNSENT_SHARE,
    jemalloc_installed,
    memory_limit,
    plan,
)
from tests.conftest import ServerThread, eventually, request, server_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_lower_of_the_cgroup_limit_and_the_flag_wins_then_the_machine(tmp_path: Path) -> None:
    cgroup = tmp_path / "memory.max"
    cgroup.write_text("1073741824\n")
    assert memory_limit(0, cgroup) == (1 << 30, f"cgroup {cgroup}")
    assert memory_limit(4096, cgroup) == (1 << 30, f"cgroup {cgroup}")  # never more than the container has
    assert memory_limit(512, cgroup) == (512 * MIB, "--memory-limit-mib")  # a worker's share of it
    cgroup.write_text("max\n")  # no limit set on the cgroup
    assert memory_limit(512, cgroup) == (512 * MIB, "--memory-limit-mib")
    bytes_, source = memory_limit(0, tmp_path / "absent")
    assert source == "physical memory" and bytes_ > 0


def test_the_byte_budget_is_what_the_target_leaves_once_the_models_are_warm() -> None:
    limit = (1024 * MIB, "--memory-limit-mib")
    made = plan(limit, models_bytes=368 * MIB, max_message_bytes=4 * MIB)
    unsent = int(1024 * MIB * UNSENT_SHARE)  # HTTP answers not yet taken by their clients: 25.6 MiB
    left = int(1024 * MIB * TARGET_SHARE) - int(1024 * MIB * UNACCOUNTED_SHARE) - unsent - 368 * MIB  # 323.2 MiB
    assert left < 350 * MIB  # the reserve and the answers' share are kept back
    assert made.request_bytes == left // MEMORY_PER_BODY_BYTE and made.unsent_bytes == unsent
    assert made.request_calls == made.request_bytes // (4 * MIB)  # every body counted as the largest message
    assert plan(limit, 368 * MIB, 4 * MIB, override_bytes=64 * MIB).request_bytes == 64 * MIB
    with pytest.raises(ValueError, match=r"leaves 0 MiB for requests once the models take 700 MiB"):
        plan(limit, models_bytes=700 * MIB, max_message_bytes=4 * MIB)


def test_a_limit_too_small_for_the_models_refuses_to_start_with_a_clear_message(tiny_artifacts: Path) -> None:
    flags = ["--port", "0", "--http-port", "-1", "--metrics-port", "-1", "--model-dir", str(tiny_artifacts)]
    flags += ["--memory-limit-mib", "64"]
    done = subprocess.run(
        [sys.executable, "-m", "server", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "memory limit 64 MiB (--memory-limit-mib) leaves 0 MiB for requests" in done.stderr


@pytest.mark.skipif(
    not jemalloc_installed(), reason="libjemalloc2 is not installed (scripts/system-packages.sh installs it as root)"
)
@pytest.mark.parametrize(("asked", "mapped"), [(None, "jemalloc"), ("glibc", "glibc")])
def test_the_server_runs_on_jemalloc_where_it_is_installed_unless_told_glibc(asked: str | None, mapped: str) -> None:
    """The allocator the server logs is read from its own memory map: what really loaded."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "EMBED_ALLOCATOR")}
    if asked:
        env["EMBED_ALLOCATOR"] = asked
    flags = ["--port", "0", "--http-port", "-1", "--metrics-port", "-1", "--model-dir", "/nonexistent"]
    done = subprocess.run(
        [sys.executable, "-m", "server", *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert f"allocator: {mapped}\n" in done.stderr


def test_info_states_the_budgets_chosen(tiny_artifacts: Path) -> None:
    server = ServerThread(server_config(tiny_artifacts, memory_limit_mib=2048, max_batch_seconds=0.0))
    try:
        info = server.stub().Info(embedding_pb2.InfoRequest(), timeout=10)
        assert info.memory_limit_bytes == 2048 * MIB and info.memory_limit_source == "--memory-limit-mib"
        assert info.max_request_bytes == server.server.admission.max_bytes > 4 * MIB
        assert info.max_request_calls == info.max_request_bytes // (4 * MIB)
        assert info.max_concurrent_rpcs == 512
        assert info.models[0].max_batch_tokens == info.max_batch_tokens == 16384  # not lowered: seconds 0
    finally:
        server.stop()


def test_a_call_is_refused_before_its_body_is_read_when_the_calls_in_progress_are_full(tiny_artifacts: Path) -> None:
    """Embed is admitted by its connection before gRPC reads its message: refused, the body is never parsed."""
    # A byte budget of two largest messages: two calls may read or tokenize a body at once.
    server = ServerThread(server_config(tiny_artifacts, max_request_bytes=8 * MIB, max_message_bytes=4 * MIB))
    admission = server.server.admission
    received: list[int] = []
    real_receive = admission.receive

    def spy(nbytes: int):  # type: ignore[no-untyped-def]
        received.append(nbytes)
        return real_receive(nbytes)

    admission.receive = spy  # type: ignore[method-assign]
    try:
        stub = server.stub()
        assert admission.max_calls == 2
        held = [server.call(_enter(admission, f"other{i}")) for i in range(2)]  # two other connections
        with pytest.raises(grpc.RpcError) as error:
            stub.Embed(request("refused unread " * 100), timeout=10)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "request bodies in progress full (2 of 2 calls" in error.value.details()
        assert received == []  # its body never reached the byte budget, which sees every body read
        for ticket in held:
            server.loop.call_soon_threadsafe(ticket.release)
        eventually(lambda: admission.calls == 0, what="the two places released")
        assert len(stub.Embed(request("admitted"), timeout=10).embeddings) == 1
        assert len(received) == 1 and admission.calls == 0 and admission.held_bytes == 0
    finally:
        server.stop()


async def _enter(admission, client: str):  # type: ignore[no-untyped-def]
    return admission.enter(client)
