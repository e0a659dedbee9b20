"""engine.forward_backend = llamacpp: specd's decoding on llama.cpp's forward, still lossless.

The engine runs every target and draft forward through llama.cpp (contexts made per model as
documents need them, one sequence per document); its output must still be exactly the target's
greedy continuation (checked against plain transformers ``generate()``), with KV reuse across requests, drafts
accepted and rejected, and the least recently used document evicted when the sequences run out.

GELU models (the GPT-2 family, Gemma, GPT-NeoX) stay on torch: llama.cpp's graphs read gelu from
an f16 table, which moves logits enough to flip near-ties (docs/llamacpp.md), so the engine
refuses that forward for them and says why.
"""

from __future__ import annotations

import pytest

from engine_helpers import assert_lossless, make_engine, make_near_draft
from specd.engine import CompletionRequest
from specd.engine.speculation.loop import MERGED_PREFILL
from test_llamacpp import make_gpt2_family_pair, pair_of  # noqa: F401 (pair_of: a fixture)

MAX_TOKENS = 24
GELU_ARCHS = ("gpt2", "gpt_bigcode-mqa", "gpt_bigcode-mha", "gemma", "gpt_neox")


@pytest.fixture(scope="module")
def engine_for(pair_of):
    """arch -> an engine on llama.cpp's forward: its tiny target and a near draft of it. Made in
    the test's body, so the GGUF files go to the test's own $XDG_CACHE_HOME: a module fixture is
    set up before conftest's per-test isolation, and wrote them into the user's cache."""
    made = {}

    def engine(arch):
        if arch not in made:
            target, _ = pair_of(arch)
            near = make_near_draft(target, target.parent / "near-draft")
            made[arch] = make_engine(target, near, prefix_tokens=384, suffix_tokens=128, forward_backend="llamacpp")
        return made[arch]
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "granite", "phi3", "stablelm"])
def test_both_models_run_on_llama_cpp_and_output_is_the_targets(arch, engine_for, sample_source):
    engine = engine_for(arch)
    check = assert_lossless
    assert {role: path.name for role, (path, _) in engine.paths.items()} == {"target": "llamacpp",
                                                                             "draft": "llamacpp"}
    assert engine.stats()["forward"]["target"]["path"] == "llamacpp"
    # a document's first prompt prefills on torch and its K/V are handed to llama.cpp (handoff.py)
    for role in ("target", "draft"):
        assert "prefill on torch's lean forward (K/V handed over" in engine.stats()["forward"][role]["detail"]
    handed = []
    for path, _ in engine.paths.values():
        real = path.torch_prefill.prefill
        path.torch_prefill.prefill = lambda *args, real=real: (handed.append(args[0].shape[1]), real(*args))[1]
    uri = f"file:///llamacpp-{arch}.py"
    text = sample_source
    results = []
    for marker in ("    def sell", "    def to_dict", "class Inventory:"):
        offset = text.index(marker)
        result = engine.complete(CompletionRequest(uri=uri, text=text, offset=offset, max_tokens=MAX_TOKENS,
                                                   stop_at_block_end=False))
        check(engine, result, MAX_TOKENS)
        results.append(result)
    # A keystroke: the same document one character on re-uses the cache and stays lossless.
    offset = text.index("    def to_dict") + 1
    typed = engine.complete(CompletionRequest(uri=uri, text=text, offset=offset, max_tokens=MAX_TOKENS,
                                              stop_at_block_end=False))
    check(engine, typed, MAX_TOKENS)
    assert typed.prefill_reused > 0
    # Near the end of the file a keystroke's few new prompt tokens (the rest of the line and the
    # short suffix) run with the first step, their rows of logits not asked for: every target
    # forward of that request is a decode step.
    near_end = text.index("    print(report(demo))")
    for offset in (near_end, near_end + 1):
        forwards = engine.caches.get(uri).target.forwards
        again = engine.complete(CompletionRequest(uri=uri, text=text, offset=offset, max_tokens=MAX_TOKENS,
                                                  stop_at_block_end=False))
        check(engine, again, MAX_TOKENS)
    assert len(again.prompt_ids) - again.prefill_reused <= MERGED_PREFILL
    assert engine.caches.get(uri).target.forwards - forwards == again.target_forwards
    assert len(handed) == 2 and min(handed) > 300  # target and draft, the first request's whole prompt
    drafted = [r.sources["draft"] for r in results + [typed] if "draft" in r.sources]
    assert sum(s.accepted for s in drafted) > 0  # the near draft is accepted ...
    assert sum(s.proposed - s.accepted for s in drafted) > 0  # ... and rejected, both on llama.cpp


def test_a_document_beyond_the_sequences_evicts_the_least_recent_and_is_served(tiny_pairs, tiny_root, sample_source):
    """A cache budget with room for one target window: the second document's cache finds no
    sequence within the budget, and the path has the cache store evict the least recently used
    document (``CacheStore.reclaim``); no out-of-memory retry."""
    target, _ = tiny_pairs["llama"]
    near = make_near_draft(target, tiny_root / "llama" / "near-draft")
    engine = make_engine(target, near, prefix_tokens=384, suffix_tokens=128, forward_backend="llamacpp",
                         cache_budget_mb=2)
    assert engine.paths["target"][0].sequences == 1
    for name in ("a", "b", "a"):
        result = engine.complete(CompletionRequest(uri=f"file:///{name}.py", text=sample_source,
                                                   offset=sample_source.index("    def to_dict"), max_tokens=8,
                                                   stop_at_block_end=False))
        assert_lossless(engine, result, 8)
    assert engine.oom_retries == 0 and engine.caches.reclaimed == 2
    # what status shows of the caches: the one document left, its sequence's cells in bytes
    target = engine.paths["target"][0]
    largest = engine.caches.stats()["largest"]
    assert [entry["document"] for entry in largest] == ["file:///a.py"]
    assert largest[0]["bytes"] == target.sequence_bytes + engine.paths["draft"][0].sequence_bytes
    assert largest[0]["tokens"] > 0 and target.cells == target.window  # one context left, of one sequence


@pytest.mark.parametrize("arch", GELU_ARCHS)
def test_gelu_models_stay_on_torch_where_llama_cpp_would_not_be_lossless(arch, engine_for, sample_source):
    engine = engine_for(arch)
    for role in ("target", "draft"):
        path, why = engine.paths[role]
        assert path.name == "lean" and "f16 table" in why and "lossless" in why, (role, path.name, why)
    result = engine.complete(CompletionRequest(uri=f"file:///torch-{arch}.py", text=sample_source,
                                               offset=sample_source.index("    def sell"), max_tokens=MAX_TOKENS,
                                               stop_at_block_end=False))
    assert_lossless(engine, result, MAX_TOKENS)


def test_a_model_llama_cpp_cannot_take_stays_on_torch_and_says_why(tmp_path):
    target, draft = make_gpt2_family_pair(tmp_path / "quick", "gpt2", activation_function="quick_gelu")
    engine = make_engine(target, draft, forward_backend="llamacpp")
    path, why = engine.paths["target"]
    assert path.name == "hf"  # torch's choice for a quick_gelu GPT-2 (the lean path runs gelu, silu, relu)
    assert "forward_backend llamacpp unavailable" in why and "activation 'quick_gelu'" in why
