"""``engine.forward_backend = auto``: each model (target and draft) runs on the forward that a
few forwards timed at load say is faster here, torch's (the lean path, else transformers') or
llama.cpp's kernels, where llama.cpp's can serve the model exactly.

What is timed (``measure.measure_path``) is what a request's decoding runs once its prompt is
in the cache, which per-document KV reuse makes most of a keystroke's work: after
``CONTEXT`` tokens of context, a one-token step, and for the target a ``VERIFY_WIDTH``-token
verify. On the lean path a verify computes only the rows of logits it reads (1 + accepted,
``caches.LazyRows``): it is timed reading ``VERIFY_ROWS``. Both paths are measured in turn,
``ROUNDS`` times, each figure's least kept. The faster sum (step + verify) wins;
a tie stays on torch, which also runs token trees. Where llama.cpp wins, the prompts that start
a cache prefill where a second measurement says (``choose.faster_prefill``, unless
``engine.llamacpp_prefill`` names one).

The choice is kept in ``$XDG_CACHE_HOME/specd/forward/``, keyed by the model's files, the
machine, the thread count, the library versions, llama.cpp's prefill piece size and the options
that shape either path, so a daemon restart builds the chosen path without measuring again.
Delete the folder to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specd.engine.forward.choose import choose_forward_path, llamacpp_forward, llamacpp_obstacle
from specd.engine.forward.measure import measure_path
from specd.engine.models import ModelPair, is_gguf
from specd.engine.options import EngineOptions

log = logging.getLogger(__name__)

CONTEXT = 512  # tokens in the cache behind the timed forwards: a keystroke's prompt holds as many or more
VERIFY_WIDTH = 4  # a few-row verify: a short draft and the token after it
VERIFY_ROWS = 2  # rows of logits such a verify reads (1 + accepted: the bench's pairs run 1.5-1.8 tokens a forward)
REPEATS = 3  # timed forwards per figure, after a warm-up; the median counts
ROUNDS = 2  # both paths measured in turn this often, each figure's least kept (a busy machine's noise)
FIGURE_BUDGET_MS = 250  # no more timed forwards of one figure once this much went into them
MEASURE_WINDOW = 1024  # cells of the one-sequence llama.cpp context the measurement runs on
CHOICE_VERSION = 1  # bump when what is measured or how it is decided changes: older choices are measured again


@dataclass(frozen=True)
class DecodeCosts:
    """ms of one path's decode forwards: a step, and (the target) a ``VERIFY_WIDTH``-token verify."""

    step_ms: float
    verify_ms: float | None = None

    @property
    def total_ms(self) -> float:
        return self.step_ms + (self.verify_ms or 0.0)

    def describe(self) -> str:
        if self.verify_ms is None:
            return f"step {self.step_ms:.2f} ms"
        return f"step {self.step_ms:.2f} + {VERIFY_WIDTH}-token verify {self.verify_ms:.2f} ms"


@dataclass(frozen=True)
class Decision:
    backend: str  # "torch" | "llamacpp"
    why: str  # the figures both ways, for ``specd doctor`` and the stats


def decide(torch_costs: DecodeCosts, llamacpp_costs: DecodeCosts, torch_name: str) -> Decision:
    """llama.cpp where its decode forwards cost less than torch's (``torch_name``: the torch
    path measured, lean or hf); torch on a tie."""
    figures = f"llamacpp {llamacpp_costs.describe()} vs {torch_name} {torch_costs.describe()}"
    if llamacpp_costs.total_ms < torch_costs.total_ms:
        return Decision("llamacpp", f"auto: llama.cpp's forward measured faster: {figures}")
    return Decision("torch", f"auto: {torch_name} measured faster: {figures}")


@dataclass
class AutoChoice:
    path: object  # the forward path built
    why: str
    figures: dict  # what was measured and chosen ({} where nothing was): the stats' "auto"


def choose_auto(model, source: str, pair: ModelPair, options: EngineOptions, role: str) -> AutoChoice:
    """The forward path ``role``'s model runs on under ``forward_backend = auto``."""
    if is_gguf(model):  # no torch weights: llama.cpp's forward is the only one
        path, why = choose_forward_path(model, options)
        return AutoChoice(path, why, {})
    obstacle = llamacpp_obstacle(model, pair)
    if obstacle is not None:
        return _on_torch(model, options, f"llama.cpp's forward cannot serve it ({obstacle})")
    key_file = _choice_file(model, source, pair, options, role)
    figures = _read_choice(key_file)
    torch_path = torch_why = None
    if figures is not None:
        figures["cached"] = True
    else:
        torch_path, torch_why = choose_forward_path(model, options)
        try:
            figures = _measure(model, source, pair, options, torch_path, last_only=role == "draft")
        except Exception as err:  # an export or a load that fails: say so, serve on torch
            return _on_torch(model, options, f"llama.cpp's forward unavailable ({_first_line(err)})", torch_path, torch_why)
    kept = " (measured before; kept in the cache)" if figures.get("cached") else ""
    if figures["chosen"] == "torch":
        if torch_path is None:
            torch_path, torch_why = choose_forward_path(model, options)
        else:
            _write_choice(key_file, figures)
        return AutoChoice(torch_path, _joined(figures["why"] + kept, torch_why), figures)
    del torch_path  # its transposed weight copies are not needed
    prefill = options.llamacpp_prefill
    if prefill == "auto" and figures.get("prefill") in ("torch", "llamacpp"):
        prefill = figures["prefill"]  # measured before: kept with the choice
    try:
        path = llamacpp_forward(model, source, pair, options, prefill=prefill)
    except Exception as err:  # a cached choice whose GGUF file can no longer be written
        return _on_torch(model, options, f"llama.cpp's forward unavailable ({_first_line(err)})")
    if prefill == "auto":  # measured just now (``choose.faster_prefill``): kept for the next load
        figures["prefill"] = "torch" if path.torch_prefill is not None else "llamacpp"
        figures["prefill_note"] = path.prefill_note
    elif prefill == figures.get("prefill") and figures.get("prefill_note") and \
            (prefill == "llamacpp" or path.torch_prefill is not None):
        path.prefill_note = figures["prefill_note"] + kept
    if not figures.get("cached"):
        _write_choice(key_file, figures)
    return AutoChoice(path, figures["why"] + kept, figures)


def _least(measured: list[DecodeCosts]) -> DecodeCosts:
    """Each figure's smallest over the rounds: what another process's work added is noise."""
    verify = [m.verify_ms for m in measured if m.verify_ms is not None]
    return DecodeCosts(min(m.step_ms for m in measured), min(verify) if verify else None)


def _on_torch(model, options: EngineOptions, reason: str, path=None, why: str | None = None) -> AutoChoice:
    """Torch's forward (``path`` when built already), because of ``reason``."""
    if path is None:
        path, why = choose_forward_path(model, options)
    log.info("forward_backend auto: %s; using the %s forward", reason, path.name)
    return AutoChoice(path, _joined(f"auto: torch, {reason}", why), {"chosen": "torch", "obstacle": reason})


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _joined(why: str, torch_why: str | None) -> str:
    return f"{why}; {torch_why}" if torch_why else why


def _measure(model, source: str, pair: ModelPair, options: EngineOptions, torch_path, last_only: bool) -> dict:
    """What was measured and chosen: the decode forwards timed on ``torch_path`` and on a
    one-sequence llama.cpp forward of the same weights, and ``decide``'s choice."""
    from specd.engine.options import context_window

    started = time.monotonic()
    window = context_window(pair.target_name, pair.target.config) or getattr(model.config, "max_position_embeddings",
                                                                             None)
    context = min(CONTEXT, window - 32 - VERIFY_WIDTH) if window else CONTEXT
    ids = torch.randint(0, pair.input_vocab(), (context + VERIFY_WIDTH,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    widths = (1,) if last_only else (1, VERIFY_WIDTH)
    synchronize = lambda: None  # noqa: E731  (llama.cpp's forward runs on the CPU: so do the models)

    def costs(path) -> DecodeCosts:
        measured = measure_path(model, path, ids, (context,), widths, 0, REPEATS, synchronize, last_only=last_only,
                                verify_rows=VERIFY_ROWS, budget_ms=FIGURE_BUDGET_MS)
        full, rows = measured["forward_ms"][str(context)], measured.get("verify_rows_ms", {}).get(str(context), {})
        verify = None if last_only else rows.get(str(VERIFY_WIDTH), full[str(VERIFY_WIDTH)])
        return DecodeCosts(full["1"], verify)

    probe = llamacpp_forward(model, source, pair, options, prefill="llamacpp", sequences=1, window=MEASURE_WINDOW)
    rounds = [(costs(torch_path), costs(probe)) for _ in range(ROUNDS)]
    del probe
    torch_costs, llamacpp_costs = (_least([r[i] for r in rounds]) for i in (0, 1))
    decision = decide(torch_costs, llamacpp_costs, torch_path.name)
    figures = {"chosen": decision.backend, "why": decision.why, "context": context,
               torch_path.name: asdict(torch_costs), "llamacpp": asdict(llamacpp_costs),
               "measure_s": round(time.monotonic() - started, 3)}
    log.info("%s (%.2f s)", decision.why, figures["measure_s"])
    return figures


# -- the choice kept between loads ----------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd" / "forward"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def _choice_file(model, source: str, pair: ModelPair, options: EngineOptions, role: str) -> Path | None:
    """Where the choice for this model on this machine is kept: None for a model not read from
    a folder (nothing to tell its versions apart by)."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return None
    import llama_cpp

    from specd.engine.forward import llamacpp as llamacpp_path

    stamp = hashlib.sha256()
    # llama.cpp's piece size moves its prefill's cost, which the prefill choice weighs.
    for part in (CHOICE_VERSION, role, folder.resolve(), pair.dtype, pair.device, torch.get_num_threads(),
                 os.cpu_count(), platform.machine(), _cpu_name(), torch.__version__, llama_cpp.__version__,
                 llamacpp_path.BATCH, options.fast_forward, options.transposed_weights, options.numpy_products):
        stamp.update(f"{part}|".encode())
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        if path.is_file():
            info = path.stat()
            stamp.update(f"{path.name}|{info.st_size}|{info.st_mtime_ns}|".encode())
    return cache_dir() / f"{folder.name}-{role}-{stamp.hexdigest()[:16]}.json"


def _read_choice(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        figures = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return figures if isinstance(figures, dict) and figures.get("chosen") in ("torch", "llamacpp") \
        and isinstance(figures.get("why"), str) else None


def _write_choice(path: Path | None, figures: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(figures), encoding="utf-8")
        partial.replace(path)
    except OSError as err:  # a read-only cache costs a measurement at the next load, nothing more
        log.info("could not keep the forward choice in %s: %s", path, err)
