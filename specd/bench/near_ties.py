"""Where an output on a GGUF file parts from llama.cpp's own greedy decoding of it, how close the
two tokens were: a near-tie or a defect.

llama.cpp's quantized CPU kernels round a batch of several rows differently from a one-row
step, so a verify forward can pick the other of two tokens whose logits are nearly equal. For
each output that differs from the reference, the first differing position is looked up in
llama.cpp's own one-row decode (``LlamaSlot.step_logits``): the margin is the reference token's
logit minus the other token's there. Within ``NEAR_TIE`` either way it is counted as a near-tie;
beyond it, the flip cannot come from rounding and is a defect.
"""

from __future__ import annotations

from typing import Any

# Logits: above the largest batch-width difference measured on 4-bit files (llama.cpp's Q4_1 and
# Q4_K_M; docs/bench.md, "A GGUF target"), so any flip rounding explains falls under it.
NEAR_TIE = 1.5


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def flip_margins(slot, prompts: list[list[int]], outputs: list[list[int]], reference: list[list[int]],
                 mismatched: list[int]) -> list[dict[str, Any]]:
    """One entry per mismatched output: where it parted from the reference, the two tokens and
    the margin between them in the reference's one-row decode (None where one output is a
    prefix of the other: a stop, not a flip)."""
    flips = []
    for index in mismatched:
        ours, theirs = outputs[index], reference[index]
        at = first_difference(ours, theirs)
        entry: dict[str, Any] = {"output": index, "position": at, "margin": None}
        if at < len(ours) and at < len(theirs):
            row = slot.step_logits(prompts[index], theirs[:at])
            entry.update(reference_token=theirs[at], token=ours[at],
                         margin=round(float(row[theirs[at]] - row[ours[at]]), 4))
        flips.append(entry)
    return flips


def summarize(flips: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts for the report: near-ties (margin under ``NEAR_TIE``) apart from the rest."""
    margins = [f["margin"] for f in flips if f["margin"] is not None]
    # A negative margin: the reference's own token is not the replay's argmax (its cache was
    # reused from another request, so its rows were batched otherwise); a near-tie by its size.
    near = sum(1 for m in margins if abs(m) < NEAR_TIE)
    return {"flips": len(flips), "near_ties": near, "defects": len(flips) - near,
            "near_tie_threshold": NEAR_TIE, "margins": margins, "at": flips}
