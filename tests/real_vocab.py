"""Real code-model vocabularies for the tests, and tiny random-weight pairs that carry them.

No weights can be downloaded, but the real tokenizers can: llama-cpp-python's sdist ships
vocab-only GGUF files (``vendor/llama.cpp/models/ggml-vocab-*.gguf``), each with llama.cpp's test
strings and their expected ids (``.gguf.inp`` / ``.gguf.out``, written by the models' own Hugging
Face tokenizers). ``vocab_dir()`` fetches the sdist of the installed llama-cpp-python with pip into
a cache kept across runs and extracts only those files; it raises when it cannot (the tests then
fail, never skip). ``SPECD_TEST_LLAMA_SDIST`` may name an sdist already on disk.

``build_tokenizer(family, out)`` rebuilds a family's tokenizer as a Hugging Face folder from the
GGUF fields with the ``tokenizers`` library: the vocabulary, merges and special tokens from the
file, the pre-tokenizer or normalizer of the family's own ``tokenizer.json`` (transformers' GGUF
reader guesses these and misses llama.cpp's strings), and the FIM specials at their real ids where
the base vocabulary lacks them (Qwen2.5-Coder over ``qwen2``, CodeLlama over ``llama-spm``).
``make_family_pair(family, root)`` adds a target and a draft of the family's real architecture.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SDIST_ENV = "SPECD_TEST_LLAMA_SDIST"
SDIST = os.environ.get(SDIST_ENV)  # read at import: the tests' isolation clears SPECD_* variables
# Read at import (conftest imports this module before any fixture points XDG_CACHE_HOME at a
# session's temporary directory), so the download is kept across runs.
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specd-tests" / "vocab"
MEMBER_DIR = "vendor/llama.cpp/models/"
MEMBER_PREFIX = "ggml-vocab-"
TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def llama_cpp_version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def vocab_dir(cache_root: Path = CACHE_ROOT) -> Path:
    """The folder of ``ggml-vocab-*`` files from the installed llama-cpp-python's sdist, fetched
    and extracted once (atomically: into a temporary folder, then renamed into place)."""
    version = llama_cpp_version()
    final = cache_root / version
    if (final / "ggml-vocab-llama-spm.gguf").is_file():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=cache_root))
    try:
        sdist = SDIST
        if not sdist:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                       "--disable-pip-version-check", "-q", "-d", str(work / "sdist"), f"llama-cpp-python=={version}"]
            done = subprocess.run(command, capture_output=True, text=True)
            found = sorted((work / "sdist").glob("llama_cpp_python-*.tar.gz"))
            if done.returncode != 0 or not found:
                raise RuntimeError(f"pip download of llama-cpp-python=={version}'s sdist failed "
                                   f"(rc {done.returncode}): {done.stderr.strip()[-400:]}")
            sdist = str(found[0])
        out = work / "models"
        out.mkdir()
        with tarfile.open(sdist) as archive:
            for member in archive:
                head, _, name = member.name.partition("/")
                if not member.isfile() or not name.startswith(MEMBER_DIR + MEMBER_PREFIX) or "/" in name[len(MEMBER_DIR):]:
                    continue
                with archive.extractfile(member) as src, open(out / Path(name).name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        if not (out / "ggml-vocab-llama-spm.gguf").is_file():
            raise RuntimeError(f"{sdist} holds no {MEMBER_DIR}{MEMBER_PREFIX}* files")
        try:
            out.rename(final)
        except OSError:  # another run got there first
            if not (final / "ggml-vocab-llama-spm.gguf").is_file():
                raise
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def llama_cpp_cases(vocab: Path, base: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings for one vocabulary file and their expected ids."""
    inputs = (vocab / f"ggml-vocab-{base}.gguf.inp").read_text(encoding="utf-8").split(TEST_SEPARATOR)
    outputs = (vocab / f"ggml-vocab-{base}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(x) for x in ids.split()]) for text, ids in zip(inputs, outputs)]


# ---- families --------------------------------------------------------------------------------

# Qwen2.5-Coder's added tokens above Qwen2's <|im_end|> (151645), from its tokenizer_config.json.
QWEN25_CODER_ADDED = {
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>", 151649: "<|box_end|>",
    151650: "<|quad_start|>", 151651: "<|quad_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>",
    151654: "<|vision_pad|>", 151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>",
    151658: "</tool_call>", 151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>", 151663: "<|repo_name|>", 151664: "<|file_sep|>",
}
# CodeLlama's infilling tokens over Llama 2's SentencePiece vocabulary (its embedding has 32016 rows).
CODELLAMA_ADDED = {32007: "▁<PRE>", 32008: "▁<SUF>", 32009: "▁<MID>", 32010: "▁<EOT>"}
# Codestral's FIM control tokens. Codestral's own vocabulary (Mistral's v3, 32768) is not among
# llama.cpp's files: these ride on Llama 2's SentencePiece (what Mistral's v1 tokenizer is like),
# just above it, so the SentencePiece side of the family is tested, not its real ids.
CODESTRAL_LIKE_ADDED = {32000: "[SUFFIX]", 32001: "[PREFIX]", 32002: "[MIDDLE]"}


@dataclass(frozen=True)
class Family:
    name: str  # as the tests say it
    base: str  # the ggml-vocab-<base>.gguf file
    archs: tuple[str, ...]  # transformers model types of the family's real models
    vocab_size: int  # the real models' embedding rows
    fim_family: str  # specd's template the tokenizer must be detected as
    added: dict[int, str] = field(default_factory=dict)  # specials placed at these ids
    tokenizer_class: str = "PreTrainedTokenizerFast"


FAMILIES: dict[str, Family] = {
    "deepseek-coder": Family("deepseek-coder", "deepseek-coder", ("llama",), 32256, "deepseek"),
    "starcoder": Family("starcoder", "starcoder", ("starcoder2", "gpt_bigcode"), 49152, "starcoder"),
    "qwen2.5-coder": Family("qwen2.5-coder", "qwen2", ("qwen2",), 151936, "qwen", QWEN25_CODER_ADDED),
    "codellama": Family("codellama", "llama-spm", ("llama",), 32016, "codellama", CODELLAMA_ADDED),
    "codestral-like": Family("codestral-like", "llama-spm", ("mistral",), 32003, "codestral",
                             CODESTRAL_LIKE_ADDED),
}


def build_tokenizer(family: Family, vocab: Path, out: Path) -> Path:
    """``out`` as a tokenizer folder AutoTokenizer loads (built once; kept if there): the
    package's own GGUF rebuild (``specd.llamacpp.dequantize.build_tokenizer``), with the family's
    pre-tokenizer and the specials its vocabulary file lacks."""
    if (out / "tokenizer.json").is_file():
        return out
    import gguf

    from specd.llamacpp.dequantize import build_tokenizer as from_gguf, read_fields

    fast = from_gguf(read_fields(gguf.GGUFReader(vocab / f"ggml-vocab-{family.base}.gguf")), added=family.added,
                     pre=family.base)
    for i, text in family.added.items():
        assert fast.convert_tokens_to_ids(text) == i, (family.name, text, i, fast.convert_tokens_to_ids(text))
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=out.parent))
    fast.save_pretrained(tmp)
    config = json.loads((tmp / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["tokenizer_class"] = family.tokenizer_class
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    tmp.rename(out)
    return out


def _config(arch: str, family: Family, tokenizer, hidden: int, layers: int, init_range: float):
    from transformers import AutoConfig

    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    common = dict(vocab_size=family.vocab_size, initializer_range=init_range, bos_token_id=bos,
                  eos_token_id=tokenizer.eos_token_id)
    if arch == "gpt_bigcode":
        return AutoConfig.for_model(arch, n_embd=hidden, n_layer=layers, n_head=4, n_positions=4096,
                                    multi_query=True, **common)
    return AutoConfig.for_model(arch, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                tie_word_embeddings=arch in ("qwen2", "starcoder2"), **common)


def make_family_pair(family: Family, arch: str, vocab: Path, root: Path, hidden: int = 64,
                     layers: int = 2) -> tuple[Path, Path]:
    """(target_dir, draft_dir): random-weight models of ``arch`` with the family's real tokenizer
    and vocabulary size. A large init range keeps greedy argmaxes clear of float rounding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = build_tokenizer(family, vocab, root / f"tokenizer-{family.name}")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    dirs = []
    for role, seed, size in (("target", 11, hidden), ("draft", 12, hidden // 2)):
        out = root / f"{family.name}-{arch}" / role
        dirs.append(out)
        if (out / "config.json").is_file():
            continue
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(arch, family, tokenizer, size, layers, 0.4))
        model.save_pretrained(out)
        for name in tok_dir.iterdir():
            shutil.copy(name, out / name.name)
        (out / "specd.json").unlink(missing_ok=True)
    return dirs[0], dirs[1]
