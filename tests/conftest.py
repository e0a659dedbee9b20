"""Shared fixtures. Tiny model pairs are built once per session, in code (no downloads)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_tiny_pair  # noqa: E402


def pytest_configure(config):
    """One torch thread in the test process: tiny models gain nothing from more, and on a
    loaded 2-core machine oversubscribed threads run 20-30x slower."""
    import torch

    torch.set_num_threads(1)

ARCHS = ("llama", "qwen2", "gpt2", "qwen3", "gemma", "granite", "gpt_neox", "phi3", "stablelm", "phi", "opt",
         "gemma2", "gemma3_text", "olmo2")
SAMPLE_SOURCE = Path(__file__).parent / "data" / "sample_module.py"


# Engines built from the config (the CLI in this process or a child) have their forward paths
# pinned: the auto choices time forwards at load, and no test's outcome may hang on the clock.
PINNED_PATHS = {"SPECD_ENGINE_FORWARD_BACKEND": "torch", "SPECD_ENGINE_LLAMACPP_PREFILL": "torch"}
# A GGUF target with the torch forward pinned runs dequantized on torch; these keep one on
# llama.cpp's forward (which has no clock-dependent choice to make for a GGUF file).
GGUF_ON_LLAMACPP = {"SPECD_ENGINE_FORWARD_BACKEND": "llamacpp"}


@pytest.fixture(scope="session", autouse=True)
def _session_xdg(tmp_path_factory):
    """Module- and session-scoped fixtures are set up before the per-test isolation below: they
    get session-wide private XDG dirs (they wrote GGUF files into the user's ~/.cache before)."""
    saved = {var: os.environ.get(var) for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME")
             + tuple(PINNED_PATHS)}
    root = tmp_path_factory.mktemp("session-xdg")
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        os.environ[var] = str(root / var.lower())
    os.environ.update(PINNED_PATHS)  # module fixtures build engines too (the bench tests')
    yield
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture(autouse=True)
def _isolated_xdg(tmp_path, monkeypatch):
    """No test reads or writes the real user's config, state or runtime dirs."""
    for var, sub in (("XDG_CONFIG_HOME", "config"), ("XDG_STATE_HOME", "state"),
                     ("XDG_RUNTIME_DIR", "run"), ("XDG_CACHE_HOME", "cache")):
        if not os.environ.get(var, "").startswith(str(tmp_path)):
            path = tmp_path / "xdg" / sub
            path.mkdir(parents=True, exist_ok=True)
            monkeypatch.setenv(var, str(path))
    for name in list(os.environ):
        if name.startswith("SPECD_"):
            monkeypatch.delenv(name)
    for name, value in PINNED_PATHS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_pairs(tiny_root) -> dict[str, tuple[Path, Path]]:
    """{arch: (target_dir, draft_dir)} for every test architecture."""
    return {arch: make_tiny_pair(tiny_root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_pair(tiny_pairs) -> tuple[Path, Path]:
    return tiny_pairs["llama"]


@pytest.fixture(scope="session")
def sample_source() -> str:
    return SAMPLE_SOURCE.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A bench corpus (``--corpus``): the sample module, and a file that is not source, which the
    corpus passes over. Shared by the session: no test writes into it."""
    root = tmp_path_factory.mktemp("bench-corpus")
    shutil.copy(SAMPLE_SOURCE, root / "sample_module.py")
    (root / "notes.txt").write_text("not python\n" * 100)
    return root


@pytest.fixture(scope="session")
def real_vocab(tmp_path_factory):
    """Real code-model vocabularies (tests/real_vocab.py): ``real_vocab.folder`` holds llama.cpp's
    ``ggml-vocab-*`` files, fetched once into the user's cache (a failure fails the tests);
    ``real_vocab.pair(family, arch)`` is a tiny random pair carrying one, built once a session."""
    import real_vocab as module

    folder = module.vocab_dir()
    root = tmp_path_factory.mktemp("real-vocab")
    pairs: dict[tuple[str, str], tuple[Path, Path]] = {}

    class RealVocab:
        def tokenizer_dir(self, family: str) -> Path:
            return module.build_tokenizer(module.FAMILIES[family], folder, root / f"tokenizer-{family}")

        def pair(self, family: str, arch: str) -> tuple[Path, Path]:
            if (family, arch) not in pairs:
                pairs[family, arch] = module.make_family_pair(module.FAMILIES[family], arch, folder, root)
            return pairs[family, arch]

    RealVocab.folder = folder
    return RealVocab()


# ---- daemon fixtures (below) ------------------------------------------------------------
# Owned by the daemon/socket API work. Two shared daemons, started once per session:
# ``daemon`` runs the real engine on the tiny llama pair; ``fake_daemon`` runs a model-free
# engine (tests/fake_engine.py) for checks of the daemon's own mechanics. A request whose text
# before the cursor holds "#slow" is held for up to 5 s in either (supersede/cancel tests).

from daemon_helpers import DaemonProcess  # noqa: E402

# Limits kept small so the limit tests need little data; fuzzing stays cheap too.
SHARED_DAEMON_CONFIG = {
    "daemon.max_frame_bytes": 1024 * 1024,
    "daemon.max_document_bytes": 256 * 1024,
    "daemon.max_documents": 32,
    "daemon.max_connections": 48,
    "engine.max_tokens": 16,
    "engine.time_budget_ms": 3000,
    "log.level": "debug",
}


def start_tiny_daemon(root, tiny_root, engine: str = "real") -> DaemonProcess:
    """The real daemon with the real engine on the tiny llama pair, started in ``root``
    (``engine``: a factory in tests/fake_engine.py around the real engine)."""
    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    config = {**SHARED_DAEMON_CONFIG, "model.target": target, "model.draft": draft, "model.device": "cpu"}
    return DaemonProcess(root, engine=engine, config=config).start(timeout=120)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory, tiny_root):
    """The real daemon with the real engine on the tiny llama pair."""
    proc = start_tiny_daemon(tmp_path_factory.mktemp("daemon"), tiny_root)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def fake_daemon(tmp_path_factory):
    """The real daemon with a model-free engine: starts in a second, answers "[<text before cursor>]"."""
    proc = DaemonProcess(tmp_path_factory.mktemp("fake-daemon"), engine="fake", config=SHARED_DAEMON_CONFIG)
    proc.start()
    yield proc
    proc.stop()

