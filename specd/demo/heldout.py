"""Which Python standard-library files the demo pair trains on, and which it never sees.

The held-out modules are whole files kept out of training so that evaluation and the
speculative-decoding benchmarks complete code the models have not memorised. They are
pure-Python modules of moderate size (3-30 KB) with a mix of classes, functions,
docstrings and arithmetic.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

HELDOUT_MODULES: list[str] = [
    "fractions.py",
    "textwrap.py",
    "shlex.py",
    "colorsys.py",
    "bisect.py",
    "heapq.py",
    "graphlib.py",
    "fnmatch.py",
    "reprlib.py",
    "glob.py",
    "string.py",
    "numbers.py",
]

# Path components never trained on: test suites, GUI code, the 2to3 fixer tree, installed
# third-party packages, generated codec tables, the pydoc topic dump (data, not code) and
# the build's config-* directory.
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages",
    "encodings", "pydoc_data", "ensurepip", "__pycache__",
})
EXCLUDED_PREFIXES = ("_sysconfigdata",)


def stdlib_dir() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(rel: Path) -> bool:
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return True
    return rel.name.startswith(EXCLUDED_PREFIXES)


def training_files(root: Path | None = None) -> list[Path]:
    """Every stdlib .py file the demo pair may train on, sorted for determinism."""
    root = root or stdlib_dir()
    heldout = set(HELDOUT_MODULES)
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _is_excluded(rel):
            continue
        if len(rel.parts) == 1 and rel.name in heldout:
            continue
        files.append(path)
    return files


def heldout_files(root: Path | None = None) -> list[Path]:
    """The held-out modules present in this interpreter's stdlib, in HELDOUT_MODULES order."""
    root = root or stdlib_dir()
    return [root / name for name in HELDOUT_MODULES if (root / name).is_file()]
