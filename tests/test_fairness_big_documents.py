"""Fair service while another connection opens and edits 8 MiB documents.

The real daemon with the real engine on the tiny llama pair, limits that admit 8 MiB documents.
A polite client asks ``status`` every 20 ms and a small ``complete`` every 10th request, in
windows that alternate with windows where another process (tests/big_documents_load.py) opens
8 MiB documents, types into them, replaces them whole and closes them: the machine's other work
weighs on idle and loaded alike. Goals (the daemon's): loaded ``complete`` p95 at most 2x its
idle p95 + 50 ms, ``status`` p95 at most 2x idle + 5 ms. A measurement that misses is taken
once more, and the second must meet them: a neighbour's burst on a shared 2-core machine can
land in the loaded windows only. ``scripts/fairness-big-docs`` runs the same by hand.
"""

from __future__ import annotations

import pytest

from big_documents_load import alternating, daemon_config, meets_goal
from daemon_helpers import DaemonProcess
from tiny import make_tiny_pair

pytestmark = pytest.mark.slow

WINDOWS = 5
WINDOW_S = 2.0
ATTEMPTS = 2


@pytest.fixture(scope="module")
def big_documents_daemon(tmp_path_factory, tiny_root):
    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    config = {**daemon_config(), "model.target": target, "model.draft": draft, "model.device": "cpu",
              "log.level": "info"}
    proc = DaemonProcess(tmp_path_factory.mktemp("fairness-big"), engine="real", config=config)
    proc.start(timeout=120)
    yield proc
    proc.stop()


def test_big_documents_of_another_connection(big_documents_daemon):
    misses = []
    for attempt in range(ATTEMPTS):
        with big_documents_daemon.client() as client:
            idle, loaded, operations = alternating(client, big_documents_daemon.socket_path, WINDOWS, WINDOW_S)
        print(f"\nattempt {attempt + 1}: the other connection sent {operations} requests")
        print(idle.line("idle"))
        print(loaded.line("loaded"))
        assert operations >= 2 * WINDOWS, "the other connection hardly loaded the daemon"
        assert len(loaded.complete_ms) >= 0.75 * len(idle.complete_ms), "the polite client got too few answers"
        misses = meets_goal(idle, loaded)
        if not misses:
            break
    assert not misses, misses
    with big_documents_daemon.client() as client:
        info = client.status()
        assert info["state"] == "ready" and info["documents"]["open"] == 0
