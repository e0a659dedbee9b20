"""The Llama family of the lean forward: Llama, Qwen2, Mistral, StarCoder2, Qwen3, Gemma, Gemma 2,
Gemma 3, Granite, Phi-3, StableLM, Phi, OLMo 2.

Rotary positions, RMSNorm (LayerNorm in StarCoder2; Gemma's scales by 1 + weight in float32),
q/k/v as nn.Linear fused here into one product, grouped-query attention. The variants:

- Qwen3 (and Gemma 3) RMS-normalise each head of q and k before rotating them; OLMo 2 normalises
  q and k over their whole projections, and only the branches' outputs (no norm before them);
- Gemma scales the token embeddings by sqrt(hidden); Granite scales the embeddings, each residual
  branch and the logits by its config's multipliers;
- Phi-3 stores q/k/v and gate/up fused already; Phi-3, StableLM and Phi may rotate only a part of
  each head (partial rotary); Phi's one LayerNorm feeds attention and MLP side by side (a
  parallel residual);
- Gemma 2 and 3 also normalise each branch's output and may soft-cap their logits; Gemma 2
  soft-caps its attention scores; Gemma 3 turns its sliding layers' q and k at another rotary
  base than its full layers' (tables per kind).

Which variant a model is, is read from its modules (which attributes its layers hold), not from
its model type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from specd.engine.forward.lean.layers import (
    ACTIVATIONS,
    Decoder,
    Layer,
    fused,
    head_norm,
    matmul,
    norm_kind,
    norm_of,
    projection,
)
from specd.engine.forward.lean.rotary import STATIC_ROPE_TYPES, rotaries

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# model type -> the transformers.models package that holds its classes
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "starcoder2": "starcoder2",
               "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
               "granite": "granite", "phi3": "phi3", "stablelm": "stablelm", "phi": "phi", "olmo2": "olmo2"}
BODY = "model"  # the decoder's attribute on the ...ForCausalLM
PARTIAL_ROTARY = ("phi3", "stablelm", "phi")  # whose rotation passes a head's dims past the rotary ones through
SCALED_EMBEDDINGS = ("GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding")


def reason(model: PreTrainedModel) -> str | None:
    config, body = model.config, model.model
    ropes = rotaries(body.rotary_emb)
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
            if norm is not None and (norm_kind(norm) not in ("rms", "gemma", "upcast")
                                     or tuple(norm.weight.shape) not in ((head_dim,), (heads * head_dim,))):
                return f"layer {i}'s {name} is not an RMSNorm of each head or of the whole projection"
        linears = [*(getattr(attn, n) for n in _attention_names(attn)),
                   *(getattr(layer.mlp, n) for n in _mlp_names(layer.mlp))]
        if any(type(m) is not nn.Linear for m in linears):
            return f"layer {i} has projections that are not plain nn.Linear"
        for norm in filter(None, _layer_norms(layer)):
            if norm_kind(norm) is None:
                return f"layer {i} has a {type(norm).__name__} norm"
    if norm_kind(_final_norm(body)) is None:
        return f"final norm is a {type(_final_norm(body)).__name__}"
    embed = body.embed_tokens
    if type(embed) is not nn.Embedding and not (isinstance(embed, nn.Embedding) and
                                                type(embed).__name__ in SCALED_EMBEDDINGS):
        return f"token embeddings are a {type(embed).__name__}"
    return None


def describe(model: PreTrainedModel, copy: bool) -> Decoder:
    config, body = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = body.layers[0].self_attn.head_dim
    ropes = rotaries(body.rotary_emb)
    layers = []
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        gated = hasattr(mlp, "gate_proj") or hasattr(mlp, "gate_up_proj")
        if hasattr(attn, "qkv_proj"):  # Phi-3 stores q, k and v fused, as we would fuse them
            qkv = projection(attn.qkv_proj, copy)
        else:
            qkv = fused([attn.q_proj, attn.k_proj, attn.v_proj], copy)
        if hasattr(mlp, "gate_up_proj"):
            gate_up = mlp.gate_up_proj
            half = gate_up.out_features // 2
            gate_up = matmul(gate_up.weight, gate_up.bias, conv1d=False, copy=copy, sizes=(half, half))
        else:
            gate_up = fused([mlp.gate_proj, mlp.up_proj], copy) if gated else None
        norms = [None if norm is None else norm_of(norm) for norm in _layer_norms(layer)]
        attn_norm, mlp_norm = norms[0], norms[-1]  # Phi: one norm, read by both branches
        post_attn_norm = post_mlp_norm = None
        if len(norms) == 4:  # Gemma 2 and 3: before and after each branch (OLMo 2: after only)
            attn_norm, post_attn_norm, mlp_norm, post_mlp_norm = norms
        layers.append(Layer(
            attn_norm=attn_norm, qkv=qkv,
            per_head_qkv=False, scale=attn.scaling,
            o=projection(getattr(attn, _attention_names(attn)[-1]), copy), mlp_norm=mlp_norm,
            gate_up=gate_up,
            up=None if gated else projection(getattr(mlp, _mlp_names(mlp)[0]), copy),
            down=projection(getattr(mlp, _mlp_names(mlp)[-1]), copy),
            window=_sliding_window(config, attn),
            qk_norm=(head_norm(attn.q_norm, attn.k_norm, heads, kv_heads)
                     if hasattr(attn, "q_norm") and attn.q_norm.weight.numel() == head_dim else None),
            projection_norms=((norm_of(attn.q_norm), norm_of(attn.k_norm))
                              if hasattr(attn, "q_norm") and attn.q_norm.weight.numel() != head_dim else None),
            residual_scale=getattr(layer, "residual_multiplier", 1.0),
            parallel=len(norms) == 1,
            rope=getattr(attn, "layer_type", None) if len(ropes) > 1 else None,
            post_attn_norm=post_attn_norm, post_mlp_norm=post_mlp_norm,
            softcap=getattr(attn, "attn_logit_softcapping", None),
        ))
    # Gemma multiplies the embeddings by a buffer cast to the weights' dtype, Granite by a float
    scale = getattr(body.embed_tokens, "embed_scale", None)
    return Decoder(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, act=ACTIVATIONS[_activation(config)],
        embed=body.embed_tokens, final_norm=norm_of(_final_norm(body)), layers=layers, ropes=ropes,
        embed_scale=scale if scale is not None else getattr(config, "embedding_multiplier", None),
        logit_scale=getattr(config, "logits_scaling", None),  # Granite divides its logits by it
        logit_cap=getattr(config, "final_logit_softcapping", None),  # Gemma 2's and 3's, where set
    )


def _activation(config) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)  # Gemma 3's name


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
