"""``LeanForward``: the lean batch-1 forward of one HF decoder, over a static cache.

It runs the ``layers.Decoder`` its model's family module describes (``families/``): the layer
step, the embeddings and the LM head, the interface ``KVState`` drives (``path.ForwardPath``),
token trees, and replayed forwards (CUDA graphs, ``graphs.py``). Attention and masks live in
``attention``, rotary tables in ``rotary``, the product routes in ``layers`` and ``host``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

from specd.engine.forward.graphs import GRAPH_WIDTHS, Captured, CudaGraphs, EagerGraphs
from specd.engine.forward.lean import host
from specd.engine.forward.lean.attention import Mask, attend, positions_mask, sequence_mask, tree_depths, tree_mask
from specd.engine.forward.lean.cache import StaticCache
from specd.engine.forward.lean.families import family_of, unsupported_reason
from specd.engine.forward.lean.layers import NO_HOST, Layer, apply_norm, copies_pay, projection
from specd.engine.forward.lean.rotary import rope_tables, rotate

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

INITIAL_CAPACITY = 256  # positions a new cache holds before its first growth
GRAPH_CHECK_CONTEXT = 40  # tokens behind use_graphs' check forwards
RECORD_AFTER = 2  # a kind of replayed forward is recorded once asked for this many times
PREPARED_KINDS = 6  # prepare() records the kinds of forward (width, last row only) asked for most ...
PREPARED_PER_CALL = 2  # ... this many at a time (idle slices stay short)
# how far a replayed forward's logits may lie from the eager one's, relative to the largest logit
# (the same maths; attention over the whole capacity sums in another order)
GRAPH_TOLERANCE = {torch.float32: 1e-3, None: 5e-2}
NO_ROPE = (None, None)  # cos, sin of a layer without rotary positions


class LeanForward:
    """One concern: the batch-1 forward of one HF model of a registered family. Build once per model (check
    ``unsupported_reason`` first); caches come from ``new_cache``, one per sequence."""

    name = "lean"
    trees = True  # forward(parents=...) runs a token tree; keep() keeps one path of it
    rows_from = False  # prompt tokens ride with a step through the lazy head instead (on a CPU)
    host_ids = False  # torch tensors in and out (its rows come from the lazy head)
    gives_hidden = True  # forward(head=False) and head(), on every device

    def __init__(self, model: PreTrainedModel, transposed_weights: str = "auto"):
        """``transposed_weights``: hold every weight matrix a second time, transposed, so that
        each product runs in the layout MKL is fastest at for its width (``layers.Matmul``):
        "on", "off", or "auto" = on for a float32 model on a CPU with at most
        ``TRANSPOSED_WEIGHTS_MAX_BYTES`` of weights whose copies take at most a share of the memory
        available (``layers.copies_pay``). It costs the weights' memory again."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        if transposed_weights not in ("auto", "on", "off"):
            raise ValueError(f"transposed_weights must be auto, on or off, not {transposed_weights!r}")
        self.model = model
        self.max_positions = model.config.max_position_embeddings
        copy, self.transposed_note = (transposed_weights == "on", "") if transposed_weights != "auto" \
            else copies_pay(model)
        decoder = family_of(model).describe(model, copy)
        self.heads, self.kv_heads, self.head_dim = decoder.heads, decoder.kv_heads, decoder.head_dim
        self.act = decoder.act
        self.embed, self.embed_scale = decoder.embed, decoder.embed_scale
        self.positions, self.position_offset = decoder.positions, decoder.position_offset
        self.ropes = decoder.ropes
        self.layers = list(decoder.layers)
        self.final_norm, self.logit_scale, self.logit_cap = decoder.final_norm, decoder.logit_scale, decoder.logit_cap
        # rotated dims of each head, where fewer than all (partial rotary); every rotary kind turns as many
        rotary_dim = 2 * next(iter(self.ropes.values()))[0].numel() if self.ropes else None
        self.rotary_dim = rotary_dim if rotary_dim is not None and rotary_dim < self.head_dim else None
        self.lm_head = projection(model.lm_head, copy)
        if self.lm_head.narrow:
            self.lm_head = dataclasses.replace(self.lm_head, narrow=self.max_positions)  # measured: every width
        self.copied_bytes = sum(m.nbytes_copied() for layer in self.layers for m in layer.matmuls()) + \
            self.lm_head.nbytes_copied()
        self._tables: dict = {}  # rotary kind -> cos, sin tables [positions, head_dim], see _rope
        self.host_rows = NO_HOST
        self.host_note = ""  # what host_products measured, for the description
        self.graphs: CudaGraphs | EagerGraphs | None = None  # see use_graphs
        self.graph_note = ""
        self.recordings = 0  # graphs recorded so far (the planner does not time those forwards)
        # forwards asked for, by (width, last row only): a kind is recorded once asked for
        # ``record_after`` times (a prefill's odd-sized last piece is not worth a recording)
        self.uses: collections.Counter[tuple[int, bool]] = collections.Counter()
        self.record_after = RECORD_AFTER

    @property
    def description(self) -> str:
        """What ``specd doctor`` says of this path."""
        parts = ["static KV cache"]
        if self.copied_bytes:
            parts.append(f"weights also held transposed (+{self.copied_bytes / 2**20:.0f} MiB)")
        elif self.transposed_note:
            parts.append(self.transposed_note)
        if self.host_rows:
            rows = "1 row" if self.host_rows == {1} else f"{host.spans(self.host_rows)} rows"
            parts.append(f"products of {rows} through numpy's BLAS ({host.host_blas()})")
        if self.host_note:
            parts.append(self.host_note)
        if self.graph_note:
            parts.append(self.graph_note)
        return ", ".join(parts)

    def route_products(self, rows: frozenset[int]) -> None:
        """Run every product (the LM head's too) of ``rows`` (row counts) through numpy's BLAS;
        ``NO_HOST`` for none. Only products held in the [in, out] layout take it (float32 on a
        CPU: ``transposed_weights``, or GPT-2's Conv1D as stored)."""
        self.layers = [layer.routed(rows) for layer in self.layers]
        self.lm_head = self.lm_head.routed(rows)
        self.host_rows = rows if self.lm_head.host is not None else NO_HOST

    def host_products(self, setting: str = "auto", repeats: int = host.HOST_REPEATS) -> frozenset[int]:
        """Choose which products run through numpy's BLAS (``route_products``): "off" none, "on"
        every product of 1-``HOST_ROWS`` rows, "auto" what measures faster on this machine: a
        forward of each ``HOST_PROBES`` width (1: a decode step; 2: a short verify; 8), timed both
        ways, interleaved, ``repeats`` times after ``HOST_CONTEXT`` tokens; the row counts a
        probe stands for go to numpy if its forward was faster there by ``HOST_MARGIN`` (so a
        tie, within this machine's noise, stays on torch). numpy's BLAS runs on one thread
        (``limit_host_threads``). Returns the row counts chosen."""
        return host.choose_host_products(self, setting, repeats)

    # ---- the interface KVState drives (path.ForwardPath) -------------------------------

    @property
    def lazy_head(self) -> bool:
        """Verification reads logits row by row (``caches.LazyRows``) on a CPU; on a GPU one
        kernel for every row costs about one row, and each row read would be a device sync.
        Replayed forwards (``use_graphs``) compute every row, as on a GPU."""
        return self.embed.weight.device.type == "cpu" and self.graphs is None

    @property
    def replays(self) -> bool:
        """Whether narrow sequence forwards replay recorded graphs (``use_graphs``)."""
        return self.graphs is not None

    def forget_uses(self) -> None:
        self.uses.clear()

    @staticmethod
    def add_reclaimer(reclaim) -> None:
        """Nothing to do: a static cache is torch's memory, which the cache store bounds."""

    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> StaticCache:
        weight = self.embed.weight
        shape = (2, self.kv_heads, min(capacity, self.max_positions), self.head_dim)
        zeroed = self.graphs is not None  # see StaticCache
        make = torch.zeros if zeroed else torch.empty
        with torch.inference_mode():
            kv = [make(shape, dtype=weight.dtype, device=weight.device) for _ in self.layers]
        return StaticCache(kv, self.max_positions, zeroed)

    @staticmethod
    def cache_length(cache: StaticCache) -> int:
        return cache.length

    @staticmethod
    def crop(cache: StaticCache, length: int) -> None:
        """Keep the first ``length`` positions: a length move, nothing is copied."""
        if not 0 <= length <= cache.length:
            raise ValueError(f"cannot crop a cache of {cache.length} tokens to {length}")
        cache.length = length

    @staticmethod
    def nbytes(cache: StaticCache) -> int:
        return cache.nbytes()

    @staticmethod
    def consistent(cache: StaticCache, length: int) -> bool:
        return cache.length == length  # a failed forward never moves the length

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: StaticCache, last_only: bool = False,
                head: bool = True, parents: Sequence[int] | None = None) -> torch.Tensor:
        """Run ``input_ids`` [1, T] at positions cache.length .. cache.length + T - 1; return
        float32 logits [T, V] ([1, V] when last_only; on CPU with 4+ rows a transposed view, see
        ``_lm_head``), or with ``head=False`` the final hidden states [T, D] for ``self.head``
        to turn into logits row by row (``lazy_head``). ``cache.length`` moves only when the
        whole forward succeeded: a failure anywhere leaves it where it was (the slots it wrote
        lie past the length, harmless).

        ``parents``: the new tokens are a tree, not a sequence (token-tree verification):
        ``parents[i]`` is the index of token i's parent among them, -1 for the root (the first
        token, whose parent is the cache's last). Token i sits at position cache.length +
        depth(i) and sees the cache and its own ancestors only; its K/V take slot
        cache.length + i, and ``keep`` then moves one root-to-leaf path's slots into place."""
        start = cache.length
        width = input_ids.shape[1]
        if input_ids.shape[0] != 1 or width == 0:
            raise ValueError(f"input_ids must be [1, T] with T >= 1, not {list(input_ids.shape)}")
        end = start + width
        depths = None if parents is None else tree_depths(parents, width)
        last_position = end - 1 if depths is None else start + max(depths)
        if self.positions is not None and last_position + self.position_offset >= self.positions.num_embeddings:
            learned = self.positions.num_embeddings - self.position_offset
            raise ValueError(f"position {last_position} is past the model's {learned} learned positions")
        if self.graphs is not None and parents is None and head and width <= GRAPH_WIDTHS:
            key = (width, last_only)
            self.uses[key] += 1
            if key in cache.graphs or self.uses[key] >= self.record_after:
                return self._replayed(input_ids, cache, key)
        cache.reserve(end)
        device, dtype, n_rep = input_ids.device, self.embed.weight.dtype, self.heads // self.kv_heads
        positions = None if depths is None else torch.tensor(depths, device=device) + start
        ropes = self._rope(start, end, device, positions)  # kind -> cos, sin [T, 1, D]: broadcast over heads
        x = self._embed(input_ids)  # x: [T, hidden]
        if self.positions is not None:  # learned absolute positions, as HF adds them
            offset = self.position_offset
            x.add_(self.positions.weight[start + offset:end + offset] if positions is None else
                   self.positions.weight[positions + offset])
        if parents is None:
            def mask(window: int | None) -> Mask:
                return sequence_mask(start, end, window, device, dtype, n_rep)
        else:
            def mask(window: int | None) -> Mask:
                return tree_mask(start, parents, depths, window, device, dtype, n_rep)
        x = self._layers(x, cache.kv, ropes, mask, start, end)
        if last_only:
            x = x[-1:]
        x = apply_norm(x, self.final_norm)
        if not head:
            cache.length = end
            return x
        logits = self._lm_head(x)
        cache.length = end
        return logits.float()

    @staticmethod
    def keep(cache: StaticCache, start: int, slots: Sequence[int]) -> None:
        """After a tree forward from ``start``: keep the first ``start`` positions and then the
        K/V of ``slots`` (a root-to-leaf path, increasing), moved to start, start + 1, ...;
        the rest is dropped. A path that already lies in place (the first branch) moves nothing."""
        if not 0 <= start <= cache.length or any(not start <= s < cache.length for s in slots):
            raise ValueError(f"cannot keep slots {list(slots)} after {start} of a cache of {cache.length}")
        moved = [(i, s) for i, s in enumerate(slots, start) if i != s]
        if moved:
            with torch.inference_mode():
                first = moved[0][0]
                source = torch.tensor(list(slots[first - start:]), device=cache.kv[0].device)
                for kv in cache.kv:
                    kv[:, :, first:start + len(slots)] = kv[:, :, source]  # the gather copies first
        cache.length = start + len(slots)

    def forward_ids(self, ids: list[int], cache, last_only: bool = False, rows_from: int = 0):
        raise TypeError("the lean forward takes and gives torch tensors (no host ids)")

    @torch.inference_mode()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, V] of final hidden states ``x`` [T, D] (``forward(head=False)``)."""
        return self._lm_head(x).float()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] of ``input_ids`` [1, T], scaled as the model scales them."""
        x = F.embedding(input_ids[0], self.embed.weight)
        if self.embed_scale is None:
            return x
        if isinstance(self.embed_scale, torch.Tensor):  # Gemma: sqrt(hidden) rounded to the weights' dtype
            return x.mul_(self.embed_scale.to(x.dtype))
        return x.mul_(self.embed_scale)

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [T, V]. On a CPU in float32, 2 rows or more against the vocabulary-sized
        weight run as (weight @ x.T).T at every width (``layers.Matmul``); the result is then a
        transposed view, which every row-wise consumer takes as it is."""
        logits = self.lm_head(x)
        if self.logit_cap is not None:  # Gemma 2's and 3's soft cap, as HF computes it
            return torch.tanh(logits / self.logit_cap) * self.logit_cap
        return logits if self.logit_scale is None else logits / self.logit_scale

    # ---- replayed forwards (CUDA graphs, see graphs.py) ----------------------------------

    def use_graphs(self, setting: str = "auto") -> None:
        """Replay sequence forwards of 1-``GRAPH_WIDTHS`` tokens from recorded graphs: "auto" and
        "on" where the model is on a CUDA device ("on" elsewhere says why not in the
        description), "off" never; "eager" runs the same static-shape forwards unrecorded
        (tests). Check forwards of two kinds (run eagerly, recorded, then replayed a position
        on) must match the eager forward, or the path stays eager and the description says why."""
        if setting not in ("auto", "on", "off", "eager"):
            raise ValueError(f"cuda graphs must be auto, on or off, not {setting!r}")
        self.graphs, self.graph_note = None, ""
        device = self.embed.weight.device
        if setting == "off":
            return
        if setting != "eager" and device.type != "cuda":
            if setting == "on":
                self.graph_note = f"no CUDA graphs: the model is on {device.type}"
            return
        self.graphs = EagerGraphs() if setting == "eager" else CudaGraphs(device)
        problem = self._check_graphs()
        if problem is not None:
            self.graphs, self.graph_note = None, f"CUDA graphs off: {problem}"
            log.warning("lean forward: %s", self.graph_note)
            return
        self.graph_note = (f"{'CUDA graphs' if self.graphs.name == 'cuda' else 'static-shape forwards (eager)'}"
                           f" for 1-{GRAPH_WIDTHS}-token steps, recorded per document once a kind of step recurs")

    def _check_graphs(self) -> str | None:
        """None if replayed forwards match eager ones on this model, else what went wrong."""
        generator = torch.Generator().manual_seed(0)
        vocab, device = self.embed.weight.shape[0], self.embed.weight.device
        cache = self.new_cache(GRAPH_CHECK_CONTEXT + GRAPH_WIDTHS)
        tolerance = GRAPH_TOLERANCE.get(self.embed.weight.dtype, GRAPH_TOLERANCE[None])
        recorder = self.graphs
        try:
            with torch.inference_mode():
                prompt = torch.randint(0, vocab, (1, GRAPH_CHECK_CONTEXT), generator=generator).to(device)
                self.forward(prompt, cache, last_only=True)  # wider than any graph: eager
                for width, last_only in ((1, True), (3, False)):
                    ids = torch.randint(0, vocab, (1, width + 2), generator=generator).to(device)
                    for shift in (0, 1, 2):  # eager, then recorded, then replayed a position on
                        step, start = ids[:, shift:shift + width], GRAPH_CHECK_CONTEXT + shift
                        cache.length = start
                        replayed = self.forward(step, cache, last_only=last_only)
                        cache.length, self.graphs = start, None
                        try:
                            eager = self.forward(step, cache, last_only=last_only)
                        finally:
                            self.graphs = recorder
                        scale = max(1.0, eager.abs().max().item())
                        difference = (replayed - eager).abs().max().item()
                        if not difference <= tolerance * scale:  # NaN fails too
                            return (f"a replayed {width}-token forward differs from the eager one by "
                                    f"{difference:.3g} (logits up to {scale:.3g})")
                    if (width, last_only) not in cache.graphs:
                        return f"a {width}-token forward asked for three times was never recorded"
        except Exception as err:  # recording can fail where an op cannot be captured
            return f"recording a forward failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        finally:
            self.graphs = recorder
        return None

    def _replayed(self, input_ids: torch.Tensor, cache: StaticCache, key: tuple[int, bool]) -> torch.Tensor:
        """``forward`` of a few tokens through the cache's recorded graph for this width and
        output (recorded now if it has none); the logits are copied out of the graph's output."""
        start, width = cache.length, input_ids.shape[1]
        cache.reserve(start + width)
        captured = cache.graphs.get(key)
        if captured is None:
            captured = self._record(input_ids, cache, key[1])
            cache.graphs[key] = captured
        captured.ids.copy_(input_ids)
        captured.start.fill_(start)
        captured.replay()
        logits = captured.out.clone()
        cache.length = start + width
        return logits

    @torch.inference_mode()
    def prepare(self, cache: StaticCache, ahead: int, most: int = PREPARED_PER_CALL) -> int:
        """Idle work, so that the next request replays rather than records: room for ``ahead``
        more positions (a request that grew the cache would drop its recordings), then up to
        ``most`` recordings this cache lacks, of the kinds of forward asked for most so far (and
        at least ``record_after`` times). Returns how many were recorded (0 without graphs).
        The recordings' warm-up forwards write past the cache's length only: nothing it holds
        changes."""
        if self.graphs is None:
            return 0
        cache.reserve(cache.length + ahead)
        wanted = [key for key, uses in self.uses.most_common(PREPARED_KINDS) if uses >= self.record_after]
        missing = [(width, last_only) for width, last_only in wanted
                   if (width, last_only) not in cache.graphs and cache.length + width <= cache.capacity]
        device = self.embed.weight.device
        for width, last_only in missing[:most]:
            ids = torch.zeros(1, width, dtype=torch.long, device=device)
            cache.graphs[width, last_only] = self._record(ids, cache, last_only)
        return min(len(missing), most)

    def _record(self, input_ids: torch.Tensor, cache: StaticCache, last_only: bool) -> Captured:
        device, capacity = input_ids.device, cache.capacity
        ids = input_ids.clone()
        start = torch.tensor(cache.length, device=device)
        self._rope(0, capacity, device)  # tables for every position of the cache
        tables = dict(self._tables)
        kv = list(cache.kv)

        def run() -> torch.Tensor:
            return self._static_forward(ids, start, kv, capacity, last_only, tables)

        out, replay = self.graphs.record(run)
        self.recordings += 1
        return Captured(ids, start, out, replay, keep=(tables,))

    def _static_forward(self, ids: torch.Tensor, start: torch.Tensor, kv: list[torch.Tensor], capacity: int,
                        last_only: bool, tables: dict) -> torch.Tensor:
        """``forward`` with the first position a device tensor: every shape is fixed by the
        width and the capacity, nothing is read back to the host (so it can be recorded).
        ``tables``: rotary kind -> (cos, sin) tables over the capacity's positions."""
        positions = start + torch.arange(ids.shape[1], device=ids.device)
        ropes = {kind: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                 for kind, (cos, sin) in tables.items()}
        x = self._embed(ids)
        if self.positions is not None:
            x.add_(self.positions.weight[positions + self.position_offset])
        dtype, n_rep = self.embed.weight.dtype, self.heads // self.kv_heads

        def mask(window: int | None) -> Mask:
            return 0, positions_mask(positions, capacity, window, dtype, n_rep)

        x = self._layers(x, kv, ropes, mask, positions, capacity)
        if last_only:
            x = x[-1:]
        return self._lm_head(apply_norm(x, self.final_norm)).float()

    # ---- the layers ---------------------------------------------------------------------

    def _layers(self, x: torch.Tensor, kv: list[torch.Tensor], ropes: dict, mask: Callable[[int | None], Mask],
                start: int | torch.Tensor, end: int) -> torch.Tensor:
        """x [T, hidden] through every decoder layer; ``mask(window)`` builds the mask of each
        sliding window (None: full attention) once, for the layers that share it."""
        masks: dict[int | None, Mask] = {}
        for layer, layer_kv in zip(self.layers, kv):
            if layer.window not in masks:
                masks[layer.window] = mask(layer.window)
            cos, sin = ropes.get(layer.rope, NO_ROPE)
            x = self._decoder_layer(layer, x, layer_kv, cos, sin, start, end, masks[layer.window])
        return x

    def _decoder_layer(self, layer: Layer, x: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, start: int | torch.Tensor, end: int, mask: Mask) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (updated in place: x is this forward's own activation).
        cos/sin: rotary tables, None for a model with learned positions. K/V go to slots
        start .. end - 1; in a replayed forward ``start`` is the tensor of those slots and
        ``end`` the cache's capacity, all of which the mask's keys span."""
        width, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        h = normed = x if layer.attn_norm is None else apply_norm(x, layer.attn_norm)
        qkv = layer.qkv(h)
        if layer.projection_norms is not None:  # OLMo 2: q and k normalised whole, before the heads split
            q_size, k_size = heads * dim, kv_heads * dim
            qkv = torch.cat((apply_norm(qkv[:, :q_size], layer.projection_norms[0]),
                             apply_norm(qkv[:, q_size:q_size + k_size], layer.projection_norms[1]),
                             qkv[:, q_size + k_size:]), dim=-1)
        if layer.per_head_qkv:
            q, k, v = qkv.reshape(width, heads, 3, dim).unbind(2)  # each [T, H, D]
            if cos is not None:  # GPT-NeoX
                q, k = self._rotary(q, cos, sin), self._rotary(k, cos, sin)
        else:
            qkv = qkv.reshape(width, heads + 2 * kv_heads, dim)  # [T, H + KV + KV, D]
            qk, v = qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:]
            if layer.qk_norm is not None:
                qk = apply_norm(qk, layer.qk_norm)
            if cos is not None:
                qk = self._rotary(qk, cos, sin)  # qk: [T, H + KV, D], one rotation for both
            q, k = qk[:, :heads], qk[:, heads:]
        if isinstance(start, int):
            kv[0, :, start:end] = k.transpose(0, 1)
            kv[1, :, start:end] = v.transpose(0, 1)
        else:  # a replayed forward (_static_forward): start holds the new positions, on the device
            kv[0].index_copy_(1, start, k.transpose(0, 1))
            kv[1].index_copy_(1, start, v.transpose(0, 1))
        out = attend(q, kv, end, mask, layer.scale, layer.softcap, kv_heads)  # out: [T, H * D]
        if layer.parallel:  # the MLP reads the layer's input, not the attention's sum
            h = normed if layer.mlp_norm is layer.attn_norm else apply_norm(x, layer.mlp_norm)
            x.add_(layer.o(out))
        else:
            branch = layer.o(out)
            if layer.post_attn_norm is not None:
                branch = apply_norm(branch, layer.post_attn_norm)
            x.add_(_scaled(branch, layer.residual_scale))
            h = x if layer.mlp_norm is None else apply_norm(x, layer.mlp_norm)
        if layer.gate_up is not None:
            gate_up = layer.gate_up(h)
            size = layer.gate_up.sizes[0]
            h = self.act(gate_up[:, :size]).mul_(gate_up[:, size:])
        else:
            h = self.act(layer.up(h))
        h = layer.down(h)
        if layer.post_mlp_norm is not None:
            h = apply_norm(h, layer.post_mlp_norm)
        return x.add_(_scaled(h, layer.residual_scale))

    # ---- rotary positions ---------------------------------------------------------------

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated at its positions: every dim, or the first ``rotary_dim`` of
        each head with the rest passed through (partial rotary, as HF concatenates them)."""
        if self.rotary_dim is None:
            return rotate(x, cos, sin)
        return torch.cat((rotate(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]), dim=-1)

    def _rope(self, start: int, end: int, device: torch.device,
              positions: torch.Tensor | None = None) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Per rotary kind (``rotary.rotaries``; none for learned positions), cos and sign-folded
        sin [T, 1, D] for positions start .. end - 1 (or ``positions``, a token tree's, none past
        end - 1), from tables computed as HF's rotary embedding computes them (float32, then the
        model's dtype); the tables grow by doubling."""
        if not self.ropes:
            return {}
        dtype = self.embed.weight.dtype  # the model's, also after a .to() since the tables were built
        cos, _ = next(iter(self._tables.values()), (None, None))
        if cos is None or cos.shape[0] < end or cos.device != device or cos.dtype != dtype:
            size = max(end, min(2 * (0 if cos is None else cos.shape[0]), self.max_positions), INITIAL_CAPACITY)
            self._tables = {kind: rope_tables(inv_freq, scaling, size, device, dtype)
                            for kind, (inv_freq, scaling, _) in self.ropes.items()}
        if positions is not None:
            return {kind: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                    for kind, (cos, sin) in self._tables.items()}
        return {kind: (cos[start:end].unsqueeze(1), sin[start:end].unsqueeze(1))
                for kind, (cos, sin) in self._tables.items()}


def _scaled(branch: torch.Tensor, scale: float) -> torch.Tensor:
    """A residual branch times Granite's residual_multiplier, rounded as HF rounds it (the
    product first, then the sum); others' branches as they are."""
    return branch if scale == 1.0 else branch.mul_(scale)
