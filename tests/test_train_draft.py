"""``specd train-draft`` end to end on a tiny random target: the draft's files, its tokenizer
shared with the target, the report, resuming after a stop and after Ctrl-C, refusing a
checkpoint of other settings, and the draft loading as ``model.draft`` in an engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_helpers import make_engine  # noqa: E402

from specd.cli import main  # noqa: E402
from specd.distill import train as trainer  # noqa: E402
from specd.distill.report import tokens_per_forward  # noqa: E402
from specd.engine.models import tokenizer_fingerprint  # noqa: E402
from specd.engine.types import CompletionRequest  # noqa: E402

HELDOUT = Path(__file__).parent / "data" / "sample_module.py"
CORPUS_FILES = ("textwrap.py", "bisect.py", "colorsys.py", "fnmatch.py")  # of the standard library
# Seconds of budget: the teacher's share and the training's on a model this small.
SHORT_MINUTES, LONGER_MINUTES = 0.03, 0.06
TINY = ["--hidden", "32", "--layers", "1", "--seq-len", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, held-out): a few standard-library modules, and the tests' sample module."""
    import sysconfig

    root = tmp_path_factory.mktemp("code")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (root / "corpus").mkdir()
    (root / "heldout").mkdir()
    for name in CORPUS_FILES:
        shutil.copyfile(stdlib / name, root / "corpus" / name)
    shutil.copyfile(HELDOUT, root / "heldout" / HELDOUT.name)
    return root / "corpus", root / "heldout"


def _train(folders, target: Path, out: Path, minutes: float, *extra: str, tiny=TINY) -> int:
    corpus, heldout = folders
    return main(["train-draft", "--target", str(target), "--corpus", str(corpus), "--heldout", str(heldout),
                 "--minutes", str(minutes), "--out", str(out), *tiny, *extra])


def _state(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "state.json").read_text())["progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_root, folders):
    """One short run into a fresh folder, then the same command with a longer budget."""
    from tiny import make_tiny_pair

    target, _ = make_tiny_pair(tiny_root / "llama", "llama")
    out = tmp_path_factory.mktemp("train-draft") / "out"
    assert _train(folders, target, out, SHORT_MINUTES, "--gguf", "f32") == 0
    first = _state(out)
    first_report = (out / "TRAINING.md").read_text()
    assert _train(folders, target, out, LONGER_MINUTES, "--gguf", "f32") == 0
    return target, out, first, first_report


def test_writes_a_draft_folder_a_gguf_file_and_the_report(trained):
    target, out, first, first_report = trained
    draft = out / "draft"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (draft / name).is_file(), name
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "draft.f32.gguf").is_file()
    report = (out / "TRAINING.md").read_text()
    for heading in ("## Agreement on held-out code", "## Step costs", "## What the agreement predicts"):
        assert heading in report
    figures = json.loads((out / "figures.json").read_text())
    assert 0.0 <= figures["agreement"] <= 1.0
    assert figures["heldout_files"] == 1 and figures["heldout_tokens"] > 0
    for path in ("hf", "lean", "llamacpp"):
        cost = figures["costs"][path]
        assert cost["draft_ms"] > 0 and cost["target_ms"]["1"] > 0, path


def test_the_draft_shares_the_targets_tokenizer_files(trained):
    target, out, _, _ = trained
    assert tokenizer_fingerprint(str(out / "draft")) == tokenizer_fingerprint(str(target))


def test_the_held_out_file_is_never_trained_on(trained, folders):
    _, out, _, _ = trained
    corpus = torch.load(out / "checkpoint" / "corpus.pt", weights_only=False)
    assert corpus["heldout_files"] == [str((folders[1] / HELDOUT.name).resolve())]
    assert corpus["train_files"] == len(CORPUS_FILES)


def test_the_same_command_goes_on_from_the_checkpoint(trained):
    _, out, first, _ = trained
    second = _state(out)
    assert second["resumes"] == 1
    assert second["teacher_done"] and second["taught"] == first["taught"]  # the teacher's work is kept
    assert second["step"] > first["step"] and second["train_s"] > first["train_s"]
    assert "1 resume" in (out / "TRAINING.md").read_text()


def test_the_draft_loads_as_model_draft_in_an_engine(trained, sample_source):
    target, out, _, _ = trained
    engine = make_engine(target, out / "draft")
    assert engine.pair.draft is not None
    result = engine.complete(CompletionRequest(uri="file:///sample.py", text=sample_source, offset=len(sample_source) // 2, max_tokens=8))
    assert result.token_ids


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stop_keeps_a_checkpoint_that_the_next_run_goes_on_from(trained, folders, tmp_path, monkeypatch, stop):
    """Ctrl-C, or a SIGTERM from outside (kill, a service manager; a background job ignores Ctrl-C)."""
    import os
    import signal

    target, _, _, _ = trained
    out = tmp_path / "out"
    real_step = trainer.train_step
    calls = []

    def interrupted_step(*args):
        calls.append(1)
        if len(calls) == 3:
            if stop == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise KeyboardInterrupt
        return real_step(*args)

    monkeypatch.setattr(trainer, "train_step", interrupted_step)
    assert _train(folders, target, out, SHORT_MINUTES) == trainer.EXIT_INTERRUPTED
    state = _state(out)
    assert state["step"] == 2 and state["teacher_done"]
    assert (out / "checkpoint" / "student.pt").is_file() and not (out / "draft").exists()
    monkeypatch.setattr(trainer, "train_step", real_step)
    assert _train(folders, target, out, SHORT_MINUTES) == 0
    assert _state(out)["resumes"] == 1 and (out / "draft" / "model.safetensors").is_file()


def test_a_checkpoint_of_other_settings_is_refused(trained, folders, tmp_path, capsys):
    target, out, _, _ = trained
    copy = tmp_path / "copy"
    shutil.copytree(out / "checkpoint", copy / "checkpoint")
    wider = ["--hidden", "48", *TINY[2:]]
    assert _train(folders, target, copy, SHORT_MINUTES, tiny=wider) == 1
    assert "other settings (shape)" in capsys.readouterr().err


def test_help_explains_the_command(capsys):
    with pytest.raises(SystemExit):
        main(["train-draft", "--help"])
    text = capsys.readouterr().out
    for words in ("--target", "--corpus", "--heldout", "--minutes", "--out", "--gguf", "TRAINING.md", "Ctrl-C"):
        assert words in text


def test_no_corpus_is_a_usage_error(capsys):
    assert main(["train-draft", "--minutes", "0.01"]) == 2
    assert "--corpus" in capsys.readouterr().err


def test_a_device_torch_cannot_use_is_refused_in_one_line(tiny_root, folders, tmp_path, capsys):
    from tiny import make_tiny_pair

    from specd.distill.teacher import resolve_device

    target, _ = make_tiny_pair(tiny_root / "llama", "llama")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    capsys.readouterr()
    # cuda:99: past the devices torch sees, with CUDA or without ("sees no CUDA device")
    for device, why in (("cuda:99", "--device cuda:99: "), ("cuda:99", "CUDA device"),
                        ("xpu", "--device xpu: train-draft runs on the CPU or a CUDA device"),
                        ("toaster", "'toaster' is not a device name")):  # model.device's own check
        assert _train(folders, target, tmp_path / device, SHORT_MINUTES, "--device", device) == 2
        err = capsys.readouterr().err
        assert err.startswith("specd") and why in err and err.count("\n") == 1, err
        assert not (tmp_path / device).exists()  # refused before any work


def test_tokens_per_forward():
    assert tokens_per_forward(0.0, 4) == 1.0
    assert tokens_per_forward(1.0, 4) == 5.0
    assert tokens_per_forward(0.5, 2) == pytest.approx(1.75)


def test_a_gguf_target_gets_a_gguf_draft_that_the_engine_pairs_with_it(trained, folders, tmp_path):
    """A GGUF target teaches from its dequantized folder; its draft is written as a GGUF file
    too (the engine pairs a GGUF target only with one), of the same vocabulary in llama.cpp."""
    from specd.engine.models import load_gguf_pair
    from specd.llamacpp.export import cached_gguf

    target, _, _, _ = trained
    target_gguf = cached_gguf(target, "f32")
    out = tmp_path / "out"
    assert _train(folders, target_gguf, out, SHORT_MINUTES) == 0
    draft = out / f"draft.{trainer.DEFAULT_GGUF_TYPE}.gguf"
    assert draft.is_file() and (out / "draft" / "model.safetensors").is_file()
    figures = json.loads((out / "figures.json").read_text())
    assert figures["served"].startswith("llama.cpp") and 0.0 <= figures["agreement"] <= 1.0
    assert set(figures["costs"]) == {"hf", "lean", "llamacpp"}
    pair = load_gguf_pair(str(target_gguf), str(draft))
    assert pair.draft is not None


class _Chars:
    """A tokenizer of one id per character, enough for cutting windows."""

    @staticmethod
    def encode(text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_a_small_held_out_budget_spans_many_files(tmp_path):
    """A held-out sample of a few thousand tokens is not filled by the first file drawn (a
    generated table of numbers, say): each file gives at most its share, from its middle."""
    from specd.distill.corpus import token_windows

    files = []
    for i, size in enumerate([5000, 300, 300, 300, 300, 300, 300, 300]):
        path = tmp_path / f"f{i}.py"
        path.write_text(chr(ord("a") + i) * size)
        files.append(path)
    one_file, _ = token_windows(_Chars, files, 16, seed=0, max_tokens=1024)
    spread, _ = token_windows(_Chars, files, 16, seed=0, max_tokens=1024, per_file=128)
    letters = {chr(t) for window in spread for t in window}
    assert len(letters) == len(files) and len(spread) <= 1024 // 16
    assert all(len(window) == 16 for window in spread)
    assert len({chr(t) for window in one_file for t in window}) < len(files)  # without: a few files fill it
