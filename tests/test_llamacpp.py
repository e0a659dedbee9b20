"""llama.cpp beside specd, for real: GGUF files written from our pairs, read by llama-cpp-python.

The writer must keep token ids (llama.cpp tokenizes as transformers does, special FIM tokens
included) and the model (llama.cpp's logits match transformers' on the same ids, Q/K rotary
permutation and grouped-query heads included); the bench's llama.cpp peers must write exactly
hf_greedy's tokens and re-use their slot's cache like llama-server's ``cache_prompt``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench_helpers import SHORT_PROMPTS, bench_cli
from specd.demo import demo_pair_paths
from specd.llamacpp.export import (ExportError, SAMPLE_TEXT, cached_gguf, detect_pre_tokenizer, export_gguf,
                                   loaded_tokenizer_json, verify_tokenizer)
from specd.llamacpp.runtime import LlamaSlot

FIM_TEXT = "<|fim_prefix|>def add(a, b):\n    return<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>"


@pytest.fixture(scope="module")
def demo_pair():
    paths = demo_pair_paths()
    assert paths is not None, "the embedded demo pair ships with the package"
    return paths


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_computes_what_transformers_computes(arch, tiny_pairs, gguf_dir):
    """Every position's logits of a FIM prompt agree (llama.cpp keeps its KV cache in f16, so
    to within 1% of the logits' range) and every argmax is the same."""
    target = tiny_pairs[arch][0]
    path = cached_gguf(target, directory=gguf_dir)  # written, then its tokenization checked
    tokenizer, model = _hf(target)
    ids = tokenizer.encode(FIM_TEXT)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].numpy()
    ours = LlamaSlot(path, n_ctx=256)._decode(ids, len(ids))
    assert ours.shape == reference.shape
    assert np.abs(ours - reference).max() <= 0.01 * np.abs(reference).max()
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


def test_tokenization_is_the_same_on_both_pairs_special_tokens_included(demo_pair, gguf_dir):
    from transformers import AutoTokenizer

    from specd.llamacpp.runtime import load_llama

    target = demo_pair[0]
    path = export_gguf(target, gguf_dir / "demo.gguf").path
    verify_tokenizer(path, target, [SAMPLE_TEXT, FIM_TEXT, "x = 1\n        \n\tself.a  =  b\r\n"])
    ids = load_llama(path, n_ctx=64).tokenize(FIM_TEXT.encode(), add_bos=False, special=True)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|fim_prefix|>")  # one id, not its characters
    assert ids == tokenizer.encode(FIM_TEXT)


def test_pre_tokenizers_are_recognised_or_named_in_the_error(demo_pair, tiny_pairs):
    assert detect_pre_tokenizer(loaded_tokenizer_json(demo_pair[0])) == "qwen2"
    assert detect_pre_tokenizer(loaded_tokenizer_json(tiny_pairs["llama"][0])) == "gpt-2"  # plain ByteLevel
    llama3 = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                                               "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
                                               "\\s+(?!\\S)|\\s+"}},
        {"type": "ByteLevel", "use_regex": False}]}}
    assert detect_pre_tokenizer(llama3) == "llama-bpe"
    odd = {"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\w+|\\s+"}}}
    with pytest.raises(ExportError, match="--pre-tokenizer"):
        detect_pre_tokenizer(odd)


def test_unsupported_architecture_is_one_clear_error(tiny_pairs, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="architecture 'gpt2' is not exported"):
        export_gguf(tiny_pairs["gpt2"][0], out / "x.gguf")
    assert not out.exists() or not list(out.iterdir())  # nothing half-written left behind


def test_greedy_equals_hf_and_the_slot_reuses_its_prefix(demo_pair, gguf_dir):
    """The trained demo target: llama.cpp's greedy tokens are HF's, with or without prompt
    lookup; a second request sharing the first one's prefix computes only the rest and writes
    what a cold slot writes."""
    import inspect

    target = demo_pair[0]
    path = cached_gguf(target, directory=gguf_dir)
    tokenizer, model = _hf(target)
    source = inspect.getsource(inspect.getmembers)
    prefix, suffix = source[:300], source[300:600]
    ids = tokenizer.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>")
    later = tokenizer.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}\n# more\n<|fim_middle|>")

    def hf(prompt):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=0,
                             pad_token_id=0)[0, len(prompt):].tolist()
        return out[:-1] if out and out[-1] == 0 else out

    for lookup in (False, True):
        slot = LlamaSlot(path, n_ctx=1024, lookup=lookup)
        first = slot.generate(ids, 24, {0})
        assert first.tokens == hf(ids) and first.tokens
        assert first.prefill_reused == 0
        second = slot.generate(later, 24, {0})
        shared = next(i for i, (a, b) in enumerate(zip(ids, later)) if a != b)
        assert second.prefill_reused == shared
        assert second.prefill_computed == len(later) - shared
        assert second.tokens == hf(later) == LlamaSlot(path, n_ctx=1024).generate(later, 24, {0}).tokens
        again = slot.generate(later, 24, {0})  # the whole prompt held: one token still runs
        assert again.prefill_reused == len(later) - 1 and again.tokens == second.tokens
        if lookup:
            assert first.drafted > 0


def test_a_healing_constraint_binds_the_first_tokens(demo_pair, gguf_dir):
    """What token healing asks of every method: the first token's text must start with the cut
    text. Here the cut text is a space the model would not write first on its own."""
    target = demo_pair[0]
    path = cached_gguf(target, directory=gguf_dir)
    tokenizer, _ = _hf(target)
    ids = tokenizer.encode("<|fim_prefix|>def f(x):\n    return x<|fim_suffix|>\n<|fim_middle|>")
    free = LlamaSlot(path, n_ctx=256).generate(ids, 4, {0})
    wanted = "  +"
    allowed = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) and
               (wanted.startswith(tokenizer.decode([i])) or tokenizer.decode([i]).startswith(wanted))]
    bound = LlamaSlot(path, n_ctx=256).generate(ids, 4, {0}, constraint=lambda out: allowed if not out else None)
    assert bound.tokens and bound.tokens[0] in allowed
    assert free.tokens[:1] != bound.tokens[:1]


@pytest.mark.slow
def test_bench_states_specd_against_llama_cpp(monkeypatch, demo_pair):
    """The bench's llama.cpp peers on the demo pair: outputs identical to hf_greedy's, prompt
    reuse on edit replay, ratios and the llama.cpp goal in the report."""
    for name, value in SHORT_PROMPTS.items():
        monkeypatch.setenv(name, value)
    code, out, err = bench_cli("--workloads", "edit_replay", "--limit", "2", "--max-tokens", "16",
                               "--methods", "hf_greedy,llamacpp,llamacpp_lookup,specd,specd_llamacpp",
                               "--no-forward-costs",
                               "--json")
    assert code == 0, err
    report = json.loads(out)
    methods = report["workloads"]["edit_replay"]["methods"]
    for name in ("llamacpp", "llamacpp_lookup", "specd_llamacpp"):
        assert methods[name]["identical"] and methods[name]["matched_nonempty"] > 0
        assert methods[name]["prefill_reused_fraction_warm"] > 0.5
    assert methods["llamacpp_lookup"]["acceptance"]["llamacpp_lookup"]["proposed"] > 0
    assert methods["specd"]["speedup_vs"]["llamacpp"] > 0
    assert any(g["goal"] == "specd speedup vs llamacpp" for g in report["goals"])
    assert report["skipped_methods"] == {}


def test_bench_skips_llama_cpp_peers_for_a_model_it_cannot_convert(tiny_pairs, sample_source, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "m.py").write_text(sample_source)
    code, out, err = bench_cli("--workloads", "line", "--limit", "1", "--max-tokens", "4", "--methods",
                               "hf_greedy,llamacpp,specd,specd_llamacpp", "--no-forward-costs", "--json",
                               pair=tiny_pairs["gpt2"], corpus=corpus)
    assert code == 0, err
    report = json.loads(out)
    assert "architecture 'gpt2' is not exported" in report["skipped_methods"]["llamacpp"]
    assert "llamacpp" not in report["workloads"]["line"]["methods"]
    assert "architecture 'gpt2' is not exported" in report["skipped_methods"]["specd_llamacpp"]
