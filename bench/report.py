"""Turns the benchmark's figures into docs/benchmarks.md, docs/benchmarks.json and two PNG plots."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from bench.measure import Reading, serial_limit

DOCS = Path(__file__).resolve().parents[1] / "docs"
MET_LABELS = {True: "yes", False: "**no**", None: "**not measured**"}
LIMIT_BAR = 0.8  # the server's share of the serial limit L
MINILM_CEILING_BAR = 0.85  # all-MiniLM-L6-v2's server against its raw ceiling
# The loads the gRPC serial-limit targets name: label, the kind of request (its transport readings), the
# server's readings of that kind, clients.
TARGET_LOADS = (
    ("1 text x 32 clients", "single", "server", 32),
    ("1 text x 128 clients", "single", "server", 128),
    ("8 texts x 16 clients", "batch8", "server_batch8", 16),
)
Row = tuple[str, str, str, bool | None]


def at(sweep: list[Reading], concurrency: int) -> Reading:
    """The reading of a load sweep at this many clients."""
    return next(r for r in sweep if r["concurrency"] == concurrency)


def on_cuda(r: dict[str, Any]) -> bool:
    return "CUDA" in r["machine"].get("provider", "")


def limits(r: dict[str, Any]) -> dict[str, dict[str, float]]:
    """gRPC: server, transport ceiling and serial limit L (texts/s) at the levels the targets name."""
    out = {}
    for key, kind, sweep, level in TARGET_LOADS:
        server = at(r[sweep], level)["texts_per_second"]
        transport = at(r["transport"][kind], level)["texts_per_second"]
        limit = serial_limit(r["ceiling"]["texts_per_second"], transport)
        out[key] = {"server": server, "transport": transport, "limit": limit, "fraction": server / limit}
    return out


def protocol_rates(p: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per load ("1x32"): medians over the rounds of each target's texts/s and p50, HTTP's serial limit L and
    HTTP's share of it, and HTTP against gRPC: the median of each round's ratio, with the lowest and highest round.

    The ratio is taken within each round, whose two readings lie seconds apart, so that a machine that slows
    down for a round slows both sides of that round's ratio alike (a ratio of the medians would set a fast
    round's HTTP against a slow round's gRPC). The HTTP ceiling answers a fixed vector, so its cost is per
    request: spread over the load's texts, then paid in turn with the model's own cost per text on this
    load's batches."""
    out = {}
    for key, by in p["loads"].items():
        per_request = int(key.split("x")[0])
        m = {f"{name} {field}": statistics.median(x[field] for x in runs) for name, runs in by.items()
             for field in ("texts_per_second", "requests_per_second", "p50_ms")}  # fmt: skip
        m["L"] = serial_limit(p["raw"][key], m["http ceiling requests_per_second"] * per_request)
        m["http / L"] = m["http texts_per_second"] / m["L"]
        ratios = [h["texts_per_second"] / g["texts_per_second"] for g, h in zip(by["grpc"], by["http"], strict=True)]
        m |= {
            "http / grpc": statistics.median(ratios),
            "http / grpc lowest": min(ratios),
            "http / grpc highest": max(ratios),
        }
        out[key] = m
    return out


def short_of(value: float, bar: float) -> str:
    """value to two decimals, or as many more as it takes that a value under its bar never reads as the bar
    (0.947 against 0.95 reads "0.947", not "0.95" beside "no")."""
    decimals = 2
    while value < bar and round(value, decimals) >= bar and decimals < 6:
        decimals += 1
    return f"{value:.{decimals}f}"


def targets(r: dict[str, Any]) -> list[Row]:
    """(target, measured, bar, met) rows. met is None where this run could not measure the target."""
    rows: list[Row] = []
    for key, x in limits(r).items():
        measured = f"{short_of(x['fraction'], LIMIT_BAR)} L ({x['server']:.0f} of {x['limit']:.0f} texts/s)"
        # A transport ceiling below the server itself: only a machine that stalled through both transport
        # readings gives that (the server does all the transport does and more), and L is then not known.
        stalled = x["transport"] < x["server"]
        if stalled:
            measured = f"not known: the transport ceiling read {x['transport']:.0f} texts/s, below the server's own {x['server']:.0f}"
        rows.append((f"gRPC: server vs serial limit L, {key}", measured, f">= {LIMIT_BAR} L (stretch 0.9)",
                     None if stalled else x["fraction"] >= LIMIT_BAR))  # fmt: skip
    p50_one, floor = at(r["server"], 1)["p50_ms"], r["single_text_ms"]
    rows.append(("gRPC: p50 at one client vs raw single-text inference",
                 f"{p50_one:.2f} ms vs {floor:.2f} ms (+{p50_one - floor:.2f} ms)", "<= raw + 1 ms", p50_one <= floor + 1))  # fmt: skip
    http, minilm_http = protocol_rates(r["protocols"]), protocol_rates(r["minilm"]["protocols"])
    one, many = http["1x1"], http["1x32"]
    ratio = {k: v["http / grpc"] for k, v in http.items()}
    worst_minilm = min(v["http / grpc"] for v in minilm_http.values())
    rows += [
        ("HTTP: server vs its serial limit L, 1 text x 32 clients", f"{short_of(many['http / L'], LIMIT_BAR)} L",
         f">= {LIMIT_BAR} L", many["http / L"] >= LIMIT_BAR),
        ("HTTP against gRPC, 1 text x 32 clients", f"{short_of(ratio['1x32'], 2)}x", ">= 2x", ratio["1x32"] >= 2),
        ("HTTP against gRPC, 8 texts x 16 clients", f"{short_of(ratio['8x16'], 1)}x", ">= 1x", ratio["8x16"] >= 1),
        ("HTTP: p50 at one client vs raw single-text inference", f"{one['http p50_ms']:.2f} ms vs {floor:.2f} ms",
         "<= raw + 0.5 ms", one["http p50_ms"] <= floor + 0.5),
        ("all-MiniLM-L6-v2: HTTP against gRPC, the lower of its loads", f"{short_of(worst_minilm, 0.95)}x", ">= 0.95x",
         worst_minilm >= 0.95),
    ]  # fmt: skip
    rows += request_path_rows(r.get("request_path"))
    rows += model_rows(r["minilm"], "all-MiniLM-L6-v2", batching_bar=2, ceiling_bar=MINILM_CEILING_BAR)
    return rows + model_rows(r, "trained model", batching_bar=3, ceiling_bar=0.8)


def cpu_per_request(runs: list[Reading]) -> float:
    """Server CPU-us a request, every thread of the serving process: the median over the rounds."""
    return statistics.median(x["server_main_thread_cpu_us"] + x["server_other_threads_cpu_us"] for x in runs)


# The request path's targets: (label, the served protocol, its transport ceiling, bar).
REQUEST_PATH_BARS = (
    ("HTTP, 1 text x 32 clients: server CPU a request vs the HTTP echo's", "http", "http ceiling", 3.0),
    ("gRPC, 1 text x 32 clients: server CPU a request vs the gRPC transport ceiling's", "grpc", "grpc ceiling", 2.0),
)


def request_path_rows(path: dict[str, Any] | None) -> list[Row]:
    """The request path's targets, each the server's CPU a request against its transport's, on the null model;
    not measured by a run before the section existed."""
    rows: list[Row] = []
    for label, served, ceiling, bar in REQUEST_PATH_BARS:
        name = f"null model, {label}"
        if path is None:
            rows.append((name, "not measured in this run", f"<= {bar:g}x", None))
            continue
        server, transport = (cpu_per_request(path["loads"]["1x32"][k]) for k in (served, ceiling))
        measured = f"{server / transport:.2f}x ({server:.0f} vs {transport:.0f} CPU-us)"
        rows.append((name, measured, f"<= {bar:g}x", server / transport <= bar))
    return rows


REQUEST_PATH_TARGETS = {"grpc": "gRPC", "http": "HTTP", "grpc ceiling": "gRPC transport ceiling",
                        "http ceiling": "HTTP echo (transport ceiling)"}  # fmt: skip


def request_path_text(path: dict[str, Any] | None) -> str:
    """Section 8: per load and target, medians over the rounds; or a line saying this run did not measure it."""
    if path is None:
        return "Not measured in this run: the section came after it. The next `make bench` run measures it."

    def med(runs: list[Reading], key: str, digits: int) -> str:
        return f"{statistics.median(x[key] for x in runs):.{digits}f}"

    rows = [
        [load_label(key), label, med(by[name], "requests_per_second", 0), med(by[name], "p50_ms", 2),
         med(by[name], "p99_ms", 2), med(by[name], "server_main_thread_cpu_us", 0),
         med(by[name], "server_other_threads_cpu_us", 0), f"{cpu_per_request(by[name]):.0f}",
         med(by[name], "server_cores", 2)]
        for key, by in path["loads"].items() for name, label in REQUEST_PATH_TARGETS.items()
    ]  # fmt: skip
    header = ["load", "target", "requests/s", "p50 ms", "p99 ms", "event-loop CPU-us", "other threads CPU-us",
              "CPU-us a request", "server cores busy"]  # fmt: skip
    return table(header, rows, 2)


def model_rows(m: dict[str, Any], name: str, batching_bar: float, ceiling_bar: float) -> list[Row]:
    """One served model's targets: server against its raw ceiling, batching's gain, padding, per-batch speed-ups."""
    batched, single = at(m["server"], 32)["texts_per_second"], at(m["no_batching"], 32)["texts_per_second"]
    best = max(s["texts_per_second"] for s in m["server"] + m["server_batch8"])
    ceiling, pb = m["ceiling"]["texts_per_second"], m["per_batch"]["seconds"]
    waste, fifo = m["padding"]["c=128"]["sorted"], m["padding"]["c=128"]["fifo"]
    rows: list[Row] = [
        (f"{name}: server vs its raw ONNX Runtime ceiling", f"{best / ceiling:.1%} ({best:.0f} of {ceiling:.0f} texts/s)",
         f">= {ceiling_bar:.0%}", best / ceiling >= ceiling_bar),
        (f"{name}: dynamic batching vs --max-batch-size 1 at 32 clients",
         f"{short_of(batched / single, batching_bar)}x ({batched:.0f} vs {single:.0f} texts/s)", f">= {batching_bar}x", batched / single >= batching_bar),
        (f"{name}: padding waste with length sorting (128 clients)", f"{waste:.1%} (FIFO: {fifo:.1%})", "<= 15%", waste <= 0.15),
    ]  # fmt: skip
    if "eager PyTorch" in pb:  # measured on the CPU, where eager PyTorch runs
        speedup = pb["eager PyTorch"] / pb["ONNX Runtime fp32"]
        label = f"{name}: ONNX Runtime fp32 vs eager PyTorch per batch on the CPU"
        rows.append((label, f"{short_of(speedup, 1.3)}x", ">= 1.3x", speedup >= 1.3))
    label = f"{name}: int8 vs fp32 per batch, at mean cosine >= 0.99"
    if "ONNX Runtime int8" not in pb:  # the per-batch pair is fp32 and fp16 on CUDA: int8 is a CPU build
        fp16 = pb["ONNX Runtime fp32"] / pb["ONNX Runtime fp16"]
        return [*rows, (label, f"int8 is a CPU build; fp16 vs fp32 on CUDA: {fp16:.2f}x", ">= 1.8x", None)]
    speedup, cosine = pb["ONNX Runtime fp32"] / pb["ONNX Runtime int8"], m["int8_cosine"]["mean_cosine"]
    return [*rows, (label, f"{short_of(speedup, 1.8)}x at cosine {cosine:.4f}", ">= 1.8x", speedup >= 1.8 and cosine >= 0.99)]  # fmt: skip


def table(header: list[str], rows: list[list[Any]], numeric_from: int = 1) -> str:
    """A markdown table; columns from ``numeric_from`` on are right-aligned."""
    rule = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    lines = [header, rule, *[[str(cell) for cell in row] for row in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def targets_table(r: dict[str, Any]) -> str:
    return table(["target", "measured", "bar", "met"], [[*row[:3], MET_LABELS[row[3]]] for row in targets(r)], 4)


def sweep_rows(batched: list[Reading], unbatched: list[Reading] | None, ceiling: float) -> list[list[str]]:
    """Per level: texts/s, p50 and p99 ms, share of the ceiling; with unbatched, its figures at that level beside."""

    def figures(x: Reading) -> list[str]:
        return [f"{x['texts_per_second']:.0f}", f"{x['p50_ms']:.2f}", f"{x['p99_ms']:.2f}"]

    rows = []
    for b in batched:
        row = [b["concurrency"], *figures(b), f"{b['texts_per_second'] / ceiling:.0%}"]
        if unbatched is not None:
            n = next((x for x in unbatched if x["concurrency"] == b["concurrency"]), None)
            row += [*figures(n), f"{b['texts_per_second'] / n['texts_per_second']:.2f}x"] if n else [""] * 4
        rows.append(row)
    return rows


def workers_table(w: dict[str, Any]) -> str:
    header = ["load", "1 worker: texts/s", "p99 ms", f"{w['n']} workers: texts/s", "p99 ms", "ratio"]
    rows = []
    for label, load in (("128 clients x 1 text", "single"), ("32 clients x 8 texts", "batch8")):
        one, many = w["1"][load], w[str(w["n"])][load]
        rows.append([label, f"{one['texts_per_second']:.0f}", f"{one['p99_ms']:.1f}", f"{many['texts_per_second']:.0f}",
                     f"{many['p99_ms']:.1f}", f"{many['texts_per_second'] / one['texts_per_second']:.2f}x"])  # fmt: skip
    return table(header, rows)


def load_label(key: str) -> str:
    """A protocol load's key ("1x32") as the tables name it."""
    per_request, clients = key.split("x")
    return f"{per_request} text(s) x {clients} clients"


def protocols_table(p: dict[str, Any]) -> str:
    header = ["load", "gRPC texts/s", "HTTP texts/s", "HTTP / gRPC (rounds)", "HTTP ceiling requests/s", "L texts/s",
              "HTTP / L", "p50 ms gRPC / HTTP"]  # fmt: skip
    rows = [[load_label(key), f"{m['grpc texts_per_second']:.0f}",
             f"{m['http texts_per_second']:.0f}",
             f"{m['http / grpc']:.2f}x ({m['http / grpc lowest']:.2f}-{m['http / grpc highest']:.2f})",
             f"{m['http ceiling requests_per_second']:.0f}", f"{m['L']:.0f}", f"{m['http / L']:.2f}",
             f"{m['grpc p50_ms']:.2f} / {m['http p50_ms']:.2f}"] for key, m in protocol_rates(p).items()]  # fmt: skip
    return table(header, rows)


PROTOCOL_TARGETS = {"grpc": "gRPC", "http": "HTTP", "http ceiling": "HTTP transport ceiling"}
# What the load generator read of the serving process's threads and its own (bench/loadgen.py), and the
# decimals each is shown with.
CPU_FIELDS = {"texts_per_second": 0, "server_main_thread_cpu_us": 0, "server_other_threads_cpu_us": 0,
              "loadgen_cpu_us": 0, "server_cores": 2}  # fmt: skip
CPU_COLUMNS = ["texts/s", "event-loop thread", "other threads", "load generator", "server cores busy"]


def cpu_figures(runs: list[Reading]) -> list[str]:
    """Each of CPU_FIELDS, the median over the readings (NaN where the serving process was not watched)."""
    return [f"{statistics.median(x.get(k, math.nan) for x in runs):.{d}f}" for k, d in CPU_FIELDS.items()]


def protocols_cpu_table(p: dict[str, Any]) -> str:
    """Per load and target, medians over the rounds of texts/s and of the CPU a request cost the serving
    process's event-loop thread, its other threads and the load generator, and the serving cores kept busy."""
    rows = [[load_label(key), label, *cpu_figures(by[name])]
            for key, by in p["loads"].items() for name, label in PROTOCOL_TARGETS.items()]  # fmt: skip
    return table(["load", "target", *CPU_COLUMNS], rows, 2)


def gpu_of(machine: dict[str, Any]) -> str:
    """ "; GPU <name> (driver <version>)" where a CUDA run recorded its GPU, else nothing."""
    return f"; GPU {machine['gpu']}" if machine.get("gpu") else ""


def gpu_text(r: dict[str, Any], out: Path) -> str:
    """This run's GPU section, from docs/gpu/ where it holds a CUDA run: that run's targets, and the GPU check's
    parity and `--workers` runs, whose tables live in gpu/gpu-check.md alone."""
    if on_cuda(r):
        return "This file is a CUDA run (`make gpu-check` runs one); parity and `--workers` scaling: [gpu-check.md](gpu-check.md)."
    gpu = out / "gpu"
    if not (gpu / "benchmarks.json").exists():
        return ("**Not measured**: no CUDA run in docs/gpu/. On a machine with an NVIDIA GPU `make gpu-check` checks "
                "export parity on CUDA, runs this benchmark with `--provider cuda` and writes `docs/gpu/`.")  # fmt: skip
    cuda = json.loads((gpu / "benchmarks.json").read_text())
    m = cuda["machine"]
    text = (f"On a machine with an NVIDIA GPU, by `{cuda['command']}` on {m['date']} ({m['cpu']}, {m['cores']} cores{gpu_of(m)}; "
            "every figure in [gpu/benchmarks.md](gpu/benchmarks.md)), the targets on the CUDA execution provider:\n\n"
            + targets_table(cuda))  # fmt: skip
    check = json.loads((gpu / "gpu-check.json").read_text()) if (gpu / "gpu-check.json").exists() else {}
    passes = all(p["passes"] for p in check.get("parity", {}).get("models", {}).values())
    steps = {"parity": f"Export parity on CUDA ({'every model passes' if passes else '**a model fails**'})",
             "scaling": "`--workers` processes sharing the GPU"}  # fmt: skip
    runs = [f"{what} by `{check[step]['run']['command']}` on {check[step]['run']['date']} ({check[step]['run']['gpu']})"
            for step, what in steps.items() if step in check]  # fmt: skip
    return text + ("\n\n" + "; ".join(runs) + ": [gpu/gpu-check.md](gpu/gpu-check.md)." if runs else "")


def plot(r: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, label, file in (("texts_per_second", "texts/s", "bench_throughput.png"),
                             ("p99_ms", "p99 latency (ms)", "bench_p99.png")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for sweep, name in ((r["server"], "dynamic batching"), (r["no_batching"], "--max-batch-size 1")):
            ax.plot([s["concurrency"] for s in sweep], [s[key] for s in sweep], marker="o", label=name)
        if key == "texts_per_second":
            ax.axhline(r["ceiling"]["texts_per_second"], color="grey", linestyle="--", label="raw ONNX Runtime ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (single-text gRPC requests)")
        ax.set_ylabel(label)
        ax.set_title(f"Embedding server: {label} against concurrency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / file, dpi=100)
        plt.close(fig)


def one_thread_text(tokens: int, cuda: bool) -> str:
    small = f"batches of at most {tokens} padded tokens on one thread"
    return small if tokens else f"every batch on its {'CUDA' if cuda else 'threaded'} session"


def server_limits_text(limits: dict[str, int] | None) -> str:
    if not limits:
        return "not recorded in this run"
    inline, most = limits["inline_batch_tokens"], limits["max_batch_tokens"]
    alone = f"a lone text of at most {inline} tokens on the event loop" if inline else "no text on the event loop"
    return f"{one_thread_text(limits['one_thread_batch_tokens'], False)}, {alone}, at most {most} padded tokens a batch"


def model_values(m: dict[str, Any]) -> dict[str, str]:
    """One served model's tables and figures for its section of the template."""
    ceiling, pb = m["ceiling"]["texts_per_second"], m["per_batch"]
    base_name, base = next(iter(pb["seconds"].items()))  # eager PyTorch where it was timed, else ONNX fp32
    return {
        "parameters": f"{m['parameters'] / 1e6:.2f}",
        "readings": " and ".join(f"{x:.0f}" for x in m["ceiling"]["readings"]),
        "sweep_table": table(["clients", "batching: texts/s", "p50 ms", "p99 ms", "of ceiling",
                              "--max-batch-size 1: texts/s", "p50 ms", "p99 ms", "batching gain"],
                             sweep_rows(m["server"], m["no_batching"], ceiling), 0),
        "padding_table": table(["clients", "length-sorted token budget", "plain FIFO"],
                               [[k.removeprefix("c="), f"{p['sorted']:.1%}", f"{p['fifo']:.1%}"] for k, p in m["padding"].items()]),
        "batch_shape": f"{pb['shape'][0]} texts padded to {pb['shape'][1]} tokens",
        "per_batch_table": table(["backend", "ms per batch", f"speed-up vs {base_name}"],
                                 [[name, f"{sec * 1000:.2f}", f"{base / sec:.2f}x"] for name, sec in pb["seconds"].items()]),
        "int8_chosen": str((m["int8_build"] or {}).get("chosen")),
        "batching_most": f"{ceiling / m['singles_per_second']:.2f}x",
        "flags": " ".join(m["server_flags"]),
    }  # fmt: skip


def values(r: dict[str, Any], out: Path) -> dict[str, str]:
    """The placeholders of bench/benchmarks.md.tmpl that are not a field of the results: tables and ratios;
    all-MiniLM-L6-v2's with the prefix m_."""
    ceiling, raw = r["ceiling"], r["ceiling"]["texts_per_second"]
    rows_cpu = [[label, name, *cpu_figures([at(sweep, level)])] for label, kind, server, level in TARGET_LOADS
                for name, sweep in (("transport ceiling", r["transport"][kind]), ("server", r[server]))]  # fmt: skip
    w, m = r["workers"], r["minilm"]
    sweeps = r["server"] + r["no_batching"] + r["server_batch8"] + r["transport"]["single"] + r["transport"]["batch8"]
    sweeps += [w[k][load] for k in ("1", str(w["n"])) for load in ("single", "batch8")]
    sweeps += m["server"] + m["no_batching"]
    paths = [r["protocols"], m["protocols"], *([r["request_path"]] if "request_path" in r else [])]
    sweeps += [x for p in paths for by in p["loads"].values() for runs in by.values() for x in runs]
    best = max(x["texts_per_second"] for x in r["server"] + r["server_batch8"])
    peak, flops = r["matmul_peak_flops"], {"raw ONNX Runtime ceiling": raw, "server at saturation": best}
    return model_values(r) | {f"m_{k}": v for k, v in model_values(m).items()} | {
        "one_thread": one_thread_text(r["settings"]["one_thread_batch_tokens"], on_cuda(r)),
        "threaded": "the CUDA session" if on_cuda(r) else "two spinning threads",
        "server_limits": server_limits_text(r.get("server_limits")),
        "protocol_seconds": f"{r['settings']['duration_per_level_s'] / 2:g}",
        "targets_table": targets_table(r),
        "batch8_table": table(["clients", "texts/s", "p50 ms (request)", "p99 ms (request)", "of ceiling"],
                              sweep_rows(r["server_batch8"], None, raw), 0),
        "workers_table": workers_table(w),
        "limits_table": table(["load", "transport ceiling texts/s", "raw ceiling texts/s", "L texts/s",
                               "server texts/s", "server / L"],
                              [[key, f"{x['transport']:.0f}", f"{raw:.0f}", f"{x['limit']:.0f}", f"{x['server']:.0f}",
                                f"{x['fraction']:.2f}"] for key, x in limits(r).items()]),
        "cpu_table": table(["load", "process", *CPU_COLUMNS], rows_cpu, 2),
        "errors": str(sum(x["errors"] for x in sweeps)),
        "protocols_table": protocols_table(r["protocols"]), "minilm_protocols_table": protocols_table(m["protocols"]),
        "protocols_cpu_table": protocols_cpu_table(r["protocols"]),
        "mflop_per_text": f"{ceiling['flops_per_text'] / 1e6:.2f}",
        "flops_table": table(["", "GFLOP/s", "of the CPU's matmul peak" + (" (the GPU computes here)" if on_cuda(r) else "")], [
            [f"measured fp32 matmul peak ({r.get('matmul_peak_kernel', 'torch')}, 2048^2, {r['machine']['cores']} threads)",
             f"{peak / 1e9:.1f}", "100%"],
            *([name, f"{rate * ceiling['flops_per_text'] / 1e9:.1f}", f"{rate * ceiling['flops_per_text'] / peak:.0%}"]
              for name, rate in flops.items())]),
        "gpu": gpu_text(r, out), "gpu_machine": gpu_of(r["machine"]), "docs": os.path.relpath(DOCS, out.resolve()),
        "request_path": request_path_text(r.get("request_path")),
    }  # fmt: skip


def write_report(r: dict[str, Any], out: Path) -> None:
    (out / "benchmarks.json").write_text(json.dumps(r, indent=2) + "\n")
    plot(r, out)
    template = (Path(__file__).parent / "benchmarks.md.tmpl").read_text()
    (out / "benchmarks.md").write_text(template.format_map(r | values(r, out)))
