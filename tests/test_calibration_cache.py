"""Forward costs measured at one load are kept for the next load of the same models on the same
paths (``speculation.calibration_cache``), and measured again when anything they depend on moves."""

from __future__ import annotations

import os

from engine_helpers import make_engine
from tiny import make_tiny_pair


def test_a_second_load_of_the_same_pair_takes_the_kept_costs(tiny_root):
    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    first = make_engine(target, draft, free_drafting=False)
    assert not first.costs_cached and first.agreement is not None
    again = make_engine(target, draft, free_drafting=False)
    assert again.costs_cached
    assert again.planning.costs.target == first.planning.costs.target
    assert again.agreement.prior == first.agreement.prior  # the agreement sample is kept with them
    assert again.planning.costs.draft_step == first.planning.costs.draft_step


def test_new_weights_or_another_path_are_measured_again(tmp_path):
    target, draft = make_tiny_pair(tmp_path / "llama", "llama")
    assert not make_engine(target, draft, free_drafting=False).costs_cached
    assert not make_engine(target, None, free_drafting=False).costs_cached  # no draft: another key
    assert not make_engine(target, draft, free_drafting=False, fast_forward=False).costs_cached
    weights = target / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a new version of the file
    assert not make_engine(target, draft, free_drafting=False).costs_cached
    assert make_engine(target, draft, free_drafting=False).costs_cached
