"""Fill-in-the-middle prompts: templates per model family (data), detection, token windows.

Prompt layout is chosen so typing at the cursor invalidates as little KV cache as possible:
extra context chunks first (stable across keystrokes), then one of three layouts:

- ``spm`` (families trained suffix-first): suffix, then prefix, so a keystroke only changes the
  prompt's tail;
- ``anchored`` (prefix-suffix-middle families: Qwen2.5-Coder, StarCoder2, DeepSeek-Coder ...):
  the prefix ends at a stable *anchor* (a line start at or before the cursor's line) and the
  text typed between the anchor and the cursor rides after the middle token, as the forced
  start of the middle. FIM training teacher-forces the middle, so a partial middle is in
  distribution, and a keystroke changes only the prompt's tail here too. The anchor stays put
  while the cursor stays within ``ANCHOR_MAX_LINES`` lines / ``ANCHOR_MAX_CHARS`` characters
  after it (``choose_anchor``);
- ``psm``: the standard order with the prefix ending at the cursor (every keystroke re-prefills
  the whole suffix window).

The prefix window starts on a line that is a multiple of ``WINDOW_STEP_LINES``, so the start
moves in coarse jumps instead of sliding with every character.

Texts are tokenized as the families' own infilling code does: the prefix as a text's start (a
SentencePiece tokenizer prepends its implicit space there, as Meta's and Mistral's ``encode`` do),
the suffix and the typed middle as continuations, without that space (their
``encode_infilling``: encode ``"☺" + text`` and drop the marker's tokens). Byte-level tokenizers
prepend nothing, so both are their plain ``encode``.
"""

from __future__ import annotations

import bisect
import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from specd.engine.types import ContextChunk, EngineError

PREFIX, SUFFIX = "{prefix}", "{suffix}"
WINDOW_STEP_LINES = 32  # a prefix window starts on a line whose number is a multiple of this ...
NARROW_STEP_LINES = 4  # ... or of this in a narrowed builder's, whose whole window is a few dozen lines
CUT_STEPS = 4  # a window cut inside its last grid stretch moves its start by a budget / CUT_STEPS tokens at a time
LAYOUTS = ("psm", "spm", "anchored")
ANCHOR_MAX_LINES = 8  # the anchor moves to the cursor's line once the typed span is longer ...
ANCHOR_MAX_CHARS = 640  # ... in lines or characters (FIM middles of this size are common in training)
ANCHOR_RESERVE_TOKENS = 192  # of the prefix budget, kept for the forced middle (at most a quarter)
ENCODE_MEMO = 64  # texts whose ids PromptBuilder.encode remembers
CHARS_PER_TOKEN_CAP = 12  # no tokenizer packs more chars than this into a token, on average
CONTINUATION_MARKER = "☺"  # what Meta's and Mistral's infilling code encodes before a continuation


@dataclass(frozen=True)
class FimTemplate:
    name: str
    psm: tuple[str, ...]  # parts: special-token strings and the PREFIX / SUFFIX placeholders
    spm: tuple[str, ...] | None = None  # suffix-first layout, when the family was trained on it
    stop_tokens: tuple[str, ...] = ()
    repo_name: str | None = None  # repo-level context, Qwen2.5-Coder / StarCoder2 style
    file_sep: str | None = None
    bos: bool = False  # prepend the tokenizer's BOS token
    marker: str | None = None  # a vocabulary entry that identifies the family
    file_header: bool = False  # the file's own header (file_sep + path) even without other files' chunks

    def layout(self, suffix_first: bool) -> tuple[str, ...]:
        return self.spm if suffix_first and self.spm else self.psm

    @property
    def middle_after_suffix(self) -> bool:
        """Whether the standard layout ends with a middle token after the suffix (where a
        forced middle can ride); False for prefix-last templates (Codestral, plain)."""
        return SUFFIX in self.psm and self.psm.index(SUFFIX) > self.psm.index(PREFIX) \
            and self.psm[-1] not in (PREFIX, SUFFIX)


def resolve_layout(template: FimTemplate, requested: str = "auto") -> str:
    """The layout a template can serve: ``auto`` is spm for families trained suffix-first, else
    anchored where the template has a middle token after the suffix, else psm."""
    if requested not in ("auto", *LAYOUTS):
        raise EngineError(f"unknown FIM layout {requested!r} (known: auto, {', '.join(LAYOUTS)})")
    if requested == "spm" and template.spm is None:
        raise EngineError(f"FIM family {template.name!r} has no suffix-first layout; use psm or anchored")
    if requested == "auto":
        if template.spm is not None:
            return "spm"
        return "anchored" if template.middle_after_suffix else "psm"
    if requested == "anchored" and not template.middle_after_suffix:
        return "psm"  # the prefix already ends the prompt: typing only changes the tail
    return requested


def choose_anchor(text: str, offset: int, previous: int | None) -> int:
    """Where an anchored prompt's prefix ends: ``previous`` while it is still a line start at
    most ``ANCHOR_MAX_LINES`` lines and ``ANCHOR_MAX_CHARS`` characters before the cursor,
    else the start of the cursor's line. A pure function of its inputs, so every caller that
    sees the same requests (the daemon, idle prefill, the bench's peers) builds the same ids."""
    line_start = text.rfind("\n", 0, offset) + 1
    if previous is None or not 0 <= previous <= line_start:
        return line_start
    if previous > 0 and text[previous - 1] != "\n":
        return line_start
    if offset - previous > ANCHOR_MAX_CHARS or text.count("\n", previous, offset) >= ANCHOR_MAX_LINES:
        return line_start
    return previous


_QWEN_STOPS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>",
               "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")

TEMPLATES: dict[str, FimTemplate] = {
    # CodeGemma: Qwen's FIM token strings, its own file separator and end of turn; detected
    # first (its marker is its own), since its vocabulary holds "<|fim_prefix|>" too.
    "codegemma": FimTemplate(
        "codegemma", ("<|fim_prefix|>", PREFIX, "<|fim_suffix|>", SUFFIX, "<|fim_middle|>"),
        stop_tokens=("<eos>", "<|file_separator|>", "<end_of_turn>", "<|fim_prefix|>", "<|fim_suffix|>",
                     "<|fim_middle|>"),
        bos=True, marker="<|file_separator|>"),
    "qwen": FimTemplate(
        "qwen", ("<|fim_prefix|>", PREFIX, "<|fim_suffix|>", SUFFIX, "<|fim_middle|>"),
        stop_tokens=_QWEN_STOPS, repo_name="<|repo_name|>", file_sep="<|file_sep|>", marker="<|fim_prefix|>"),
    # The embedded demo pair: Qwen tokens, trained on both PSM and SPM.
    "demo": FimTemplate(
        "demo", ("<|fim_prefix|>", PREFIX, "<|fim_suffix|>", SUFFIX, "<|fim_middle|>"),
        spm=("<|fim_suffix|>", SUFFIX, "<|fim_prefix|>", PREFIX, "<|fim_middle|>"),
        stop_tokens=_QWEN_STOPS, repo_name="<|repo_name|>", file_sep="<|file_sep|>"),
    "starcoder": FimTemplate(
        "starcoder", ("<fim_prefix>", PREFIX, "<fim_suffix>", SUFFIX, "<fim_middle>"),
        stop_tokens=("<|endoftext|>", "<file_sep>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>"),
        repo_name="<repo_name>", file_sep="<file_sep>", marker="<fim_prefix>"),
    "deepseek": FimTemplate(
        "deepseek", ("<｜fim▁begin｜>", PREFIX, "<｜fim▁hole｜>", SUFFIX, "<｜fim▁end｜>"),
        stop_tokens=("<｜end▁of▁sentence｜>", "<|EOT|>", "<｜fim▁begin｜>"), bos=True, marker="<｜fim▁begin｜>"),
    "codellama": FimTemplate(
        "codellama", ("▁<PRE>", PREFIX, "▁<SUF>", SUFFIX, "▁<MID>"),
        stop_tokens=("▁<EOT>", "</s>"), bos=True, marker="▁<PRE>"),
    "codestral": FimTemplate(
        "codestral", ("[SUFFIX]", SUFFIX, "[PREFIX]", PREFIX),
        stop_tokens=("</s>",), bos=True, marker="[SUFFIX]"),
    # Models without FIM tokens whose vocabulary marks files as StarCoder's training data does
    # (SmolLM2): the prefix after a file header, as such a model read code in training. Without
    # the header a fresh indented line reads as the end of a chat answer's code block.
    "plain-files": FimTemplate("plain-files", (PREFIX,), repo_name="<repo_name>", file_sep="<file_sep>",
                               stop_tokens=("<|endoftext|>", "<file_sep>", "<repo_name>", "<filename>"),
                               marker="<file_sep>", file_header=True),
    # Any causal LM without FIM tokens: complete from the prefix alone.
    "plain": FimTemplate("plain", (PREFIX,), stop_tokens=()),
}


def detect_family(tokenizer, model_dir: str | None = None, override: str = "auto") -> FimTemplate:
    """Family from config override, else a ``specd.json`` beside the weights, else the vocabulary."""
    if override and override != "auto":
        if override not in TEMPLATES:
            raise EngineError(f"unknown FIM family {override!r} (known: {', '.join(TEMPLATES)})")
        return TEMPLATES[override]
    if model_dir and (Path(model_dir) / "specd.json").is_file():
        meta = json.loads((Path(model_dir) / "specd.json").read_text(encoding="utf-8"))
        if meta.get("fim_family") in TEMPLATES:
            return TEMPLATES[meta["fim_family"]]
    for template in TEMPLATES.values():
        if template.marker and _in_vocabulary(tokenizer, template.marker):
            return template
    return TEMPLATES["plain"]


def _in_vocabulary(tokenizer, token: str) -> bool:
    """Whether ``token`` is one entry of the vocabulary: looked up, and read back the same (an
    unknown token maps to the unknown id or None). ``get_vocab`` would build a dict of every
    entry, a tenth of a second for a 152k vocabulary."""
    ids = tokenizer.convert_tokens_to_ids([token])
    if not ids or ids[0] is None:
        return False
    return tokenizer.convert_ids_to_tokens(ids[0]) == token


@dataclass
class Prompt:
    ids: list[int]
    prefix_start: int  # char offset where the prefix window starts
    suffix_end: int  # char offset where the suffix window ends
    indent: str  # leading whitespace of the cursor's line (for the block-end stop rule)
    cursor_line_tail: str = ""  # text after the cursor on its line
    chunks_used: list[str] = field(default_factory=list)
    anchor: int = -1  # char offset where the prefix ends (the cursor, unless anchored)
    forced: int = 0  # tokens at the end of ids that re-type text[anchor:cursor] after the middle token
    healed: str = ""  # text before the cursor cut from the prompt (token healing): output re-types it
    newline: str = "\n"  # the document's line break ("\r\n" when its first one is), kept by the output


def file_name(path: str | None) -> str:
    """The name a file's own header gives it: the last part of its path or URI (what the path
    says of the language, and the same wherever the project lives), "current" without one."""
    if not path:
        return "current"
    return PurePosixPath(path.split("://", 1)[-1]).name or "current"


def document_newline(text: str) -> str:
    """The line break a completion must use: the document's first one ("\n" when it has none)."""
    first = text.find("\n")
    return "\r\n" if first > 0 and text[first - 1] == "\r" else "\n"


def drops_leading_space(tokenizer) -> bool:
    """Whether the tokenizer gives a text that starts with a space no implicit space of its own
    (``tokenizers``' Metaspace with ``prepend_scheme="first"``, as newer Llama tokenizer.json
    files have it): " x" then reads "x", where SentencePiece itself, whose ids the models were
    trained on, prepends its space to every text and keeps " x"."""
    ids = tokenizer.encode(" x", add_special_tokens=False)
    return bool(ids) and tokenizer.decode(ids) == "x"


def implicit_space(tokenizer) -> bool:
    """Whether the tokenizer starts every text with a space of its own (SentencePiece's
    ``add_dummy_prefix``): "x" then reads " x" when decoded after another token."""
    x = tokenizer.encode("x", add_special_tokens=False)
    if not x:
        return False
    return tokenizer.decode(x + x) != tokenizer.decode(x) * 2


class PromptBuilder:
    """One concern: a document and a cursor to the prompt's token ids for one FIM template,
    within its token budgets (prefix and suffix windows, other files' chunks, the anchored
    layout's anchor, token healing's cut), built so successive keystrokes get windows whose
    starts stay put and whose tokens it need not encode again."""

    def __init__(self, tokenizer, template: FimTemplate, prefix_tokens: int, suffix_tokens: int,
                 extra_tokens: int = 512, layout: str = "auto"):
        self.tokenizer = tokenizer
        self.template = template
        self.prefix_tokens = prefix_tokens
        self.suffix_tokens = suffix_tokens
        self.extra_tokens = extra_tokens
        self.layout = resolve_layout(template, layout)
        self.step_lines = WINDOW_STEP_LINES
        self.healing = None  # a healing.HealingVocabulary turns token healing on (the engine sets it)
        # Continuations are encoded after CONTINUATION_MARKER where the tokenizer prepends a space
        # (None: plain encode). The marker's own tokens, which are dropped again.
        self._marker_ids: list[int] | None = None
        if implicit_space(tokenizer):
            self._marker_ids = tokenizer.encode(CONTINUATION_MARKER, add_special_tokens=False)
        # A text's start encoded as SentencePiece does it, implicit space included, where the
        # tokenizer leaves that space out before a leading space (``drops_leading_space``).
        self._start_space = self._marker_ids is not None and drops_leading_space(tokenizer)
        self._memo: OrderedDict[tuple[bool, str], list[int]] = OrderedDict()  # text -> ids, see encode
        # Prefix windows (text, grid starts, budget) -> (start, ids): in the anchored layout the
        # prefix ends at an anchor that stays put while the user types, so successive keystrokes
        # find their window here instead of re-tokenizing up to budget x 12 characters
        # (milliseconds a keystroke: docs/engine.md).
        self._windows: OrderedDict[tuple, tuple[int, list[int] | None]] = OrderedDict()
        # (window up to its last line, grid starts, budget) -> (start chosen, window length then): ``_fit_again``
        self._starts: OrderedDict[tuple, tuple[int, int]] = OrderedDict()
        self._memo_lock = threading.Lock()  # the daemon's request and idle work may both build prompts

    def narrowed(self, tokens: int) -> "PromptBuilder":
        """A builder of prompts about ``tokens`` long: the prefix and (where the template has one)
        suffix budgets scaled down together, no other files' chunks, window starts on a finer
        grid. It shares this builder's tokenizer, healing vocabulary and memos (which key on
        text and budget, so both builders' entries stay right)."""
        narrow = copy.copy(self)
        uses_suffix = SUFFIX in self.template.psm
        total = self.prefix_tokens + (self.suffix_tokens if uses_suffix else 0)
        narrow.prefix_tokens = max(1, min(self.prefix_tokens, tokens * self.prefix_tokens // max(1, total)))
        narrow.suffix_tokens = min(self.suffix_tokens, max(0, tokens - narrow.prefix_tokens)) if uses_suffix else 0
        narrow.extra_tokens = 0
        narrow.step_lines = NARROW_STEP_LINES
        return narrow

    @property
    def suffix_first(self) -> bool:
        return self.layout == "spm"

    @property
    def anchored(self) -> bool:
        return self.layout == "anchored"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a text's start; the last ``ENCODE_MEMO`` texts are remembered
        (successive keystrokes re-encode the same suffix window, the same context chunks)."""
        return self._encode(text, False)

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of ``text`` where it follows other text or a special token (the suffix, the
        typed middle, the output): without a SentencePiece tokenizer's implicit leading space."""
        return self._encode(text, self._marker_ids is not None)

    def _encode(self, text: str, continuation: bool) -> list[int]:
        if not text:
            return []
        key = (continuation, text)
        with self._memo_lock:
            ids = self._memo.get(key)
            if ids is not None:
                self._memo.move_to_end(key)
                return list(ids)
        if continuation:
            marker = self._marker_ids
            ids = self.tokenizer.encode(CONTINUATION_MARKER + text, add_special_tokens=False)
            # Where the marker merged with the text there is no clean cut: the text's own ids.
            ids = ids[len(marker):] if ids[:len(marker)] == marker else \
                self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(self._as_start(text), add_special_tokens=False)
        with self._memo_lock:
            self._memo[key] = ids
            if len(self._memo) > ENCODE_MEMO:
                self._memo.popitem(last=False)
        return list(ids)

    def _as_start(self, text: str) -> str:
        """What to encode for ``text`` as a text's start: one more space before a leading space
        where the tokenizer would drop SentencePiece's implicit one (its ids are then
        SentencePiece's)."""
        return " " + text if self._start_space and text.startswith(" ") else text

    def special(self, token: str) -> list[int]:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            return self.encode(token)
        return [token_id]

    def stop_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        for token in self.template.stop_tokens:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if token_id is not None and token_id != self.tokenizer.unk_token_id:
                ids.add(token_id)
        return ids

    def _prefix_window(self, text: str, offset: int) -> tuple[int, list[int]]:
        """Start offset (a line start on a coarse grid) and tokens of the prefix window."""
        budget = self.prefix_tokens - self.anchor_reserve
        floor = max(0, offset - budget * CHARS_PER_TOKEN_CAP)
        # Window starts: starts of lines whose absolute number is on the grid, at or after the floor.
        if floor == 0:
            pos = 0
        else:
            newline = text.find("\n", floor - 1, offset)
            pos = newline + 1 if newline >= 0 else -1
        grid_starts: list[int] = []
        line_no = text.count("\n", 0, pos) if pos >= 0 else 0
        while 0 <= pos <= offset:
            if line_no % self.step_lines == 0:
                grid_starts.append(pos)
            newline = text.find("\n", pos, offset)
            if newline < 0:
                break
            pos, line_no = newline + 1, line_no + 1
        if grid_starts:
            first = grid_starts[0]
            window = text[first:offset]
            key = (window, tuple(start - first for start in grid_starts), budget)
            with self._memo_lock:
                found = self._windows.get(key)
                if found is not None:
                    self._windows.move_to_end(key)
            if found is None:
                found = self._fit_again(window, key[1], budget) or \
                    self._fit_prefix(window, [start - first for start in grid_starts], budget)
                with self._memo_lock:
                    self._windows[key] = found
                    if len(self._windows) > ENCODE_MEMO:
                        self._windows.popitem(last=False)
            if found[1] is not None:
                return first + found[0], list(found[1])
        # The last grid stretch alone is over budget: the tokens nearest the cursor.
        start = grid_starts[-1] if grid_starts else floor
        if grid_starts:
            return self._cut_stretch(text[start:offset], start, budget)
        ids = self.encode(text[start:offset])  # one line longer than the budget's characters
        return start, ids[-budget:]

    def _cut_stretch(self, stretch: str, start: int, budget: int) -> tuple[int, list[int]]:
        """(start, ids) of the tokens of ``stretch`` (the text from line start ``start`` to the
        cursor, over ``budget`` tokens) nearest the cursor: it starts at a token boundary that
        drops a multiple of ``budget // CUT_STEPS`` tokens, so successive keystrokes keep the same
        start (and the window's cache) for that many tokens typed, instead of sliding it a token
        at a time and prefilling the whole window again at every key (a narrow window's budget
        is often less than a few lines)."""
        spans = self.tokenizer(stretch, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        step = max(1, budget // CUT_STEPS)
        drop = -(-(len(spans) - budget) // step) * step
        if 0 < drop < len(spans):
            cut = spans[drop][0]
            ids = self.encode(stretch[cut:])
            if len(ids) <= budget:
                return start + cut, ids
        return start, self.encode(stretch)[-budget:]

    def _fit_again(self, window: str, starts: tuple[int, ...], budget: int) -> tuple[int, list[int] | None] | None:
        """Where the prefix ends at the cursor (psm, prefix-last templates), a keystroke changes
        only the window's last line: the start chosen for the same text up to that line, while
        the window has not shrunk since and its tail from there still fits (the earliest start
        that fits then is the same: text added at the end only adds tokens), or (0, None) again
        where no start fitted. One encode at most instead of ``_fit_prefix``'s encode with
        offsets and its exact encode; None when nothing is known."""
        with self._memo_lock:
            known = self._starts.get(self._head(window, starts, budget))
        if known is None or len(window) < known[1]:
            return None
        if known[0] < 0:
            return 0, None
        ids = self.encode(window[known[0]:])
        return (known[0], ids) if len(ids) <= budget else None

    def _remember_start(self, window: str, starts: tuple[int, ...], budget: int, start: int) -> None:
        """What ``_fit_prefix`` chose (-1: no start fitted), for ``_fit_again``."""
        with self._memo_lock:
            self._starts[self._head(window, starts, budget)] = (start, len(window))
            if len(self._starts) > ENCODE_MEMO:
                self._starts.popitem(last=False)

    @staticmethod
    def _head(window: str, starts: tuple[int, ...], budget: int) -> tuple:
        return window[:window.rfind("\n") + 1], starts, budget

    def _fit_prefix(self, window: str, starts: list[int], budget: int) -> tuple[int, list[int] | None]:
        """(start, ids) of the longest tail of ``window`` that begins at one of ``starts`` and fits
        ``budget`` tokens; (0, None) when none does. One encode with offsets estimates every
        start's token count; then exact encodes from the first start estimated to fit (usually one)."""
        encoded = self.tokenizer(window, add_special_tokens=False, return_offsets_mapping=True)
        token_starts = [s for s, _ in encoded["offset_mapping"]]
        for start in starts:
            if len(token_starts) - bisect.bisect_left(token_starts, start) > budget + 2:
                continue
            if start or self._as_start(window) != window:
                ids = self.encode(window[start:])
            else:  # the ids just computed (the same text)
                ids = list(encoded["input_ids"])
            if len(ids) <= budget:
                self._remember_start(window, tuple(starts), budget, start)
                return start, ids
        self._remember_start(window, tuple(starts), budget, -1)
        return 0, None

    def _suffix_window(self, text: str, offset: int) -> tuple[int, list[int]]:
        if self.suffix_tokens == 0 or offset >= len(text):
            return offset, []
        end = min(len(text), offset + self.suffix_tokens * CHARS_PER_TOKEN_CAP)
        while True:
            ids = self.encode_continuation(text[offset:end])
            if len(ids) <= self.suffix_tokens or end <= offset:
                return end, ids
            # Cut at a line end, shrinking in proportion to the overshoot.
            target = offset + int((end - offset) * self.suffix_tokens / len(ids) * 0.95)
            newline = text.rfind("\n", offset, target)
            end = newline + 1 if newline > offset else target

    def _context_ids(self, chunks: list[ContextChunk], path: str | None) -> tuple[list[int], list[str]]:
        if not self.template.file_sep:
            return [], []
        if not chunks:
            if not self.template.file_header:
                return [], []
            return self.special(self.template.file_sep) + self.encode(f"{file_name(path)}\n"), []
        ids: list[int] = []
        used: list[str] = []
        for chunk in chunks:
            piece = self.special(self.template.file_sep) + self.encode(f"{chunk.path}\n{chunk.text}\n")
            if len(ids) + len(piece) > self.extra_tokens:
                continue
            ids += piece
            used.append(chunk.path)
        if ids:
            ids = self.special(self.template.repo_name) + self.encode("workspace\n") + ids if self.template.repo_name else ids
            ids += self.special(self.template.file_sep) + self.encode(f"{path or 'current'}\n")
        return ids, used

    @property
    def anchor_reserve(self) -> int:
        return min(ANCHOR_RESERVE_TOKENS, self.prefix_tokens // 4) if self.anchored else 0

    def _anchor(self, text: str, offset: int, previous: int | None) -> tuple[int, list[int]]:
        """The anchor and the forced middle's tokens: ``choose_anchor``'s, unless the span is
        over the reserved tokens; then the cursor's line start, or (a huge line) the cursor."""
        for candidate in (choose_anchor(text, offset, previous), text.rfind("\n", 0, offset) + 1):
            forced = self.encode_continuation(text[candidate:offset])
            if len(forced) <= self.anchor_reserve:
                return candidate, forced
        return offset, []

    def _heal(self, segment: str, ids: list[int]) -> tuple[list[int], str]:
        """``ids`` (the tokens of ``segment``, which ends at the cursor) without the last token,
        and that token's text, which generation must re-type; unchanged when it cannot be cut
        cleanly (a special token, or text that is not the segment's exact tail)."""
        if self.healing is None or not ids:
            return ids, ""
        tail = self.healing.decode_tail(self.tokenizer, ids)
        if not tail or "\ufffd" in tail or not segment.endswith(tail):
            return ids, ""
        return ids[:-1], tail

    def build(self, text: str, offset: int, chunks: list[ContextChunk] | None = None,
              path: str | None = None, previous_anchor: int | None = None, heal: bool = True) -> Prompt:
        """The prompt for a cursor at ``offset``. In the anchored layout the prefix ends at an
        anchor chosen from the document's ``previous_anchor`` (``choose_anchor``); the prompt
        records it, for the caller to pass back with the next request. With ``heal`` (and a
        healing vocabulary) the text before the cursor loses its last token (``Prompt.healed``)."""
        if not 0 <= offset <= len(text):
            raise EngineError(f"cursor offset {offset} is out of range 0..{len(text)}")
        anchor, forced = self._anchor(text, offset, previous_anchor) if self.anchored else (offset, [])
        prefix_start, prefix_ids = self._prefix_window(text, anchor)
        suffix_end, suffix_ids = self._suffix_window(text, offset)
        healed = ""
        if heal and forced:  # the forced middle ends at the cursor
            forced, healed = self._heal(text[anchor:offset], forced)
        elif heal:  # the prefix does
            prefix_ids, healed = self._heal(text[prefix_start:offset], prefix_ids)
        context_ids, used = self._context_ids(chunks or [], path)
        ids: list[int] = []
        if self.template.bos and self.tokenizer.bos_token_id is not None:
            ids.append(self.tokenizer.bos_token_id)
        ids += context_ids
        for part in self.template.layout(self.suffix_first):
            if part == PREFIX:
                ids += prefix_ids
            elif part == SUFFIX:
                ids += suffix_ids
            else:
                ids += self.special(part)
        ids += forced
        line_start = text.rfind("\n", 0, offset) + 1
        line = text[line_start:offset]
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        line_end = text.find("\n", offset)
        tail = text[offset: line_end if line_end >= 0 else len(text)]
        return Prompt(ids, prefix_start, suffix_end, indent, tail, used, anchor, len(forced), healed,
                      document_newline(text))
