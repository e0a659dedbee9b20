"""A lean batch-1 forward for Llama- and GPT-2-family decoders, on the loaded HF model's own weights.

HF's eager forward spends most of a small model's step outside arithmetic: mask building, the
DynamicCache machinery, module calls and hooks. ``LeanForward`` runs the same maths in a few tensor
ops per layer, after gpt-fast: a static per-document KV cache (rollback moves its length, nothing
is copied), rotary tables computed once, ``scaled_dot_product_attention`` with no mask for one
new token and a causal mask among the new tokens only. It holds the HF modules' parameters
themselves (no copies): it costs no weight memory and reads whatever the model holds.

Two families share the cache, masks, attention and the layer step; what differs is data in
``_Layer`` and two fields of ``LeanForward``:

- Llama family (Llama, Qwen2, Mistral, StarCoder2, Qwen3, Gemma, Gemma 2, Gemma 3, Granite, Phi-3, StableLM,
  Phi, OLMo 2):
  rotary positions,
  RMSNorm (LayerNorm in StarCoder2; Gemma's scales by 1 + weight in float32), q/k/v as
  nn.Linear fused here into one product, grouped-query attention; Qwen3 also RMS-normalises each
  head of q and k before rotating them, Gemma scales the token embeddings by sqrt(hidden), and
  Granite scales the embeddings, each residual branch and the logits by its config's multipliers;
  Phi-3 stores q/k/v and gate/up fused already; Phi-3, StableLM and Phi may rotate only a part
  of each head (partial rotary); Phi's one LayerNorm feeds attention and MLP side by side (a
  parallel residual); Gemma 2 and 3 also normalise each branch's output and may soft-cap their
  logits; Gemma 2 soft-caps its attention scores (an attention of our own: SDPA has no cap);
  Gemma 3 turns its sliding layers' q and k at another rotary base than its full layers'
  (tables per kind); OLMo 2 normalises only the branches' outputs, and q and k over their whole
  projections;
- GPT-2 family (gpt2; gpt_bigcode: StarCoderBase, SantaCoder, TinyStarCoder): learned absolute
  position embeddings added to the token embeddings, LayerNorm with bias, one fused ``c_attn``
  as the checkpoint stores it (gpt2's ``Conv1D`` keeps its weight [in, out] and runs as
  ``addmm(bias, x, weight)``, as transformers does), multi-query attention in gpt_bigcode, the
  LM head tied to the token embeddings;
- OPT (as OPT-125m and the larger ones; not OPT-350m's post-norm and projected embeddings):
  learned positions offset by 2, q/k/v as nn.Linear fused here, relu, LayerNorms before each block;
- GPT-NeoX (Pythia): LayerNorm with bias, one fused ``query_key_value`` laid out per head (as
  gpt_bigcode's without multi-query), rotary positions over the first ``rotary_dim`` dims of each
  head (partial rotary), and by default a parallel residual: x + attn(norm1(x)) + mlp(norm2(x)).

The interface is the one ``KVState`` drives the HF path with (see ``compat``):
``new_cache()``, ``forward(input_ids, cache, last_only)``, ``crop(cache, length)``,
``cache_length(cache)``, ``nbytes(cache)``. ``unsupported_reason(model)`` says, in one line,
why a model must stay on the HF path.

Numerics follow HF's modules step for step (RMSNorm in float32 and cast back, rotary tables in
float32 cast to the model's dtype, projections, activations and residuals in the model's dtype),
so fp32 logits agree with HF's to float rounding and greedy argmaxes are the same. (GPT-2's
``gelu_new`` is the tanh GELU written out in six ops; here it is ``F.gelu(approximate="tanh")``,
the same formula in one op, equal to it up to float32 rounding.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from specd.engine.forward.graphs import GRAPH_WIDTHS, Captured, CudaGraphs, EagerGraphs

log = logging.getLogger(__name__)

LLAMA_FAMILY = ("llama", "qwen2", "mistral", "starcoder2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite",
                "phi3", "stablelm", "phi", "olmo2")
PARTIAL_ROTARY = ("phi3", "stablelm", "phi")  # whose rotation passes a head's dims past the rotary ones through
GPT2_FAMILY = ("gpt2", "gpt_bigcode")
# model type -> family: the decoder's attribute on the ...ForCausalLM, and which _<family>_reason
# and LeanForward._describe_<family> read it
FAMILIES = {**dict.fromkeys(LLAMA_FAMILY, "llama"), **dict.fromkeys(GPT2_FAMILY, "gpt2"), "gpt_neox": "neox",
            "opt": "opt"}
BODIES = {"llama": "model", "gpt2": "transformer", "neox": "gpt_neox", "opt": "model"}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# Rotary types with fixed frequencies and scale: HF computes inv_freq and attention_scaling once.
# "dynamic" and "longrope" change them with the sequence length, so they stay on the HF path.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = {  # each returns a tensor the caller may modify in place
    "silu": functools.partial(F.silu, inplace=True),
    "relu": functools.partial(F.relu, inplace=True),  # OPT
    "swish": functools.partial(F.silu, inplace=True),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's NewGELU: the same formula
}
INITIAL_CAPACITY = 256  # positions a new cache holds before its first growth
CAUSAL = torch.empty(0, dtype=torch.bool)  # marks "is_causal" in place of a mask tensor
WIDE = 64  # forwards at least this wide (prefills) attend per head; narrower ones group the queries
NARROW_ROWS = 8  # products of at most this many rows run as (W @ x.T).T on a CPU (see _Matmul)
HOST_ROWS = 16  # products of at most this many rows may run through numpy's BLAS (see host_products)
HOST_CONTEXT = 256  # tokens of context behind host_products' timed forwards
HOST_REPEATS = 11  # timed forwards per width and route (after one warm-up round)
HOST_MARGIN = 0.97  # numpy's BLAS takes a width class only when at least 3% faster (ties stay on torch)
NO_HOST: frozenset[int] = frozenset()  # no product runs through numpy
# host_products' probes: a forward of each width (key) decides the row counts (value) it stands for
HOST_PROBES = {1: range(1, 2), 2: range(2, 4), 8: range(4, HOST_ROWS + 1)}
ALL_HOST_ROWS = frozenset(range(1, HOST_ROWS + 1))
TRANSPOSED_WEIGHTS_MAX_BYTES = 2 << 30  # transposed_weights="auto": copy the weights of models up to this size
GRAPH_CHECK_CONTEXT = 40  # tokens behind use_graphs' check forwards
RECORD_AFTER = 2  # a kind of replayed forward is recorded once asked for this many times
PREPARED_KINDS = 6  # prepare() records the kinds of forward (width, last row only) asked for most ...
PREPARED_PER_CALL = 2  # ... this many at a time (idle slices stay short)
# how far a replayed forward's logits may lie from the eager one's, relative to the largest logit
# (the same maths; attention over the whole capacity sums in another order)
GRAPH_TOLERANCE = {torch.float32: 1e-3, None: 5e-2}
Mask = tuple[int, torch.Tensor | None]  # (first key slot attended, additive mask / CAUSAL / None)
NO_ROPE = (None, None)  # cos, sin of a layer without rotary positions


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """None when ``LeanForward`` computes exactly what this HF model computes; otherwise one line
    saying why not (``specd doctor`` shows it beside the HF fallback)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} has no lean forward (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    package = {"gemma3_text": "gemma3"}.get(model_type, model_type)  # where transformers keeps the class
    if not type(model).__module__.startswith(f"transformers.models.{package}."):
        return f"{type(model).__name__} is not transformers' own {model_type} class (remote code?)"
    family = FAMILIES[model_type]
    if not (hasattr(model, "lm_head") and hasattr(model, BODIES[family])):
        return f"{type(model).__name__} is not a ...ForCausalLM (no LM head)"
    if getattr(model, "hf_quantizer", None) is not None or getattr(config, "quantization_config", None):
        return "quantized weights"
    if model.training:
        return "the model is in training mode (dropout)"
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return f"weights spread over {len(devices)} devices"
    if next(iter(devices)).type == "meta":
        return "weights not loaded (meta device / offloaded)"
    reason = {"llama": _llama_family_reason, "gpt2": _gpt2_family_reason, "neox": _neox_reason,
              "opt": _opt_reason}[family](model)
    if reason is not None:
        return reason
    if type(model.lm_head) is not nn.Linear:
        return "the LM head is not a plain nn.Linear"
    return None


def _rotaries(rotary: nn.Module) -> dict[str | None, tuple[torch.Tensor, float, str]]:
    """A model's rotary embeddings: layer type -> (inv_freq, attention scaling, rope type).
    One for most models (key None); Gemma 3 keeps one per layer type (sliding layers turn at
    another base than full ones), as ``<type>_inv_freq`` buffers."""
    if hasattr(rotary, "inv_freq"):
        return {None: (rotary.inv_freq, rotary.attention_scaling, getattr(rotary, "rope_type", None))}
    return {kind: (getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling"),
                   rotary.rope_type[kind]) for kind in rotary.rope_type}


def _activation(config) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)  # Gemma 3's name


def _llama_family_reason(model: PreTrainedModel) -> str | None:
    config, body = model.config, model.model
    ropes = _rotaries(body.rotary_emb)
    for _, _, rope_type in ropes.values():
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    head_dim = body.layers[0].self_attn.head_dim
    rotary_dim = 2 * min(inv_freq.numel() for inv_freq, _, _ in ropes.values())
    if rotary_dim != head_dim and config.model_type not in PARTIAL_ROTARY:
        return f"rotary embedding over {rotary_dim} of {head_dim} head dims (partial rotary)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "qk_layernorm", False):  # StableLM's per-head LayerNorms, one weight per head
        return "per-head LayerNorms of q and k (qk_layernorm)"
    if config.model_type == "stablelm" and config.use_parallel_residual:
        return "a parallel residual (use_parallel_residual)"
    if _activation(config) not in ACTIVATIONS:
        return f"activation {_activation(config)!r}"
    for i, layer in enumerate(body.layers):
        if i < len(getattr(config, "layer_types", None) or ()) and config.layer_types[i] not in (
                "full_attention", "sliding_attention"):
            return f"layer {i} is {config.layer_types[i]!r}"
        attn = layer.self_attn
        for name, heads in (("q_norm", config.num_attention_heads), ("k_norm", config.num_key_value_heads)):
            norm = getattr(attn, name, None)  # Qwen3's and Gemma 3's norm each head, OLMo 2's the whole projection
            if norm is not None and (_norm_kind(norm) not in ("rms", "gemma", "upcast")
                                     or tuple(norm.weight.shape) not in ((head_dim,), (heads * head_dim,))):
                return f"layer {i}'s {name} is not an RMSNorm of each head or of the whole projection"
        linears = [*(getattr(attn, n) for n in _attention_names(attn)),
                   *(getattr(layer.mlp, n) for n in _mlp_names(layer.mlp))]
        if any(type(m) is not nn.Linear for m in linears):
            return f"layer {i} has projections that are not plain nn.Linear"
        for norm in filter(None, _layer_norms(layer)):
            if _norm_kind(norm) is None:
                return f"layer {i} has a {type(norm).__name__} norm"
    if _norm_kind(_final_norm(body)) is None:
        return f"final norm is a {type(_final_norm(body)).__name__}"
    embed = body.embed_tokens
    if type(embed) is not nn.Embedding and not (isinstance(embed, nn.Embedding) and type(embed).__name__ in
                                                ("GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding",
                                                 "Gemma3TextScaledWordEmbedding")):
        return f"token embeddings are a {type(embed).__name__}"
    return None


def _neox_reason(model: PreTrainedModel) -> str | None:
    config, body = model.config, model.gpt_neox
    rope_type = getattr(body.rotary_emb, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if config.hidden_act not in ACTIVATIONS:
        return f"activation {config.hidden_act!r}"
    if type(body.embed_in) is not nn.Embedding:
        return f"token embeddings are a {type(body.embed_in).__name__}"
    return _plain_modules_reason(body.layers, lambda layer: (
        (layer.attention.query_key_value, layer.attention.dense, layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h),
        (layer.input_layernorm, layer.post_attention_layernorm)), body.final_layer_norm)


def _plain_modules_reason(layers, parts, final_norm: nn.Module) -> str | None:
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


def _opt_reason(model: PreTrainedModel) -> str | None:
    config, body = model.config, model.model.decoder
    if not config.do_layer_norm_before:
        return "layer norms after each block (do_layer_norm_before = false, as OPT-350m)"
    if body.project_in is not None or body.project_out is not None:
        return f"embeddings of {config.word_embed_proj_dim} dims projected to and from the hidden size"
    if body.final_layer_norm is None:
        return "no final layer norm"
    if config.activation_function not in ACTIVATIONS:
        return f"activation {config.activation_function!r}"
    if type(body.embed_tokens) is not nn.Embedding or getattr(body.embed_positions, "offset", None) != 2:
        return "embeddings that are not OPT's own (token ids, positions offset by 2)"
    return _plain_modules_reason(body.layers, lambda layer: (
        (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.out_proj, layer.fc1,
         layer.fc2), (layer.self_attn_layer_norm, layer.final_layer_norm)), body.final_layer_norm)


def _gpt2_family_reason(model: PreTrainedModel) -> str | None:
    config, body = model.config, model.transformer
    if config.add_cross_attention:
        return "cross-attention layers (add_cross_attention)"
    if getattr(config, "reorder_and_upcast_attn", False):
        return "reorder_and_upcast_attn (attention scores upcast to float32) is not implemented"
    if config.activation_function not in ACTIVATIONS:
        return f"activation {config.activation_function!r}"
    if type(body.wpe) is not nn.Embedding:
        return "position embeddings that are not a plain nn.Embedding"
    for i, block in enumerate(body.h):
        projections = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
        if any(type(m) not in (nn.Linear, Conv1D) for m in projections):
            return f"layer {i} has projections that are not plain nn.Linear or Conv1D"
        for norm in (block.ln_1, block.ln_2):
            if _norm_kind(norm) != "layer":
                return f"layer {i} has a {type(norm).__name__} norm"
    if _norm_kind(body.ln_f) != "layer":
        return f"final norm is a {type(body.ln_f).__name__}"
    return None


def _spans(rows: frozenset[int]) -> str:
    """Row counts as spans: {1, 4, 5, 6} -> "1, 4-6"."""
    spans, ordered = [], sorted(rows)
    start = prev = ordered[0]
    for row in ordered[1:] + [None]:
        if row is not None and row == prev + 1:
            prev = row
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if row is not None:
            start = prev = row
    return ", ".join(spans)


def _host_blas_libraries() -> list:
    """threadpoolctl's controllers of the BLAS libraries numpy may run on, torch's own excepted
    (a torch build that bundles OpenBLAS keeps its threads)."""
    from threadpoolctl import ThreadpoolController

    torch_dir = os.path.dirname(torch.__file__)
    return [lib for lib in ThreadpoolController().select(user_api="blas").lib_controllers
            if not lib.filepath.startswith(torch_dir)]


@functools.cache
def limit_host_threads() -> None:
    """numpy's BLAS on one thread: the products it takes are a few rows, where threads cost more
    than they share, and OpenBLAS's idle threads spin on the cores torch's threads need. An MKL
    is left alone: where numpy runs on MKL (conda), torch may share that very library, and torch
    sets its threads."""
    for lib in _host_blas_libraries():
        if lib.internal_api != "mkl":
            lib.set_num_threads(1)


@functools.cache
def host_blas() -> str:
    """numpy's BLAS, e.g. "openblas 0.3.31" (for descriptions)."""
    libraries = sorted(_host_blas_libraries(),  # numpy's own first (scipy may bring another)
                       key=lambda lib: not os.path.basename(os.path.dirname(lib.filepath)).startswith("numpy"))
    if not libraries:
        return "numpy's BLAS"
    lib = libraries[0]
    return f"{lib.internal_api} {lib.version}" if lib.version else lib.internal_api


def _copies_pay(model: PreTrainedModel) -> bool:
    """transposed_weights="auto": a float32 model on a CPU, small enough that its weights twice
    over are no burden (measured on float32 with MKL; bf16/fp16 products take other kernels)."""
    weight = model.get_input_embeddings().weight
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and size <= TRANSPOSED_WEIGHTS_MAX_BYTES


def _sliding_window(config, attention: nn.Module) -> int | None:
    # Qwen2 keeps a per-layer window on the attention module; Mistral and StarCoder2 one in the config.
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(config, "sliding_window", None)


def _attention_names(attn: nn.Module) -> tuple[str, ...]:
    if hasattr(attn, "qkv_proj"):  # Phi-3
        return ("qkv_proj", "o_proj")
    return ("q_proj", "k_proj", "v_proj", "dense" if hasattr(attn, "dense") else "o_proj")  # Phi: dense


def _layer_norms(layer: nn.Module) -> list[nn.Module | None]:
    """A decoder layer's norms: before attention and before the MLP; Phi's one norm feeds both;
    Gemma 2 and 3 also normalise each branch's output (before attention, after it, before the
    MLP, after it); OLMo 2 normalises only the outputs (None: no norm before a branch)."""
    if not hasattr(layer, "input_layernorm"):
        return [None, layer.post_attention_layernorm, None, layer.post_feedforward_layernorm]
    if hasattr(layer, "pre_feedforward_layernorm"):
        return [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm]
    second = getattr(layer, "post_attention_layernorm", None)
    return [layer.input_layernorm] + ([second] if second is not None else [])


def _final_norm(body: nn.Module) -> nn.Module:
    return body.final_layernorm if hasattr(body, "final_layernorm") else body.norm  # Phi's name


def _mlp_names(mlp: nn.Module) -> tuple[str, ...]:
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate and up in one nn.Linear, gate first
        return ("gate_up_proj", "down_proj")
    if hasattr(mlp, "fc1"):  # Phi
        return ("fc1", "fc2")
    return ("gate_proj", "up_proj", "down_proj") if hasattr(mlp, "gate_proj") else ("c_fc", "c_proj")


def _norm_kind(norm: nn.Module) -> str | None:
    if type(norm) is nn.LayerNorm:
        return "layer"
    if type(norm).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm") and hasattr(norm, "eps"):
        return "gemma"
    if type(norm).__name__ == "Olmo2RMSNorm" and hasattr(norm, "variance_epsilon"):
        return "upcast"  # the weight's product taken in float32, then the cast
    if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
        return "rms"
    return None


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


@dataclass(frozen=True)
class _Norm:
    weight: nn.Parameter
    bias: nn.Parameter | None
    eps: float
    rms: bool  # RMSNorm as HF computes it, else nn.LayerNorm
    upcast: bool = False  # Gemma's: normalised and scaled by ``weight`` (= 1 + its weight) in float32, then cast


@dataclass(frozen=True)
class _Matmul:
    """``x @ W.T + bias`` for x [T, in] and a weight W [out, in], held in one memory layout or
    both: ``out_in`` is W as nn.Linear stores it, ``in_out`` is W transposed as transformers'
    Conv1D (GPT-2) stores it; one of them is the module's own tensor, the other None or a copy
    (``transposed_weights``).

    On a CPU the layout decides the speed (MKL, one thread, measured on this AMD EPYC over a
    whole forward of the demo and dev pairs' models): one row runs ~1.5x faster as
    ``x @ in_out`` (MKL streams the matrix as it lies) than as ``F.linear(x, out_in)``, and
    2-8 rows ~1.3-1.9x faster as ``(out_in @ x.T).T`` than as either; wider products, prefills,
    are alike every way and run as transformers runs them, as does everything not measured
    (other dtypes, GPUs; one row without the [in, out] copy). The result of the transposed route
    is a transposed view [T, out]: every consumer here takes it as it is or reshapes it.

    ``host_rows``: products of that many rows go to numpy's BLAS instead (``x @ in_out`` in
    numpy, on the same memory), where ``LeanForward.host_products`` measured it faster: numpy's
    wheels bring OpenBLAS, whose kernels for a few rows stream a matrix that is not in the
    cache better than MKL's here (one cold row of the demo target's LM head: 0.65 vs 0.94 ms)."""

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

    def routed(self, rows: frozenset[int]) -> "_Matmul":
        """This product with ``rows`` (row counts) through numpy's BLAS; where it holds no
        [in, out] layout (the one that BLAS streams for few rows), unchanged."""
        if self.in_out is None or self.in_out.device.type != "cpu" or self.in_out.dtype != torch.float32:
            return self
        return dataclasses.replace(self, host=self.in_out.detach().numpy() if rows else None, host_rows=rows)

    def nbytes_copied(self) -> int:
        """Bytes this product holds beyond the module's own weight (the second layout)."""
        return self.out_in.numel() * self.out_in.element_size() if self.out_in is not None and self.in_out is not None else 0


def _matmul(weight: torch.Tensor, bias: torch.Tensor | None, *, conv1d: bool, copy: bool,
            sizes: tuple[int, ...] = ()) -> _Matmul:
    """The product of a weight stored [out, in] (nn.Linear) or [in, out] (``conv1d``), with
    the other layout copied when ``copy``."""
    other = weight.detach().t().contiguous() if copy else None
    out_in, in_out = (other, weight) if conv1d else (weight, other)
    measured = weight.device.type == "cpu" and weight.dtype == torch.float32  # MKL's float32 kernels
    narrow = NARROW_ROWS if measured and out_in is not None else 0
    return _Matmul(out_in, in_out, bias, narrow, sizes)


def _projection(module: nn.Module, copy: bool) -> _Matmul:
    return _matmul(module.weight, module.bias, conv1d=type(module) is Conv1D, copy=copy)


def _fused(linears: list[nn.Linear], copy: bool) -> _Matmul:
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
    return _matmul(weight, bias, conv1d=False, copy=copy, sizes=tuple(linear.out_features for linear in linears))


@dataclass(frozen=True)
class _Layer:
    """References to one decoder layer's parameters (the HF module's own tensors), and the
    little that differs between the families: where q, k and v lie in the fused projection's
    output, the attention scale, and the MLP's shape."""

    attn_norm: _Norm
    qkv: _Matmul  # q, k and v projections in one product
    per_head_qkv: bool  # qkv output [T, H, (q k v), D] (gpt_bigcode without MQA), else [T, (H q, KV k, KV v), D]
    scale: float  # of the attention logits (GPT-2 may also divide it by the layer's index + 1)
    o: _Matmul
    mlp_norm: _Norm
    gate_up: _Matmul | None  # gated MLP (Llama, Qwen2, Mistral): down(act(gate(x)) * up(x)) ...
    up: _Matmul | None  # ... or plain (StarCoder2, GPT-2): up = c_fc, down = c_proj: down(act(up(x)))
    down: _Matmul
    window: int | None  # sliding window in tokens, None for full attention
    qk_norm: _Norm | None = None  # Qwen3: RMSNorm of each q and k head before the rotation (_head_norm)
    residual_scale: float = 1.0  # Granite's residual_multiplier: x + scale * branch(x)
    parallel: bool = False  # GPT-NeoX's parallel residual: x + attn(norm1(x)) + mlp(norm2(x))
    rope: str | None = None  # which rotary tables turn q and k (Gemma 3's layer type; None: the one)
    post_attn_norm: _Norm | None = None  # Gemma 3 normalises each branch's output too ...
    post_mlp_norm: _Norm | None = None  # ... before adding it to the residual stream
    softcap: float | None = None  # Gemma 2's soft cap of the attention scores: cap * tanh(scores / cap)
    projection_norms: tuple[_Norm, _Norm] | None = None  # OLMo 2's RMSNorms of the whole q and k projections

    def matmuls(self) -> list[_Matmul]:
        return [m for m in (self.qkv, self.o, self.gate_up, self.up, self.down) if m is not None]

    def routed(self, rows: frozenset[int]) -> "_Layer":
        """This layer with its products of ``rows`` through numpy's BLAS (``_Matmul.routed``)."""
        return dataclasses.replace(self, **{name: getattr(self, name).routed(rows)
                                            for name in ("qkv", "o", "gate_up", "up", "down")
                                            if getattr(self, name) is not None})


def _norm(module: nn.Module) -> _Norm:
    kind = _norm_kind(module)
    if kind == "layer":
        return _Norm(module.weight, module.bias, module.eps, rms=False)
    if kind == "gemma":  # output * (1 + weight), in float32: the sum is a small copy held here
        with torch.no_grad():
            return _Norm(1.0 + module.weight.float(), None, module.eps, rms=True, upcast=True)
    if kind == "upcast":
        return _Norm(module.weight, None, module.variance_epsilon, rms=True, upcast=True)
    return _Norm(module.weight, None, module.variance_epsilon, rms=True)


def _head_norm(q: nn.Module, k: nn.Module, heads: int, kv_heads: int) -> _Norm:
    """Qwen3's (and Gemma 3's) RMSNorms of each q head and each k head as one norm over the last
    dim of [T, heads + kv_heads, D]: its weight [heads + kv_heads, D] repeats q's weight per q
    head and k's per k head (a small copy)."""
    q_norm, k_norm = _norm(q), _norm(k)
    with torch.no_grad():
        weight = torch.cat([q_norm.weight.expand(heads, -1), k_norm.weight.expand(kv_heads, -1)])
    return dataclasses.replace(q_norm, weight=weight)


def _apply_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    if not norm.rms:
        return F.layer_norm(x, norm.weight.shape, norm.weight, norm.bias, norm.eps)
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        if norm.weight.dim() > 1:  # per-head weights (_head_norm): normalise over the head dim, then scale
            return F.rms_norm(x, norm.weight.shape[-1:], None, norm.eps).mul_(norm.weight)
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)  # one fused op, same maths
    # HF's RMSNorms in a half dtype: statistics in float32; Llama's cast back, then scale by the
    # weight; Gemma's scale by (1 + weight) in float32, then cast.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.upcast:
        return (h * norm.weight).to(x.dtype)
    return norm.weight * h.to(x.dtype)


@functools.lru_cache(maxsize=None)
def _sdpa_has_gqa() -> bool:
    """Whether this torch's scaled_dot_product_attention takes ``enable_gqa`` (2.5 and later)."""
    q = torch.zeros(1, 2, 1, 1)
    try:
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


class LeanForward:
    """The batch-1 forward of one HF Llama- or GPT-2-family model. Build once per model (check
    ``unsupported_reason`` first); caches come from ``new_cache``, one per sequence."""

    name = "lean"

    def __init__(self, model: PreTrainedModel, transposed_weights: str = "auto"):
        """``transposed_weights``: hold every weight matrix a second time, transposed, so that
        each product runs in the layout MKL is fastest at for its width (``_Matmul``): "on",
        "off", or "auto" = on for a float32 model on a CPU with at most
        ``TRANSPOSED_WEIGHTS_MAX_BYTES`` of weights. It costs the weights' memory again."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        if transposed_weights not in ("auto", "on", "off"):
            raise ValueError(f"transposed_weights must be auto, on or off, not {transposed_weights!r}")
        self.model = model
        self.max_positions = model.config.max_position_embeddings
        copy = transposed_weights == "on" or (transposed_weights == "auto" and _copies_pay(model))
        self.position_offset = 0  # learned positions' first row (OPT's: 2)
        getattr(self, f"_describe_{FAMILIES[model.config.model_type]}")(model, copy)
        # rotated dims of each head, where fewer than all (partial rotary); every rotary kind turns as many
        rotary_dim = 2 * next(iter(self.ropes.values()))[0].numel() if self.ropes else None
        self.rotary_dim = rotary_dim if rotary_dim is not None and rotary_dim < self.head_dim else None
        self.lm_head = _projection(model.lm_head, copy)
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
        if self.host_rows:
            rows = "1 row" if self.host_rows == {1} else f"{_spans(self.host_rows)} rows"
            parts.append(f"products of {rows} through numpy's BLAS ({host_blas()})")
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

    def host_products(self, setting: str = "auto", repeats: int = HOST_REPEATS) -> frozenset[int]:
        """Choose which products run through numpy's BLAS (``route_products``): "off" none, "on"
        every product of 1-``HOST_ROWS`` rows, "auto" what measures faster on this machine: a
        forward of each ``HOST_PROBES`` width (1: a decode step; 2: a short verify; 8), timed both
        ways, interleaved, ``repeats`` times after ``HOST_CONTEXT`` tokens; the row counts a
        probe stands for go to numpy if its forward was faster there by ``HOST_MARGIN`` (so a
        tie, within this machine's noise, stays on torch). numpy's BLAS runs on one thread
        (``limit_host_threads``). Returns the row counts chosen."""
        if setting not in ("auto", "on", "off"):
            raise ValueError(f"host products must be auto, on or off, not {setting!r}")
        weight = self.embed.weight
        eligible = weight.device.type == "cpu" and weight.dtype == torch.float32 and \
            self.lm_head.in_out is not None
        if setting == "off" or not eligible:
            self.route_products(NO_HOST)
            return self.host_rows
        limit_host_threads()
        if setting == "on":
            self.route_products(ALL_HOST_ROWS)
            return self.host_rows
        generator = torch.Generator().manual_seed(0)
        vocab = self.embed.weight.shape[0]
        cache = self.new_cache(HOST_CONTEXT + 16)
        self.forward(torch.randint(0, vocab, (1, HOST_CONTEXT), generator=generator), cache, last_only=True)
        times: dict[tuple[int, bool], list[float]] = {}
        for width in HOST_PROBES:
            ids = torch.randint(0, vocab, (1, width), generator=generator)
            for i in range(repeats + 1):
                for host in ((False, True) if i % 2 else (True, False)):
                    self.route_products(ALL_HOST_ROWS if host else NO_HOST)
                    started = time.perf_counter()
                    self.forward(ids, cache, last_only=True)
                    if i:  # the first round warms up
                        times.setdefault((width, host), []).append(time.perf_counter() - started)
                    cache.length = HOST_CONTEXT
        median = {key: statistics.median(values) * 1000 for key, values in times.items()}
        chosen = frozenset(rows for width, rows in HOST_PROBES.items()
                           if median[width, True] < HOST_MARGIN * median[width, False] for rows in rows)
        self.host_note = "numpy/torch measured " + ", ".join(
            f"{median[width, True]:.2f}/{median[width, False]:.2f} ms at width {width}" for width in HOST_PROBES)
        self.route_products(chosen)
        return self.host_rows

    def _describe_llama(self, model: PreTrainedModel, copy: bool) -> None:
        config, body = model.config, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        self.act = ACTIVATIONS[_activation(config)]
        self.embed, self.positions, self.ropes = body.embed_tokens, None, _rotaries(body.rotary_emb)
        # Gemma multiplies the embeddings by a buffer cast to the weights' dtype, Granite by a float
        scale = getattr(body.embed_tokens, "embed_scale", None)
        self.embed_scale = scale if scale is not None else getattr(config, "embedding_multiplier", None)
        self.logit_scale = getattr(config, "logits_scaling", None)  # Granite divides its logits by it
        self.logit_cap = getattr(config, "final_logit_softcapping", None)  # Gemma 3's, where set
        self.final_norm = _norm(_final_norm(body))
        self.layers = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            gated = hasattr(mlp, "gate_proj") or hasattr(mlp, "gate_up_proj")
            if hasattr(attn, "qkv_proj"):  # Phi-3 stores q, k and v fused, as we would fuse them
                qkv = _projection(attn.qkv_proj, copy)
            else:
                qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj], copy)
            if hasattr(mlp, "gate_up_proj"):
                gate_up = mlp.gate_up_proj
                half = gate_up.out_features // 2
                gate_up = _matmul(gate_up.weight, gate_up.bias, conv1d=False, copy=copy, sizes=(half, half))
            else:
                gate_up = _fused([mlp.gate_proj, mlp.up_proj], copy) if gated else None
            norms = [None if norm is None else _norm(norm) for norm in _layer_norms(layer)]
            attn_norm, mlp_norm = norms[0], norms[-1]  # Phi: one norm, read by both branches
            post_attn_norm = post_mlp_norm = None
            if len(norms) == 4:  # Gemma 2 and 3: before and after each branch (OLMo 2: after only)
                attn_norm, post_attn_norm, mlp_norm, post_mlp_norm = norms
            self.layers.append(_Layer(
                attn_norm=attn_norm, qkv=qkv,
                per_head_qkv=False, scale=attn.scaling,
                o=_projection(getattr(attn, _attention_names(attn)[-1]), copy), mlp_norm=mlp_norm,
                gate_up=gate_up,
                up=None if gated else _projection(getattr(mlp, _mlp_names(mlp)[0]), copy),
                down=_projection(getattr(mlp, _mlp_names(mlp)[-1]), copy),
                window=_sliding_window(config, attn),
                qk_norm=(_head_norm(attn.q_norm, attn.k_norm, self.heads, self.kv_heads)
                         if hasattr(attn, "q_norm") and attn.q_norm.weight.numel() == self.head_dim else None),
                projection_norms=((_norm(attn.q_norm), _norm(attn.k_norm))
                                  if hasattr(attn, "q_norm") and attn.q_norm.weight.numel() != self.head_dim else None),
                residual_scale=getattr(layer, "residual_multiplier", 1.0),
                parallel=len(norms) == 1,
                rope=getattr(attn, "layer_type", None) if len(self.ropes) > 1 else None,
                post_attn_norm=post_attn_norm, post_mlp_norm=post_mlp_norm,
                softcap=getattr(attn, "attn_logit_softcapping", None),
            ))

    def _describe_gpt2(self, model: PreTrainedModel, copy: bool) -> None:
        config, body = model.config, model.transformer
        attention = body.h[0].attn
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(attention, "kv_heads", self.heads)  # gpt_bigcode: 1 with multi_query
        self.head_dim = attention.head_dim
        self.act = ACTIVATIONS[config.activation_function]
        self.embed, self.positions, self.ropes = body.wte, body.wpe, {}
        self.embed_scale = self.logit_scale = self.logit_cap = None
        self.final_norm = _norm(body.ln_f)
        # gpt_bigcode without multi-query views c_attn's output per head; gpt2 and MQA split it whole
        per_head = config.model_type == "gpt_bigcode" and not config.multi_query
        self.layers = [_Layer(
            attn_norm=_norm(block.ln_1), qkv=_projection(block.attn.c_attn, copy), per_head_qkv=per_head,
            scale=block.attn.scaling, o=_projection(block.attn.c_proj, copy), mlp_norm=_norm(block.ln_2),
            gate_up=None, up=_projection(block.mlp.c_fc, copy), down=_projection(block.mlp.c_proj, copy),
            window=None,
        ) for block in body.h]

    def _describe_neox(self, model: PreTrainedModel, copy: bool) -> None:
        config, body = model.config, model.gpt_neox
        self.heads = self.kv_heads = config.num_attention_heads
        attention = body.layers[0].attention
        self.head_dim = attention.head_size
        self.act = ACTIVATIONS[config.hidden_act]
        self.embed, self.positions, self.ropes = body.embed_in, None, _rotaries(body.rotary_emb)
        self.embed_scale = self.logit_scale = self.logit_cap = None
        self.final_norm = _norm(body.final_layer_norm)
        # query_key_value's output is [T, H, (q k v), D], as gpt_bigcode's without multi-query
        self.layers = [_Layer(
            attn_norm=_norm(layer.input_layernorm), qkv=_projection(layer.attention.query_key_value, copy),
            per_head_qkv=True, scale=layer.attention.scaling, o=_projection(layer.attention.dense, copy),
            mlp_norm=_norm(layer.post_attention_layernorm), gate_up=None,
            up=_projection(layer.mlp.dense_h_to_4h, copy), down=_projection(layer.mlp.dense_4h_to_h, copy),
            window=None, parallel=config.use_parallel_residual,
        ) for layer in body.layers]

    def _describe_opt(self, model: PreTrainedModel, copy: bool) -> None:
        config, body = model.config, model.model.decoder
        self.heads = self.kv_heads = config.num_attention_heads
        self.head_dim = body.layers[0].self_attn.head_dim
        self.act = ACTIVATIONS[config.activation_function]
        self.embed, self.positions, self.ropes = body.embed_tokens, body.embed_positions, {}
        self.position_offset = body.embed_positions.offset
        self.embed_scale = self.logit_scale = self.logit_cap = None
        self.final_norm = _norm(body.final_layer_norm)
        # OPT multiplies q (bias included) by the scale before its product with k; here SDPA
        # scales the product: the same value up to float rounding
        self.layers = [_Layer(
            attn_norm=_norm(layer.self_attn_layer_norm),
            qkv=_fused([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], copy),
            per_head_qkv=False, scale=layer.self_attn.scaling, o=_projection(layer.self_attn.out_proj, copy),
            mlp_norm=_norm(layer.final_layer_norm), gate_up=None, up=_projection(layer.fc1, copy),
            down=_projection(layer.fc2, copy), window=None,
        ) for layer in body.layers]

    # ---- the interface KVState drives ---------------------------------------------------

    @property
    def lazy_head(self) -> bool:
        """Verification reads logits row by row (``kvcache.LazyRows``) on a CPU; on a GPU one
        kernel for every row costs about one row, and each row read would be a device sync.
        Replayed forwards (``use_graphs``) compute every row, as on a GPU."""
        return self.embed.weight.device.type == "cpu" and self.graphs is None

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

    trees = True  # forward(parents=...) runs a token tree; keep() keeps one path of it

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
        depths = None if parents is None else _tree_depths(parents, width)
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
        device = input_ids.device
        positions = None if depths is None else torch.tensor(depths, device=device) + start
        ropes = self._rope(start, end, device, positions)  # kind -> cos, sin [T, 1, D]: broadcast over heads
        masks: dict[int | None, Mask] = {}  # per sliding window
        x = self._embed(input_ids)  # x: [T, hidden]
        if self.positions is not None:  # learned absolute positions, as HF adds them
            offset = self.position_offset
            x.add_(self.positions.weight[start + offset:end + offset] if positions is None else
                   self.positions.weight[positions + offset])
        for layer, kv in zip(self.layers, cache.kv):
            if layer.window not in masks:
                masks[layer.window] = (self._mask(start, end, layer.window, device) if parents is None else
                                       self._tree_mask(start, parents, depths, layer.window, device))
            cos, sin = ropes.get(layer.rope, NO_ROPE)
            x = self._decoder_layer(layer, x, kv, cos, sin, start, end, masks[layer.window])
        if last_only:
            x = x[-1:]
        x = _apply_norm(x, self.final_norm)
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

    @torch.inference_mode()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, V] of final hidden states ``x`` [T, D] (``forward(head=False)``)."""
        return self._lm_head(x).float()

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated at its positions: every dim, or the first ``rotary_dim`` of
        each head with the rest passed through (partial rotary, as HF concatenates them)."""
        if self.rotary_dim is None:
            return _rotate(x, cos, sin)
        return torch.cat((_rotate(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]), dim=-1)

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
        weight run as (weight @ x.T).T at every width (``_Matmul``); the result is then a
        transposed view, which every row-wise consumer takes as it is."""
        logits = self.lm_head(x)
        if self.logit_cap is not None:  # Gemma 3's soft cap, as HF computes it
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
        masks: dict[int | None, Mask] = {}
        for layer, layer_kv in zip(self.layers, kv):
            if layer.window not in masks:
                masks[layer.window] = (0, self._positions_mask(positions, capacity, layer.window))
            cos, sin = ropes.get(layer.rope, NO_ROPE)
            x = self._decoder_layer(layer, x, layer_kv, cos, sin, positions, capacity, masks[layer.window])
        if last_only:
            x = x[-1:]
        return self._lm_head(_apply_norm(x, self.final_norm)).float()

    def _positions_mask(self, positions: torch.Tensor, capacity: int, window: int | None) -> torch.Tensor:
        """``_mask`` over every slot of a cache of ``capacity`` for queries at ``positions``
        (a device tensor), as the grouped queries of a narrow forward read it."""
        key = torch.arange(capacity, device=positions.device).unsqueeze(0)  # [1, S]
        query = positions.unsqueeze(1)  # [T, 1]
        allowed = key <= query
        if window is not None:
            allowed &= key > query - window
        bias = torch.zeros(allowed.shape, dtype=self.embed.weight.dtype, device=positions.device)
        bias.masked_fill_(~allowed, float("-inf"))
        return bias.repeat(self.heads // self.kv_heads, 1)

    # ---- one layer ----------------------------------------------------------------------

    def _decoder_layer(self, layer: _Layer, x: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, start: int | torch.Tensor, end: int, mask: Mask) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (updated in place: x is this forward's own activation).
        cos/sin: rotary tables, None for a model with learned positions. K/V go to slots
        start .. end - 1; in a replayed forward ``start`` is the tensor of those slots and
        ``end`` the cache's capacity, all of which the mask's keys span."""
        width, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        h = normed = x if layer.attn_norm is None else _apply_norm(x, layer.attn_norm)
        qkv = layer.qkv(h)
        if layer.projection_norms is not None:  # OLMo 2: q and k normalised whole, before the heads split
            q_size, k_size = heads * dim, kv_heads * dim
            qkv = torch.cat((_apply_norm(qkv[:, :q_size], layer.projection_norms[0]),
                             _apply_norm(qkv[:, q_size:q_size + k_size], layer.projection_norms[1]),
                             qkv[:, q_size + k_size:]), dim=-1)
        if layer.per_head_qkv:
            q, k, v = qkv.reshape(width, heads, 3, dim).unbind(2)  # each [T, H, D]
            if cos is not None:  # GPT-NeoX
                q, k = self._rotary(q, cos, sin), self._rotary(k, cos, sin)
        else:
            qkv = qkv.reshape(width, heads + 2 * kv_heads, dim)  # [T, H + KV + KV, D]
            qk, v = qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:]
            if layer.qk_norm is not None:
                qk = _apply_norm(qk, layer.qk_norm)
            if cos is not None:
                qk = self._rotary(qk, cos, sin)  # qk: [T, H + KV, D], one rotation for both
            q, k = qk[:, :heads], qk[:, heads:]
        if isinstance(start, int):
            kv[0, :, start:end] = k.transpose(0, 1)
            kv[1, :, start:end] = v.transpose(0, 1)
        else:  # a replayed forward (_static_forward): start holds the new positions, on the device
            kv[0].index_copy_(1, start, k.transpose(0, 1))
            kv[1].index_copy_(1, start, v.transpose(0, 1))
        out = self._attend(q, kv, end, mask, layer.scale, layer.softcap)  # out: [T, H * D]
        if layer.parallel:  # the MLP reads the layer's input, not the attention's sum
            h = normed if layer.mlp_norm is layer.attn_norm else _apply_norm(x, layer.mlp_norm)
            x.add_(layer.o(out))
        else:
            branch = layer.o(out)
            if layer.post_attn_norm is not None:
                branch = _apply_norm(branch, layer.post_attn_norm)
            x.add_(_scaled(branch, layer.residual_scale))
            h = x if layer.mlp_norm is None else _apply_norm(x, layer.mlp_norm)
        if layer.gate_up is not None:
            gate_up = layer.gate_up(h)
            size = layer.gate_up.sizes[0]
            h = self.act(gate_up[:, :size]).mul_(gate_up[:, size:])
        else:
            h = self.act(layer.up(h))
        h = layer.down(h)
        if layer.post_mlp_norm is not None:
            h = _apply_norm(h, layer.post_mlp_norm)
        return x.add_(_scaled(h, layer.residual_scale))

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, end: int, mask: Mask, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        """Attention of q [T, H, D] over the cache's keys/values up to ``end``; [T, H * D].
        4-D inputs throughout: the CPU flash kernel takes only those (3-D ones fall to the math path)."""
        width, first, attn_mask = q.shape[0], *mask
        keys, values = kv[:, :, first:end].unsqueeze(1)  # each [1, KV, S, D]
        if softcap is not None:
            return self._attend_capped(q, keys, values, attn_mask, scale, softcap)
        if width < WIDE:
            # GQA without expanding K/V: the n_rep query heads sharing a kv head become n_rep * T
            # query rows of that head (HF's repeat_kv pairs head h with kv head h // n_rep).
            q = q.transpose(0, 1).reshape(1, self.kv_heads, -1, self.head_dim)  # q: [1, KV, n_rep * T, D]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale)
            return out.view(self.heads, width, self.head_dim).transpose(0, 1).reshape(width, -1)
        # A prefill: per-head queries, so the kernel's causal path can skip masked blocks.
        if _sdpa_has_gqa():
            gqa = {"enable_gqa": True}
        else:  # an older torch: expand the kv heads (a prefill-sized copy, once per layer)
            gqa, n_rep = {}, self.heads // self.kv_heads
            keys, values = keys.repeat_interleave(n_rep, 1), values.repeat_interleave(n_rep, 1)
        causal = attn_mask is CAUSAL
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, is_causal=causal,
                                             attn_mask=None if causal else attn_mask, scale=scale, **gqa)
        return out[0].transpose(0, 1).reshape(width, -1)

    def _attend_capped(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       attn_mask: torch.Tensor | None, scale: float, cap: float) -> torch.Tensor:
        """Attention whose scores are soft-capped (Gemma 2), which SDPA cannot do: transformers'
        eager formula, step for step (scores times the scale, cap * tanh(scores / cap), plus the
        mask, softmax in float32), with the query heads grouped per kv head as a narrow forward
        groups them (``_attend``)."""
        width, n_rep = q.shape[0], self.heads // self.kv_heads
        q = q.transpose(0, 1).reshape(1, self.kv_heads, n_rep * width, self.head_dim)  # [1, KV, n_rep * T, D]
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [1, KV, n_rep * T, S]
        scores = torch.tanh(scores / cap) * cap
        if attn_mask is CAUSAL:  # a prefill from position 0: queries and keys are the same positions
            attn_mask = torch.full((width, width), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
        if attn_mask is not None:
            scores = scores + (attn_mask if attn_mask.shape[0] == scores.shape[2] else attn_mask.repeat(n_rep, 1))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, values)  # [1, KV, n_rep * T, D]
        return out.view(self.heads, width, self.head_dim).transpose(0, 1).reshape(width, -1)

    def _mask(self, start: int, end: int, window: int | None, device: torch.device) -> Mask:
        """(first key slot, mask) for queries at positions start .. end - 1: each sees the keys at
        or before its own position (and, with a sliding window, after its position minus the
        window). The mask is additive, [T, S] for a wide forward and [n_rep * T, S] for a narrow
        one (see ``_attend``); None for one query; CAUSAL for a wide one from position 0."""
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
        bias = torch.zeros(allowed.shape, dtype=self.embed.weight.dtype, device=device)
        bias.masked_fill_(~allowed, float("-inf"))
        return first, bias if width >= WIDE else bias.repeat(self.heads // self.kv_heads, 1)

    def _tree_mask(self, start: int, parents: Sequence[int], depths: list[int], window: int | None,
                   device: torch.device) -> Mask:
        """``_mask`` for a token tree (``forward(parents=...)``): token i sees the cache and the
        tree's tokens on its own root path; a sliding window counts positions (depths), not slots."""
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
        bias = torch.zeros(allowed.shape, dtype=self.embed.weight.dtype)
        bias.masked_fill_(~allowed, float("-inf"))
        bias = bias.to(device)
        return first, bias if width >= WIDE else bias.repeat(self.heads // self.kv_heads, 1)

    def _rope(self, start: int, end: int, device: torch.device,
              positions: torch.Tensor | None = None) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Per rotary kind (``_rotaries``; none for learned positions), cos and sign-folded sin
        [T, 1, D] for positions start .. end - 1 (or ``positions``, a token tree's, none past
        end - 1), from tables computed as HF's rotary embedding computes them (float32, then the
        model's dtype); the tables grow by doubling."""
        if not self.ropes:
            return {}
        dtype = self.embed.weight.dtype  # the model's, also after a .to() since the tables were built
        cos, _ = next(iter(self._tables.values()), (None, None))
        if cos is None or cos.shape[0] < end or cos.device != device or cos.dtype != dtype:
            size = max(end, min(2 * (0 if cos is None else cos.shape[0]), self.max_positions), INITIAL_CAPACITY)
            self._tables = {kind: self._rope_tables(inv_freq, scaling, size, device)
                            for kind, (inv_freq, scaling, _) in self.ropes.items()}
        if positions is not None:
            return {kind: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                    for kind, (cos, sin) in self._tables.items()}
        return {kind: (cos[start:end].unsqueeze(1), sin[start:end].unsqueeze(1))
                for kind, (cos, sin) in self._tables.items()}

    def _rope_tables(self, inv_freq: torch.Tensor, scaling: float, size: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            inv_freq = inv_freq.to(device=device, dtype=torch.float32)
            freqs = torch.arange(size, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            cos = emb.cos() * scaling
            sin = emb.sin() * scaling
            half = emb.shape[-1] // 2  # the rotated dims (all of a head's, unless partial)
            # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2]: one op instead of slice+neg+cat
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            dtype = self.embed.weight.dtype
            return cos.to(dtype), sin.to(dtype)


def _tree_depths(parents: Sequence[int], width: int) -> list[int]:
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


def _scaled(branch: torch.Tensor, scale: float) -> torch.Tensor:
    """A residual branch times Granite's residual_multiplier, rounded as HF rounds it (the
    product first, then the sum); others' branches as they are."""
    return branch if scale == 1.0 else branch.mul_(scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for x [T, heads, D]: x * cos + rotate_half(x) * sin, with
    rotate_half(x) * sin == roll(x, D/2) * sin_folded (negation is exact, so are the products)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
