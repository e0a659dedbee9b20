"""GPT-NeoX (Pythia) in the lean forward.

LayerNorm with bias, one fused ``query_key_value`` laid out per head (as gpt_bigcode's without
multi-query), rotary positions over the first ``rotary_dim`` dims of each head (partial rotary),
and by default a parallel residual: x + attn(norm1(x)) + mlp(norm2(x)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from specd.engine.forward.lean.layers import ACTIVATIONS, Decoder, Layer, norm_of, plain_modules_reason, projection
from specd.engine.forward.lean.rotary import STATIC_ROPE_TYPES, rotaries

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# model type -> the transformers.models package that holds its classes
MODEL_TYPES = {"gpt_neox": "gpt_neox"}
BODY = "gpt_neox"  # the decoder's attribute on the ...ForCausalLM


def reason(model: PreTrainedModel) -> str | None:
    config, body = model.config, model.gpt_neox
    rope_type = getattr(body.rotary_emb, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if config.hidden_act not in ACTIVATIONS:
        return f"activation {config.hidden_act!r}"
    if type(body.embed_in) is not nn.Embedding:
        return f"token embeddings are a {type(body.embed_in).__name__}"
    return plain_modules_reason(body.layers, lambda layer: (
        (layer.attention.query_key_value, layer.attention.dense, layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h),
        (layer.input_layernorm, layer.post_attention_layernorm)), body.final_layer_norm)


def describe(model: PreTrainedModel, copy: bool) -> Decoder:
    config, body = model.config, model.gpt_neox
    heads = config.num_attention_heads
    return Decoder(
        heads=heads, kv_heads=heads, head_dim=body.layers[0].attention.head_size,
        act=ACTIVATIONS[config.hidden_act], embed=body.embed_in, ropes=rotaries(body.rotary_emb),
        final_norm=norm_of(body.final_layer_norm),
        # query_key_value's output is [T, H, (q k v), D], as gpt_bigcode's without multi-query
        layers=[Layer(
            attn_norm=norm_of(layer.input_layernorm), qkv=projection(layer.attention.query_key_value, copy),
            per_head_qkv=True, scale=layer.attention.scaling, o=projection(layer.attention.dense, copy),
            mlp_norm=norm_of(layer.post_attention_layernorm), gate_up=None,
            up=projection(layer.mlp.dense_h_to_4h, copy), down=projection(layer.mlp.dense_4h_to_h, copy),
            window=None, parallel=config.use_parallel_residual,
        ) for layer in body.layers],
    )
