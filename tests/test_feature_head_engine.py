"""A feature head as the engine's draft: it reads the target's own final hidden states at the
right positions, its chains keep the output the target's greedy, and a pair it cannot serve is
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import assert_lossless, make_engine
from specd.engine import CompletionRequest
from specd.engine.caches import KVState
from specd.engine.feature_head import FeatureHead, HeadConfig, lookup_guesses
from specd.engine.forward.lean import LeanForward
from specd.engine.head_state import HeadState
from specd.engine.models import load_pair
from specd.engine.types import ModelLoadError


def make_head(target_dir, out, seed: int = 0, guess: bool = True):
    """A head for the tiny target: its every token scored, the layer randomly disturbed from its
    identity start (so it predicts something other than the state it reads); ``guess``: reading
    prompt lookup's guess at each position, as heads are trained now."""
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    c = model.config
    torch.manual_seed(seed)
    vocab = torch.arange(c.vocab_size - 7)  # a reduced vocabulary: the last few ids never drafted
    head = FeatureHead(HeadConfig(c.hidden_size, c.num_attention_heads, c.intermediate_size, c.vocab_size,
                                  getattr(c, "rope_theta", 10000.0), c.rms_norm_eps, guess=guess),
                       vocab, model.get_output_embeddings().weight.detach()[vocab].clone(),
                       model.get_input_embeddings().weight.detach())
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head.save(out)
    return out, head


@pytest.fixture(scope="module")
def head_pair(llama_pair, tmp_path_factory):
    target, _ = llama_pair
    folder, head = make_head(target, tmp_path_factory.mktemp("head") / "head")
    return target, folder, head


@pytest.mark.parametrize("guess", [True, False], ids=["reading-lookups-guess", "states-and-tokens-only"])
def test_the_head_reads_the_targets_states_one_position_behind(llama_pair, tmp_path, guess):
    target_dir, _ = llama_pair
    _, head = make_head(target_dir, tmp_path / "head", guess=guess)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    target = KVState(model, LeanForward(model, transposed_weights="off"))
    state = HeadState(head, target)
    torch.manual_seed(1)
    seq = torch.randint(0, 12, (40,)).tolist()  # few distinct ids: most positions have a guess
    target.extend(seq[:30], last_only=True)  # the target has run the prompt but its last token

    def window(end: int) -> torch.Tensor:
        """What the whole-window forward predicts after ``seq[:end + 1]``: position p reads token
        p, the target's state at p - 1 and lookup's guess from the tokens before p."""
        guesses = torch.tensor([lookup_guesses(seq[:end + 1], 1, end + 1)]) if guess else None
        with torch.no_grad():
            return head.scores(head(hidden[:, :end], torch.tensor([seq[1:end + 1]]), guesses)[0, -1])

    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state  # [1, 40, D]
    got = state.logits_after(seq[:31])[0]
    torch.testing.assert_close(got[head.vocab], window(30), atol=2e-4, rtol=2e-4)
    assert torch.isinf(got[-7:]).all()  # never a token outside its vocabulary

    # A drafted chain reads the head's own predictions; once the target has run those tokens,
    # the next draft reads the target's states again, as a head that never drafted would.
    state.extend(seq[31:34], last_only=True)
    target.extend(seq[30:36])
    again = state.logits_after(seq[:37])[0]
    torch.testing.assert_close(again[head.vocab], window(36), atol=2e-4, rtol=2e-4)


def test_completions_with_the_head_drafting_are_the_targets_greedy(head_pair, sample_source):
    target, folder, _ = head_pair
    engine = make_engine(target, folder, prefix_tokens=384, suffix_tokens=128)
    assert engine.paths["draft"][0].name == "feature-head"
    text, drafted = sample_source, 0
    # the head alone, then beside lookup (token trees of both, whose kept path moves the
    # target's states as it moves its cache)
    for at, lookup in ((len(text) // 3, False), (len(text) // 2, False), (len(text) // 2 + 7, True), (len(text) // 4, True)):
        text = text[:at] + "value = " + text[at:]
        result = engine.complete(CompletionRequest(text=text, offset=at + 8, uri="file:///head.py", max_tokens=24,
                                                   use_draft_model=True, use_lookup=lookup))
        assert_lossless(engine, result, 24)
        drafted += result.sources["draft"].proposed if "draft" in result.sources else 0
    assert drafted > 0  # the head drafted, and what it drafted was verified away or kept
    stats = json.loads(json.dumps(engine.stats()))  # status reads it: plain data
    assert stats["planner"]["draft_agreement"] is not None


def test_a_loaded_head_scores_with_the_targets_lm_head_which_its_file_does_not_hold(head_pair):
    from safetensors.torch import load_file

    target, folder, head = head_pair
    assert "rows" not in load_file(str(folder / "head.safetensors"))
    pair = load_pair(str(target), str(folder))
    lm_head = pair.target.get_output_embeddings().weight.detach()
    # the tiny Llama's LM head is untied: the rows are its, not the input embeddings'
    assert not torch.equal(lm_head, pair.target.get_input_embeddings().weight.detach())
    assert torch.equal(pair.draft.rows, lm_head[head.vocab].float())
    assert pair.draft.config.guess
    states, tokens, guesses = torch.randn(3, pair.target.config.hidden_size), torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 5, 2]])
    with torch.no_grad():
        torch.testing.assert_close(pair.draft.scores(pair.draft(states[None], tokens, guesses)),
                                   head.scores(head(states[None], tokens, guesses)))


def test_a_head_is_refused_where_the_target_gives_no_states(head_pair, tmp_path):
    target, folder, _ = head_pair
    with pytest.raises(ModelLoadError, match="feature head.*llama.cpp"):
        load_pair(str(tmp_path / "model.gguf"), str(folder))
    with pytest.raises(ModelLoadError, match="feature head.*does not give them"):
        make_engine(target, folder, fast_forward=False)


def test_a_head_keeps_the_target_on_torch_when_the_forward_is_left_to_auto(head_pair):
    target, folder, _ = head_pair
    engine = make_engine(target, folder, forward_backend="auto")
    assert engine.paths["target"][0].name == "lean"
    assert "feature head" in engine.paths["target"][1]


def test_the_bench_runs_a_head_draft_and_skips_what_cannot_run_it(head_pair, corpus_dir, tmp_path):
    from bench_helpers import bench_cli, module_bench_env

    target, folder, _ = head_pair
    with module_bench_env(tmp_path):
        code, stdout, _ = bench_cli("--methods", "specd,specd_no_draft,hf_assisted", "--workloads", "line", "--limit", "2",
                                    "--max-tokens", "8", "--json", "--no-forward-costs", "--costs", "gpu",
                                    pair=(target, folder), corpus=corpus_dir)
    assert code == 0
    report = json.loads(stdout)
    assert report["identical"] is True
    assert "feature head" in report["skipped_methods"]["hf_assisted"]
    assert set(report["workloads"]["line"]["methods"]) >= {"specd", "specd_no_draft"}


def test_the_targets_states_follow_its_cache_through_a_token_tree(llama_pair):
    """After a token tree's forward and ``keep`` of one path, the kept states are that path's, as
    a plain run of it would keep them."""
    model = AutoModelForCausalLM.from_pretrained(llama_pair[0]).eval()
    torch.manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (12,)).tolist()
    tree, parents = [5, 9, 17, 23, 31], [-1, 0, 0, 2, 3]  # 5 -> {9, 17 -> 23 -> 31}
    kept = [0, 2, 3]  # the path 5, 17, 23

    def state():
        s = KVState(model, LeanForward(model, transposed_weights="off"))
        s.keeps_features = True
        s.extend(prompt, last_only=True)
        return s

    grown, plain = state(), state()
    grown.extend_tree(tree, parents)
    grown.keep(len(prompt), kept)
    plain.extend([tree[i] for i in kept])
    assert grown.ids == plain.ids
    torch.testing.assert_close(grown.features(0, len(plain.ids)), plain.features(0, len(plain.ids)), atol=1e-4, rtol=1e-4)
    grown.rollback(len(prompt) + 1)
    assert grown.features(0, len(prompt) + 2) is None and grown.features(0, len(prompt) + 1) is not None


def test_a_head_starting_on_a_long_prompt_reads_back_only_its_last_positions(head_pair):
    from specd.engine.head_state import READ_BACK

    target_dir, _, head = head_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    target = KVState(model, LeanForward(model, transposed_weights="off"))
    state = HeadState(head, target)
    seq = torch.randint(0, model.config.vocab_size, (150,)).tolist()
    target.extend(seq[:-1], last_only=True)
    got = state.logits_after(seq)[0]
    assert state.cache.length == READ_BACK and len(state.ids) == len(seq)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state
        start = len(seq) - READ_BACK  # positions start .. len - 1 read, each with the state before it
        # lookup's guesses read the whole document before each position, as prompt lookup does
        guesses = torch.tensor([lookup_guesses(seq, start)])
        expected = head.scores(head(hidden[:, start - 1:-1], torch.tensor([seq[start:]]), guesses)[0, -1])
    torch.testing.assert_close(got[head.vocab], expected, atol=2e-4, rtol=2e-4)


def test_a_prefill_reads_nothing_and_the_next_draft_reads_back_what_it_needs(head_pair):
    target_dir, _, head = head_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    target = KVState(model, LeanForward(model, transposed_weights="off"))
    state, fresh = HeadState(head, target), HeadState(head, target)
    seq = torch.randint(0, model.config.vocab_size, (120,)).tolist()
    for end in (40, 80, 119):  # a prompt prefilled in pieces, the target first, as DocumentState does
        target.prefill(seq[:end])
        state.prefill(seq[:end])
        assert state.ids == seq[:end] and state.cache.length == 0
    torch.testing.assert_close(state.logits_after(seq), fresh.logits_after(seq))


def test_a_long_session_keeps_the_heads_cache_to_its_window(head_pair):
    """Past twice the target's feature window the head's cache drops its oldest positions (its
    tensors were made in inference mode, and so is the drop); drafting goes on."""
    from specd.engine.caches import FEATURE_WINDOW

    target_dir, _, head = head_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    target = KVState(model, LeanForward(model, transposed_weights="off"))
    state = HeadState(head, target)
    seq = torch.randint(0, model.config.vocab_size, (3 * FEATURE_WINDOW,)).tolist()
    for end in range(40, len(seq), 24):  # keystrokes: the target runs a step's tokens, the head drafts after
        target.extend(seq[len(target.ids):end - 1], last_only=True)
        rows = state.logits_after(seq[:end])
        assert torch.isfinite(rows[0, head.vocab]).all()
    assert FEATURE_WINDOW <= state.cache.length <= 2 * FEATURE_WINDOW


def test_the_loads_agreement_sample_is_read_by_the_head_at_every_position(head_pair):
    """The load's calibration times the target's verifies after it read the sample; the head
    reads the sample first, while the target still holds a state at every position, so its
    agreement is the one a head reading the whole sample gets."""
    from specd.engine.speculation.agreement import next_tokens
    from specd.engine.speculation.costs import calibrate

    target_dir, _, head = head_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()

    def target_state():
        state = KVState(model, LeanForward(model, transposed_weights="off"))
        state.keeps_features = True
        return state

    context = torch.randint(0, model.config.vocab_size, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    sample = calibrate(target_state, lambda target: HeadState(head, target), model.config.vocab_size, 17,
                       torch.device("cpu"), context=context).sample
    target = target_state()
    next_tokens(target, context, model.config.vocab_size)
    whole, _ = next_tokens(HeadState(head, target), context, model.config.vocab_size)
    assert sample.draft_next == whole
    # and its chains' second tokens as a chain drafts them, where the head agreed and the code
    # went on with that token
    chained = sample.chained_next
    assert chained is not None and len(chained) == len(context)
    kept = [i for i, token in enumerate(chained) if token >= 0]
    assert all(sample.target_next[i] == sample.draft_next[i] == context[i + 1] for i in kept)


def test_a_heads_chained_second_token_is_the_one_drafting_a_chain_gives(head_pair):
    """``HeadState.chained_next`` (the load's measure of a head's chains, batched) gives at each
    position what drafting does: the head's first token there, then the token after it read
    with the head's own predicted state, the target not having run it."""
    target_dir, _, head = head_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    seq = torch.randint(0, 12, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = KVState(model, LeanForward(model, transposed_weights="off"))
    tokens, confidence = HeadState(head, whole).chained_next([]) or ([], [])  # nothing to read
    assert tokens == []
    whole.extend(seq)  # the target runs the whole sample and keeps every state
    tokens, confidence = HeadState(head, whole).chained_next(seq)
    assert tokens[0] == -1 and len(tokens) == len(confidence) == len(seq)
    for i in (3, 17, 38):
        target = KVState(model, LeanForward(model, transposed_weights="off"))
        state = HeadState(head, target)
        target.extend(seq[:i], last_only=True)  # a request's target: it has run up to the token at i
        first = int(state.logits_after(seq[:i + 1])[0].argmax())
        row = state.logits_after(seq[:i + 1] + [first])[0]  # the chain's second token
        assert int(row.argmax()) == tokens[i], i
        assert float(torch.softmax(row, -1).max()) == pytest.approx(confidence[i], abs=1e-4)
