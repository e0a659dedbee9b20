"""The demo trainer's command-line options, defined once for ``specd train-demo`` and
``python -m specd.demo.train``. The standard library only: ``specd --help`` builds every
subcommand's parser, and giving these options must not load the trainer, its data or torch."""

from __future__ import annotations

import argparse

# transformers config and model classes per --arch; both get tied embeddings and no biases added.
ARCHS: dict[str, tuple[str, str]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}
# The keys of specd.demo.train.PRESETS and specd.demo.data.FIM_FORMATS, spelled out so that the
# options load neither module (tests/test_train_options.py keeps them in step).
PRESET_NAMES = ("dev-llama", "full", "tiny")
FIM_FORMAT_NAMES = ("qwen", "starcoder")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainer's options, shared by ``specd train-demo`` and ``python -m specd.demo.train``."""
    parser.add_argument("--out", metavar="DIR", help="output directory (default: the package's demo folder)")
    parser.add_argument("--minutes", type=float, help="training-loop time budget in minutes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=PRESET_NAMES, default="full",
                        help="model and batch sizes ('tiny' is a seconds-long smoke run; 'dev-llama' the "
                             "second development pair, see dev-pairs/)")
    parser.add_argument("--arch", choices=sorted(ARCHS), help="model architecture (default: the preset's)")
    parser.add_argument("--fim-format", choices=FIM_FORMAT_NAMES,
                        help="special tokens and FIM layouts (default: the preset's; 'starcoder' is PSM only)")
    parser.add_argument("--distill-weight", type=float, metavar="W",
                        help="final weight of the draft's KL to the target (0: the draft learns from data alone)")
    parser.add_argument("--repo-rate", type=float, metavar="R",
                        help="share of FIM samples that begin with other files' chunks, most holding a near-twin "
                             "of the middle (default: the preset's)")
    parser.add_argument("--init", metavar="DIR",
                        help="go on training this pair (its tokenizer, sizes and weights; lower peak learning "
                             "rates) instead of a fresh one")
