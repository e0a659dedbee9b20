"""llama.cpp in this process (llama-cpp-python): one slot that keeps its KV cache between
requests, greedy decoding, and optional prompt-lookup drafting verified in one batch.

This is what a user of llama-server gets (``cache_prompt``: each request re-uses the longest
common token prefix of the slot's previous one), minus HTTP: the bench peers ``llamacpp`` and
``llamacpp_lookup`` run on it, on GGUF files written from the very same weights
(:mod:`specd.llamacpp.export`).

Why not ``Llama.generate``: its speculative path asks llama.cpp for the logits of *every*
position (``logits_all``), prompt included, which makes llama.cpp pay an LM-head product per
prompt token and copy them all; llama-server asks only for the positions it samples. So the loop
is ours, on llama-cpp-python's own context and batch objects: logits only where a token is
chosen, greedy as llama.cpp's greedy sampler (the first maximum), the same constraint on the
first tokens as every other method under token healing. The drafter is llama-cpp-python's
``LlamaPromptLookupDecoding`` (n-grams of up to 2 tokens, 10 tokens per draft, its defaults).
Tested against llama-cpp-python 0.3.x (``_ctx``, ``_batch``, ``input_ids``, ``n_tokens``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

LOOKUP_NGRAM = 2  # LlamaPromptLookupDecoding's defaults
LOOKUP_TOKENS = 10

# (tokens generated so far) -> None for "anything", or the token ids allowed next.
Constraint = Callable[[list[int]], "np.ndarray | list[int] | None"]


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python is not installed (one line, with the install hint)."""


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as err:
        raise LlamaCppUnavailable(
            f"llama-cpp-python is not installed ({err}); pip install 'specd[llamacpp]' builds it "
            "(about 10-15 minutes on 2 cores)") from None
    # llama.cpp logs every load step through this logger, printed unless its level is above INFO.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


def available() -> bool:
    try:
        import_llama_cpp()
    except LlamaCppUnavailable:
        return False
    return True


# ---- repacked weight layouts ----------------------------------------------------------------
# llama.cpp repacks quantized weights into layouts of its "extra buffer types" (AMX tiles,
# interleaved rows) where the CPU advertises the instructions. A virtual machine may advertise
# AMX yet fault on it (SIGILL, which no Python code survives), so whether a file's repacked
# forward runs is tried once in a child process and remembered per llama.cpp build, CPU and
# the file's tensor types; where it dies, the file loads with its plain layout (the same
# results: repacking changes where the weights sit, and the plain kernels are what a CPU
# without those instructions runs).
_PROBE = """
import sys, llama_cpp
params = llama_cpp.llama_model_default_params()
params.n_gpu_layers = 0
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
ctx_params = llama_cpp.llama_context_default_params()
ctx_params.n_ctx, ctx_params.n_batch, ctx_params.n_threads, ctx_params.n_threads_batch = 64, 64, 1, 1
ctx = llama_cpp.llama_init_from_model(model, ctx_params)
for width in (8, 1):
    tokens = (llama_cpp.llama_token * width)(*([1] * width))
    if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, width)) != 0:
        sys.exit(3)
"""
_repack_ok: dict[str, bool] = {}


def _probe_key(path: Path) -> str:
    import hashlib
    import importlib.metadata

    from specd.llamacpp.gguf import read_header

    try:
        flags = next((line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("flags")), "")
    except OSError:
        flags = ""
    types = sorted({tensor.ggml_type for tensor in read_header(path).tensors})
    version = importlib.metadata.version("llama-cpp-python")
    return hashlib.sha256(f"{version}|{flags}|{types}".encode()).hexdigest()[:16]


def repacked_layouts_run(path: str | Path) -> bool:
    """Whether llama.cpp's repacked layouts run this file's forward here (a child process tries
    an 8-token and a 1-token forward; its verdict is kept under ``$XDG_CACHE_HOME/specd/llamacpp/``)."""
    import json
    import os
    import subprocess
    import sys

    key = _probe_key(Path(path))
    if key in _repack_ok:
        return _repack_ok[key]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specd" / "llamacpp"
    record = base / f"repack-{key}.json"
    try:
        verdict = bool(json.loads(record.read_text(encoding="utf-8"))["runs"])
    except (OSError, ValueError, KeyError, TypeError):
        done = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, timeout=300)
        verdict = done.returncode >= 0  # only a signal says the instructions fault; other failures load as usual
        if not verdict:
            logging.getLogger(__name__).warning(
                "llama.cpp's repacked weight layouts fault on this CPU (signal %d): %s loads with its plain layout",
                -done.returncode, Path(path).name)
        try:
            base.mkdir(parents=True, exist_ok=True)
            partial = record.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"runs": verdict}), encoding="utf-8")
            os.replace(partial, record)
        except OSError:
            pass
    _repack_ok[key] = verdict
    return verdict


def model_params(path: str | Path):
    """llama.cpp's model parameters for ``path`` on the CPU: no GPU layers, repacked layouts
    only where they run here (``repacked_layouts_run``)."""
    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = repacked_layouts_run(path)
    return params


_CONSTRUCT_LOCK = threading.Lock()


def load_llama(path: str | Path, n_ctx: int = 4096, threads: int = 1, n_batch: int = 512, kv_f32: bool = False):
    """A quiet ``llama_cpp.Llama`` on the CPU (no GPU layers), ``threads`` for decode and batch;
    K/V in f32 with ``kv_f32`` (llama.cpp's default is f16); the model's parameters are
    ``model_params``'s (``Llama`` takes no flag for repacking: its default parameters are ours
    while it loads)."""
    llama_cpp = import_llama_cpp()
    from llama_cpp import llama as high_level

    params = model_params(path)
    kv = {"type_k": 0, "type_v": 0} if kv_f32 else {}  # ggml type 0 = f32
    with _CONSTRUCT_LOCK:
        default = high_level.llama_cpp.llama_model_default_params
        high_level.llama_cpp.llama_model_default_params = lambda: params
        try:
            return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                                   n_threads_batch=threads, n_gpu_layers=0, logits_all=False, verbose=False, **kv)
        finally:
            high_level.llama_cpp.llama_model_default_params = default


@dataclass
class Generation:
    tokens: list[int]
    first_token_ms: float
    forwards: int  # llama_decode rounds that produced tokens (the prompt's included)
    prefill_reused: int
    prefill_computed: int
    drafted: int = 0
    accepted: int = 0
    ms: float = 0.0


class LlamaSlot:
    """One llama.cpp context used as one llama-server slot: the KV cache of the last request."""

    def __init__(self, path: str | Path, *, n_ctx: int = 4096, threads: int = 1, lookup: bool = False,
                 kv_f32: bool = False):
        self.llama = load_llama(path, n_ctx=n_ctx, threads=threads, kv_f32=kv_f32)
        self.n_vocab = self.llama.n_vocab()
        self.lookup = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.lookup = LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=LOOKUP_TOKENS)

    @property
    def held(self) -> list[int]:
        return self.llama.input_ids[: self.llama.n_tokens].tolist()

    def forget(self) -> None:
        """Start the next request from an empty cache (its cells are dropped then, in ``_decode``)."""
        self.llama.n_tokens = 0

    def _decode(self, tokens: list[int], outputs: int) -> np.ndarray:
        """Run ``tokens`` after the cache; logits of the last ``outputs`` of them (rows)."""
        llama = self.llama
        llama._ctx.kv_cache_seq_rm(-1, llama.n_tokens, -1)
        step = llama.n_batch
        for start in range(0, len(tokens), step):
            chunk = tokens[start:start + step]
            llama._batch.set_batch(batch=chunk, n_past=llama.n_tokens, logits_all=False)
            last_chunk = start + step >= len(tokens)
            if last_chunk:
                for i in range(max(0, len(chunk) - outputs), len(chunk)):
                    llama._batch.batch.logits[i] = True
            llama._ctx.decode(llama._batch)
            llama.input_ids[llama.n_tokens:llama.n_tokens + len(chunk)] = chunk
            llama.n_tokens += len(chunk)
        rows = min(outputs, len(tokens))
        logits = np.ctypeslib.as_array(llama._ctx.get_logits(), shape=(rows * self.n_vocab,))
        return logits.reshape(rows, self.n_vocab).copy()

    def step_logits(self, prompt: list[int], generated: list[int]) -> np.ndarray:
        """The logits after ``prompt + generated`` as plain greedy decoding computes them: the
        prompt in one batch, then each generated token in a forward of its own (the path whose
        rounding the bench's ``llamacpp`` reference follows). Starts from an empty cache."""
        self.forget()
        row = self._decode(list(prompt), 1)[-1]
        for token in generated:
            row = self._decode([token], 1)[-1]
        self.forget()
        return row

    @staticmethod
    def _pick(row: np.ndarray, allowed) -> int:
        if allowed is None:
            return int(np.argmax(row))
        allowed = np.asarray(allowed, dtype=np.int64)
        return int(allowed[np.argmax(row[allowed])])

    def generate(self, prompt: list[int], max_tokens: int, stop_ids: set[int],
                 constraint: Constraint | None = None) -> Generation:
        """Greedy tokens after ``prompt`` (the stop token excluded), re-using the cache's prefix."""
        if not prompt:
            raise ValueError("empty prompt")
        started = time.perf_counter()
        llama = self.llama
        if len(prompt) + max_tokens + LOOKUP_TOKENS + 1 > llama.n_ctx():
            raise ValueError(f"prompt of {len(prompt)} tokens + {max_tokens} exceeds n_ctx {llama.n_ctx()}")
        held = self.held
        reused = 0
        for a, b in zip(held, prompt[:-1]):  # one prompt token always runs: it gives the first logits
            if a != b:
                break
            reused += 1
        llama.n_tokens = reused
        allowed = constraint or (lambda out: None)

        logits = self._decode(prompt[reused:], 1)
        out: list[int] = []
        token = self._pick(logits[-1], allowed(out))
        first_ms = (time.perf_counter() - started) * 1000
        gen = Generation(out, first_ms, 1, reused, len(prompt) - reused)
        while True:
            if token in stop_ids:
                break
            out.append(token)
            if len(out) >= max_tokens:
                break
            draft: list[int] = []
            if self.lookup is not None:  # over the held ids and the pending token, in place
                llama.input_ids[llama.n_tokens] = token
                draft = self.lookup(llama.input_ids[:llama.n_tokens + 1]).astype(int).tolist()[: max_tokens - len(out)]
            rows = self._decode([token, *draft], len(draft) + 1)
            gen.forwards += 1
            gen.drafted += len(draft)
            # Row i holds the logits after [token, *draft[:i]]: accept drafts while greedy agrees.
            for i in range(len(draft) + 1):
                token = self._pick(rows[i], allowed(out))
                if i == len(draft) or token != draft[i] or token in stop_ids:
                    break
                out.append(token)
                gen.accepted += 1
                if len(out) >= max_tokens:
                    break
            if len(out) >= max_tokens:
                break
            # Drop what the cache holds past the accepted tokens (the next decode starts there).
            llama.n_tokens = len(prompt) + len(out)
        llama.n_tokens = min(llama.n_tokens, len(prompt) + len(out))
        gen.ms = (time.perf_counter() - started) * 1000
        return gen
