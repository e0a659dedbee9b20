"""CLI handlers for the daemon: ``specd serve | status | stop | install-service``.

Each takes the parsed arguments and the effective config and returns an exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from specd.config import Config

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_NOT_RUNNING = 3  # as `systemctl status` / LSB: the program is not running


def _err(message: str) -> None:
    sys.stderr.write(f"specd: {message}\n")  # one write: a log record from another thread cannot split it
    sys.stderr.flush()


def serve(args: argparse.Namespace, cfg: Config) -> int:
    """Serve until stopped, then end the process at once (``_exit_now``): a stopped daemon never
    waits on interpreter teardown, where a thread stuck in a load or a progress bar's lock
    would keep it alive for ever."""
    from specd.daemon.server import Daemon, StartupError

    daemon = Daemon(cfg, idle_unload_s=getattr(args, "idle_unload", None), tcp=getattr(args, "tcp", None),
                    exit_hard=True)
    try:
        code = asyncio.run(daemon.run())
    except StartupError as err:
        _err(str(err))
        return err.exit_code
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """Flush what we wrote, then ``os._exit``: no atexit hook, no join of a stuck thread."""
    import logging

    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # a full disk: the log is already lost, the exit must still happen
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


# -- status ---------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _compact(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key} {_compact(item)}" for key, item in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def _acceptance(value: Any) -> str:
    """Per-source acceptance as "lookup 72% (180/250), draft_model 55% (...)" when shaped so."""
    if not isinstance(value, dict) or not value:
        return _compact(value)
    parts = []
    for source, stats in value.items():
        if isinstance(stats, dict) and "proposed" in stats and "accepted" in stats:
            proposed = stats["proposed"] or 0
            rate = stats["accepted"] / proposed if proposed else 0.0
            parts.append(f"{source} {rate:.0%} ({stats['accepted']}/{proposed})")
        else:
            parts.append(f"{source} {_compact(stats)}")
    return ", ".join(parts)


def _forward(engine: Any) -> str:
    """Which forward runs each model, and why (engine.forward_backend auto: the measured figures)."""
    forward = engine.get("forward") if isinstance(engine, dict) else None
    if not isinstance(forward, dict) or not forward:
        return "-"
    parts = []
    for role, about in forward.items():
        if isinstance(about, dict):
            why = about.get("why")
            parts.append(f"{role} {about.get('path')}" + (f" ({why})" if why else ""))
    return "; ".join(parts) or "-"


def _cache(cache: Any) -> str:
    """The KV caches: documents, bytes against the budget, evictions, and the documents holding most."""
    if not isinstance(cache, dict) or "bytes" not in cache:
        return _compact(cache)
    mib = 1 << 20
    line = (f"{cache.get('documents', 0)} documents, {cache['bytes'] / mib:.0f} of "
            f"{(cache.get('budget_bytes') or 0) / mib:.0f} MiB, {cache.get('evictions', 0)} evicted")
    largest = [f"{item['document']} {item['bytes'] / mib:.0f} MiB ({item['tokens']} tokens)"
               for item in cache.get("largest") or [] if isinstance(item, dict) and "bytes" in item]
    return line + (f"; largest: {', '.join(largest)}" if largest else "")


def _first_suggestion(engine: Any) -> str:
    """The measured prefill speed, what ``engine.first_suggestion_ms`` affords at it, how many
    cold documents' requests answered from a narrow window, and how many windows idle prefill
    filled at an editor's cursor hint (``focus``) before a request came."""
    about = engine.get("first_suggestion") if isinstance(engine, dict) else None
    if not isinstance(about, dict):
        return "-"
    if not about.get("budget_ms"):
        return "full prompt always (engine.first_suggestion_ms = 0)"
    speed = about.get("prefill_tokens_per_s")
    head = (f"prefill {speed:.0f} tokens/s: {about.get('affordable_tokens')} within {about['budget_ms']} ms"
            if speed else "prefill speed not measured yet")
    narrow = about.get("narrow_answers") or 0
    last = f" (last {about['last_window_tokens']} tokens)" if about.get("last_window_tokens") else ""
    ahead = about.get("windows_prefilled_ahead") or 0
    return f"{head}; {narrow} answered from a narrow window{last}; {ahead} prefilled at the cursor ahead"


def format_status(info: dict[str, Any]) -> str:
    models = info.get("models") or {}
    memory = info.get("memory") or {}
    latency = info.get("latency_ms") or {}
    requests = info.get("requests") or {}
    documents = info.get("documents") or {}
    device = info.get("device") or "-"
    if info.get("dtype"):
        device += f" ({info['dtype']})"
    mem = f"rss {memory.get('rss_mb', '-')} MiB (peak {memory.get('peak_rss_mb', '-')})"
    if memory.get("device_allocated_mb") is not None:
        mem += (f"; device {memory['device_allocated_mb']} MiB allocated, "
                f"{memory.get('device_reserved_mb', '-')} reserved (peak {memory.get('device_peak_mb', '-')})")
    lat = "-" if not latency.get("count") else f"p50 {latency['p50']:.0f} ms, p95 {latency['p95']:.0f} ms (last {latency['count']})"
    rows = [
        ("state", f"{info.get('state')} (pid {info.get('pid')}, up {_duration(info.get('uptime_s', 0))})"),
        ("socket", info.get("socket")),
        ("models", f"target {models.get('target') or '-'}, draft {models.get('draft') or '-'}"
         if isinstance(models, dict) and ("target" in models or "draft" in models) else _compact(models)),
        ("device", device),
        ("forward", _forward(info.get("engine"))),
        ("memory", mem),
        ("cache", _cache(info.get("cache"))),
        ("acceptance", _acceptance(info.get("acceptance"))),
        ("latency", lat),
        ("cold docs", _first_suggestion(info.get("engine"))),
        ("requests", f"{requests.get('completed', 0)} completed, {requests.get('cancelled', 0)} cancelled, "
                     f"{requests.get('failed', 0)} failed, {requests.get('queued', 0)} queued"),
        ("documents", f"{documents.get('open', 0)} open"),
        ("clients", info.get("connections")),
    ]
    for queue in info.get("queues") or []:
        kind = "batch" if queue.get("batch") else "interactive"
        running = queue.get("started") or "-"
        rows.append((f"conn{queue.get('id')}", f"{queue.get('client') or '-'} ({kind}): {queue.get('waiting', 0)} waiting, "
                                               f"{queue.get('in_worker', 0)} in the worker, running {running}, "
                                               f"model {queue.get('model_s', 0):.2f} s lately"))
    if info.get("last_error"):
        rows.append(("last error", info["last_error"]))
    return "\n".join(f"{name:<11}{value}" for name, value in rows)


def status(args: argparse.Namespace, cfg: Config) -> int:
    from specd.client import Client, DaemonUnavailable
    from specd.protocol.errors import RpcError

    try:
        with Client.connect_unix(cfg.socket_path) as client:
            info = client.status()
    except DaemonUnavailable:
        if getattr(args, "json", False):
            print(json.dumps({"state": "not running", "socket": str(cfg.socket_path)}))
        else:
            print(f"specd: no daemon running at {cfg.socket_path}")
        return EXIT_NOT_RUNNING
    except RpcError as err:
        _err(f"status failed: {err}")
        return EXIT_FAILURE
    print(json.dumps(info, indent=2, sort_keys=True) if getattr(args, "json", False) else format_status(info))
    return EXIT_OK


# -- stop -----------------------------------------------------------------------------------------


def _process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie its parent has not reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process took the number: ours is gone
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as status:
            return status.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):  # reaped meanwhile (the next kill says so), or no /proc here
        return not os.path.isdir("/proc")


def stop(args: argparse.Namespace, cfg: Config, timeout: float = 60.0) -> int:
    from specd.client import Client, DaemonUnavailable
    from specd.protocol.errors import ErrorCode, RpcError

    try:
        client = Client.connect_unix(cfg.socket_path)
    except DaemonUnavailable:
        print(f"specd: no daemon running at {cfg.socket_path}")
        return EXIT_OK
    with client:
        try:
            pid = client.hello().get("pid")
            client.shutdown()
        except RpcError as err:
            if err.code != ErrorCode.CONNECTION_LOST.value:
                _err(f"stop failed: {err}")
                return EXIT_FAILURE
            pid = None
        # The daemon answers first, then finishes its in-flight work and closes: wait for that,
        # and then for its process to end (it exits hard a bounded time after the last answer).
        deadline = time.monotonic() + timeout
        while not client.closed and time.monotonic() < deadline:
            time.sleep(0.05)
    while isinstance(pid, int) and not _process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not client.closed or (isinstance(pid, int) and not _process_gone(pid)):
        _err(f"the daemon (pid {pid}) did not stop within {timeout:.0f} s")
        return EXIT_FAILURE
    print(f"specd: stopped the daemon (pid {pid})")
    return EXIT_OK


# -- install-service ------------------------------------------------------------------------------


def user_unit_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def install_service(args: argparse.Namespace, cfg: Config) -> int:
    from specd.systemd_units import render

    unit_dir = Path(args.unit_dir) if getattr(args, "unit_dir", None) else user_unit_dir()
    socket_path = cfg["daemon.socket"] or None  # '' = systemd's %t/specd/specd.sock, as the daemon's default
    try:
        unit_dir.mkdir(parents=True, exist_ok=True)
        for name, text in render(socket_path=socket_path).items():
            (unit_dir / name).write_text(text, encoding="utf-8")
            print(f"wrote {unit_dir / name}")
    except OSError as err:
        _err(f"cannot write the units: {err}")
        return EXIT_FAILURE
    commands = [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "specd.socket"],
    ]
    if not getattr(args, "enable", False):
        print("to start the daemon on demand (socket activation), run:")
        for command in commands:
            print("  " + " ".join(command))
        return EXIT_OK
    if shutil.which("systemctl") is None:
        _err("systemctl not found; run the commands above on a systemd machine")
        return EXIT_FAILURE
    for command in commands:
        print("+ " + " ".join(command))
        done = subprocess.run(command, check=False)
        if done.returncode != 0:
            _err(f"{' '.join(command)} failed with status {done.returncode}")
            return EXIT_FAILURE
    return EXIT_OK
