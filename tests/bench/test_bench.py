"""The benchmark's own arithmetic and tools (the full `make bench` is too slow for `make test`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.measure import MATMUL_PEAK_KERNEL, forward_flops, matmul_session, plan_batches
from server.core.batcher import BatchPolicy
from tests.conftest import ServerThread, request, server_config

ROOT = Path(__file__).resolve().parents[2]


def test_flop_count_matches_a_count_of_the_models_matmuls() -> None:
    from model.transformer import Encoder, EncoderConfig

    config = EncoderConfig(vocab_size=50, max_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64, dropout=0.0)
    model = Encoder(config).eval()
    ids = torch.ones((3, 16), dtype=torch.long)
    flops = 0

    def count_linear(module: torch.nn.Linear, inputs: tuple[torch.Tensor], _: torch.Tensor) -> None:
        nonlocal flops
        flops += 2 * inputs[0].shape[:-1].numel() * module.in_features * module.out_features

    hooks = [m.register_forward_hook(count_linear) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(ids, torch.ones_like(ids))
    for h in hooks:
        h.remove()
    attention = 2 * 2 * 3 * 2 * 16 * 16 * 32  # QK^T and weights @ V: 2 matmuls, 2 flops, batch 3, 2 layers
    assert forward_flops(asdict(config), batch=3, sequence=16) == flops + attention


def test_the_matmul_peak_times_the_product_it_counts() -> None:
    """The FLOP table's peak divides 2 n^3 by the time of one run of this one-MatMul graph: it must be that product."""
    session, feeds = matmul_session(96, threads=1)
    (product,) = session.run(None, feeds)
    assert sorted(feeds) == ["a", "b"] and feeds["a"].shape == feeds["b"].shape == (96, 96)
    np.testing.assert_allclose(product, feeds["a"] @ feeds["b"], rtol=1e-4, atol=1e-3)


def test_the_flop_table_names_the_kernel_its_peak_was_read_with(tmp_path: Path) -> None:
    """A run records what measured its peak; a run from before that record read it with torch."""
    from bench.report import write_report

    results = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    for kernel, expected in ((MATMUL_PEAK_KERNEL, MATMUL_PEAK_KERNEL), (None, "torch")):
        run = {k: v for k, v in results.items() if k != "matmul_peak_kernel"}
        if kernel:
            run["matmul_peak_kernel"] = kernel
        write_report(run, tmp_path)
        row = f"| measured fp32 matmul peak ({expected}, 2048^2, {results['machine']['cores']} threads) |"
        assert row in (tmp_path / "benchmarks.md").read_text()


def test_planned_batches_cover_every_row_once_within_the_policy() -> None:
    rng = np.random.default_rng(0)
    rows = [np.full(int(n), i, dtype=np.int64) for i, n in enumerate(rng.integers(3, 120, size=500))]
    policy = BatchPolicy(max_batch_tokens=2048, max_batch_size=64, max_queue_tokens=100_000)
    batches = plan_batches(rows, policy)
    seen = sorted(int(r[0]) for b in batches for r in b)
    assert seen == list(range(500))
    for b in batches:
        longest = max(len(r) for r in b)
        assert len(b) <= 64 and len(b) * longest <= 2048
        assert len(b) * longest - sum(len(r) for r in b) <= 0.15 * len(b) * longest


def run_loadgen(target: str, texts: Path, *flags: str) -> dict[str, float]:
    """bench/loadgen.py as make bench runs it, on a short window."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.loadgen", "--target", target, "--texts", str(texts), "--warmup", "0.2", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return dict(json.loads(done.stdout))


def test_load_generator_reports_throughput_and_latency(served: ServerThread, tmp_path: Path) -> None:
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(["a short text", "another somewhat longer text about rivers and lungs"]))
    result = run_loadgen(served.target, texts, "--concurrency", "4", "--duration", "1", "--texts-per-request", "2")
    assert result["errors"] == 0 and result["requests"] > 10
    assert result["texts_per_second"] > 0 and 0 < result["p50_ms"] <= result["p99_ms"]


def test_load_generator_sends_to_the_model_named(served: ServerThread, tmp_path: Path) -> None:
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(["a short text"]))
    name = served.server.state.resolve("").name
    named = run_loadgen(served.target, texts, "--concurrency", "2", "--duration", "0.5", "--model", name)
    assert named["errors"] == 0 and named["requests"] > 0
    unknown = run_loadgen(served.target, texts, "--concurrency", "2", "--duration", "0.5", "--model", "no-such-model")
    assert unknown["requests"] == 0 and set(unknown["error_kinds"]) == {"INVALID_ARGUMENT"}


def test_load_generator_spreads_grpc_clients_over_the_connections_asked(
    served: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's fair queue keys clients by connection: one channel is one client, as each HTTP connection is.
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(["a short text", "another somewhat longer text about rivers and lungs"]))
    batcher = served.server.state.resolve("").batcher
    clients: set[str] = set()
    submit = batcher.submit

    async def recording(rows, deadline=None, client=""):  # type: ignore[no-untyped-def]
        clients.add(client)
        return await submit(rows, deadline, client)

    monkeypatch.setattr(batcher, "submit", recording)
    for connections in (1, 3):
        clients.clear()
        result = run_loadgen(served.target, texts, "--concurrency", "6", "--duration", "1",
                             "--grpc-connections", str(connections))  # fmt: skip
        assert result["errors"] == 0 and len(clients) == connections


def test_transport_ceiling_server_answers_each_input_with_a_fixed_vector(tmp_path: Path) -> None:
    import grpc

    from bench.measure import transport_server
    from embedding.v1 import embedding_pb2, embedding_pb2_grpc

    with transport_server(dim=8) as ceiling:
        with grpc.insecure_channel(ceiling.target) as channel:
            stub = embedding_pb2_grpc.EmbedderStub(channel)
            response = stub.Embed(embedding_pb2.EmbedRequest(inputs=["a", "b c", "d"]), timeout=10)
        assert [len(e.values) for e in response.embeddings] == [8, 8, 8]
        # The load generator watches the server's threads: CPU per request is reported for the budget table.
        texts = tmp_path / "texts.json"
        texts.write_text(json.dumps(["one text", "another"]))
        flags = ["--concurrency", "2", "--duration", "0.5", "--watch-pid", str(ceiling.process.pid)]
        result = run_loadgen(ceiling.target, texts, *flags)
    assert result["requests"] > 0 and result["errors"] == 0
    assert result["server_main_thread_cpu_us"] > 0 and result["loadgen_cpu_us"] > 0


def test_http_transport_ceiling_answers_openai_shaped_embeddings(tmp_path: Path) -> None:
    import base64

    import httpx

    from bench.measure import transport_server

    with transport_server(dim=8, protocol="http") as ceiling:
        answer = httpx.post(f"http://{ceiling.target}/v1/embeddings", json={"input": "a"}, timeout=10)
        texts = tmp_path / "texts.json"
        texts.write_text(json.dumps(["one text", "another"]))
        result = run_loadgen(ceiling.target, texts, "--protocol", "http", "--concurrency", "2", "--duration", "0.5")
    vector = base64.b64decode(answer.json()["data"][0]["embedding"])
    assert answer.status_code == 200 and len(vector) == 8 * 4  # float32, the model's width
    assert result["requests"] > 0 and result["errors"] == 0


def test_serial_limit_adds_the_two_costs_per_text() -> None:
    from bench.measure import serial_limit

    # 1/4000 s of model time plus 1/2000 s of transport time per text: 1333 texts/s when paid in turn.
    assert round(serial_limit(4000, 2000)) == 1333


def test_a_transport_ceiling_below_the_server_leaves_the_target_unmeasured() -> None:
    # A run on a machine that stalled through both transport readings once marked 1.27 L as met.
    from bench.report import at, targets

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    server, transport = at(run["server"], 32), at(run["transport"]["single"], 32)

    def row() -> tuple[str, str, str, bool | None]:
        (found,) = [t for t in targets(run) if t[0] == "gRPC: server vs serial limit L, 1 text x 32 clients"]
        return found

    transport["texts_per_second"] = server["texts_per_second"] * 3
    assert isinstance(row()[3], bool) and row()[1].endswith(" texts/s)")
    transport["texts_per_second"] = server["texts_per_second"] * 0.9
    assert row()[3] is None
    assert row()[1].startswith("not known")


def test_gpu_check_without_a_gpu_says_so_and_fails(tmp_path: Path) -> None:
    # An nvidia-smi that lists no device (as on a machine without a GPU or driver) stands first in PATH.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices were found' >&2\nexit 9\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "scripts/gpu-check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "no NVIDIA GPU on this machine" in done.stderr and "pending" in done.stderr
    assert "make setup" not in done.stdout  # stopped before installing anything
    dry_run = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "scripts/gpu-check.sh" in dry_run.stdout


def test_load_generator_speaks_http_to_the_same_server(served: ServerThread, tmp_path: Path) -> None:
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(["a short text", "another somewhat longer text about rivers and lungs"]))
    target = f"127.0.0.1:{served.server.http_port}"
    before = served.server.metrics.registry.get_sample_value(
        "embed_inputs_total", {"model": served.server.default.name}
    )
    result = run_loadgen(target, texts, "--protocol", "http", "--concurrency", "4", "--duration", "1")
    assert result["errors"] == 0 and result["requests"] > 10
    after = served.server.metrics.registry.get_sample_value("embed_inputs_total", {"model": served.server.default.name})
    assert (after or 0) - (before or 0) >= result["requests"]  # every answer counted was really embedded


def readings(*texts_per_second: float, p50: float = 1.0) -> list[dict[str, float]]:
    """One reading per round, as the load generator reports it (one text per request)."""
    return [{"texts_per_second": t, "requests_per_second": t, "p50_ms": p50} for t in texts_per_second]


def test_the_protocol_targets_take_medians_of_the_rounds_against_the_serial_limit() -> None:
    from bench.report import protocols_table, targets

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    run["single_text_ms"] = 0.3
    run["protocols"] = {
        "raw": {"1x32": 4000.0, "8x16": 8000.0, "1x1": 3000.0},
        "loads": {
            "1x32": {
                "grpc": readings(900, 1000, 1600),
                "http": readings(1350, 1500, 2400),
                "http ceiling": readings(20000, 20000, 20000),
            },
            "8x16": {"grpc": readings(1600), "http": readings(2000), "http ceiling": readings(2500)},
            "1x1": {"grpc": readings(500, p50=1.7), "http": readings(800, p50=0.7), "http ceiling": readings(8000)},
        },
    }
    # A machine whose speed moved from round to round: each round's own ratio is 0.95x.
    run["minilm"]["protocols"] = {
        "raw": {"1x32": 110.0, "8x16": 120.0},
        "loads": {
            "1x32": {"grpc": readings(100), "http": readings(97), "http ceiling": readings(20000)},
            "8x16": {
                "grpc": readings(1000, 800, 1300),
                "http": readings(950, 760, 1235),
                "http ceiling": readings(2500, 2500, 2500),
            },
        },
    }
    rows = {name: (measured, met) for name, measured, _, met in targets(run)}
    # L = 1 / (1/20000 + 1/4000) = 3333 texts/s at 1 x 32; HTTP's median 1500 is 0.45 of it, 1.5x gRPC's in
    # every round.
    assert rows["HTTP: server vs its serial limit L, 1 text x 32 clients"] == ("0.45 L", False)
    assert rows["HTTP against gRPC, 1 text x 32 clients"] == ("1.50x", False)
    assert rows["HTTP against gRPC, 8 texts x 16 clients"] == ("1.25x", True)
    assert rows["HTTP: p50 at one client vs raw single-text inference"] == ("0.70 ms vs 0.30 ms", True)
    assert rows["all-MiniLM-L6-v2: HTTP against gRPC, the lower of its loads"] == ("0.95x", True)
    # The ceiling answers per request: at 8 texts each, 2500 requests/s carry 20000 texts/s.
    table = protocols_table(run["protocols"])
    assert "| 1 text(s) x 32 clients | 1000 | 1500 | 1.50x (1.50-1.50) | 20000 | 3333 | 0.45 | 1.00 / 1.00 |" in table
    assert "| 8 text(s) x 16 clients | 1600 | 2000 | 1.25x (1.25-1.25) | 2500 | 5714 | 0.35 | 1.00 / 1.00 |" in table
    minilm = protocols_table(run["minilm"]["protocols"])
    assert "| 8 text(s) x 16 clients | 1000 | 950 | 0.95x (0.95-0.95) |" in minilm
    # Rounds whose ratios differ: the median of the rounds' ratios (0.88, 1.05, 1.00), not the ratio of the
    # medians (880 against 1000), with the lowest and highest beside it.
    run["minilm"]["protocols"]["loads"]["8x16"]["http"] = readings(880, 840, 1300)
    assert "| 8 text(s) x 16 clients | 1000 | 880 | 1.00x (0.88-1.05) |" in protocols_table(run["minilm"]["protocols"])
    rows = {name: (measured, met) for name, measured, _, met in targets(run)}
    assert rows["all-MiniLM-L6-v2: HTTP against gRPC, the lower of its loads"] == ("0.97x", True)


def test_the_protocol_comparison_reads_every_target_in_every_round(served: ServerThread, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from bench.measure import compare_protocols

    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(["a short text", "another somewhat longer text about rivers and lungs"]))
    server = SimpleNamespace(target=served.target, http=f"http://127.0.0.1:{served.server.http_port}")
    # The server runs in this process: its threads are this process's.
    loads = compare_protocols(server, 8, texts, 0.3, 2, [(2, 3)], os.getpid())  # type: ignore[arg-type]
    assert set(loads) == {"2x3"} and set(loads["2x3"]) == {"grpc", "http", "http ceiling"}
    for name, runs in loads["2x3"].items():
        assert len(runs) == 2 and all(r["requests"] > 0 and r["errors"] == 0 for r in runs), name
        assert all(r["texts_per_request"] == 2 and r["concurrency"] == 3 for r in runs)
        # Each reading says what a request cost the process that answered it: the server's (here this process,
        # whose main thread only waits), or the ceiling's, whose main thread is its event loop.
        assert all(r["server_cores"] > 0 for r in runs), name
    assert all(r["server_main_thread_cpu_us"] > 0 for r in loads["2x3"]["http ceiling"])
    # The second round reads the targets in reverse: a drift within a round does not always hit the last one.
    places = {name: [r["place"] for r in runs] for name, runs in loads["2x3"].items()}
    assert places == {"grpc": [0, 2], "http": [1, 1], "http ceiling": [2, 0]}


def test_the_protocol_comparisons_cpu_table_gives_each_targets_medians_over_the_rounds() -> None:
    from bench.report import protocols_cpu_table

    def costs(loop: float, other: float, loadgen: float, cores: float) -> dict[str, float]:
        return {"server_main_thread_cpu_us": loop, "server_other_threads_cpu_us": other, "loadgen_cpu_us": loadgen,
                "server_cores": cores}  # fmt: skip

    grpc = [r | costs(*c) for r, c in zip(readings(900, 1000, 1600), [(500, 600, 200, 1.5), (540, 640, 190, 1.6),
                                                                      (480, 700, 180, 1.7)], strict=True)]  # fmt: skip
    http = [r | costs(300, 450, 50, 1.6) for r in readings(2000, 2400, 2100)]
    ceiling = [r | costs(30, 0, 40, 1.0) for r in readings(30000, 31000, 29000)]
    table = protocols_cpu_table({"loads": {"1x32": {"grpc": grpc, "http": http, "http ceiling": ceiling}}})
    assert "| 1 text(s) x 32 clients | gRPC | 1000 | 500 | 640 | 190 | 1.60 |" in table
    assert "| 1 text(s) x 32 clients | HTTP | 2100 | 300 | 450 | 50 | 1.60 |" in table
    assert "| 1 text(s) x 32 clients | HTTP transport ceiling | 30000 | 30 | 0 | 40 | 1.00 |" in table


def test_the_null_model_is_served_behind_the_tokenizer_it_was_given(tiny_artifacts: Path, tmp_path: Path) -> None:
    """bench/null_model.py: the server takes it as any model, tokenizes as the source model does, and answers
    each text with a vector of the null model's width."""
    from bench.null_model import NULL_DIM, build
    from contract.manifest import Manifest

    folder = build(tmp_path / "null", tiny_artifacts)
    assert Manifest.read(folder).vocab_size == Manifest.read(tiny_artifacts).vocab_size
    texts = ["a small domesticated carnivore", "draw air into the lungs"]
    counts = {}
    for model in (folder, tiny_artifacts):
        server = ServerThread(server_config(model))
        try:
            answer = server.stub().Embed(request(*texts), timeout=10)
            counts[model] = list(answer.token_counts)
            width = {len(e.values) for e in answer.embeddings}
        finally:
            server.stop()
        if model == folder:
            assert width == {NULL_DIM}
    assert counts[folder] == counts[tiny_artifacts]


def test_the_request_path_section_compares_each_protocols_cpu_with_its_transport_ceiling() -> None:
    """The null model's targets: the server's CPU a request (every thread, median over the rounds) against its
    transport ceiling's; a run from before the section says it did not measure them."""
    from bench.report import request_path_rows, request_path_text

    def runs(loop: float, other: float) -> list[dict[str, float]]:
        costs = {
            "server_main_thread_cpu_us": loop,
            "server_other_threads_cpu_us": other,
            "server_cores": 1.0,
            "p99_ms": 3.0,
        }
        return [r | costs for r in readings(1000, 1100, 1200, p50=2.0)]

    by = {"http": runs(200, 100), "http ceiling": runs(60, 0), "grpc": runs(300, 200), "grpc ceiling": runs(180, 90)}
    path = {"loads": {"1x32": by}}
    rows = request_path_rows(path)
    assert [(row[1].split("x")[0], row[3]) for row in rows] == [("5.00", False), ("1.85", True)]
    assert "| 1 text(s) x 32 clients | HTTP | 1100 | 2.00 |" in request_path_text(path)
    assert {row[3] for row in request_path_rows(None)} == {None}
    assert "Not measured in this run" in request_path_text(None)


def test_the_report_renders_a_run_from_its_results_alone(tmp_path: Path) -> None:
    """docs/benchmarks.md is the template filled from benchmarks.json: the committed run renders again, with
    its date, every placeholder filled and each target marked."""
    from bench.report import targets, write_report

    results = json.loads((Path(__file__).resolve().parents[2] / "docs" / "benchmarks.json").read_text())
    write_report(results, tmp_path)
    text = (tmp_path / "benchmarks.md").read_text()
    assert "{" not in text and "}" not in text  # no placeholder left unfilled
    assert f"- **Run**: {results['machine']['date']}, `{results['command']}`." in text
    for name, measured, bar, _ in targets(results):
        assert f"| {name} | {measured} | {bar} |" in text
    assert json.loads((tmp_path / "benchmarks.json").read_text()) == results


def test_a_share_just_under_its_bar_never_reads_as_the_bar() -> None:
    """A run read all-MiniLM-L6-v2 at 214 of 253 texts/s (84.6%) against 85%: "85%" beside "no" reads as a
    contradiction, so shares against a ceiling carry one decimal."""
    from bench.report import targets

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    run["minilm"]["ceiling"]["texts_per_second"] = 253.0
    for reading in run["minilm"]["server"]:
        reading["texts_per_second"] = 214.0
    rows = {name: (measured, met) for name, measured, _, met in targets(run)}
    measured, met = rows["all-MiniLM-L6-v2: server vs its raw ONNX Runtime ceiling"]
    assert met is False and measured.startswith("84.6% ")


def test_a_ratio_just_under_its_bar_never_reads_as_the_bar() -> None:
    """all-MiniLM-L6-v2 over HTTP at 0.947 of its gRPC rate against 0.95x: "0.95x" beside "no" reads as a
    contradiction, so a ratio under its bar carries the decimals that show it."""
    from bench.report import targets

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    for by in run["minilm"]["protocols"]["loads"].values():
        for name, rate in (("grpc", 1000.0), ("http", 947.0)):
            for reading in by[name]:
                reading["texts_per_second"] = rate
    rows = {name: (measured, met) for name, measured, _, met in targets(run)}
    assert rows["all-MiniLM-L6-v2: HTTP against gRPC, the lower of its loads"] == ("0.947x", False)
    for by in run["minilm"]["protocols"]["loads"].values():
        for reading in by["http"]:
            reading["texts_per_second"] = 951.0
    rows = {name: (measured, met) for name, measured, _, met in targets(run)}
    assert rows["all-MiniLM-L6-v2: HTTP against gRPC, the lower of its loads"] == ("0.95x", True)


def test_the_report_says_when_no_batch_runs_on_one_thread() -> None:
    """0 one-thread tokens means the one-thread session is off, not batches of "at most 0 padded tokens"."""
    from bench.report import values

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    run["settings"]["one_thread_batch_tokens"] = 0
    assert values(run, ROOT / "docs")["one_thread"].startswith("every batch on its threaded session")
    run["settings"]["one_thread_batch_tokens"] = 256
    assert values(run, ROOT / "docs")["one_thread"].startswith("batches of at most 256 padded tokens")
    assert values(run, ROOT / "docs")["threaded"] == "two spinning threads"
    run["machine"]["provider"] = "CUDAExecutionProvider"
    assert values(run, ROOT / "docs")["threaded"] == "the CUDA session"
    run["settings"]["one_thread_batch_tokens"] = 0
    assert values(run, ROOT / "docs")["one_thread"] == "every batch on its CUDA session"


def test_the_bench_reads_the_limits_the_running_server_measured_itself(served: ServerThread) -> None:
    """The server measures its one-thread and event-loop limits and its batch budget at each start, and they move
    from one start to the next: the report names the ones of the server it loaded."""
    from bench.measure import server_limits

    info = served.server.default.info
    assert server_limits(f"http://127.0.0.1:{served.server.http_port}") == {
        "one_thread_batch_tokens": info.one_thread_batch_tokens,
        "inline_batch_tokens": info.inline_batch_tokens,
        "max_batch_tokens": info.max_batch_tokens,
    }


def test_the_report_names_the_servers_own_limits_or_says_they_were_not_recorded() -> None:
    from bench.report import values

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    run["server_limits"] = {"one_thread_batch_tokens": 64, "inline_batch_tokens": 32, "max_batch_tokens": 10240}
    assert values(run, ROOT / "docs")["server_limits"] == (
        "batches of at most 64 padded tokens on one thread, a lone text of at most 32 tokens on the event loop, "
        "at most 10240 padded tokens a batch"
    )
    run["server_limits"] |= {"one_thread_batch_tokens": 0, "inline_batch_tokens": 0}
    assert values(run, ROOT / "docs")["server_limits"] == (
        "every batch on its threaded session, no text on the event loop, at most 10240 padded tokens a batch"
    )
    del run["server_limits"]
    assert values(run, ROOT / "docs")["server_limits"] == "not recorded in this run"


def test_parallel_load_generators_add_up_and_merge_their_latencies(served: ServerThread, tmp_path: Path) -> None:
    from bench.measure import load

    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(["a short text", "another somewhat longer text about rivers and lungs"]))
    merged = load(served.target, 3, texts, 1.0, 2, processes=2)
    assert merged["processes"] == 2 and merged["concurrency"] == 6 and merged["errors"] == 0
    assert merged["texts_per_second"] == 2 * merged["requests_per_second"] > 0
    assert 0 < merged["p50_ms"] <= merged["p99_ms"]


def test_a_cuda_run_reports_what_it_measured_where() -> None:
    """On CUDA the per-batch comparisons of eager, TorchScript and int8 run on the CPU, and int8 is not a CUDA
    build: the report must say so instead of scoring a CUDA run against CPU bars."""
    from bench.report import targets, values

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    run["machine"]["provider"] = "CUDAExecutionProvider"
    run["minilm"]["per_batch"]["seconds"] = {"ONNX Runtime fp32": 0.004, "ONNX Runtime fp16": 0.002}
    rows = {t[0]: t for t in targets(run)}
    int8 = rows["all-MiniLM-L6-v2: int8 vs fp32 per batch, at mean cosine >= 0.99"]
    assert int8[3] is None and int8[1] == "int8 is a CPU build; fp16 vs fp32 on CUDA: 2.00x"
    assert rows["trained model: ONNX Runtime fp32 vs eager PyTorch per batch on the CPU"][3] is not None
    rendered = values(run, ROOT / "docs" / "gpu")
    assert "the GPU computes here" in rendered["flops_table"] and rendered["docs"] == ".."
    assert rendered["gpu_machine"] == ""  # a run that recorded no GPU names none
    run["machine"]["gpu"] = "NVIDIA H200 (driver 580.159.04)"
    assert values(run, ROOT / "docs" / "gpu")["gpu_machine"] == "; GPU NVIDIA H200 (driver 580.159.04)"


def test_the_soak_cycles_request_sizes_and_samples_the_servers_memory(served: ServerThread) -> None:
    from bench.soak import SIZES, drive

    texts = ["a short text", "another somewhat longer text about rivers and lungs", "x", "y z", "w", "v", "u", "t"]
    samples = drive(served.target, os.getpid(), 1.0, 4, texts, window=0.3)
    assert [s["texts_per_request"] for s in samples[:3]] == list(SIZES)
    assert all(s["requests_per_second"] > 0 and s["errors"] == 0 and s["rss_mib"] > 10 for s in samples)


def test_the_gpu_check_report_renders_from_its_results_alone(tmp_path: Path) -> None:
    """Steps run apart keep their own runs: each section names the command and date that measured it."""
    from bench.gpu_check import write_markdown

    report = json.loads((ROOT / "docs" / "gpu" / "gpu-check.json").read_text())
    report["scaling"]["run"] |= {"date": "2001-02-03", "command": "python -m bench.gpu_check --steps scaling"}
    write_markdown(report, tmp_path / "full.md")
    text = (tmp_path / "full.md").read_text()
    parity_section, scaling_section = text.split("## `--workers` scaling")
    for run, section in ((report["parity"]["run"], parity_section), (report["scaling"]["run"], scaling_section)):
        assert f"`{run['command']}` on {run['date']}" in section and run["gpu"] in section
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 2 + len(report["parity"]["models"]) + len(report["scaling"]["rows"])  # headers, a row each
    write_markdown({"parity": report["parity"]}, tmp_path / "parity.md")
    parity_only = (tmp_path / "parity.md").read_text()
    assert "Not run: `--steps` left out `scaling`." in parity_only and "2001-02-03" not in parity_only


def test_the_reports_gpu_section_carries_the_cuda_targets_and_points_to_the_gpu_check(tmp_path: Path) -> None:
    """docs/benchmarks.md states the CUDA run's targets, and names the GPU check's runs and its verdict on parity
    where docs/gpu/ holds them (their tables live in gpu/gpu-check.md alone)."""
    from bench.report import gpu_text, targets

    run = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    assert "**Not measured**" in gpu_text(run, tmp_path)
    shutil.copytree(ROOT / "docs" / "gpu", tmp_path / "gpu")
    text = gpu_text(run, tmp_path)
    cuda = json.loads((ROOT / "docs" / "gpu" / "benchmarks.json").read_text())
    assert cuda["command"] in text
    for target, measured, _, _ in targets(cuda):
        assert f"| {target} | {measured} |" in text
    check = json.loads((ROOT / "docs" / "gpu" / "gpu-check.json").read_text())
    for step in ("parity", "scaling"):
        assert f"`{check[step]['run']['command']}` on {check[step]['run']['date']}" in text
    assert "every model passes" in text and "[gpu/gpu-check.md](gpu/gpu-check.md)" in text
    check["parity"]["models"]["trained"]["passes"] = False
    (tmp_path / "gpu" / "gpu-check.json").write_text(json.dumps(check))
    assert "**a model fails**" in gpu_text(run, tmp_path)
