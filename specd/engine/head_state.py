"""The draft role's state when the draft is a feature head (``feature_head``): what the decode
loop, the drafter and the calibration ask of a draft model's ``KVState``, answered by the head
reading the target's own final hidden states.

Position p of the head reads the token at p and the target's state at p - 1 (the state that
emitted that token) and predicts the state at p, which its rows score into the token after p. So
the head can read a position with the target's own state where the target has run the tokens up
to it and still keeps its state (``KVState.features``, the last ``FEATURE_WINDOW`` positions);
past that (the pending token, a drafted chain) it reads its own prediction of the state before.
Positions read with a prediction are read again once the target's state for them exists:
``logits_after`` rolls back to the last position read with a state of the target's own.

Where the target keeps no state for the positions before (a document whose prefix was computed
before, a restart), the head's cache starts again after them: its ``ids`` still hold every token,
as a draft model's cache would, so the planner's catch-up counts stay true.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from specd.engine.caches import FEATURE_WINDOW, KVState, common_prefix
from specd.engine.feature_head import FeatureHead, HeadCache, chain_guesses, lookup_guesses


# Positions a head reads back from the target's last state when it starts again (a new document,
# a jump): the target's state already carries the context, so the head's agreement does not grow
# with more of its own (docs/engine.md), while each position read costs a head forward's row.
READ_BACK = 64


class HeadPath:
    """What the engine asks of a draft's forward path, for a feature head: a name for logs, the
    stats and the calibration's key; nothing recorded, replayed or reclaimed."""

    name = "feature-head"
    description = "a feature head reading the target's final hidden states"
    lazy_head = rows_from = trees = replays = host_ids = gives_hidden = False
    recordings = 0

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        return None

    def forget_uses(self) -> None:
        return None


HEAD_PATH = HeadPath()


class HeadState:
    """One concern: the feature head's cache for one document, kept in step with the target's
    state of the same document (see the module docstring)."""

    path = HEAD_PATH
    lazy_head = merges_prompt = trees = False
    recordings = 0

    def __init__(self, head: FeatureHead, target: KVState):
        self.head = head
        self.model = head
        self.target = target
        target.keeps_features = True
        self.device = head.rows.device
        self.vocab_size = head.config.vocab_size
        self.ids: list[int] = []
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.ids = []
        self.cache = HeadCache()
        self._start = 0  # the position the head's cache starts at
        self._outputs: list[torch.Tensor] = []  # the predicted state [D] of each position read
        self._true = 0  # positions before this were read with the target's own states

    def rollback(self, length: int) -> None:
        if length < len(self.ids):
            del self.ids[length:]
            read = max(0, length - self._start)
            self.cache.crop(read)
            del self._outputs[read:]
            self._true = min(self._true, length)

    def logits_after(self, seq: Sequence[int]) -> torch.Tensor:
        """Logits [1, V] of the token after ``seq``."""
        self.rollback(min(common_prefix(self.ids, seq), len(seq) - 1, self._true))
        return self.extend(seq[len(self.ids):], last_only=True)

    def prefill(self, ids: Sequence[int], deadline: float | None = None, piece: int | None = None) -> bool:
        """Hold exactly ``ids``, reading none of them: a chain reads the last ``READ_BACK``
        positions it needs when it is drafted (``logits_after``), so a document the planner
        never drafts on costs the head nothing, and a prompt prefilled in pieces is not read
        piece by piece."""
        self.rollback(common_prefix(self.ids, ids))
        self.ids.extend(ids[len(self.ids):])
        return True

    def extend(self, new_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Read ``new_ids``; logits [len(new_ids), V] of the token after each (or [1, V])."""
        new = list(new_ids)
        states = self._read(new)
        if last_only:
            states = states[-1:]
        return self._logits(states)

    def chained_next(self, ids: Sequence[int]) -> tuple[list[int], list[float]] | None:
        """For ``ids`` that the target has run whole, keeping every state: at each position i, the
        head's greedy token (and its probability) after ``ids[:i + 1]`` and the head's own first
        drafted token there, read as a chain reads it (the head's predicted state at i + 1, not
        the target's); -1 (and 0.0) at position 0, which has no state before it. None where the
        target no longer keeps every state. It leaves the head's cache as it was."""
        n = len(ids)
        features = self.target.features(0, n - 1) if n >= 2 else None
        if features is None:
            return None
        head = self.head
        with torch.inference_mode():
            states = features.to(head.rows.dtype)[None]
            tokens = torch.tensor([list(ids[1:])], device=self.device)
            guesses = torch.tensor([lookup_guesses(ids, 1)], device=self.device) if head.config.guess else None
            predicted = head(states, tokens, guesses)
            emitted = head.vocab[head.scores(predicted).argmax(-1)]  # the head's first token at each position
            after = None
            if head.config.guess:
                after = torch.tensor([chain_guesses(ids, emitted[0].tolist())], device=self.device)
            top = torch.softmax(head.scores(head.second(states, tokens, predicted, emitted, guesses, after)).float(),
                                -1).max(-1)
        return [-1] + head.vocab[top.indices[0]].tolist(), [0.0] + top.values[0].tolist()

    def nbytes(self) -> int:
        return self.cache.nbytes() + sum(t.numel() * t.element_size() for t in self._outputs)

    def prepare(self, ahead: int) -> int:
        return 0

    def _read(self, new: list[int]) -> list[torch.Tensor | None]:
        """Read the positions of ``new`` (after ``ids``); each one's predicted state, None where
        the head could not read it (no state before it, the target's or its own)."""
        self.forwards += 1
        first = len(self.ids)
        seq = self.ids + new
        self.ids = seq
        states: list[torch.Tensor | None] = [None] * len(new)
        # The target's own states: positions p whose tokens up to p the target has run (its state
        # at p - 1 is the one that emitted token p) and whose state at p - 1 it keeps.
        kept = self.target.features_from
        true_end = min(len(seq), common_prefix(self.target.ids, seq) + 1)
        p = first
        if kept is not None and p < true_end and kept + 1 < true_end:
            earliest = max(kept + 1, 1, true_end - READ_BACK)
            if p < earliest or p != self._start + self.cache.length:
                self._restart(max(p, earliest))  # the states before are gone, or not worth reading
            p = self._start + self.cache.length
            features = self.target.features(p - 1, true_end - 1)
            if features is not None and p < true_end:
                out = self._step(features, seq, p, true_end)
                for i in range(p, true_end):
                    states[i - first] = out[i - p]
                self._true = true_end
                p = true_end
        # Past the target's states: each position reads the state the head predicted before it.
        while p < len(seq):
            if p != self._start + self.cache.length or not self._outputs:
                break  # nothing read before it: these positions stay unread
            out = self._step(self._outputs[-1][None], seq, p, p + 1)
            states[p - first] = out[0]
            p += 1
        self._trim()
        return states

    def _restart(self, start: int) -> None:
        self.cache = HeadCache()
        self._outputs = []
        self._start = start
        self._true = start  # the positions before it can be read no better

    def _step(self, features: torch.Tensor, seq: list[int], start: int, end: int) -> torch.Tensor:
        """The head over positions ``start`` .. ``end - 1`` of ``seq`` (their tokens, and prompt
        lookup's guesses from the document's tokens before each, for a head that reads them)."""
        guesses = None
        if self.head.config.guess:
            guesses = torch.tensor(lookup_guesses(seq, start, end), device=self.device)
        with torch.inference_mode():
            out = self.head.step(features.to(self.head.rows.dtype), torch.tensor(seq[start:end], device=self.device),
                                 self.cache, guesses)
        self._outputs.extend(out)
        return out

    def _trim(self) -> None:
        """Past twice the target's feature window, keep the head's cache to the last window: it
        attends over the recent code, as it was trained to, and a long session does not grow it
        without end (by halves, so the copy is rare)."""
        if self.cache.length > 2 * FEATURE_WINDOW:
            extra = self.cache.length - FEATURE_WINDOW
            with torch.inference_mode():  # the cache's tensors were made in it (``_step``)
                self.cache.drop_front(extra)
            del self._outputs[:extra]
            self._start += extra

    def _logits(self, states: list[torch.Tensor | None]) -> torch.Tensor:
        """Rows [n, V]: the head's scores over its vocabulary, -inf elsewhere; an unread
        position's row is uniform over the vocabulary (no confidence: a chain stops there)."""
        rows = torch.full((len(states), self.vocab_size), float("-inf"), device=self.device)
        vocab = self.head.vocab
        with torch.inference_mode():
            for i, state in enumerate(states):
                rows[i, vocab] = self.head.scores(state).float() if state is not None else 0.0
        return rows
