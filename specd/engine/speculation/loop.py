"""The speculative loop: draft, verify in one target forward, accept/reject, roll back.

Invariant between steps: the target's KV cache holds ``seq[:-1]``; ``seq[-1]`` is pending, so
each step runs ``[seq[-1], d_1 .. d_k]`` through the target and gets k + 1 next-token
distributions at once (the last prompt token rides along with the first step; so may a
keystroke's few new prompt tokens before it, whose rows are never read: one forward to the first
token instead of a prefill and a step). Where the planner builds a token tree (on a forward path
that runs trees), the step runs ``[seq[-1], tree nodes]`` instead and keeps the path that stood
(``KVState.keep``).

``decode_steps`` is the loop as a generator: it yields after each step, so whoever drives it
(the daemon's model worker) can run other requests' steps in between, or send the text so far.
Time spent suspended is not the request's own: the time budget and the first-token time leave
it out, and the planner only ever prices the forward itself.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator

import torch

from specd.engine.caches import KVState, Rows
from specd.engine.speculation.drafters import Draft, DraftTree
from specd.engine.speculation.planner import DraftPlanner
from specd.engine.speculation.sampling import SamplingParams
from specd.engine.speculation.healing import Constraint
from specd.engine.speculation.verify import accept_chain, accept_tree
from specd.engine.types import Cancelled, run_to_end

MERGED_PREFILL = 64  # most prompt tokens the first step runs before its draft (a keystroke's, see Engine._complete)


@dataclass
class DecodeOutcome:
    tokens: list[int]
    stop_reason: str
    target_forwards: int
    first_token_s: float
    suspended_s: float = 0.0  # time the decode spent suspended between its steps


def _timed(started: float, recordings: int, target: KVState, rows: Rows) -> float | None:
    """ms of a verify step since ``started``, less the rows of logits computed on demand (they
    are priced apart); None when the forward recorded a CUDA graph first (``recordings`` moved):
    a recording costs a few forwards once, and would price that width out for a while."""
    if target.recordings != recordings:
        return None
    return (time.perf_counter() - started) * 1000 - rows.head_ms


def _allowed_part(draft: Draft, constraint: Constraint, out: list[int]) -> Draft:
    """``draft`` cut before its first token the constraint disallows (one that could only be
    rejected: a wider verify for nothing). Only for a point mass or a greedy draft: a sampled
    draft cut on the token it drew would no longer be verified into the target's law."""
    allowed = constraint.allows(out, draft.tokens)
    if allowed == len(draft):
        return draft
    probs = draft.probs[:allowed] if draft.probs is not None else None
    return dataclasses.replace(draft, tokens=draft.tokens[:allowed], probs=probs)


def speculative_decode(*args, **kwargs) -> DecodeOutcome:
    """``decode_steps`` run to its end in one go."""
    return run_to_end(decode_steps(*args, **kwargs))


def decode_steps(
    target: KVState,
    seq: list[int],
    planner: DraftPlanner,
    sampling: SamplingParams,
    max_tokens: int,
    stop: Callable[[int], str | None],
    deadline: float,
    cancel: threading.Event | None = None,
    generator: torch.Generator | None = None,
    constraint: Constraint | None = None,
) -> Generator[int, None, DecodeOutcome]:
    """Generate after ``seq``, of which the target holds a prefix, at least all but the last
    token: the rest (the last token, or a keystroke's few new prompt tokens, ``MERGED_PREFILL``)
    runs with the first step's draft in one forward, whose rows before the last prompt token's
    are never read. Each later step runs the last token and its draft.

    ``stop(token)`` sees each new token in order and returns a reason to stop, or None.
    ``constraint``, if given, masks disallowed tokens in the verify logits (token healing):
    drafts and the target's own tokens obey it alike.

    Yields the count of tokens generated after each step that did not end the decode; returns
    the outcome.
    """
    start = time.monotonic()
    first_token_s = 0.0
    out: list[int] = []
    forwards = 0
    suspended_s = 0.0
    held = len(target.ids)  # the target holds seq[:held]; seq[held:] runs with the next step
    if not 0 < len(seq) - held <= MERGED_PREFILL or target.ids != seq[:held]:
        raise ValueError(f"the target holds {held} tokens that do not lead the {len(seq)} to decode after")
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled("completion cancelled")
        if out and time.monotonic() > deadline:
            return DecodeOutcome(out, "time_budget", forwards, first_token_s, suspended_s)
        room = max_tokens - len(out) - 1  # one token of each step is the target's own
        # The first step's forward also runs the prompt's new tokens (the lead): its draft is priced
        # against the first token's wait as well as against tokens per ms.
        draft = planner.propose(seq, room, lead=0 if out else len(seq) - held)
        if constraint is not None and not isinstance(draft, DraftTree) and draft.tokens and (
                draft.probs is None or sampling.greedy):
            draft = _allowed_part(draft, constraint, out)
        step_started, recordings = time.perf_counter(), target.recordings
        forwards += 1
        lead = seq[held:]  # the pending token, after the first step's prompt tokens (if any)
        skip = len(lead) - 1  # rows not read: the prompt tokens' before the last
        if isinstance(draft, DraftTree):
            parents = [*range(-1, skip), *(skip + 1 + parent for parent in draft.parents)]
            rows = target.extend_tree([*lead, *draft.tokens], parents, skip=skip)
            path, own = accept_tree(rows, draft, sampling, generator, out, constraint)
            # (a step that also ran prompt tokens is no measure of a verify's cost)
            step_ms = _timed(step_started, recordings, target, rows) if not skip else None
            stood = [draft.tokens[node] for node in path]
            planner.record_tree(draft, stood, step_ms, rows.head_ms / max(rows.computed, 1))
            target.keep(held, [*range(len(lead)), *(len(lead) + node for node in path)])  # lead and the path that stood
            new = [*stood, own]
        else:
            rows = target.extend_rows([*lead, *draft.tokens], skip=skip)  # k + 1 rows read, one forward
            accepted, own = accept_chain(rows, draft, sampling, generator, out, constraint)
            step_ms = _timed(step_started, recordings, target, rows) if not skip else None
            planner.record(draft, accepted, step_ms, rows.head_ms / max(rows.computed, 1))
            target.rollback(len(seq) + accepted)  # keep the lead and the accepted drafts
            new = [*draft.tokens[:accepted], own]
        planner.settle(new[0])
        if not out:
            first_token_s = time.monotonic() - start
        seq.extend(new)
        held = len(seq) - 1
        if constraint is not None and constraint.settled([*out, *new]):
            constraint = None  # the cut text is re-typed: no row is masked from here on
        for token in new:
            reason = stop(token)
            if reason is not None:
                if reason != "eos":
                    out.append(token)
                return DecodeOutcome(out, reason, forwards, first_token_s, suspended_s)
            out.append(token)
            if len(out) >= max_tokens:
                return DecodeOutcome(out, "max_tokens", forwards, first_token_s, suspended_s)
        suspended = time.monotonic()
        yield len(out)
        away = time.monotonic() - suspended  # other work ran: not this request's time
        deadline += away
        start += away
        suspended_s += away
