"""Which of the lean forward's products run through numpy's BLAS instead of torch's: the timed
choice (``choose_host_products``), numpy's BLAS on one thread (``limit_host_threads``) and its
name (``host_blas``).

On a CPU in float32, numpy's wheels bring OpenBLAS, whose kernels for a few rows may stream a
weight matrix faster than torch's MKL (``layers.Matmul``); whether they do depends on the
machine, so ``engine.numpy_products = auto`` times both on the loaded model at start-up."""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch

from specd.engine.forward.lean.layers import NO_HOST

HOST_ROWS = 16  # products of at most this many rows may run through numpy's BLAS (see choose_host_products)
HOST_CONTEXT = 256  # tokens of context behind choose_host_products' timed forwards
HOST_REPEATS = 11  # timed forwards per width and route (after one warm-up round)
# ... fewer where a width's rounds would take longer than this (a real model's forwards), but
# never under HOST_MIN_REPEATS: a median of fewer would choose by noise.
HOST_BUDGET_S = 0.5
HOST_MIN_REPEATS = 3
HOST_MARGIN = 0.97  # numpy's BLAS takes a width class only when at least 3% faster (ties stay on torch)
# choose_host_products' probes: a forward of each width (key) decides the row counts (value) it stands for
HOST_PROBES = {1: range(1, 2), 2: range(2, 4), 8: range(4, HOST_ROWS + 1)}
ALL_HOST_ROWS = frozenset(range(1, HOST_ROWS + 1))


def choose_host_products(lean, setting: str, repeats: int) -> frozenset[int]:
    """``LeanForward.host_products``: route the products of ``lean`` (a ``LeanForward``, which
    imports this module, hence untyped here) as ``setting`` says ("off", "on", "auto": timed
    here), note what was measured in ``lean.host_note``; the row counts chosen."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"host products must be auto, on or off, not {setting!r}")
    weight = lean.embed.weight
    eligible = weight.device.type == "cpu" and weight.dtype == torch.float32 and \
        lean.lm_head.in_out is not None
    if setting == "off" or not eligible:
        lean.route_products(NO_HOST)
        return lean.host_rows
    limit_host_threads()
    if setting == "on":
        lean.route_products(ALL_HOST_ROWS)
        return lean.host_rows
    generator = torch.Generator().manual_seed(0)
    vocab = lean.embed.weight.shape[0]
    cache = lean.new_cache(HOST_CONTEXT + 16)
    lean.forward(torch.randint(0, vocab, (1, HOST_CONTEXT), generator=generator), cache, last_only=True)
    times: dict[tuple[int, bool], list[float]] = {}
    for width in HOST_PROBES:
        ids = torch.randint(0, vocab, (1, width), generator=generator)
        rounds, i = repeats + 1, 0
        while i < rounds:
            round_started = time.perf_counter()
            for host in ((False, True) if i % 2 else (True, False)):
                lean.route_products(ALL_HOST_ROWS if host else NO_HOST)
                started = time.perf_counter()
                lean.forward(ids, cache, last_only=True)
                if i:  # the first round warms up
                    times.setdefault((width, host), []).append(time.perf_counter() - started)
                cache.length = HOST_CONTEXT
            if i == 0:  # a dear model gets fewer rounds: start-up waits on them
                rounds = 1 + max(HOST_MIN_REPEATS, min(repeats, int(HOST_BUDGET_S / (time.perf_counter() - round_started))))
            i += 1
    median = {key: statistics.median(values) * 1000 for key, values in times.items()}
    chosen = frozenset(rows for width, rows in HOST_PROBES.items()
                       if median[width, True] < HOST_MARGIN * median[width, False] for rows in rows)
    lean.host_note = "numpy/torch measured " + ", ".join(
        f"{median[width, True]:.2f}/{median[width, False]:.2f} ms at width {width}" for width in HOST_PROBES)
    lean.route_products(chosen)
    return lean.host_rows


def spans(rows: frozenset[int]) -> str:
    """Row counts as spans: {1, 4, 5, 6} -> "1, 4-6"."""
    out, ordered = [], sorted(rows)
    start = prev = ordered[0]
    for row in ordered[1:] + [None]:
        if row is not None and row == prev + 1:
            prev = row
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if row is not None:
            start = prev = row
    return ", ".join(out)


def _host_blas_libraries() -> list:
    """threadpoolctl's controllers of the BLAS libraries numpy may run on, torch's own excepted
    (a torch build that bundles OpenBLAS keeps its threads)."""
    from threadpoolctl import ThreadpoolController

    torch_dir = os.path.dirname(torch.__file__)
    return [lib for lib in ThreadpoolController().select(user_api="blas").lib_controllers
            if not lib.filepath.startswith(torch_dir)]


@functools.cache
def limit_host_threads() -> None:
    """numpy's BLAS on one thread: the products it takes are a few rows, where threads cost more
    than they share, and OpenBLAS's idle threads spin on the cores torch's threads need. An MKL
    is left alone: where numpy runs on MKL (conda), torch may share that very library, and torch
    sets its threads."""
    for lib in _host_blas_libraries():
        if lib.internal_api != "mkl":
            lib.set_num_threads(1)


@functools.cache
def host_blas() -> str:
    """numpy's BLAS, e.g. "openblas 0.3.31" (for descriptions)."""
    libraries = sorted(_host_blas_libraries(),  # numpy's own first (scipy may bring another)
                       key=lambda lib: not os.path.basename(os.path.dirname(lib.filepath)).startswith("numpy"))
    if not libraries:
        return "numpy's BLAS"
    lib = libraries[0]
    return f"{lib.internal_api} {lib.version}" if lib.version else lib.internal_api
