"""Widen a trained model without changing what it computes: a memory-bound stand-in for a
real-sized model, with a trained model's behaviour (so a draft's acceptance is real).

Real code models are 30-500x larger than the demo and development pairs, so each forward
streams hundreds of megabytes of weights: there a few-row verify costs little more than a
one-row step, while on a tiny model it costs 2-3x. To measure that regime with trained pairs:

- ``--intermediate N``: each decoder layer's gated MLP gets N units instead of its own; the
  new units' output weights (``down_proj`` columns) are zero, so they add exactly nothing,
  while their input weights (random, at the trained weights' scale) are read on every forward.
- ``--hidden D``: the residual stream gets D dimensions; the new ones are zero in the
  embeddings and in every projection writing to the stream (``o_proj``, ``down_proj``), so they
  stay zero, and every RMS norm's weight is scaled by sqrt(old/new) with its epsilon by
  old/new, so the mean of squares over the wider stream normalises alike. The attention heads
  keep their size (``head_dim`` is written to the config).
- ``--heads H`` / ``--kv-heads G``: more attention heads of the same ``head_dim``. The new
  query heads and KV heads get random q/k/v rows (at the trained rows' scale) and zero
  ``o_proj`` input columns, so they add nothing. The original heads keep their grouping: the
  original KV heads come first, and the query heads that read KV head j sit at the start of
  group j, so each still reads its own K/V (this needs H/G >= the model's own group size).
- ``--layers L``: L decoder layers in all; the new ones are identity on the residual stream
  (random q/k/v and gate/up weights, zero ``o_proj`` and ``down_proj``), spread evenly between
  the original ones. An identity layer still costs a whole layer's forward and its KV cache.

A layout with a real model's proportions, e.g. Qwen2.5-Coder-0.5B's per-layer shape from the
development target (hidden 896, 14 heads of 64, 2 KV heads, 4864 MLP units)::

    python -m specd.demo.widen dev-pairs/llama-starcoder/target /tmp/qwen-shaped \
        --hidden 896 --heads 14 --kv-heads 2 --intermediate 4864 --layers 10

The logits equal the original's up to float rounding, and greedy outputs are identical; this
module checks both on a few inputs before it writes anything. Only Llama-style decoders
(``q/k/v/o_proj``, ``gate/up/down_proj``, RMS norms: Llama, Qwen2, Mistral and kin) are
supported; others get one line saying so.

    python -m specd.demo.widen dev-pairs/llama-starcoder/target /tmp/wide-target --intermediate 16384
"""

from __future__ import annotations

import argparse
import copy
import math
import shutil
import sys
from pathlib import Path

import torch

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "specd.json",
          "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")
READS_STREAM = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # their inputs are the stream
WRITES_STREAM = ("o_proj", "down_proj")  # their outputs are added to the stream


class Unsupported(ValueError):
    """A model this module cannot widen (not a Llama-style decoder)."""


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise Unsupported(f"{type(model).__name__} has no model.layers: only Llama-style decoders can be widened")
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        attn = getattr(layer, "self_attn", None)
        if mlp is None or attn is None or not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) \
                or not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise Unsupported(f"{type(model).__name__}: a layer without gate/up/down_proj and q/k/v/o_proj "
                              "(only Llama-style decoders can be widened)")
    return list(layers)


def _grow(linear: torch.nn.Linear, rows: int | None = None, cols: int | None = None,
          fill_rows: str = "zero", generator: torch.Generator | None = None) -> None:
    """Give ``linear`` ``rows`` outputs and ``cols`` inputs; new input columns are zero, new
    output rows zero or random at the existing rows' scale (``fill_rows="random"``)."""
    weight = linear.weight.data
    out_f, in_f = weight.shape
    rows, cols = rows or out_f, cols or in_f
    grown = torch.zeros(rows, cols, dtype=weight.dtype)
    grown[:out_f, :in_f] = weight
    if fill_rows == "random" and rows > out_f:
        scale = float(weight.float().std())
        grown[out_f:, :in_f] = torch.randn(rows - out_f, in_f, generator=generator).to(weight.dtype) * scale
    linear.weight = torch.nn.Parameter(grown, requires_grad=False)
    linear.in_features, linear.out_features = cols, rows
    if linear.bias is not None:
        bias = torch.zeros(rows, dtype=linear.bias.dtype)
        bias[:out_f] = linear.bias.data
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)


def _random_like(weight: torch.Tensor, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random values at the scale of ``weight``'s nonzero entries (zero padding does not count)."""
    trained = weight.float()[weight != 0]
    scale = float(trained.std()) if trained.numel() > 1 else 0.02
    return (torch.randn(*shape, generator=generator) * scale).to(weight.dtype)


def _place_heads(linear: torch.nn.Linear, places: list[int], heads: int, head_dim: int,
                 generator: torch.Generator) -> None:
    """Give a q/k/v projection ``heads`` heads of ``head_dim`` rows: its own head i at slot
    ``places[i]``, random rows (zero bias) in the other slots."""
    weight = linear.weight.data  # [old_heads * head_dim, hidden]
    grown = _random_like(weight, (heads * head_dim, weight.shape[1]), generator)
    bias = None if linear.bias is None else torch.zeros(heads * head_dim, dtype=linear.bias.dtype)
    for head, slot in enumerate(places):
        own, new = slice(head * head_dim, (head + 1) * head_dim), slice(slot * head_dim, (slot + 1) * head_dim)
        grown[new] = weight[own]
        if bias is not None:
            bias[new] = linear.bias.data[own]
    linear.weight = torch.nn.Parameter(grown, requires_grad=False)
    linear.out_features = heads * head_dim
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)


def _place_head_inputs(o_proj: torch.nn.Linear, places: list[int], heads: int, head_dim: int) -> None:
    """``o_proj`` reads ``heads`` heads: its own head i's columns at slot ``places[i]``, zero
    columns for the new heads (so their outputs add nothing)."""
    weight = o_proj.weight.data  # [hidden, old_heads * head_dim]
    grown = torch.zeros(weight.shape[0], heads * head_dim, dtype=weight.dtype)
    for head, slot in enumerate(places):
        grown[:, slot * head_dim:(slot + 1) * head_dim] = weight[:, head * head_dim:(head + 1) * head_dim]
    o_proj.weight = torch.nn.Parameter(grown, requires_grad=False)
    o_proj.in_features = heads * head_dim


def _widen_heads(layers: list[torch.nn.Module], config, heads: int | None, kv_heads: int | None,
                 generator: torch.Generator) -> None:
    """More query and KV heads of the same size; each original query head still reads its
    original KV head, and the new heads' outputs are multiplied by zero in ``o_proj``."""
    old_heads = config.num_attention_heads
    old_kv = getattr(config, "num_key_value_heads", None) or old_heads
    heads, kv_heads = heads or old_heads, kv_heads or old_kv
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // old_heads
    if heads < old_heads or kv_heads < old_kv:
        raise ValueError(f"--heads {heads} / --kv-heads {kv_heads} is below the model's {old_heads} / {old_kv}")
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    old_group, group = old_heads // old_kv, heads // kv_heads
    if group < old_group:
        raise ValueError(f"--heads {heads} / --kv-heads {kv_heads} gives groups of {group} query heads, "
                         f"fewer than the model's {old_group}: its heads could not keep their KV heads")
    # Original KV head j stays at slot j; the query heads reading it fill the start of group j.
    places = [(head // old_group) * group + head % old_group for head in range(old_heads)]
    for layer in layers:
        attn = layer.self_attn
        _place_heads(attn.q_proj, places, heads, head_dim, generator)
        _place_heads(attn.k_proj, list(range(old_kv)), kv_heads, head_dim, generator)
        _place_heads(attn.v_proj, list(range(old_kv)), kv_heads, head_dim, generator)
        _place_head_inputs(attn.o_proj, places, heads, head_dim)
        attn.head_dim = head_dim
        attn.num_key_value_groups = group
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, kv_heads, head_dim


def _identity_layer(layer: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """A copy of ``layer`` that adds nothing to the residual stream: random weights where it
    reads the stream, zero where it writes to it (so it still costs a whole layer's forward)."""
    new = copy.deepcopy(layer)
    for name in READS_STREAM:
        linear = getattr(new.self_attn if name in ("q_proj", "k_proj", "v_proj") else new.mlp, name)
        linear.weight = torch.nn.Parameter(_random_like(linear.weight.data, tuple(linear.weight.shape), generator),
                                           requires_grad=False)
    for name in WRITES_STREAM:
        linear = getattr(new.self_attn if name == "o_proj" else new.mlp, name)
        linear.weight = torch.nn.Parameter(torch.zeros_like(linear.weight), requires_grad=False)
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    return new


def _add_layers(model: torch.nn.Module, total: int, generator: torch.Generator) -> None:
    """``total`` decoder layers: identity layers spread evenly after the original ones (each a
    copy of the layer before it, so it has that layer's attention type)."""
    config, layers = model.config, list(model.model.layers)
    old, extra = len(layers), total - len(layers)
    if extra < 0:
        raise ValueError(f"--layers {total} is below the model's {old}")
    old_types = list(getattr(config, "layer_types", None) or [])
    grown, types = [], []
    for index, layer in enumerate(layers):
        copies = (index + 1) * extra // old - index * extra // old
        grown += [layer] + [_identity_layer(layer, generator) for _ in range(copies)]
        types += [old_types[index]] * (1 + copies) if old_types else []
    for index, layer in enumerate(grown):
        layer.self_attn.layer_idx = index  # the KV cache's slot
    model.model.layers = torch.nn.ModuleList(grown)
    config.num_hidden_layers = total
    if old_types:
        config.layer_types = types


def _norms(model: torch.nn.Module, hidden: int) -> list[torch.nn.Module]:
    """Every RMS norm over the residual stream (a 1-D weight of the stream's width)."""
    return [module for name, module in model.named_modules()
            if "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.dim() == 1 and module.weight.shape[0] == hidden and not name.endswith(("q_norm", "k_norm"))]


def widen(model: torch.nn.Module, intermediate: int | None = None, hidden: int | None = None,
          seed: int = 0, heads: int | None = None, kv_heads: int | None = None,
          layers: int | None = None) -> torch.nn.Module:
    """Widen ``model`` in place (see the module's docstring) and return it."""
    config = model.config
    total_layers, layers = layers, _layers(model)
    generator = torch.Generator().manual_seed(seed)
    old_hidden = config.hidden_size
    if heads is not None or kv_heads is not None:
        _widen_heads(layers, config, heads, kv_heads, generator)  # before --hidden: it reads the old width
    if intermediate is not None:
        if intermediate < config.intermediate_size:
            raise ValueError(f"--intermediate {intermediate} is below the model's {config.intermediate_size}")
        for layer in layers:
            mlp = layer.mlp
            _grow(mlp.gate_proj, rows=intermediate, fill_rows="random", generator=generator)
            _grow(mlp.up_proj, rows=intermediate, fill_rows="random", generator=generator)
            _grow(mlp.down_proj, cols=intermediate)  # the new units' outputs: zero
        config.intermediate_size = intermediate
    if hidden is not None and hidden != old_hidden:
        if hidden < old_hidden:
            raise ValueError(f"--hidden {hidden} is below the model's {old_hidden}")
        head_dim = getattr(config, "head_dim", None) or old_hidden // config.num_attention_heads
        norms = _norms(model, old_hidden)
        for layer in layers:
            for name in READS_STREAM:
                _grow(getattr(layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj")) else layer.mlp, name),
                      cols=hidden)
            for name in WRITES_STREAM:
                _grow(getattr(layer.self_attn if name == "o_proj" else layer.mlp, name), rows=hidden)
        embed = model.get_input_embeddings()
        grown = torch.zeros(embed.weight.shape[0], hidden, dtype=embed.weight.dtype)
        grown[:, :old_hidden] = embed.weight.data
        embed.weight = torch.nn.Parameter(grown, requires_grad=False)
        embed.embedding_dim = hidden
        head = model.get_output_embeddings()
        if config.tie_word_embeddings:
            head.weight = embed.weight
        else:
            _grow(head, cols=hidden)
        scale = math.sqrt(old_hidden / hidden)
        for norm in norms:
            weight = torch.zeros(hidden, dtype=norm.weight.dtype)
            weight[:old_hidden] = norm.weight.data * scale
            norm.weight = torch.nn.Parameter(weight, requires_grad=False)
            for attr in ("variance_epsilon", "eps"):
                if isinstance(getattr(norm, attr, None), float):
                    setattr(norm, attr, getattr(norm, attr) * old_hidden / hidden)
        config.rms_norm_eps = config.rms_norm_eps * old_hidden / hidden
        config.head_dim = head_dim
        config.hidden_size = hidden
    if total_layers is not None:
        _add_layers(model, total_layers, generator)  # last: the copies have every widened shape
    return model


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def check_same(original: torch.nn.Module, wide: torch.nn.Module, vocab_size: int, tokens: int = 24,
               seed: int = 1) -> float:
    """Greedy continuations of a few random inputs must be identical; returns the largest logit
    difference seen (float rounding only)."""
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(1, vocab_size, (1, 16), generator=generator)
            a = original(ids).logits
            b = wide(ids).logits
            worst = max(worst, float((a - b).abs().max()))
            kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))
            out_a = original.generate(ids, **kwargs)
            out_b = wide.generate(ids, **kwargs)
            if not torch.equal(out_a, out_b):
                raise AssertionError("the widened model's greedy output differs from the original's")
    return worst


def widen_dir(source: Path, out: Path, intermediate: int | None = None, hidden: int | None = None,
              dtype: str = "float32", seed: int = 0, heads: int | None = None, kv_heads: int | None = None,
              layers: int | None = None) -> dict:
    """Widen the model in ``source`` into ``out`` (safetensors, ``dtype``), with its tokenizer
    files; returns a summary."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():  # loading bars only for a person watching
        hf_logging.disable_progress_bar()
    if all(value is None for value in (intermediate, hidden, heads, kv_heads, layers)):
        raise ValueError("say how to widen: --intermediate, --hidden, --heads, --kv-heads and/or --layers")
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    before = parameters(original)
    wide = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    widen(wide, intermediate, hidden, seed, heads=heads, kv_heads=kv_heads, layers=layers)
    worst = check_same(original, wide, original.config.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    wide.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    after = parameters(wide)
    nbytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in wide.parameters()}.values())
    return {"parameters_before": before, "parameters_after": after, "bytes": nbytes, "max_logit_diff": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd.demo.widen", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[2:]))
    parser.add_argument("source", type=Path, help="a trained model's folder (config.json + safetensors)")
    parser.add_argument("out", type=Path, help="where to write the widened model")
    parser.add_argument("--intermediate", type=int, help="MLP units per layer (new ones have zero output weights)")
    parser.add_argument("--hidden", type=int, help="residual stream width (new dimensions stay zero)")
    parser.add_argument("--heads", type=int, help="attention heads of the same size (new ones add nothing)")
    parser.add_argument("--kv-heads", type=int, help="KV heads (the original heads keep theirs)")
    parser.add_argument("--layers", type=int, help="decoder layers in all (new ones are identity on the stream)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=0, help="for the new units', heads' and layers' random weights")
    args = parser.parse_args(argv)
    try:
        summary = widen_dir(args.source, args.out, args.intermediate, args.hidden, args.dtype, args.seed,
                            heads=args.heads, kv_heads=args.kv_heads, layers=args.layers)
    except (Unsupported, ValueError, OSError) as err:
        print(f"widen: {err}", file=sys.stderr)
        return 2
    print(f"widened {args.source} -> {args.out}: {summary['parameters_before']:,} -> "
          f"{summary['parameters_after']:,} parameters, {summary['bytes'] / 2**20:.0f} MiB in {args.dtype} "
          f"(largest logit difference {summary['max_logit_diff']:.2e}, greedy outputs identical)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
