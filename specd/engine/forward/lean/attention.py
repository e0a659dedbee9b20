"""Attention as the lean forward computes it: ``scaled_dot_product_attention`` over a static
cache's slots (query heads grouped per kv head for narrow forwards, per head for prefills), the
soft-capped attention SDPA cannot do (Gemma 2), and the additive masks: causal among new tokens,
sliding windows, token trees, and the whole-capacity mask of a replayed forward.

A mask is ``(first key slot attended, bias)``: bias is an additive float mask, ``CAUSAL`` (SDPA's
own causal path, for a wide forward from position 0) or None (one query sees every key)."""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F

CAUSAL = torch.empty(0, dtype=torch.bool)  # marks "is_causal" in place of a mask tensor
WIDE = 64  # forwards at least this wide (prefills) attend per head; narrower ones group the queries
Mask = tuple[int, torch.Tensor | None]  # (first key slot attended, additive mask / CAUSAL / None)


@functools.lru_cache(maxsize=None)
def sdpa_has_gqa() -> bool:
    """Whether this torch's scaled_dot_product_attention takes ``enable_gqa`` (2.5 and later)."""
    q = torch.zeros(1, 2, 1, 1)
    try:
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


def attend(q: torch.Tensor, kv: torch.Tensor, end: int, mask: Mask, scale: float, softcap: float | None,
           kv_heads: int) -> torch.Tensor:
    """Attention of q [T, H, D] over the cache's keys/values ``kv`` [2, KV, S, D] up to ``end``;
    [T, H * D]. 4-D inputs throughout: the CPU flash kernel takes only those (3-D ones fall to
    the math path)."""
    width, heads, head_dim = q.shape
    first, attn_mask = mask
    keys, values = kv[:, :, first:end].unsqueeze(1)  # each [1, KV, S, D]
    if softcap is not None:
        return attend_capped(q, keys, values, attn_mask, scale, softcap, kv_heads)
    if width < WIDE:
        # GQA without expanding K/V: the n_rep query heads sharing a kv head become n_rep * T
        # query rows of that head (HF's repeat_kv pairs head h with kv head h // n_rep).
        q = q.transpose(0, 1).reshape(1, kv_heads, -1, head_dim)  # q: [1, KV, n_rep * T, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale)
        return out.view(heads, width, head_dim).transpose(0, 1).reshape(width, -1)
    # A prefill: per-head queries, so the kernel's causal path can skip masked blocks.
    if sdpa_has_gqa():
        gqa = {"enable_gqa": True}
    else:  # an older torch: expand the kv heads (a prefill-sized copy, once per layer)
        gqa, n_rep = {}, heads // kv_heads
        keys, values = keys.repeat_interleave(n_rep, 1), values.repeat_interleave(n_rep, 1)
    causal = attn_mask is CAUSAL
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, is_causal=causal,
                                         attn_mask=None if causal else attn_mask, scale=scale, **gqa)
    return out[0].transpose(0, 1).reshape(width, -1)


def attend_capped(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None,
                  scale: float, cap: float, kv_heads: int) -> torch.Tensor:
    """Attention whose scores are soft-capped (Gemma 2), which SDPA cannot do: transformers'
    eager formula, step for step (scores times the scale, cap * tanh(scores / cap), plus the
    mask, softmax in float32), with the query heads grouped per kv head as a narrow forward
    groups them (``attend``)."""
    width, heads, head_dim = q.shape
    n_rep = heads // kv_heads
    q = q.transpose(0, 1).reshape(1, kv_heads, n_rep * width, head_dim)  # [1, KV, n_rep * T, D]
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [1, KV, n_rep * T, S]
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is CAUSAL:  # a prefill from position 0: queries and keys are the same positions
        attn_mask = torch.full((width, width), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
    if attn_mask is not None:
        scores = scores + (attn_mask if attn_mask.shape[0] == scores.shape[2] else attn_mask.repeat(n_rep, 1))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, values)  # [1, KV, n_rep * T, D]
    return out.view(heads, width, head_dim).transpose(0, 1).reshape(width, -1)


def sequence_mask(start: int, end: int, window: int | None, device: torch.device, dtype: torch.dtype,
                  n_rep: int) -> Mask:
    """(first key slot, mask) for queries at positions start .. end - 1: each sees the keys at
    or before its own position (and, with a sliding window, after its position minus the
    window). The mask is additive in ``dtype`` (the model's), [T, S] for a wide forward and
    [n_rep * T, S] for a narrow one (``n_rep`` query heads per kv head, see ``attend``); None
    for one query; CAUSAL for a wide one from position 0."""
    first = 0 if window is None else max(0, start - window + 1)
    width = end - start
    if width == 1:
        return first, None
    if width >= WIDE and start == 0 and window is None:
        return 0, CAUSAL
    query = torch.arange(start, end, device=device).unsqueeze(1)  # [T, 1]
    key = torch.arange(first, end, device=device).unsqueeze(0)  # [1, S]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    # Additive float: SDPA's CPU kernel would first turn a boolean mask into this, per layer.
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, float("-inf"))
    return first, bias if width >= WIDE else bias.repeat(n_rep, 1)


def tree_mask(start: int, parents: Sequence[int], depths: list[int], window: int | None, device: torch.device,
              dtype: torch.dtype, n_rep: int) -> Mask:
    """``sequence_mask`` for a token tree (``LeanForward.forward(parents=...)``): token i sees
    the cache and the tree's tokens on its own root path; a sliding window counts positions
    (depths), not slots."""
    width = len(parents)
    end_position = start + max(depths)
    first = 0 if window is None else max(0, start - window + 1)
    allowed = torch.zeros(width, start + width - first, dtype=torch.bool)
    allowed[:, :start - first] = True
    for i, parent in enumerate(parents):
        row = allowed[i, start - first:]
        if parent >= 0:
            row.copy_(allowed[parent, start - first:])
        row[i] = True
    if window is not None and end_position - window + 1 > first:
        key = torch.cat([torch.arange(first, start), torch.tensor(depths) + start]).unsqueeze(0)
        query = (torch.tensor(depths) + start).unsqueeze(1)
        allowed &= key > query - window
    bias = torch.zeros(allowed.shape, dtype=dtype)
    bias.masked_fill_(~allowed, float("-inf"))
    bias = bias.to(device)
    return first, bias if width >= WIDE else bias.repeat(n_rep, 1)


def tree_depths(parents: Sequence[int], width: int) -> list[int]:
    """Depth of each token of a tree given as parent indexes (-1: the root, depth 0); every
    parent comes before its children, and only the first token is a root."""
    if len(parents) != width:
        raise ValueError(f"{len(parents)} parents for {width} tokens")
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if (parent < 0) != (i == 0) or parent >= i:
            raise ValueError(f"not a token tree: token {i} has parent {parent} (the first token is "
                             "the only root, and parents come before their children)")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def positions_mask(positions: torch.Tensor, capacity: int, window: int | None, dtype: torch.dtype,
                   n_rep: int) -> torch.Tensor:
    """``sequence_mask`` over every slot of a cache of ``capacity`` for queries at ``positions``
    (a device tensor), as the grouped queries of a narrow forward read it (a replayed forward:
    nothing is read back to the host)."""
    key = torch.arange(capacity, device=positions.device).unsqueeze(0)  # [1, S]
    query = positions.unsqueeze(1)  # [T, 1]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    bias = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    bias.masked_fill_(~allowed, float("-inf"))
    return bias.repeat(n_rep, 1)
