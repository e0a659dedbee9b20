"""The lean forward's description of a decoder: norms, products and layers as references to the
HF modules' own parameters, and the ``Decoder`` a family module (``families/``) builds of them.

A product (``Matmul``) may hold its weight in a second, transposed layout (``transposed_weights``)
and route few-row products to numpy's BLAS (``host.py``); everything else here is a reference to
a tensor the HF model holds. Nothing here runs a forward (``forward.py`` does) or knows a model
family by name beyond the norm classes ``norm_kind`` recognises.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ACTIVATIONS = {  # each returns a tensor the caller may modify in place
    "silu": functools.partial(F.silu, inplace=True),
    "relu": functools.partial(F.relu, inplace=True),  # OPT
    "swish": functools.partial(F.silu, inplace=True),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's NewGELU: the same formula
}
NARROW_ROWS = 8  # products of at most this many rows run as (W @ x.T).T on a CPU (see Matmul)
TRANSPOSED_WEIGHTS_MAX_BYTES = 2 << 30  # transposed_weights="auto": copy the weights of models up to this size ...
TRANSPOSED_MEMORY_SHARE = 4  # ... whose copies take at most 1/this of the memory available at load
NO_HOST: frozenset[int] = frozenset()  # no product runs through numpy


@dataclass(frozen=True)
class Norm:
    weight: nn.Parameter
    bias: nn.Parameter | None
    eps: float
    rms: bool  # RMSNorm as HF computes it, else nn.LayerNorm
    upcast: bool = False  # Gemma's: normalised and scaled by ``weight`` (= 1 + its weight) in float32, then cast


@dataclass(frozen=True)
class Matmul:
    """``x @ W.T + bias`` for x [T, in] and a weight W [out, in], held in one memory layout or
    both: ``out_in`` is W as nn.Linear stores it, ``in_out`` is W transposed as transformers'
    Conv1D (GPT-2) stores it; one of them is the module's own tensor, the other None or a copy
    (``transposed_weights``).

    On a CPU the layout decides the speed (MKL, one thread, float32; figures in docs/): one row
    runs faster as ``x @ in_out`` (MKL streams the matrix as it lies) than as
    ``F.linear(x, out_in)``, and 2-``NARROW_ROWS`` rows faster as ``(out_in @ x.T).T`` than as
    either; wider products, prefills, are alike every way and run as transformers runs them, as
    does everything not measured (other dtypes, GPUs; one row without the [in, out] copy). The
    result of the transposed route is a transposed view [T, out]: every consumer here takes it
    as it is or reshapes it.

    ``host_rows``: products of that many rows go to numpy's BLAS instead (``x @ in_out`` in
    numpy, on the same memory), where ``LeanForward.host_products`` measured it faster: numpy's
    wheels bring OpenBLAS, whose kernels for a few rows may stream a matrix that is not in the
    cache better than MKL's."""

    out_in: torch.Tensor | None
    in_out: torch.Tensor | None
    bias: torch.Tensor | None
    narrow: int  # the most rows that take the (out_in @ x.T).T route (0: never: a GPU, not float32)
    sizes: tuple[int, ...] = ()  # output features of each part of a fused product, in order
    host: np.ndarray | None = None  # in_out as numpy sees it (the same memory), see host_rows
    host_rows: frozenset[int] = NO_HOST  # products of these many rows run through numpy's BLAS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows in self.host_rows:
            out = torch.from_numpy(np.matmul(x.numpy(), self.host))
            return out if self.bias is None else out.add_(self.bias)
        if self.in_out is not None and (rows == 1 or self.out_in is None):
            return torch.mm(x, self.in_out) if self.bias is None else torch.addmm(self.bias, x, self.in_out)
        if 1 < rows <= self.narrow:
            if self.bias is None:
                return torch.mm(self.out_in, x.t()).t()
            return torch.addmm(self.bias.unsqueeze(1), self.out_in, x.t()).t()
        return F.linear(x, self.out_in, self.bias)

    def routed(self, rows: frozenset[int]) -> "Matmul":
        """This product with ``rows`` (row counts) through numpy's BLAS; where it holds no
        [in, out] layout (the one that BLAS streams for few rows), unchanged."""
        if self.in_out is None or self.in_out.device.type != "cpu" or self.in_out.dtype != torch.float32:
            return self
        return dataclasses.replace(self, host=self.in_out.detach().numpy() if rows else None, host_rows=rows)

    def nbytes_copied(self) -> int:
        """Bytes this product holds beyond the module's own weight (the second layout)."""
        if self.out_in is None or self.in_out is None:
            return 0
        return self.out_in.numel() * self.out_in.element_size()


def matmul(weight: torch.Tensor, bias: torch.Tensor | None, *, conv1d: bool, copy: bool,
           sizes: tuple[int, ...] = ()) -> Matmul:
    """The product of a weight stored [out, in] (nn.Linear) or [in, out] (``conv1d``), with
    the other layout copied when ``copy``."""
    other = weight.detach().t().contiguous() if copy else None
    out_in, in_out = (other, weight) if conv1d else (weight, other)
    measured = weight.device.type == "cpu" and weight.dtype == torch.float32  # MKL's float32 kernels
    narrow = NARROW_ROWS if measured and out_in is not None else 0
    return Matmul(out_in, in_out, bias, narrow, sizes)


def projection(module: nn.Module, copy: bool) -> Matmul:
    """An nn.Linear's or a Conv1D's product."""
    from transformers.pytorch_utils import Conv1D  # on use: importing the engine loads no transformers

    return matmul(module.weight, module.bias, conv1d=type(module) is Conv1D, copy=copy)


def fused(linears: list[nn.Linear], copy: bool) -> Matmul:
    """Linear layers that read the same input, as one product: one matrix multiply per forward
    instead of several (on a CPU each costs dispatch comparable to its arithmetic here; on a
    GPU, a kernel launch). The modules' own parameters become views of the fused tensors, so
    the weights are held once and transformers' forward still uses them."""
    biases = [linear.bias for linear in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("fusing linears where only some have a bias")
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        bias = None if biases[0] is None else torch.cat(biases)
        start = 0
        for linear in linears:
            end = start + linear.out_features
            linear.weight.data = weight[start:end]
            if bias is not None:
                linear.bias.data = bias[start:end]
            start = end
    return matmul(weight, bias, conv1d=False, copy=copy, sizes=tuple(linear.out_features for linear in linears))


def transposed_bytes(model: PreTrainedModel) -> int:
    """What holding the weights transposed adds (``transposed_weights``): every matrix but the
    input embeddings (a lookup), the LM head once even where it is the embeddings' own tensor."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    size = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2 and p is not embed)
    if head is not None and head.weight is embed:
        size += embed.numel() * embed.element_size()
    return size


def available_memory() -> int | None:
    """Bytes the kernel says could be had now without swapping (MemAvailable); None where it
    does not say (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def copies_pay(model: PreTrainedModel, available: int | None = None) -> tuple[bool, str]:
    """transposed_weights="auto": (whether to hold the copies, why not where memory decided).
    A float32 model on a CPU, small enough that its weights twice over are no burden (measured on
    float32 with MKL; bf16/fp16 products take other kernels), and whose copies take at most
    1/``TRANSPOSED_MEMORY_SHARE`` of the memory available at load (``available``, bytes; read
    from the kernel when None): they make one-row products faster (docs/engine.md), but a model whose
    memory doubles where memory is short pushes out the page cache or the editor."""
    weight = model.get_input_embeddings().weight
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or size > TRANSPOSED_WEIGHTS_MAX_BYTES:
        return False, ""
    copies = transposed_bytes(model)
    available = available_memory() if available is None else available
    if available is not None and copies * TRANSPOSED_MEMORY_SHARE > available:
        return False, (f"weights held once: transposed copies would take +{copies / 2**20:.0f} MiB, more than "
                       f"1/{TRANSPOSED_MEMORY_SHARE} of the {available / 2**20:.0f} MiB available at load "
                       f"(engine.transposed_weights = on holds them anyway)")
    return True, ""


@dataclass(frozen=True)
class Layer:
    """References to one decoder layer's parameters (the HF module's own tensors), and the
    little that differs between the families: where q, k and v lie in the fused projection's
    output, the attention scale, the MLP's shape, and the optional steps some families take
    (each field's default is the step not taken)."""

    attn_norm: Norm | None  # None: no norm before attention (OLMo 2)
    qkv: Matmul  # q, k and v projections in one product
    per_head_qkv: bool  # qkv output [T, H, (q k v), D] (gpt_bigcode without MQA), else [T, (H q, KV k, KV v), D]
    scale: float  # of the attention logits (GPT-2 may also divide it by the layer's index + 1)
    o: Matmul
    mlp_norm: Norm | None  # None: no norm before the MLP (OLMo 2)
    gate_up: Matmul | None  # gated MLP (Llama, Qwen2, Mistral): down(act(gate(x)) * up(x)) ...
    up: Matmul | None  # ... or plain (StarCoder2, GPT-2): up = c_fc, down = c_proj: down(act(up(x)))
    down: Matmul
    window: int | None  # sliding window in tokens, None for full attention
    qk_norm: Norm | None = None  # Qwen3: RMSNorm of each q and k head before the rotation (head_norm)
    residual_scale: float = 1.0  # Granite's residual_multiplier: x + scale * branch(x)
    parallel: bool = False  # GPT-NeoX's parallel residual: x + attn(norm1(x)) + mlp(norm2(x))
    rope: str | None = None  # which rotary tables turn q and k (Gemma 3's layer type; None: the one)
    post_attn_norm: Norm | None = None  # Gemma 3 normalises each branch's output too ...
    post_mlp_norm: Norm | None = None  # ... before adding it to the residual stream
    softcap: float | None = None  # Gemma 2's soft cap of the attention scores: cap * tanh(scores / cap)
    projection_norms: tuple[Norm, Norm] | None = None  # OLMo 2's RMSNorms of the whole q and k projections

    def matmuls(self) -> list[Matmul]:
        return [m for m in (self.qkv, self.o, self.gate_up, self.up, self.down) if m is not None]

    def routed(self, rows: frozenset[int]) -> "Layer":
        """This layer with its products of ``rows`` through numpy's BLAS (``Matmul.routed``)."""
        return dataclasses.replace(self, qkv=self.qkv.routed(rows), o=self.o.routed(rows),
                                   gate_up=None if self.gate_up is None else self.gate_up.routed(rows),
                                   up=None if self.up is None else self.up.routed(rows),
                                   down=self.down.routed(rows))


@dataclass(frozen=True)
class Decoder:
    """What a family module's ``describe`` gives ``LeanForward``: the model's shape and its
    parameters as the lean forward runs them. Defaults: no learned positions, no rotary
    positions, no embedding, residual or logit scaling."""

    heads: int
    kv_heads: int
    head_dim: int
    act: Callable[[torch.Tensor], torch.Tensor]  # one of ACTIVATIONS
    embed: nn.Embedding  # token embeddings
    final_norm: Norm
    layers: list[Layer]
    positions: nn.Embedding | None = None  # learned absolute positions, added to the token embeddings
    position_offset: int = 0  # the learned positions' first row (OPT's: 2)
    # rotary kind -> (inv_freq, attention scaling, rope type), see rotary.rotaries; empty: none
    ropes: dict[str | None, tuple[torch.Tensor, float, str]] = field(default_factory=dict)
    embed_scale: torch.Tensor | float | None = None  # Gemma's sqrt(hidden) buffer, Granite's multiplier
    logit_scale: float | None = None  # Granite divides its logits by it
    logit_cap: float | None = None  # Gemma 2's and 3's soft cap of the logits


def norm_kind(norm: nn.Module) -> str | None:
    """How ``norm`` computes (``norm_of``): "layer" (nn.LayerNorm), "gemma" (scales by 1 + weight,
    in float32), "upcast" (the weight's product in float32, then the cast: OLMo 2), "rms"
    (transformers' RMSNorm); None for a module the lean forward does not compute."""
    if type(norm) is nn.LayerNorm:
        return "layer"
    if type(norm).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm") and hasattr(norm, "eps"):
        return "gemma"
    if type(norm).__name__ == "Olmo2RMSNorm" and hasattr(norm, "variance_epsilon"):
        return "upcast"  # the weight's product taken in float32, then the cast
    if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
        return "rms"
    return None


def norm_of(module: nn.Module) -> Norm:
    """An HF norm module as the lean forward computes it (``norm_kind`` must know it)."""
    kind = norm_kind(module)
    if kind == "layer":
        return Norm(module.weight, module.bias, module.eps, rms=False)
    if kind == "gemma":  # output * (1 + weight), in float32: the sum is a small copy held here
        with torch.no_grad():
            return Norm(1.0 + module.weight.float(), None, module.eps, rms=True, upcast=True)
    if kind == "upcast":
        return Norm(module.weight, None, module.variance_epsilon, rms=True, upcast=True)
    return Norm(module.weight, None, module.variance_epsilon, rms=True)


def head_norm(q: nn.Module, k: nn.Module, heads: int, kv_heads: int) -> Norm:
    """Qwen3's (and Gemma 3's) RMSNorms of each q head and each k head as one norm over the last
    dim of [T, heads + kv_heads, D]: its weight [heads + kv_heads, D] repeats q's weight per q
    head and k's per k head (a small copy)."""
    q_norm, k_norm = norm_of(q), norm_of(k)
    with torch.no_grad():
        weight = torch.cat([q_norm.weight.expand(heads, -1), k_norm.weight.expand(kv_heads, -1)])
    return dataclasses.replace(q_norm, weight=weight)


def apply_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    if not norm.rms:
        return F.layer_norm(x, norm.weight.shape, norm.weight, norm.bias, norm.eps)
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        if norm.weight.dim() > 1:  # per-head weights (head_norm): normalise over the head dim, then scale
            return F.rms_norm(x, norm.weight.shape[-1:], None, norm.eps).mul_(norm.weight)
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)  # one fused op, same maths
    # HF's RMSNorms in a half dtype: statistics in float32; Llama's cast back, then scale by the
    # weight; Gemma's scale by (1 + weight) in float32, then cast.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.upcast:
        return (h * norm.weight).to(x.dtype)
    return norm.weight * h.to(x.dtype)


def plain_modules_reason(layers, parts, final_norm: nn.Module) -> str | None:
    """Why not, where a layer's projections are not plain nn.Linear or its norms (and the final
    one) not nn.LayerNorm; ``parts(layer)`` gives (projections, norms)."""
    for i, layer in enumerate(layers):
        projections, norms = parts(layer)
        if any(type(m) is not nn.Linear for m in projections):
            return f"layer {i} has projections that are not plain nn.Linear"
        if any(type(norm) is not nn.LayerNorm for norm in norms):
            return f"layer {i} has norms that are not nn.LayerNorm"
    if type(final_norm) is not nn.LayerNorm:
        return f"final norm is a {type(final_norm).__name__}"
    return None
