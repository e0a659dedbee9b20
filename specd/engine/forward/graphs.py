"""Replayed forwards: the lean forward's narrow steps captured once and replayed (CUDA graphs).

On a GPU a batch-1 forward of a 1.5B model launches some 600 small kernels, and launching them
from Python costs more than running them: the step is bound by the host, not by the GPU's memory
bandwidth. A CUDA graph records the launches of one forward once and replays them with one call
(what gpt-fast gets from ``torch.compile(mode="reduce-overhead")``, without compiling: the lean
forward's own ops are recorded as they are).

A graph replays fixed memory: the same input and output tensors, the same cache tensors, the
same shapes. So ``LeanForward`` records a graph per cache (a document's K/V), per width (1 ..
``GRAPH_WIDTHS`` tokens: decode steps and verifies; prefills and token trees run eagerly) and per
kind of output (all rows or the last); the new tokens and their first position go in through
small static tensors, attention runs over the cache's whole capacity under a mask built on the
device from that position, and K/V are written at positions computed there. Nothing of a step
is read back to the host inside the graph. A cache that grows to a new capacity drops its graphs
(its tensors are new). A recording costs a few forwards' time (a warm-up forward, the
recording), so a kind of step is recorded once it recurs (``LeanForward.record_after``), on
each document at its first use there, or ahead in idle time (``LeanForward.prepare``).

``EagerGraphs`` runs the same static-shape forward without recording, each "replay" running it
again on the same static tensors: it is how the CPU tests check everything here but the CUDA
recording itself, and it is never chosen by a user setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# sequence forwards of 1 .. this many tokens replay a graph: a draft chain's verify (draft_max + 1)
# and a lookup's (lookup_max + 1: 17 by default); prefills and trees run eagerly
GRAPH_WIDTHS = 32


@dataclass
class Captured:
    """One recorded forward of one cache: its static inputs (the new tokens, the first new
    position), its output, and the call that replays it. ``keep`` holds tensors the recording
    reads that the forward path may replace later (the rotary tables), so their memory stays."""

    ids: torch.Tensor  # [1, width] long
    start: torch.Tensor  # [] long: cache length before the forward
    out: torch.Tensor  # float32 logits, overwritten by each replay
    replay: Callable[[], None]
    keep: tuple = ()


class CudaGraphs:
    """Records with ``torch.cuda.CUDAGraph``; every graph of one forward path shares one memory
    pool (replays run one at a time and each output is copied out before the next)."""

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        """(output, replay) of ``run``. ``run`` executes once for real first, on a side stream
        (CUDA requires a warm-up before recording; its K/V writes are the forward's own)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: work other threads put on the device meanwhile does not void the recording
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = run()
        return out, graph.replay


class EagerGraphs:
    """The same static-shape forwards, run again at each replay instead of recorded (tests)."""

    name = "eager"

    def record(self, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        out = run()
        return out, lambda: out.copy_(run())
