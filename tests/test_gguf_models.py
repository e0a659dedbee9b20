"""GGUF models loaded directly: ``model.target`` / ``model.draft`` naming a ``.gguf`` file (or
``ollama:NAME``). No torch weights: llama.cpp's tokenizer and llama.cpp's forward, and the
reference for losslessness is llama.cpp's own greedy decoding of the same file (``LlamaSlot``,
the bench's ``llamacpp`` peer: one token per forward).

Every GGUF here is written in the test: tiny random-weight pairs exported in f32 and quantized
by llama.cpp (``export_gguf(..., dtype="q8_0")``); the tokenizer checks read the real
vocabularies of llama.cpp's ``ggml-vocab-*.gguf`` files (tests/real_vocab.py).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GGUF_ON_LLAMACPP
from engine_helpers import make_drafting_free, make_near_draft
from real_vocab import llama_cpp_cases
from tiny import make_tiny_pair
from specd.engine import CompletionRequest
from specd.engine.engine import Engine
from specd.engine.front.prompt import detect_family
from specd.engine.models import load_pair
from specd.engine.options import EngineOptions
from specd.engine.types import ModelLoadError, UnsupportedModel
from specd.llamacpp.export import EXPORT_TYPES, export_gguf
from specd.llamacpp.gguf import GgufError, read_header, resolve_ollama
from specd.llamacpp.model import open_gguf
from specd.llamacpp.runtime import LlamaSlot

MAX_TOKENS = 24
CODE = "def parse(line: str) -> dict[str, int]:\n\tkey, _, value = line.partition('=')  # 12 ünï\r\n    return {key: 42}\n"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """(arch, type) -> (target.gguf, draft.gguf): a tiny random target and a near draft of it
    (the target plus weight noise: drafts accepted and rejected), both exported."""
    root = tmp_path_factory.mktemp("gguf-models")
    made = {}

    def files(arch: str, kind: str):
        if (arch, kind) not in made:
            target, _ = make_tiny_pair(root / arch, arch)
            near = make_near_draft(target, root / arch / "near-draft")
            made[arch, kind] = tuple(export_gguf(source, root / f"{arch}-{role}.{kind}.gguf", dtype=kind).path
                                     for role, source in (("target", target), ("draft", near)))
        return made[arch, kind]
    return files


def gguf_engine(target, draft=None, **options) -> Engine:
    """An engine on GGUF files whose planner drafts at full length every step (wide verifies)."""
    options.setdefault("time_budget_ms", 600_000)
    opts = EngineOptions(target=str(target), draft=str(draft or ""), **options)
    engine = Engine(opts, pair=load_pair(str(target), str(draft) if draft else None))
    make_drafting_free(engine)
    return engine


# ---- the tokenizer ---------------------------------------------------------------------------

@pytest.mark.parametrize("base", ["qwen2", "deepseek-coder", "starcoder", "llama-spm", "llama-bpe", "phi-3"])
def test_the_tokenizer_is_llama_cpps_on_real_vocabularies(real_vocab, base):
    model, tokenizer = open_gguf(str(real_vocab.folder / f"ggml-vocab-{base}.gguf"))
    for text, ids in llama_cpp_cases(real_vocab.folder, base):
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
    ids = tokenizer.encode(CODE, add_special_tokens=False)
    assert tokenizer.decode(ids) == CODE
    assert model.vocab_size == len(tokenizer) == tokenizer.n_tokens
    # offsets: each token's start, in characters, is where its text begins
    encoded = tokenizer(CODE, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in encoded["offset_mapping"]]
    assert starts == sorted(starts) and starts[0] == 0 and encoded["offset_mapping"][-1][1] == len(CODE)
    for k in range(1, len(ids)):
        before = tokenizer.decode(ids[:k])
        if "\ufffd" not in before:  # not within a character split between tokens
            assert starts[k] == len(before), (k, before)


@pytest.mark.parametrize("base, family", [("deepseek-coder", "deepseek"), ("starcoder", "starcoder"),
                                          ("llama-spm", "plain")])
def test_the_fim_family_comes_from_the_files_vocabulary(real_vocab, base, family):
    _, tokenizer = open_gguf(str(real_vocab.folder / f"ggml-vocab-{base}.gguf"))
    assert detect_family(tokenizer).name == family


def test_an_exported_qwen25_coder_tokenizes_as_transformers_does(real_vocab, tmp_path):
    """Qwen2.5-Coder's real vocabulary with its FIM specials, through an export: llama.cpp's
    tokenizer of the file gives transformers' ids, specials included, and the family is qwen."""
    from transformers import AutoTokenizer

    target, _ = real_vocab.pair("qwen2.5-coder", "qwen2")
    path = export_gguf(target, tmp_path / "coder.gguf").path
    _, tokenizer = open_gguf(str(path))
    hf = AutoTokenizer.from_pretrained(target)
    fim = "<|fim_prefix|>" + CODE[:40] + "<|fim_suffix|>" + CODE[60:] + "<|fim_middle|>"
    assert tokenizer.encode(fim, add_special_tokens=False) == hf.encode(fim, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|fim_middle|>") == 151660
    assert 151660 in tokenizer.all_special_ids
    assert detect_family(tokenizer).name == "qwen"


# ---- lossless against llama.cpp's own greedy ---------------------------------------------------

@pytest.mark.parametrize("arch, kind", [("qwen2", "f32"), ("qwen2", "q8_0"), ("llama", "q8_0")])
def test_output_is_llama_cpps_greedy_of_the_same_file(gguf_files, sample_source, arch, kind):
    target, draft = gguf_files(arch, kind)
    engine = gguf_engine(target, draft, prefix_tokens=384, suffix_tokens=128)
    assert {role: path.name for role, (path, _) in engine.paths.items()} == {"target": "llamacpp", "draft": "llamacpp"}
    slot = LlamaSlot(target, n_ctx=2048, kv_f32=True)
    tokens = forwards = accepted = 0
    for marker in ("    def sell", "    def to_dict", "class Inventory:", "    def sell"):
        offset = sample_source.index(marker)
        result = engine.complete(CompletionRequest(uri="file:///inventory.py", text=sample_source, offset=offset,
                                                   max_tokens=MAX_TOKENS, token_healing=False))
        reference = slot.generate(result.prompt_ids, MAX_TOKENS, set(engine.stop_ids)).tokens
        n = len(result.token_ids)
        assert result.token_ids == reference[:n], (marker, result.stop_reason)
        assert n == len(reference) or result.stop_reason not in ("eos", "max_tokens")
        tokens += n
        forwards += result.target_forwards
        accepted += sum(s.accepted for s in result.sources.values())
    assert accepted > 0 and tokens > forwards  # drafts stood: verifies were wider than a step
    assert engine.caches.get("file:///inventory.py").target.ids  # the document's cache was reused


def test_token_healing_on_a_gguf_model_stays_llama_cpps_greedy(gguf_files, sample_source):
    target, draft = gguf_files("qwen2", "q8_0")
    engine = gguf_engine(target, draft, prefix_tokens=384, suffix_tokens=128)
    slot = LlamaSlot(target, n_ctx=2048, kv_f32=True)
    offset = sample_source.index("    def sell") + len("    def se")
    result = engine.complete(CompletionRequest(text=sample_source, offset=offset, max_tokens=MAX_TOKENS))
    assert result.healed
    healing = engine.healing

    def allowed(generated: list[int]):  # the bench's llamacpp peer's constraint
        rest = healing.remaining(result.healed, generated) if len(generated) <= len(result.healed) else ""
        return healing.allowed(rest, "\n").numpy() if rest else None

    reference = slot.generate(result.prompt_ids, MAX_TOKENS, set(engine.stop_ids), constraint=allowed).tokens
    assert result.token_ids == reference[:len(result.token_ids)]


def test_a_gguf_target_says_what_it_is_and_which_forward_runs_it(gguf_files):
    target, draft = gguf_files("qwen2", "q8_0")
    engine = gguf_engine(target, draft)
    stats = engine.stats()
    assert stats["models"]["dtype"] == "gguf Q8_0"
    assert stats["models"]["gguf"]["target"] == {"file": str(target), "type": "Q8_0", "architecture": "qwen2"}
    assert stats["models"]["target_params"] == read_header(target).params() > 0
    forward = stats["forward"]["target"]
    assert forward["path"] == "llamacpp" and "GGUF Q8_0, qwen2" in forward["detail"]
    assert "every forward on llama.cpp" in forward["detail"]


# ---- one line for what cannot be served --------------------------------------------------------

def _rewrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def test_a_tensor_type_llama_cpp_cannot_load_is_one_line(gguf_files, tmp_path):
    target, _ = gguf_files("qwen2", "f32")
    bad = tmp_path / "odd-type.gguf"
    bad.write_bytes(target.read_bytes())
    tensor = read_header(bad).tensors[3]
    _rewrite(bad, tensor.type_offset, struct.pack("<I", 31))  # a type ggml removed (Q4_0_4_4)
    with pytest.raises(UnsupportedModel) as info:
        load_pair(str(bad), None)
    message = str(info.value)
    assert "\n" not in message and "odd-type.gguf" in message
    assert f"tensor {tensor.name} is of ggml type 31" in message and "cannot load" in message


def test_an_architecture_llama_cpp_does_not_know_is_one_line(gguf_files, tmp_path):
    target, _ = gguf_files("qwen2", "f32")
    bad = tmp_path / "odd-arch.gguf"
    bad.write_bytes(target.read_bytes())
    at = read_header(bad).value_offsets["general.architecture"]
    _rewrite(bad, at + 8, b"qwen9")  # the same length as "qwen2"
    with pytest.raises(UnsupportedModel) as info:
        load_pair(str(bad), None)
    message = str(info.value)
    assert "\n" not in message and "architecture 'qwen9' is not one" in message


def test_other_refusals_are_one_line(gguf_files, tmp_path, tiny_root):
    target, _ = gguf_files("qwen2", "f32")
    hf_target, _ = make_tiny_pair(tiny_root / "qwen2", "qwen2")
    (tmp_path / "text.gguf").write_text("not a model")
    cases = [
        ((str(tmp_path / "text.gguf"), None), "is not a GGUF file"),
        ((str(tmp_path / "missing.gguf"), None), "does not exist"),
        ((str(target), str(hf_target)), "is not a GGUF file, but the target is"),
    ]
    for (t, d), expected in cases:
        with pytest.raises(UnsupportedModel) as info:
            load_pair(t, d)
        assert expected in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UnsupportedModel, match="run on llama.cpp's CPU backend"):
        load_pair(str(target), None, device="cuda")


def test_a_draft_with_another_vocabulary_is_refused(gguf_files, real_vocab):
    target, _ = gguf_files("qwen2", "f32")
    with pytest.raises(ModelLoadError, match="different vocabularies"):
        load_pair(str(target), str(real_vocab.folder / "ggml-vocab-qwen2.gguf"))


def test_the_cli_prints_one_line_and_exits_2_on_an_unsupported_file(gguf_files, tmp_path):
    target, _ = gguf_files("qwen2", "f32")
    bad = tmp_path / "odd-type.gguf"
    bad.write_bytes(target.read_bytes())
    _rewrite(bad, read_header(bad).tensors[0].type_offset, struct.pack("<I", 31))
    source = tmp_path / "x.py"
    source.write_text("def f(x):\n    return x\n")
    proc = subprocess.run([sys.executable, "-m", "specd", "complete", str(source), "--line", "2", "--col", "4",
                           "--model", str(bad)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **GGUF_ON_LLAMACPP})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "odd-type.gguf" in lines[0] and "ggml type 31" in lines[0], proc.stderr


# ---- end to end: the CLI, the daemon ----------------------------------------------------------

def test_specd_complete_with_a_gguf_model(gguf_files, tmp_path):
    target, draft = gguf_files("qwen2", "q8_0")
    source = tmp_path / "x.py"
    source.write_text("import os\n\n\ndef list_files(root):\n    return \n")
    proc = subprocess.run([sys.executable, "-m", "specd", "complete", str(source), "--line", "5", "--col", "11",
                           "--model", str(target), "--draft-model", str(draft), "--max-tokens", "8", "--json"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **GGUF_ON_LLAMACPP})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["via"] == "local" and result["models"]["dtype"] == "gguf Q8_0"
    assert 1 <= len(result["token_ids"]) <= 8 and result["prompt_ids"]


def test_a_gguf_pair_loads_and_completes_without_transformers_model_machinery(gguf_files):
    """No torch weights, so none of transformers' model machinery (``modeling_utils`` and what it
    pulls in: seconds to import), in a fresh interpreter. Read from ``sys.modules``: transformers
    imports its submodules through ``importlib``, which ``python -X importtime`` does not report."""
    target, draft = gguf_files("qwen2", "q8_0")
    code = (
        "import json, sys\n"
        "from specd.engine import CompletionRequest\n"
        "from specd.engine.engine import Engine\n"
        "from specd.engine.options import EngineOptions\n"
        f"engine = Engine(EngineOptions(target={str(target)!r}, draft={str(draft)!r}, forward_backend='llamacpp'))\n"
        "engine.ensure_loaded()\n"
        "result = engine.complete(CompletionRequest(text='def list_files(root):\\n    return ', max_tokens=8))\n"
        "print(json.dumps({'paths': sorted(p.name for p, _ in engine.paths.values()), 'tokens': len(result.token_ids),\n"
        "                  'transformers': sorted(m for m in sys.modules if m.startswith('transformers'))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert loaded["paths"] == ["llamacpp", "llamacpp"] and loaded["tokens"] >= 1
    assert "transformers.modeling_utils" not in loaded["transformers"], loaded["transformers"]


def test_doctor_says_the_target_is_a_gguf_file(gguf_files):
    target, draft = gguf_files("qwen2", "q8_0")
    proc = subprocess.run([sys.executable, "-m", "specd", "doctor", "--model", str(target), "--draft-model", str(draft)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **GGUF_ON_LLAMACPP})
    assert proc.returncode == 0, proc.stderr
    assert "a GGUF file, Q8_0, llama.cpp architecture qwen2, llama.cpp's tokenizer" in proc.stdout
    assert "target forward: llamacpp (llama.cpp on" in proc.stdout and "GGUF Q8_0" in proc.stdout


def test_the_daemon_serves_a_gguf_pair(gguf_files, tmp_path):
    from conftest import SHARED_DAEMON_CONFIG
    from daemon_helpers import DaemonProcess

    target, draft = gguf_files("qwen2", "q8_0")
    config = {**SHARED_DAEMON_CONFIG, "model.target": target, "model.draft": draft,
              "engine.forward_backend": "llamacpp"}
    daemon = DaemonProcess(tmp_path, engine="real", config=config).start(timeout=120)
    try:
        with daemon.client() as client:
            uri = "file:///gguf.py"
            client.open_document(uri, "def f(x):\n    return x\n", version=1)
            result = client.complete(uri=uri, cursor={"line": 1, "character": 12}, options={"max_tokens": 6})
            assert 1 <= len(result["token_ids"]) <= 6 and result["target_forwards"] >= 1
            status = client.status()
        assert status["dtype"] == "gguf Q8_0"
        assert status["models"]["gguf"]["target"]["type"] == "Q8_0"
        assert status["models"]["forward"] == {"target": "llamacpp", "draft": "llamacpp"}
    finally:
        daemon.stop()


# ---- Ollama's models -------------------------------------------------------------------------

def _ollama_tree(root, name: str, tag: str, blob_bytes: bytes, namespace=("registry.ollama.ai", "library")) -> str:
    digest = "ab" * 32
    manifest = root.joinpath("manifests", *namespace, name, tag)
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(blob_bytes)},
    ]}))
    (root / "blobs").mkdir(exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(blob_bytes)
    return digest


def test_an_ollama_name_resolves_to_its_gguf_blob(tmp_path):
    digest = _ollama_tree(tmp_path, "qwen2.5-coder", "1.5b", b"GGUF")
    assert resolve_ollama("qwen2.5-coder:1.5b", tmp_path) == tmp_path / "blobs" / f"sha256-{digest}"
    _ollama_tree(tmp_path / "other", "coder", "latest", b"GGUF", namespace=("registry.ollama.ai", "someone"))
    assert resolve_ollama("someone/coder", tmp_path / "other").name == f"sha256-{digest}"
    for name, expected in (("qwen2.5-coder:7b", "is not pulled here"), ("../x", "expected NAME[:TAG]")):
        with pytest.raises(GgufError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            resolve_ollama(name, tmp_path)
    (tmp_path / "blobs" / f"sha256-{digest}").unlink()
    with pytest.raises(GgufError, match="are missing"):
        resolve_ollama("qwen2.5-coder:1.5b", tmp_path)


def test_an_engine_on_an_ollama_model(gguf_files, tmp_path, monkeypatch, sample_source):
    target, _ = gguf_files("qwen2", "q8_0")
    _ollama_tree(tmp_path, "tiny-coder", "q8", target.read_bytes())
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    engine = gguf_engine("ollama:tiny-coder:q8", prefix_tokens=256)
    result = engine.complete(CompletionRequest(text=sample_source, offset=sample_source.index("    def sell"),
                                               max_tokens=8, token_healing=False))
    slot = LlamaSlot(target, n_ctx=2048, kv_f32=True)
    assert result.token_ids == slot.generate(result.prompt_ids, 8, set(engine.stop_ids)).tokens[:len(result.token_ids)]
    assert engine.stats()["models"]["target"] == "ollama:tiny-coder:q8"


# ---- export ----------------------------------------------------------------------------------

def test_the_clis_export_types_are_the_exporters():
    from specd.cli import GGUF_TYPES

    assert GGUF_TYPES == EXPORT_TYPES


@pytest.mark.parametrize("kind, file_type", [("q4_k_m", "Q4_K_M"), ("bf16", "BF16")])
def test_quantized_exports_load_and_complete(gguf_files, kind, file_type, sample_source):
    target, _ = gguf_files("qwen2", kind)
    header = read_header(target)
    assert header.metadata["general.architecture"] == "qwen2"
    engine = gguf_engine(target, prefix_tokens=256)
    assert engine.stats()["models"]["dtype"] == f"gguf {file_type}"
    result = engine.complete(CompletionRequest(text=sample_source, offset=sample_source.index("    def sell"),
                                               max_tokens=8, token_healing=False))
    assert result.token_ids


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_a_prefill_in_pieces_gives_the_logits_of_one_piece(gguf_files, kind):
    """specd's llama.cpp forward runs a long prefill in pieces of ``BATCH`` tokens, smaller than
    llama.cpp's default (docs/llamacpp.md): ``scripts/prefill-pieces`` times it at several sizes
    and finds the rows of logits identical to the bit, on a Llama file in f32 and Q8_0."""
    target, _ = gguf_files("llama", kind)
    script = Path(__file__).resolve().parent.parent / "scripts" / "prefill-pieces"
    proc = subprocess.run([sys.executable, str(script), str(target), "--tokens", "700", "--pieces", "64,256,700",
                           "--repeats", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tokens"] == 700 and [row["piece"] for row in result["pieces"]] == [64, 256, 700]
    for row in result["pieces"]:
        assert row["identical"] and row["max_abs_diff"] == 0.0 and row["ms"] > 0, row
