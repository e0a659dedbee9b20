"""What ``costs.calibrate`` measured at a load, kept for the next load of the same models on the
same forward paths and machine: a real model's calibration is seconds of start-up, and what it
measures changes only with those.

A kept table is a starting point, as a fresh one is: every plain step re-times width 1 and
scales the other widths with it (``ForwardCosts.record_target``), so a machine busier or
quieter than at the first load corrects the table within a few steps. The agreement sample
(both models' greedy tokens on the code sample) is a pure function of the models and is kept
with it. Files live under ``$XDG_CACHE_HOME/specd/costs/``, written whole (a temporary file
renamed); an unreadable one is measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Callable, Sequence

from specd.engine.speculation.agreement import AgreementSample
from specd.engine.speculation.costs import CALIBRATION_WIDTHS, Calibration, ForwardCosts

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # bump when what calibrate measures, or how, changes


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd" / "costs"


def model_stamp(source: str | None) -> str | None:
    """What tells one version of a model's files from another: a GGUF file's or a folder's
    weights and config, by path, size and modification time. None for a name that is not on
    this disk (a hub id): nothing to tell versions apart by, so nothing is kept."""
    if not source:
        return ""
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) + [path / "config.json"]
    else:
        return None
    parts = [str(path.resolve())]
    for file in files:
        if file.is_file():
            info = file.stat()
            parts.append(f"{file.name}|{info.st_size}|{info.st_mtime_ns}")
    return "|".join(parts)


def key_file(parts: Sequence[object]) -> Path:
    stamp = hashlib.sha256()
    for part in (CACHE_VERSION, CALIBRATION_WIDTHS, os.cpu_count(), platform.machine(), *parts):
        stamp.update(f"{part}|".encode())
    return cache_dir() / f"{stamp.hexdigest()[:24]}.json"


def _encode(calibration: Calibration) -> dict:
    costs, sample = calibration.costs, calibration.sample
    return {"target": {str(w): ms for w, ms in costs.target.items()}, "head_row": costs.head_row,
            "draft_step": costs.draft_step, "draft_per_token": costs.draft_per_token,
            "sample": None if sample is None else [sample.target_next, sample.draft_next, sample.draft_confidence,
                                                   sample.chained_next, sample.chained_confidence]}


def _decode(data: dict) -> Calibration:
    costs = ForwardCosts(target={int(w): float(ms) for w, ms in data["target"].items()},
                         head_row=float(data["head_row"]), draft_step=data["draft_step"],
                         draft_per_token=data["draft_per_token"])
    sample = data["sample"]
    return Calibration(costs, None if sample is None else AgreementSample(*sample))


def cached_calibration(parts: Sequence[object] | None, measure: Callable[[], Calibration]) -> tuple[Calibration, bool]:
    """(the calibration, whether it came from the cache): the one kept under ``parts`` (what
    identifies the models, their forward paths and their settings), else ``measure()``'s, kept.
    ``parts`` None: measured, nothing kept."""
    path = None if parts is None else key_file(parts)
    if path is not None:
        try:
            return _decode(json.loads(path.read_text(encoding="utf-8"))), True
        except (OSError, ValueError, KeyError, TypeError):
            pass
    calibration = measure()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(_encode(calibration)), encoding="utf-8")
            os.replace(partial, path)
        except OSError as err:  # a read-only cache costs a measurement at the next load, nothing more
            log.info("could not keep the forward costs in %s: %s", path, err)
    return calibration, False
