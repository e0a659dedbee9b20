"""The feature head: a one-layer draft that reads the target's own final hidden state (the idea
of EAGLE, Li et al. 2024), its network and its file format.

At a position t the target's final hidden state h_t (after its last norm: what its LM head
scores) already summarises the whole context. Given h_t and the token x_{t+1} the target then
emitted, one decoder layer predicts h_{t+1}; scoring that prediction with the target's own head
rows gives the token after. Drafting a chain feeds each predicted state back in with the token it
scored. A small student trained from scratch must learn the context itself; the head only has to
carry the target's summary one token on, which is why it agrees far more often at the same cost.

Why a head may read prompt lookup's guess (``HeadConfig.guess``): where the target is surest, it
is mostly finishing a word or copying a name from earlier in the code, and one layer reading
states cannot look a token up in the context (that takes two attention layers). So each position
also reads ``lookup_guess``: the token that followed the last earlier occurrence of its last two
tokens (else of its last one), the way prompt lookup drafts. The head learns when to trust it.
It is written here rather than read from ``lookup.NgramIndex``: training asks it at every
position of a window, and a chain at a drafted token, each from the tokens before only, and it
falls back to a single token where the index needs a bigram.

Why the head scores a reduced vocabulary: a draft step's cost is the layer plus the head, and at
a vocabulary of tens of thousands the head would be most of it; the rows of the target's most
frequent tokens on code (``vocab``) cover nearly every token it emits there. Neither the target's
embedding table (the input side) nor its LM head (``rows``, its rows at ``vocab``) is stored here:
both are frozen copies of the target's, so the loader is handed them
(``FeatureHead.load(folder, embedding, lm_head)``) and a head file carries only what it trained.

File format (a folder): ``head.json`` (``HeadConfig``'s fields, ``format``) and
``head.safetensors`` (the layer's weights and ``vocab``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FORMAT = "specd-feature-head"
CONFIG_FILE = "head.json"
WEIGHTS_FILE = "head.safetensors"
NO_GUESS = -1  # ``lookup_guess`` where the token never occurred before with one after it


def lookup_guess(history: np.ndarray, last: int) -> int:
    """Prompt lookup's guess of the token after ``last``, which follows the token ids
    ``history``: the token after the latest occurrence in ``history`` of the pair
    (``history[-1]``, ``last``), else of ``last`` alone; ``NO_GUESS`` where there is none."""
    hits = np.flatnonzero(history[:-1] == last)  # occurrences with a token after them in history
    if not len(hits):
        return NO_GUESS
    paired = hits[hits >= 1]
    paired = paired[history[paired - 1] == history[-1]]
    return int(history[(paired[-1] if len(paired) else hits[-1]) + 1])


def lookup_guesses(ids, start: int = 0, end: int | None = None) -> list[int]:
    """``lookup_guess`` of the token after each of ``ids[start:end]``, from the ids before it."""
    history = np.asarray(ids, dtype=np.int64)
    end = len(history) if end is None else end
    return [lookup_guess(history[:i], int(history[i])) for i in range(start, end)]


def chain_guesses(ids, emitted) -> list[int]:
    """``lookup_guess`` at a chain's second position, for each t: of the token after
    ``emitted[t]``, drafted where ``ids[:t + 2]`` came before it (``FeatureHead.second``'s
    ``emitted_guesses``)."""
    history = np.asarray(ids, dtype=np.int64)
    return [lookup_guess(history[:t + 2], int(token)) for t, token in enumerate(emitted)]


@dataclass(frozen=True)
class HeadConfig:
    hidden: int                 # the target's hidden size (its final hidden state's width)
    heads: int                  # attention heads of the head's one layer
    intermediate: int           # its MLP's width
    vocab_size: int             # the target's vocabulary (token ids the head reads and emits)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    guess: bool = False         # each position also reads ``lookup_guess`` (the embedding of that token)
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
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = positions.to(x.device)[:, None].float() * inv[None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


@dataclass
class HeadCache:
    """The head's keys and values for the positions it has read ([heads, T, head_dim] each),
    after the ``dropped`` oldest ones it no longer attends to. Held in buffers that grow by
    doubling: a drafting step appends one position, and a copy of them all each step would
    cost as much as the step's products."""

    length: int = 0
    dropped: int = 0
    _keys: torch.Tensor | None = None  # [heads, capacity, head_dim]
    _values: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :self.length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :self.length]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values) if t is not None)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = self.length + keys.shape[1]
        if self._keys is None or end > self._keys.shape[1]:
            capacity = max(end, 2 * (0 if self._keys is None else self._keys.shape[1]), 64)
            grown_k = keys.new_empty(keys.shape[0], capacity, keys.shape[2])
            grown_v = values.new_empty(values.shape[0], capacity, values.shape[2])
            if self.length:
                grown_k[:, :self.length] = self._keys[:, :self.length]
                grown_v[:, :self.length] = self._values[:, :self.length]
            self._keys, self._values = grown_k, grown_v
        self._keys[:, self.length:end] = keys
        self._values[:, self.length:end] = values
        self.length = end

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions held."""
        self.length = max(0, min(self.length, length))

    def drop_front(self, count: int) -> None:
        """Stop attending to the ``count`` oldest positions; the rest keep their positions."""
        count = min(count, self.length)
        if self._keys is not None and count > 0:
            rest = self.length - count
            self._keys[:, :rest] = self._keys[:, count:self.length].clone()
            self._values[:, :rest] = self._values[:, count:self.length].clone()
            self.length = rest
            self.dropped += count


class FeatureHead(nn.Module):
    """One concern: the head's network. ``forward`` over whole windows (training: causal over the
    window), ``step`` over new positions after a ``HeadCache`` (drafting)."""

    def __init__(self, config: HeadConfig, vocab: torch.Tensor, rows: torch.Tensor,
                 embedding: torch.Tensor | None = None):
        """``vocab`` [R]: the target token ids the head scores; ``rows`` [R, D]: their rows of the
        target's LM head; ``embedding`` [V, D]: the target's input embedding table (neither is
        saved in the head's file)."""
        super().__init__()
        d, i = config.hidden, config.intermediate
        self.config = config
        self.fc = nn.Linear((3 if config.guess else 2) * d, d, bias=False)
        if config.guess:  # what a position without a guess reads in its place
            self.no_guess = nn.Parameter(torch.zeros(d))
        self.attn_norm = RMSNorm(d, config.rms_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, config.rms_eps)
        self.gate_up = nn.Linear(d, 2 * i, bias=False)
        self.down = nn.Linear(i, d, bias=False)
        self.register_buffer("vocab", vocab.long())
        # in the state dict, so a training checkpoint holds them; ``save`` leaves them out
        self.register_buffer("rows", rows.float())
        # a plain tensor, never a parameter of the head's (handed an nn.Parameter, a module would
        # register it, and then look for it in the head's file)
        self.embedding = embedding.detach() if embedding is not None else None
        with torch.no_grad():  # start as "the next state is this one": a sensible first guess
            self.fc.weight.zero_()
            self.fc.weight[:, :d] = torch.eye(d)

    def _apply(self, fn, recurse=True):
        """``to``, ``cpu``, ``float`` and the like move the target's embedding table too (a plain
        tensor here, so the module's own machinery would leave it where it was)."""
        module = super()._apply(fn, recurse)
        if self.embedding is not None:
            self.embedding = fn(self.embedding)
        return module

    def _split(self, x: torch.Tensor, positions: torch.Tensor):
        c = self.config
        q, k, v = self.qkv(self.attn_norm(x)).unflatten(-1, (3, c.heads, c.head_dim)).unbind(-3)
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [..., heads, T, head_dim]
        return rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta), v

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attended.transpose(-3, -2).flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor, guesses: torch.Tensor | None) -> torch.Tensor:
        """The layer's input at each position: the state h_t, the embedding of x_{t+1} and, for a
        head that reads them, that of ``guesses`` (``lookup_guess`` of the token after x_{t+1},
        shaped as ``tokens``)."""
        dtype = features.dtype
        parts = [features, self.embedding[tokens].to(dtype)]
        if self.config.guess:
            if guesses is None:
                raise ValueError("this feature head reads prompt lookup's guess at each position (lookup_guesses)")
            known = (guesses != NO_GUESS)[..., None]
            parts.append(torch.where(known, self.embedding[guesses.clamp(min=0)].to(dtype), self.no_guess.to(dtype)))
        return self.fc(torch.cat(parts, -1))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, guesses: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next states [B, T, D] of states ``features`` [B, T, D] followed by ``tokens``
        [B, T] (and their ``guesses``, [B, T]), causal over the window (positions 0 .. T-1)."""
        x = self.inputs(features, tokens, guesses)
        q, k, v = self._split(x, torch.arange(x.shape[-2]))
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def step(self, features: torch.Tensor, tokens: torch.Tensor, cache: HeadCache,
             guesses: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next states [n, D] of ``n`` new positions after those ``cache`` holds; their
        keys and values join it."""
        x = self.inputs(features, tokens, guesses)
        start = cache.dropped + cache.length
        q, k, v = self._split(x, torch.arange(start, start + x.shape[0]))
        cache.append(k, v)
        keys, values = cache.keys, cache.values
        n, total = x.shape[0], keys.shape[1]
        # each new position sees itself and those before (one new position: all of them)
        mask = None if n == 1 else torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
        return self._finish(x, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))

    def second(self, features: torch.Tensor, tokens: torch.Tensor, predicted: torch.Tensor,
               emitted: torch.Tensor, guesses: torch.Tensor | None = None,
               emitted_guesses: torch.Tensor | None = None) -> torch.Tensor:
        """The second drafted state at every position of a window at once [B, T, D]: at t + 1 the
        head reads its own prediction ``predicted`` [B, T, D] (of the state at t + 1, from
        ``forward``) and the token emitted there ``emitted`` [B, T], attending to the true
        positions up to t (``features`` and ``tokens`` as ``forward`` reads them) and to itself:
        the cache a chain's second step has. Training on it teaches the head to read its own
        predictions (EAGLE-3's "training-time test"); judging with it measures a chain's second
        token. ``guesses`` go with ``tokens``, ``emitted_guesses`` with ``emitted``."""
        true_inputs = self.inputs(features, tokens, guesses)
        length = true_inputs.shape[-2]
        positions = torch.arange(length, device=features.device)
        _, true_keys, true_values = self._split(true_inputs, positions)
        drafted = self.inputs(predicted, emitted, emitted_guesses)
        queries, keys, values = self._split(drafted, positions + 1)  # [B, heads, T, head_dim]
        mask = torch.zeros(length, 2 * length, dtype=torch.bool, device=features.device)
        mask[:, :length] = torch.ones(length, length, dtype=torch.bool, device=features.device).tril()
        mask[positions, length + positions] = True  # of the drafted positions, each sees only itself
        attended = F.scaled_dot_product_attention(queries, torch.cat([true_keys, keys], -2),
                                                  torch.cat([true_values, values], -2), attn_mask=mask)
        return self._finish(drafted, attended)

    def scores(self, states: torch.Tensor) -> torch.Tensor:
        """Logits [..., R] over ``vocab`` of predicted states [..., D]."""
        return states @ self.rows.T.to(states.dtype)

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()
                   if name != "rows"}  # the target's, handed to ``load``
        save_file(tensors, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **asdict(self.config)}, indent=1) + "\n")

    @classmethod
    def load(cls, folder: Path | str, embedding: torch.Tensor, lm_head: torch.Tensor) -> "FeatureHead":
        """The head in ``folder``, reading ``embedding`` [V, D] (the target's input embeddings) and
        scoring with ``lm_head`` [V, D] (the target's LM-head weight; with tied embeddings the same
        tensor) at its vocabulary."""
        from safetensors.torch import load_file

        folder = Path(folder)
        config = read_config(folder)
        expected = (config.vocab_size, config.hidden)
        for name, table in (("an embedding", embedding), ("an LM head", lm_head)):
            if tuple(table.shape) != expected:
                raise ValueError(f"feature head {folder}: trained for a target of vocabulary {config.vocab_size} "
                                 f"and width {config.hidden}, not {name} of {tuple(table.shape)}")
        tensors = load_file(str(folder / WEIGHTS_FILE))
        # A file may carry ``rows`` too. They are ignored: training froze them as a copy of the
        # target's LM head at ``vocab``, so for the target the head was trained for they equal
        # what is read here, and the head's predicted states are meant to be scored by the
        # target's own rows, whatever a file holds.
        tensors["rows"] = lm_head.detach()[tensors["vocab"].long()].float()
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
