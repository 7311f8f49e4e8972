"""The default number of DataLoader worker processes of training and evaluation, and of the index writers' decoding
threads (torch-free: the CLI's help states them)."""

from __future__ import annotations

import os

MAX_DEFAULT_WORKERS = 4
DEFAULT_WORKERS_TEXT = f"cores - 1, at most {MAX_DEFAULT_WORKERS}"  # the rule, as help texts state it


def default_workers() -> int:
    """Worker processes when none are asked for: one core is left to the main process, at most MAX_DEFAULT_WORKERS."""
    return min(MAX_DEFAULT_WORKERS, max(0, (os.cpu_count() or 1) - 1))


DECODE_THREADS = 2
DECODE_THREADS_TEXT = f"{DECODE_THREADS}, or 1 on one core"  # the rule, as help texts state it


def available_cpus() -> int:
    """The cores this process may run on (its affinity: a container's cpuset, ``taskset``), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this system (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def default_decode_threads() -> int:
    """Decoding threads of the index writers when none are asked for: DECODE_THREADS, the fastest build measured on
    2 and on 16 cores (docs/BENCHMARKS.md "CPU throughput": more threads contend with onnxruntime's for the cores and
    the GIL, and decoded no faster), or 1 on one core."""
    return min(DECODE_THREADS, available_cpus())
