"""llama.cpp beside specd, for real: GGUF files written from our pairs, read by llama-cpp-python.

The writer must keep token ids (llama.cpp tokenizes as transformers does, special FIM tokens
included) and the model (llama.cpp's logits match transformers' on the same ids, Q/K rotary
permutation and grouped-query heads included, and the GPT-2 family's Conv1D weights, fused and
per-head q/k/v, multi-query heads and attention scales); the bench's llama.cpp peers must write exactly
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
from tiny import make_tokenizer

FIM_TEXT = "<|fim_prefix|>def add(a, b):\n    return<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>"


# The GPT-2 family as llama.cpp's gpt2 and starcoder serve it: name -> (model_type, config overrides).
GPT2_FAMILY = {
    "gpt2": ("gpt2", {}),
    "gpt2-layer-scaled": ("gpt2", {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True}),
    "gpt_bigcode-mqa": ("gpt_bigcode", {"multi_query": True}),
    "gpt_bigcode-mha": ("gpt_bigcode", {"multi_query": False}),
}


def make_gpt2_family_pair(root, model_type: str, **overrides):
    """A tiny gpt2 or gpt_bigcode target (4 layers) and draft (1 layer) on tests/tiny.py's
    tokenizer. LayerNorm weights start at 1 and biases at 0: they are spread out, so a norm or a
    bias llama.cpp misread would show in the logits."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPTBigCodeConfig

    tokenizer = make_tokenizer()
    config_cls = {"gpt2": GPT2Config, "gpt_bigcode": GPTBigCodeConfig}[model_type]
    for name, hidden, layers, seed in (("target", 64, 4, 1), ("draft", 32, 1, 2)):
        out = root / name
        if (out / "config.json").exists():
            continue
        torch.manual_seed(seed)
        config = config_cls(vocab_size=len(tokenizer), n_embd=hidden, n_layer=layers, n_head=4, n_positions=1024,
                            initializer_range=0.4, bos_token_id=0, eos_token_id=0, **overrides)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for key, param in model.named_parameters():
                if ".ln_" in key or key.endswith("bias"):
                    param.normal_(1.0 if key.endswith("weight") else 0.0, 0.3)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def pair_of(tiny_pairs, tiny_root):
    """arch -> (target, draft): the session's tiny pairs, and the GPT-2 family's built here."""
    def pair(arch):
        if arch in GPT2_FAMILY:
            model_type, overrides = GPT2_FAMILY[arch]
            return make_gpt2_family_pair(tiny_root / "llamacpp" / arch, model_type, **overrides)
        return tiny_pairs[arch]
    return pair


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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "granite", "gpt_neox", "phi3", "stablelm", *GPT2_FAMILY])
def test_llama_cpp_computes_what_transformers_computes(arch, pair_of, gguf_dir):
    """Every position's logits of a FIM prompt agree (llama.cpp keeps its KV cache in f16, and
    runs GPT-2's gelu from an f16 table, so to within 1% of the logits' range) and every argmax
    is the same. The prompt's ids are llama.cpp's too, FIM tokens as single ids."""
    target = pair_of(arch)[0]
    path = cached_gguf(target, directory=gguf_dir)  # written, then its tokenization checked
    verify_tokenizer(path, target, [FIM_TEXT])
    tokenizer, model = _hf(target)
    ids = tokenizer.encode(FIM_TEXT)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].numpy()
    ours = LlamaSlot(path, n_ctx=256)._decode(ids, len(ids))
    assert ours.shape == reference.shape
    # StableLM's tiny pair: its LayerNorms amplify the f16 rounding of the KV cache to 1.3% of
    # the logits' range at one position here (0.2-0.4% elsewhere), argmaxes all equal
    tolerance = 0.02 if arch == "stablelm" else 0.01
    assert np.abs(ours - reference).max() <= tolerance * np.abs(reference).max()
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


def test_the_cache_keeps_one_file_per_model_and_replaces_an_older_export(pair_of, tmp_path):
    """Weights saved again (a new mtime) make a new file, and the older one of the same model
    directory goes; another model's file stays."""
    import os
    import shutil

    llama, qwen = pair_of("llama")[0], pair_of("qwen2")[0]
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    cache = tmp_path / "cache"
    first, other = cached_gguf(model, directory=cache), cached_gguf(qwen, directory=cache)
    assert cached_gguf(model, directory=cache) == first  # the same weights: the same file, not rewritten
    weights = next(model.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = cached_gguf(model, directory=cache)
    assert second != first and not first.exists() and second.exists() and other.exists()
    assert sorted(cache.glob("*.gguf")) == sorted([second, other])


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


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    from transformers import OPTConfig

    model_dir = tmp_path / "opt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(OPTConfig().to_dict()))
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="architecture 'opt' is not exported"):
        export_gguf(model_dir, out / "x.gguf")
    assert not out.exists() or not list(out.iterdir())  # nothing half-written left behind


@pytest.mark.parametrize(("config", "refused"), [
    ({"model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 4096}, True),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True}, True),
    ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}, False),  # Qwen2.5's configs
    ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 4096}, False),  # never binds
])
def test_a_sliding_window_llama_cpp_would_not_apply_is_refused(config, refused):
    from specd.llamacpp.export import _shape

    config = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128} | config
    if refused:
        with pytest.raises(ExportError, match="sliding window of 16 tokens is not exported"):
            _shape(config, config["model_type"])
    else:
        assert _shape(config, config["model_type"]).layers == 2


def test_what_llama_cpp_s_gpt2_graph_cannot_run_is_one_clear_error(tmp_path):
    """llama.cpp's gpt2 and starcoder graphs run gelu, decoder-only."""
    with pytest.raises(ExportError, match="activation 'relu' is not exported"):
        export_gguf(make_gpt2_family_pair(tmp_path / "relu", "gpt2", activation_function="relu")[0],
                    tmp_path / "out" / "x.gguf")
    with pytest.raises(ExportError, match="cross-attention is not exported"):
        export_gguf(make_gpt2_family_pair(tmp_path / "cross", "gpt_bigcode", add_cross_attention=True,
                                          multi_query=False)[0], tmp_path / "out" / "y.gguf")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


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
        slot.forget()  # the bench's peer, when the document it holds closes
        cold = slot.generate(later, 24, {0})
        assert cold.prefill_reused == 0 and cold.prefill_computed == len(later) and cold.tokens == second.tokens
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
    code, out, err = bench_cli("--model", "demo", "--workloads", "edit_replay", "--limit", "2", "--max-tokens", "16",
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


def test_the_bench_peer_forgets_a_closed_documents_prompt():
    """The bench warms each method up on the first completion's own text, then closes that
    document: llama.cpp's one slot must not keep it, or the first measured completion alone
    would find its whole prompt cached there (and cold everywhere else)."""
    from specd.bench.peers import LlamaCppMethod

    class Slot:
        forgotten = 0

        def forget(self):
            self.forgotten += 1

    method = object.__new__(LlamaCppMethod)
    method.slot, method._held_doc = Slot(), "warmup"
    method.close_document("other")
    assert method.slot.forgotten == 0  # another document's close leaves the slot alone
    method.close_document("warmup")
    assert method.slot.forgotten == 1 and method._held_doc is None


@pytest.mark.parametrize("arch", ["gpt2", "gpt_bigcode-mqa", "gpt_bigcode-mha"])
def test_bench_runs_the_llama_cpp_peers_on_the_gpt2_family(arch, pair_of, sample_source, tmp_path):
    """GPT-2 and StarCoder-style pairs: llama.cpp's greedy (plain, with prompt lookup) writes
    hf_greedy's tokens. One request each: llama.cpp runs these graphs' gelu from an f16 table,
    which moves a tiny random model's logits by up to ~0.01, and the random gpt2 pair's second
    line request meets a near-tie (top two 0.007 apart) that it flips; the logits test above
    bounds the difference everywhere. specd_llamacpp is skipped, saying why: specd's own
    decoding stays on torch for them, where it is lossless."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "m.py").write_text(sample_source)
    code, out, err = bench_cli("--workloads", "line", "--limit", "1", "--max-tokens", "16", "--methods",
                               "hf_greedy,llamacpp,llamacpp_lookup,specd_llamacpp", "--no-forward-costs", "--json",
                               pair=pair_of(arch), corpus=corpus)
    assert code == 0, err
    report = json.loads(out)
    assert list(report["skipped_methods"]) == ["specd_llamacpp"]
    assert "f16 table" in report["skipped_methods"]["specd_llamacpp"]
    methods = report["workloads"]["line"]["methods"]
    for name in ("llamacpp", "llamacpp_lookup"):
        assert methods[name]["identical"] and methods[name]["matched_nonempty"] > 0, name


def test_bench_skips_llama_cpp_peers_for_a_model_it_cannot_convert(sample_source, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "m.py").write_text(sample_source)
    pair = make_gpt2_family_pair(tmp_path / "relu", "gpt2", activation_function="relu")
    code, out, err = bench_cli("--workloads", "line", "--limit", "1", "--max-tokens", "4", "--methods",
                               "hf_greedy,llamacpp,specd,specd_llamacpp", "--no-forward-costs", "--json",
                               pair=pair, corpus=corpus)
    assert code == 0, err
    report = json.loads(out)
    assert "activation 'relu' is not exported" in report["skipped_methods"]["llamacpp"]
    assert "llamacpp" not in report["workloads"]["line"]["methods"]
    assert "activation 'relu' is not exported" in report["skipped_methods"]["specd_llamacpp"]
