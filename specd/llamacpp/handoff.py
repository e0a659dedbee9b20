"""Prefill on torch, decode on llama.cpp: a sequence's K/V handed from one to the other.

On this project's CPUs each side is faster at one half of a completion: llama.cpp's one-token
forward costs about half of torch's, and torch's prefill (one MKL product per weight over the
whole prompt) about half of llama.cpp's (``specd bench`` forward costs, docs/llamacpp.md).
``engine.forward_backend = llamacpp`` with ``engine.llamacpp_prefill = torch`` runs a prompt that
starts a document's cache from empty on torch's lean forward (the same weights, already loaded),
writes the K/V it computed into the document's llama.cpp sequence, and decodes there.

The K/V go in through llama.cpp's own sequence-state API (``llama_state_seq_set_data``), in the
byte layout its ``llama_state_seq_get_data`` writes (``parse`` and ``build`` below; for
llama.cpp's KV cache with one stream per sequence, as ``LlamaCppForward`` builds it):

    u32 magic 0xaf143cd8, i32 seq_id, u32 n_stream,
    per stream: u32 cell_count, and when non-zero:
        per cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id
        u32 v_trans, u32 n_layer,
        per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K
        per layer, v_trans = 0: i32 v_type, u64 v_row_bytes, cell_count rows of V
                   v_trans = 1: i32 v_type, u32 v_element_bytes, u32 n_embd_v, then V transposed
                                (n_embd_v rows of cell_count elements)

K is stored after rotary embedding. llama.cpp's Llama graph rotates interleaved pairs, so the
GGUF export permutes q/k weights per head (``export.permute_rotary_rows``) and its K is a
per-head permutation of transformers' K; its Qwen2 graph rotates halves as transformers does. Which one
holds is not assumed: ``TorchPrefill.calibrate`` has llama.cpp prefill a probe itself, reads its
state back and finds the mapping under which torch's K/V equal llama.cpp's; then a probe handed
over must decode to llama.cpp's own logits. Anything else (another layout, another version of
the format) leaves the prefill on llama.cpp, and ``specd doctor`` says why.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
from dataclasses import dataclass

import numpy as np
import torch

from specd.llamacpp.export import permute_rotary_rows

MAGIC = 0xAF143CD8
GGML_TYPES = {0: np.float32, 1: np.float16}  # ggml_type -> element type of K/V rows
PROBE_TOKENS = 24  # tokens of the calibration prompt
PROBE_SEED = 0
TOLERANCE = 1e-3  # of the values' scale: how far torch's K/V and logits may lie from llama.cpp's


class HandoffError(RuntimeError):
    pass


@dataclass
class SequenceState:
    """One sequence's cells as llama.cpp's state API lays them out (see the module docstring)."""

    streams: int  # n_stream of the context
    stream: int  # the stream holding the cells
    positions: list[int]
    v_trans: bool
    k_type: int
    v_type: int
    keys: list[np.ndarray]  # per layer [cells, n_embd_k]
    values: list[np.ndarray]  # per layer [cells, n_embd_v]


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.offset = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value[0]

    def rows(self, dtype, count: int, shape: tuple[int, int]) -> np.ndarray:
        array = np.frombuffer(self.data, dtype, count, self.offset).reshape(shape)
        self.offset += array.nbytes
        return array


def parse(data: bytes) -> SequenceState:
    """A ``llama_state_seq_get_data`` buffer of one sequence, every byte accounted for."""
    reader = _Reader(data)
    try:
        if reader.take("<I") != MAGIC:
            raise HandoffError("not a llama.cpp sequence state (magic)")
        reader.take("<i")  # the source sequence id
        streams = reader.take("<I")
        found = None
        for stream in range(streams):
            cells = reader.take("<I")
            if cells == 0:
                continue
            if found is not None:
                raise HandoffError("cells in more than one stream")
            positions = []
            for _ in range(cells):
                positions.append(reader.take("<i"))
                for _ in range(reader.take("<I")):
                    reader.take("<i")
            v_trans, layers = bool(reader.take("<I")), reader.take("<I")
            keys, values, k_type, v_type = [], [], 0, 0
            for _ in range(layers):
                k_type, row = reader.take("<i"), reader.take("<Q")
                dtype = GGML_TYPES[k_type]
                width = row // np.dtype(dtype).itemsize
                keys.append(reader.rows(dtype, cells * width, (cells, width)))
            for _ in range(layers):
                v_type = reader.take("<i")
                dtype = GGML_TYPES[v_type]
                if v_trans:
                    reader.take("<I")  # element bytes
                    width = reader.take("<I")
                    values.append(reader.rows(dtype, cells * width, (width, cells)).T)
                else:
                    width = reader.take("<Q") // np.dtype(dtype).itemsize
                    values.append(reader.rows(dtype, cells * width, (cells, width)))
            found = SequenceState(streams, stream, positions, v_trans, k_type, v_type, keys, values)
    except (struct.error, ValueError, KeyError) as err:
        raise HandoffError(f"unexpected sequence state layout: {err}") from err
    if reader.offset != len(data):
        raise HandoffError(f"unexpected sequence state layout: {len(data) - reader.offset} bytes left over")
    if found is None:
        raise HandoffError("an empty sequence state")
    return found


def build(state: SequenceState, seq: int) -> bytes:
    """The buffer ``llama_state_seq_set_data`` reads to give sequence ``seq`` these cells."""
    cells = len(state.positions)
    parts = [struct.pack("<IiI", MAGIC, seq, state.streams)]
    for stream in range(state.streams):
        if stream != state.stream:
            parts.append(struct.pack("<I", 0))
            continue
        parts.append(struct.pack("<I", cells))
        parts.append(np.array([(position, 1, seq) for position in state.positions], dtype="<i4").tobytes())
        parts.append(struct.pack("<II", int(state.v_trans), len(state.keys)))
        k_dtype, v_dtype = GGML_TYPES[state.k_type], GGML_TYPES[state.v_type]
        for keys in state.keys:
            rows = np.ascontiguousarray(keys, dtype=k_dtype)
            parts += [struct.pack("<iQ", state.k_type, rows.shape[1] * rows.itemsize), rows.tobytes()]
        for values in state.values:
            if state.v_trans:
                columns = np.ascontiguousarray(values.T, dtype=v_dtype)
                parts += [struct.pack("<iII", state.v_type, columns.itemsize, columns.shape[0]), columns.tobytes()]
            else:
                rows = np.ascontiguousarray(values, dtype=v_dtype)
                parts += [struct.pack("<iQ", state.v_type, rows.shape[1] * rows.itemsize), rows.tobytes()]
    return b"".join(parts)


# K [cells, heads * D] as llama.cpp holds it, from transformers' layout: as it is, or with each
# head's dims moved as the GGUF export moves the K projection's rows (``export.permute_rotary_rows``)
MAPPINGS = {"as is": lambda keys, heads: keys, "interleaved": lambda keys, heads: permute_rotary_rows(keys.T, heads).T}


class TorchPrefill:
    """Prefills from an empty cache on torch's lean forward and hands the K/V to llama.cpp."""

    def __init__(self, lean, forward, mapping: str, template: SequenceState):
        self.lean = lean  # the lean forward (specd.engine.forward.lean.LeanForward) of the same model
        self.forward = forward  # the LlamaCppForward whose sequences receive the K/V
        self.mapping = mapping
        self.template = template  # streams, stream index, V transposition, element types (no cells)

    @classmethod
    def calibrate(cls, lean, forward) -> "TorchPrefill":
        """Check, on a probe, that torch's K/V are llama.cpp's under one mapping and that a
        sequence given them decodes as llama.cpp's own does; raises HandoffError (why) if not."""
        generator = torch.Generator().manual_seed(PROBE_SEED)
        vocab = min(forward.n_vocab, lean.embed.weight.shape[0])
        probe = torch.randint(0, vocab, (1, PROBE_TOKENS + 1), generator=generator)
        cache = forward.new_cache()  # one sequence: a context may hold no more
        try:
            forward.forward(probe[:, :PROBE_TOKENS], cache, last_only=True)
            theirs = parse(forward.read_state(cache))
            step = probe[:, PROBE_TOKENS:]
            expected = forward.forward(step, cache, last_only=True)
            forward.crop(cache, 0)
            keys, values = cls._torch_kv(lean, probe[:, :PROBE_TOKENS])[1:]
            scale = max(1.0, *(float(np.abs(v).max()) for v in theirs.keys))

            def agree(mine: list[np.ndarray], other: list[np.ndarray]) -> bool:
                return len(mine) == len(other) and all(
                    a.shape == b.shape and float(np.abs(a - b).max()) <= TOLERANCE * scale for a, b in zip(mine, other))

            mapping = next((name for name, permute in MAPPINGS.items()
                            if agree([permute(k, lean.kv_heads) for k in keys], theirs.keys)), None)
            if mapping is None:
                raise HandoffError("torch's keys are not llama.cpp's under any known rotary layout")
            if not agree(values, theirs.values):
                raise HandoffError("torch's values are not llama.cpp's")
            # the layout only: the probe's own cells are not kept
            prefill = cls(lean, forward, mapping, dataclasses.replace(theirs, positions=[], keys=[], values=[]))
            prefill.prefill(probe[:, :PROBE_TOKENS], cache, last_only=True)
            got = forward.forward(step, cache, last_only=True)
            logit_scale = max(1.0, float(expected.abs().max()))
            if not float((got - expected).abs().max()) <= TOLERANCE * logit_scale:
                raise HandoffError("a sequence given torch's K/V decodes otherwise than llama.cpp's own")
            return prefill
        finally:
            del cache  # its sequence goes back to the free list

    @staticmethod
    def _torch_kv(lean, input_ids: torch.Tensor, last_only: bool = True):
        """(logits, keys, values): the lean forward over ``input_ids`` from empty; K and V per
        layer as [tokens, kv_heads * head_dim] float32 arrays."""
        width = input_ids.shape[1]
        cache = lean.new_cache(width)
        with torch.inference_mode():
            logits = lean.forward(input_ids, cache, last_only=last_only).contiguous()
            flat = [kv[:, :, :width].transpose(1, 2).reshape(2, width, -1).float().numpy() for kv in cache.kv]
        return logits, [f[0] for f in flat], [f[1] for f in flat]

    def prefill(self, input_ids: torch.Tensor, cache, last_only: bool) -> torch.Tensor:
        """Run ``input_ids`` on torch and give ``cache`` (an empty llama.cpp sequence) their K/V;
        the logits as ``LlamaCppForward.forward`` returns them."""
        logits, keys, values = self._torch_kv(self.lean, input_ids, last_only)
        permute = MAPPINGS[self.mapping]
        template = self.template
        # any stream index: llama.cpp puts the cells in the receiving sequence's own stream
        state = SequenceState(template.streams, template.stream, list(range(input_ids.shape[1])),
                              template.v_trans, template.k_type, template.v_type,
                              [permute(k, self.lean.kv_heads) for k in keys], values)
        self.forward.write_state(cache, build(state, cache.seq))
        cache.length = input_ids.shape[1]
        return logits


def as_ctypes(data: bytes):
    """A ctypes uint8 array over a copy of ``data`` (what llama.cpp's state API takes)."""
    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
