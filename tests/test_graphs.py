"""Replayed forwards (specd.engine.forward.graphs, ``LeanForward.use_graphs``): the static-shape forward
that CUDA graphs record computes what HF computes for every architecture the lean path serves,
through decode, verify, rollback, cache growth and sliding windows; a recording replays new
tokens at new positions through its static inputs alone; nothing in it reads the device back to
the host (which a recording cannot hold); the load-time check turns replays off when they do not
match; the settings say what they do.

These run the forward that would be recorded through ``EagerGraphs`` (the CPU has no graphs):
everything but the CUDA recording itself, which ``scripts/gpu-bench`` exercises on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specd.engine import compat
from specd.engine.forward.lean import WIDE, LeanForward
from specd.engine.forward.graphs import GRAPH_WIDTHS, EagerGraphs
from test_fastpath import ARCH_CASES, STEPS, assert_close, assert_same_logits, ids, tiny

# ops that read a device tensor back to the host (a sync, which a CUDA graph cannot record) or
# copy host data to the device mid-forward (a recording would replay the stale copy)
HOST_ROUND_TRIPS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "lift_fresh",
                    "lift_fresh_copy", "_to_copy_from_host", "tolist")


def replaying(model) -> LeanForward:
    """A lean forward that records every narrow forward at its first use (the engine waits for
    a kind of step to recur, ``record_after``), so each step below runs a recording."""
    lean = LeanForward(model)
    lean.use_graphs("eager")
    assert isinstance(lean.graphs, EagerGraphs), lean.graph_note
    lean.record_after = 1
    return lean


def test_graph_widths_stay_narrow():
    assert 17 <= GRAPH_WIDTHS < WIDE  # a default lookup verify (16 + 1) replays; grouped-query attention


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_replayed_logits_equal_hf_through_decode_verify_and_rollback(case):
    model = ARCH_CASES[case]()
    lean = replaying(model)
    cache, hf_cache = lean.new_cache(), compat.new_cache(model)
    for i, width in enumerate(STEPS):
        step = ids(width, seed=i)
        assert_same_logits(lean.forward(step, cache, last_only=False), compat.forward(model, step, hf_cache))
    # every narrow step replayed a recording of this cache; the prefills ran eagerly
    assert set(cache.graphs) == {(width, False) for width in STEPS if width <= GRAPH_WIDTHS}
    held = lean.cache_length(cache) - 9
    lean.crop(cache, held)
    compat.crop_cache(hf_cache, held)
    for i, width in enumerate((5, 1, 1, 16)):  # after a rollback, and again from new positions
        step = ids(width, seed=100 + i)
        assert_same_logits(lean.forward(step, cache, last_only=False), compat.forward(model, step, hf_cache))
    step = ids(3, seed=200)
    last = lean.forward(step, cache, last_only=True)
    assert last.shape == (1, model.config.vocab_size) and (3, True) in cache.graphs
    assert_same_logits(last, compat.forward(model, step, hf_cache, last_only=True))


def test_a_recording_replays_new_tokens_at_new_positions_through_its_static_inputs():
    model = tiny("qwen2")
    lean = replaying(model)
    cache = lean.new_cache()
    lean.forward(ids(40, seed=0), cache)
    first = lean.forward(ids(2, seed=1), cache)
    captured = cache.graphs[2, False]
    replays = []
    real = captured.replay
    captured.replay = lambda: (replays.append(1), real())[1]
    fresh = lean.new_cache()
    lean.forward(torch.cat([ids(40, seed=0), ids(2, seed=1)], 1), fresh)
    for i in range(3):  # each replay reads only what went into captured.ids and captured.start
        step = ids(2, seed=10 + i)
        got = lean.forward(step, cache)
        assert cache.graphs[2, False] is captured and len(replays) == i + 1
        assert_close(got, lean.forward(step, fresh))
        assert int(captured.start) == lean.cache_length(cache) - 2 and torch.equal(captured.ids, step)
    assert not torch.equal(first, got)


def test_growth_drops_the_recordings_of_the_old_tensors_and_records_again():
    model = tiny("llama", max_position_embeddings=96)
    lean = replaying(model)
    cache, hf_cache = lean.new_cache(capacity=8), compat.new_cache(model)
    assert cache.zeroed and all(bool((kv == 0).all()) for kv in cache.kv)
    for i, width in enumerate((5, 1, 1, 1, 1)):  # the fourth step outgrows 8 slots
        step = ids(width, seed=i)
        assert_same_logits(lean.forward(step, cache), compat.forward(model, step, hf_cache))
        if i == 2:
            recorded = cache.graphs[1, False]
    assert cache.capacity == 16 and cache.graphs[1, False] is not recorded
    assert cache.graphs[1, False].out.shape == (1, model.config.vocab_size)
    # grown slots start at zero too: a replay attends over all of them under its mask
    assert all(bool((kv[:, :, lean.cache_length(cache):] == 0).all()) for kv in cache.kv)
    # what the cache holds counts the recordings' outputs (they live as long as it does)
    assert lean.nbytes(cache) == sum(kv.numel() * 4 for kv in cache.kv) + 4 * model.config.vocab_size


def test_replays_apply_a_sliding_window():
    model = tiny("mistral", sliding_window=24, max_position_embeddings=24)
    lean = replaying(model)
    cache, hf_cache = lean.new_cache(), compat.new_cache(model)
    replayed = set()
    for i, width in enumerate((20, 1, 8, 1, 12, 3, 1, 70, 2)):  # the window binds from position 24 on
        step = ids(width, seed=i)
        assert_same_logits(lean.forward(step, cache), compat.forward(model, step, hf_cache))
        replayed |= set(cache.graphs)
    assert {(1, False), (12, False), (2, False)} <= replayed


def test_bfloat16_replays_follow_hf_rounding():
    model = tiny("qwen2").to(torch.bfloat16)
    lean = replaying(model)
    cache, hf_cache = lean.new_cache(), compat.new_cache(model)
    for i, width in enumerate((70, 1, 8, 1)):
        step = ids(width, seed=i)
        mine, theirs = lean.forward(step, cache), compat.forward(model, step, hf_cache)
        assert (mine - theirs).abs().max() <= 0.02 * theirs.abs().max()
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["qwen2", "gpt2", "gpt_bigcode-mqa", "mistral-window"])
def test_a_replayed_forward_never_reads_the_device_back(case, monkeypatch):
    model = tiny("mistral", sliding_window=24, max_position_embeddings=24) if case == "mistral-window" \
        else ARCH_CASES[case]()
    lean = replaying(model)
    cache = lean.new_cache()
    lean.forward(ids(30, seed=0), cache)
    recorded = []
    real = lean._static_forward

    def watched(*args, **kwargs):
        with _Ops() as ops:
            out = real(*args, **kwargs)
        recorded.append(ops.names)
        return out

    monkeypatch.setattr(lean, "_static_forward", watched)
    for width in (1, 4):
        lean.forward(ids(width, seed=width), cache)
    assert len(recorded) == 4  # recorded once (run, then replayed) per width
    for names in recorded:
        assert "embedding" in names and "scaled_dot_product_attention" in names  # the whole forward was seen
        assert not set(names) & set(HOST_ROUND_TRIPS), sorted(set(names) & set(HOST_ROUND_TRIPS))
        assert names.count("index_copy_") == 2 * len(lean.layers)  # K and V written at device positions


def test_settings_and_what_the_description_says():
    model = tiny("llama")
    lean = LeanForward(model)
    for setting in ("off", "auto"):  # auto on a CPU: nothing to record, nothing to say
        lean.use_graphs(setting)
        assert lean.graphs is None and "graph" not in lean.description
    lean.use_graphs("on")
    assert lean.graphs is None and "no CUDA graphs: the model is on cpu" in lean.description
    lean.use_graphs("eager")
    assert lean.graphs is not None and f"1-{GRAPH_WIDTHS}-token steps" in lean.description
    with pytest.raises(ValueError, match="auto, on or off"):
        lean.use_graphs("always")
    lean.use_graphs("off")
    cache = lean.new_cache()
    lean.forward(ids(4, seed=0), cache)
    assert not cache.graphs and not cache.zeroed


def test_the_load_check_keeps_a_forward_whose_replays_differ_eager(monkeypatch):
    model = tiny("qwen2")
    lean = LeanForward(model)
    real = lean._static_forward
    monkeypatch.setattr(lean, "_static_forward", lambda *args: real(*args) + 0.5)  # a wrong recording
    lean.use_graphs("eager")
    assert lean.graphs is None and "CUDA graphs off: a replayed 1-token forward differs" in lean.description

    def unrecordable(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(lean, "_static_forward", unrecordable)
    lean.use_graphs("eager")
    assert lean.graphs is None and "recording a forward failed: operation not permitted" in lean.description
    monkeypatch.undo()
    lean.use_graphs("eager")  # and the real one passes
    assert lean.graphs is not None


def test_a_failed_replay_leaves_the_cache_length_unchanged(monkeypatch):
    model = tiny("llama")
    lean = replaying(model)
    seq = ids(24, seed=1)
    cache = lean.new_cache()
    lean.forward(seq[:, :20], cache)
    lean.forward(seq[:, 20:22], cache)  # records width 2
    captured = cache.graphs[2, False]

    def failing():
        raise RuntimeError("injected fault")

    monkeypatch.setattr(captured, "replay", failing)
    with pytest.raises(RuntimeError, match="injected fault"):
        lean.forward(seq[:, 22:24], cache)
    assert lean.cache_length(cache) == 22
    monkeypatch.undo()
    assert_close(lean.forward(seq[:, 22:24], cache), LeanForward(model).forward(seq, LeanForward(model).new_cache())[22:])


def test_a_step_that_recorded_a_graph_first_is_not_timed_for_the_planner(tiny_pairs):
    """A recording costs a few forwards once; timed as a forward of its width it would price
    that width out for a while. The planner hears of replays only (and of every eager step)."""
    from engine_helpers import make_engine
    from specd.engine import CompletionRequest
    from specd.engine.speculation.loop import _timed

    class Held:
        recordings = 3

    class Rows:
        head_ms = 1.0

    started = __import__("time").perf_counter() - 0.050
    assert 45 <= _timed(started, 3, Held, Rows) < 1000 and _timed(started, 2, Held, Rows) is None

    target, draft = tiny_pairs["llama"]
    engine = make_engine(target, draft, free_drafting=False, cuda_graphs="eager", use_draft_model=False)
    lean = engine.paths["target"][0]
    events = []
    forward, record, record_target = lean.forward, lean._record, engine.planning.costs.record_target
    lean.forward = lambda *args, **kwargs: (events.append("forward"), forward(*args, **kwargs))[1]
    lean._record = lambda *args: (events.append("record"), record(*args))[1]
    engine.planning.costs.record_target = lambda width, ms: (events.append(("timed", width)), record_target(width, ms))
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    for uri in ("file:///a.py", "file:///b.py"):
        engine.complete(CompletionRequest(uri=uri, text=text, offset=len(text), max_tokens=12,
                                          stop_at_block_end=False))
    assert events.count("record") >= 2  # each document recorded its own
    steps = "".join("F" if event == "forward" else "R" if event == "record" else "t" for event in events)
    assert "FRt" not in steps and "FRF" in steps, steps  # a step that recorded went untimed ...
    assert steps.count("Ft") >= 12, steps  # ... and the replays were timed


def test_idle_prefill_records_what_the_next_request_replays(tiny_pairs):
    """On a GPU the first step of each width on a new document records a graph; idle prefill
    (what the daemon runs between keystrokes) records the usual ones ahead and makes room, so
    the request after it replays from its first step."""
    from engine_helpers import make_engine
    from specd.engine import CompletionRequest

    target, draft = tiny_pairs["qwen2"]
    engine = make_engine(target, draft, cuda_graphs="eager", use_lookup=False)
    lean, draft_lean = engine.paths["target"][0], engine.paths["draft"][0]
    assert not lean.uses and not draft_lean.uses  # the load's check and calibration are forgotten
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    uri = "file:///first.py"
    engine.complete(CompletionRequest(uri=uri, text=text, offset=len(text), max_tokens=10, stop_at_block_end=False))
    used = {key for key, uses in lean.uses.items() if uses >= lean.record_after}
    assert any(not last for _, last in used)  # verify or decode steps recurred

    uri, text = "file:///second.py", "".join(f"x{i} = add({i}, {i + 1})\n" for i in range(30)) + text
    engine.open_document(uri, text)
    engine.update_document(uri, text + "    return", len(text) + len("    return"))
    while engine.prefill_pending(10.0):
        pass
    state = engine.caches.get(uri)
    prepared = set(state.target.cache.graphs)
    assert prepared and prepared <= used and (1, True) in state.draft.cache.graphs
    held = len(state.target.ids)
    assert held + engine.options.max_tokens > 256  # more than a new cache holds: room was made
    assert state.target.cache.capacity >= held + engine.options.max_tokens + engine._widest_verify()
    recorded = dict(state.target.cache.graphs)
    result = engine.complete(CompletionRequest(uri=uri, text=text + "    return", offset=len(text) + len("    return"),
                                               max_tokens=4, stop_at_block_end=False))
    assert result.token_ids
    # the request replayed what idle time recorded (the cache did not grow and drop them)
    assert all(state.target.cache.graphs[key] is captured for key, captured in recorded.items())


def test_a_kind_of_step_is_recorded_once_it_recurs():
    """A prefill's odd-sized last piece is asked for once: not worth a recording (a few
    forwards' time on a GPU). A width asked for a second time is recorded then, on any cache."""
    model = tiny("llama")
    lean = LeanForward(model)
    lean.use_graphs("eager")
    assert lean.record_after == 2
    lean.uses.clear()
    cache, other = lean.new_cache(), lean.new_cache()
    lean.forward(ids(40, seed=0), cache)
    lean.forward(ids(40, seed=0), other)
    recordings = lean.recordings  # the load-time check's
    lean.forward(ids(29, seed=1), cache, last_only=True)  # once: eager
    assert not cache.graphs and lean.recordings == recordings
    lean.forward(ids(29, seed=2), other, last_only=True)  # again: recorded (on that cache)
    assert set(other.graphs) == {(29, True)} and lean.recordings == recordings + 1
    lean.forward(ids(29, seed=3), cache, last_only=True)  # and now on any cache at first use
    assert set(cache.graphs) == {(29, True)} and lean.recordings == recordings + 2


# The one part CPU tests cannot run (EagerGraphs runs the rest); where a CUDA device is present the
# engine's load check compares a replay with the eager forward too, and scripts/gpu-bench reports it.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="recording CUDA graphs needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_record_and_replay_what_the_eager_forward_computes(dtype):
    model = tiny("qwen2").to(device="cuda", dtype=dtype)
    lean = LeanForward(model)
    lean.use_graphs("auto")
    assert lean.graphs is not None and lean.graphs.name == "cuda", lean.description
    eager = LeanForward(model)
    cache, reference = lean.new_cache(), eager.new_cache()
    for i, width in enumerate((40, 1, 1, 3, 3, 1, 17, 17)):
        step = ids(width, seed=i).cuda()
        mine, theirs = lean.forward(step, cache), eager.forward(step, reference)
        assert (mine - theirs).abs().max() <= (1e-3 if dtype == torch.float32 else 5e-2) * theirs.abs().max()
    assert {(1, False), (3, False), (17, False)} <= set(cache.graphs)
