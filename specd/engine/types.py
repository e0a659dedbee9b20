"""Plain data the engine takes and returns. No torch here: the daemon and CLI import these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, make_dataclass
from typing import Any, Callable, Generator, TypeVar

from specd.options_table import REQUEST_OPTIONS, Option, annotation

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


def _request_field(option: Option) -> tuple[str, str, Any]:
    """A request's option: where the engine has the option too, None (the engine's); else the
    option's own default."""
    default = None if option.engine else option.default
    return option.name, annotation(option, unset=option.engine), field(default=default)


# One fill-in-the-middle completion. ``offset`` is a character (code point) offset into the
# document text; the text comes from ``text`` when given, else from the open document ``uri``.
# Its settings are the options table's request options (``specd.options_table``), each None
# where the engine's option applies (``specd.engine.options.resolve``).
CompletionRequest = make_dataclass(
    "CompletionRequest",
    [("uri", "str | None", field(default=None)),
     ("text", "str | None", field(default=None)),
     ("offset", "int | None", field(default=None)),
     *(_request_field(option) for option in REQUEST_OPTIONS),
     ("extra_context", "list[ContextChunk]", field(default_factory=list)),
     ("path", "str | None", field(default=None))],  # file path shown in repo-level prompts
    namespace={"__module__": __name__,
               "__doc__": "One fill-in-the-middle completion: a document, a cursor, the request's settings."},
)


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
    # Tokens of the narrow window a cold document's request answered from while its full prompt
    # prefilled (``engine.first_suggestion_ms``, ``cold_start``); None: the full prompt.
    window_tokens: int | None = None

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
