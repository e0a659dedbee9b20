"""GGUF files for llama.cpp from a Hugging Face model folder, with the very same token ids.

Why our own writer, on the ``gguf`` package (llama.cpp's own GGUF library), rather than
llama.cpp's ``convert_hf_to_gguf.py``: that script is not on PyPI (it lives in llama.cpp's
sources), and it recognises a byte-level BPE pre-tokenizer only by a hash of its output on a
test text, so a custom tokenizer (the demo pair's, any in-house one) stops it until a name is
passed by hand. The parts that matter here are small: the config's hyperparameters, the
vocabulary with merges and token types, the pre-tokenizer's name, and the tensors under
llama.cpp's names (``gguf.get_tensor_name_map`` knows them), with the Q/K rows of Llama-style
checkpoints permuted from Hugging Face's rotate-half rotary layout to llama.cpp's interleaved one.

Served architectures: Llama, Mistral (as ``llama``), Qwen2, and the GPT-2 family: ``gpt2`` and
``gpt_bigcode`` (StarCoderBase, SantaCoder, TinyStarCoder; as llama.cpp's ``starcoder``, with
multi-query attention or without), each with a byte-level BPE tokenizer (``tokenizer.json``);
anything else is refused with one line. The GPT-2 family's checkpoints need their own reshaping
(``_gpt2_family_tensor``): Conv1D weights stored [in, out], per-head fused q/k/v, attention
scales llama.cpp does not know. ``verify_tokenizer`` checks that
llama.cpp tokenizes a text to the same ids as transformers (tests and ``specd export-gguf`` run it).
"""

from __future__ import annotations

import glob
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


class ExportError(Exception):
    """The model cannot be written as GGUF (one line, for the user)."""


# Hugging Face model_type -> llama.cpp architecture.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2", "gpt_bigcode": "starcoder",
                 "qwen3": "qwen3", "gemma": "gemma", "granite": "granite", "gpt_neox": "gptneox",
                 "phi3": "phi3", "stablelm": "stablelm"}
ROTARY_PERMUTED = {"llama", "mistral", "granite"}  # Q/K rows go from rotate-half to interleaved rotary pairs
# Gemma's RMSNorm scales by 1 + weight; llama.cpp's gemma graph by the weight as written
NORM_PLUS_ONE = {"gemma"}
# Granite's multipliers, as llama.cpp's granite graph reads them: config key -> GGUFWriter method
GRANITE_SCALES = {"attention_multiplier": "add_attention_scale", "embedding_multiplier": "add_embedding_scale",
                  "residual_multiplier": "add_residual_scale", "logits_scaling": "add_logit_scale"}
GPT2_FAMILY = {"gpt2", "gpt_bigcode"}  # learned positions, LayerNorm with bias, fused c_attn, gelu
# llama.cpp's gpt2 and starcoder graphs run one gelu: the tanh form, read from an f16 table
# (ggml's GGML_GELU_FP16), ~1e-3 from either formula; the exact (erf) gelu is another 3e-4 away.
GELUS = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"}
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

# llama.cpp pre-tokenizer names by the split regex a tokenizer.json carries. llama.cpp
# implements each name with its own regex; these are the patterns those names stand for.
_LETTERS = r"[^\r\n\p{L}\p{N}]?\p{L}+"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    "qwen2": rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|{_LETTERS}|\p{{N}}|{_TAIL}",
    "llama-bpe": rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|{_LETTERS}|\p{{N}}{{1,3}}|{_TAIL}",
}
GPT2_REGEX_NAME = "gpt-2"  # a ByteLevel pre-tokenizer with its built-in (GPT-2) regex
STARCODER_NAME = "starcoder"  # GPT-2's regex after splitting digits one by one

SAMPLE_TEXT = (
    "def parse(line: str) -> dict[str, int]:\n    \"\"\"Split 'key=value' pairs.\"\"\"\n"
    "\tresult = {}  # 1234567 ünïcödé → 中文\n\n\n        return   result\r\n"
)


@dataclass(frozen=True)
class ExportReport:
    path: Path
    architecture: str
    pre_tokenizer: str
    tensors: int
    vocab: int
    bytes: int


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path.parent} has no {path.name}") from None
    except json.JSONDecodeError as err:
        raise ExportError(f"{path}: not valid JSON ({err})") from None


def loaded_tokenizer_json(model_dir: Path) -> dict:
    """The tokenizer as transformers loads it (``AutoTokenizer``), serialised: the truth, which
    can differ from the folder's ``tokenizer.json`` (transformers 5 gives a Qwen2 model its
    Qwen2 pre-tokenizer whatever the file says)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:
        raise ExportError(f"cannot load the tokenizer of {model_dir}: {str(err).splitlines()[0]}") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError(f"{model_dir}: not a fast (tokenizers) tokenizer; only those are exported")
    return json.loads(backend.to_str())


def detect_pre_tokenizer(tokenizer_json: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, or ExportError naming what it found."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split" and "pattern" in s]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    digits = [s for s in steps if s.get("type") == "Digits"]
    if len(splits) == 1 and splits[0] is not None:
        for name, pattern in PRE_TOKENIZERS.items():
            if splits[0] == pattern:
                return name
    if not splits and len(byte_level) == 1 and byte_level[0].get("use_regex", True):
        if digits and digits[0].get("individual_digits"):
            return STARCODER_NAME
        if not digits:
            return GPT2_REGEX_NAME
    shown = splits[0] if splits else json.dumps(pre)[:120]
    raise ExportError(f"unknown pre-tokenizer ({shown!r}); pass the llama.cpp name "
                      "(e.g. --pre-tokenizer qwen2, llama-bpe, gpt-2, starcoder, deepseek-coder)")


def _merges(model: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _vocab(tokenizer_json: dict, vocab_size: int):
    """(token strings by id, token types by id) for a byte-level BPE ``tokenizer.json``."""
    import gguf

    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(f"tokenizer model {model.get('type')!r} is not byte-level BPE; only BPE "
                          "tokenizers (GPT-2, Qwen, Llama 3, StarCoder style) are exported")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    kinds: dict[int, int] = {i: gguf.TokenType.NORMAL for i in by_id}
    for added in tokenizer_json.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        kinds[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    size = max(vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(kinds[i])
        else:  # the embedding matrix is padded past the tokenizer (common: to a multiple of 64)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types


def permute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a Q or K projection from rotate-half to interleaved rotary pairs (per head)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _config(model_dir: Path) -> dict:
    config = _read_json(model_dir / "config.json")
    if "text_config" in config and "num_hidden_layers" not in config:
        config = {**config, **config["text_config"]}
    return config


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise ExportError(f"rope scaling {kind!r} is not exported yet (only plain RoPE)")
    return float(params.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base", 10000.0))))


@dataclass(frozen=True)
class Shape:
    """The hyperparameters llama.cpp reads, whatever the config calls them."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context: int
    norm_eps: float


def _shape(config: dict, model_type: str) -> Shape:
    if model_type == "gpt_neox":
        activation = config.get("hidden_act", "gelu")
        if activation not in GELUS:
            raise ExportError(f"activation {activation!r} is not exported (llama.cpp's gptneox runs gelu)")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return Shape(layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads, kv_heads=heads,
                     head_dim=hidden // heads, ffn=int(config["intermediate_size"]),
                     context=int(config.get("max_position_embeddings", 2048)),
                     norm_eps=float(config.get("layer_norm_eps", 1e-5)))
    if model_type in GPT2_FAMILY:
        _check_gpt2_family(config, model_type)
        hidden, heads = int(config["n_embd"]), int(config["n_head"])
        multi_query = model_type == "gpt_bigcode" and config.get("multi_query", True)  # gpt_bigcode's default
        return Shape(layers=int(config["n_layer"]), hidden=hidden, heads=heads, kv_heads=1 if multi_query else heads,
                     head_dim=hidden // heads, ffn=int(config.get("n_inner") or 4 * hidden),
                     context=int(config["n_positions"]), norm_eps=float(config.get("layer_norm_epsilon", 1e-5)))
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window and window < int(config.get("max_position_embeddings", 4096)) and model_type != "phi3":
        raise ExportError(f"a sliding window of {window} tokens is not exported (llama.cpp's "
                          f"{ARCHITECTURES[model_type]} graph attends to every position)")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return Shape(layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads,
                 kv_heads=int(config.get("num_key_value_heads") or heads),
                 head_dim=int(config.get("head_dim") or hidden // heads), ffn=int(config["intermediate_size"]),
                 context=int(config.get("max_position_embeddings", 4096)),
                 norm_eps=float(config.get("rms_norm_eps", config.get("layer_norm_eps", 1e-6))))


def _check_gpt2_family(config: dict, model_type: str) -> None:
    """What llama.cpp's gpt2/starcoder graphs cannot run, refused in one line."""
    activation = config.get("activation_function", "gelu_new" if model_type == "gpt2" else "gelu_pytorch_tanh")
    if activation not in GELUS:
        raise ExportError(f"activation {activation!r} is not exported (llama.cpp's "
                          f"{ARCHITECTURES[model_type]} runs gelu)")
    if config.get("add_cross_attention"):
        raise ExportError("cross-attention is not exported (llama.cpp runs decoder-only models)")


def _query_scale(config: dict, model_type: str, layer: int, head_dim: int) -> float:
    """What the Q rows are multiplied by so that llama.cpp's fixed 1/sqrt(head_dim) attention
    scale gives the checkpoint's own (GPT-2's may be off, or divided by the layer's number)."""
    scale = head_dim ** -0.5 if config.get("scale_attn_weights", True) else 1.0
    if model_type == "gpt2" and config.get("scale_attn_by_inverse_layer_idx", False):
        scale /= layer + 1
    return scale * head_dim ** 0.5


def _gpt2_family_tensor(key: str, data: np.ndarray, config: dict, model_type: str, shape: Shape) -> np.ndarray:
    """A GPT-2 / GPTBigCode tensor in the layout llama.cpp reads."""
    if model_type == "gpt2" and key.endswith(CONV1D_WEIGHTS):
        data = data.T  # Conv1D stores [in, out]; GGUF (as nn.Linear) [out, in]
    if not key.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        return data
    # c_attn rows: llama.cpp splits the fused output as [all q | all k | all v]. gpt2 and
    # multi-query gpt_bigcode store it so; gpt_bigcode without multi-query stores it per head,
    # [H, (q k v), D].
    if model_type == "gpt_bigcode" and shape.kv_heads > 1:
        data = (data.reshape(shape.heads, 3, shape.head_dim, *data.shape[1:])
                .swapaxes(0, 1).reshape(data.shape))
    scale = _query_scale(config, model_type, int(re.search(r"(?:^|\.)h\.(\d+)\.", key).group(1)), shape.head_dim)
    if scale != 1.0:
        data = np.array(data)  # a copy: the rows below change
        data[:shape.hidden] *= scale
    return data


def _neox_tensor(key: str, data: np.ndarray, shape: Shape) -> np.ndarray:
    """GPT-NeoX's fused query_key_value rows are per head, [H, (q k v), D]; llama.cpp's gptneox
    graph splits them as [all q | all k | all v]."""
    if not key.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
        return data
    return data.reshape(shape.heads, 3, shape.head_dim, *data.shape[1:]).swapaxes(0, 1).reshape(data.shape)


def _rotary_dims(config: dict, head_dim: int) -> int:
    params = config.get("rope_parameters") or {}
    return int(head_dim * params.get("partial_rotary_factor", config.get("rotary_pct", 1.0)))


def _is_buffer(key: str) -> bool:
    """Saved non-weights: rotary frequencies, old GPT-2 checkpoints' causal masks (``attn.bias``)."""
    return key.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"))


def _special_ids(model_dir: Path, tokenizer_json: dict, config: dict) -> dict[str, int]:
    """Token ids llama.cpp should know by role: eos/bos/pad, and the FIM tokens when present."""
    by_content = {a["content"]: a["id"] for a in tokenizer_json.get("added_tokens", [])}
    ids: dict[str, int] = {}
    tok_config = {}
    if (model_dir / "tokenizer_config.json").is_file():
        tok_config = _read_json(model_dir / "tokenizer_config.json")
    for role in ("eos", "bos", "pad"):
        value = config.get(f"{role}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if value is None:
            text = tok_config.get(f"{role}_token")
            text = text.get("content") if isinstance(text, dict) else text
            value = by_content.get(text) if text else None
        if value is not None:
            ids[role] = int(value)
    fim_names = {
        "fim_pre": ("<|fim_prefix|>", "<fim_prefix>", "<｜fim▁begin｜>"),
        "fim_suf": ("<|fim_suffix|>", "<fim_suffix>", "<｜fim▁hole｜>"),
        "fim_mid": ("<|fim_middle|>", "<fim_middle>", "<｜fim▁end｜>"),
        "fim_pad": ("<|fim_pad|>", "<fim_pad>"),
        "fim_rep": ("<|repo_name|>", "<repo_name>"),
        "fim_sep": ("<|file_sep|>", "<file_sep>"),
    }
    for role, texts in fim_names.items():
        for text in texts:
            if text in by_content:
                ids[role] = by_content[text]
                break
    return ids


# Types written through llama.cpp's own quantizer (``llama_model_quantize``) from an f32
# export: the types users run (llama-server, Ollama, LM Studio), each as llama.cpp quantizes it.
# A tensor whose rows do not split into the type's blocks (256 values for the K types) gets
# llama.cpp's fallback type, as its ``llama-quantize`` does.
QUANTIZED_TYPES = {"bf16": "BF16", "q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q5_k_s": "Q5_K_S",
                   "q5_0": "Q5_0", "q5_1": "Q5_1", "q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S", "q4_0": "Q4_0",
                   "q4_1": "Q4_1", "q3_k_m": "Q3_K_M", "q2_k": "Q2_K"}
WRITTEN_TYPES = ("f32", "f16")
EXPORT_TYPES = WRITTEN_TYPES + tuple(QUANTIZED_TYPES)


def quantize_gguf(source: str | Path, out: str | Path, gguf_type: str, threads: int = 0) -> None:
    """``out``: the GGUF file ``source`` quantized to ``gguf_type`` (a ``QUANTIZED_TYPES`` key)
    by llama.cpp; whole (written to ``.partial``, renamed) or not at all."""
    from specd.llamacpp.runtime import import_llama_cpp

    if gguf_type not in QUANTIZED_TYPES:
        raise ExportError(f"type {gguf_type!r}: choose one of {', '.join(EXPORT_TYPES)}")
    llama_cpp = import_llama_cpp()
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{QUANTIZED_TYPES[gguf_type]}")
    params.nthread = threads
    try:
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
        if code != 0:
            raise ExportError(f"llama.cpp could not quantize {Path(source).name} to {gguf_type} (code {code})")
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)


def export_gguf(model_dir: str | Path, out: str | Path, *, dtype: str = "f32",
                pre_tokenizer: str | None = None, progress: bool = False) -> ExportReport:
    """Write ``model_dir`` (a Hugging Face folder) to the GGUF file ``out``: f32 or f16
    matrices written here, any ``QUANTIZED_TYPES`` one by llama.cpp's quantizer from f32."""
    if dtype in QUANTIZED_TYPES:
        out = Path(out)
        full = out.with_name(out.name + ".f32.partial")
        try:
            report = export_gguf(model_dir, full, dtype="f32", pre_tokenizer=pre_tokenizer, progress=progress)
            quantize_gguf(full, out, dtype)
        finally:
            full.unlink(missing_ok=True)
        return ExportReport(out, report.architecture, report.pre_tokenizer, report.tensors, report.vocab,
                            out.stat().st_size)
    import gguf
    import torch
    from safetensors import safe_open

    model_dir, out = Path(model_dir), Path(out)
    if not model_dir.is_dir():
        raise ExportError(f"{model_dir} is not a model directory")
    config = _config(model_dir)
    model_type = config.get("model_type", "")
    if model_type not in ARCHITECTURES:
        raise ExportError(f"architecture {model_type!r} is not exported (served: {', '.join(ARCHITECTURES)})")
    arch_name = ARCHITECTURES[model_type]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    dtypes = {"f32": (np.float32, gguf.LlamaFileType.ALL_F32), "f16": (np.float16, gguf.LlamaFileType.MOSTLY_F16)}
    if dtype not in dtypes:
        raise ExportError(f"type {dtype!r}: choose one of {', '.join(EXPORT_TYPES)}")
    np_dtype, file_type = dtypes[dtype]

    shape = _shape(config, model_type)  # refuses what llama.cpp's graph cannot run, before any work
    tokenizer_json = loaded_tokenizer_json(model_dir)
    pre = pre_tokenizer or detect_pre_tokenizer(tokenizer_json)
    vocab_size = int(config["vocab_size"])
    tokens, types = _vocab(tokenizer_json, vocab_size)

    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ExportError(f"{model_dir} has no .safetensors weights")
    names = gguf.get_tensor_name_map(arch, shape.layers)

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer logs every step at INFO
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    try:
        writer = gguf.GGUFWriter(str(partial), arch_name)
        writer.add_name(model_dir.name)
        # GPT-2's learned positions: llama.cpp sizes position_embd by the context length.
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.ffn)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        if model_type == "gpt_neox":
            writer.add_layer_norm_eps(shape.norm_eps)
            writer.add_rope_freq_base(_rope_theta(config))
            writer.add_rope_dimension_count(_rotary_dims(config, shape.head_dim))
            writer.add_parallel_residual(bool(config.get("use_parallel_residual", True)))
        elif model_type in GPT2_FAMILY:
            writer.add_layer_norm_eps(shape.norm_eps)
        elif model_type == "stablelm":  # LayerNorms with biases, a part of each head rotated
            writer.add_layer_norm_eps(shape.norm_eps)
            writer.add_rope_freq_base(_rope_theta(config))
            writer.add_rope_dimension_count(_rotary_dims(config, shape.head_dim))
            writer.add_parallel_residual(bool(config.get("use_parallel_residual", False)))
        else:
            writer.add_layer_norm_rms_eps(shape.norm_eps)
            writer.add_rope_freq_base(_rope_theta(config))
            writer.add_rope_dimension_count(_rotary_dims(config, shape.head_dim))
        if model_type == "phi3":  # llama.cpp's phi3 graph reads these (a window of 0: none)
            writer.add_sliding_window(int(config.get("sliding_window") or 0))
            writer.add_rope_scaling_orig_ctx_len(int(config.get("original_max_position_embeddings") or shape.context))
        if model_type == "granite":
            for key, add in GRANITE_SCALES.items():
                if config.get(key) is not None:
                    getattr(writer, add)(float(config[key]))
        if shape.head_dim != shape.hidden // shape.heads:
            writer.add_key_length(shape.head_dim)
            writer.add_value_length(shape.head_dim)
        writer.add_vocab_size(len(tokens))
        writer.add_file_type(file_type)

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([int(t) for t in types])
        writer.add_token_merges(_merges(tokenizer_json["model"]))
        special = _special_ids(model_dir, tokenizer_json, config)
        special.setdefault("bos", special.get("eos", 0))  # llama.cpp wants one; it is never added below
        adders = {"eos": writer.add_eos_token_id, "bos": writer.add_bos_token_id, "pad": writer.add_pad_token_id}
        for role, value in special.items():
            if role in adders:
                adders[role](value)
            else:
                writer.add_uint32(getattr(gguf.Keys.Tokenizer, f"{role.upper()}_ID"), value)
        writer.add_add_bos_token(False)  # specd's prompt ids are complete; the template adds BOS if any
        writer.add_add_eos_token(False)

        # Tied: llama.cpp's graphs read token_embd where the file has no output matrix.
        tied = bool(config.get("tie_word_embeddings", model_type in GPT2_FAMILY))  # their configs' default
        written = 0
        handles = [safe_open(str(p), framework="pt") for p in shards]
        keys = [(h, k) for h in handles for k in h.keys()]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(keys), desc=f"gguf {model_dir.name}", unit="tensor", leave=False,
                       file=sys.stderr, disable=None)  # no bar off a terminal (a log file)
        for handle, key in keys:
            if bar:
                bar.update()
            if _is_buffer(key) or (tied and key == "lm_head.weight"):
                continue
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ExportError(f"tensor {key!r} has no llama.cpp name for {arch_name}")
            data = handle.get_tensor(key).to(torch.float32).numpy()
            if model_type in GPT2_FAMILY:
                data = _gpt2_family_tensor(key, data, config, model_type, shape)
            elif model_type == "gpt_neox":
                data = _neox_tensor(key, data, shape)
            elif model_type in ROTARY_PERMUTED and key.endswith("q_proj.weight"):
                data = permute_rotary_rows(data, shape.heads)
            elif model_type in ROTARY_PERMUTED and key.endswith("k_proj.weight"):
                data = permute_rotary_rows(data, shape.kv_heads)
            elif model_type in NORM_PLUS_ONE and key.endswith("norm.weight"):
                data = data + 1.0
            # Norms and biases stay f32, as llama.cpp expects; matrices take the chosen type.
            data = data.astype(np_dtype if data.ndim > 1 else np.float32)
            writer.add_tensor(name, np.ascontiguousarray(data))
            written += 1
        if bar:
            bar.close()
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(out)
    log.info("wrote %s: %s, %d tensors, %d tokens, pre-tokenizer %s", out, arch_name, written, len(tokens), pre)
    return ExportReport(out, arch_name, pre, written, len(tokens), out.stat().st_size)


def verify_tokenizer(gguf_path: str | Path, model_dir: str | Path, texts: list[str] | None = None) -> None:
    """Raise ExportError unless llama.cpp tokenizes ``texts`` to the ids transformers gives."""
    from transformers import AutoTokenizer

    from specd.llamacpp.runtime import load_llama

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    llama = load_llama(gguf_path, n_ctx=256)
    for text in texts or [SAMPLE_TEXT]:
        ours = tokenizer.encode(text, add_special_tokens=False)
        theirs = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise ExportError(f"llama.cpp tokenizes differently from transformers at token {first} "
                              f"({ours[first:first + 4]} vs {theirs[first:first + 4]}): wrong pre-tokenizer?")


def default_name(model_dir: Path, dtype: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{model_dir.parent.name}-{model_dir.name}") + f".{dtype}.gguf"


EXPORT_VERSION = 1  # bump when the writer's output changes: cached files are re-written


def resolve_model_dir(name: str | Path) -> Path:
    """A local folder for a model name: the folder itself, or a hub id's local snapshot."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name), local_files_only=True))
    except Exception as err:  # not a folder, and no local snapshot of that id
        raise ExportError(f"{name}: not a model folder, nor a hub id with a local snapshot "
                          f"({type(err).__name__})") from None


def cache_dir() -> Path:
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd" / "gguf"


def cached_gguf(model: str | Path, dtype: str = "f32", directory: Path | None = None,
                progress: bool = False) -> Path:
    """The GGUF file of ``model`` in the cache (written and checked once per weights version).
    Named ``<model>.<dtype>-<source>-<version>.gguf``: a new version of the same source (weights
    saved again, a newer exporter) replaces the older file, which is removed, so the cache holds
    one file per model directory and dtype (a 1.5B model in f32 is 6 GB)."""
    import hashlib

    model_dir = resolve_model_dir(model).resolve()
    source = hashlib.sha256(f"{model_dir}|{dtype}".encode()).hexdigest()[:8]
    stamp = hashlib.sha256(f"{EXPORT_VERSION}".encode())
    for path in sorted(model_dir.glob("*.safetensors")) + [model_dir / "tokenizer.json", model_dir / "config.json"]:
        if path.is_file():
            info = path.stat()
            stamp.update(f"{path.name}|{info.st_size}|{info.st_mtime_ns}".encode())
    prefix = f"{default_name(model_dir, dtype)[:-5]}-{source}-"
    out = (directory or cache_dir()) / f"{prefix}{stamp.hexdigest()[:10]}.gguf"
    if not out.is_file():
        export_gguf(model_dir, out, dtype=dtype, progress=progress)
        try:
            verify_tokenizer(out, model_dir)
        except ExportError:
            out.unlink(missing_ok=True)
            raise
        for stale in out.parent.glob(f"{glob.escape(prefix)}*.gguf"):
            if stale != out:
                log.info("removing %s: an older export of %s", stale, model_dir)
                stale.unlink(missing_ok=True)
    return out


def run_export_gguf(args, cfg) -> int:
    """``specd export-gguf``: the configured pair (or the demo pair) as GGUF files."""
    import sys

    from specd.llamacpp.runtime import available

    target, draft = cfg["model.target"], cfg["model.draft"]
    if not target:
        from specd.demo import demo_pair_paths

        paths = demo_pair_paths()
        if paths is None:
            print("specd export-gguf: no model configured and the demo pair is not built", file=sys.stderr)
            return 1
        target, draft = str(paths[0]), draft or str(paths[1])
    out_dir = Path(args.out).expanduser() if args.out else cache_dir()
    check = available()
    for role, name in (("target", target), ("draft", draft)):
        if not name:
            continue
        try:
            model_dir = resolve_model_dir(name)
            out = out_dir / default_name(model_dir.resolve(), args.gguf_type)
            report = export_gguf(model_dir, out, dtype=args.gguf_type, pre_tokenizer=args.pre_tokenizer,
                                 progress=True)
            if check:
                verify_tokenizer(out, model_dir, [SAMPLE_TEXT])
        except (ExportError, OSError) as err:
            print(f"specd export-gguf: {role} {name}: {err}", file=sys.stderr)
            return 1
        verdict = "llama.cpp tokenizes as transformers does" if check else \
            "tokenization not checked: llama-cpp-python is not installed"
        print(f"{role}: {report.path} ({report.architecture}, {report.tensors} tensors, {report.vocab} tokens, "
              f"pre-tokenizer {report.pre_tokenizer}, {report.bytes / 2**20:.1f} MiB; {verdict})")
    return 0
