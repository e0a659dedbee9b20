"""Token-tree verification on the lean forward: a tree of candidate continuations runs in one
forward, each node's row equals what the target computes after that node's root path alone, and
keeping one path leaves the cache exactly as if only that path had ever run."""

from __future__ import annotations

import pytest
import torch

from specd.engine.forward.lean import LeanForward
from specd.engine.caches import KVState
from test_fastpath import ARCH_CASES, assert_same_logits, ids, tiny

# pending token, then three branches: a (3 tokens), b (2) off the root, c (2) off a's first token
TREE = [11, 21, 22, 23, 31, 32, 41, 42]
PARENTS = [-1, 0, 1, 2, 0, 4, 1, 6]
PATHS = {  # root-to-leaf paths as node indexes
    "a": [0, 1, 2, 3],
    "b": [0, 4, 5],
    "c": [0, 1, 6, 7],
}


def chain_rows(lean: LeanForward, context: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    cache = lean.new_cache()
    lean.forward(context, cache)
    return lean.forward(torch.tensor([tokens]), cache)


@pytest.fixture(scope="module", params=sorted(ARCH_CASES))  # the -window cases bind inside the tree's context
def lean(request):
    return LeanForward(ARCH_CASES[request.param]())


@pytest.mark.parametrize("context_width", [1, 40])
def test_every_node_sees_its_root_path_only(lean, context_width):
    context = ids(context_width, seed=5)
    cache = lean.new_cache()
    lean.forward(context, cache)
    rows = lean.forward(torch.tensor([TREE]), cache, parents=PARENTS)
    assert cache.length == context_width + len(TREE)
    for name, path in PATHS.items():
        expected = chain_rows(lean, context, [TREE[i] for i in path])
        assert_same_logits(rows[path], expected)


@pytest.mark.parametrize("keep", sorted(PATHS))
def test_keeping_a_path_leaves_the_cache_of_that_path_alone(lean, keep):
    context = ids(30, seed=6)
    cache = lean.new_cache()
    lean.forward(context, cache)
    lean.forward(torch.tensor([TREE]), cache, parents=PARENTS)
    kept = PATHS[keep][:3]  # a prefix of the path: what stood, the rest dropped
    lean.keep(cache, 30, [30 + node for node in kept])
    assert cache.length == 30 + len(kept)
    after = ids(5, seed=7)
    expected = chain_rows(lean, context, [TREE[i] for i in kept] + after[0].tolist())[len(kept):]
    assert_same_logits(lean.forward(after, cache), expected)


def test_a_tree_of_one_chain_equals_the_chain(lean):
    context = ids(20, seed=8)
    cache = lean.new_cache()
    lean.forward(context, cache)
    tokens = [5, 6, 7, 8]
    assert_same_logits(lean.forward(torch.tensor([tokens]), cache, parents=[-1, 0, 1, 2]),
                       chain_rows(lean, context, tokens))


def test_malformed_trees_are_refused_and_leave_the_cache_as_it_was():
    lean = LeanForward(tiny("llama"))
    cache = lean.new_cache()
    lean.forward(ids(10, seed=1), cache)
    for parents in ([0, 0], [-1, -1], [-1, 2, 0], [-1, 0]):  # a root that is not first, two roots, a forward parent, too few
        with pytest.raises(ValueError):
            lean.forward(torch.tensor([[1, 2, 3]]), cache, parents=parents)
        assert cache.length == 10
    with pytest.raises(ValueError):
        lean.keep(cache, 8, [12])  # a slot past what the cache holds


def test_kv_state_keeps_ids_and_cache_together():
    model = tiny("qwen2")
    state = KVState(model, LeanForward(model))
    assert state.trees
    state.extend(ids(12, seed=2)[0].tolist())
    held = list(state.ids)
    rows = state.extend_tree(TREE, PARENTS)
    assert len(rows) == len(TREE)
    state.keep(12, PATHS["b"])
    assert state.ids == held + [TREE[i] for i in PATHS["b"]]
    fresh = KVState(model, LeanForward(model))
    fresh.extend(state.ids)
    after = [3, 4]
    assert_same_logits(state.extend(after), fresh.extend(after))


def test_paths_without_trees_refuse_them():
    model = tiny("llama")
    state = KVState(model)  # transformers' forward
    assert not state.trees
    with pytest.raises(ValueError, match="no token trees"):
        state.extend_tree([1, 2], [-1, 0])


# ---- the decode loop with a token tree ---------------------------------------------------

def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    state = KVState(model, LeanForward(model))
    out, logits = [], state.extend(prompt, last_only=True)
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = state.extend([out[-1]], last_only=True)
    return out


def flat_costs():
    from specd.engine.speculation.planner import PlannerMemory
    memory = PlannerMemory()
    memory.costs.target = {width: 1.0 for width in range(1, 65)}
    memory.costs.record_target = lambda width, ms: None
    return memory


@pytest.mark.parametrize("pending", [1, 6])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_second_branch_stands_where_the_first_fails_and_the_output_is_the_targets(arch, pending):
    """Two sources match the prompt's last 5 tokens (a tie: the earlier source's draft is
    chosen). The chosen one continues wrongly, the other with what the target writes: the tree
    verifies both, the second branch stands, and the output equals the target alone. With
    ``pending`` 6 the cache lacks the prompt's last 6 tokens (a keystroke's): they run with the
    first step's tree, in the same forward."""
    from specd.engine.speculation.loop import speculative_decode
    from specd.engine.speculation.planner import TREE, DraftPlanner
    from specd.engine.speculation.drafters import LookupDrafter
    from specd.engine.lookup import NgramIndex
    from specd.engine.speculation.sampling import SamplingParams

    model = tiny(arch, seed=3)
    prompt = ids(40, seed=9)[0].tolist()
    reference = greedy_reference(model, prompt, 16)
    wrong = [(t + 7) % 500 + 1 for t in reference]  # differs from the reference at every token
    lookup = LookupDrafter(NgramIndex(), [("lookup:open", NgramIndex(prompt[-5:] + wrong)),
                                          ("lookup:workspace", NgramIndex(prompt[-5:] + reference))], longest=8)
    planner = DraftPlanner(flat_costs(), [lookup], trees=True)
    state = KVState(model, LeanForward(model))
    state.extend(prompt[:-pending])
    outcome = speculative_decode(state, list(prompt), planner, SamplingParams(0.0, 1.0), 16,
                                 stop=lambda token: None, deadline=float("inf"))
    assert state.forwards == 1 + outcome.target_forwards  # the pending tokens took no forward of their own
    assert outcome.tokens == reference
    assert planner.stats[TREE].accepted >= 1
    assert planner.stats["lookup:workspace"].accepted >= 8
    assert planner.stats["lookup:open"].accepted == 0
    assert outcome.target_forwards < len(reference)
    assert state.ids == prompt + reference[:-1]  # the cache holds what was written, nothing of the branch that failed
