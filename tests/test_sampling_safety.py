"""Every sampling option the daemon accepts gives a completion, never an engine error.

The options are checked one by one (temperature 0-100, top_p 0-1), and some combinations
used to leave the sampler with no mass at all: a top_p below float32's smallest value compares
as 0 and dropped every token, and a temperature that float32 rounds to 0 divided logits by 0.
``probabilities`` is checked here over extreme values by property, then the engine over the
options the daemon's validation accepts, then the real daemon with the request that failed.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import make_engine
from specd.daemon.params import completion_options
from specd.engine.speculation.sampling import SamplingParams, probabilities, sample
from specd.engine.types import CompletionRequest

# Temperatures and top_p values at and near the edges the options allow, and where float32
# stops representing them (subnormal, rounded to 0).
EDGE_TEMPERATURES = [0.0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-30, 1e-8, 0.01, 1.0, 99.99, 100.0]
EDGE_TOP_PS = [0.0, 5e-324, 1e-300, 1e-45, 1e-8, 0.3, 0.999999, 1.0]

temperatures = st.one_of(st.sampled_from(EDGE_TEMPERATURES), st.floats(0.0, 100.0, allow_subnormal=True))
top_ps = st.one_of(st.sampled_from(EDGE_TOP_PS), st.floats(0.0, 1.0, allow_subnormal=True))


@st.composite
def logit_rows(draw) -> torch.Tensor:
    """Rows of logits such as models give: ordinary, huge, tied, or partly masked to -inf."""
    vocab = draw(st.integers(2, 64))
    rows = draw(st.integers(1, 3))
    scale = draw(st.sampled_from([1.0, 30.0, 1e4, 1e30]))
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16)))) * scale
    if draw(st.booleans()):
        logits[:, : vocab // 2] = -math.inf  # a masked half
    if draw(st.booleans()):
        logits[:, -2:] = logits.amax(-1, keepdim=True)  # a tie for the top
    return logits.to(draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])))


@settings(max_examples=400, deadline=None)
@given(logits=logit_rows(), temperature=temperatures, top_p=top_ps)
def test_the_distribution_is_a_distribution_for_every_accepted_value(logits, temperature, top_p):
    params = SamplingParams(temperature, top_p)
    probs = probabilities(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5)
    # A most probable token (any of a tie) always stays drawable, whatever top_p and temperature.
    logits = logits.float()
    top = logits == logits.amax(-1, keepdim=True)
    assert (probs.where(top, 0.0).sum(-1) > 0).all()
    for row in probs:
        token = sample(row, params, torch.Generator().manual_seed(0))
        assert row[token] > 0


def test_ordinary_values_keep_the_plain_softmax_and_nucleus():
    """The guards change nothing where there was nothing to guard: same law as the textbook."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1)) * 3
    for temperature in (0.2, 0.7, 1.0, 1.5, 10.0):
        expected = torch.softmax(logits.double() / temperature, -1)
        assert torch.allclose(probabilities(logits, SamplingParams(temperature)).double(), expected, atol=1e-6)
        kept = probabilities(logits, SamplingParams(temperature, 0.9))
        for row, full in zip(kept, expected):
            order = full.argsort(descending=True)
            mass_before = full[order].cumsum(0) - full[order]
            nucleus = order[mass_before < 0.9]  # the smallest set whose mass reaches 0.9
            assert set((row > 0).nonzero().flatten().tolist()) == set(nucleus.tolist())
            assert torch.allclose(row[nucleus].double(), full[nucleus] / full[nucleus].sum(), atol=1e-5)


def test_rows_without_any_mass_fall_back_to_their_argmax():
    assert probabilities(torch.full((1, 5), -math.inf), SamplingParams(1.0, 0.9)).tolist() == [[1.0, 0, 0, 0, 0]]
    probs = probabilities(torch.tensor([[math.nan, 1.0, 2.0]]), SamplingParams(0.5))
    assert probs.tolist() == [[0.0, 0.0, 1.0]]


def test_the_tiniest_temperature_is_the_argmax_and_ties_share():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    probs = probabilities(logits, SamplingParams(1e-300))
    assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0]]


# -- the engine, over what the daemon's validation accepts -----------------------------------


@pytest.fixture(scope="module")
def engine(llama_pair):
    target, draft = llama_pair
    return make_engine(target, draft)


option_maps = st.fixed_dictionaries({}, optional={
    "temperature": temperatures,
    "top_p": top_ps,
    "seed": st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1])),
    "max_tokens": st.integers(1, 6),
    "single_line": st.booleans(),
    "stop_at_block_end": st.booleans(),
    "stop_at_repeated_line": st.booleans(),
    "stop_at_suffix_line": st.booleans(),
    "multiline": st.sampled_from(["blocks", "always"]),
    "use_draft_model": st.booleans(),
    "use_lookup": st.booleans(),
    "kv_reuse": st.booleans(),
    "time_budget_ms": st.sampled_from([1, 50, 600_000]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=option_maps, cut=st.integers(0, 400))
def test_every_accepted_option_map_completes(engine, sample_source, options, cut):
    options.setdefault("max_tokens", 4)
    request = CompletionRequest(uri="file:///sampling.py", text=sample_source, offset=min(cut, len(sample_source)),
                                **completion_options(options))
    result = engine.complete(request)
    assert isinstance(result.text, str)
    assert result.stop_reason in {"eos", "max_tokens", "single_line", "block_end", "time_budget", "line_ending",
                                  "repeated_line", "suffix_line", "current_line"}


def test_the_extreme_request_over_the_real_daemon(daemon):
    """The request that ended in ``engine_error`` (no mass left for multinomial)."""
    extremes = ({"temperature": 100, "top_p": 1e-300}, {"temperature": 1e-300, "top_p": 0.0},
                {"temperature": 5e-324, "top_p": 5e-324, "seed": 2**63 - 1})
    with daemon.client() as client:
        for options in extremes:
            result = client.complete(text="def add(a, b):\n    return ", cursor={"line": 1, "character": 11},
                                     options={**options, "max_tokens": 6})
            assert isinstance(result["text"], str), (options, result)
