"""``specd bench --costs PROFILE``: the planner prices forwards as another machine would
(``specd.engine.speculation.costs.CostProfile``, e.g. ``gpu``: a 7B model on an H100) while the
forwards run here.

Outputs stay what they are at measured costs: the planner chooses how much to draft, never
which token stands. What a run shows then: tokens per target forward (which no machine
changes), the wall times measured here, and a projected decode time: the forwards each
completion ran, by width, priced at the profile's costs (``ForwardCosts.price``). The peers
whose every forward makes one token (``ONE_TOKEN_PEERS``: greedy decoding) are priced at one
step a forward; the others' forward widths are not known here, and they get no projection.
Prefill is left out on every side: a GPU's prefill is another figure, and the same prompt
tokens run for every method.
"""

from __future__ import annotations

from typing import Any, Iterable

from specd.bench.peers import ONE_TOKEN_PEERS, Method, Run, SpecdMethod
from specd.engine.speculation.costs import MEASURED, PROFILES, CostProfile, SimulatedCosts

PROJECTION = ("decode forwards x simulated costs: each target forward at the profile's cost of its width, "
              "the draft model's at its measured ratio; one-token peers one step a forward; prefill not counted")


def profile_named(name: str | None) -> CostProfile | None:
    """The profile ``--costs NAME`` asks for; None for measured costs. ValueError for others."""
    if name in (None, MEASURED):
        return None
    if name not in PROFILES:
        raise ValueError(f"unknown --costs {name} (known: {', '.join([MEASURED, *PROFILES])})")
    return PROFILES[name]


def install(methods: Iterable[Method], profile: CostProfile) -> None:
    """Every specd method's engine (``specd`` and the ablations share one; a sibling engine has
    its own) prices its forwards by ``profile`` from here on."""
    engines = {id(method.engine): method.engine for method in methods if isinstance(method, SpecdMethod)}
    for engine in engines.values():
        if not isinstance(engine.planning.costs, SimulatedCosts):
            engine.planning.costs = profile.simulate(engine.planning.costs)


def project(method: Method, run: Run, profile: CostProfile) -> float | None:
    """ms ``run``'s decode forwards would take at ``profile``'s costs; None where not known."""
    if isinstance(method, SpecdMethod) and run.forwards is not None:
        return method.engine.planning.costs.price(run.forwards)
    if method.name in ONE_TOKEN_PEERS:
        return run.target_forwards * profile.target_ms(1)
    return None


def describe(profile: CostProfile | None, engine) -> dict[str, Any]:
    """The report's ``costs``: measured, or the profile simulated with what the planner priced
    at (the simulated table and this machine's measured one beside it)."""
    if profile is None:
        return {"mode": MEASURED, "simulated": False}
    return {"mode": profile.name, "simulated": True, "profile": profile.describe(), "projection": PROJECTION,
            "planner": engine.planning.costs.describe()}
