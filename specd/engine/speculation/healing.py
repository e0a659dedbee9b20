"""Token healing: the prompt ends at a token boundary before the cursor, and the first generated
tokens are constrained to re-type what was cut.

Why: byte-level BPE tokenizers (GPT-2, Qwen, StarCoder, DeepSeek ...) split ``"\\n        self"``
as ``"\\n"``, 7 spaces, ``" self"``; a prompt that ends in 8 spaces (a fresh indented line) or in
half a word ends in a token the model has rarely seen there, and it writes whitespace or junk.
So the prompt drops its last token (``heal``) and generation must start with that token's text:
each generated token's text either starts with what is still to re-type, or is a prefix of it
(``remaining``). The constraint masks the target's logits (``mask``), for drafts and
verification alike, so output stays the target's greedy (or sampled) output under the same
constraint; the returned completion is what follows the cursor.

Tokenizer-agnostic: a token's text is measured in context (decoded after a fixed plain token,
so SentencePiece's leading-space marker counts), never from a list of families.

Line breaks: a token that re-types the cut text may go on past it only without a line break of
another style than the document's (``foreign_break``: a ``\r`` in an LF document, a lone ``\n`` in
a CRLF one), the same rule by which the stop rules end a completion.
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from specd.suggestion_rules import foreign_break


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """Each id's text as it reads after a plain token, for ids below ``vocab_size``; "" for an id
    that is never allowed while healing (a special token, one beyond the tokenizer, part of a
    UTF-8 sequence). One batch decode of the whole vocabulary: the costly part of a
    ``HealingVocabulary``, which is why the engine caches its result (``healing_cache``)."""
    lead = tokenizer.encode("x", add_special_tokens=False)[-1]
    base = tokenizer.decode([lead])
    known = min(len(tokenizer), vocab_size)
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)}
    decoded = tokenizer.batch_decode([[lead, i] for i in range(known)], skip_special_tokens=False)
    texts = [""] * vocab_size
    for i, text in enumerate(decoded):
        if i in special or not text.startswith(base):
            continue
        text = text[len(base):]
        if not text or "\ufffd" in text:  # part of a UTF-8 sequence: no text of its own
            continue
        texts[i] = text
    return texts


class HealingVocabulary:
    """Every token's text, indexed by its first character, for constraint checks."""

    def __init__(self, tokenizer, vocab_size: int, texts: Sequence[str] | None = None):
        """``texts``: ``token_texts(tokenizer, vocab_size)`` when it is known already (a cached
        copy); decoded here otherwise."""
        self.vocab_size = vocab_size
        self.texts: list[str] = token_texts(tokenizer, vocab_size) if texts is None else list(texts)
        if len(self.texts) != vocab_size:
            raise ValueError(f"{len(self.texts)} token texts for a vocabulary of {vocab_size}")
        # Every non-empty text in sorted order, equal texts by increasing id: the texts that start
        # with a cut text, and those equal to one of its prefixes, are runs of it (``_candidates``).
        # A look-up by first character walked a third of the vocabulary for a cut that starts with
        # a space (milliseconds on a large vocabulary: docs/engine.md), once per keystroke, each cut
        # being new.
        order = sorted((i for i, text in enumerate(self.texts) if text), key=self.texts.__getitem__)
        self._sorted_texts = [self.texts[i] for i in order]
        self._sorted_ids = np.array(order, dtype=np.int64)
        self._allowed: dict[tuple[str, str], torch.Tensor] = {}
        # Texts holding a line break: only these can break a document's line-break style, so
        # ``allowed`` judges only them (a cut's candidates run to thousands of tokens).
        self._breaks = [("\n" in text or "\r" in text) for text in self.texts]

    def decode_tail(self, tokenizer, ids: Sequence[int]) -> str:
        """The text the last of ``ids`` adds after the ones before it."""
        if len(ids) == 1:
            return self.texts[ids[0]] if ids[0] < self.vocab_size else ""
        return tokenizer.decode(list(ids[-2:]))[len(tokenizer.decode(list(ids[-2:-1]))):]

    def allowed(self, rest: str, newline: str = "\n") -> torch.Tensor:
        """Ids whose text starts with ``rest`` or is a non-empty prefix of it (a LongTensor), and
        goes on past it without a line break foreign to a ``newline`` document.

        When ``rest`` is whitespace ending in spaces or tabs (the indentation the editor put on a
        fresh line, or the space after a word), a token may not go on with more of them: the
        cursor's indentation is the user's, and a model that liked a deeper one (a 12-space token
        where 8 were typed) would shift the whole suggestion right of it."""
        ids = self._allowed.get((rest, newline))
        if ids is None:
            exact_indent = not rest.strip() and rest[-1] in " \t"
            size = len(rest)

            def ok(text: str) -> bool:
                if rest.startswith(text):
                    return True
                return text.startswith(rest) and not (exact_indent and text[size:size + 1] in (" ", "\t")) \
                    and foreign_break(text, newline, size) < 0

            texts, breaks = self.texts, self._breaks
            ids = torch.tensor([i for i in self._candidates(rest)
                                if (not exact_indent and not breaks[i]) or ok(texts[i])], dtype=torch.long)
            if len(self._allowed) > 4096:
                self._allowed.clear()
            self._allowed[(rest, newline)] = ids
        return ids

    def _candidates(self, rest: str) -> list[int]:
        """Ids whose text starts with ``rest`` (a run of the sorted texts) or is a shorter
        non-empty prefix of it (a run each, before the first), in increasing order."""
        texts = self._sorted_texts
        start = bisect.bisect_left(texts, rest)
        if ord(rest[-1]) < sys.maxunicode:  # the run ends before the first text past every extension of rest
            end = bisect.bisect_left(texts, rest[:-1] + chr(ord(rest[-1]) + 1), start)
        else:
            end = start
            while end < len(texts) and texts[end].startswith(rest):
                end += 1
        shorter = []  # runs of the texts equal to a shorter prefix of rest
        for size in range(1, len(rest)):
            first = last = bisect.bisect_left(texts, rest[:size], 0, start)
            while last < start and texts[last] == rest[:size]:
                last += 1
            shorter.append(self._sorted_ids[first:last])
        return np.sort(np.concatenate([self._sorted_ids[start:end], *shorter])).tolist()

    def remaining(self, healed: str, tokens: Sequence[int]) -> str | None:
        """What is still to re-type after ``tokens`` ("" once done); None if a token broke it."""
        rest = healed
        for token in tokens:
            if not rest:
                return ""
            text = self.texts[token] if 0 <= token < self.vocab_size else ""
            if not text:
                return None
            if text.startswith(rest):
                rest = ""
            elif rest.startswith(text):
                rest = rest[len(text):]
            else:
                return None
        return rest

    def mask(self, logits: torch.Tensor, healed: str, before: Sequence[int], draft: Sequence[int],
             newline: str = "\n") -> torch.Tensor:
        """``logits`` [k + 1, V] with the constraint applied (a copy when any row changes): row i
        follows ``before`` + draft[:i]. Rows after a draft token that broke the constraint are
        left alone: verification rejects that token (its masked probability is 0) first."""
        rest = self.remaining(healed, before)
        out = None
        for i in range(len(draft) + 1):
            if not rest:
                break
            if out is None:
                out = logits.clone()  # the forward's output may be an inference tensor: never in place
            keep = self.allowed(rest, newline).to(out.device)
            row = torch.full_like(out[i], float("-inf"))
            row[keep] = out[i, keep]
            out[i] = row
            if i < len(draft):
                rest = self.remaining(rest, draft[i:i + 1])
        return logits if out is None else out

    def mask_row(self, row: torch.Tensor, healed: str, before: Sequence[int], newline: str = "\n") -> torch.Tensor:
        """One row of logits [V] for the token after ``before``, constrained like ``mask``'s rows
        (a copy when constrained): what greedy verification reads one row at a time."""
        rest = self.remaining(healed, before)
        if not rest:  # done re-typing (""), or already broken (None: that token is never accepted)
            return row
        out = torch.full_like(row, float("-inf"))
        keep = self.allowed(rest, newline).to(row.device)
        out[keep] = row[keep]
        return out

    def prefix_allowed_fn(self, healed: str, prompt_length: int, newline: str = "\n"):
        """The same constraint for ``generate(prefix_allowed_tokens_fn=...)`` (tests, bench peers)."""
        everything = torch.arange(self.vocab_size)  # a tensor: transformers indexes its mask with it, cheaply

        def allowed(batch_id: int, input_ids: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[-1] - prompt_length > len(healed):  # past the cut text: free
                return everything
            rest = self.remaining(healed, input_ids[prompt_length:].tolist())
            return self.allowed(rest, newline) if rest else everything

        return allowed


class Constraint(Protocol):
    """Masks logits under token healing, as the decode loop's verification (the target's) and a
    drafter drafting under it apply it: ``rows`` for a forward's rows [k + 1, V] after
    ``before`` + draft[:i], ``row`` for one row [V] after ``before`` (the output so far).
    ``HealingConstraint`` is the one kind there is."""

    def rows(self, logits: torch.Tensor, before: Sequence[int], draft: Sequence[int]) -> torch.Tensor: ...
    def row(self, logits: torch.Tensor, before: Sequence[int]) -> torch.Tensor: ...
    def settled(self, generated: Sequence[int]) -> bool: ...  # binds nothing after ``generated``
    def allows(self, generated: Sequence[int], draft: Sequence[int]) -> int: ...  # draft's first tokens it allows


@dataclass(frozen=True)
class HealingConstraint:
    """The constraint of one healed prompt, as the decode loop applies it (``Constraint``)."""

    vocabulary: HealingVocabulary
    healed: str
    newline: str = "\n"  # the document's line break (see foreign_break)

    def rows(self, logits: torch.Tensor, before: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        return self.vocabulary.mask(logits, self.healed, before, draft, self.newline)

    def row(self, logits: torch.Tensor, before: Sequence[int]) -> torch.Tensor:
        return self.vocabulary.mask_row(logits, self.healed, before, self.newline)

    def settled(self, generated: Sequence[int]) -> bool:
        """Whether ``generated`` re-typed the cut text (nothing is masked after it): the decode
        loop then drops the constraint."""
        return self.vocabulary.remaining(self.healed, generated) == ""

    def allows(self, generated: Sequence[int], draft: Sequence[int]) -> int:
        """How many of ``draft``'s first tokens the constraint allows after ``generated``: a
        verification masks the rest to probability 0, so they can only be rejected."""
        rest = self.vocabulary.remaining(self.healed, generated)
        for i, token in enumerate(draft):
            if not rest:  # re-typed ("", nothing masked from here) or broken (None: never reached)
                return len(draft)
            if not bool((self.vocabulary.allowed(rest, self.newline) == token).any()):
                return i
            rest = self.vocabulary.remaining(rest, [token])
        return len(draft)
