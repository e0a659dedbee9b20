"""``specd.demo.widen``: a wider model that computes the same function, as the memory-bound
stand-in for a real-sized one. Checked through the engine (its default forward) on the tiny
pairs: the same completion token for token, the weights several times larger; a model that is
not a Llama-style decoder is refused in one line."""

from __future__ import annotations

import pytest

from engine_helpers import make_engine
from specd.demo import widen
from specd.engine import CompletionRequest
from specd.engine.front.boundaries import NO_BOUNDARIES


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", [{"intermediate": 1024}, {"intermediate": 512, "hidden": 192}],
                         ids=["mlp", "mlp+hidden"])
def test_widened_target_completes_the_same(arch, shape, tiny_pairs, tmp_path, sample_source):
    target, draft = tiny_pairs[arch]
    summary = widen.widen_dir(target, tmp_path / "wide", shape["intermediate"], shape.get("hidden"))
    assert summary["parameters_after"] > 2 * summary["parameters_before"]
    assert summary["max_logit_diff"] < 1e-3
    request = CompletionRequest(text=sample_source, offset=700, max_tokens=24, **NO_BOUNDARIES)
    narrow = make_engine(target, draft).complete(request)
    wide = make_engine(tmp_path / "wide", draft).complete(request)
    assert wide.token_ids == narrow.token_ids and len(wide.token_ids) == 24


def test_a_model_that_is_not_llama_style_is_refused_in_one_line(tiny_pairs, tmp_path, capsys):
    target, _ = tiny_pairs["gpt2"]
    assert widen.main([str(target), str(tmp_path / "out"), "--intermediate", "4096"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Llama-style" in err
    assert not (tmp_path / "out").exists()


def test_narrowing_is_refused(tiny_pairs, tmp_path, capsys):
    target, _ = tiny_pairs["llama"]
    assert widen.main([str(target), str(tmp_path / "out"), "--intermediate", "8"]) == 2
    assert "below" in capsys.readouterr().err
