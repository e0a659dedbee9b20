"""What configures an engine: its options (the ``model`` and ``engine`` config sections), the
model's context window from the files beside its weights, and the prompt budget fitted to it.
No torch here: the CLI, the remote engine and the forward choice read these cheaply."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from specd.options_table import ENGINE_OPTIONS, REQUEST_OPTIONS, annotation
from specd.suggestion_rules import BoundaryRules

log = logging.getLogger(__name__)


def _from_config(cls, cfg) -> "EngineOptions":
    values = {**cfg.section("model"), **cfg.section("engine")}
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


# The ``model`` and ``engine`` config sections' options that the engine reads, each as the one
# table (``specd.options_table``) defines it: ``EngineOptions(max_tokens=64)``, ``options.max_tokens``.
EngineOptions = make_dataclass(
    "EngineOptions",
    [(option.name, annotation(option), field(default=option.default)) for option in ENGINE_OPTIONS],
    namespace={"__module__": __name__, "from_config": classmethod(_from_config),
               "__doc__": "What configures an engine: the ``model`` and ``engine`` sections of the options table."},
)


# The options that decide which forward paths an engine builds (``Engine.share_paths``).
FORWARD_OPTIONS = ("target", "draft", "device", "dtype", "trust_remote_code", "fast_forward",
                   "transposed_weights", "numpy_products", "cuda_graphs", "forward_backend", "llamacpp_prefill")



def context_window(source: str, config=None) -> int | None:
    """Tokens the model can attend to: a ``trained_context`` in ``specd.json`` beside its files
    (what the model saw in training), else ``config``'s max_position_embeddings (the loaded
    model's config; without one, ``config.json``'s); None when neither says."""
    folder = Path(source).expanduser()
    try:
        trained = json.loads((folder / "specd.json").read_text(encoding="utf-8")).get("trained_context")
    except (OSError, ValueError, AttributeError):
        trained = None
    if isinstance(trained, int) and trained > 0:
        return trained
    if config is not None:
        window = getattr(config, "max_position_embeddings", None)
    else:
        try:
            window = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            window = None
    return window if isinstance(window, int) and window > 0 else None


def fit_prompt_budget(prefix: int, suffix: int, context: int, window: int | None,
                      max_tokens: int) -> tuple[int, int, int]:
    """Shrink the prompt budgets in proportion so prompt + completion fit the model's window."""
    if window is None:
        return prefix, suffix, context
    room = window - max_tokens - 8  # the FIM and file-separator tokens
    total = prefix + suffix + context
    if total <= room:
        return prefix, suffix, context
    scale = max(room, 64) / total
    fitted = (max(32, int(prefix * scale)), int(suffix * scale), int(context * scale))
    log.info("prompt budget %d+%d+%d tokens exceeds the model's %d-token window; using %d+%d+%d",
             prefix, suffix, context, window, *fitted)
    return fitted


# -- a request against the options ----------------------------------------------------------------

# What a request may set over the engine's option (None on the request: the engine's).
ASKED_OPTIONS = tuple(option.name for option in REQUEST_OPTIONS if option.engine)


@dataclass(frozen=True)
class RequestSettings:
    """A request's settings resolved against the engine's options (``resolve_request``)."""

    max_tokens: int  # at least 1
    time_budget_ms: int
    use_draft_model: bool
    use_lookup: bool
    kv_reuse: bool  # and the request names a document: no document, nothing to reuse
    token_healing: bool
    rules: BoundaryRules  # the suggestion boundaries (stop_at_* and multiline)

    @property
    def budget_s(self) -> float:
        return self.time_budget_ms / 1000.0


def resolve_request(request: Any, options: Any) -> RequestSettings:
    """The one place a request meets the engine's options, for the local and the remote engine
    alike: each setting the request leaves None is the engine's option."""
    value = {name: getattr(options, name) if getattr(request, name) is None else getattr(request, name)
             for name in ASKED_OPTIONS}
    rules = BoundaryRules(repeated_line=value["stop_at_repeated_line"], suffix_line=value["stop_at_suffix_line"],
                          block_end=value["stop_at_block_end"], multiline=value["multiline"])
    return RequestSettings(max_tokens=max(1, value["max_tokens"]), time_budget_ms=value["time_budget_ms"],
                           use_draft_model=value["use_draft_model"], use_lookup=value["use_lookup"],
                           kv_reuse=value["kv_reuse"] and bool(request.uri), token_healing=value["token_healing"],
                           rules=rules)
