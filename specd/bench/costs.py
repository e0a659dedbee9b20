"""Forward costs: what one forward of each model costs here, per forward path, width and context.

The engine runs each model through one of three forward paths (``HFForward``, which every
architecture can take, ``lean.LeanForward`` for the lean families, or
``specd.engine.forward.llamacpp.LlamaCppForward`` with ``engine.forward_backend = llamacpp``). This
measures each one that serves the model (llama.cpp's where llama-cpp-python is installed; and
``lean_eager``, the lean forward without CUDA graphs, where the engine's lean path replays them),
so a report says what each path buys on this machine and what a forward of each width costs.
A GGUF model has llama.cpp's path only (no torch weights): that one is measured, the others
are reported unavailable.

- target: median ms of a forward of 1, 2, 4, 8 and 16 new tokens (a decode step up to a long
  verify) after 512 and 2048 tokens of context, and of a 1024-token prefill from empty
  (reported per 1k tokens);
- draft: median ms of one step (a 1-token forward) after 512 tokens, and of the same prefill.

Contexts stay ``WINDOW_MARGIN`` tokens inside the window the engine fits its prompts to (the
target's ``context_window``, never beyond any model's ``max_position_embeddings``; on a GGUF
model never beyond the cells llama.cpp's path gives one sequence): a context beyond that is
measured at the cap instead, as is a prefill longer than it.

Every figure: a cache on that path holds the context, one warm-up forward (first calls of a
shape allocate), then the median of ``REPEATS`` timed forwards, each after a crop back to the
context length (not timed): ``specd.engine.forward.measure``, the same measuring the engine's
``engine.forward_backend = auto`` runs at load. ``lean_over_hf`` divides lean ms by
hf ms: below 1 the lean path is faster.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

TARGET_WIDTHS = (1, 2, 4, 8, 16)  # new tokens per forward: one decode step .. a long verify
TARGET_CONTEXTS = (512, 2048)  # tokens held in the cache before the forward
DRAFT_WIDTHS = (1,)  # a draft model proposes one token per forward
DRAFT_CONTEXTS = (512,)
PREFILL_TOKENS = 1024  # a prefill from empty; its cost is reported per 1k tokens
REPEATS = 5  # timed forwards per figure, after one warm-up; the median counts
WINDOW_MARGIN = 32  # contexts stay this far inside the window: room for the widest forward
SEED = 0  # the random token ids the forwards run on
NO_TORCH_WEIGHTS = "a GGUF file: no torch weights"


def window_cap(window: int | None, *position_limits: int | None) -> int | None:
    """Most tokens of context a measurement may hold: the engine's window and every model's
    position limit, less ``WINDOW_MARGIN``; None when nothing limits it."""
    limits = [n for n in (window, *position_limits) if isinstance(n, int) and n > 0]
    if not limits:
        return None
    return max(1, min(limits) - WINDOW_MARGIN)


def capped(sizes: Sequence[int], cap: int | None) -> list[int]:
    """``sizes`` with each one beyond ``cap`` measured at the cap instead (duplicates merged)."""
    return sorted({size if cap is None else min(size, cap) for size in sizes})


def _position_limit(model) -> int | None:
    """Positions ``model`` was made for: its ``max_position_embeddings``, a GGUF file's trained
    context."""
    from specd.engine.models import is_gguf

    if is_gguf(model):
        return model.context_length
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def candidate_paths(model, engine_path, llamacpp: Callable[[], Any] | None = None
                    ) -> tuple[dict[str, Any], dict[str, str]]:
    """({name: forward path} to measure, {name: why not} for a path this model cannot take).
    The engine's own path object is measured as is; the others are built beside it (a
    ``LeanForward`` holds the model's parameters, no copies; ``llamacpp`` builds llama.cpp's
    forward on the model's GGUF file, when llama-cpp-python is installed)."""
    from specd.engine.forward.transformers import HFForward
    from specd.engine.forward.lean import LeanForward, unsupported_reason
    from specd.engine.models import is_gguf

    paths = {engine_path.name: engine_path}
    unavailable: dict[str, str] = {}
    if is_gguf(model):  # llama.cpp's path on the file itself is the only one
        unavailable.update({name: NO_TORCH_WEIGHTS for name in ("hf", "lean")})
        return paths, unavailable
    if "hf" not in paths:
        paths["hf"] = HFForward(model)
    if "lean" not in paths:
        reason = unsupported_reason(model)
        if reason is None:
            paths["lean"] = LeanForward(model)
        else:
            unavailable["lean"] = reason
    elif engine_path.replays:  # the engine replays CUDA graphs: and without?
        paths["lean_eager"] = LeanForward(model)
    if "llamacpp" not in paths and llamacpp is not None:
        try:
            paths["llamacpp"] = llamacpp()
        except Exception as err:  # not installed, not exportable, not on the CPU
            unavailable["llamacpp"] = str(err).splitlines()[0]
    return {name: paths[name] for name in ("hf", "lean", "lean_eager", "llamacpp") if name in paths}, unavailable


def measure_path(model, path, ids: Sequence[int], contexts: Sequence[int], widths: Sequence[int],
                 prefill_tokens: int, repeats: int, synchronize: Callable[[], None],
                 last_only: bool = False) -> dict[str, Any]:
    """ms of forwards on one path (``specd.engine.forward.measure.measure_path``, which the
    engine's ``forward_backend = auto`` runs too): ``forward_ms[context][width]``, on a path
    that computes rows on demand ``verify_one_row_ms`` (a verify whose first drafted token is
    rejected), and a ``prefill_tokens`` prefill from empty."""
    from specd.engine.forward.measure import measure_path as measure

    out = measure(model, path, ids, contexts, widths, prefill_tokens, repeats, synchronize, last_only=last_only)
    if "verify_rows_ms" in out:
        out["verify_one_row_ms"] = out.pop("verify_rows_ms")
    return out


def lean_over_hf(paths: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """lean ms / hf ms for every figure both paths have (below 1: lean is faster)."""
    if not {"hf", "lean"} <= set(paths):
        return None
    hf, lean = paths["hf"], paths["lean"]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b > 0 else None

    return {
        "forward_ms": {context: {width: ratio(ms, hf["forward_ms"][context][width]) for width, ms in row.items()}
                       for context, row in lean["forward_ms"].items()},
        "prefill_ms_per_1k": ratio(lean["prefill_ms_per_1k"], hf["prefill_ms_per_1k"]),
    }


def measure_role(model, engine_path, ids: Sequence[int], contexts: Sequence[int], widths: Sequence[int],
                 prefill_tokens: int, repeats: int, synchronize: Callable[[], None],
                 last_only: bool = False, llamacpp: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Every available path of one model (the target or the draft)."""
    paths, unavailable = candidate_paths(model, engine_path, llamacpp)
    measured = {name: measure_path(model, path, ids, contexts, widths, prefill_tokens, repeats, synchronize,
                                   last_only=last_only)
                for name, path in paths.items()}
    return {
        "engine_path": engine_path.name,
        "contexts": list(contexts),
        "widths": list(widths),
        "prefill_tokens": prefill_tokens,
        "paths": measured,
        "unavailable": unavailable,
        "lean_over_hf": lean_over_hf(measured),
    }


def measure_forward_costs(engine, repeats: int = REPEATS,
                          announce: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Forward costs of the loaded pair (see the module docstring); ``announce`` gets one
    progress line before the work starts."""
    import torch

    pair = engine.pair
    target_path, _ = engine.paths["target"]
    draft_path = engine.paths["draft"][0] if pair.draft is not None else None
    # A GGUF pair's window is what llama.cpp's path gives one document's cache (sized to the
    # prompt budgets, not the file's 32k-128k trained positions); otherwise the target's.
    window = target_path.window if pair.gguf else pair.window()
    cap = window_cap(window, _position_limit(pair.target))
    draft_cap = window_cap(window, _position_limit(pair.target), _position_limit(pair.draft)) if pair.draft else None
    target_contexts = capped(TARGET_CONTEXTS, cap)
    draft_contexts = capped(DRAFT_CONTEXTS, draft_cap)
    target_prefill = capped([PREFILL_TOKENS], cap)[0]
    draft_prefill = capped([PREFILL_TOKENS], draft_cap)[0]

    if announce is not None:
        roles = [f"target ({_path_names(pair.target, target_path)})"]
        if pair.draft is not None:
            roles.append(f"draft ({_path_names(pair.draft, draft_path)})")
        announce(f"forward costs of the {' and the '.join(roles)}: widths "
                 f"{'/'.join(map(str, TARGET_WIDTHS))} after {' and '.join(map(str, target_contexts))} tokens, "
                 f"a {target_prefill}-token prefill; median of {repeats}")

    vocab = pair.input_vocab()
    longest = max(max(target_contexts) + max(TARGET_WIDTHS), target_prefill, draft_prefill,
                  max(draft_contexts, default=0) + max(DRAFT_WIDTHS))
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (longest,), generator=generator).tolist()
    synchronize = torch.cuda.synchronize if pair.device.type == "cuda" else (lambda: None)

    started = time.monotonic()
    result: dict[str, Any] = {
        "window": window,
        "cap": cap,
        "repeats": repeats,
        "target": measure_role(pair.target, target_path, ids, target_contexts, TARGET_WIDTHS, target_prefill,
                               repeats, synchronize, llamacpp=_llamacpp_factory(engine, "target")),
        "draft": None,
    }
    if pair.draft is not None:
        result["draft"] = measure_role(pair.draft, draft_path, ids, draft_contexts, DRAFT_WIDTHS, draft_prefill,
                                       repeats, synchronize, last_only=True,
                                       llamacpp=_llamacpp_factory(engine, "draft"))
    result["wall_s"] = round(time.monotonic() - started, 2)
    return result


def _llamacpp_factory(engine, role: str) -> Callable[[], Any] | None:
    """Builds llama.cpp's forward of ``role`` (engine.forward_backend = llamacpp), or None when
    llama-cpp-python is not installed."""
    from specd.engine.models import is_gguf
    from specd.llamacpp.runtime import available

    if not available() or is_gguf(engine.pair.target):  # a GGUF pair's engine paths are llama.cpp's
        return None
    from specd.engine.forward.choose import llamacpp_forward

    pair = engine.pair
    model, source = (pair.target, pair.target_name) if role == "target" else (pair.draft, pair.draft_name)
    return lambda: llamacpp_forward(model, source, pair, engine.options)


def _path_names(model, engine_path) -> str:
    from specd.engine.forward.lean import unsupported_reason
    from specd.engine.models import is_gguf
    from specd.llamacpp.runtime import available

    if is_gguf(model):
        return f"{engine_path.name} path"
    names = ["hf"]
    if engine_path.name == "lean" or unsupported_reason(model) is None:
        names.append("lean")
    if engine_path.replays:
        names.append("lean_eager")
    if engine_path.name == "llamacpp" or available():
        names.append("llamacpp")
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names) + " paths"


# -- text ----------------------------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _role_lines(role_name: str, role: dict[str, Any], step_only: bool) -> list[str]:
    widths = [str(w) for w in role["widths"]]
    headers = ["1-step"] if step_only else [f"w={w}" for w in widths]
    cell = max(8, *(len(h) + 2 for h in headers))
    lines = [f"  {role_name} (the engine runs {role['engine_path']}; prefill: {role['prefill_tokens']} tokens "
             "from empty)",
             f"    {'path':<10}{'context':>8}" + "".join(f"{h:>{cell}}" for h in headers) + f"{'prefill ms/1k':>15}"]
    rows = [(name, figures, _ms) for name, figures in role["paths"].items()]
    rows += [(f"{name}:1row", {"forward_ms": figures["verify_one_row_ms"], "prefill_ms_per_1k": None}, _ms)
             for name, figures in role["paths"].items() if figures.get("verify_one_row_ms")]
    if role.get("lean_over_hf"):
        rows.append(("lean/hf", role["lean_over_hf"], lambda r: "-" if r is None else f"{r:.2f}x"))
    for name, figures, fmt in rows:
        for i, (context, row) in enumerate(figures["forward_ms"].items()):
            prefill = fmt(figures["prefill_ms_per_1k"]) if i == 0 else ""
            lines.append((f"    {name:<10}{context:>8}" + "".join(f"{fmt(row.get(w)):>{cell}}" for w in widths)
                          + f"{prefill:>15}").rstrip())
    for name, why in role.get("unavailable", {}).items():
        lines.append(f"    ({name} path unavailable: {why})")
    return lines


def format_forward_costs(costs: dict[str, Any]) -> str:
    """The text block: per model, ms by path, context and width, and lean/hf ratios."""
    cap = costs.get("cap")
    limit = f"; contexts at most {cap} tokens (window {costs.get('window')} less {WINDOW_MARGIN})" if cap else ""
    lines = [f"forward costs: median ms of {costs['repeats']} forwards after a warm-up; prefill ms per 1k "
             f"tokens{limit}; lean/hf = lean ms / hf ms (<1: lean is faster); lean_eager = the lean "
             "forward without the CUDA graphs the engine replays (when it does); lean:1row = what a "
             "verify costs on a CPU when its first drafted token is rejected (the forward, then one row "
             "of logits: the engine computes rows as verification reads them)"]
    lines += _role_lines("target", costs["target"], step_only=False)
    if costs.get("draft"):
        lines += _role_lines("draft", costs["draft"], step_only=True)
    return "\n".join(lines)
