"""The model families the lean forward serves: one module per family, registered in ``FAMILIES``.

Each family module offers the same small interface (``Family``): the model types it serves, the
decoder's attribute on the ``...ForCausalLM``, ``reason(model)`` (why the lean forward cannot
compute exactly what this model computes, or None) and ``describe(model, copy)`` (the
``layers.Decoder`` the forward runs). Adding a family is one module here and its entry in
``FAMILIES``; ``unsupported_reason`` and ``LeanForward`` read nothing else, and the tests
parametrize over ``SUPPORTED_MODEL_TYPES``.

Family modules may import ``layers`` and ``rotary``, never ``forward`` (which imports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol

from torch import nn

from specd.engine.forward.lean.families import gpt2, llama, neox, opt, seed_oss
from specd.engine.forward.lean.layers import Decoder

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Family(Protocol):
    """What a family module offers."""

    MODEL_TYPES: Mapping[str, str]  # model type -> the transformers.models package holding its classes
    BODY: str  # the decoder's attribute on the ...ForCausalLM

    def reason(self, model: PreTrainedModel) -> str | None: ...
    def describe(self, model: PreTrainedModel, copy: bool) -> Decoder: ...


# The one table: order is the order unsupported_reason lists the model types in.
FAMILIES: tuple[Family, ...] = (llama, gpt2, neox, opt, seed_oss)
BY_MODEL_TYPE: dict[str, Family] = {model_type: family for family in FAMILIES for model_type in family.MODEL_TYPES}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


def family_of(model: PreTrainedModel) -> Family:
    """The family module serving ``model`` (KeyError for a model type none serves)."""
    return BY_MODEL_TYPE[model.config.model_type]


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """None when ``LeanForward`` computes exactly what this HF model computes; otherwise one line
    saying why not (``specd doctor`` shows it beside the HF fallback)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in BY_MODEL_TYPE:
        return f"model type {model_type!r} has no lean forward (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    family = BY_MODEL_TYPE[model_type]
    package = family.MODEL_TYPES[model_type]
    if not type(model).__module__.startswith(f"transformers.models.{package}."):
        return f"{type(model).__name__} is not transformers' own {model_type} class (remote code?)"
    if not (hasattr(model, "lm_head") and hasattr(model, family.BODY)):
        return f"{type(model).__name__} is not a ...ForCausalLM (no LM head)"
    if getattr(model, "hf_quantizer", None) is not None or getattr(config, "quantization_config", None):
        return "quantized weights"
    if model.training:
        return "the model is in training mode (dropout)"
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return f"weights spread over {len(devices)} devices"
    if next(iter(devices)).type == "meta":
        return "weights not loaded (meta device / offloaded)"
    reason = family.reason(model)
    if reason is not None:
        return reason
    if type(model.lm_head) is not nn.Linear:
        return "the LM head is not a plain nn.Linear"
    return None
