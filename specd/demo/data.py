"""The demo pair's data: its special tokens and FIM formats, its byte-level BPE tokenizer, and
the training samples (plain windows, fill-in-the-middle in both orders, repo-level FIM with other
files' chunks) drawn from source texts. ``train`` runs the training on them."""

from __future__ import annotations

import keyword
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

# Qwen2.5-Coder's special tokens; ids 0..6 in this vocabulary, in this order.
EOS = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_PAD = "<|fim_pad|>"
REPO_NAME = "<|repo_name|>"
FILE_SEP = "<|file_sep|>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, REPO_NAME, FILE_SEP]

# Qwen2's pre-tokenizer split: words with one leading non-letter, single digits, punctuation
# runs, newline runs and whitespace runs. Byte-level after the split, so every string round-trips.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECD_JSON = {"fim_family": "demo", "spm": True}
MODEL_DTYPE_ON_DISK = "bfloat16"


@dataclass(frozen=True)
class FimFormat:
    """A model family's special tokens, as the tokenizer learns them and the samples use them."""

    family: str      # specd.json "fim_family": the engine's prompt template (specd.engine.front.prompt)
    eos: str
    prefix: str
    middle: str
    suffix: str
    pad: str
    repo_name: str
    file_sep: str
    spm: bool        # the family's template has a suffix-first layout, so samples may use it

    @property
    def special_tokens(self) -> list[str]:
        """Ids 0..6 of the vocabulary, in this order."""
        return [self.eos, self.prefix, self.middle, self.suffix, self.pad, self.repo_name, self.file_sep]

    def specd_json(self) -> dict[str, Any]:
        return dict(SPECD_JSON) if self.family == "demo" else {"fim_family": self.family}


FIM_FORMATS: dict[str, FimFormat] = {
    "qwen": FimFormat("demo", *SPECIAL_TOKENS, spm=True),
    # StarCoder / StarCoder2: the engine's "starcoder" template, prefix-suffix-middle only.
    "starcoder": FimFormat("starcoder", "<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>",
                           "<fim_pad>", "<repo_name>", "<file_sep>", spm=False),
}

# --- FIM sampling -------------------------------------------------------------------------
# How the middle is chosen (cumulative thresholds on one uniform draw). The product completes
# the rest of a line or a few whole lines, so most middles are line-shaped.
MIDDLE_EMPTY = 0.03          # nothing to insert: the model must learn to stop at once
MIDDLE_REST_OF_LINE = 0.38   # from the cursor to the end of its line (and maybe more lines)
MIDDLE_WHOLE_LINES = 0.73    # 1..MAX_MIDDLE_LINES whole lines; the rest: a random char span
MAX_MIDDLE_LINES = 6
MAX_SPAN_CHARS = 400
CURSOR_AFTER_INDENT = 0.3    # rest-of-line middles that start right after the indentation
SUFFIX_SHARE = (0.1, 0.5)    # fraction of the context budget given to the suffix
# Upper bound on characters per token, to cut a window of text wide enough to fill a budget.
MAX_CHARS_PER_TOKEN = 8
FILE_HEADER_RATE = 0.3       # plain files preceded by "<|file_sep|>{path}\n" (repo-level format)
# Repo-level FIM samples (``Settings.repo_rate`` of the FIM samples): the prompt begins with other
# files' chunks as specd's prompt builder writes them (``<repo_name>workspace``, then
# ``<file_sep>path`` + a window of lines per chunk, then ``<file_sep>`` + the current path).
# Most such samples hold a near-twin of the text around the middle (as a project holds similar
# code: a renamed copy, a variant), the others only unrelated files, so the model learns to copy
# from context when the context has it and not otherwise.
REPO_TWIN_RATE = 0.6         # of repo samples: one chunk is a near-twin of the middle's surroundings
REPO_DISTRACTORS = (0, 2)    # unrelated chunks per repo sample (inclusive range)
REPO_CHUNK_LINES = 40        # a chunk is at most this many lines (as specd.engine.front.context's windows)
REPO_CONTEXT_SHARE = 0.4     # at most this share of the sample's tokens goes to the chunks
REPO_RENAME_DEF = 0.5        # twin mutations: the enclosing def renamed (the bench's multi_file twin) ...
REPO_RENAME_WORD = 0.3       # ... or one identifier renamed throughout the chunk (else verbatim)
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
_DEF = re.compile(r"\b(def|class) ([A-Za-z_][A-Za-z0-9_]*)")
MIN_FILE_CHARS = 64
SAMPLE_RETRIES = 8


# --- tokenizer ----------------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS):
    """A byte-level BPE `tokenizers.Tokenizer` with the special tokens at ids 0..6."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # transformers 5 loads every qwen2-typed model's tokenizer as Qwen2Tokenizer, which rebuilds
    # the pipeline from vocab and merges with an NFC normalizer; train with the same pipeline so
    # training and serving tokenize identically. Round trips are exact for NFC text (nearly all
    # code); decomposed accents come back composed.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def wrap_tokenizer(tok, max_positions: int, fim: FimFormat = FIM_FORMATS["qwen"]):
    """The transformers tokenizer saved next to each model: no BOS, EOS doubles as pad."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=fim.eos,
        pad_token=fim.eos,
        extra_special_tokens=fim.special_tokens[1:],
        clean_up_tokenization_spaces=False,  # would turn " ." into "." and break round trips
        model_max_length=max_positions,
    )


# --- samples ------------------------------------------------------------------------------

@dataclass
class Sample:
    ids: list[int]
    loss_from: int   # index of the first token whose prediction counts in middle-only evals
    fim: bool


def line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end


def after_lines(text: str, pos: int, count: int) -> int:
    """Index just past the count-th newline at or after pos (or the end of text)."""
    for _ in range(count):
        end = text.find("\n", pos)
        if end < 0:
            return len(text)
        pos = end + 1
    return pos


def choose_middle(text: str, rng: random.Random) -> tuple[int, int]:
    """Character span [start, end) of text to cut out as the FIM middle."""
    pos = rng.randrange(len(text))
    line_start = text.rfind("\n", 0, pos) + 1
    draw = rng.random()
    if draw < MIDDLE_EMPTY:
        return pos, pos
    if draw < MIDDLE_REST_OF_LINE:
        if rng.random() < CURSOR_AFTER_INDENT:
            line = text[line_start:line_end(text, line_start)]
            pos = line_start + len(line) - len(line.lstrip(" \t"))
        if rng.random() < 0.5:
            return pos, line_end(text, pos)   # the suffix starts with the newline
        return pos, after_lines(text, pos, 1 + rng.randrange(MAX_MIDDLE_LINES))
    if draw < MIDDLE_WHOLE_LINES:
        return line_start, after_lines(text, line_start, 1 + rng.randrange(MAX_MIDDLE_LINES))
    span = int(math.exp(rng.uniform(0.0, math.log(MAX_SPAN_CHARS))))
    return pos, min(len(text), pos + span)


class SampleMaker:
    """Draws training sequences from a list of source texts.

    Plain samples are windows of one token stream holding every file (some with a
    ``<|file_sep|>path`` header), each followed by ``<|endoftext|>`` (or the FIM format's
    equivalents). FIM samples cut one file at character level and tokenize prefix, middle and
    suffix separately, as the engine does at a cursor; the prefix is trimmed from the left and
    the suffix from the right so the sample fills the sequence.
    """

    def __init__(self, tok, texts: list[tuple[str, str]], settings: Any, rng: random.Random):
        import itertools

        import torch

        self.tok, self.settings, self.rng = tok, settings, rng
        self.fmt = fmt = settings.fim
        self.ids = {name: tok.token_to_id(name) for name in fmt.special_tokens}
        self.files = [(rel, text) for rel, text in texts if len(text) >= MIN_FILE_CHARS]
        self.texts = [text for _, text in self.files]
        self.cum_chars = list(itertools.accumulate(len(t) for t in self.texts))
        docs = []
        for rel, text in texts:
            header = f"{fmt.file_sep}{rel}\n" if rng.random() < FILE_HEADER_RATE else ""
            docs.append(header + text + fmt.eos)
        encoded = tok.encode_batch(docs, add_special_tokens=False)
        self.stream = torch.tensor([i for e in encoded for i in e.ids], dtype=torch.long)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids if text else []

    def _random_file(self) -> tuple[str, str]:
        import bisect

        return self.files[bisect.bisect_right(self.cum_chars, self.rng.randrange(self.cum_chars[-1]))]

    def _random_text(self) -> str:
        return self._random_file()[1]

    def plain(self, n_tokens: int) -> Sample:
        start = self.rng.randrange(max(1, len(self.stream) - n_tokens))
        return Sample(self.stream[start:start + n_tokens].tolist(), 0, fim=False)

    def fim(self, n_tokens: int, spm: bool, repo: bool = False) -> Sample:
        """One FIM sample of at most n_tokens tokens; shorter only when the file is. With
        ``repo``, other files' chunks come first (``repo_context``)."""
        middle_cap = n_tokens // 4
        for _ in range(SAMPLE_RETRIES):
            rel, text = self._random_file()
            start, end = choose_middle(text, self.rng)
            middle = self.encode(text[start:end])
            if len(middle) <= middle_cap:
                break
        else:
            middle = middle[:middle_cap]  # rare: keep the sample, lose its end-of-middle signal
        context = self.repo_context(rel, text, start, int(n_tokens * REPO_CONTEXT_SHARE)) if repo else []
        budget = n_tokens - 4 - len(middle) - len(context)  # four special tokens: prefix, suffix, middle, EOS
        suffix_budget = int(budget * self.rng.uniform(*SUFFIX_SHARE))
        suffix = self.encode(text[end:end + suffix_budget * MAX_CHARS_PER_TOKEN])[:suffix_budget]
        prefix_budget = budget - len(suffix)
        prefix = self.encode(text[max(0, start - prefix_budget * MAX_CHARS_PER_TOKEN):start])
        prefix = prefix[len(prefix) - prefix_budget:] if prefix_budget > 0 else []
        ids, fmt = self.ids, self.fmt
        if spm:
            head = [ids[fmt.suffix], *suffix, ids[fmt.prefix], *prefix, ids[fmt.middle]]
        else:
            head = [ids[fmt.prefix], *prefix, ids[fmt.suffix], *suffix, ids[fmt.middle]]
        head = context + head
        return Sample(head + middle + [ids[fmt.eos]], len(head), fim=True)

    def repo_context(self, rel: str, text: str, cursor: int, budget: int) -> list[int]:
        """Ids of repo-level context for a FIM sample cut from ``text`` (path ``rel``) at
        ``cursor``, in the engine's format (``specd.engine.front.prompt.PromptBuilder._context_ids``):
        ``<repo_name>workspace\n``, each chunk as ``<file_sep>path\n`` + its lines + ``\n``, then
        ``<file_sep>`` + the current path. Unrelated chunks first, the twin (when there is one)
        last: the engine emits the most relevant chunk nearest the current file."""
        rng, fmt = self.rng, self.fmt
        file_sep = self.ids[fmt.file_sep]
        head = [self.ids[fmt.repo_name], *self.encode("workspace\n")]
        tail = [file_sep, *self.encode(f"{rel}\n")]
        room = budget - len(head) - len(tail)
        twin: list[int] = []
        if rng.random() < REPO_TWIN_RATE:
            chunk = self._mutate(self._window(text, cursor))
            twin = [file_sep, *self.encode(f"{_variant_path(rel, rng)}\n{chunk}\n")][:room]
        others: list[int] = []
        for _ in range(rng.randint(*REPO_DISTRACTORS)):
            other_rel, other = self._random_file()
            if other is text:
                continue
            piece = [file_sep, *self.encode(f"{other_rel}\n{self._window(other, rng.randrange(len(other)))}\n")]
            others += piece[:max(0, room - len(twin) - len(others))]  # cut short, as the engine's budget cuts one
        if not twin and not others:
            return []
        ids = head + others + twin
        return ids + tail

    def _window(self, text: str, position: int) -> str:
        """Up to REPO_CHUNK_LINES whole lines around ``position``, at a random offset."""
        lines = text.splitlines(keepends=True)
        line = text.count("\n", 0, position)
        first = max(0, line - self.rng.randrange(REPO_CHUNK_LINES))
        return "".join(lines[first:first + REPO_CHUNK_LINES]).rstrip("\n")

    def _mutate(self, chunk: str) -> str:
        """A near-twin: the first def/class renamed, or one identifier renamed throughout, or as is."""
        draw = self.rng.random()
        if draw < REPO_RENAME_DEF and (found := _DEF.search(chunk)):
            return chunk.replace(f"{found[1]} {found[2]}", f"{found[1]} {found[2]}_variant", 1)
        if draw < REPO_RENAME_DEF + REPO_RENAME_WORD:
            words = [w for w in _IDENTIFIER.findall(chunk) if w not in _PY_KEYWORDS]
            if words:
                word = self.rng.choice(words)
                return re.sub(rf"\b{re.escape(word)}\b", f"{word}2", chunk)
        return chunk

    def sample(self, n_tokens: int) -> Sample:
        if self.rng.random() < self.settings.fim_rate:
            return self.fim(n_tokens, spm=self.rng.random() < self.settings.spm_rate,
                            repo=self.rng.random() < self.settings.repo_rate)
        return self.plain(n_tokens)

    def batch(self, count: int, seq_len: int):
        """(inputs [B, T], targets [B, T], mask [B, T]) for count sequences of seq_len tokens."""
        return collate([self.sample(seq_len + 1) for _ in range(count)], seq_len, self.ids[self.fmt.eos])


def _variant_path(rel: str, rng: random.Random) -> str:
    """Where a near-twin of ``rel`` lives in the pretend project."""
    stem, _, ext = Path(rel).name.rpartition(".")
    return rng.choice([f"variants/{stem}_v{rng.randrange(10)}.{ext}", f"legacy/{Path(rel).name}",
                       f"{Path(rel).parent}/{stem}_old.{ext}"])


_PY_KEYWORDS = frozenset(keyword.kwlist) | {"self", "cls"}


def collate(samples: list[Sample], seq_len: int, pad_id: int, middle_only: bool = False):
    import torch

    tokens = torch.full((len(samples), seq_len + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), seq_len), dtype=torch.bool)
    for row, sample in enumerate(samples):
        ids = sample.ids[:seq_len + 1]
        tokens[row, :len(ids)] = torch.tensor(ids)
        # target t predicts ids[t + 1]; middle-only scoring starts at the first middle token
        first = sample.loss_from - 1 if middle_only else 0
        mask[row, max(0, first):len(ids) - 1] = True
    return tokens[:, :-1], tokens[:, 1:], mask
