"""OPT in the lean forward (OPT-125m's shape and the larger ones'; not OPT-350m's post-norm and
projected embeddings).

Learned positions offset by 2, q/k/v as nn.Linear fused here, relu, LayerNorms before each block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from specd.engine.forward.lean.layers import (
    ACTIVATIONS,
    Decoder,
    Layer,
    fused,
    norm_of,
    plain_modules_reason,
    projection,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# model type -> the transformers.models package that holds its classes
MODEL_TYPES = {"opt": "opt"}
BODY = "model"  # the decoder's attribute on the ...ForCausalLM


def reason(model: PreTrainedModel) -> str | None:
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
    return plain_modules_reason(body.layers, lambda layer: (
        (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.out_proj, layer.fc1,
         layer.fc2), (layer.self_attn_layer_norm, layer.final_layer_norm)), body.final_layer_norm)


def describe(model: PreTrainedModel, copy: bool) -> Decoder:
    config, body = model.config, model.model.decoder
    heads = config.num_attention_heads
    return Decoder(
        heads=heads, kv_heads=heads, head_dim=body.layers[0].self_attn.head_dim,
        act=ACTIVATIONS[config.activation_function], embed=body.embed_tokens,
        positions=body.embed_positions, position_offset=body.embed_positions.offset,
        final_norm=norm_of(body.final_layer_norm),
        # OPT multiplies q (bias included) by the scale before its product with k; here SDPA
        # scales the product: the same value up to float rounding
        layers=[Layer(
            attn_norm=norm_of(layer.self_attn_layer_norm),
            qkv=fused([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], copy),
            per_head_qkv=False, scale=layer.self_attn.scaling, o=projection(layer.self_attn.out_proj, copy),
            mlp_norm=norm_of(layer.final_layer_norm), gate_up=None, up=projection(layer.fc1, copy),
            down=projection(layer.fc2, copy), window=None,
        ) for layer in body.layers],
    )
