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


def llamacpp_obstacle(model, pair: ModelPair) -> str | None:
    """Why llama.cpp's forward cannot serve ``model`` (a torch model of ``pair``) exactly, or
    None; what building it may still find (an export that fails) is not known here."""
    from specd.llamacpp.runtime import LlamaCppUnavailable, import_llama_cpp

    try:
        import_llama_cpp()
    except LlamaCppUnavailable as err:
        return str(err)
    if pair.device.type != "cpu":
        return f"the llama.cpp forward runs on the CPU, the models are on {pair.device}"
    model_type = getattr(model.config, "model_type", None)
    activation = getattr(model.config, "hidden_act", None) or getattr(model.config, "activation_function", None)
    if activation in INEXACT_ON_LLAMACPP:
        # specd is lossless: its output is the target's own greedy. llama.cpp's graphs (gpt2,
        # starcoder, gemma, gptneox) read gelu from an f16 table, which moved a 7.9M GPT-2's
        # logits by up to 1.4 and flipped 14 of 1,100 argmaxes, and a random Gemma's greedy
        # output in 3 of 40 bench completions (docs/llamacpp.md); the bench's llama.cpp peers still run.
        return (f"llama.cpp computes {model_type}'s gelu from an f16 table, so its greedy output is "
                "not always the target's own; specd stays lossless on torch")
    if pair.dtype not in LLAMACPP_TYPES:
        return f"weights in {pair.dtype}; the llama.cpp forward takes float32 or float16"
    return None


LLAMACPP_TYPES = {torch.float32: "f32", torch.float16: "f16"}  # weights' dtype -> the GGUF written for them


def llamacpp_forward(model, source: str, pair: ModelPair, options: EngineOptions, prefill: str | None = None,
                     sequences: int | None = None, window: int | None = None):
    """A ``LlamaCppForward`` for ``model`` (loaded from ``source``), on its GGUF file in the
    cache (written and checked the first time), its KV cells sized from the cache budget
    (``sequences``: at most that many, by default as many as the budget holds; ``window``: cells
    per sequence, by default the model's). ``prefill`` (default ``engine.llamacpp_prefill``): where
    a prompt from an empty cache prefills: torch (K/V handed over), llamacpp, or auto (whichever
    a few prefills timed here say is faster, ``faster_prefill``)."""
    from specd.llamacpp.export import cached_gguf
    from specd.engine.forward.llamacpp import LlamaCppForward

    if is_gguf(model):
        return gguf_forward(model, options)
    reason = llamacpp_obstacle(model, pair)
    if reason is not None:
        raise ValueError(reason)
    window = window or context_window(pair.target_name, pair.target.config) \
        or getattr(model.config, "max_position_embeddings", 4096)
    path = LlamaCppForward(cached_gguf(source, LLAMACPP_TYPES[pair.dtype]), budget_bytes=options.cache_budget_mb << 20,
                           window=window, threads=torch.get_num_threads(), kv_bytes=pair.dtype.itemsize,
                           sequences=sequences)
    prefill = prefill or options.llamacpp_prefill
    if prefill in ("torch", "auto"):
        from specd.engine.forward.lean import LeanForward, unsupported_reason

        reason = unsupported_reason(model)
        if reason is None:  # the loaded weights themselves: no copies ("off"), prefills are wide
            path.use_torch_prefill(LeanForward(model, transposed_weights="off"))
            if prefill == "auto" and path.torch_prefill is not None:
                prompt = options.prefix_tokens + options.suffix_tokens + options.context_tokens
                faster_prefill(model, path, vocab=pair.input_vocab(), tokens=min(PREFILL_TOKENS, prompt, window - 32))
        else:
            path.prefill_note = f"prefills on llama.cpp: no lean torch forward for this model ({reason})"
    return path


# A prompt that starts a document's cache, timed both ways by faster_prefill. The default
# budgets make 1.5-2k-token prompts, and torch's lead grows with length (docs/llamacpp.md has
# the ratios): at 256 tokens a busy machine's noise picked llama.cpp.
PREFILL_TOKENS = 512
PREFILL_ROUNDS = 2  # both ways in turn this often, one timed prefill after a warm-up each, the least kept


def faster_prefill(model, path, vocab: int, tokens: int = PREFILL_TOKENS) -> dict[str, float]:
    """Keep the prefill on torch (``path.torch_prefill``, K/V handed over) only where it is
    faster than llama.cpp's own: a ``tokens``-token prefill from empty timed each way, in turn,
    ``PREFILL_ROUNDS`` times, the least kept (on a busy machine another process's work lands on
    one way or the other; ``measure.measure_path``). Says which and by how much in ``path.prefill_note``; returns
    ms per token each way ({"torch": .., "llamacpp": ..})."""
    from specd.engine.forward.measure import measure_path

    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    handoff, note = path.torch_prefill, path.prefill_note
    least: dict[str, float] = {}
    for _ in range(PREFILL_ROUNDS):
        for name, prefill in (("torch", handoff), ("llamacpp", None)):
            path.torch_prefill = prefill
            ms = measure_path(model, path, ids, (), (), tokens, 1, lambda: None)["prefill_ms"]
            least[name] = min(ms, least.get(name, ms))
    torch_ms, llamacpp_ms = least["torch"], least["llamacpp"]
    per_token = {name: round(ms / tokens, 4) for name, ms in least.items()}
    if torch_ms < llamacpp_ms:
        path.torch_prefill = handoff
        path.prefill_note = f"{note}; measured faster: {tokens} tokens in {torch_ms:.1f} ms vs llama.cpp {llamacpp_ms:.1f} ms"
    else:
        path.prefill_note = (f"prefills on llama.cpp, measured faster than torch's with the K/V handed over: "
                             f"{tokens} tokens in {llamacpp_ms:.1f} ms vs torch {torch_ms:.1f} ms")
    return per_token


def gguf_forward(model, options: EngineOptions):
    """A ``LlamaCppForward`` on the GGUF file a ``GgufModel`` was loaded from, as it is (its own
    tensor types), K/V in f32 as the bench's ``llamacpp`` peer keeps them. Every forward runs
    on llama.cpp, prefill included: there are no torch weights to prefill with.

    Each sequence gets the cells a request can fill (the prompt budgets, the completion, the
    widest verify), not the model's whole trained context: real GGUF files declare 32k-128k
    positions, and a sequence's cells are resident from its context's making on."""
    from specd.engine.forward.llamacpp import LlamaCppForward

    needed = (options.prefix_tokens + options.suffix_tokens + options.context_tokens + options.max_tokens
              + 2 * max(options.lookup_max, options.draft_max) + 64)
    window = min(model.context_length or GGUF_WINDOW, -(-needed // WINDOW_ROUND) * WINDOW_ROUND)
    path = LlamaCppForward(model.path, budget_bytes=options.cache_budget_mb << 20, window=window,
                           threads=torch.get_num_threads(), kv_bytes=4, about=model.describe())
    path.prefill_note = "every forward on llama.cpp (a GGUF file has no torch weights)"
    return path
