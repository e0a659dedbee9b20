"""The embedded demo model pair: a tiny target + draft trained here on CPU.

``specd train-demo`` (``specd.demo.train``) writes it; the engine falls back to it when no
model is configured. Loading it needs only transformers: each directory is an ordinary
Hugging Face model folder.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "pair"
TARGET_SUBDIR = "target"
DRAFT_SUBDIR = "draft"
# Files that make a directory a usable model; a half-written pair counts as absent.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _is_model_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def demo_pair_paths(root: Path | None = None) -> tuple[Path, Path] | None:
    """(target dir, draft dir) of the trained demo pair, or None if it has not been trained."""
    root = Path(root) if root is not None else DEMO_DIR
    target, draft = root / TARGET_SUBDIR, root / DRAFT_SUBDIR
    if _is_model_dir(target) and _is_model_dir(draft):
        return target, draft
    return None
