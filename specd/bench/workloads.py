"""Benchmark workloads cut from real source files.

A workload is a list of ``Completion``s: a document text, a cursor offset and the key of the
document it belongs to. Methods that keep per-document KV caches key them by ``doc``, so
completions sharing a ``doc`` are successive requests on one editor buffer.

- ``line``: the cursor at the start of a line (after its indentation) inside a function body,
  with the rest of the function deleted, as when writing a body top to bottom. Positions of one
  file share a document key and run in file order, like a user moving down a file.
- ``edit_replay``: a few lines of a function are deleted and typed back word by word; a
  completion is requested after every word, with one document key per replayed region, the
  way an editor asks at each (debounced) keystroke. The rest of the file stays in the buffer,
  so lookup finds similar code there and consecutive prompts share all but their tail.
- ``cold``: the cursor at a random column inside a function body, the rest of that line
  deleted, each completion a fresh document: no cache to reuse.
- ``multi_file``: a function's body is deleted and written from its first line, while a
  near-twin of that function (same body, another name) sits in another file of the workspace,
  one that is not open in the editor. The workload's workspace (``Completion.workspace``) holds
  every completion's twin; methods that use the workspace index draft from it.

How many completions (``--limit N``): N for ``line``, ``cold`` and ``multi_file``; for
``edit_replay``, max(2N, ``EDIT_REPLAY_MIN_REQUESTS`` = 24) requests (``edit_replay_requests``).
A replayed region (one function) gives at most ``REPLAY_STEPS`` = 6 successive requests, so that
is at least 4 regions: with N requests the default N = 12 would give 2 regions, and one
function's quirks could decide the workload.

Everything is drawn from ``random.Random`` seeded by (seed, workload name): the same flags
give the same completions.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

WORKLOADS = ("line", "edit_replay", "cold", "multi_file")
SOURCE_SUFFIXES = (".py",)
MIN_FILE_CHARS = 500  # smaller files give too little context to complete in
MAX_FILE_CHARS = 400_000  # generated tables and the like; not what people type
REPLAY_LINES = 3  # lines typed back per edit-replay region
REPLAY_STEPS = 6  # completions per edit-replay region (one per word typed)
EDIT_REPLAY_MIN_REQUESTS = 24  # with REPLAY_STEPS, at least 4 regions (functions)
WORD = re.compile(r"\w+|[^\w\s]+")  # what one burst of typing between two requests adds
TWIN_MIN_BODY_LINES = 3  # shorter functions have too little to draft from a twin


@dataclass(frozen=True)
class SourceFile:
    name: str
    text: str


@dataclass(frozen=True)
class Completion:
    workload: str
    doc: str  # document key: same key = same editor buffer (KV reuse may pay)
    text: str  # the whole document at request time
    offset: int  # cursor, in characters
    workspace: tuple[tuple[str, str], ...] = ()  # (path, text) of workspace files not open in the editor
    expected: str = ""  # what the deleted text held after the cursor: the reference for quality metrics

    @property
    def label(self) -> str:
        line = self.text.count("\n", 0, self.offset) + 1
        return f"{self.doc}:{line}"


def load_corpus(directory: str | Path | None = None) -> list[SourceFile]:
    """Source files to cut workloads from: ``directory`` (recursively) or the held-out stdlib
    modules the demo pair never trained on."""
    if directory is None:
        from specd.demo.heldout import heldout_files

        paths, root = heldout_files(), None
    else:
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise ValueError(f"corpus {directory} is not a directory")
        paths = sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())
    files = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if MIN_FILE_CHARS <= len(text) <= MAX_FILE_CHARS:
            files.append(SourceFile(str(path.relative_to(root)) if root else path.name, text))
    return files


@dataclass(frozen=True)
class _BodyLine:
    file: SourceFile
    line_start: int  # offset of the line's first character
    cursor: int  # offset just after the line's indentation
    line_end: int  # offset of the line's newline (or end of text)
    body_end: int  # offset just past the enclosing function's last line


def _line_offsets(text: str) -> list[int]:
    offsets = [0]
    for match in re.finditer("\n", text):
        offsets.append(match.end())
    return offsets


def function_body_lines(file: SourceFile) -> list[_BodyLine]:
    """Non-blank, non-comment lines inside function bodies (innermost function wins)."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):
        return []
    starts = _line_offsets(file.text)
    owner: dict[int, int] = {}  # line number -> end line of its innermost enclosing function
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            for lineno in range(node.body[0].lineno, node.end_lineno + 1):
                previous = owner.get(lineno)
                if previous is None or node.end_lineno < previous:
                    owner[lineno] = node.end_lineno
    lines = []
    for lineno in sorted(owner):
        start = starts[lineno - 1]
        end = file.text.find("\n", start)
        end = len(file.text) if end < 0 else end
        content = file.text[start:end]
        stripped = content.lstrip(" \t")
        if not stripped or stripped.startswith("#"):
            continue
        end_line = owner[lineno]
        body_end = starts[end_line] if end_line < len(starts) else len(file.text)
        lines.append(_BodyLine(file, start, start + len(content) - len(stripped), end, body_end))
    return lines


def _open_line(text: str, cursor: int, resume: int) -> str:
    """The document with ``text[cursor:resume]`` deleted and the cursor's line still ending in a
    newline (``resume`` is a line start), as in an editor after pressing Enter."""
    return text[:cursor] + "\n" + text[resume:]


def _rng(seed: int, workload: str) -> random.Random:
    return random.Random(f"{seed}:{workload}")


def _all_body_lines(files: Iterable[SourceFile]) -> list[_BodyLine]:
    return [line for file in files for line in function_body_lines(file)]


def line_workload(files: list[SourceFile], limit: int, seed: int) -> list[Completion]:
    candidates = _all_body_lines(files)
    picked = _rng(seed, "line").sample(candidates, min(limit, len(candidates)))
    order = {f.name: i for i, f in enumerate(files)}
    picked.sort(key=lambda c: (order[c.file.name], c.cursor))
    return [Completion("line", f"line/{c.file.name}", _open_line(c.file.text, c.cursor, c.body_end), c.cursor,
                       expected=c.file.text[c.cursor:c.body_end]) for c in picked]


def cold_workload(files: list[SourceFile], limit: int, seed: int) -> list[Completion]:
    rng = _rng(seed, "cold")
    candidates = _all_body_lines(files)
    picked = rng.sample(candidates, min(limit, len(candidates)))
    out = []
    for i, c in enumerate(picked):
        cursor = rng.randint(c.cursor, c.line_end)  # anywhere from after the indent to the line end
        out.append(Completion("cold", f"cold/{i}/{c.file.name}", c.file.text[:cursor] + c.file.text[c.line_end:],
                              cursor, expected=c.file.text[cursor:c.line_end]))
    return out


def typing_stops(typed: str) -> list[int]:
    """Offsets into ``typed`` where an editor would ask: after each line's indentation (Enter
    with auto-indent) and after each word or run of punctuation."""
    stops = []
    pos = 0
    for line in typed.splitlines(keepends=True):
        body = line.rstrip("\n")
        indent = len(body) - len(body.lstrip(" \t"))
        stops.append(pos + indent)
        stops.extend(pos + m.end() for m in WORD.finditer(body))
        pos += len(line)
    return sorted(set(stops))


def edit_replay_requests(limit: int) -> int:
    """Requests of the edit_replay workload for ``--limit limit``: 2 x limit, at least
    ``EDIT_REPLAY_MIN_REQUESTS``."""
    return max(2 * limit, EDIT_REPLAY_MIN_REQUESTS)


def edit_replay_workload(files: list[SourceFile], limit: int, seed: int) -> list[Completion]:
    """``limit`` requests (exactly this many, corpus permitting), ``REPLAY_STEPS`` per region at
    most; ``build_workloads`` passes ``edit_replay_requests(--limit)``."""
    rng = _rng(seed, "edit_replay")
    candidates = _all_body_lines(files)
    # A region starts on a body line and spans up to REPLAY_LINES lines of the same function.
    regions = rng.sample(candidates, len(candidates))
    out: list[Completion] = []
    used: set[tuple[str, int]] = set()
    for c in regions:
        if len(out) >= limit:
            break
        if (c.file.name, c.body_end) in used:  # one region per function: keep documents distinct
            continue
        used.add((c.file.name, c.body_end))
        text = c.file.text
        end = c.line_start
        for _ in range(REPLAY_LINES):
            newline = text.find("\n", end, c.body_end)
            if newline < 0:
                end = c.body_end
                break
            end = newline + 1
        typed = text[c.line_start:end]
        stops = [s for s in typing_stops(typed) if s > 0][:REPLAY_STEPS]
        doc = f"edit_replay/{c.file.name}@{text.count(chr(10), 0, c.line_start) + 1}"
        for stop in stops[: limit - len(out)]:
            cursor = c.line_start + stop
            out.append(Completion("edit_replay", doc, _open_line(text, cursor, end), cursor, expected=text[cursor:end]))
    return out


def _functions(file: SourceFile) -> list[tuple[str, int, int, int]]:
    """(name, first line, first body line, last line) of each function with a body of at least
    ``TWIN_MIN_BODY_LINES`` lines, 1-based."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):
        return []
    return [(node.name, node.lineno, node.body[0].lineno, node.end_lineno) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list
            and node.end_lineno - node.body[0].lineno + 1 >= TWIN_MIN_BODY_LINES]


def _twin(name: str, source: str) -> str:
    """A near-twin of a function's source: another name, the same body (a method stays inside a
    class, so its body keeps its indentation)."""
    twin = source.replace(f"def {name}(", f"def {name}_variant(", 1)
    return twin if not source[:1].isspace() else "class Variant:\n" + twin


def multi_file_workload(files: list[SourceFile], limit: int, seed: int) -> list[Completion]:
    rng = _rng(seed, "multi_file")
    candidates = [(file, *function) for file in files for function in _functions(file)]
    picked = rng.sample(candidates, min(limit, len(candidates)))
    twins: list[tuple[str, str]] = []
    items: list[tuple[SourceFile, str, int, int]] = []
    for number, (file, name, first, body_first, last) in enumerate(picked):
        starts = _line_offsets(file.text)
        end = starts[last] if last < len(starts) else len(file.text)
        twins.append((f"variants/v{number}_{Path(file.name).stem}.py",
                      f'"""Variants kept beside {file.name}."""\n\n\n' + _twin(name, file.text[starts[first - 1]:end])))
        body_start = starts[body_first - 1]
        line_end = file.text.find("\n", body_start)
        line = file.text[body_start:line_end if line_end >= 0 else len(file.text)]
        items.append((file, f"multi_file/{file.name}:{first}", body_start + len(line) - len(line.lstrip(" \t")), end))
    workspace = tuple(twins)
    return [Completion("multi_file", doc, _open_line(file.text, cursor, end), cursor, workspace,
                       expected=file.text[cursor:end]) for file, doc, cursor, end in items]


BUILDERS: dict[str, Callable[[list[SourceFile], int, int], list[Completion]]] = {
    "line": line_workload,
    "edit_replay": edit_replay_workload,
    "cold": cold_workload,
    "multi_file": multi_file_workload,
}


def workload_size(name: str, limit: int) -> int:
    """Completions asked of workload ``name`` for ``--limit limit`` (see the module docstring)."""
    return edit_replay_requests(limit) if name == "edit_replay" else limit


def build_workloads(names: Iterable[str], files: list[SourceFile], limit: int,
                    seed: int) -> dict[str, list[Completion]]:
    out = {}
    for name in names:
        if name not in BUILDERS:
            raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
        out[name] = BUILDERS[name](files, workload_size(name, limit), seed)
    return out
