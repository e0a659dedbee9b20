"""llama.cpp as the engine's forward path: specd's decoding on llama.cpp's kernels.

On a CPU, llama.cpp runs the same weights faster than torch (``specd bench`` forward costs;
figures in docs/llamacpp.md: per-op dispatch and small-batch GEMMs dominate a torch forward
there). specd's gains
(per-document KV reuse, drafting, the planner, token healing) sit above the forward, so this
path gives the engine llama.cpp's forward behind the interface ``KVState`` drives
(``new_cache``, ``forward``, ``crop``, ``consistent``, ``nbytes``), on a GGUF file written
from the loaded weights (:mod:`specd.llamacpp.export`, same token ids).

Each document's cache is one *sequence* of ``window`` cells in a llama.cpp context, in its own
stream (a unified cache would make every forward attend over all documents' cells): a cache is
a sequence and a length; rollback is ``llama_memory_seq_rm`` past the length (nothing copied).
Contexts come in *slabs* of a few sequences, made when a cache needs one and freed when the last
of their sequences is: llama.cpp clears a context's K/V buffer when it makes it, so every cell of
a context is resident from then on, and one context for every sequence the budget could hold
would cost the whole budget at load. The cells of all slabs stay within ``engine.cache_budget_mb``
(``sequences`` windows); when no sequence can be had within it, the path asks the cache store
(``add_reclaimer``) to evict its least recently used document, and only when nothing is left to
evict does a new cache fail with "out of memory" (the engine's out-of-memory path).

Lossless stays defined the same way: greedy output equals the target alone. K/V are kept in
the weights' precision (f32 for f32 weights: llama-server's default f16 moves logits enough to
flip near-ties, f32 only as far as torch's own paths differ), so outputs match transformers'
greedy; tests check it on random and trained pairs. Built on llama-cpp-python 0.3's
``_internals`` (model, context, batch).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specd.engine.forward.path import BasicPath
from specd.llamacpp.handoff import HandoffError, TorchPrefill, as_ctypes
from specd.llamacpp.runtime import import_llama_cpp, model_params

log = logging.getLogger(__name__)

# Tokens per llama_decode call (a longer forward runs in pieces). Without flash attention each
# piece's attention spans every cell up to its end, masked, so smaller pieces skip more of the
# triangle a causal prefill leaves empty: a long prefill took less time in pieces of 256 than of
# 512 (llama.cpp's default), with logits identical to the bit, and smaller pieces were alike
# (cells come in blocks of 256): docs/llamacpp.md has the timings.
BATCH = 256
HANDOFF_TOKENS = 64  # prompts from an empty cache at least this long prefill on torch (see handoff.py)
# Sequences per llama.cpp context: at most SLAB_SEQUENCES, and at most 1/SLABS_PER_BUDGET of the
# budget's, so a budget fills in steps. A context costs megabytes beyond its cells (compute
# buffers: docs/llamacpp.md) and is made in one go, so one per sequence would add that to every
# document; larger slabs strand more free cells in a context that one live sequence keeps.
SLAB_SEQUENCES = 4
SLABS_PER_BUDGET = 4
GGML_F32, GGML_F16 = 0, 1  # ggml_type values of the KV cache's element type


class Slab:
    """One llama.cpp context of ``size`` sequences, each a stream of ``window`` cells."""

    def __init__(self, llama_cpp, model, params, size: int):
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if self.ctx is None:
            raise MemoryError(f"llama.cpp out of memory: could not make a context of {size} sequences")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.size = size
        self.free = list(range(size - 1, -1, -1))  # sequence ids not in use, the lowest last

    @property
    def used(self) -> int:
        return self.size - len(self.free)


class SequenceCache:
    """One document's KV cache: a sequence of a slab (its context) and how many positions it holds."""

    __slots__ = ("slab", "seq", "length", "__weakref__")

    def __init__(self, slab: Slab, seq: int):
        self.slab = slab
        self.seq = seq
        self.length = 0


class LlamaCppForward(BasicPath):
    """One concern: the forward path of one model (target or draft) on llama.cpp, for every document. Of the
    optional capabilities (``path.ForwardPath``) it has two: ``rows_from`` (llama.cpp computes
    logits for the positions a batch flags, and no others) and ``host_ids`` (``forward_ids``: a
    list in, numpy logits out, no torch in a decode step). Logits come with the forward, no
    token trees, nothing recorded.

    Threads: the engine's worker runs every forward; a cache dropped on another thread (a closed
    document) gives its sequence back there only if no forward runs, else the next call on the
    worker does (``_reap``): llama.cpp's contexts are not safe to share between threads."""

    name = "llamacpp"
    rows_from = True
    host_ids = True

    def __init__(self, gguf_path: str | Path, *, budget_bytes: int, window: int, threads: int = 1,
                 sequences: int | None = None, kv_bytes: int = 4, about: str = ""):
        """``sequences``: at most this many caches at once (default: as many windows as
        ``budget_bytes`` holds, at least one). ``about``: what the file is, for ``description``
        (a GGUF model's type and size)."""
        llama_cpp = import_llama_cpp()
        from llama_cpp import _internals as internals

        self._llama_cpp = llama_cpp
        self._model = internals.LlamaModel(path_model=str(gguf_path), params=model_params(gguf_path), verbose=False)
        model = self._model.model
        heads = llama_cpp.llama_model_n_head(model)
        head_dim = llama_cpp.llama_model_n_embd(model) // heads
        self.bytes_per_token = 2 * llama_cpp.llama_model_n_layer(model) * llama_cpp.llama_model_n_head_kv(model) \
            * head_dim * kv_bytes
        self.window = window  # positions one sequence (one document's cache) holds
        self.sequence_bytes = self.bytes_per_token * window  # resident from its slab's making
        fit = max(1, budget_bytes // max(1, self.sequence_bytes))
        self.sequences = fit if sequences is None else max(1, min(sequences, fit))
        self.slab_size = max(1, min(SLAB_SEQUENCES, self.sequences // SLABS_PER_BUDGET))
        params = llama_cpp.llama_context_default_params()
        params.n_batch = params.n_ubatch = BATCH
        params.kv_unified = False
        params.type_k = params.type_v = GGML_F32 if kv_bytes == 4 else GGML_F16
        params.n_threads = params.n_threads_batch = threads
        # Flash attention off, as llama-cpp-python's default: on the CPUs measured it sped up long
        # prefills and slowed narrow verifies, and specd's forwards are mostly narrow (docs/llamacpp.md).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._params = params
        self._slabs: list[Slab] = []
        self._batch = internals.LlamaBatch(n_tokens=BATCH, embd=0, n_seq_max=1, verbose=False)
        self.n_vocab = self._model.n_vocab()
        self.path = str(gguf_path)
        self.about = about
        self.slabs_made = 0  # contexts made so far (and freed again once empty)
        self._lock = threading.Lock()  # held by every call into a context, and by _reap
        self._released: list[tuple[Slab, int]] = []  # sequences given back while a call ran (finalizers)
        self._reclaimers: list[weakref.WeakMethod] = []  # see add_reclaimer
        # The native contexts go before the model they were made from, whatever frees which first.
        self._model._exit_stack.callback(self._free_slabs)
        self.torch_prefill = None  # a handoff.TorchPrefill: see use_torch_prefill
        self.prefill_note = ""

    @property
    def cells(self) -> int:
        """KV cells allocated now, in every slab."""
        return sum(slab.size for slab in self._slabs) * self.window

    @property
    def allocated_bytes(self) -> int:
        """K/V bytes of every slab made and not yet freed (resident: llama.cpp clears them)."""
        return self.cells * self.bytes_per_token

    @property
    def in_use(self) -> int:
        """Sequences held by caches now."""
        return sum(slab.used for slab in self._slabs)

    @property
    def description(self) -> str:
        """What ``specd doctor`` says of this path."""
        about = f" ({self.about})" if self.about else ""
        parts = [f"llama.cpp on {Path(self.path).name}{about}, up to {self.sequences} sequences of {self.window} "
                 f"cells ({self.sequence_bytes / 2**20:.0f} MiB each) in contexts of up to {self.slab_size} made as "
                 f"documents need them ({len(self._slabs)} now, {self.allocated_bytes / 2**20:.0f} MiB)"]
        if self.prefill_note:
            parts.append(self.prefill_note)
        return ", ".join(parts)

    def use_torch_prefill(self, lean) -> None:
        """Prefill prompts of ``HANDOFF_TOKENS`` or more from an empty cache on ``lean`` (torch's
        lean forward of the same model) and hand the K/V over (``handoff.TorchPrefill``), if a
        probe at load shows llama.cpp decodes from them as from its own; else say why not."""
        try:
            self.torch_prefill = TorchPrefill.calibrate(lean, self)
        except HandoffError as err:
            self.torch_prefill, self.prefill_note = None, f"prefills on llama.cpp: torch's K/V cannot be handed over ({err})"
            log.warning("llama.cpp forward: %s", self.prefill_note)
            return
        self.prefill_note = (f"prompts of {HANDOFF_TOKENS}+ tokens from an empty cache prefill on torch's lean forward "
                             f"(K/V handed over, keys {self.torch_prefill.mapping}; checked at load)")

    def read_state(self, cache: SequenceCache) -> bytes:
        """The sequence's cells as ``llama_state_seq_get_data`` writes them (handoff.py)."""
        with self._calling():
            ctx = cache.slab.ctx
            size = self._llama_cpp.llama_state_seq_get_size(ctx, cache.seq)
            buffer = (ctypes.c_uint8 * size)()
            written = self._llama_cpp.llama_state_seq_get_data(ctx, buffer, size, cache.seq)
        if not written:
            raise HandoffError(f"llama.cpp wrote no state for sequence {cache.seq}")
        return bytes(buffer)[:written]

    def write_state(self, cache: SequenceCache, data: bytes) -> None:
        """Replace the sequence's cells with ``data`` (``handoff.build``); on failure it is empty."""
        with self._calling():
            read = self._llama_cpp.llama_state_seq_set_data(cache.slab.ctx, as_ctypes(data), len(data), cache.seq)
            if read != len(data):
                self._seq_rm(cache, 0)
                cache.length = 0
                raise HandoffError(f"llama.cpp took {read} of {len(data)} bytes of sequence state")

    # ---- slabs: contexts made on demand, within the budget ------------------------------

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        """``reclaim()`` evicts the least recently used document's caches somewhere (a cache
        store's ``reclaim``), False when it has none left: called when a new cache finds no
        sequence within the budget. Held weakly (a bound method: the store may go)."""
        ref = weakref.WeakMethod(reclaim)
        with self._lock:
            self._reclaimers = [r for r in self._reclaimers if r() is not None and r != ref] + [ref]

    def new_cache(self) -> SequenceCache:
        """A free sequence: in the fullest slab that has one (so emptier ones drain and go), in a
        new slab while the budget has room, else one a reclaimer's eviction gives back."""
        reclaimers = [reclaim for reclaim in (ref() for ref in self._reclaimers) if reclaim is not None]
        while True:
            with self._calling():
                cache = self._take()
            if cache is not None:
                weakref.finalize(cache, self._release, cache.slab, cache.seq)
                return cache
            # One eviction at a time: a cache still held elsewhere (a request in flight) frees
            # nothing when its document leaves the store, so the next goes too.
            while reclaimers and not reclaimers[0]():
                reclaimers.pop(0)
            if not reclaimers:
                raise MemoryError(f"llama.cpp out of memory: all {self.sequences} cache sequences "
                                  f"({self.sequence_bytes * self.sequences >> 20} MiB) are in use")

    def _take(self) -> SequenceCache | None:
        open_slabs = [slab for slab in self._slabs if slab.free]
        if open_slabs:
            slab = max(open_slabs, key=lambda s: s.used)
        else:
            room = self.sequences - sum(s.size for s in self._slabs)
            if room <= 0:
                return None
            slab = self._make_slab(min(self.slab_size, room))
        return SequenceCache(slab, slab.free.pop())

    def _make_slab(self, size: int) -> Slab:
        params = self._params
        params.n_seq_max = size
        params.n_ctx = size * self.window
        slab = Slab(self._llama_cpp, self._model.model, params, size)
        self._slabs.append(slab)
        self.slabs_made += 1
        log.debug("llama.cpp context of %d sequences made (%d MiB of K/V in all)", size, self.allocated_bytes >> 20)
        return slab

    def _release(self, slab: Slab, seq: int) -> None:
        """A cache's finalizer, on whatever thread dropped it: its sequence goes back now if no
        call into a context runs, else when that call ends."""
        self._released.append((slab, seq))  # list.append: atomic
        self._release_pending()

    @contextmanager
    def _calling(self):
        """Hold the contexts for one call; sequences given back meanwhile are reaped after it."""
        with self._lock:
            self._reap()
            try:
                yield
            finally:
                self._reap()
        if self._released:  # given back as the call ended, by a finalizer that found the lock held
            self._release_pending()

    def _release_pending(self) -> None:
        if self._lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._lock.release()

    def _reap(self) -> None:
        """Empty the sequences given back (under ``_lock``), and free each slab left empty."""
        while self._released:
            slab, seq = self._released.pop()
            if slab.ctx is None:
                continue
            self._llama_cpp.llama_memory_seq_rm(slab.memory, seq, -1, -1)
            slab.free.append(seq)
            if not slab.used:
                self._slabs.remove(slab)
                self._free_slab(slab)
                log.debug("llama.cpp context of %d sequences freed (%d MiB of K/V left)", slab.size,
                          self.allocated_bytes >> 20)

    def _free_slab(self, slab: Slab) -> None:
        ctx, slab.ctx, slab.memory = slab.ctx, None, None
        if ctx is not None:
            self._llama_cpp.llama_free(ctx)

    def _free_slabs(self) -> None:
        for slab in self._slabs:
            self._free_slab(slab)
        self._slabs = []

    def _seq_rm(self, cache: SequenceCache, start: int) -> None:
        self._llama_cpp.llama_memory_seq_rm(cache.slab.memory, cache.seq, start, -1)

    # ---- the interface KVState drives --------------------------------------------------

    def forward(self, input_ids: torch.Tensor, cache: SequenceCache, last_only: bool = False,
                rows_from: int = 0) -> torch.Tensor:
        """Run ``input_ids`` [1, T] after the cache's positions; float32 logits [T - rows_from, V]
        of rows ``rows_from``.. ([1, V] when last_only). On failure the sequence is cut back to
        where it was and the error raised."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, T] with T >= 1, not {list(input_ids.shape)}")
        return torch.from_numpy(self.forward_ids(input_ids[0].tolist(), cache, last_only, rows_from))

    def forward_ids(self, ids: list[int], cache: SequenceCache, last_only: bool = False,
                    rows_from: int = 0) -> np.ndarray:
        """``forward`` of a list of ids, the logits as a numpy array: the decode loop's steps."""
        if not ids or not 0 <= rows_from < len(ids):
            raise ValueError(f"ids must hold at least one token (rows from {rows_from}), not {len(ids)}")
        start = cache.length
        if self.torch_prefill is not None and start == 0 and len(ids) >= HANDOFF_TOKENS:
            try:
                logits = self.torch_prefill.prefill(torch.tensor([ids], dtype=torch.long), cache, last_only)
                return (logits if last_only else logits[rows_from:]).contiguous().numpy()
            except BaseException:
                with self._calling():
                    self._seq_rm(cache, 0)
                cache.length = 0
                raise
        with self._calling():
            return self._decode(ids, cache, last_only, rows_from)

    def _decode(self, ids: list[int], cache: SequenceCache, last_only: bool, rows_from: int) -> np.ndarray:
        """``forward_ids`` on llama.cpp, under ``_lock``."""
        start = cache.length
        ctx = cache.slab.ctx
        rows: list[np.ndarray] = []
        try:
            for offset in range(0, len(ids), BATCH):
                chunk = ids[offset:offset + BATCH]
                last_chunk = offset + BATCH >= len(ids)
                skipped = len(chunk) if last_only else min(len(chunk), max(0, rows_from - offset))
                outputs = self._fill(chunk, start + offset, cache.seq, skipped, last_chunk)
                code = self._llama_cpp.llama_decode(ctx, self._batch.batch)
                if code != 0:  # 1: no KV cell free for the batch; <0: an error
                    what = "out of memory: no free KV cells" if code == 1 else f"llama_decode returned {code}"
                    raise MemoryError(f"llama.cpp {what} ({self.window} cells)") if code == 1 else RuntimeError(what)
                if outputs:
                    logits = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits(ctx),
                                                   shape=(outputs * self.n_vocab,))
                    rows.append(logits.reshape(outputs, self.n_vocab).copy())
        except BaseException:
            self._seq_rm(cache, start)
            raise
        cache.length = start + len(ids)
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def _fill(self, chunk: list[int], position: int, seq: int, skipped: int, last_chunk: bool) -> int:
        """Load the batch, asking for the logits of its tokens past the first ``skipped`` (and of
        the last chunk's last token); returns how many of its tokens ask for logits."""
        batch = self._batch.batch
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = position + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i >= skipped
        if last_chunk and skipped >= len(chunk):
            batch.logits[len(chunk) - 1] = True
            return 1
        return len(chunk) - skipped

    def crop(self, cache: SequenceCache, length: int) -> None:
        if not 0 <= length <= cache.length:
            raise ValueError(f"cannot crop a cache of {cache.length} tokens to {length}")
        with self._calling():
            self._seq_rm(cache, length)
        cache.length = length

    @staticmethod
    def consistent(cache: SequenceCache, length: int) -> bool:
        return cache.length == length

    def nbytes(self, cache: SequenceCache) -> int:
        """The sequence's cells, held or not: they are resident from its slab's making on."""
        return self.sequence_bytes


