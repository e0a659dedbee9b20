"""``specd.demo.widen``: a wider model that computes the same function, as the memory-bound
stand-in for a real-sized one. Each option on its own, in memory: logits equal up to rounding and
greedy identical (``check_same``); a real-shaped layout through the engine (its default forward):
the same completion token for token, the weights several times larger; a model that is not a
Llama-style decoder, or a narrower shape, is refused in one line."""

from __future__ import annotations

import pytest

from engine_helpers import make_engine
from specd.demo import widen
from specd.engine import CompletionRequest
from specd.engine.front.boundaries import NO_BOUNDARIES

# The tiny targets: hidden 64, 4 heads of 16, 2 KV heads (groups of 2), 4 layers, 128 MLP units.
SHAPES = {
    "mlp": {"intermediate": 1024},
    "hidden": {"hidden": 192},
    "heads": {"heads": 8},  # groups of 4: the original heads at slots 0, 1 and 4, 5
    "kv-heads": {"heads": 12, "kv_heads": 3},  # a new KV head; its 4 query heads all new
    "layers": {"layers": 7},  # 3 identity layers between the 4 trained ones
    "real-shaped": {"hidden": 128, "heads": 8, "kv_heads": 2, "intermediate": 352, "layers": 6},
}


def _load(folder):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_each_option_keeps_the_function(arch, shape, tiny_pairs):
    target, _ = tiny_pairs[arch]
    original, wide = _load(target), _load(target)
    widen.widen(wide, **shape)
    assert widen.check_same(original, wide, original.config.vocab_size) < 1e-3  # rounding only
    config = wide.config
    assert len(wide.model.layers) == config.num_hidden_layers == shape.get("layers", 4)
    assert [layer.self_attn.layer_idx for layer in wide.model.layers] == list(range(config.num_hidden_layers))
    assert config.num_attention_heads == shape.get("heads", 4) and config.num_key_value_heads == shape.get("kv_heads", 2)
    assert wide.model.layers[0].self_attn.q_proj.weight.shape == (shape.get("heads", 4) * 16, shape.get("hidden", 64))
    assert widen.parameters(wide) > widen.parameters(original)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", [SHAPES["mlp"], SHAPES["real-shaped"]], ids=["mlp", "real-shaped"])
def test_widened_target_completes_the_same(arch, shape, tiny_pairs, tmp_path, sample_source):
    target, draft = tiny_pairs[arch]
    summary = widen.widen_dir(target, tmp_path / "wide", **shape)
    assert summary["parameters_after"] > 2 * summary["parameters_before"]
    assert summary["max_logit_diff"] < 1e-3
    request = CompletionRequest(text=sample_source, offset=700, max_tokens=24, **NO_BOUNDARIES)
    narrow = make_engine(target, draft).complete(request)
    wide = make_engine(tmp_path / "wide", draft).complete(request)
    assert wide.token_ids == narrow.token_ids and len(wide.token_ids) == 24


def test_the_cli_takes_the_new_options(tiny_pairs, tmp_path, capsys):
    target, _ = tiny_pairs["llama"]
    argv = [str(target), str(tmp_path / "out"), "--heads", "8", "--kv-heads", "4", "--layers", "5"]
    assert widen.main(argv) == 0
    assert "greedy outputs identical" in capsys.readouterr().out
    config = _load(tmp_path / "out").config
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (8, 4, 5)


def test_a_model_that_is_not_llama_style_is_refused_in_one_line(tiny_pairs, tmp_path, capsys):
    target, _ = tiny_pairs["gpt2"]
    assert widen.main([str(target), str(tmp_path / "out"), "--intermediate", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Llama-style" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, says", [
    (["--intermediate", "8"], "below"),
    (["--layers", "2"], "below"),
    (["--heads", "6", "--kv-heads", "4"], "multiple"),
    (["--heads", "4", "--kv-heads", "4"], "could not keep their KV heads"),  # groups of 1 < the model's 2
])
def test_narrowing_or_regrouping_is_refused(argv, says, tiny_pairs, tmp_path, capsys):
    target, _ = tiny_pairs["llama"]
    assert widen.main([str(target), str(tmp_path / "out"), *argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
