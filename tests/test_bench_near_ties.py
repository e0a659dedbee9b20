"""Flips against llama.cpp's greedy, sorted into near-ties and defects by the margin between the
two tokens in llama.cpp's one-row decode (``specd.bench.near_ties``)."""

from __future__ import annotations

import numpy as np

from specd.bench.near_ties import NEAR_TIE, first_difference, flip_margins, summarize


class RecordingSlot:
    """``step_logits`` from a table: logits after ``prompt + generated``, and who asked."""

    def __init__(self, rows: dict[tuple, np.ndarray]):
        self.rows = rows
        self.asked: list[tuple] = []

    def step_logits(self, prompt, generated):
        key = (tuple(prompt), tuple(generated))
        self.asked.append(key)
        return self.rows[key]


def row(**logits: float) -> np.ndarray:
    out = np.zeros(8, dtype=np.float32)
    for token, value in logits.items():
        out[int(token[1:])] = value
    return out


def test_a_flip_is_a_near_tie_or_a_defect_by_its_margin():
    prompts = [[1, 2], [3], [4]]
    reference = [[5, 6, 7], [5, 5], [6]]
    outputs = [[5, 7, 7], [5, 2], [6, 1]]
    slot = RecordingSlot({((1, 2), (5,)): row(t6=2.0, t7=2.0 - NEAR_TIE / 3),
                          ((3,), (5,)): row(t5=4.0, t2=4.0 - 2 * NEAR_TIE)})
    flips = flip_margins(slot, prompts, outputs, reference, [0, 1, 2])
    assert slot.asked == [((1, 2), (5,)), ((3,), (5,))]  # the reference's tokens up to the flip
    assert [f["position"] for f in flips] == [1, 1, 1]
    assert flips[0]["reference_token"] == 6 and flips[0]["token"] == 7
    assert flips[2]["margin"] is None  # one output is the other's prefix: a stop, not a flip
    counts = summarize(flips)
    assert (counts["flips"], counts["near_ties"], counts["defects"]) == (3, 1, 2)
    assert counts["near_tie_threshold"] == NEAR_TIE


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [1]) == 0
