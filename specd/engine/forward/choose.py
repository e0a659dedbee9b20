"""Which forward path runs a model: the lean static-cache forward where it serves the model
exactly, else transformers' own; llama.cpp's kernels when ``engine.forward_backend`` asks, and
always for a model given as a GGUF file (it has no torch weights)."""

from __future__ import annotations

import torch

from specd.engine.forward.transformers import HFForward
from specd.engine.models import ModelPair, is_gguf
from specd.engine.options import EngineOptions, context_window

GGUF_WINDOW = 4096  # cells per sequence for a GGUF file that names no trained context length
WINDOW_ROUND = 256


def choose_forward_path(model, options: EngineOptions):
    """(path, why): the lean static-cache forward where it serves the model exactly (its
    products routed as ``engine.numpy_products`` says, measured here when auto; its narrow
    steps replayed from CUDA graphs as ``engine.cuda_graphs`` says), else
    transformers' own (why says what stands in the way)."""
    from specd.engine.forward.lean import LeanForward, unsupported_reason

    if is_gguf(model):
        return gguf_forward(model, options), None
    if not options.fast_forward:
        return HFForward(model), "engine.fast_forward is off"
    reason = unsupported_reason(model)
    if reason is not None:
        return HFForward(model), reason
    lean = LeanForward(model, options.transposed_weights)
    lean.host_products(options.numpy_products)
    lean.use_graphs(options.cuda_graphs)
    return lean, None


# activations llama.cpp's graphs compute from an f16 table (ggml's GELU): other numerics, see below
INEXACT_ON_LLAMACPP = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def llamacpp_forward(model, source: str, pair: ModelPair, options: EngineOptions):
    """A ``LlamaCppForward`` for ``model`` (loaded from ``source``), on its GGUF file in the
    cache (written and checked the first time), its KV cells sized from the cache budget."""
    from specd.llamacpp.export import cached_gguf
    from specd.engine.forward.llamacpp import LlamaCppForward

    if is_gguf(model):
        return gguf_forward(model, options)
    if pair.device.type != "cpu":
        raise ValueError(f"the llama.cpp forward runs on the CPU, the models are on {pair.device}")
    model_type = getattr(model.config, "model_type", None)
    activation = getattr(model.config, "hidden_act", None) or getattr(model.config, "activation_function", None)
    if activation in INEXACT_ON_LLAMACPP:
        # specd is lossless: its output is the target's own greedy. llama.cpp's graphs (gpt2,
        # starcoder, gemma, gptneox) read gelu from an f16 table, which moved a 7.9M GPT-2's
        # logits by up to 1.4 and flipped 14 of 1,100 argmaxes, and a random Gemma's greedy
        # output in 3 of 40 bench completions (docs/llamacpp.md); the bench's llama.cpp peers still run.
        raise ValueError(f"llama.cpp computes {model_type}'s gelu from an f16 table, so its greedy output is "
                         "not always the target's own; specd stays lossless on torch")
    types = {torch.float32: "f32", torch.float16: "f16"}
    if pair.dtype not in types:
        raise ValueError(f"weights in {pair.dtype}; the llama.cpp forward takes float32 or float16")
    window = context_window(pair.target_name, pair.target.config) or getattr(model.config, "max_position_embeddings", 4096)
    path = LlamaCppForward(cached_gguf(source, types[pair.dtype]), budget_bytes=options.cache_budget_mb << 20,
                           window=window, threads=torch.get_num_threads(), kv_bytes=pair.dtype.itemsize)
    if options.llamacpp_prefill == "torch":
        from specd.engine.forward.lean import LeanForward, unsupported_reason

        reason = unsupported_reason(model)
        if reason is None:  # the loaded weights themselves: no copies ("off"), prefills are wide
            path.use_torch_prefill(LeanForward(model, transposed_weights="off"))
        else:
            path.prefill_note = f"prefills on llama.cpp: no lean torch forward for this model ({reason})"
    return path


def gguf_forward(model, options: EngineOptions):
    """A ``LlamaCppForward`` on the GGUF file a ``GgufModel`` was loaded from, as it is (its own
    tensor types), K/V in f32 as the bench's ``llamacpp`` peer keeps them. Every forward runs
    on llama.cpp, prefill included: there are no torch weights to prefill with.

    Each sequence gets the cells a request can fill (the prompt budgets, the completion, the
    widest verify), not the model's whole trained context: real GGUF files declare 32k-128k
    positions, and cells are allocated up front for every sequence."""
    from specd.engine.forward.llamacpp import LlamaCppForward

    needed = (options.prefix_tokens + options.suffix_tokens + options.context_tokens + options.max_tokens
              + 2 * max(options.lookup_max, options.draft_max) + 64)
    window = min(model.context_length or GGUF_WINDOW, -(-needed // WINDOW_ROUND) * WINDOW_ROUND)
    path = LlamaCppForward(model.path, budget_bytes=options.cache_budget_mb << 20, window=window,
                           threads=torch.get_num_threads(), kv_bytes=4, about=model.describe())
    path.prefill_note = "every forward on llama.cpp (a GGUF file has no torch weights)"
    return path
