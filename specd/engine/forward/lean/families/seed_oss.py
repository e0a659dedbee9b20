"""Seed-OSS (ByteDance's Seed-OSS-36B) in the lean forward: Llama's layout with biased q/k/v
projections, as Qwen2's, so the Llama family's own checks and description serve it (its
residual dropout is off in eval, the only mode the lean forward serves)."""

from specd.engine.forward.lean.families.llama import describe, reason

MODEL_TYPES = {"seed_oss": "seed_oss"}  # model type -> the transformers.models package that holds its classes
BODY = "model"  # the decoder's attribute on the ...ForCausalLM

__all__ = ["BODY", "MODEL_TYPES", "describe", "reason"]
