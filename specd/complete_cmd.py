"""``specd complete FILE --line L --col C``: one completion, through the daemon or in-process."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("specd.complete")

EXIT_USAGE = 2
EXIT_FAILED = 1


def cursor_offset(text: str, line: int, col: int) -> int:
    """Code-point offset of 1-based ``line`` and 0-based ``col``; ValueError when out of range."""
    lines = text.split("\n")
    if not 1 <= line <= len(lines):
        raise ValueError(f"--line {line} is out of range 1..{len(lines)}")
    if not 0 <= col <= len(lines[line - 1]):
        raise ValueError(f"--col {col} is out of range 0..{len(lines[line - 1])} for line {line}")
    return sum(len(s) + 1 for s in lines[: line - 1]) + col


def request_options(args) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.max_tokens is not None:
        options["max_tokens"] = args.max_tokens
    if args.no_draft:
        options["use_draft_model"] = False
    if args.no_lookup:
        options["use_lookup"] = False
    if args.single_line:
        options["single_line"] = True
    if args.temperature:
        options["temperature"] = args.temperature
    if args.seed is not None:
        options["seed"] = args.seed
    return options


def complete_locally(cfg, text: str, offset: int, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    from specd.engine import CompletionRequest, load_engine

    engine = load_engine(cfg)
    result = engine.complete(CompletionRequest(uri=path.resolve().as_uri(), text=text, offset=offset,
                                               path=str(path), **options))
    out = result.to_dict()
    out["models"] = engine.stats()["models"]
    return out


def fetch_default_model(cfg) -> bool:
    """On a terminal, fetch the default model here, with its line on stderr, before a daemon is
    started to serve it (a daemon fetching it would leave the terminal silent for the download);
    False, with the one-line reason printed, when it cannot be had. Elsewhere (scripts, editors)
    the daemon fetches it as it loads, and says so in its log."""
    from specd.engine.builtin import DEFAULT, FetchError, fetch, is_fetched

    if cfg["model.target"] or cfg["model.backend"] != "local" or is_fetched(DEFAULT) or not sys.stderr.isatty():
        return True
    try:
        fetch(DEFAULT, say=lambda line: print(line, file=sys.stderr, flush=True))
    except FetchError as err:
        print(f"specd: {err}", file=sys.stderr)
        return False
    return True


def run_complete(args, cfg) -> int:
    from specd.engine.types import EngineError, UnsupportedModel

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        print(f"specd: {path}: no such file", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, UnicodeDecodeError) as err:
        print(f"specd: cannot read {path}: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        offset = cursor_offset(text, args.line, args.col)
    except ValueError as err:
        print(f"specd: {err}", file=sys.stderr)
        return EXIT_USAGE
    options = request_options(args)
    # The daemon serves its configured models; model flags on the command line mean "this model",
    # so they run in-process, as does --local and the no-daemon, no-spawn case.
    local = args.local or any(getattr(args, f, None) for f in ("model", "draft_model", "device", "dtype"))
    result = None
    try:
        if not local:
            from specd.client import DaemonUnavailable, RpcError, complete_via_daemon

            if not args.no_spawn and not fetch_default_model(cfg):
                return EXIT_FAILED

            try:
                result = complete_via_daemon(cfg, text, offset=offset, path=path, options=options,
                                             spawn=not args.no_spawn)
                result["via"] = "daemon"
            except DaemonUnavailable as err:
                if not args.no_spawn:
                    print(f"specd: {err}", file=sys.stderr)
                    # A daemon that refused its configuration or surroundings (exit 2) is the
                    # user's to fix, as the same error in this process would be.
                    return EXIT_USAGE if err.daemon_exit == EXIT_USAGE else EXIT_FAILED
                log.info("no daemon running (--no-spawn): completing in this process")
            except RpcError as err:
                print(f"specd: {err}", file=sys.stderr)
                return EXIT_FAILED
        if result is None:
            result = complete_locally(cfg, text, offset, path, options)
            result["via"] = "local"
    except EngineError as err:
        print(f"specd: {err}", file=sys.stderr)
        return EXIT_USAGE if isinstance(err, UnsupportedModel) else EXIT_FAILED  # the model's config is the user's to fix
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(result["text"])
        if sys.stdout.isatty():
            sys.stdout.write("\n")
    return 0
