"""engine.transposed_weights = auto weighs memory: the lean forward holds each weight matrix a
second time, transposed, only where those copies take at most a share of the memory available at
load, and says what they take (or would have taken) in its description (``specd doctor``,
``specd status``)."""

from __future__ import annotations

import torch

from specd.engine.forward.lean import LeanForward
from specd.engine.forward.lean.layers import TRANSPOSED_MEMORY_SHARE, available_memory, copies_pay, transposed_bytes
from tiny import make_model


def model():
    return make_model("llama", 512, 64, 2, seed=1)


def test_the_copies_size_is_what_the_lean_forward_holds():
    tiny = model()
    lean = LeanForward(tiny, transposed_weights="on")
    assert transposed_bytes(tiny) == lean.copied_bytes > 0
    assert f"+{lean.copied_bytes / 2**20:.0f} MiB" in lean.description


def test_auto_declines_the_copies_where_memory_is_short_and_says_so():
    tiny = model()
    copies = transposed_bytes(tiny)
    assert copies_pay(tiny, available=copies * TRANSPOSED_MEMORY_SHARE) == (True, "")
    copy, why = copies_pay(tiny, available=copies * TRANSPOSED_MEMORY_SHARE - 1)
    assert not copy and "transposed copies would take" in why and "available at load" in why
    assert copies_pay(tiny.to(torch.bfloat16), available=1) == (False, "")  # not float32: never, nothing to say


def test_auto_on_this_machine_follows_the_memory_available():
    tiny = model()
    lean = LeanForward(tiny)  # a few hundred KiB of copies: any machine running the tests has room
    assert available_memory() is None or available_memory() > transposed_bytes(tiny) * TRANSPOSED_MEMORY_SHARE
    assert lean.copied_bytes == transposed_bytes(tiny) and lean.transposed_note == ""


def test_doctor_says_what_the_weights_their_copies_and_the_caches_take():
    from types import SimpleNamespace

    from specd.doctor import memory_line

    tiny = model()
    lean = LeanForward(tiny, transposed_weights="on")
    engine = SimpleNamespace(pair=SimpleNamespace(target=tiny, draft=None), paths={"target": (lean, None)},
                             options=SimpleNamespace(transposed_weights="on", cache_budget_mb=2048))
    weights = sum(p.numel() * p.element_size() for p in tiny.parameters())
    assert memory_line(engine) == (f"weights {weights / 2**20:.0f} MiB, transposed copies of them "
                                   f"+{lean.copied_bytes / 2**20:.0f} MiB (engine.transposed_weights = on), "
                                   "KV caches up to 2048 MiB (engine.cache_budget_mb)")
