"""``workspace``: the folders each connection works in, watched while anyone holds them, their
files fed to the engine's lookup corpus (``Workspace`` does the watching)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from specd.daemon.admission import Connection
from specd.daemon.params import WorkspaceParams
from specd.daemon.workspace import Workspace
from specd.protocol.errors import ErrorCode, RpcError

log = logging.getLogger("specd.daemon")

DAEMON_OWNER = 0  # holds the folders of ``workspace.folders`` for the daemon's life


class FolderMethods:
    def __init__(self, workspace: Workspace):
        self.workspace = workspace

    def add_configured(self, folders: str) -> None:
        """The folders of ``workspace.folders`` (``os.pathsep``-separated)."""
        if not self.workspace.options.enabled:
            return
        for folder in filter(None, folders.split(os.pathsep)):
            try:
                self.workspace.add(folder, owner=DAEMON_OWNER)
            except OSError as err:
                log.warning("workspace.folders: %s", err)

    async def workspace_folders(self, conn: Connection, params: WorkspaceParams, msgid: int | None) -> dict[str, Any]:
        """Set (``folders``) or change (``add``/``remove``) the folders this connection works in.
        A folder is watched while any connection (or ``workspace.folders``) holds it."""
        if not self.workspace.options.enabled:
            return {"enabled": False, "folders": [], "watched": []}
        replace = params.folders
        add, remove = [*(replace or []), *(params.add or [])], list(params.remove or [])
        if replace is not None:
            wanted = {str(Path(folder).resolve()) for folder in replace}
            remove += [folder for folder in self.workspace.folders(conn.id) if folder not in wanted]
        missing = [folder for folder in add if not Path(folder).is_dir()]
        if missing:  # checked first: a failed call changes nothing
            raise RpcError(ErrorCode.INVALID_PARAMS, f"not a directory: {', '.join(missing)}")
        for folder in add:
            self.workspace.add(folder, owner=conn.id)
        for folder in remove:
            self.workspace.remove(folder, owner=conn.id)
        return {"enabled": True, "folders": self.workspace.folders(conn.id), "watched": self.workspace.folders()}
