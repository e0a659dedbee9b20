"""``specd doctor``: the effective config with sources, the torch device, a model load check, and
what the load spent where."""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

from specd import __version__


def _timed_import(imports: dict[str, float], name: str):
    """Import module ``name``, adding the seconds it took to ``imports``."""
    import importlib

    started = time.perf_counter()
    module = importlib.import_module(name)
    imports[name] = time.perf_counter() - started
    return module


def _device_report(imports: dict[str, float]) -> list[str]:
    torch = _timed_import(imports, "torch")

    lines = [f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("no CUDA device: models run on the CPU in float32 (slow for real code models)")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        lines.append("mps: available")
    return lines


def run_doctor(args, cfg) -> int:
    print(f"specd {__version__} on Python {platform.python_version()} ({sys.platform})")
    print(f"config file: {cfg.file or 'none (defaults)'}")
    print(f"socket:      {cfg.socket_path}")
    print(f"log file:    {cfg.log_file}")
    remote = cfg["model.backend"] == "remote"
    print(f"backend:     {cfg['model.backend']} "
          + (f"({cfg['model.remote_url'] or 'model.remote_url unset'})" if remote else "(the resident model pair)"))
    print()
    rows = cfg.rows()
    width = max(len(key) for key, _, _ in rows)
    print("effective config:")
    for key, value, source in rows:
        shown = "***" if key in ("daemon.tcp_token", "model.remote_api_key") and value else repr(value)
        print(f"  {key:<{width}}  {shown:<28} ({source})")
    print()
    print("device:")
    imports: dict[str, float] = {}  # module -> seconds, in the order imported: the start-up's first part
    for line in _device_report(imports):
        print(f"  {line}")
    transformers = _timed_import(imports, "transformers")

    print(f"  transformers {transformers.__version__}")
    if args.no_load:
        return 0
    print()
    print("models:")
    if remote:
        from specd.engine.remote.engine import doctor_report

        ok, lines = doctor_report(cfg)
        for line in lines:
            print(f"  {line}")
        if ok:
            print("  OK")
        return 0 if ok else 1
    Engine = _timed_import(imports, "specd.engine.engine").Engine
    from specd.engine.options import EngineOptions
    from specd.engine.types import EngineError, UnsupportedModel

    started = time.monotonic()
    try:
        engine = Engine(EngineOptions.from_config(cfg))
        engine.import_s = sum(imports.values())
        engine.ensure_loaded()
    except EngineError as err:
        print(f"  FAILED: {err}")
        return 2 if isinstance(err, UnsupportedModel) else 1
    info = engine.stats()["models"]
    gguf = info.get("gguf") or {}
    print(f"  target: {info['target']} ({info['target_params'] / 1e6:.1f}M params{_gguf_note(gguf.get('target'))})")
    if info["draft"]:
        print(f"  draft:  {info['draft']} ({info['draft_params'] / 1e6:.1f}M params{_gguf_note(gguf.get('draft'))})")
    else:
        print("  draft:  none (prompt lookup drafting only)")
    print(f"  device {info['device']}, dtype {info['dtype']}, FIM family {engine.template.name} "
          f"({engine.prompts.layout} layout), loaded in {time.monotonic() - started:.1f} s")
    for role, (path, why) in engine.paths.items():
        detail = path.description or ("transformers' forward" if path.name == "hf" else "")
        print(f"  {role} forward: {path.name}" + (f" ({detail})" if detail else ""))
        if why:  # why this path (engine.forward_backend auto: the figures), or why not the one asked for
            print(f"    {why}")
    print(f"  memory: {memory_line(engine)}")
    costs = engine.planning.costs
    widths = ", ".join(f"{w}: {ms:.1f}" for w, ms in sorted(costs.target.items()))
    print(f"  target forward ms by width: {widths}")
    if costs.draft_step is not None:
        print(f"  draft step {costs.draft_step:.2f} ms ({costs.draft_step / costs.target_ms(1):.0%} of a target forward)")
    if engine.agreement is not None:
        print(f"  draft {engine.agreement_line()}")
    print("  start-up, seconds by step:")
    for line in startup_lines(engine.startup.seconds, imports, engine.healing_source):
        print(f"    {line}")
    print("  OK")
    return 0


def memory_line(engine) -> str:
    """What the loaded models hold in memory and may come to hold: the weights (a GGUF file's
    size; a torch model's parameters), the lean forward's transposed copies of them
    (``engine.transposed_weights``), and the KV caches' budget."""
    from specd.engine.forward.lean import LeanForward
    from specd.engine.models import is_gguf

    pair = engine.pair
    weights = 0
    for model in (pair.target, pair.draft):
        if model is None:
            continue
        if is_gguf(model):
            weights += Path(model.path).stat().st_size
        else:
            weights += sum(p.numel() * p.element_size() for p in model.parameters())
    parts = [f"weights {weights / 2**20:.0f} MiB"]
    copies = sum(path.copied_bytes for path, _ in engine.paths.values() if isinstance(path, LeanForward))
    setting = engine.options.transposed_weights
    if copies:
        parts.append(f"transposed copies of them +{copies / 2**20:.0f} MiB (engine.transposed_weights = {setting})")
    parts.append(f"KV caches up to {engine.options.cache_budget_mb} MiB (engine.cache_budget_mb)")
    return ", ".join(parts)


def _gguf_note(file: dict | None) -> str:
    """What a GGUF model is, beside its name: its type, architecture and whose tokenizer runs it."""
    if not file:
        return ""
    return f"; a GGUF file, {file['type']}, llama.cpp architecture {file['architecture']}, llama.cpp's tokenizer"


def startup_lines(steps: dict[str, float], imports: dict[str, float], healing_source: str) -> list[str]:
    """The start-up's steps, one a line, the imports split by module and the healing table's
    source beside it, then the total."""
    width = max(len(step) for step in steps)
    lines = []
    for step, seconds in steps.items():
        note = ""
        if step == "imports" and imports:
            note = "  (" + ", ".join(f"{name} {s:.2f}" for name, s in imports.items()) + ")"
        elif step == "healing table" and healing_source:
            note = f"  ({healing_source})"
        lines.append(f"{step:<{width}}  {seconds:6.2f}{note}")
    lines.append(f"{'total':<{width}}  {sum(steps.values()):6.2f}")
    return lines
