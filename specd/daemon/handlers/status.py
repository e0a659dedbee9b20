"""``hello`` and ``status``: what the daemon is, what it allows, and how it is doing.

``status`` aggregates every part of the daemon (worker, buffers, queue, workspace, latency,
the engine's own figures); the engine's figures are fetched off the loop and reused for
``ENGINE_FIGURES_MAX_AGE_S`` (``metrics.EngineFigures``).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from specd import __version__
from specd.daemon.admission import Connection
from specd.daemon.buffers import BufferStore
from specd.daemon.engine_api import StatsOnLoop
from specd.daemon.handlers.completion import CompletionMethods
from specd.daemon.metrics import EngineFigures, device_memory, process_memory
from specd.daemon.params import HelloParams
from specd.daemon.scheduler import Scheduler
from specd.daemon.worker import ModelWorker
from specd.daemon.workspace import Workspace
from specd.logs import log_losses
from specd.protocol.errors import RpcError
from specd.protocol.methods import CAPABILITIES, ERROR_FORMATS, POSITION_ENCODINGS, PROTOCOL_VERSION, Method

# `status` (and hello's model names) reuse the engine's figures for this long, unless a
# completion ended or the models loaded or were released since (metrics.EngineFigures).
ENGINE_FIGURES_MAX_AGE_S = 0.1
ENGINE_STATS_TIMEOUT_S = 5.0


class EngineStats:
    """The engine's ``stats()``, fetched on a thread (they may walk caches and call torch),
    or on the loop where the engine says they are cheap (``StatsOnLoop``)."""

    def __init__(self, worker: ModelWorker, figures: EngineFigures):
        self.worker = worker
        self.figures = figures
        self.waiting = 0  # requests waiting on a thread for the figures now

    async def fetch(self) -> dict[str, Any]:
        engine = self.worker.engine
        if engine is None:
            return {}
        source = (engine, self.worker.state)  # figures taken before a load or a release are not reused
        if (figures := self.figures.fresh(source)) is not None:
            return figures
        error: Exception | None = None
        for _attempt in range(2):  # stats() reads counters the worker may be updating: retry once
            self.waiting += 1
            token = self.figures.begin()
            try:
                if isinstance(engine, StatsOnLoop) and engine.stats_on_loop:
                    stats = engine.stats()  # a thread's round trip costs more than the call (see StatsOnLoop)
                else:
                    stats = await asyncio.wait_for(asyncio.to_thread(engine.stats), timeout=ENGINE_STATS_TIMEOUT_S)
                figures = stats if isinstance(stats, dict) else {"stats": stats}
                self.figures.keep(token, source, figures)
                return figures
            except Exception as err:
                error = err
            finally:
                self.waiting -= 1
        return {"error": f"{type(error).__name__}: {error}"}


class StatusMethods:
    def __init__(self, cfg: Any, *, socket_path: Path, worker: ModelWorker, buffers: BufferStore,
                 completions: Scheduler, completion: CompletionMethods, workspace: Workspace,
                 connections: dict[int, Connection], engine: EngineStats, limits: Callable[[], dict[str, Any]],
                 focus_counts: Mapping[str, int] | None = None):
        self.cfg = cfg
        self.socket_path = socket_path
        self.worker = worker
        self.buffers = buffers
        self.completions = completions  # the queue
        self.completion = completion  # its counts and latency
        self.workspace = workspace
        self.connections = connections
        self.engine = engine
        self.limits = limits  # what hello reports of the daemon's limits
        self.focus_counts = focus_counts if focus_counts is not None else {}  # ``focus`` calls: received, not_open
        self.started_at = time.time()

    def _models(self) -> dict[str, Any]:
        return {"target": self.cfg["model.target"] or "demo", "draft": self.cfg["model.draft"] or None}

    async def _model_names(self) -> dict[str, Any]:
        models = (await self.engine.fetch()).get("models")
        if isinstance(models, dict) and "target" in models:
            return {"target": models.get("target"), "draft": models.get("draft")}
        return self._models()

    async def hello(self, conn: Connection, params: HelloParams, msgid: int | None) -> dict[str, Any]:
        conn.client = params.client
        conn.batch = params.batch
        if conn.session is not None:
            conn.session.encode_error = RpcError.to_text if params.errors == "string" else RpcError.to_wire
        return {
            "server": "specd",
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "capabilities": list(CAPABILITIES),
            "methods": [m.value for m in Method],
            "position_encodings": list(POSITION_ENCODINGS),
            "error_formats": list(ERROR_FORMATS),
            "models": await self._model_names(),
            "state": self.worker.state,
            "limits": self.limits(),
        }

    def _queues(self) -> list[dict[str, Any]]:
        """Each client connection's share of the model: what waits, what runs, its model time."""
        started = {job.lane: job for job in self.completions.started()}
        out = []
        for conn in list(self.connections.values()):
            if conn.pending:
                continue
            job = started.get(conn.id)
            out.append({
                "id": conn.id,
                "client": conn.client,
                "batch": conn.batch,
                "waiting": self.completions.waiting(conn.id),
                "in_worker": self.completions.handed(conn.id),
                "started": job.label if job is not None else None,
                "model_s": round(self.completions.lane_seconds(conn.id), 3),
            })
        return out

    async def status(self, conn: Connection, params: None, msgid: int | None) -> dict[str, Any]:
        engine_stats = await self.engine.fetch()
        models = engine_stats.get("models") if isinstance(engine_stats.get("models"), dict) else self._models()
        current = self.worker.current
        counts = self.completion.counts
        out = {
            "state": self.worker.state,
            "pid": os.getpid(),
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "socket": str(self.socket_path),
            "uptime_s": round(time.time() - self.started_at, 1),
            "loaded_at": self.worker.loaded_at,
            "load_seconds": self.worker.load_seconds,
            "idle_unload_s": self.worker.idle_unload_s,
            "models": models,
            "device": engine_stats.get("device", models.get("device")),
            "dtype": engine_stats.get("dtype", models.get("dtype")),
            "memory": {**process_memory(), **device_memory()},
            "cache": engine_stats.get("cache"),
            "acceptance": engine_stats.get("acceptance"),
            "latency_ms": self.completion.latency.summary(),
            "requests": {
                "completed": counts["completed"],
                "cancelled": counts["cancelled"],
                "failed": counts["failed"],
                "superseded": counts["superseded"],
                "queued": len(self.completions),
                "running": current.label if current is not None else None,
            },
            "documents": {**self.buffers.stats(conn.id),
                          "focus": {"received": self.focus_counts.get("received", 0),
                                    "not_open": self.focus_counts.get("not_open", 0)}},
            "workspace": {**self.workspace.stats(), "index": engine_stats.get("workspace")},
            "connections": len(self.connections),
            "queues": self._queues(),
            "engine": engine_stats,
        }
        if self.worker.load_error is not None:
            out["last_error"] = str(self.worker.load_error)
        if losses := log_losses():  # a log destination dropped (a full disk): said here, whatever else is lost
            out["log_errors"] = losses
        return out
