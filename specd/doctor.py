"""``specd doctor``: the effective config with sources, the torch device, and a model load check."""

from __future__ import annotations

import platform
import sys
import time

from specd import __version__


def _device_report() -> list[str]:
    import torch

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
    for line in _device_report():
        print(f"  {line}")
    import transformers

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
    from specd.engine.engine import Engine
    from specd.engine.options import EngineOptions
    from specd.engine.types import EngineError

    started = time.monotonic()
    try:
        engine = Engine(EngineOptions.from_config(cfg))
        engine.ensure_loaded()
    except EngineError as err:
        print(f"  FAILED: {err}")
        return 1
    info = engine.stats()["models"]
    print(f"  target: {info['target']} ({info['target_params'] / 1e6:.1f}M params)")
    if info["draft"]:
        print(f"  draft:  {info['draft']} ({info['draft_params'] / 1e6:.1f}M params)")
    else:
        print("  draft:  none (prompt lookup drafting only)")
    print(f"  device {info['device']}, dtype {info['dtype']}, FIM family {engine.template.name} "
          f"({engine.prompts.layout} layout), loaded in {time.monotonic() - started:.1f} s")
    for role, (path, why) in engine.paths.items():
        detail = path.description or ("transformers' forward" if path.name == "hf" else "")
        print(f"  {role} forward: {path.name}" + (f" ({why})" if why else f" ({detail})" if detail else ""))
    costs = engine.planning.costs
    widths = ", ".join(f"{w}: {ms:.1f}" for w, ms in sorted(costs.target.items()))
    print(f"  target forward ms by width: {widths}")
    if costs.draft_step is not None:
        print(f"  draft step {costs.draft_step:.2f} ms ({costs.draft_step / costs.target_ms(1):.0%} of a target forward)")
    print("  OK")
    return 0
