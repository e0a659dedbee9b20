"""An engine factory (``SPECD_TEST_ENGINE_FACTORY=stuck_engine:stuck_in_progress_bar``) whose
load never ends: its progress bar waits on tqdm's lock, which another thread holds for ever, as
a load stuck behind a progress bar's monitor or a failing write would. That other thread is not
a daemon thread, so a process that ends by ordinary interpreter exit waits on it for ever."""

from __future__ import annotations

import sys
import threading
from typing import Any


def stuck_in_progress_bar(cfg: Any) -> Any:
    from tqdm import tqdm

    bar = tqdm(total=10, desc="loading", file=sys.stderr)
    held = threading.Event()

    def hold_the_lock() -> None:
        with tqdm.get_lock():
            held.set()
            threading.Event().wait()

    threading.Thread(target=hold_the_lock, name="progress-monitor").start()
    held.wait()
    bar.refresh()  # waits on the held lock: the load never returns
    raise AssertionError("unreachable: the lock is never released")
