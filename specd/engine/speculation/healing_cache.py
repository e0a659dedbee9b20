"""The healing vocabulary's token texts cached on disk, keyed by a hash of the tokenizer.

Decoding every id once (``healing.token_texts``) grows with the vocabulary (a 152k-id one takes
seconds), and every start-up of the engine would pay it. The texts are a pure function of the
tokenizer's files, its class, the vocabulary size and the transformers / tokenizers versions that
decode them, so a file under ``$XDG_CACHE_HOME/specd/healing/`` named by a hash of all of those
holds them. A file is used only when whole: a header line (format, key, count and a SHA-256 of
the body), then the body (a JSON list of strings); anything else (truncated, edited, another
format) is rebuilt and written again. Writes go to a temporary file in the same folder, renamed
over the old one, so a reader never sees half a file. A tokenizer whose files were not found
(no hash) is decoded each time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from specd.engine.speculation.healing import HealingVocabulary, token_texts

log = logging.getLogger(__name__)

FORMAT = 1  # bump when token_texts' output or this file's layout changes


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd" / "healing"


def cache_key(tokenizer, vocab_size: int, tokenizer_hash: str) -> str:
    """What the texts depend on, hashed: the tokenizer files' hash, the class that reads them,
    the vocabulary size, and the versions of the libraries that decode (from their installed
    metadata, the same strings as ``__version__``: importing transformers only for its version
    would slow the load of a GGUF model, which uses none of it)."""
    versions = [importlib.metadata.version(name) for name in ("transformers", "tokenizers")]
    kind = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
    parts = (str(FORMAT), tokenizer_hash, kind, str(vocab_size), *versions)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def read_texts(path: Path, key: str, vocab_size: int) -> list[str] | None:
    """The cached texts at ``path`` when the file is whole and is for ``key``; None otherwise."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            body = f.read()
        if (not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key
                or header.get("count") != vocab_size or header.get("sha256") != hashlib.sha256(body).hexdigest()):
            return None
        texts = json.loads(body)
    except (OSError, ValueError):  # missing, unreadable, not JSON, not UTF-8
        return None
    if not isinstance(texts, list) or len(texts) != vocab_size or not all(isinstance(t, str) for t in texts):
        return None
    return texts


def write_texts(path: Path, key: str, texts: list[str]) -> None:
    """Write ``texts`` for ``key`` atomically (a temporary file renamed over ``path``)."""
    body = json.dumps(texts, ensure_ascii=False).encode("utf-8")
    header = {"format": FORMAT, "key": key, "count": len(texts), "sha256": hashlib.sha256(body).hexdigest()}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def healing_vocabulary(tokenizer, vocab_size: int, tokenizer_hash: str | None,
                       directory: Path | None = None) -> tuple[HealingVocabulary, str]:
    """(the tokenizer's ``HealingVocabulary``, where its texts came from: "cache", "decoded,
    cached", "decoded"): read from the cache when a whole file for this tokenizer is there, else
    decoded (and cached, when the tokenizer's hash is known). Either way the same table: the
    cache holds exactly what ``token_texts`` returns."""
    if tokenizer_hash is None:
        return HealingVocabulary(tokenizer, vocab_size), "decoded"
    key = cache_key(tokenizer, vocab_size, tokenizer_hash)
    path = (directory or cache_dir()) / f"{key[:32]}.json"
    started = time.perf_counter()
    texts = read_texts(path, key, vocab_size)
    if texts is not None:
        log.debug("healing table: %d token texts read from %s in %.2f s", vocab_size, path,
                  time.perf_counter() - started)
        return HealingVocabulary(tokenizer, vocab_size, texts), "cache"
    if path.exists():
        log.warning("healing table cache %s is not a whole file for this tokenizer: rebuilding it", path)
    texts = token_texts(tokenizer, vocab_size)
    log.debug("healing table: %d token texts decoded in %.2f s", vocab_size, time.perf_counter() - started)
    try:
        write_texts(path, key, texts)
    except OSError as err:  # a read-only or full cache: serve anyway, decode again next time
        log.warning("cannot cache the healing table at %s: %s", path, err)
        return HealingVocabulary(tokenizer, vocab_size, texts), "decoded"
    return HealingVocabulary(tokenizer, vocab_size, texts), "decoded, cached"
