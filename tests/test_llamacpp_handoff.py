"""engine.llamacpp_prefill = torch: on llama.cpp's forward, a prompt from an empty cache prefills
on torch's lean forward and its K/V go to llama.cpp through the sequence-state API
(specd.llamacpp.handoff). The byte layout is llama.cpp's own (what it writes, rebuilt, is
byte-identical), the rotary layout of the keys is found at load (interleaved for Llama, as is
for Qwen2), decoding from handed-over K/V is llama.cpp's own decoding, and a state llama.cpp
refuses leaves the sequence empty and the error raised."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specd.engine.forward.lean import LeanForward
from specd.llamacpp.export import export_gguf
from specd.engine.forward.llamacpp import HANDOFF_TOKENS, LlamaCppForward
from specd.llamacpp.handoff import HandoffError, TorchPrefill, build, parse

WINDOW = 512


@pytest.fixture(scope="module")
def paths_for(tiny_pairs, tmp_path_factory):
    """arch -> (llama.cpp forward with torch's prefill, one without, the lean forward)."""
    made = {}

    def paths(arch):
        if arch not in made:
            target, _ = tiny_pairs[arch]
            gguf = tmp_path_factory.mktemp(f"handoff-{arch}") / "target.gguf"
            export_gguf(target, gguf)
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
            handing = LlamaCppForward(gguf, budget_bytes=64 << 20, window=WINDOW)
            lean = LeanForward(model, transposed_weights="off")
            handing.use_torch_prefill(lean)
            made[arch] = handing, LlamaCppForward(gguf, budget_bytes=64 << 20, window=WINDOW), lean
        return made[arch]
    return paths


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 500, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("arch", "keys"), [("llama", "interleaved"), ("qwen2", "as is"), ("qwen3", "as is"),
                                           ("granite", "interleaved")])
def test_the_keys_rotary_layout_is_found_at_load(arch, keys, paths_for):
    handing, _, _ = paths_for(arch)
    assert handing.torch_prefill is not None and handing.torch_prefill.mapping == keys
    assert f"keys {keys}; checked at load" in handing.description


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpps_own_state_rebuilds_byte_for_byte(arch, paths_for):
    _, plain, _ = paths_for(arch)
    cache = plain.new_cache()
    plain.forward(prompt(70), cache, last_only=True)
    data = plain.read_state(cache)
    state = parse(data)
    assert state.positions == list(range(70)) and len(state.keys) == len(state.values) > 0
    assert build(state, cache.seq) == data


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoding_from_handed_over_kv_is_llama_cpps_own(arch, paths_for):
    handing, plain, lean = paths_for(arch)
    calls = []
    real = handing.torch_prefill.prefill
    handing.torch_prefill.prefill = lambda *args: (calls.append(args[0].shape[1]), real(*args))[1]
    try:
        outputs = []
        for path in (handing, plain):
            cache = path.new_cache()
            logits = path.forward(prompt(HANDOFF_TOKENS + 36, seed=1), cache, last_only=True)
            tokens = []
            for _ in range(24):
                tokens.append(int(logits[-1].argmax()))
                logits = path.forward(torch.tensor([[tokens[-1]]]), cache, last_only=True)
            outputs.append((tokens, cache.length, path.read_state(cache)))
    finally:
        handing.torch_prefill.prefill = real
    assert calls == [HANDOFF_TOKENS + 36]  # the prefill went through torch, the steps did not
    assert outputs[0][:2] == outputs[1][:2]
    handed, own = parse(outputs[0][2]), parse(outputs[1][2])
    for mine, theirs in zip(handed.keys + handed.values, own.keys + own.values):
        assert abs(mine - theirs).max() <= 1e-3 * max(1.0, abs(theirs).max())
    # shorter prompts, and prompts after what a cache holds, stay on llama.cpp
    cache = handing.new_cache()
    handing.forward(prompt(HANDOFF_TOKENS - 1), cache)
    handing.forward(prompt(HANDOFF_TOKENS + 5), cache)
    assert cache.length == 2 * HANDOFF_TOKENS + 4


def test_a_state_llama_cpp_refuses_leaves_the_sequence_empty(paths_for):
    handing, _, _ = paths_for("llama")
    cache = handing.new_cache()
    handing.forward(prompt(10), cache)
    data = handing.read_state(cache)
    with pytest.raises(HandoffError, match="took"):
        handing.write_state(cache, data[:-8])  # cut short
    assert cache.length == 0
    with pytest.raises(HandoffError, match="magic"):
        parse(b"\0" * 16)
    with pytest.raises(HandoffError, match="left over"):
        parse(data + b"\0")


def test_a_model_whose_kv_are_not_llama_cpps_keeps_the_prefill_there(paths_for, tiny_pairs):
    """Torch's K/V from another model than the GGUF's: the check at load finds no layout under
    which they agree, says so, and prompts prefill on llama.cpp."""
    _, plain, _ = paths_for("llama")
    other = AutoModelForCausalLM.from_pretrained(tiny_pairs["llama"][1], dtype=torch.float32).eval()
    with pytest.raises(HandoffError):
        TorchPrefill.calibrate(LeanForward(other, transposed_weights="off"), plain)
    path = LlamaCppForward(plain.path, budget_bytes=64 << 20, window=WINDOW)
    path.use_torch_prefill(LeanForward(other, transposed_weights="off"))
    assert path.torch_prefill is None and "prefills on llama.cpp: torch's K/V cannot be handed over" in path.description


def test_the_setting_keeps_every_prefill_on_llama_cpp(tiny_pairs):
    from engine_helpers import make_engine

    target, draft = tiny_pairs["qwen2"]
    engine = make_engine(target, draft, forward_backend="llamacpp", llamacpp_prefill="llamacpp")
    for path, _ in engine.paths.values():
        assert path.name == "llamacpp" and path.torch_prefill is None and "torch" not in path.description


@pytest.mark.parametrize("first", [0, 5, HANDOFF_TOKENS + 2])
def test_rows_from_computes_only_the_rows_asked_for(first, paths_for):
    """``forward(..., rows_from=i)``: the rows of logits from i on, as a whole forward gives them,
    and the same cache after, also where the forward runs in pieces (``BATCH``) or prefills an
    empty cache on torch; i out of range is refused."""
    from specd.engine.forward import llamacpp as forward_module

    handing, plain, _ = paths_for("llama")
    ids = prompt(HANDOFF_TOKENS + 12, seed=3)
    for path in (handing, plain):
        whole, asked = path.new_cache(), path.new_cache()
        expected = path.forward(ids, whole)
        batch, forward_module.BATCH = forward_module.BATCH, 16  # in pieces of 16 tokens
        try:
            got = path.forward(ids, asked, rows_from=first)
        finally:
            forward_module.BATCH = batch
        assert got.shape == (ids.shape[1] - first, path.n_vocab)
        assert torch.allclose(got, expected[first:], atol=1e-4)
        assert asked.length == whole.length == ids.shape[1]
        with pytest.raises(ValueError, match="rows from"):
            path.forward(ids[:, :3], asked, rows_from=3)
        assert asked.length == ids.shape[1]
