"""The benchmark's own arithmetic and tools (the full `make bench` is too slow for `make test`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from bench.measure import ModelShape, plan_batches
from server.batcher import BatchPolicy
from tests.conftest import ServerThread

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
    assert ModelShape(2, 32, 64).flops(batch=3, sequence=16) == flops + attention


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


def test_load_generator_reports_throughput_and_latency(served: ServerThread, tmp_path: Path) -> None:
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(["a short text", "another somewhat longer text about rivers and lungs"]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.loadgen",
            "--target",
            served.target,
            "--concurrency",
            "4",
            "--duration",
            "1",
            "--warmup",
            "0.3",
            "--texts",
            str(texts),
            "--texts-per-request",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result = json.loads(done.stdout)
    assert result["errors"] == 0 and result["requests"] > 10
    assert result["texts_per_second"] > 0 and 0 < result["p50_ms"] <= result["p99_ms"]
