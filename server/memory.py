"""The memory the process may use, and the budgets derived from it (docs/reliability.md, "Memory").

The limit is the lower of the cgroup's (``memory.max``, what Kubernetes sets from the container's limit)
and ``--memory-limit-mib``, where either is set, else the machine's memory; ``--workers N`` gives each
worker a share of 1/N through that flag. Peak RSS is kept within ``TARGET_SHARE`` of it:
what the models take once loaded and warmed up (their largest batch included) is measured, a share of the
limit is kept for HTTP answers written and not yet taken by their clients (``UnsentAnswers``), and the
rest goes to request bodies received and not yet tokenized (the byte budget, ``Admission``).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")  # cgroup v2
TARGET_SHARE = 0.75  # of the limit: the rest is slack for the allocator, the kernel's accounting and spikes
# Kept for what is neither the warm models nor admitted bodies: gRPC's buffers for calls not yet admitted,
# thread stacks, responses. Without it a one-connection flood overshot its target (tests/reliability/test_flood.py).
UNACCOUNTED_SHARE = 0.05  # of the limit
# HTTP answers written and not yet taken by their clients (server/api/http/connection.py, UnsentAnswers): a
# client that stops reading leaves its answer in the server's memory. 2.5% of 1 GiB holds the largest answer
# (2,048 inputs of 384 floats as JSON) more than twice; clients reading at network speed hold far less.
UNSENT_SHARE = 0.025  # of the limit
# What one byte of body costs in memory until it is tokenized: gRPC's buffers, the bytes object it copies
# them into, the parsed message and the Python strings read from it (docs/reliability.md, "Memory").
MEMORY_PER_BODY_BYTE = 3
MIB = 1 << 20


def memory_limit(flag_mib: int, cgroup_file: Path = CGROUP_MEMORY_MAX) -> tuple[int, str]:
    """(bytes, where it came from): the lower of the cgroup's limit and the flag, where either is set, else
    the machine's memory. The flag only ever lowers the cgroup's: a process never plans for more memory
    than its container has."""
    limits = [(flag_mib * MIB, "--memory-limit-mib")] if flag_mib > 0 else []
    try:
        text = cgroup_file.read_text().strip()
        if text != "max":
            limits.append((int(text), f"cgroup {cgroup_file}"))
    except (OSError, ValueError):
        pass
    if limits:
        return min(limits, key=lambda limit: limit[0])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (Linux /proc); 0 where there is no /proc."""
    try:
        for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class MemoryPlan:
    limit_bytes: int
    limit_source: str
    models_bytes: int  # RSS once every model is loaded and has run its largest batch
    request_bytes: int  # the byte budget: request bodies held (received, not yet tokenized)
    request_calls: int  # calls reading or tokenizing their body at once: request_bytes / max_message_bytes
    unsent_bytes: int  # HTTP answers written and not yet taken by their clients, at most (UNSENT_SHARE)

    @property
    def target_bytes(self) -> int:
        return int(self.limit_bytes * TARGET_SHARE)

    def describe(self) -> str:
        return (
            f"memory limit {self.limit_bytes // MIB} MiB ({self.limit_source}); target peak "
            f"{self.target_bytes // MIB} MiB; models {self.models_bytes // MIB} MiB after warm-up; "
            f"request bodies {self.request_bytes // MIB} MiB, {self.request_calls} calls reading or tokenizing; "
            f"HTTP answers waiting for their clients {self.unsent_bytes // MIB} MiB"
        )


def plan(limit: tuple[int, str], models_bytes: int, max_message_bytes: int, override_bytes: int = 0) -> MemoryPlan:
    """What the target leaves, less UNACCOUNTED_SHARE and UNSENT_SHARE of the limit, once the models are warm
    goes to request bodies, each byte costing MEMORY_PER_BODY_BYTE; calls are counted as if every body were the
    largest message, so the bound holds before any body is read.

    ``override_bytes`` (--max-request-bytes) replaces the derived budget. Raises ValueError when not
    even one largest message fits: the limit is too small for these models and batches.
    """
    limit_bytes, source = limit
    unsent = int(limit_bytes * UNSENT_SHARE)
    left = int(limit_bytes * TARGET_SHARE) - int(limit_bytes * UNACCOUNTED_SHARE) - unsent - models_bytes
    budget = override_bytes or left // MEMORY_PER_BODY_BYTE
    if budget < max_message_bytes:
        raise ValueError(
            f"memory limit {limit_bytes // MIB} MiB ({source}) leaves {max(left, 0) // MIB} MiB for requests "
            f"once the models take {models_bytes // MIB} MiB, less than one largest message "
            f"({max_message_bytes // MIB} MiB x {MEMORY_PER_BODY_BYTE}): raise the limit, or lower "
            "--max-batch-seconds/--max-batch-tokens or --max-message-bytes"
        )
    return MemoryPlan(limit_bytes, source, models_bytes, budget, budget // max_message_bytes, unsent)


# glibc's malloc settings, read from the environment when the process starts.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2"}
# jemalloc (Debian's libjemalloc2), preloaded in glibc malloc's place where it is installed: its per-thread caches
# cost the event loop less per request (decisions/0030).
# Two arenas, as MALLOC_ARENA_MAX, and freed pages given back within a second by its own thread, so a flood's
# peak stays where glibc's settings hold it.
JEMALLOC = "libjemalloc.so.2"
JEMALLOC_CONF = "narenas:2,background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"
JEMALLOC_SETTINGS = {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": JEMALLOC_CONF}
ALLOCATOR_VARIABLE = "EMBED_ALLOCATOR"  # "glibc" keeps glibc's malloc where jemalloc is installed


def jemalloc_installed() -> bool:
    import ctypes.util  # runs ldconfig: only where it is asked

    return ctypes.util.find_library("jemalloc") is not None


def allocator_settings() -> dict[str, str]:
    """The allocator's environment the server runs with: glibc's settings, and jemalloc preloaded where it is
    installed, unless EMBED_ALLOCATOR is ``glibc``."""
    settings = dict(MALLOC_SETTINGS)
    # Where both are set already (by the image, or by the restart below) they stand: no need to ask ldconfig.
    unset = any(not os.environ.get(name) for name in JEMALLOC_SETTINGS)
    if unset and os.environ.get(ALLOCATOR_VARIABLE, "auto") != "glibc" and jemalloc_installed():
        settings.update(JEMALLOC_SETTINGS)
    return settings


def allocator_in_use() -> str:
    """``jemalloc`` where it is mapped into this process, else ``glibc``: what really loaded, not what was asked."""
    try:
        return "jemalloc" if "libjemalloc" in Path("/proc/self/maps").read_text() else "glibc"
    except OSError:  # not Linux
        return "the platform's"


def reexec_with_malloc_settings() -> None:
    """Restart this ``python -m server`` in place (same pid) with ``allocator_settings()``, those not already set
    (an operator's own ``LD_PRELOAD`` or ``MALLOC_CONF`` wins).

    glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), after which a
    request's megabyte-sized buffers come from the heap and stay there as fragmentation; a fixed 128 KiB
    threshold keeps a flood's peak down. glibc reads these only at start (mallopt() from Python, after
    start, gave no gain), and a
    preloaded library only loads at start, hence the exec; the image sets them in its environment, so there
    it never happens.
    """
    if not sys.platform.startswith("linux"):
        return
    missing = {name: value for name, value in allocator_settings().items() if not os.environ.get(name)}
    if not missing:
        return
    os.environ.update(missing)
    os.execv(sys.executable, [sys.executable, "-m", "server", *sys.argv[1:]])
