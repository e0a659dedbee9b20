"""A GGUF file's weights as a transformers folder: dequantized tensors, the config, and the
tokenizer llama.cpp uses for that file, so the torch paths (the lean forward, CUDA graphs)
serve a file a user already has from Ollama or LM Studio.

Written here rather than through transformers' ``from_pretrained(gguf_file=...)``: that reader
needs ``accelerate`` for the weights, takes seconds to rebuild a tokenizer, and rebuilds it with
a guessed pre-tokenizer where llama.cpp names its own (``tokenizer.ggml.pre``: SmolLM2's
``smollm`` splits digits one by one, which transformers' GGUF tokenizer does not). The tensors
are decoded by the ``gguf`` package (llama.cpp's own Python library, every quant type); the
tokenizer is built with ``tokenizers`` from the file's vocabulary, merges and llama.cpp's
pre-tokenizer expressions (``PRE_TOKENIZERS``).

A converted file is kept under ``$XDG_CACHE_HOME/specd/dequantized/``, keyed by the file's path,
size and modification time and ``CONVERT_VERSION``; written into a temporary folder and renamed,
so a folder there is whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

CONVERT_VERSION = 1  # bump when what a converted folder holds changes
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp's token types

# llama.cpp's pre-tokenizer types (llama-vocab.cpp) as the ``tokenizers`` steps of the models'
# own tokenizer.json files. Keys are ``tokenizer.ggml.pre`` values.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+")


def _pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer for llama.cpp's type ``pre``; None when not known here."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("qwen2",):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level])
    if pre in ("llama3", "llama-bpe", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level])
    if pre == "deepseek-coder":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(expr), "isolated") for expr in _DEEPSEEK_CODER_SPLITS]
            + [pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("starcoder", "smollm", "refact"):  # GPT-2's expression, digits one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return None


PRE_TOKENIZERS = ("qwen2", "llama3", "llama-bpe", "smaug-bpe", "deepseek-coder", "starcoder", "smollm",
                  "refact", "gpt-2", "default")


class DequantizeError(ValueError):
    """A GGUF file that cannot be served on the torch path (one line: the file and why)."""


@dataclass
class GgufFields:
    """What the conversion reads of a file: its metadata and its tokenizer's arrays."""

    metadata: dict
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None


def read_fields(reader) -> GgufFields:
    """The metadata scalars and the tokenizer arrays of a ``gguf.GGUFReader``."""
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key[len("tokenizer.ggml."):] in (
                "tokens", "token_type", "scores", "merges"):
            continue
        try:
            metadata[key] = field.contents()
        except Exception:  # an array type this gguf version cannot decode: not needed here
            continue

    def array(key: str):
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    tokens = array("tokenizer.ggml.tokens")
    if not tokens:
        raise DequantizeError("it holds no tokenizer (tokenizer.ggml.tokens)")
    return GgufFields(metadata, tokens, array("tokenizer.ggml.token_type") or [1] * len(tokens),
                      array("tokenizer.ggml.scores"), array("tokenizer.ggml.merges"))


def spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE model's merges, as transformers derives them: every split of a piece
    into two pieces, the merged piece's score first (then the parts' ids)."""
    merges = []
    for piece, piece_id in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((-scores[piece_id], vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def build_tokenizer(fields: GgufFields, added: dict[int, str] | None = None, pre: str | None = None):
    """A ``PreTrainedTokenizerFast`` with the file's vocabulary, merges and special tokens and
    llama.cpp's pre-tokenizer for it (``pre`` overrides the file's ``tokenizer.ggml.pre``).
    ``added`` places extra specials at given ids (tests rebuild FIM tokens a vocab file lacks)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    added = added or {}
    meta = fields.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens, types = fields.tokens, fields.types
    # Placeholders ("[PAD151646]") fill llama.cpp's files up to the embedding size; the real
    # tokenizers have no such entries.
    keep = {i: t for i, t in enumerate(tokens) if not (t.startswith("[PAD") and types[i] == USER_DEFINED)}
    keep.update(added)
    specials = {i for i in keep if i < len(types) and types[i] in (UNKNOWN, CONTROL)} | set(added)
    extra = {i: t for i, t in keep.items() if i in specials or (i < len(types) and types[i] == USER_DEFINED)}
    vocab = {t: i for i, t in keep.items()}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if kind == "gpt2":
        pre = pre or str(meta.get("tokenizer.ggml.pre", "default"))
        pre_tokenizer = _pre_tokenizer(pre)
        if pre_tokenizer is None:
            raise DequantizeError(f"its pre-tokenizer {pre!r} is not rebuilt here (known: "
                                  f"{', '.join(PRE_TOKENIZERS)}); llama.cpp's forward serves it "
                                  "(pip install 'specd[llamacpp]')")
        merges = [tuple(m.split(" ", 1)) for m in fields.merges or []]
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        unk = None
    elif kind == "llama":  # SentencePiece BPE with byte fallback, as Llama 2's tokenizer.json
        if fields.scores is None:
            raise DequantizeError("its SentencePiece vocabulary has no scores")
        base = {t: i for t, i in vocab.items() if i < len(tokens)}
        unk = tokens[unk_id] if unk_id is not None else "<unk>"
        tok = Tokenizer(models.BPE(vocab, spm_merges(base, fields.scores), unk_token=unk, fuse_unk=True,
                                   byte_fallback=True))
        prefix = [normalizers.Prepend("▁")] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
        tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    else:
        raise DequantizeError(f"its tokenizer model {kind!r} is not rebuilt here (gpt2 and llama are); "
                              "llama.cpp's forward serves it (pip install 'specd[llamacpp]')")
    tok.add_tokens([AddedToken(t, special=i in specials, normalized=False) for i, t in sorted(extra.items())])

    def token(key: str) -> str | None:
        found = meta.get(key)
        return tokens[found] if isinstance(found, int) and 0 <= found < len(tokens) else None

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=token("tokenizer.ggml.bos_token_id"),
                                   eos_token=token("tokenizer.ggml.eos_token_id"), unk_token=unk,
                                   pad_token=token("tokenizer.ggml.padding_token_id"))


# ---- weights --------------------------------------------------------------------------------

# GGUF tensor names (per block) -> transformers' Llama/Qwen2 names.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# Architectures converted, with whether llama.cpp's converter permuted Q and K rows to
# interleaved rotary pairs (Llama's rotate-half weights are; Qwen2's NeoX rotary is not).
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama", True), "qwen2": ("Qwen2ForCausalLM", "qwen2", False)}


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a Q or K projection from llama.cpp's interleaved rotary pairs back to
    transformers' rotate-half order (the inverse of ``export.permute_rotary_rows``)."""
    return (weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def hf_config(meta: dict, vocab_rows: int, tied: bool) -> dict:
    arch = str(meta.get("general.architecture"))
    if arch not in ARCHITECTURES:
        raise DequantizeError(f"its architecture {arch!r} is not converted for the torch path (known: "
                              f"{', '.join(ARCHITECTURES)}); llama.cpp's forward serves it "
                              "(pip install 'specd[llamacpp]')")
    cls, model_type, _ = ARCHITECTURES[arch]
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    config = {
        "architectures": [cls], "model_type": model_type, "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": vocab_rows, "tie_word_embeddings": tied, "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != hidden // heads:
        raise DequantizeError(f"its rotary covers {rope_dims} of {hidden // heads} head dimensions, "
                              "which the torch path does not convert")
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise DequantizeError(f"its rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not converted")
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config


def dequantized_weights(reader, config: dict, arch: str, progress: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of the file decoded to float32 under its transformers name."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    permuted = ARCHITECTURES[arch][2]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress, leave=False):
        name = tensor.name
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _BLOCK_NAMES:
                raise DequantizeError(f"its tensor {name} has no transformers counterpart here")
            hf_name = f"model.layers.{layer}.{_BLOCK_NAMES[rest]}"
        elif name in _TOP_NAMES:
            hf_name = _TOP_NAMES[name]
        elif name == "rope_freqs.weight":
            raise DequantizeError("it carries rope frequency factors (Llama 3.1 scaling), not converted")
        else:
            raise DequantizeError(f"its tensor {name} has no transformers counterpart here")
        data = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if permuted and rest_is(name, "attn_q.weight"):
            data = unpermute_rotary_rows(data, heads)
        elif permuted and rest_is(name, "attn_k.weight"):
            data = unpermute_rotary_rows(data, kv_heads)
        out[hf_name] = data
    return out


def rest_is(name: str, suffix: str) -> bool:
    return name.startswith("blk.") and name.endswith("." + suffix)


# ---- the cached folder ------------------------------------------------------------------------

def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd" / "dequantized"


def folder_for(path: Path, root: Path | None = None) -> Path:
    """Where ``path``'s conversion is kept: a name from the file's stem and a key of its resolved
    path, size, modification time and ``CONVERT_VERSION``."""
    info = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{info.st_size}|{info.st_mtime_ns}|{CONVERT_VERSION}".encode())
    return (root or cache_root()) / f"{path.stem}-{key.hexdigest()[:12]}"


def dequantized_folder(name: str, root: Path | None = None, progress: bool = False) -> Path:
    """The transformers folder of the GGUF file ``name`` (a path or ``ollama:NAME``), converted
    on first use and kept. ``DequantizeError`` (one line) for a file the torch path cannot take."""
    from specd.llamacpp.gguf import GgufError, resolve

    try:
        path = resolve(name)
    except GgufError as err:
        raise DequantizeError(str(err)) from None
    out = folder_for(path, root)
    if (out / "model.safetensors").is_file():
        return out
    try:
        import gguf
    except ImportError:
        raise DequantizeError(f"GGUF file {name}: reading it on the torch path needs the gguf package "
                              "(pip install gguf)") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _convert(gguf.GGUFReader(path), work, progress)
        (work / "specd.json").write_text(json.dumps({"source_gguf": str(path.resolve())}, indent=1) + "\n",
                                         encoding="utf-8")
        try:
            work.rename(out)
        except OSError:  # another process converted it first
            if not (out / "model.safetensors").is_file():
                raise
    except DequantizeError as err:
        raise DequantizeError(f"GGUF file {name}: {err}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("dequantized %s into %s", path, out)
    return out


def _convert(reader, out: Path, progress: bool) -> None:
    from safetensors.numpy import save_file

    fields = read_fields(reader)
    meta = fields.metadata
    arch = str(meta.get("general.architecture"))
    names = {tensor.name for tensor in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_rows = int(embedding.shape[-1])  # ggml's order: [hidden, rows]
    config = hf_config(meta, vocab_rows, tied="output.weight" not in names)
    tokenizer = build_tokenizer(fields)  # before the weights: a refusal costs no dequantizing
    weights = dequantized_weights(reader, config, arch, progress)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(out)
