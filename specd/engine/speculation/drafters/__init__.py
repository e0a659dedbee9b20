"""Drafters: one module per drafter, the types they share (``base``), and the registry of the
drafters the engine builds for a request.

Adding a drafter: a module with a ``Drafter`` subclass that declares what the planner needs
(``priors``, ``kind``, ``longest``, ``cost``, ``ends_when_empty``, ``propose_all``) and a
``for_request(inputs)`` factory, and one line in ``REGISTRY``."""

from specd.engine.speculation.drafters.base import (EMPTY, Draft, Drafter, DrafterFactory, DrafterInputs,
                                                    DraftingCost, DraftTree, KVCost, Prior)
from specd.engine.speculation.drafters.continuation import ContinuationDrafter
from specd.engine.speculation.drafters.lookup import SUGGESTED, LookupDrafter
from specd.engine.speculation.drafters.model import ModelDrafter

# The drafters a request gets, in priority order (where two drafts rate the same, the earlier
# drafter's wins): each factory takes what the engine has and returns None where it has nothing.
REGISTRY: tuple[DrafterFactory, ...] = (
    ContinuationDrafter.for_request,
    LookupDrafter.for_request,
    ModelDrafter.for_request,
)


def build(inputs: DrafterInputs) -> list[Drafter]:
    """The registry's drafters for one request, in priority order."""
    return [drafter for make in REGISTRY if (drafter := make(inputs)) is not None]


__all__ = ["EMPTY", "REGISTRY", "SUGGESTED", "ContinuationDrafter", "Draft", "DraftTree", "Drafter", "DrafterFactory",
           "DrafterInputs", "DraftingCost", "KVCost", "LookupDrafter", "ModelDrafter", "Prior", "build"]
