"""Plain data the engine takes and returns. No torch here: the daemon and CLI import these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Generator, TypeVar

T = TypeVar("T")


class EngineError(Exception):
    """A request the engine cannot serve; the message is meant for the user."""

    code = "engine_error"


class Cancelled(EngineError):
    code = "cancelled"


class ModelLoadError(EngineError):
    code = "model_load_error"


class UnsupportedModel(ModelLoadError):
    """A model specd cannot serve as configured (a GGUF file's tensor type or architecture, a
    pair of mixed formats): the configuration's to change, so the CLI exits 2 on it."""

    code = "unsupported_model"


@dataclass
class ContextChunk:
    """Extra context for the prompt: another file's text (repo-level FIM formats)."""

    path: str
    text: str


@dataclass
class CompletionRequest:
    """One fill-in-the-middle completion.

    ``offset`` is a character (code point) offset into the document text. The text comes from
    ``text`` when given, else from the open document ``uri``.
    """

    uri: str | None = None
    text: str | None = None
    offset: int | None = None
    max_tokens: int | None = None  # None: engine default
    single_line: bool = False
    # Suggestion boundaries (front/boundaries.py); None: the engine's default (engine.stop_at_* / multiline).
    stop_at_block_end: bool | None = None
    stop_at_repeated_line: bool | None = None
    stop_at_suffix_line: bool | None = None
    multiline: str | None = None  # blocks | always
    # A line break of the other style than the document's ends the completion ("line_ending").
    # Off only where output is compared token for token with a decoder that has no such stop.
    stop_at_line_ending: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    time_budget_ms: int | None = None
    use_draft_model: bool | None = None  # None: engine default
    use_lookup: bool | None = None
    kv_reuse: bool | None = None
    token_healing: bool | None = None  # None: engine default (engine.token_healing)
    extra_context: list[ContextChunk] = field(default_factory=list)
    path: str | None = None  # file path shown in repo-level prompts


@dataclass
class SourceStats:
    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class CompletionResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    # eos | max_tokens | single_line | line_ending | time_budget | cancelled, or the boundary that
    # cut the text: block_end | repeated_line | suffix_line | current_line
    stop_reason: str
    healed: str = ""  # text before the cursor that token_ids re-type first (token healing); not in text
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_computed: int = 0  # target prompt tokens run through the model for this request
    prefill_reused: int = 0  # target prompt tokens served from the document's KV cache
    sources: dict[str, SourceStats] = field(default_factory=dict)
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0
    total_ms: float = 0.0  # wall time, suspended time included
    suspended_ms: float = 0.0  # time it waited while other requests' steps ran (complete_steps)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sources"] = {name: {**asdict(s), "rate": s.rate} for name, s in self.sources.items()}
        out["tokens_per_forward"] = self.tokens_per_forward
        return out


@dataclass(frozen=True)
class Progress:
    """A completion in flight, after one of its steps: the tokens it has generated so far and,
    on demand (it decodes them all), its text so far, cut where the stop rules cut."""

    tokens: int
    read_text: Callable[[], str]

    def text(self) -> str:
        return self.read_text()


def run_to_end(steps: Generator[Progress, None, T]) -> T:
    """Drive a ``complete_steps`` generator to its end in one go; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
