"""``specd train-draft --head`` on a tiny random target: the feature head's folder and how it loads,
its vocabulary and rows, the report, resuming (after a longer budget and after Ctrl-C), refusing
a checkpoint of other settings and the options that shape the small draft; the teacher's states
and the second drafted token's batched evaluation against the head's own step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_train_draft import LONGER_MINUTES, SHORT_MINUTES, _state, _train, folders  # noqa: E402,F401

from specd.cli import main  # noqa: E402
from specd.distill import head as head_training  # noqa: E402
from specd.distill import train as trainer  # noqa: E402
from specd.engine.feature_head import FeatureHead, HeadCache, HeadConfig, lookup_guesses  # noqa: E402

VOCAB = 64
TINY_HEAD = ["--head", "--head-vocab", str(VOCAB), "--seq-len", "32", "--threads", "1"]


def _target_model(target: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def head_trained(tmp_path_factory, tiny_root, folders):  # noqa: F811
    """One short --head run into a fresh folder, then the same command with a longer budget."""
    from tiny import make_tiny_pair

    target, _ = make_tiny_pair(tiny_root / "llama", "llama")
    out = tmp_path_factory.mktemp("train-head") / "out"
    assert _train(folders, target, out, SHORT_MINUTES, tiny=TINY_HEAD) == 0
    first = _state(out)
    assert _train(folders, target, out, LONGER_MINUTES, tiny=TINY_HEAD) == 0
    return target, out, first


def test_writes_a_head_folder_that_loads_against_the_targets_embeddings(head_trained):
    from safetensors.torch import load_file

    target, out, _ = head_trained
    folder = out / head_training.HEAD_SUBDIR
    assert (folder / "head.json").is_file() and (folder / "head.safetensors").is_file()
    assert not (out / "draft").exists()
    model = _target_model(target)
    lm_head = model.get_output_embeddings().weight.detach()
    head = FeatureHead.load(folder, model.get_input_embeddings().weight.detach(), lm_head)
    tc = model.config
    assert (head.config.hidden, head.config.heads, head.config.intermediate) == \
        (tc.hidden_size, tc.num_attention_heads, tc.intermediate_size)
    assert head.config.vocab_size == lm_head.shape[0]
    assert head.config.guess  # a trained head reads prompt lookup's guess
    assert len(head.vocab) == VOCAB and len(set(head.vocab.tolist())) == VOCAB
    # its rows are the target's LM-head rows of its tokens, untouched by training (the training's
    # checkpoint holds them); the head's file leaves them to the target
    trained = torch.load(out / "checkpoint" / head_training.HEAD_CHECKPOINT, weights_only=False)["model"]
    assert torch.equal(trained["rows"], lm_head[trained["vocab"]])
    assert "rows" not in load_file(str(folder / "head.safetensors"))
    figures = json.loads((out / "figures.json").read_text())
    assert head.config.trained["agreement"] == round(figures["agreement"], 4)
    assert head.config.trained["tokens"] == _state(out)["tokens"] > 0
    assert head.config.target == {"name": str(target)}


def test_the_vocabulary_is_the_most_frequent_tokens_of_what_the_teacher_read_and_emitted(head_trained):
    _, out, _ = head_trained
    corpus = torch.load(out / "checkpoint" / "corpus.pt", weights_only=False)
    state = _state(out)
    greedy = torch.cat([torch.load(out / "checkpoint" / f"teacher-{i:05d}.pt", weights_only=False)["greedy"]
                        for i in range(state["shards"])])
    read = corpus["train"][:state["taught"]]
    head = torch.load(out / "checkpoint" / "head.pt", weights_only=False)["model"]
    size = 1 + max(int(read.max()), int(greedy.max()), int(head["vocab"].max()))
    counts = torch.bincount(read.flatten().long(), minlength=size) + torch.bincount(greedy.flatten().long(),
                                                                                     minlength=size)
    chosen = counts[head["vocab"]]
    others = counts.clone()
    others[head["vocab"]] = -1
    assert chosen.min() >= others.max()


def test_the_report_says_what_the_head_is_its_agreement_and_its_step(head_trained):
    _, out, _ = head_trained
    report = (out / "TRAINING.md").read_text()
    figures = json.loads((out / "figures.json").read_text())
    assert 0.0 <= figures["agreement"] <= 1.0 and 0.0 <= figures["second"] <= 1.0
    assert f"**{figures['agreement']:.1%}**" in report and f"**{figures['second']:.1%}**" in report
    assert f"**{figures['coverage']:.1%}**" in report
    assert "Feature head" in report and f'draft = "{out / "head"}"' in report
    assert figures["head_ms"] > 0
    for path in ("hf", "lean"):
        assert figures["costs"][path]["ratio"] > 0, path
        assert f"| {path} | {figures['head_ms']:.2f} |" in report


def test_the_same_command_goes_on_from_the_checkpoint(head_trained):
    _, out, first = head_trained
    second = _state(out)
    assert second["resumes"] == 1
    assert second["teacher_done"] and second["taught"] == first["taught"]
    assert second["step"] > first["step"] and second["train_s"] > first["train_s"]
    assert "1 resume" in (out / "TRAINING.md").read_text()


def test_ctrl_c_keeps_the_heads_checkpoint_that_the_next_run_goes_on_from(head_trained, folders, tmp_path,  # noqa: F811
                                                                           monkeypatch):
    target, _, _ = head_trained
    out = tmp_path / "out"
    real_step = head_training.head_train_step
    calls = []

    def interrupted_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args)

    monkeypatch.setattr(head_training, "head_train_step", interrupted_step)
    assert _train(folders, target, out, SHORT_MINUTES, tiny=TINY_HEAD) == trainer.EXIT_INTERRUPTED
    assert _state(out)["step"] == 2 and (out / "checkpoint" / "head.pt").is_file()
    saved = torch.load(out / "checkpoint" / "head.pt", weights_only=False)["model"]
    monkeypatch.setattr(head_training, "head_train_step", real_step)
    assert _train(folders, target, out, SHORT_MINUTES, tiny=TINY_HEAD) == 0
    assert _state(out)["resumes"] == 1 and _state(out)["step"] > 2
    head = torch.load(out / "checkpoint" / "head.pt", weights_only=False)["model"]
    assert torch.equal(head["vocab"], saved["vocab"])  # the resumed head kept its vocabulary


@pytest.mark.parametrize("other, differs", [(["--head-vocab", "32"], "head_vocab)"), ([], "head, ")])
def test_a_checkpoint_of_other_settings_is_refused(head_trained, folders, tmp_path, capsys, other, differs):  # noqa: F811
    target, out, _ = head_trained
    copy = tmp_path / "copy"
    shutil.copytree(out / "checkpoint", copy / "checkpoint")
    tiny = (["--head", *other] if other else []) + ["--seq-len", "32", "--threads", "1"]
    assert _train(folders, target, copy, SHORT_MINUTES, tiny=tiny) == 1
    assert f"other settings ({differs}" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--gguf"], ["--hidden", "64"], ["--layers", "1"]])
def test_options_that_shape_the_small_draft_are_refused_with_head(option, capsys, tmp_path):
    assert main(["train-draft", "--head", "--corpus", str(tmp_path), "--out", str(tmp_path / "out"), *option]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option[0] in err and "--head" in err
    assert not (tmp_path / "out").exists()


def test_head_vocab_without_head_is_refused(capsys, tmp_path):
    assert main(["train-draft", "--head-vocab", "100", "--corpus", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--head-vocab" in err and "--head" in err
    assert not (tmp_path / "out").exists()


def test_help_names_the_head(capsys):
    with pytest.raises(SystemExit):
        main(["train-draft", "--help"])
    text = capsys.readouterr().out
    assert "--head" in text and "--head-vocab" in text


def test_the_teachers_states_are_what_its_lm_head_scores(tiny_root):
    from tiny import make_tiny_pair

    from specd.distill.teacher import teach_states

    model = _target_model(make_tiny_pair(tiny_root / "llama", "llama")[0])
    windows = torch.randint(0, model.config.vocab_size, (3, 12))
    states, greedy = teach_states(model, windows, batch=2)
    with torch.no_grad():
        logits = model(input_ids=windows).logits
        scored = model.get_output_embeddings()(states.float())
    assert states.dtype == torch.bfloat16 and states.shape == (3, 12, model.config.hidden_size)
    assert torch.equal(greedy.long(), logits.argmax(-1))
    assert torch.allclose(scored, logits, atol=0.05 * float(logits.abs().max()))


@pytest.mark.parametrize("guess", [False, True])
def test_the_second_drafted_state_is_the_heads_own_step_after_the_true_ones(guess):
    """The batched evaluation of the second token is what drafting computes with ``step``: the
    true positions up to t in the cache, then the predicted state and the target's token (and,
    for a head reading them, lookup's guesses as drafting computes them, the drafted token in
    place of the window's)."""
    torch.manual_seed(0)
    config = HeadConfig(hidden=32, heads=4, intermediate=48, vocab_size=50, guess=guess)
    vocab = torch.arange(20)
    embedding = torch.randn(50, 32)
    head = FeatureHead(config, vocab, embedding[vocab], embedding).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
        window = torch.randint(0, 6, (1, 8))  # few distinct ids: guesses at most positions
        features, tokens, emitted = torch.randn(1, 7, 32), window[:, 1:], torch.randint(0, 6, (1, 7))
        guesses = head_training.window_guesses(head, window)
        following = None if guesses is None else guesses[:, 1:]
        second_guesses = head_training.emitted_guesses(head, window, emitted)
        predicted = head(features, tokens, following)
        batched = head.second(features, tokens, predicted, emitted, following, second_guesses)
        for t in range(7):
            cache = HeadCache()
            head.step(features[0, :t + 1], tokens[0, :t + 1], cache, None if guess is False else following[0, :t + 1])
            drafted = window[0, :t + 2].tolist() + [int(emitted[0, t])]  # the document as drafting has it
            guess_t = torch.tensor(lookup_guesses(drafted, t + 2)) if guess else None
            stepped = head.step(predicted[0, t:t + 1], emitted[0, t:t + 1], cache, guess_t)
            assert torch.allclose(stepped[0], batched[0, t], atol=1e-5), t
    if guess:  # with the window's own next tokens emitted, the guesses are the window's
        assert torch.equal(head_training.emitted_guesses(head, window, window[:, 2:]), guesses[:, 2:])


def test_chain_tokens():
    from specd.distill.report import chain_tokens, tokens_per_forward

    assert chain_tokens(0.0, 0.9, 4) == 1.0
    assert chain_tokens(0.5, 0.5, 2) == pytest.approx(tokens_per_forward(0.5, 2))
    assert chain_tokens(0.4, 1.0, 3) == pytest.approx(2.2)


def test_a_head_step_learns_the_next_state_and_trains_only_the_layer():
    torch.manual_seed(0)
    config = HeadConfig(hidden=16, heads=2, intermediate=24, vocab_size=40)
    embedding = torch.randn(40, 16)
    vocab = torch.arange(0, 40, 2)
    head = head_training.build_head(config, vocab, embedding.clone(), embedding)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    windows = torch.randint(0, 40, (2, 10))
    states = torch.randn(2, 10, 16).to(torch.bfloat16)
    rows = head.rows.clone()

    def loss() -> float:
        with torch.no_grad():
            return float(head_training.head_loss(head, head(states[:, :-1].float(), windows[:, 1:]),
                                                 states[:, 1:].float())[0])

    def second_loss() -> float:
        """A chain's second step: the head reading its own prediction (``FeatureHead.second``)."""
        with torch.no_grad():
            features, tokens = states[:, :-1].float(), windows[:, 1:]
            predicted = head(features, tokens)
            drafted = head.second(features[:, :-1], tokens[:, :-1], predicted[:, :-1], windows[:, 2:])
            return float(head_training.head_loss(head, drafted, states[:, 2:].float())[0])

    before, second_before = loss(), second_loss()
    for _ in range(30):
        head_training.head_train_step(head, optimizer, windows, states)
    assert loss() < 0.8 * before
    assert second_loss() < 0.8 * second_before  # the step trains the second step too
    assert torch.equal(head.rows, rows) and torch.equal(head.embedding, embedding)
    assert not {"rows", "vocab", "embedding"} & {name for name, _ in head.named_parameters()}


def test_the_step_teaches_the_head_to_read_its_own_predictions():
    """Trained on true states alone, the second step (the head reading its own prediction) lags;
    the training step's second loss closes much of that gap."""
    def trained(chained: bool) -> float:
        torch.manual_seed(0)
        config = HeadConfig(hidden=16, heads=2, intermediate=24, vocab_size=40)
        embedding = torch.randn(40, 16)
        head = head_training.build_head(config, torch.arange(0, 40, 2), embedding.clone(), embedding)
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
        windows = torch.randint(0, 40, (2, 12))
        states = torch.randn(2, 12, 16)
        features, tokens = states[:, :-1], windows[:, 1:]
        for _ in range(60):
            if chained:
                head_training.head_train_step(head, optimizer, windows, states)
            else:  # the first step's loss alone
                head_training.head_loss(head, head(features, tokens), states[:, 1:])[0].backward()
                optimizer.step()
                optimizer.zero_grad()
        with torch.no_grad():
            predicted = head(features, tokens)
            drafted = head.second(features[:, :-1], tokens[:, :-1], predicted[:, :-1], windows[:, 2:])
            return float(head_training.head_loss(head, drafted, states[:, 2:])[0])

    assert trained(chained=True) < 0.8 * trained(chained=False)
