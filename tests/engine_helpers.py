"""Helpers shared by the engine tests: engines over tiny pairs, and the reference decoder."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specd.engine import CompletionResult
from specd.engine.engine import Engine
from specd.engine.options import EngineOptions
from specd.engine.models import load_pair


def make_near_draft(target_dir: Path, out: Path, noise: float = 0.02, seed: int = 3) -> Path:
    """A draft that agrees with the target often but not always: the target plus weight noise.
    Exercises partial acceptance, which a random draft (rejected) or the target (accepted) can't."""
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise * param.std().clamp(min=1e-3))
    model.save_pretrained(out)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out)
    return out


def make_engine(target: Path, draft: Path | None, free_drafting: bool = True, **options) -> Engine:
    """An engine over a tiny pair. ``free_drafting``: the planner believes drafts cost nothing
    and verify widths cost the same, so every step drafts at full length, whatever the drafts'
    acceptance: the tests of losslessness exercise rejections. (Tests of the planner's economics
    turn it off or set their own costs.)"""
    # No wall-clock cut-off: on a loaded machine a time budget would make outputs load-dependent.
    options.setdefault("time_budget_ms", 600_000)
    # The paths pinned: the auto choices time forwards at load, and no test may hang on the clock.
    options.setdefault("forward_backend", "torch")
    options.setdefault("llamacpp_prefill", "torch")
    opts = EngineOptions(target=str(target), draft=str(draft or ""), device="cpu", dtype="float32", **options)
    engine = Engine(opts, pair=load_pair(str(target), str(draft) if draft else None, "cpu", "float32"))
    if free_drafting:
        make_drafting_free(engine)
    return engine


def make_drafting_free(engine: Engine) -> None:
    """Drafts cost nothing to the planner, and the draft model is priced and cut as if nothing
    had been measured at load (its prior the fixed guess, its chains stopped at 0.3): tiny random
    drafts agree rarely and confidently never, and measured they would hardly ever draft."""
    from specd.engine.speculation.agreement import NO_SAMPLE_CONFIDENCE

    engine.planning.priors.pop("draft", None)
    engine.planning.acceptance.pop("draft", None)
    engine.draft_confidence = NO_SAMPLE_CONFIDENCE
    costs = engine.planning.costs
    costs.target = {width: 1.0 for width in range(1, 65)}
    costs.draft_step, costs.draft_per_token = 1e-6, 0.0
    costs.record_target = lambda width, ms: None  # measurements must not change the plan
    costs.record_draft = lambda catch_up, steps, ms: None


def reference_tokens(model, prompt_ids: list[int], max_new_tokens: int, allowed=None) -> list[int]:
    """The target alone, greedy, through plain transformers generate(), no early stop; under
    the token-healing constraint (``prefix_allowed_tokens_fn``) when the prompt was healed."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, prefix_allowed_tokens_fn=allowed)
    return out[0, len(prompt_ids):].tolist()


def assert_lossless(engine: Engine, result: CompletionResult, max_tokens: int) -> None:
    """The completion is exactly the target's greedy continuation, cut where a stop rule fired."""
    allowed = engine.healing_constraint(result.healed, len(result.prompt_ids))
    reference = reference_tokens(engine.pair.target, result.prompt_ids, max_tokens, allowed)
    n = len(result.token_ids)
    assert result.token_ids == reference[:n], (result.stop_reason, result.token_ids, reference)
    if result.stop_reason == "eos":
        assert n < max_tokens and reference[n] in engine.stop_ids
    elif result.stop_reason == "max_tokens":
        assert n == max_tokens
