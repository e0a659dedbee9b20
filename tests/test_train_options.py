"""The trainer's options for a second development pair: Llama, StarCoder FIM tokens, no distillation."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specd.demo import demo_pair_paths  # noqa: E402
from specd.demo.data import FIM_FORMATS, SPECIAL_TOKENS  # noqa: E402
from specd.demo.options import FIM_FORMAT_NAMES, PRESET_NAMES  # noqa: E402
from specd.demo.train import ARCHS, PRESETS, Settings, add_arguments, settings_from_args, train  # noqa: E402
from specd.engine.front.prompt import TEMPLATES, detect_family  # noqa: E402
from specd.engine.types import CompletionRequest  # noqa: E402

STARCODER_TOKENS = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>",
                    "<repo_name>", "<file_sep>"]
SMOKE_MINUTES = 0.05
COMPLETE_TOKENS = 12
DOCUMENT = "import os\n\n\ndef join(a, b):\n    return os.path.join(a, b)\n\n\ndef main():\n    \n"


def _args(**options) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = []
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return parser.parse_args(argv)


def _options(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    return {a.dest: (tuple(a.choices or ()), a.type, a.default) for a in parser._actions if a.dest != "help"}


def test_cli_train_demo_takes_the_trainers_options():
    from specd.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    trainer = argparse.ArgumentParser()
    add_arguments(trainer)
    assert _options(sub.choices["train-demo"]) == _options(trainer)


def test_the_options_name_the_trainers_presets_and_fim_formats():
    """specd.demo.options spells the names out, so that ``specd --help`` loads neither the trainer nor its data."""
    assert sorted(PRESET_NAMES) == sorted(PRESETS)
    assert sorted(FIM_FORMAT_NAMES) == sorted(FIM_FORMATS)


def test_default_preset_is_the_demo_pair():
    settings = settings_from_args(_args())
    assert settings == PRESETS["full"]
    assert (settings.arch, settings.fim_format, settings.fim.family) == ("qwen2", "qwen", "demo")
    assert settings.fim.special_tokens == SPECIAL_TOKENS and settings.fim.spm
    assert settings.spm_rate > 0 and settings.distill_weight > 0


def test_starcoder_format_matches_the_engine_template_and_trains_psm_only():
    fmt = FIM_FORMATS["starcoder"]
    assert fmt.special_tokens == STARCODER_TOKENS
    template = TEMPLATES[fmt.family]
    assert template.spm is None and not fmt.spm
    assert template.psm == (fmt.prefix, "{prefix}", fmt.suffix, "{suffix}", fmt.middle)
    assert (template.repo_name, template.file_sep) == (fmt.repo_name, fmt.file_sep)
    assert settings_from_args(_args(fim_format="starcoder")).spm_rate == 0.0
    with pytest.raises(ValueError, match="spm_rate"):
        Settings(fim_format="starcoder")
    with pytest.raises(ValueError, match="arch"):
        Settings(arch="gpt2")


def test_dev_llama_preset():
    settings = settings_from_args(_args(preset="dev-llama"))
    assert (settings.arch, settings.fim_format, settings.spm_rate, settings.distill_weight) == (
        "llama", "starcoder", 0.0, 0.0)
    assert settings.threads == 1 and settings.vocab_size == 8192 and settings.max_positions == 4096
    assert settings.target.hidden < PRESETS["full"].target.hidden
    assert ARCHS[settings.arch] == ("LlamaConfig", "LlamaForCausalLM")
    assert asdict(settings)["arch"] == "llama"  # recorded in TRAINING.md's settings


def test_llama_starcoder_smoke_run_loads_in_the_engine(tmp_path, monkeypatch):
    from specd.engine.engine import Engine
    from specd.engine.options import EngineOptions

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    settings = settings_from_args(_args(preset="tiny", minutes=SMOKE_MINUTES, arch="llama",
                                        fim_format="starcoder", distill_weight=0))
    threads = torch.get_num_threads()
    try:
        assert train(replace(settings, threads=1), tmp_path, "smoke") == 0
    finally:
        torch.set_num_threads(threads)

    target_dir, draft_dir = demo_pair_paths(tmp_path)
    for model_dir in (target_dir, draft_dir):
        config = json.loads((model_dir / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
        assert json.loads((model_dir / "specd.json").read_text())["fim_family"] == "starcoder"
    tok = transformers.AutoTokenizer.from_pretrained(target_dir)
    assert [tok.encode(t) for t in STARCODER_TOKENS] == [[i] for i in range(len(STARCODER_TOKENS))]
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token is None
    assert detect_family(tok, str(target_dir)).name == "starcoder"
    training_md = (tmp_path / "TRAINING.md").read_text()
    assert "Llama" in training_md and "No distillation" in training_md

    engine = Engine(EngineOptions(target=str(target_dir), draft=str(draft_dir), device="cpu",
                                  dtype="float32", threads=1, max_tokens=COMPLETE_TOKENS,
                                  time_budget_ms=600_000, forward_backend="torch"))
    try:
        engine.ensure_loaded()
        assert engine.template.name == "starcoder"
        result = engine.complete(CompletionRequest(text=DOCUMENT, offset=len(DOCUMENT) - 1,
                                                   stop_at_block_end=False))
    finally:
        torch.set_num_threads(threads)
    # Prefix-suffix-middle order (the middle token may be followed by forced text in an anchored prompt).
    prefix_id, suffix_id, middle_id = tok.convert_tokens_to_ids(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    ids = result.prompt_ids
    assert ids[0] == prefix_id and ids.index(prefix_id) < ids.index(suffix_id) < ids.index(middle_id)

    # --init goes on from this pair: its tokenizer and sizes, new weights, repo-level samples.
    more = tmp_path / "more"
    settings = settings_from_args(_args(preset="tiny", minutes=SMOKE_MINUTES, arch="llama", fim_format="starcoder",
                                        init=tmp_path, repo_rate=1.0))
    assert settings.init == str(tmp_path) and settings.repo_rate == 1.0
    try:
        assert train(replace(settings, threads=1), more, "smoke --init") == 0
    finally:
        torch.set_num_threads(threads)
    more_target, _ = demo_pair_paths(more)
    assert (more_target / "tokenizer.json").read_text() == (target_dir / "tokenizer.json").read_text()
    before = transformers.AutoModelForCausalLM.from_pretrained(target_dir).state_dict()
    after = transformers.AutoModelForCausalLM.from_pretrained(more_target).state_dict()
    assert before.keys() == after.keys() and all(before[k].shape == after[k].shape for k in before)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert "Went on from the pair" in (more / "TRAINING.md").read_text()
    with pytest.raises(ValueError, match="was not trained with --fim-format qwen"):
        train(replace(settings_from_args(_args(preset="tiny", minutes=SMOKE_MINUTES, init=tmp_path)), threads=1),
              tmp_path / "wrong", "smoke")
    assert result.target_forwards >= 1 and result.stop_reason in ("eos", "max_tokens", "single_line")
    assert len(result.token_ids) <= COMPLETE_TOKENS


def test_repo_samples_put_chunks_first_in_the_engines_format_with_a_twin_of_the_middle():
    """Repo-level FIM samples (``Settings.repo_rate``): other files' chunks come first, written
    as specd's prompt builder writes them (so the model sees at training what the engine sends),
    and most hold a near-twin of the text around the middle, which is what the model can learn to
    copy from."""
    import random
    import re

    from specd.demo.data import SampleMaker, train_tokenizer

    files = [(f"pkg/mod{n}.py", "".join(f"def func{n}_{k}(value):\n    return value * {k} + {n}\n\n\n"
                                         for k in range(30))) for n in range(6)]
    settings = replace(settings_from_args(_args(preset="dev-llama", repo_rate=1.0)), vocab_size=400, fim_rate=1.0)
    assert PRESETS["dev-llama"].repo_rate == PRESETS["full"].repo_rate == 0  # the shipped pairs' recipes are unchanged
    fmt = settings.fim
    tok = train_tokenizer((text for _, text in files), settings.vocab_size, fmt.special_tokens)
    maker = SampleMaker(tok, files, settings, random.Random(1))
    twins = 0
    for _ in range(60):
        sample = maker.sample(512)
        text = tok.decode(sample.ids, skip_special_tokens=False)
        head, _, body = text.partition(fmt.prefix)
        middle = tok.decode(sample.ids[sample.loss_from:-1], skip_special_tokens=False)
        if not head:
            continue  # no chunk drawn
        assert head.startswith(f"{fmt.repo_name}workspace\n{fmt.file_sep}")
        chunks = head.split(fmt.file_sep)[1:]
        current = chunks.pop()
        assert re.fullmatch(r"pkg/mod\d\.py\n", current), current  # the current file's path line, last
        assert all(re.match(r"[\w./-]+(\n|$)", chunk) for chunk in chunks), chunks  # a path line, then lines
        twin = [c for c in chunks if not c.startswith("pkg/")]
        if twin and middle.strip() and middle in twin[0].replace("_variant", "").replace("2", ""):
            twins += 1
        assert len(sample.ids) <= 512 and fmt.suffix in body and fmt.middle in body
    assert twins >= 10  # a good share of samples can be completed by copying from a chunk
