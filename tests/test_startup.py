"""Start-up: one tokenizer load for a pair that shares its tokenizer files, the healing table
from its on-disk cache (equal to a fresh one, rebuilt when the file is bad), what each step
took in the log and in ``specd doctor``, and no torch on the paths that only talk to a daemon."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import torch

from specd.engine import models
from specd.engine.models import load_pair, tokenizer_fingerprint
from specd.engine.speculation.healing import HealingVocabulary, token_texts
from specd.engine.speculation.healing_cache import cache_key, healing_vocabulary, read_texts, write_texts

LARGE_VOCAB = 150_000  # about Qwen2's 151,936: the size whose decoding made start-ups slow


def _large_byte_level_tokenizer(size: int):
    """A byte-level BPE of ``size`` entries (GPT-2's byte alphabet, then seeded random byte
    strings: ASCII pieces of words, runs of spaces, and pieces of multi-byte UTF-8 characters, which
    decode to U+FFFD on their own), with two special tokens."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _bytes_to_unicode()
    assert set(byte_char.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {byte_char[b]: b for b in range(256)}
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz_()."
    while len(vocab) < size - 2:
        kind = rng.random()
        if kind < 0.6:
            data = ((" " if rng.random() < 0.5 else "") + "".join(rng.choices(letters, k=rng.randint(2, 8)))).encode()
        elif kind < 0.75:
            data = b"\n" * rng.randint(0, 1) + b" " * rng.randint(1, 16)
        else:
            data = "".join(rng.choice("éüñ你好🎉—") for _ in range(rng.randint(1, 2))).encode()
            data = data[: rng.randint(1, len(data))]  # often cut inside a character
        vocab.setdefault("".join(byte_char[b] for b in data), len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    vocab["<|fim_prefix|>"] = len(vocab)
    backend = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|fim_prefix|>"])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(kept)
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + len(chars) - 188)
    return dict(zip(kept, map(chr, chars)))


@pytest.fixture(scope="module")
def large_tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("large-tokenizer")
    _large_byte_level_tokenizer(LARGE_VOCAB).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def large_tokenizer(large_tokenizer_dir):
    return models.load_tokenizer(str(large_tokenizer_dir))


@pytest.fixture(scope="module")
def large_texts(large_tokenizer):
    return token_texts(large_tokenizer, len(large_tokenizer))


def _same_table(a: HealingVocabulary, b: HealingVocabulary, rests) -> None:
    assert a.vocab_size == b.vocab_size and a.texts == b.texts
    assert a._sorted_texts == b._sorted_texts and a._sorted_ids.tolist() == b._sorted_ids.tolist()
    for rest in rests:
        assert torch.equal(a.allowed(rest), b.allowed(rest)), rest


RESTS = ["\n        ", "    ", " ", " se", "sel", "(", "é", "你", "x"]


def test_the_large_tokenizer_is_byte_level_with_partial_characters(large_tokenizer, large_texts):
    table = HealingVocabulary(large_tokenizer, len(large_tokenizer), large_texts)
    assert len(large_tokenizer) == LARGE_VOCAB
    assert large_tokenizer.decode(large_tokenizer.encode("    def x(self):", add_special_tokens=False)) == "    def x(self):"
    assert sum(1 for t in table.texts if not t) > 100  # UTF-8 pieces and specials: never allowed while healing
    assert table.allowed("        ").numel() > 0


@pytest.mark.parametrize("which", ["large", "demo"])
def test_cached_healing_table_equals_a_fresh_one(which, large_tokenizer, large_tokenizer_dir, tmp_path):
    tmp_path = tmp_path / "healing"
    if which == "large":
        tokenizer, folder = large_tokenizer, large_tokenizer_dir
    else:
        from specd.demo import DEMO_DIR

        folder = DEMO_DIR / "target"
        tokenizer = models.load_tokenizer(str(folder))
    size = len(tokenizer) + 7  # an embedding wider than the tokenizer, as real models have
    fingerprint = tokenizer_fingerprint(str(folder))
    fresh = HealingVocabulary(tokenizer, size)
    built, source = healing_vocabulary(tokenizer, size, fingerprint, tmp_path)
    assert source == "decoded, cached" and len(list(tmp_path.glob("*.json"))) == 1
    cached, source = healing_vocabulary(tokenizer, size, fingerprint, tmp_path)
    assert source == "cache"
    _same_table(fresh, built, RESTS)
    _same_table(fresh, cached, RESTS)
    for healed in (" se", "\n        "):
        assert cached.remaining(healed, []) == fresh.remaining(healed, [])


@pytest.mark.parametrize("damage", ["truncated", "edited", "garbage", "empty", "other key"])
def test_a_bad_cache_file_is_rebuilt_never_trusted(damage, large_tokenizer, large_tokenizer_dir, large_texts,
                                                   tmp_path):
    tmp_path = tmp_path / "healing"
    size = len(large_tokenizer)
    fingerprint = tokenizer_fingerprint(str(large_tokenizer_dir))
    key = cache_key(large_tokenizer, size, fingerprint)
    path = tmp_path / f"{key[:32]}.json"  # where healing_vocabulary writes it
    write_texts(path, key, large_texts)
    assert read_texts(path, key, size) == large_texts
    data = path.read_bytes()
    header, body = data.split(b"\n", 1)
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "edited":  # a whole-looking file whose texts changed: the checksum says no
        texts = json.loads(body)
        first = next(i for i, t in enumerate(texts) if t == " ")
        texts[first] = "  "
        path.write_bytes(header + b"\n" + json.dumps(texts, ensure_ascii=False).encode())
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a whole file for another tokenizer, under this one's name
        fields = json.loads(header)
        fields["key"] = "0" * 64
        path.write_bytes(json.dumps(fields).encode() + b"\n" + body)
    assert read_texts(path, key, size) is None
    rebuilt, source = healing_vocabulary(large_tokenizer, size, fingerprint, tmp_path)
    assert source == "decoded, cached"
    assert rebuilt.texts == large_texts
    assert read_texts(path, key, size) == large_texts  # written again, whole
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_unwritable_cache_still_serves(large_tokenizer, large_tokenizer_dir, large_texts, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    fingerprint = tokenizer_fingerprint(str(large_tokenizer_dir))
    table, source = healing_vocabulary(large_tokenizer, len(large_tokenizer), fingerprint, blocker / "healing")
    assert source == "decoded" and table.texts == large_texts


def test_the_cache_key_follows_the_tokenizer_files_and_the_size(large_tokenizer):
    key = cache_key(large_tokenizer, LARGE_VOCAB, "a" * 64)
    assert key == cache_key(large_tokenizer, LARGE_VOCAB, "a" * 64)
    assert key != cache_key(large_tokenizer, LARGE_VOCAB + 1, "a" * 64)
    assert key != cache_key(large_tokenizer, LARGE_VOCAB, "b" * 64)


def _count_tokenizer_loads(monkeypatch) -> list[str]:
    loads: list[str] = []
    real = models.load_tokenizer

    def counting(name, trust_remote_code=False):
        loads.append(name)
        return real(name, trust_remote_code)

    monkeypatch.setattr(models, "load_tokenizer", counting)
    return loads


def test_a_pair_sharing_tokenizer_files_loads_one_tokenizer(llama_pair, monkeypatch, tmp_path):
    target, draft = llama_pair
    assert tokenizer_fingerprint(str(target)) == tokenizer_fingerprint(str(draft)) is not None
    loads = _count_tokenizer_loads(monkeypatch)
    pair = load_pair(str(target), str(draft), "cpu", "float32")
    assert loads == [str(target)]
    assert pair.tokenizer_hash == tokenizer_fingerprint(str(target))
    assert list(pair.startup.seconds) == ["tokenizer", "draft tokenizer check", "target model", "draft model"]


def test_different_files_of_the_same_vocabulary_are_compared(llama_pair, monkeypatch, tmp_path):
    """A draft whose tokenizer files differ (here a slow-tokenizer-only copy of the same
    vocabulary) is loaded and its vocabulary compared; a different vocabulary is refused."""
    target, draft = llama_pair
    copy = tmp_path / "draft"
    shutil.copytree(draft, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["model_max_length"] = 12345  # same vocabulary, other bytes
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_fingerprint(str(copy)) != tokenizer_fingerprint(str(target))
    loads = _count_tokenizer_loads(monkeypatch)
    load_pair(str(target), str(copy), "cpu", "float32")
    assert loads == [str(target), str(copy)]

    other = tmp_path / "other"
    shutil.copytree(draft, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    added = tok["added_tokens"][-1]  # a special token renamed: one entry of the vocabulary differs
    tok["model"]["vocab"].pop(added["content"], None)
    added["content"] += "x"
    tok["model"]["vocab"][added["content"]] = added["id"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(models.ModelLoadError, match="different tokenizers"):
        load_pair(str(target), str(other), "cpu", "float32")


def test_engine_start_up_reports_its_steps_and_reuses_the_healing_cache(llama_pair, caplog):
    from specd.engine.engine import Engine
    from specd.engine.options import EngineOptions

    target, draft = llama_pair
    options = EngineOptions(target=str(target), draft=str(draft), device="cpu", dtype="float32",
                            forward_backend="torch")
    with caplog.at_level("INFO", logger="specd.engine.engine"):
        first = Engine(options)
        first.ensure_loaded()
        second = Engine(options)
        second.ensure_loaded()
    assert (first.healing_source, second.healing_source) == ("decoded, cached", "cache")
    assert second.healing.texts == HealingVocabulary(second.pair.tokenizer, second.vocab_size).texts
    steps = list(second.startup.seconds)
    assert steps[:2] == ["tokenizer", "draft tokenizer check"]
    assert {"healing table", "forward paths", "forward costs"} <= set(steps)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: ")]
    assert len(lines) == 2 and "healing table" in lines[1] and lines[1].endswith("healing table cache)")
    assert set(second.stats()["startup_s"]) == set(steps)


def test_doctor_prints_the_start_up_by_step(llama_pair):
    target, draft = llama_pair
    proc = subprocess.run([sys.executable, "-m", "specd", "doctor", "--model", str(target), "--draft-model", str(draft)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    start = out.index("  start-up, seconds by step:")
    steps = [line.split()[0] for line in out[start + 1:] if line.startswith("    ")]
    assert steps[:3] == ["imports", "tokenizer", "draft"]
    assert {"healing", "forward", "total"} <= set(steps)
    imports = next(line for line in out[start + 1:] if line.strip().startswith("imports"))
    assert "torch" in imports and "transformers" in imports and "specd.engine.engine" in imports
    healing = next(line for line in out[start + 1:] if line.strip().startswith("healing table"))
    assert healing.endswith(("(decoded, cached)", "(cache)"))


# A command that only talks to a running daemon never needs these.
HEAVY = ("torch", "transformers", "tokenizers", "numpy", "safetensors", "specd.engine.engine", "specd.engine.models",
         "specd.daemon.server")


def _imported(stderr: str) -> set[str]:
    """Module names ``python -X importtime`` reported importing."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", ["complete", "status"])
def test_commands_that_talk_to_the_daemon_import_no_engine(command, fake_daemon, tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f(x):\n    return x\n", encoding="utf-8")
    args = {"complete": ["complete", str(source), "--line", "2", "--col", "4", "--no-spawn", "--json"],
            "status": ["status", "--json"]}[command]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "specd", *args], capture_output=True,
                          text=True, timeout=60, env=fake_daemon.env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = json.loads(proc.stdout)
    if command == "complete":
        assert answer["via"] == "daemon"
    imported = _imported(proc.stderr)
    assert "specd.cli" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY or m in HEAVY)
    assert not heavy, heavy
