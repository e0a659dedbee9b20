"""llama.cpp's own tokenizer of a GGUF file, behind the calls specd's front makes of a
transformers tokenizer (``encode``, ``decode``, token lookups, offsets, the special ids).

Why llama.cpp's and not transformers' GGUF loading: a GGUF model is decoded by llama.cpp, and
losslessness is judged against llama.cpp's greedy output of the same file, so the prompt's ids
must be the ids llama.cpp itself gives. transformers rebuilds a tokenizer from the GGUF fields
and guesses its pre-tokenizer; on llama.cpp's own test strings (the ``ggml-vocab-*.gguf`` files
and their expected ids) it gave other ids on several vocabularies, and loaded large vocabularies
slowly, while llama.cpp's tokenizer is the reference by definition (docs/llamacpp.md has the
counts and times).

Text in, as transformers does by default: special tokens written in the text are parsed as
such (``parse_special``), and ``add_special_tokens`` adds what the file says (BOS) only when
asked. Text out: control tokens' text is written unless ``skip_special_tokens``; a
SentencePiece vocabulary's leading space of the first token is dropped, as transformers' Llama
decoder does.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from specd.llamacpp.runtime import import_llama_cpp

ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED = 1 << 0, 1 << 3, 1 << 4  # llama_token_attr bits
NO_TOKEN = -1  # LLAMA_TOKEN_NULL


class SpecialToken:
    """What ``added_tokens_decoder`` maps an id to: its text and whether it is special (a
    control token), as transformers' ``AddedToken`` says."""

    __slots__ = ("content", "special")

    def __init__(self, content: str, special: bool):
        self.content = content
        self.special = special

    def __repr__(self) -> str:
        return f"SpecialToken({self.content!r}, special={self.special})"


class LlamaCppTokenizer:
    """The tokenizer of one GGUF file, read by llama.cpp (a vocabulary-only load: no weights)."""

    def __init__(self, llama_model, path: str | Path):
        """``llama_model``: llama-cpp-python's ``_internals.LlamaModel`` of the file (its vocabulary
        is used; the object is kept alive here)."""
        self._llama_cpp = import_llama_cpp()
        self._model = llama_model
        self._vocab = llama_model.vocab
        self.path = str(path)
        lc = self._llama_cpp
        self.n_tokens = lc.llama_vocab_n_tokens(self._vocab)
        self._texts: list[str] | None = None  # every token's text, read on first lookup
        self._ids: dict[str, int] | None = None
        self._attrs: list[int] | None = None

        def token(value: int) -> int | None:
            return None if value == NO_TOKEN or value >= self.n_tokens else value

        self.bos_token_id = token(lc.llama_vocab_bos(self._vocab))
        self.eos_token_id = token(lc.llama_vocab_eos(self._vocab))
        self.pad_token_id = token(lc.llama_vocab_pad(self._vocab))
        self._add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self._add_eos = bool(lc.llama_vocab_get_add_eos(self._vocab))

    # -- the vocabulary -------------------------------------------------------------------

    def _read_vocabulary(self) -> None:
        lc, vocab = self._llama_cpp, self._vocab
        texts, attrs = [], []
        for i in range(self.n_tokens):
            texts.append(lc.llama_vocab_get_text(vocab, i).decode("utf-8", errors="replace"))
            attrs.append(int(lc.llama_vocab_get_attr(vocab, i)))
        ids: dict[str, int] = {}
        for i, text in enumerate(texts):
            ids.setdefault(text, i)  # the first id of a text, as a lookup by text finds it
        self._texts, self._attrs, self._ids = texts, attrs, ids

    @property
    def texts(self) -> list[str]:
        if self._texts is None:
            self._read_vocabulary()
        return self._texts

    @property
    def attrs(self) -> list[int]:
        if self._attrs is None:
            self._read_vocabulary()
        return self._attrs

    def __len__(self) -> int:
        return self.n_tokens

    def get_vocab(self) -> dict[str, int]:
        if self._ids is None:
            self._read_vocabulary()
        return dict(self._ids)

    @functools.cached_property
    def unk_token_id(self) -> int | None:
        # cached: each prompt asks for it per FIM marker (PromptBuilder.special), and it is a scan
        # of the whole vocabulary (152k tokens for Qwen2.5); the vocabulary never changes
        return next((i for i, attr in enumerate(self.attrs) if attr & ATTR_UNKNOWN), None)

    @property
    def all_special_ids(self) -> list[int]:
        """Control and unknown tokens (BOS, EOS, FIM markers ...): never text of a completion."""
        return list(self._special_ids)

    @functools.cached_property
    def _special_ids(self) -> tuple[int, ...]:
        return tuple(i for i, attr in enumerate(self.attrs) if attr & (ATTR_CONTROL | ATTR_UNKNOWN))

    @property
    def added_tokens_decoder(self) -> dict[int, SpecialToken]:
        """The vocabulary's control and user-defined tokens, as transformers lists added tokens."""
        return {i: SpecialToken(self.texts[i], bool(attr & ATTR_CONTROL))
                for i, attr in enumerate(self.attrs) if attr & (ATTR_CONTROL | ATTR_USER_DEFINED)}

    def convert_tokens_to_ids(self, tokens):
        """The id of a token's text (or of each in a list); None for a text not in the vocabulary."""
        if self._ids is None:
            self._read_vocabulary()
        if isinstance(tokens, str):
            return self._ids.get(tokens)
        return [self._ids.get(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.texts[ids] if 0 <= ids < self.n_tokens else None
        return [self.convert_ids_to_tokens(int(i)) for i in ids]

    def fingerprint(self) -> str:
        """A hash of what the token texts depend on: every token's text and attributes, the
        vocabulary's kind, and the llama-cpp-python version (whose llama.cpp decodes them)."""
        digest = hashlib.sha256()
        digest.update(f"llama-cpp-python {self._llama_cpp.__version__}|"
                      f"{self._llama_cpp.llama_vocab_type(self._vocab)}|{self.n_tokens}".encode())
        for text, attr in zip(self.texts, self.attrs):
            digest.update(text.encode("utf-8", errors="replace") + b"\0" + str(attr).encode() + b"\0")
        return digest.hexdigest()

    # -- text to ids ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8  # a token covers one byte at least; BOS/EOS beside
        while True:
            tokens = (self._llama_cpp.llama_token * capacity)()
            count = self._llama_cpp.llama_tokenize(self._vocab, data, len(data), tokens, capacity,
                                                   add_special_tokens, True)
            if count >= 0:
                return list(tokens[:count])
            capacity = -count

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        """``{"input_ids": ids}`` and, when asked, ``"offset_mapping"``: each token's (start, end)
        in characters of ``text``, from the bytes of its piece (a SentencePiece vocabulary's
        leading space, which the text does not hold, is not counted)."""
        ids = self.encode(text, add_special_tokens)
        out: dict = {"input_ids": ids}
        if return_offsets_mapping:
            # The front asks for offsets of every prompt window it fits (thousands of tokens):
            # piece lengths come from a per-token memo and the spans are computed as arrays.
            char_at = _byte_to_char(text)
            last = len(char_at) - 1
            sizes = self._piece_sizes(ids)
            ends = np.cumsum(sizes) + min(0, last - int(sizes.sum()))  # less the added leading space, if any
            starts = ends - sizes
            spans = np.stack([char_at[np.clip(starts, 0, last)], char_at[np.clip(ends, 0, last)]], axis=1)
            out["offset_mapping"] = list(map(tuple, spans.tolist()))
        return out

    def _piece_sizes(self, ids: list[int]) -> np.ndarray:
        """Bytes of each token's piece as the offsets count them, each token's read once."""
        held = np.asarray(ids, dtype=np.int64)
        sizes = self._piece_bytes[held]
        for at in np.flatnonzero(sizes < 0).tolist():
            sizes[at] = self._piece_bytes[held[at]] = len(self._piece(ids[at]))
        return sizes

    @functools.cached_property
    def _piece_bytes(self) -> np.ndarray:
        return np.full(self.n_tokens, -1, dtype=np.int64)  # per token id; -1 until read

    def _piece(self, token: int) -> bytes:
        buffer = ctypes.create_string_buffer(64)
        size = self._llama_cpp.llama_token_to_piece(self._vocab, token, buffer, 64, 0, True)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = self._llama_cpp.llama_token_to_piece(self._vocab, token, buffer, -size, 0, True)
        return buffer.raw[:size]

    # -- ids to text ----------------------------------------------------------------------

    def decode(self, ids: Sequence[int] | Iterable[int], skip_special_tokens: bool = False, **_unused) -> str:
        """``ids`` as text (invalid UTF-8, a token cut within a character, as U+FFFD).
        ``clean_up_tokenization_spaces`` and the like are transformers' and do nothing here."""
        ids = [int(i) for i in ids]
        if not ids:
            return ""
        tokens = (self._llama_cpp.llama_token * len(ids))(*ids)
        capacity = 16 * len(ids) + 16
        while True:
            buffer = ctypes.create_string_buffer(capacity)
            size = self._llama_cpp.llama_detokenize(self._vocab, tokens, len(ids), buffer, capacity,
                                                    False, not skip_special_tokens)
            if size >= 0:
                return buffer.raw[:size].decode("utf-8", errors="replace")
            capacity = -size

    def batch_decode(self, sequences: Iterable[Sequence[int]], skip_special_tokens: bool = False, **_unused) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]


def _byte_to_char(text: str) -> np.ndarray:
    """For each byte offset of ``text``'s UTF-8 form (and its end), the character it falls in:
    a character starts at every byte that is not a continuation byte (0b10xxxxxx)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    out = np.empty(len(data) + 1, dtype=np.int64)
    out[:-1] = np.cumsum((data & 0xC0) != 0x80) - 1
    out[-1] = len(text)
    return out
