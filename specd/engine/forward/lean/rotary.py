"""Rotary positions as the lean forward computes them: a model's rotary embeddings read from its
HF module, the cos/sin tables (float32, cast to the model's dtype, as HF computes them), and the
rotation of q and k."""

from __future__ import annotations

import torch
from torch import nn

# Rotary types with fixed frequencies and scale: HF computes inv_freq and attention_scaling once.
# "dynamic" and "longrope" change them with the sequence length, so they stay on the HF path.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rotaries(rotary: nn.Module) -> dict[str | None, tuple[torch.Tensor, float, str]]:
    """A model's rotary embeddings: layer type -> (inv_freq, attention scaling, rope type).
    One for most models (key None); Gemma 3 keeps one per layer type (sliding layers turn at
    another base than full ones), as ``<type>_inv_freq`` buffers."""
    if hasattr(rotary, "inv_freq"):
        return {None: (rotary.inv_freq, rotary.attention_scaling, getattr(rotary, "rope_type", None))}
    return {kind: (getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling"),
                   rotary.rope_type[kind]) for kind in rotary.rope_type}


def rope_tables(inv_freq: torch.Tensor, scaling: float, size: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin [size, D] for positions 0 .. size - 1, computed in float32 and
    cast to ``dtype`` (the model's)."""
    with torch.inference_mode():
        inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        freqs = torch.arange(size, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        half = emb.shape[-1] // 2  # the rotated dims (all of a head's, unless partial)
        # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2]: one op instead of slice+neg+cat
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for x [T, heads, D]: x * cos + rotate_half(x) * sin, with
    rotate_half(x) * sin == roll(x, D/2) * sin_folded (negation is exact, so are the products)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
