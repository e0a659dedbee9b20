"""The embedded demo pair: the shipped weights load and complete code; the trainer runs end to end."""

from __future__ import annotations

import argparse
import json
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specd.demo import DEMO_DIR, demo_pair_paths  # noqa: E402
from specd.demo.heldout import HELDOUT_MODULES, heldout_files, stdlib_dir, training_files  # noqa: E402
from specd.demo.data import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, SPECIAL_TOKENS  # noqa: E402

# Shipped-size bounds from the design: small enough to live in the wheel.
TARGET_PARAMS = (6e6, 10e6)
DRAFT_PARAMS = (1e6, 2e6)
MAX_PAIR_MB = 25
GENERATE_TOKENS = 24

ROUND_TRIP_TEXTS = [
    "",
    " ",
    "\n",
    "  leading spaces",
    "\n\n\tdef f(a, b):\r\n        return a  +  b  \n",
    "emoji 🎉👍🏽 and CJK 日本語, café, naïve — «quotes»",
    "x = 'don't' ; y=\"<|fim_prefix|>\"  # special token text inside code",
    "\u00a0\u3000trailing whitespace\t \n  ",
]


def _load(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


def _fim_prompt(text: str, tokenizer, budget: int = 900) -> tuple[list[int], str]:
    """PSM prompt with the cursor after the indentation of a line mid-way through text."""
    lines = text.splitlines(keepends=True)
    row = next(i for i in range(len(lines) // 2, len(lines)) if lines[i].startswith("        ") and lines[i].strip())
    indent = len(lines[row]) - len(lines[row].lstrip(" "))
    prefix = "".join(lines[:row]) + lines[row][:indent]
    suffix = "".join(lines[row + 1:])
    prefix_ids = tokenizer.encode(prefix)[-(budget * 3 // 4):]
    suffix_ids = tokenizer.encode(suffix)[:budget // 4]
    ids = tokenizer.convert_tokens_to_ids
    return [ids(FIM_PREFIX), *prefix_ids, ids(FIM_SUFFIX), *suffix_ids, ids(FIM_MIDDLE)], lines[row]


def _greedy_middle(model, tokenizer, prompt: list[int]) -> str:
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=GENERATE_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)


def _looks_like_python(text: str) -> bool:
    printable = sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text)
    return bool(text.strip()) and printable >= 0.9 * len(text) and re.search(r"[A-Za-z_]\w*", text) is not None


@pytest.fixture(scope="module")
def shipped():
    paths = demo_pair_paths()
    assert paths is not None, f"the demo pair is not trained: run `specd train-demo` (writes {DEMO_DIR})"
    (target, target_tok), (draft, draft_tok) = _load(paths[0]), _load(paths[1])
    return {"paths": paths, "target": target, "draft": draft, "target_tok": target_tok, "draft_tok": draft_tok}


def test_shipped_pair_is_small_qwen2_with_tied_embeddings(shipped):
    for name, bounds in (("target", TARGET_PARAMS), ("draft", DRAFT_PARAMS)):
        model = shipped[name]
        assert model.config.model_type == "qwen2"
        assert model.config.tie_word_embeddings
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
        params = sum(p.numel() for p in model.parameters())
        assert bounds[0] <= params <= bounds[1], (name, params)
    size = sum(p.stat().st_size for d in shipped["paths"] for p in d.rglob("*") if p.is_file())
    assert size < MAX_PAIR_MB * 1e6


def test_shipped_pair_shares_one_tokenizer(shipped):
    target_tok, draft_tok = shipped["target_tok"], shipped["draft_tok"]
    assert target_tok.get_vocab() == draft_tok.get_vocab()
    target_dir, draft_dir = shipped["paths"]
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()
    assert shipped["target"].config.vocab_size == shipped["draft"].config.vocab_size >= len(target_tok)


def test_special_tokens_are_single_tokens(shipped):
    tok = shipped["target_tok"]
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    ids = set()
    for special in SPECIAL_TOKENS:
        encoded = tok.encode(special)
        assert encoded == [tok.convert_tokens_to_ids(special)], special
        ids.add(encoded[0])
    assert len(ids) == len(SPECIAL_TOKENS)
    assert tok.encode("x = 1") == tok("x = 1")["input_ids"]  # no BOS/EOS added


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(shipped, text):
    tok = shipped["target_tok"]
    assert tok.decode(tok.encode(text)) == text


def test_specd_json_declares_demo_family_with_spm(shipped):
    for model_dir in shipped["paths"]:
        meta = json.loads((model_dir / "specd.json").read_text())
        assert meta["fim_family"] == "demo" and meta["spm"] is True
        assert (model_dir / "generation_config.json").is_file()


def test_fim_completion_on_heldout_file_looks_like_python(shipped):
    path = next(p for p in heldout_files() if p.name == "textwrap.py")
    prompt, _original = _fim_prompt(path.read_text(encoding="utf-8"), shipped["target_tok"])
    for name in ("target", "draft"):
        middle = _greedy_middle(shipped[name], shipped["target_tok"], prompt)
        assert _looks_like_python(middle), (name, middle)


def test_heldout_modules_are_kept_out_of_training():
    root = stdlib_dir()
    assert 10 <= len(HELDOUT_MODULES) <= 16
    assert [p.name for p in heldout_files()] == [m for m in HELDOUT_MODULES if (root / m).is_file()]
    train = training_files()
    assert len(train) > 100
    for path in train:
        rel = path.relative_to(root)
        assert not (len(rel.parts) == 1 and rel.name in HELDOUT_MODULES), rel
        assert not {"test", "idlelib", "tkinter", "lib2to3", "site-packages"} & set(rel.parts), rel


def test_training_smoke_run_writes_a_loadable_pair(tmp_path, monkeypatch):
    from specd.demo.train import run_train_demo

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # restored afterwards; the trainer would set it
    threads = torch.get_num_threads()
    args = argparse.Namespace(out=str(tmp_path), minutes=0.05, seed=0, preset="tiny")
    try:
        assert run_train_demo(args, None) == 0
    finally:
        torch.set_num_threads(threads)
    paths = demo_pair_paths(tmp_path)
    assert paths is not None
    (target, tok), (draft, draft_tok) = _load(paths[0]), _load(paths[1])
    assert tok.get_vocab() == draft_tok.get_vocab()
    assert "Held-out results" in (tmp_path / "TRAINING.md").read_text()
    prompt = tok.encode("def add(a, b):\n    return")
    for model in (target, draft):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        assert out.shape[1] > len(prompt)
