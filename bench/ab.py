"""A/B runs of server variants, interleaved, as the "What was tried" rows of docs/benchmarks.md are measured.

    python -m bench.ab --variant base= --variant one-thread="--intra-op-threads 1" \
        [--checkout NAME=DIR] [--rounds 2] [--duration 5] [--levels 1x1,32x1,16x8] [--model-dir artifacts]
        [--json OUT]

Each variant is `python -m server` with its flags, started fresh for each round; the rounds alternate
the variants, so on a machine whose speed drifts every variant sees the same drift and each cell is
read as a range over rounds, not one number. Every level is the benchmark's own load generator
(closed loop, CLIENTSxTEXTS per request) with the server's CPU per request by thread. Prints one line
per measurement and the ranges at the end; --json writes every measurement.

--checkout runs a variant's server from another checkout (a `git worktree` of an earlier commit, with
its generated protobuf modules copied in), to compare code rather than flags.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.measure import load_sweep, traffic
from loadtest.run import ROOT, local_server


@dataclass(frozen=True)
class Variant:
    name: str
    flags: list[str]
    source: Path = ROOT  # the checkout its server runs from


@dataclass(frozen=True)
class Level:
    clients: int
    texts_per_request: int

    def __str__(self) -> str:
        return f"{self.clients}x{self.texts_per_request}"


def parse_variant(spec: str) -> Variant:
    """NAME=FLAGS, FLAGS as a shell would split them (empty for the defaults)."""
    name, sep, flags = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {spec!r}: expected NAME=FLAGS (FLAGS may be empty)")
    return Variant(name, shlex.split(flags))


def parse_levels(spec: str) -> list[Level]:
    """Comma-separated CLIENTSxTEXTS, e.g. 1x1,32x1,16x8."""
    levels = []
    for part in spec.split(","):
        clients, sep, texts = part.strip().partition("x")
        if not sep or not clients.isdigit() or not texts.isdigit() or int(clients) < 1 or int(texts) < 1:
            raise argparse.ArgumentTypeError(f"level {part!r}: expected CLIENTSxTEXTS, e.g. 32x1")
        levels.append(Level(int(clients), int(texts)))
    return levels


def summary_line(variant: str, level: Level, results: Sequence[dict[str, Any]]) -> str:
    def rounds(key: str, digits: int = 0) -> str:
        return ", ".join(f"{r[key]:.{digits}f}" for r in results)

    return (
        f"{variant} {level}: texts/s {rounds('texts_per_second')}; p50 ms {rounds('p50_ms', 2)}; "
        f"server CPU-us per request {rounds('server_cpu_us')}"
    )


def run(
    variants: Sequence[Variant],
    levels: Sequence[Level],
    rounds: int,
    duration: float,
    model_dir: str,
    texts: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    texts = texts or traffic()
    measured: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(texts))
        for round_ in range(rounds):
            for variant in variants:
                with local_server(model_dir, variant.flags, variant.source) as server:
                    for level in levels:
                        with contextlib.redirect_stdout(io.StringIO()):  # load_sweep's own progress line
                            (result,) = load_sweep(
                                server.target,
                                (level.clients,),
                                texts_file,
                                duration,
                                level.texts_per_request,
                                watch_pid=server.process.pid,
                            )
                        result["server_cpu_us"] = (
                            result["server_main_thread_cpu_us"] + result["server_other_threads_cpu_us"]
                        )
                        measured.append({"round": round_, "variant": variant.name, "level": str(level), **result})
                        print(
                            f"round {round_ + 1} {variant.name} {level}: {result['texts_per_second']:.0f} texts/s, "
                            f"p50 {result['p50_ms']:.2f} ms, server CPU-us per request: event loop "
                            f"{result['server_main_thread_cpu_us']:.0f}, other threads "
                            f"{result['server_other_threads_cpu_us']:.0f}",
                            flush=True,
                        )
    print("ranges over rounds:")
    for variant in variants:
        for level in levels:
            cell = [m for m in measured if m["variant"] == variant.name and m["level"] == str(level)]
            print("  " + summary_line(variant.name, level, cell))
    return measured


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True, help="NAME=SERVER FLAGS")
    parser.add_argument("--checkout", action="append", default=[], help="NAME=DIR: run that variant from DIR")
    parser.add_argument("--levels", type=parse_levels, default=parse_levels("1x1,32x1,16x8"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per level")
    parser.add_argument("--model-dir", default="artifacts")
    parser.add_argument("--texts", type=Path, help="a JSON list of texts (default: the benchmark's traffic)")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args(argv)
    names = [v.name for v in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"variant names must differ: {names}")
    checkouts = dict(spec.partition("=")[::2] for spec in args.checkout)
    if unknown := set(checkouts) - set(names):
        parser.error(f"--checkout names no variant: {sorted(unknown)}")
    variants = [
        replace(v, source=Path(checkouts[v.name]).resolve()) if v.name in checkouts else v for v in args.variant
    ]
    texts = json.loads(args.texts.read_text()) if args.texts else None
    measured = run(variants, args.levels, args.rounds, args.duration, args.model_dir, texts)
    if args.json:
        args.json.write_text(json.dumps(measured, indent=2) + "\n")


if __name__ == "__main__":
    main()
