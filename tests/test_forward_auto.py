"""engine.forward_backend = auto (the default): each model on whichever forward, torch's or
llama.cpp's, a few forwards timed at load say decodes faster; torch with the reason where
llama.cpp's cannot serve the model; the prefill where a second measurement says; the choice
kept between loads, and said by ``specd doctor`` and ``status``.

The choice logic is tested on injected costs (no clock); one real load checks that auto builds
a valid path whose output is the target's own, whichever won."""

from __future__ import annotations

import pytest

from engine_helpers import assert_lossless, make_engine, make_near_draft
from specd.daemon.commands import format_status
from specd.engine import CompletionRequest
from specd.engine.forward import auto
from specd.engine.forward.auto import DecodeCosts, decide
from test_llamacpp import make_gpt2_family_pair

MAX_TOKENS = 24


def test_the_faster_decode_wins_and_a_tie_stays_on_torch():
    fast, slow = DecodeCosts(1.9, 3.0), DecodeCosts(2.6, 4.1)
    chosen = decide(torch_costs=slow, llamacpp_costs=fast, torch_name="lean")
    assert chosen.backend == "llamacpp"
    assert chosen.why == ("auto: llama.cpp's forward measured faster: llamacpp step 1.90 + 4-token verify 3.00 ms "
                          "vs lean step 2.60 + 4-token verify 4.10 ms")
    assert decide(torch_costs=fast, llamacpp_costs=slow, torch_name="lean").backend == "torch"
    assert decide(torch_costs=fast, llamacpp_costs=fast, torch_name="hf").backend == "torch"  # torch also runs trees
    # the sum decides: a cheaper step does not win against a dearer verify
    assert decide(DecodeCosts(2.0, 3.0), DecodeCosts(1.5, 4.0), "lean").backend == "torch"
    draft = decide(DecodeCosts(0.75), DecodeCosts(0.40), "lean")  # a draft model: steps only
    assert draft.backend == "llamacpp" and "llamacpp step 0.40 ms vs lean step 0.75 ms" in draft.why


def test_a_model_llama_cpp_cannot_serve_exactly_stays_on_torch_unmeasured(tiny_pairs, monkeypatch):
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured a model llama.cpp cannot serve")

    monkeypatch.setattr(auto, "_measure", no_measuring)
    engine = make_engine(*tiny_pairs["gpt2"], forward_backend="auto")
    for role in ("target", "draft"):
        path, why = engine.paths[role]
        assert path.name == "lean"
        assert why.startswith("auto: torch, llama.cpp's forward cannot serve it (llama.cpp computes gpt2's gelu")
        figures = engine.stats()["forward"][role]["auto"]
        assert figures["chosen"] == "torch" and "gelu from an f16 table" in figures["obstacle"]


def test_a_llama_cpp_forward_that_fails_to_build_leaves_torch_and_the_reason(tmp_path):
    target, draft = make_gpt2_family_pair(tmp_path / "quick", "gpt2", activation_function="quick_gelu")
    engine = make_engine(target, draft, forward_backend="auto")
    path, why = engine.paths["target"]
    assert path.name == "hf"  # torch's choice for a quick_gelu GPT-2 (the lean path runs gelu, silu, relu)
    assert why.startswith("auto: torch, llama.cpp's forward unavailable (") and "quick_gelu" in why


def test_the_prefill_stays_where_it_measured_faster(llama_pair, monkeypatch):
    """engine.llamacpp_prefill auto: torch's prefill (K/V handed over) where it measured faster
    than llama.cpp's own, else llama.cpp's; figures injected, no clock."""
    from specd.engine.forward import measure

    def measured(ms_on_torch, ms_on_llamacpp):
        def fake(model, path, ids, contexts, widths, prefill_tokens, *args, **kwargs):
            return {"prefill_ms": ms_on_torch if path.torch_prefill is not None else ms_on_llamacpp}
        return fake

    monkeypatch.setattr(measure, "measure_path", measured(10.0, 30.0))
    engine = make_engine(*llama_pair, forward_backend="llamacpp", llamacpp_prefill="auto")
    for path, _ in engine.paths.values():
        assert path.torch_prefill is not None
        assert path.prefill_note.endswith("measured faster: 512 tokens in 10.0 ms vs llama.cpp 30.0 ms")
    monkeypatch.setattr(measure, "measure_path", measured(30.0, 10.0))
    engine = make_engine(*llama_pair, forward_backend="llamacpp", llamacpp_prefill="auto")
    for path, _ in engine.paths.values():
        assert path.torch_prefill is None
        assert path.prefill_note == ("prefills on llama.cpp, measured faster than torch's with the K/V handed over: "
                                     "512 tokens in 10.0 ms vs torch 30.0 ms")


def test_auto_chooses_a_valid_path_measured_once_and_stays_lossless(tiny_pairs, tiny_root, sample_source, monkeypatch):
    """A real load: whichever path won, the why holds both figures, the output is the target's
    own, and a second load reads the choice back instead of measuring."""
    target, _ = tiny_pairs["llama"]
    near = make_near_draft(target, tiny_root / "llama" / "near-draft")
    engine = make_engine(target, near, prefix_tokens=384, suffix_tokens=128, forward_backend="auto",
                         llamacpp_prefill="auto")
    for role, (path, why) in engine.paths.items():
        figures = engine.stats()["forward"][role]["auto"]
        assert path.name in ("lean", "llamacpp") and figures["chosen"] == ("torch" if path.name == "lean" else "llamacpp")
        assert why.startswith("auto: ") and " vs lean step " in why and "llamacpp step " in why
        assert figures["lean"]["step_ms"] > 0 and figures["llamacpp"]["step_ms"] > 0
        assert (figures["lean"]["verify_ms"] is None) == (role == "draft")
        if path.name == "llamacpp":
            assert figures["prefill"] in ("torch", "llamacpp") and "measured faster" in path.description
    offset = sample_source.index("    def to_dict")
    for text_offset in (offset, offset + 1):  # a prompt, then a keystroke on its cache
        result = engine.complete(CompletionRequest(uri="file:///auto.py", text=sample_source, offset=text_offset,
                                                   max_tokens=MAX_TOKENS, stop_at_block_end=False))
        assert_lossless(engine, result, MAX_TOKENS)

    monkeypatch.setattr(auto, "_measure", lambda *args, **kwargs: pytest.fail("measured again"))
    again = make_engine(target, near, prefix_tokens=384, suffix_tokens=128, forward_backend="auto",
                        llamacpp_prefill="auto")
    for role, (path, why) in again.paths.items():
        assert path.name == engine.paths[role][0].name and why.endswith("(measured before; kept in the cache)")
        assert again.stats()["forward"][role]["auto"]["cached"] is True


def test_a_cached_choice_is_measured_again_when_the_weights_change(llama_pair, tmp_path):
    import shutil

    from specd.engine.models import load_pair

    folder = tmp_path / "target"
    shutil.copytree(llama_pair[0], folder)
    pair = load_pair(str(folder), None, "cpu", "float32")
    options = make_engine(folder, None).options
    before = auto._choice_file(pair.target, str(folder), pair, options, "target")
    assert before == auto._choice_file(pair.target, str(folder), pair, options, "target")
    assert before != auto._choice_file(pair.target, str(folder), pair, options, "draft")
    # llama.cpp's prefill piece size moves its prefill's cost: a choice made under another is measured again
    from specd.engine.forward import llamacpp as llamacpp_path

    piece, llamacpp_path.BATCH = llamacpp_path.BATCH, llamacpp_path.BATCH * 2
    try:
        assert before != auto._choice_file(pair.target, str(folder), pair, options, "target")
    finally:
        llamacpp_path.BATCH = piece
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")
    assert before != auto._choice_file(pair.target, str(folder), pair, options, "target")


def test_status_says_which_forward_runs_each_model_and_why():
    info = {"state": "ready", "engine": {"forward": {
        "target": {"path": "llamacpp", "why": "auto: llama.cpp's forward measured faster: llamacpp step 1.90 ms "
                                              "vs lean step 2.60 ms", "detail": "llama.cpp on t.gguf"},
        "draft": {"path": "lean", "why": None, "detail": "static KV cache"}}}}
    line = next(line for line in format_status(info).splitlines() if line.startswith("forward"))
    assert line.split(None, 1)[1] == ("target llamacpp (auto: llama.cpp's forward measured faster: llamacpp step "
                                      "1.90 ms vs lean step 2.60 ms); draft lean")
    assert any(line.startswith("forward    -") for line in format_status({"state": "loading"}).splitlines())


def test_doctor_says_what_auto_chose_and_why(llama_pair, monkeypatch, capsys):
    from specd.cli import main

    monkeypatch.setenv("SPECD_ENGINE_FORWARD_BACKEND", "auto")
    monkeypatch.setattr(auto, "_measure", lambda *args, **kwargs: {
        "chosen": "torch", "why": "auto: lean measured faster: llamacpp step 3.00 ms vs lean step 2.00 ms"})
    assert main(["doctor", "--model", str(llama_pair[0]), "--draft-model", str(llama_pair[1])]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    at = lines.index(next(line for line in lines if line.startswith("target forward: lean (static KV cache")))
    assert lines[at + 1] == "auto: lean measured faster: llamacpp step 3.00 ms vs lean step 2.00 ms"
