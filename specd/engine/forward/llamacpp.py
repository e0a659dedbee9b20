"""llama.cpp as the engine's forward path: specd's decoding on llama.cpp's kernels.

On a CPU, llama.cpp runs the same weights faster than torch (``specd bench`` forward costs;
figures in docs/llamacpp.md: per-op dispatch and small-batch GEMMs dominate a torch forward
there). specd's gains
(per-document KV reuse, drafting, the planner, token healing) sit above the forward, so this
path gives the engine llama.cpp's forward behind the interface ``KVState`` drives
(``new_cache``, ``forward``, ``crop``, ``consistent``, ``nbytes``), on a GGUF file written
from the loaded weights (:mod:`specd.llamacpp.export`, same token ids).

One llama.cpp context holds every document's cache as one *sequence*, each in its own stream
of ``window`` cells (a unified cache would make every forward attend over all documents'
cells): a cache is a sequence id and a length; rollback is ``llama_memory_seq_rm`` past the
length (nothing copied); a cache dropped by the engine (LRU eviction, a closed document) frees
its sequence. How many sequences: as many windows as ``engine.cache_budget_mb`` holds, at most
``MAX_SEQUENCES``; when all are taken, a new cache fails with "out of memory", which the engine
answers as it does a torch OOM (evict the other documents, retry once).

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
from pathlib import Path

import numpy as np
import torch

from specd.engine.forward.path import BasicPath
from specd.llamacpp.handoff import HandoffError, TorchPrefill, as_ctypes
from specd.llamacpp.runtime import import_llama_cpp, model_params

log = logging.getLogger(__name__)

# Tokens per llama_decode call (a longer forward runs in pieces). Without flash attention each
# piece's attention spans every cell up to its end, masked, so smaller pieces skip more of the
# triangle a causal prefill leaves empty: a 1,555-token prefill took 8% less time in pieces of
# 256 than of 512 (llama.cpp's default) on the dev pair's Q8_0 file and 4.5% less on a real-shaped
# 82M one, with logits identical to the bit; 32-256 were alike (cells come in blocks of 256).
BATCH = 256
HANDOFF_TOKENS = 64  # prompts from an empty cache at least this long prefill on torch (see handoff.py)
MAX_SEQUENCES = 16  # documents (per model) whose caches the context holds at once, budget allowing
GGML_F32, GGML_F16 = 0, 1  # ggml_type values of the KV cache's element type


class SequenceCache:
    """One document's KV cache in the shared context: a sequence id and how many positions it holds."""

    __slots__ = ("seq", "length", "__weakref__")

    def __init__(self, seq: int):
        self.seq = seq
        self.length = 0


class LlamaCppForward(BasicPath):
    """The forward path of one model (target or draft) on llama.cpp, for every document. Of the
    optional capabilities (``path.ForwardPath``) it has two: ``rows_from`` (llama.cpp computes
    logits for the positions a batch flags, and no others) and ``host_ids`` (``forward_ids``: a
    list in, numpy logits out, no torch in a decode step). Logits come with the forward, no
    token trees, nothing recorded."""

    name = "llamacpp"
    rows_from = True
    host_ids = True

    def __init__(self, gguf_path: str | Path, *, budget_bytes: int, window: int, threads: int = 1,
                 sequences: int = MAX_SEQUENCES, kv_bytes: int = 4, about: str = ""):
        """``about``: what the file is, for ``description`` (a GGUF model's type and size)."""
        llama_cpp = import_llama_cpp()
        from llama_cpp import _internals as internals

        self._llama_cpp = llama_cpp
        self._model = internals.LlamaModel(path_model=str(gguf_path), params=model_params(gguf_path), verbose=False)
        model = self._model.model
        heads = llama_cpp.llama_model_n_head(model)
        head_dim = llama_cpp.llama_model_n_embd(model) // heads
        self.bytes_per_token = 2 * llama_cpp.llama_model_n_layer(model) * llama_cpp.llama_model_n_head_kv(model) \
            * head_dim * kv_bytes
        # One stream of ``window`` cells per sequence (not a unified cache: there every forward
        # attends over the cells of all documents, masked).
        sequences = max(1, min(sequences, budget_bytes // max(1, self.bytes_per_token * window)))
        cells = sequences * window
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = params.n_ubatch = BATCH
        params.n_seq_max = sequences
        params.kv_unified = False
        params.type_k = params.type_v = GGML_F32 if kv_bytes == 4 else GGML_F16
        params.n_threads = params.n_threads_batch = threads
        # Flash attention off, as llama-cpp-python's default: on the CPUs measured it sped up long
        # prefills and slowed narrow verifies, and specd's forwards are mostly narrow (docs/llamacpp.md).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._batch = internals.LlamaBatch(n_tokens=BATCH, embd=0, n_seq_max=1, verbose=False)
        self.n_vocab = self._model.n_vocab()
        self.cells = cells
        self.window = window  # positions one sequence (one document's cache) holds
        self.path = str(gguf_path)
        self.about = about
        self.sequences = sequences
        self._free = list(range(sequences - 1, -1, -1))
        self._lock = threading.Lock()  # the free list: finalizers may run on any thread
        self.torch_prefill = None  # a handoff.TorchPrefill: see use_torch_prefill
        self.prefill_note = ""

    @property
    def description(self) -> str:
        """What ``specd doctor`` says of this path."""
        about = f" ({self.about})" if self.about else ""
        parts = [f"llama.cpp on {Path(self.path).name}{about}, {self.sequences} sequences of "
                 f"{self.cells // self.sequences} cells"]
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
        ctx = self._ctx.ctx
        size = self._llama_cpp.llama_state_seq_get_size(ctx, cache.seq)
        buffer = (ctypes.c_uint8 * size)()
        written = self._llama_cpp.llama_state_seq_get_data(ctx, buffer, size, cache.seq)
        if not written:
            raise HandoffError(f"llama.cpp wrote no state for sequence {cache.seq}")
        return bytes(buffer)[:written]

    def write_state(self, cache: SequenceCache, data: bytes) -> None:
        """Replace the sequence's cells with ``data`` (``handoff.build``); on failure it is empty."""
        read = self._llama_cpp.llama_state_seq_set_data(self._ctx.ctx, as_ctypes(data), len(data), cache.seq)
        if read != len(data):
            self._ctx.kv_cache_seq_rm(cache.seq, -1, -1)
            cache.length = 0
            raise HandoffError(f"llama.cpp took {read} of {len(data)} bytes of sequence state")

    # ---- the interface KVState drives --------------------------------------------------

    def new_cache(self) -> SequenceCache:
        with self._lock:
            if not self._free:
                raise MemoryError(f"llama.cpp out of memory: all {self.sequences} cache sequences are in use")
            seq = self._free.pop()
        cache = SequenceCache(seq)
        weakref.finalize(cache, self._release, seq)
        return cache

    def _release(self, seq: int) -> None:
        self._ctx.kv_cache_seq_rm(seq, -1, -1)
        with self._lock:
            self._free.append(seq)

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
                self._ctx.kv_cache_seq_rm(cache.seq, -1, -1)
                cache.length = 0
                raise
        rows: list[np.ndarray] = []
        try:
            for offset in range(0, len(ids), BATCH):
                chunk = ids[offset:offset + BATCH]
                last_chunk = offset + BATCH >= len(ids)
                skipped = len(chunk) if last_only else min(len(chunk), max(0, rows_from - offset))
                outputs = self._fill(chunk, start + offset, cache.seq, skipped, last_chunk)
                code = self._llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
                if code != 0:  # 1: no KV cell free for the batch; <0: an error
                    what = "out of memory: no free KV cells" if code == 1 else f"llama_decode returned {code}"
                    raise MemoryError(f"llama.cpp {what} ({self.cells} cells)") if code == 1 else RuntimeError(what)
                if outputs:
                    logits = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits(self._ctx.ctx),
                                                   shape=(outputs * self.n_vocab,))
                    rows.append(logits.reshape(outputs, self.n_vocab).copy())
        except BaseException:
            self._ctx.kv_cache_seq_rm(cache.seq, start, -1)
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
        self._ctx.kv_cache_seq_rm(cache.seq, length, -1)
        cache.length = length

    @staticmethod
    def consistent(cache: SequenceCache, length: int) -> bool:
        return cache.length == length

    def nbytes(self, cache: SequenceCache) -> int:
        return cache.length * self.bytes_per_token


