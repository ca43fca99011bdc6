"""Turns the benchmark's figures into docs/benchmarks.md, docs/benchmarks.json and two PNG plots."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from typing import Any

from bench.measure import serial_limit

DOCS = Path(__file__).resolve().parents[1] / "docs"


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


def on_cuda(r: dict[str, Any]) -> bool:
    return "CUDA" in r["machine"].get("provider", "")


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
    cb_batched, cb_single = at(cb["server"], 32)["texts_per_second"], at(cb["no_batching"], 32)["texts_per_second"]
    cb_best = max(s["texts_per_second"] for s in cb["server"])
    cb_ceiling = cb["ceiling"]["texts_per_second"]
    cb_pb = cb["per_batch"]["seconds"]
    cb_int8 = cb_pb["ONNX Runtime fp32"] / cb_pb.get("ONNX Runtime int8", float("inf"))
    # On CUDA the per-batch pair is fp32 and fp16 (int8 is a CPU build); eager and TorchScript run on the CPU.
    cuda = on_cuda(r)
    cb_int8_row: tuple[str, str, str, bool | None] = (
        "MiniLM-sized: int8 vs fp32 per batch, at mean cosine >= 0.99",
        f"{cb_int8:.2f}x at cosine {cb['int8_cosine']['mean_cosine']:.4f}", ">= 1.8x",
        cb_int8 >= 1.8 and cb["int8_cosine"]["mean_cosine"] >= 0.99,
    )  # fmt: skip
    if cuda:
        fp16 = cb_pb["ONNX Runtime fp32"] / cb_pb["ONNX Runtime fp16"]
        cb_int8_row = (cb_int8_row[0], f"int8 is a CPU build; fp16 vs fp32 on CUDA: {fp16:.2f}x", ">= 1.8x", None)
    on_cpu = f" (on the CPU, {r['machine']['cores']} threads)" if cuda else ""
    cb_waste = cb["padding"]["c=128"]["sorted"]
    best = max(s["texts_per_second"] for s in r["server"] + r["server_batch8"])
    best_single = max(s["texts_per_second"] for s in r["server"])
    ceiling = r["ceiling"]["texts_per_second"]
    batched32, single32 = at(r["server"], 32)["texts_per_second"], at(r["no_batching"], 32)["texts_per_second"]
    waste, per_batch = r["padding"]["c=128"]["sorted"], r["per_batch"]["seconds"]
    fp32_vs_eager = per_batch["eager PyTorch"] / per_batch["ONNX Runtime fp32"]
    int8_vs_fp32 = per_batch["ONNX Runtime fp32"] / per_batch["ONNX Runtime int8"]
    rows += [
        ("MiniLM-sized: dynamic batching vs --max-batch-size 1 at 32 clients",
         f"{cb_batched / cb_single:.2f}x ({cb_batched:.0f} vs {cb_single:.0f} texts/s)", ">= 2x", cb_batched / cb_single >= 2),
        ("MiniLM-sized: server vs its raw ONNX Runtime ceiling",
         f"{cb_best / cb_ceiling:.0%} ({cb_best:.0f} of {cb_ceiling:.0f} texts/s)",
         f">= {COMPUTE_BOUND_CEILING_BAR:.0%}", cb_best / cb_ceiling >= COMPUTE_BOUND_CEILING_BAR),
        cb_int8_row,
        ("MiniLM-sized: padding waste with length sorting (128 clients)",
         f"{cb_waste:.1%} (FIFO: {cb['padding']['c=128']['fifo']:.1%})", "<= 15%", cb_waste <= 0.15),
        ("trained model: server saturation vs raw ONNX Runtime ceiling",
         f"{best / ceiling:.0%} ({best:.0f} of {ceiling:.0f} texts/s; single-text requests: {best_single / ceiling:.0%})",
         ">= 80% (stretch 90%)", best / ceiling >= 0.8),
        ("trained model: dynamic batching vs --max-batch-size 1 at 32 clients", f"{batched32 / single32:.2f}x",
         ">= 3x", batched32 / single32 >= 3),
        ("trained model: padding waste with length sorting (128 clients)",
         f"{waste:.1%} (FIFO: {r['padding']['c=128']['fifo']:.1%})", "<= 15%", waste <= 0.15),
        (f"trained model: ONNX Runtime fp32 vs eager PyTorch per batch{on_cpu}", f"{fp32_vs_eager:.2f}x", ">= 1.3x",
         fp32_vs_eager >= 1.3),
        (f"trained model: ONNX Runtime int8 vs fp32 per batch{on_cpu}", f"{int8_vs_fp32:.2f}x", ">= 1.8x",
         int8_vs_fp32 >= 1.8),
    ]  # fmt: skip
    return rows


def cpu_per_request(x: dict[str, Any]) -> float:
    """Server CPU microseconds per request, all threads."""
    return float(x.get("server_main_thread_cpu_us", float("nan")) + x.get("server_other_threads_cpu_us", float("nan")))


def accounting_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
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
    loop_us = server32.get("server_main_thread_cpu_us", float("nan"))
    cb = r["compute_bound"]
    readings, seconds, cb_ceiling = (
        cb["ceiling"]["readings"],
        cb["per_batch"]["seconds"],
        cb["ceiling"]["texts_per_second"],
    )
    other = next(n for n in seconds if n != "ONNX Runtime fp32")
    return [
        ("ONNX Runtime per text, on the raw ceiling's batches (cores x wall time"
         + ("; the GPU computes, so not CPU time)" if on_cuda(r) else ")"), f"{raw_cpu_us:.0f} us"),
        ("the transport ceiling's server per request, 32 clients", f"{transport_cpu:.0f} CPU-us"),
        ("the server per single-text request, 32 clients", f"{server_cpu:.0f} CPU-us"),
        ("of it, costs L does not count", f"{server_cpu - transport_cpu - raw_cpu_us:.0f} CPU-us"),
        (f"what server and load generator may spend per request together at {LIMIT_BAR} L",
         f"{budget:.0f} CPU-us (spent: {server_cpu + server32['loadgen_cpu_us']:.0f})"),
        ("our code on the event loop per request, without gRPC (`bench/request_path.py`)",
         f"{ours:.0f} CPU-us, {tokenize:.0f} of it tokenization, {path['bare']['event_loop_cpu_us']:.0f} neither "
         "tokenizer nor model"),
        ("one client, p50: transport ceiling, server, raw single-text inference",
         f"{transport_one:.2f}, {one_client:.2f}, {r['single_text_ms']:.2f} ms"),
        ("the server's event-loop thread per single-text request, 32 clients (one thread: at most 1 / that)",
         f"{loop_us:.0f} CPU-us: at most {1e6 / loop_us:.0f} requests/s"),
        ("MiniLM-sized: raw ceiling before and after the server sweeps",
         f"{readings[0]:.0f} and {readings[1]:.0f} texts/s (drift {1 - min(readings) / max(readings):.0%})"),
        ("MiniLM-sized: ONNX Runtime one text at a time against the batcher's batches",
         f"{cb['singles_per_second']:.0f} against {cb_ceiling:.0f} texts/s "
         f"({cb_ceiling / cb['singles_per_second']:.2f}x: batching's most on this machine)"),
        (f"MiniLM-sized: {other.removeprefix('ONNX Runtime ')} against fp32 per batch" + (" on CUDA" if on_cuda(r) else ""),
         f"{seconds['ONNX Runtime fp32'] / seconds[other]:.2f}x at {cb['per_batch']['shape'][0]} x "
         f"{cb['per_batch']['shape'][1]}" + ("" if on_cuda(r) else f", mean cosine {cb['int8_cosine']['mean_cosine']:.4f}")),
    ]  # fmt: skip


def table(header: list[str], rows: list[list[Any]], numeric_from: int = 1) -> str:
    """A markdown table; columns from ``numeric_from`` on are right-aligned."""
    rule = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    lines = [header, rule, *[[str(cell) for cell in row] for row in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def workers_table(w: dict[str, Any], one_single: dict[str, Any], one_batch8: dict[str, Any]) -> str:
    """1 worker against w["n"], both over w["connections"] connections; a run that read the workers over
    one connection (the kernel gives it to one worker) compares one worker with one of n, and says so."""
    if "1" in w:
        pairs = [(w["1"][load], w[str(w["n"])][load]) for load in ("single", "batch8")]
        note = f"each loaded over {w['connections']} connections from as many load-generator processes"
    else:
        pairs = [(one_single, w["single"]), (one_batch8, w["batch8"])]
        note = f"over one connection, which the kernel gives to one worker: one worker against one of {w['n']}"
    header = ["load", "1 worker: texts/s", "p99 ms", f"{w['n']} workers: texts/s", "p99 ms", "ratio"]
    rows = [
        [label, f"{one['texts_per_second']:.0f}", f"{one['p99_ms']:.1f}", f"{many['texts_per_second']:.0f}",
         f"{many['p99_ms']:.1f}", f"{many['texts_per_second'] / one['texts_per_second']:.2f}x"]
        for label, (one, many) in zip(("128 clients x 1 text", "32 clients x 8 texts"), pairs, strict=True)
    ]  # fmt: skip
    return f"Measured {note}.\n\n" + table(header, rows)


def pretrained_text(r: dict[str, Any]) -> str:
    pt = r.get("pretrained")
    if not pt:
        return "Not measured in this run: its artifacts were not there (`make export-pretrained` writes them)."
    ceiling, server = pt["ceiling"]["texts_per_second"], at(pt["server"], 32)
    readings = ", ".join(f"{x:.0f}" for x in pt["ceiling"]["readings"])
    intro = (
        f"`{pt['model_id']}` ({pt['parameters'] / 1e6:.1f} M parameters, max length {pt['max_length']}) exported by "
        "`make export-pretrained` into `ARTIFACTS/minilm` and served by the same server with no code path of its own "
        f"(default settings plus `{' '.join(pt['server_flags'])}`), same texts and load generator, 32 clients of one text."
    )
    header = ["raw ONNX Runtime ceiling, texts/s", "server, texts/s", "p50 ms", "p99 ms", "of ceiling"]
    row = [f"{ceiling:.0f} (higher of {readings})", f"{server['texts_per_second']:.0f}", f"{server['p50_ms']:.2f}",
           f"{server['p99_ms']:.2f}", f"{server['texts_per_second'] / ceiling:.0%}"]  # fmt: skip
    return intro + "\n\n" + table(header, [row], 0)


def gpu_text(r: dict[str, Any], out: Path) -> str:
    if on_cuda(r):
        return "This file is a CUDA run (`make gpu-check` runs one); parity and `--workers` scaling: [gpu-check.md](gpu-check.md)."
    if (out / "gpu" / "gpu-check.md").exists():
        return (
            "Measured on a machine with an NVIDIA GPU (`make gpu-check`, or `python -m bench.gpu_check` where the CUDA "
            "libraries are installed; the commands are in each file): parity and `--workers` scaling in "
            "[gpu/gpu-check.md](gpu/gpu-check.md), speed on the CUDA execution provider in [gpu/benchmarks.md](gpu/benchmarks.md)."
        )
    return (
        "**Not measured in this run**: it had no NVIDIA GPU, so the CUDA execution provider (`--provider cuda`, "
        "`--precision fp16`) is not measured here. On such a machine `make gpu-check` installs the CUDA libraries, "
        "checks export parity on CUDA (fp32 against CPU within 1e-4, fp16 cosine >= 0.999), runs this benchmark with "
        "`--provider cuda`, measures `--workers` 1 to 8 sharing the GPU, and writes `docs/gpu/`; "
        "this section then links to it."
    )


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


def sweep_rows(
    batched: list[dict[str, Any]], unbatched: list[dict[str, Any]] | None, ceiling: float
) -> list[list[str]]:
    rows = []
    for b in batched:
        row = [b["concurrency"], f"{b['texts_per_second']:.0f}", f"{b['p50_ms']:.2f}", f"{b['p99_ms']:.2f}",
               f"{b['texts_per_second'] / ceiling:.0%}"]  # fmt: skip
        if unbatched is not None:
            n = next((x for x in unbatched if x["concurrency"] == b["concurrency"]), None)
            row += [f"{n['texts_per_second']:.0f}", f"{n['p50_ms']:.2f}", f"{n['p99_ms']:.2f}",
                    f"{b['texts_per_second'] / n['texts_per_second']:.2f}x"] if n else ["", "", "", ""]  # fmt: skip
        rows.append(row)
    return rows


def values(r: dict[str, Any], out: Path) -> dict[str, str]:
    """Every placeholder of bench/benchmarks.md.tmpl, from this run's results alone."""
    m, s, c, ceiling = r["machine"], r["settings"], r["model"]["config"], r["ceiling"]
    raw, w, pb, cb = ceiling["texts_per_second"], r["workers"], r["per_batch"], r["compute_bound"]
    rows_cpu = []
    for label, kind, level in TARGET_LOADS:
        for name, sweep in (("transport ceiling", r["transport"][kind]), ("server", server_sweep(r, kind))):
            x = at(sweep, level)
            rows_cpu.append([label, name, f"{x['texts_per_second']:.0f}"] + [
                f"{x.get(k, float('nan')):.{d}f}" for k, d in (("server_main_thread_cpu_us", 0),
                ("server_other_threads_cpu_us", 0), ("loadgen_cpu_us", 0), ("server_cores", 2))])  # fmt: skip
    errors = sum(x["errors"] for x in r["server"] + r["no_batching"] + r["server_batch8"])
    errors += sum(x["errors"] for x in ([w[k][load] for k in ("1", str(w["n"])) for load in ("single", "batch8")]
                                        if "1" in w else [w["single"], w["batch8"]]))  # fmt: skip
    errors += sum(x["errors"] for x in r["transport"]["single"] + r["transport"]["batch8"])
    eager = pb["seconds"]["eager PyTorch"]
    best = max(x["texts_per_second"] for x in r["server"] + r["server_batch8"])
    achieved, peak = best * ceiling["flops_per_text"], r["matmul_peak_flops"]
    build = r["model"].get("int8_build") or {}
    cb_seconds, cb_build, cb_single32 = cb["per_batch"]["seconds"], cb["int8_build"], at(cb["no_batching"], 32)
    other = next(name for name in cb_seconds if name != "ONNX Runtime fp32")
    cb_rows = sweep_rows(cb["server"], None, cb["ceiling"]["texts_per_second"])
    for row, b in zip(cb_rows, cb["server"], strict=True):
        at32 = b["concurrency"] == 32
        row += [f"{cb_single32['texts_per_second']:.0f}" if at32 else "",
                f"{b['texts_per_second'] / cb_single32['texts_per_second']:.2f}x" if at32 else ""]  # fmt: skip
    padding_header = ["clients", "length-sorted token budget", "plain FIFO"]
    return {
        "date": m.get("date", "date not recorded"), "cpu": m["cpu"], "cores": str(m["cores"]),
        "provider": m.get("provider", "CPUExecutionProvider"), "python": m["python"],
        "bench_seconds": f"{r['bench_seconds']:.0f}", "parameters": f"{r['model']['parameters'] / 1e6:.2f}",
        "layers": str(c["n_layers"]), "d_model": str(c["d_model"]), "heads": str(c["n_heads"]), "d_ff": str(c["d_ff"]),
        "max_len": str(c["max_len"]), "vocab": str(c["vocab_size"]),
        "max_batch_tokens": str(s["max_batch_tokens"]), "max_batch_size": str(s["max_batch_size"]),
        "max_queue_tokens": str(s["max_queue_tokens"]), "max_delay_ms": str(s["max_delay_ms"]),
        "texts": str(s["texts"]), "tokens_per_text": f"{ceiling['real_tokens_per_text']:.1f}",
        "duration": f"{s['duration_per_level_s']:.0f}",
        "targets_table": table(["target", "measured", "bar", "met"],
                               [[t, v, bar, MET_LABELS[ok]] for t, v, bar, ok in targets(r)], 4),
        "ceiling_batches": str(ceiling["batches"]), "ceiling_mean_batch": f"{ceiling['mean_batch']:.1f}",
        "ceiling": f"{raw:.0f}", "ceiling_start": f"{ceiling['texts_per_second_start']:.0f}",
        "ceiling_end": f"{ceiling['texts_per_second_end']:.0f}", "single_text_ms": f"{r['single_text_ms']:.2f}",
        "tokenize_one_ms": f"{r['tokenize_one_ms']:.3f}",
        "sweep_table": table(["clients", "batching: texts/s", "p50 ms", "p99 ms", "of ceiling",
                              "--max-batch-size 1: texts/s", "p50 ms", "p99 ms", "batching gain"],
                             sweep_rows(r["server"], r["no_batching"], raw), 0),
        "batch8_table": table(["clients", "texts/s", "p50 ms (request)", "p99 ms (request)", "of ceiling"],
                              sweep_rows(r["server_batch8"], None, raw), 0),
        "workers": str(w["n"]),
        "workers_table": workers_table(w, at(r["server"], 128), at(r["server_batch8"], 32)),
        "limits_table": table(["load", "transport ceiling texts/s", "raw ceiling texts/s", "L texts/s",
                               "server texts/s", "server / L"],
                              [[key, f"{x['transport']:.0f}", f"{raw:.0f}", f"{x['limit']:.0f}", f"{x['server']:.0f}",
                                f"{x['fraction']:.2f}"] for key, x in limits(r).items()]),
        "cpu_table": table(["load", "process", "texts/s", "event-loop thread", "other threads", "load generator",
                            "server cores busy"], rows_cpu, 2),
        "errors": str(errors),
        "padding_table": table(padding_header, [[k.removeprefix("c="), f"{p['sorted']:.1%}", f"{p['fifo']:.1%}"]
                                                for k, p in r["padding"].items()]),
        "batch_shape": f"{pb['shape'][0]} texts padded to {pb['shape'][1]} tokens",
        "per_batch_table": table(["backend", "ms per batch", "speed-up vs eager"],
                                 [[name, f"{sec * 1000:.2f}", f"{eager / sec:.2f}x"] for name, sec in pb["seconds"].items()]),
        "int8_chosen": str(build.get("chosen")), "int8_timed": str(build.get("seconds_per_batch")),
        "mflop_per_text": f"{ceiling['flops_per_text'] / 1e6:.2f}",
        "padded_tokens_per_text": f"{ceiling['padded_tokens_per_text']:.1f}",
        "flops_table": table(["", "GFLOP/s", "of the CPU's matmul peak" + (" (the GPU computes here)" if on_cuda(r) else "")], [
            [f"measured fp32 matmul peak (torch, 2048^2, {m['cores']} threads)", f"{peak / 1e9:.1f}", "100%"],
            ["raw ONNX Runtime ceiling", f"{ceiling['flops_per_second'] / 1e9:.1f}", f"{ceiling['flops_per_second'] / peak:.0%}"],
            ["server at saturation", f"{achieved / 1e9:.1f}", f"{achieved / peak:.0%}"]]),
        "cb_d_model": str(cb["config"]["d_model"]), "cb_layers": str(cb["config"]["n_layers"]),
        "cb_heads": str(cb["config"]["n_heads"]), "cb_d_ff": str(cb["config"]["d_ff"]),
        "cb_parameters": f"{cb['parameters'] / 1e6:.1f}", "cb_flags": " ".join(cb["server_flags"]),
        "cb_single_text_ms": f"{cb['single_text_ms']:.2f}", "cb_ceiling": f"{cb['ceiling']['texts_per_second']:.0f}",
        "cb_readings": ", ".join(f"{x:.0f}" for x in cb["ceiling"]["readings"]),
        "cb_sweep_table": table(["clients", "batching: texts/s", "p50 ms", "p99 ms", "of ceiling",
                                 "--max-batch-size 1: texts/s", "batching gain"], cb_rows, 0),
        "cb_padding_table": table(["padding waste", "length-sorted token budget", "plain FIFO"],
                                  [[f"{k.removeprefix('c=')} clients", f"{p['sorted']:.1%}", f"{p['fifo']:.1%}"]
                                   for k, p in cb["padding"].items()]),
        "cb_batch_shape": f"{cb['per_batch']['shape'][0]} texts padded to {cb['per_batch']['shape'][1]} tokens",
        "cb_per_batch": ", ".join(f"{n.removeprefix('ONNX Runtime ')} {sec * 1000:.1f} ms" for n, sec in cb_seconds.items()),
        "cb_speedup": f"{cb_seconds['ONNX Runtime fp32'] / cb_seconds[other]:.2f}x",
        "cb_mean_cosine": f"{cb['int8_cosine']['mean_cosine']:.4f}", "cb_worst_cosine": f"{cb['int8_cosine']['worst_row_cosine']:.4f}",
        "cb_int8_chosen": cb_build["chosen"],
        "cb_int8_timed": ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in cb_build["seconds_per_batch"].items())
        + f"; fp32 {cb_build['fp32_seconds_per_batch'] * 1000:.1f} ms",
        "pretrained": pretrained_text(r),
        "accounting_table": table(["quantity", "this run"], [list(row) for row in accounting_rows(r)], 2),
        "gpu": gpu_text(r, out),
        "command": r.get("command", "make bench"),
        "docs": os.path.relpath(DOCS, out.resolve()),
    }  # fmt: skip


def write_report(r: dict[str, Any], out: Path) -> None:
    (out / "benchmarks.json").write_text(json.dumps(r, indent=2) + "\n")
    plot(r, out)
    template = string.Template((Path(__file__).parent / "benchmarks.md.tmpl").read_text())
    (out / "benchmarks.md").write_text(template.substitute(values(r, out)))
