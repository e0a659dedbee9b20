"""What configures an engine: its options (the ``model`` and ``engine`` config sections), the
model's context window from the files beside its weights, and the prompt budget fitted to it.
No torch here: the CLI, the remote engine and the forward choice read these cheaply."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class EngineOptions:
    target: str = ""
    draft: str = ""
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    fim_family: str = "auto"
    fim_layout: str = "auto"  # auto | psm | spm | anchored (see specd.engine.front.prompt)
    max_tokens: int = 128
    prefix_tokens: int = 1536
    suffix_tokens: int = 512
    use_draft_model: bool = True
    use_lookup: bool = True
    kv_reuse: bool = True
    fast_forward: bool = True  # the lean static-cache forward where the architecture allows
    transposed_weights: str = "auto"  # auto | on | off (forward.lean.LeanForward)
    numpy_products: str = "auto"  # auto | on | off (forward.lean.LeanForward.host_products)
    cuda_graphs: str = "auto"  # auto | on | off (forward.lean.LeanForward.use_graphs)
    forward_backend: str = "auto"  # auto | torch | llamacpp (specd.engine.forward.auto, .llamacpp)
    llamacpp_prefill: str = "auto"  # auto | torch | llamacpp: where llama.cpp's prompts from empty prefill (handoff.py)
    token_healing: bool = True  # the prompt ends a token before the cursor; output re-types it
    draft_max: int = 8
    lookup_max: int = 16
    token_tree: bool = True  # several drafts in one verify forward where the planner expects it to pay
    draft_confidence: float | str = "auto"  # a probability, or auto: measured at load (speculation.agreement)
    cache_budget_mb: int = 2048
    time_budget_ms: int = 5000
    first_suggestion_ms: int = 1000  # prefill a cold completion may spend; beyond it a narrower window answers
    threads: int = 0
    context_tokens: int = 512  # prompt budget for other files' chunks (repo-level context)
    auto_context: bool = True  # choose those chunks from open buffers and the workspace
    # Suggestion boundaries (specd.engine.front.boundaries), each request's default.
    stop_at_block_end: bool = True
    stop_at_repeated_line: bool = True
    stop_at_suffix_line: bool = True
    multiline: str = "blocks"  # blocks (several lines only where a block is expected) | always

    @classmethod
    def from_config(cls, cfg) -> "EngineOptions":
        values = {**cfg.section("model"), **cfg.section("engine")}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


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


