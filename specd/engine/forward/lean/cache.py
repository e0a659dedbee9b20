"""The lean forward's KV cache: one sequence's keys and values for every layer, in preallocated
slots; a rollback moves its length, nothing is copied."""

from __future__ import annotations

import torch

from specd.engine.forward.graphs import Captured


class StaticCache:
    """K/V of one sequence (batch 1) for every layer, in preallocated slots.

    ``kv[layer]``: [2, kv_heads, capacity, head_dim], keys then values. Slots ``[:length]`` are
    valid; slots past ``length`` are garbage and harmless, so a rollback only lowers ``length``.
    Capacity doubles when a forward needs more (one copy, amortized), up to the model's
    max_position_embeddings, and past it only as far as a forward actually reaches."""

    def __init__(self, kv: list[torch.Tensor], max_positions: int, zeroed: bool = False):
        """``zeroed``: every slot starts at zero, also after growth (a replayed forward attends
        over the whole capacity under a mask, and a never-written slot holding NaN bits would
        still poison it: NaN times a zero weight is NaN)."""
        self.kv = kv
        self.length = 0
        self.max_positions = max_positions
        self.zeroed = zeroed
        self.graphs: dict[tuple[int, bool], Captured] = {}  # (width, last_only): see graphs.py

    @property
    def capacity(self) -> int:
        return self.kv[0].shape[2] if self.kv else 0

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` positions. All layers grow together or none does."""
        if needed <= self.capacity:
            return
        capacity = max(self.capacity, 1)
        while capacity < needed:
            capacity *= 2
        capacity = max(needed, min(capacity, self.max_positions))
        grown = []
        for old in self.kv:
            shape = (old.shape[0], old.shape[1], capacity, old.shape[3])
            new = old.new_zeros(shape) if self.zeroed else old.new_empty(shape)
            new[:, :, :self.length] = old[:, :, :self.length]
            grown.append(new)
        self.kv = grown
        self.graphs.clear()  # they replay the old tensors

    def nbytes(self) -> int:
        """K/V and the outputs of the recorded graphs (each holds its logits on the device)."""
        held = [*self.kv, *(captured.out for captured in self.graphs.values())]
        return sum(t.numel() * t.element_size() for t in held)

