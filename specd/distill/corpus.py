"""The code a draft learns from and the code it is judged on: source files under the corpus
folders, tokenized with the target's tokenizer into fixed-length windows.

Held-out code is never trained on: files under a ``--heldout`` folder are dropped from the
training set even when a corpus folder holds them too; with no held-out folder, a share of the
corpus files (chosen by a hash of their path, so the same files on every run and resume) is
set aside instead.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

# What counts as code: the suffixes of source files in the languages code models are trained on.
CODE_SUFFIXES = frozenset({
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java", ".kt", ".scala", ".js",
    ".jsx", ".ts", ".tsx", ".mjs", ".lua", ".rb", ".php", ".cs", ".swift", ".sh", ".bash", ".zig", ".hs",
    ".ml", ".ex", ".exs", ".erl", ".clj", ".r", ".jl", ".dart", ".vue", ".sql", ".toml", ".cmake",
})
# Folders never walked into below a corpus root (the workspace watcher's defaults, in spirit).
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".tox",
                          ".mypy_cache", ".pytest_cache", ".ruff_cache", ".idea", ".vscode", "dist", "build",
                          "target"})
MAX_FILE_BYTES = 512 * 1024  # larger files are mostly generated tables, not code people type
MIN_FILE_BYTES = 64
HELDOUT_SHARE = 0.05  # of corpus files set aside when no held-out folder is named


class CorpusError(ValueError):
    """No usable code where the corpus was looked for (one line, for the user)."""


def code_files(roots: Iterable[Path]) -> list[Path]:
    """Source files under ``roots`` (a root may be a file), resolved, sorted, without
    duplicates; skipped: ``SKIPPED_DIRS`` and hidden folders below a root, files outside the
    size bounds."""
    found: set[Path] = set()
    for root in roots:
        root = Path(root).expanduser().resolve()
        if root.is_file():
            found.add(root)
            continue
        if not root.is_dir():
            raise CorpusError(f"corpus folder {root} does not exist")
        for path in root.rglob("*"):
            relative = path.relative_to(root).parts[:-1]
            if any(part in SKIPPED_DIRS or part.startswith(".") for part in relative):
                continue
            if path.suffix.lower() in CODE_SUFFIXES and path.is_file() \
                    and MIN_FILE_BYTES <= path.stat().st_size <= MAX_FILE_BYTES:
                found.add(path)
    return sorted(found)


def _set_aside(path: Path) -> bool:
    """Whether ``path`` is one of the ``HELDOUT_SHARE`` of files held out when no folder is."""
    digest = hashlib.sha256(str(path).encode()).digest()
    return int.from_bytes(digest[:4], "big") < HELDOUT_SHARE * 2 ** 32


@dataclass
class Split:
    train: list[Path]
    heldout: list[Path]
    heldout_named: bool  # the held-out files are a named folder's, not a share of the corpus


def split_files(corpus: Sequence[Path], heldout: Sequence[Path]) -> Split:
    """Training and held-out files: ``heldout``'s files never train; without any, a hashed share
    of the corpus is held out."""
    train = code_files(corpus)
    if heldout:
        held = code_files(heldout)
        held_set = set(held)
        train = [p for p in train if p not in held_set]
        named = True
    else:
        held = [p for p in train if _set_aside(p)]
        train = [p for p in train if not _set_aside(p)]
        named = False
    if not train:
        raise CorpusError(f"no code files to train on under {', '.join(map(str, corpus))}")
    if not held:
        raise CorpusError("no held-out code files (name a --heldout folder)")
    return Split(train, held, named)


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def token_windows(tokenizer, files: Sequence[Path], seq_len: int, seed: int, max_tokens: int | None = None,
                  separator: int | None = None, per_file: int | None = None) -> tuple[list[list[int]], int]:
    """(windows, chars): the files, in an order shuffled by ``seed``, tokenized into one stream
    (``separator`` between files) and cut into windows of ``seq_len`` tokens; at most
    ``max_tokens`` of them. ``per_file``: at most this many tokens of each file, from its middle,
    so a small budget spans many files rather than the first one drawn (a held-out sample
    filled by one generated table of numbers measures nothing about code). ``chars``:
    characters read. ``tokenizer``: a transformers tokenizer."""
    order = list(files)
    random.Random(seed).shuffle(order)
    stream: list[int] = []
    chars = 0
    budget = None if max_tokens is None else max_tokens + seq_len
    for path in order:
        text = read_text(path)
        if not text:
            continue
        chars += len(text)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if per_file is not None and len(ids) > per_file:
            middle = (len(ids) - per_file) // 2
            ids = ids[middle:middle + per_file]
        stream.extend(ids)
        if separator is not None:
            stream.append(separator)
        if budget is not None and len(stream) >= budget:
            break
    windows = [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    if max_tokens is not None:
        windows = windows[:max(1, max_tokens // seq_len)]
    return windows, chars
