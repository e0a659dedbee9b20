"""Every FIM family with its real vocabulary (tests/real_vocab.py): the tokenizer reproduces
llama.cpp's own test strings, the family is detected, the prompt is the one its model card
documents, token healing re-types the cursor's token, and completions from tiny random pairs of
the family's real architecture are the target's greedy output, returned as the text after the
cursor, never empty while their tokens are not, never starting with whitespace the cursor has."""

from __future__ import annotations

import pytest

from engine_helpers import assert_lossless, make_engine
from real_vocab import FAMILIES, llama_cpp_cases
from specd.engine import CompletionRequest

# Stop reasons that cut the text inside the tokens (the text is then a prefix of their decoding).
CUT_REASONS = ("block_end", "single_line", "line_ending", "repeated_line", "suffix_line", "current_line")

# Third-party-looking code; "<|>" marks where each cursor kind goes.
DOCUMENT = '''"""Render tables to a terminal."""

import threading
from dataclasses import dataclass


@dataclass
class Column:
    header: str = ""
    width: int | None = None


class Console:
    def __init__(self, width: int = 80, color_system: str = "auto") -> None:
        self.width = width
        self.color_system = color_system
        self._lock = threading.RLock()

    def size(self) -> tuple[int, int]:
{line}
        return self.width, 25

    def render(self, columns: list[Column]) -> str:
        return " | ".join(column.header for column in columns)
'''
CURSOR_KINDS = {
    "fresh_line": "        <|>",  # after Enter: the editor indented the new line by 8 spaces
    "attribute": "        if self.con<|>",
    "call": "        print(<|>)",
    "assignment": "        x = cons<|>",
}
PAIRS = [(family, arch) for family in FAMILIES for arch in FAMILIES[family].archs]
MAX_TOKENS = 10


def document(kind: str, newline: str = "\n") -> tuple[str, int]:
    line = CURSOR_KINDS[kind]
    text = DOCUMENT.format(line=line)
    offset = text.index("<|>")
    text = text.replace("<|>", "")
    if newline != "\n":
        offset += text.count("\n", 0, offset) * (len(newline) - 1)
        text = text.replace("\n", newline)
    return text, offset


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) if text else []


def encode_infilling(tok, text: str) -> list[int]:
    """Meta's ``Tokenizer.encode_infilling`` (codellama/llama/tokenizer.py) and mistral_common's
    ``_encode_infilling``: a text without SentencePiece's implicit leading space."""
    ids = tok.encode("☺" + text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[:2]) == ["▁", "☺"]
    return ids[2:]


def card_prompt(family: str, tok, prefix: str, suffix: str, middle: str, heal: bool) -> list[int]:
    """The FIM prompt as each model card (or the reference code it points to) writes it: prefix,
    suffix, and the middle the user typed after the middle token, whose last token is cut when
    healing (the prefix's, when nothing was typed after it)."""
    special = tok.convert_tokens_to_ids

    def cut(ids):
        return ids[:-1] if heal else ids

    if family == "codellama":  # Meta's infilling_prompt_tokens (PSM): BOS, <PRE>, encode(prefix), <SUF>, ...
        pre, mid = encode(tok, prefix), encode_infilling(tok, middle) if middle else []
        return [tok.bos_token_id, special("▁<PRE>"), *(pre if mid else cut(pre)), special("▁<SUF>"),
                *encode_infilling(tok, suffix), special("▁<MID>"), *cut(mid)]
    if family == "codestral-like":  # mistral_common's encode_fim: BOS, [SUFFIX], suffix, [PREFIX], prefix
        return [tok.bos_token_id, special("[SUFFIX]"), *encode_infilling(tok, suffix), special("[PREFIX]"),
                *cut(encode(tok, prefix + middle))]
    names = {"deepseek-coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # BOS first
             "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
             "qwen2.5-coder": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")}[family]
    bos = [tok.bos_token_id] if family == "deepseek-coder" else []
    pre, mid = encode(tok, prefix), encode(tok, middle)
    return [*bos, special(names[0]), *(pre if mid else cut(pre)), special(names[1]), *encode(tok, suffix),
            special(names[2]), *cut(mid)]


def decode_in_context(tok, ids: list[int]) -> str:
    """Tokens' text as it reads after other text (a leading ``▁`` is a space)."""
    x = tok.encode("x", add_special_tokens=False)[-1:]
    return tok.decode(x + ids, skip_special_tokens=False)[len(tok.decode(x)):]


_ENGINES: dict = {}


@pytest.fixture
def engine_for(real_vocab):
    def get(family: str, arch: str):
        if (family, arch) not in _ENGINES:
            target, draft = real_vocab.pair(family, arch)
            _ENGINES[family, arch] = make_engine(target, draft, max_tokens=MAX_TOKENS)
        return _ENGINES[family, arch]
    return get


def check_completion(engine, family: str, kind: str, heal: bool, newline: str = "\n") -> dict:
    """One completion at a cursor kind, and what the tests require of it."""
    tok = engine.pair.tokenizer
    text, offset = document(kind, newline)
    result = engine.complete(CompletionRequest(text=text, offset=offset, token_healing=heal))
    prompt = engine.build_prompt(None, text, offset, heal=heal)
    anchor = prompt.anchor if engine.prompts.anchored else offset
    expected = card_prompt(family, tok, text[prompt.prefix_start:anchor], text[offset:prompt.suffix_end],
                           text[anchor:offset], heal)
    after = decode_in_context(tok, result.token_ids)
    typed_back = after.startswith(result.healed)
    returned = after[len(result.healed):] if typed_back else None
    before_cursor = text[prompt.prefix_start:offset]
    return {
        "result": result, "text": text, "offset": offset,
        "detected": engine.template.name == FAMILIES[family].fim_family,
        "prompt_ok": result.prompt_ids == expected == prompt.ids,
        "expected": expected,
        "healed_ok": before_cursor.endswith(result.healed) and (bool(result.healed) == heal),
        "text_ok": returned is not None and (returned == result.text or (
            result.stop_reason in CUT_REASONS and returned.startswith(result.text))),
        "empty": not result.text and bool(result.token_ids) and result.stop_reason not in CUT_REASONS,
        "doubled": bool(result.text) and result.text[0] in " \t" and text[offset - 1:offset] in (" ", "\t"),
        "foreign_break": ("\r" in result.text) if newline == "\n" else ("\n" in result.text.replace("\r\n", "")),
    }


@pytest.mark.parametrize("family", sorted({f.base: name for name, f in FAMILIES.items()}.values()))
def test_tokenizer_reproduces_llama_cpp_test_strings(real_vocab, family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_vocab.tokenizer_dir(family))
    cases = llama_cpp_cases(real_vocab.folder, FAMILIES[family].base)
    assert len(cases) > 30
    wrong = [(text, ids) for text, ids in cases if encode(tok, text) != ids]
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fim_specials_sit_at_their_real_ids(real_vocab, family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_vocab.tokenizer_dir(family))
    for token_id, token in FAMILIES[family].added.items():
        assert tok.convert_tokens_to_ids(token) == token_id
        assert encode(tok, token) == [token_id]  # a special token, never split


@pytest.mark.parametrize("heal", [True, False], ids=["healed", "plain"])
@pytest.mark.parametrize("kind", list(CURSOR_KINDS))
@pytest.mark.parametrize("family, arch", PAIRS)
def test_completion_at_cursor_kinds(engine_for, family, arch, kind, heal):
    engine = engine_for(family, arch)
    got = check_completion(engine, family, kind, heal)
    tok = engine.pair.tokenizer
    assert got["detected"], engine.template.name
    assert got["prompt_ok"], (tok.convert_ids_to_tokens(got["result"].prompt_ids[:8]),
                              tok.convert_ids_to_tokens(got["expected"][:8]))
    assert got["healed_ok"], got["result"].healed
    assert got["text_ok"], (got["result"].text, decode_in_context(tok, got["result"].token_ids))
    assert not got["empty"], got["result"].token_ids
    if heal:
        assert not got["doubled"], got["result"].text
    assert not got["foreign_break"], got["result"].text
    assert_lossless(engine, got["result"], MAX_TOKENS)


@pytest.mark.parametrize("family, arch", [("qwen2.5-coder", "qwen2"), ("codellama", "llama")])
@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_completions_keep_the_documents_line_breaks(engine_for, family, arch, newline):
    """No "\\r" enters an LF document, no lone "\\n" a CRLF one: the healing constraint never lets
    a token go on past the cut text with one, and the stop rules end a completion before one."""
    engine = engine_for(family, arch)
    for kind in ("fresh_line", "call"):
        got = check_completion(engine, family, kind, True, newline)
        assert not got["foreign_break"], got["result"].text
        allowed = engine.healing_constraint(got["result"].healed, len(got["result"].prompt_ids), newline)
        assert_lossless_with(engine, got["result"], allowed)


def assert_lossless_with(engine, result, allowed) -> None:
    from engine_helpers import reference_tokens

    reference = reference_tokens(engine.pair.target, result.prompt_ids, MAX_TOKENS, allowed)
    assert result.token_ids == reference[:len(result.token_ids)]


def test_healing_never_continues_whitespace_with_a_foreign_line_break(real_vocab):
    from transformers import AutoTokenizer

    from specd.engine.speculation.healing import HealingVocabulary

    tok = AutoTokenizer.from_pretrained(real_vocab.tokenizer_dir("qwen2.5-coder"))
    vocabulary = HealingVocabulary(tok, len(tok))
    rest = " " * 8
    crlf = [i for i, text in enumerate(vocabulary.texts) if text.startswith(rest + "\r\n")]
    lf = [i for i, text in enumerate(vocabulary.texts) if text.startswith(rest + "\n")]
    assert crlf and lf  # the vocabulary has both, so the check bites
    assert not set(vocabulary.allowed(rest, "\n").tolist()) & set(crlf)
    assert set(lf) <= set(vocabulary.allowed(rest, "\n").tolist())
    assert not set(vocabulary.allowed(rest, "\r\n").tolist()) & set(lf)
    assert set(crlf) <= set(vocabulary.allowed(rest, "\r\n").tolist())


def test_stop_rules_keep_a_sentencepiece_completions_leading_space(real_vocab):
    from transformers import AutoTokenizer

    from specd.engine.front.stops import StopRules

    tok = AutoTokenizer.from_pretrained(real_vocab.tokenizer_dir("codellama"))
    ids = tok.convert_tokens_to_ids(["▁▁▁▁▁▁▁▁▁▁▁", "▁self", "."])
    healed = " " * 12
    stop = StopRules(tok, set(), False, None, healed=healed)
    for token in ids:
        stop(token)
    assert stop.text() == "self."  # 11 + 1 spaces re-typed the cut indentation, then "self."
    plain = StopRules(tok, set(), False, None)
    plain(tok.convert_tokens_to_ids("▁cons"))
    assert plain.text() == " cons"


@pytest.mark.parametrize("base", ["qwen2", "llama-spm", "deepseek-coder"])
def test_healing_allows_exactly_the_tokens_that_retype_the_cut(real_vocab, base):
    """``allowed`` looks cuts up in the sorted token texts; on real vocabularies it gives what the
    constraint says, token by token over the whole vocabulary: a token whose text starts with the
    cut (not going on with more of a cut indentation, nor with a foreign line break) or is a
    non-empty prefix of it, in increasing order."""
    import random

    from specd.engine.speculation.healing import HealingVocabulary, foreign_break, token_texts
    from specd.llamacpp.model import open_gguf

    _, tok = open_gguf(str(real_vocab.folder / f"ggml-vocab-{base}.gguf"))
    texts = token_texts(tok, tok.n_tokens)
    vocabulary = HealingVocabulary(tok, len(texts), texts)

    def expected(rest: str, newline: str) -> list[int]:
        exact_indent = not rest.strip() and rest[-1] in " \t"
        return [i for i, text in enumerate(texts) if text and (rest.startswith(text) or (
            text.startswith(rest) and not (exact_indent and text[len(rest):len(rest) + 1] in (" ", "\t"))
            and foreign_break(text, newline, len(rest)) < 0))]

    rng = random.Random(0)
    cuts = [" ", "    ", "\t", "\n  ", "\r\n    ", " self", " retu", "(", "é", "漢", "\U0010ffff"]
    cuts += [text[:rng.randint(1, len(text))] for text in rng.sample([t for t in texts if t], 40)]
    for rest in cuts:
        for newline in ("\n", "\r\n"):
            assert vocabulary.allowed(rest, newline).tolist() == expected(rest, newline), (rest, newline)


def _metaspace_first_copy(source, out):
    """``source``'s tokenizer as newer Llama tokenizer.json files write it: Metaspace with
    ``prepend_scheme="first"``, which gives a text that starts with a space no implicit space."""
    import shutil

    from tokenizers import Tokenizer, decoders, pre_tokenizers

    shutil.copytree(source, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.save(str(out / "tokenizer.json"))
    return out


def test_a_prefix_window_starting_at_an_indented_line_keeps_its_indentation(real_vocab, tmp_path):
    """Meta's infilling_prompt_tokens encodes the prefix as SentencePiece does: its implicit
    space, then the text, so a window that starts at an indented line keeps every space of it.
    A Metaspace tokenizer with prepend_scheme "first" drops that space before a leading space;
    the prompt's ids must still be SentencePiece's (the Prepend normalizer's here)."""
    from transformers import AutoTokenizer

    from specd.engine.front.prompt import TEMPLATES, PromptBuilder, drops_leading_space

    faithful = AutoTokenizer.from_pretrained(real_vocab.tokenizer_dir("codellama"))
    first = AutoTokenizer.from_pretrained(_metaspace_first_copy(real_vocab.tokenizer_dir("codellama"), tmp_path / "first"))
    assert not drops_leading_space(faithful) and drops_leading_space(first)
    lines = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]  # lines 32 and 64 (window starts) are indented
    text = "import os\n" + "".join(lines) + "def g():\n    "
    prompts = [PromptBuilder(tok, TEMPLATES["codellama"], prefix_tokens=280, suffix_tokens=0, layout="psm")
               .build(text, len(text), heal=False) for tok in (faithful, first)]
    assert prompts[0].prefix_start == prompts[1].prefix_start > 0
    assert text[prompts[0].prefix_start:].startswith("    return x")
    assert prompts[1].ids == prompts[0].ids
    # SentencePiece's implicit space and the line's four: five in all before "return".
    assert "".join(faithful.convert_ids_to_tokens(prompts[0].ids[2:4])) == "▁▁▁▁▁return"
