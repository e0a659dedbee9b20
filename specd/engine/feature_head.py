"""The feature head: a one-layer draft that reads the target's own final hidden state (the idea
of EAGLE, Li et al. 2024), its network and its file format.

At a position t the target's final hidden state h_t (after its last norm: what its LM head
scores) already summarises the whole context. Given h_t and the token x_{t+1} the target then
emitted, one decoder layer predicts h_{t+1}; scoring that prediction with the target's own head
rows gives the token after. Drafting a chain feeds each predicted state back in with the token it
scored. A small student trained from scratch must learn the context itself; the head only has to
carry the target's summary one token on, which is why it agrees far more often at the same cost.

Why the head scores a reduced vocabulary: a draft step's cost is the layer plus the head, and at
a vocabulary of tens of thousands the head would be most of it; the rows of the target's most
frequent tokens on code (``vocab``) cover nearly every token it emits there. The input side reads
the target's whole embedding table, which is not stored here: the loader is handed it
(``FeatureHead.load(folder, embedding)``), so a head file carries only what it trained.

File format (a folder): ``head.json`` (``HeadConfig``'s fields, ``format``) and
``head.safetensors`` (the layer's weights, ``vocab`` and ``rows``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FORMAT = "specd-feature-head"
CONFIG_FILE = "head.json"
WEIGHTS_FILE = "head.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    hidden: int                 # the target's hidden size (its final hidden state's width)
    heads: int                  # attention heads of the head's one layer
    intermediate: int           # its MLP's width
    vocab_size: int             # the target's vocabulary (token ids the head reads and emits)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    target: dict[str, Any] = field(default_factory=dict)  # what it was trained for (name, file digest)
    trained: dict[str, Any] = field(default_factory=dict)  # how (tokens, minutes) and its held-out agreement

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions (rotate-half, as Llama) of ``x`` [..., T, d] at ``positions`` [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions[:, None].float() * inv[None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


@dataclass
class HeadCache:
    """The head's keys and values for the positions it has read ([heads, T, head_dim] each),
    after the ``dropped`` oldest ones it no longer attends to."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    dropped: int = 0

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions held."""
        if self.keys is not None and length < self.length:
            self.keys, self.values = self.keys[:, :length], self.values[:, :length]

    def drop_front(self, count: int) -> None:
        """Stop attending to the ``count`` oldest positions; the rest keep their positions."""
        if self.keys is not None and count > 0:
            self.keys, self.values = self.keys[:, count:], self.values[:, count:]
            self.dropped += count


class FeatureHead(nn.Module):
    """One concern: the head's network. ``forward`` over whole windows (training: causal over the
    window), ``step`` over new positions after a ``HeadCache`` (drafting)."""

    def __init__(self, config: HeadConfig, vocab: torch.Tensor, rows: torch.Tensor,
                 embedding: torch.Tensor | None = None):
        """``vocab`` [R]: the target token ids the head scores; ``rows`` [R, D]: their rows of the
        target's LM head; ``embedding`` [V, D]: the target's input embedding table (not saved)."""
        super().__init__()
        d, i = config.hidden, config.intermediate
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.attn_norm = RMSNorm(d, config.rms_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, config.rms_eps)
        self.gate_up = nn.Linear(d, 2 * i, bias=False)
        self.down = nn.Linear(i, d, bias=False)
        self.register_buffer("vocab", vocab.long())
        self.register_buffer("rows", rows.float())
        self.embedding = embedding
        with torch.no_grad():  # start as "the next state is this one": a sensible first guess
            self.fc.weight.zero_()
            self.fc.weight[:, :d] = torch.eye(d)

    def _split(self, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        q, k, v = self.qkv(self.attn_norm(x)).unflatten(-1, (3, c.heads, c.head_dim)).unbind(-3)
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [..., heads, T, head_dim]
        return rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta), v

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attended.transpose(-3, -2).flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input at each position: the state h_t and the embedding of x_{t+1}."""
        return self.fc(torch.cat([features, self.embedding[tokens].to(features.dtype)], -1))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Predicted next states [B, T, D] of states ``features`` [B, T, D] followed by ``tokens``
        [B, T], causal over the window (positions 0 .. T-1)."""
        x = self.inputs(features, tokens)
        q, k, v = self._split(x, torch.arange(x.shape[-2]))
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def step(self, features: torch.Tensor, tokens: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """Predicted next states [n, D] of ``n`` new positions after those ``cache`` holds; their
        keys and values join it."""
        x = self.inputs(features, tokens)
        start = cache.dropped + cache.length
        q, k, v = self._split(x, torch.arange(start, start + x.shape[0]))
        keys = k if cache.keys is None else torch.cat([cache.keys, k], 1)
        values = v if cache.values is None else torch.cat([cache.values, v], 1)
        cache.keys, cache.values = keys, values
        n, total = x.shape[0], keys.shape[1]
        mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)  # each new position sees itself and before
        return self._finish(x, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))

    def scores(self, states: torch.Tensor) -> torch.Tensor:
        """Logits [..., R] over ``vocab`` of predicted states [..., D]."""
        return states @ self.rows.T.to(states.dtype)

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **asdict(self.config)}, indent=1) + "\n")

    @classmethod
    def load(cls, folder: Path | str, embedding: torch.Tensor) -> "FeatureHead":
        """The head in ``folder``, reading ``embedding`` [V, D] (the target's input embeddings)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        config = read_config(folder)
        if tuple(embedding.shape) != (config.vocab_size, config.hidden):
            raise ValueError(f"feature head {folder}: trained for a target of vocabulary {config.vocab_size} "
                             f"and width {config.hidden}, not {tuple(embedding.shape)}")
        tensors = load_file(str(folder / WEIGHTS_FILE))
        head = cls(config, tensors["vocab"], tensors["rows"], embedding.float())
        head.load_state_dict(tensors)
        return head.eval()


def read_config(folder: Path) -> HeadConfig:
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder} holds no feature head ({CONFIG_FILE}: {err})") from None
    if raw.pop("format", None) != FORMAT:
        raise ValueError(f"{folder / CONFIG_FILE} is not a {FORMAT} file")
    return HeadConfig(**raw)


def is_feature_head(path: Path | str) -> bool:
    return (Path(path).expanduser() / CONFIG_FILE).is_file()
