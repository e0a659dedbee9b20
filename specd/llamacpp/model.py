"""A GGUF file as one model of the engine's pair: no torch weights, llama.cpp's forward, its
tokenizer and the facts the engine asks of a model read from the file.

Opening a file loads its vocabulary only (llama.cpp's ``vocab_only``: metadata and tokenizer,
no tensors) and checks that specd can serve it; the weights load once, in the forward path
(``specd.engine.forward.llamacpp.LlamaCppForward``). Each refusal is one line naming the file
and the reason: a tensor type this llama.cpp cannot load, an architecture it does not know, or
one whose state cannot be cut back to any position (recurrent and hybrid models: specd rolls a
rejected draft back by dropping the cache's positions past it), or no decoder.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

from specd.llamacpp.gguf import GgufError, GgufHeader, file_type_name, read_header, resolve, type_name
from specd.llamacpp.runtime import import_llama_cpp
from specd.llamacpp.tokenizer import LlamaCppTokenizer

LOG_LEVEL_ERROR = 3  # ggml_log_level


class UnsupportedGguf(GgufError):
    """A GGUF file specd cannot serve (one line: the file and why)."""


@dataclass
class GgufModel:
    """One model given as a GGUF file. There is no module to call: the engine runs it through
    llama.cpp's forward on ``path``; what it needs to size and describe the model is here."""

    name: str  # as configured (a path, or ``ollama:NAME``)
    path: Path  # the file itself
    architecture: str  # llama.cpp's name (``qwen2``, ``llama``)
    file_type: str  # ``F32``, ``Q8_0``, ``Q4_K_M`` ...
    params: int
    vocab_size: int  # rows of logits a forward returns
    context_length: int | None  # positions the model was trained on (``<arch>.context_length``)
    tensor_types: dict[str, int] = field(default_factory=dict)  # tensors per ggml type

    @property
    def device(self):
        """llama.cpp's CPU backend: where its logits and this model's caches are."""
        import torch

        return torch.device("cpu")

    def describe(self) -> str:
        types = ", ".join(f"{count} {name}" for name, count in self.tensor_types.items())
        return f"GGUF {self.file_type}, {self.architecture}, {self.params / 1e6:.1f}M params ({types} tensors)"


def open_gguf(name: str) -> tuple[GgufModel, LlamaCppTokenizer]:
    """The model and tokenizer of the GGUF file ``name`` means (a path or ``ollama:NAME``);
    ``GgufError`` (one line) when it cannot be served."""
    path = resolve(name)
    header = read_header(path)
    llama_model = _load_vocabulary(path, header)
    lc = import_llama_cpp()
    model = llama_model.model
    arch = header.architecture
    if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
        raise UnsupportedGguf(f"{path.name}: architecture {arch} keeps a recurrent state, which cannot be cut "
                              "back to a position; specd drops a rejected draft that way (a KV cache of "
                              "attention layers)")
    if lc.llama_model_has_encoder(model) or not lc.llama_model_has_decoder(model) or lc.llama_model_is_diffusion(model):
        raise UnsupportedGguf(f"{path.name}: architecture {arch} is not a causal decoder-only model")
    tokenizer = LlamaCppTokenizer(llama_model, path)
    context = int(lc.llama_model_n_ctx_train(model)) or None
    return GgufModel(name, path, arch, file_type_name(header), header.params(), tokenizer.n_tokens, context,
                     header.type_counts()), tokenizer


def _load_vocabulary(path: Path, header: GgufHeader):
    """llama.cpp's vocabulary-only load of ``path``; on failure, why, in one line."""
    lc = import_llama_cpp()
    from llama_cpp import _internals as internals
    from llama_cpp import _logger

    errors: list[str] = []

    @lc.llama_log_callback
    def collect(level: int, text: bytes, user_data) -> None:
        if level == LOG_LEVEL_ERROR:
            errors.append(text.decode("utf-8", errors="replace").strip())

    params = lc.llama_model_default_params()
    params.vocab_only = True
    params.n_gpu_layers = 0
    lc.llama_log_set(collect, ctypes.c_void_p(0))  # llama.cpp says why it refuses a file only in its log
    try:
        return internals.LlamaModel(path_model=str(path), params=params, verbose=False)
    except ValueError:
        raise UnsupportedGguf(_why_not(path, header, errors)) from None
    finally:
        lc.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _why_not(path: Path, header: GgufHeader, errors: list[str]) -> str:
    version = import_llama_cpp().__version__
    unknown = [t for t in header.tensors if type_name(t.ggml_type).startswith("type ")]
    if unknown:
        return (f"{path.name}: tensor {unknown[0].name} is of ggml {type_name(unknown[0].ggml_type)}, which "
                f"llama-cpp-python {version}'s llama.cpp cannot load (it loads f32, f16, bf16 and the quantized "
                "types of today's llama.cpp: Q8_0, Q4_0, Q4_K_M ...)")
    said = next((e for e in reversed(errors) if "architecture" in e), None) or (errors[-1] if errors else "")
    if "architecture" in said or header.architecture not in _known_architectures():
        return (f"{path.name}: architecture {header.architecture!r} is not one llama-cpp-python {version}'s "
                f"llama.cpp runs ({said.removeprefix('llama_model_load: error loading model: ')})")
    reason = said.removeprefix("llama_model_load: error loading model: ") or "no reason given"
    return f"{path.name}: llama-cpp-python {version}'s llama.cpp cannot load it: {reason}"


def _known_architectures() -> set[str]:
    """The architectures llama.cpp's own GGUF library (gguf-py) names: llama.cpp's log, which
    would say it, is not always delivered while a load fails."""
    try:
        import gguf

        return set(gguf.MODEL_ARCH_NAMES.values())
    except ImportError:
        return set()
