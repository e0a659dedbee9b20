"""Running ``specd bench`` through its real CLI in-process, as the bench tests do."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Iterator

import pytest

from specd.cli import main

SHORT_PROMPTS = {"SPECD_ENGINE_PREFIX_TOKENS": "192", "SPECD_ENGINE_SUFFIX_TOKENS": "64"}  # seconds, not minutes


def bench_cli(*argv: str, pair=None, corpus=None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``specd bench --device cpu --threads 1 ARGV``, on ``pair``
    (target, draft) and cutting workloads from ``corpus`` when given."""
    args = ["bench", "--device", "cpu", "--threads", "1"]
    if pair is not None:
        args += ["--model", str(pair[0]), "--draft-model", str(pair[1])]
    if corpus is not None:
        args += ["--corpus", str(corpus)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([*args, *argv])
    return code, stdout.getvalue(), stderr.getvalue()


@contextlib.contextmanager
def module_bench_env(home: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """Short prompts and XDG dirs under ``home`` for a module-scoped bench run: it is set up
    before conftest's per-test XDG isolation, so it isolates itself."""
    monkeypatch = pytest.MonkeyPatch()
    for var, value in {**SHORT_PROMPTS, **(env or {})}.items():
        monkeypatch.setenv(var, value)
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(home / var.lower()))
    try:
        yield
    finally:
        monkeypatch.undo()
