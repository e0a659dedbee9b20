"""The GPT-2 family of the lean forward: gpt2, and gpt_bigcode (StarCoderBase, SantaCoder,
TinyStarCoder).

Learned absolute position embeddings added to the token embeddings, LayerNorm with bias, one
fused ``c_attn`` as the checkpoint stores it (gpt2's ``Conv1D`` keeps its weight [in, out] and
runs as ``addmm(bias, x, weight)``, as transformers does), multi-query attention in gpt_bigcode,
the LM head tied to the token embeddings. GPT-2's ``gelu_new`` is the tanh GELU written out in
six ops; here it is ``F.gelu(approximate="tanh")``, the same formula in one op, equal to it up to
float32 rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from specd.engine.forward.lean.layers import ACTIVATIONS, Decoder, Layer, norm_kind, norm_of, projection

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# model type -> the transformers.models package that holds its classes
MODEL_TYPES = {"gpt2": "gpt2", "gpt_bigcode": "gpt_bigcode"}
BODY = "transformer"  # the decoder's attribute on the ...ForCausalLM


def reason(model: PreTrainedModel) -> str | None:
    from transformers.pytorch_utils import Conv1D  # on use: importing the engine loads no transformers

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
            if norm_kind(norm) != "layer":
                return f"layer {i} has a {type(norm).__name__} norm"
    if norm_kind(body.ln_f) != "layer":
        return f"final norm is a {type(body.ln_f).__name__}"
    return None


def describe(model: PreTrainedModel, copy: bool) -> Decoder:
    config, body = model.config, model.transformer
    attention = body.h[0].attn
    heads = config.num_attention_heads
    # gpt_bigcode without multi-query views c_attn's output per head; gpt2 and MQA split it whole
    per_head = config.model_type == "gpt_bigcode" and not config.multi_query
    return Decoder(
        heads=heads, kv_heads=getattr(attention, "kv_heads", heads),  # gpt_bigcode: 1 with multi_query
        head_dim=attention.head_dim, act=ACTIVATIONS[config.activation_function],
        embed=body.wte, positions=body.wpe, final_norm=norm_of(body.ln_f),
        layers=[Layer(
            attn_norm=norm_of(block.ln_1), qkv=projection(block.attn.c_attn, copy), per_head_qkv=per_head,
            scale=block.attn.scaling, o=projection(block.attn.c_proj, copy), mlp_norm=norm_of(block.ln_2),
            gate_up=None, up=projection(block.mlp.c_fc, copy), down=projection(block.mlp.c_proj, copy),
            window=None,
        ) for block in body.h],
    )
