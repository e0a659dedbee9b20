"""Verification: which of a draft's tokens the target lets stand, and the target's own token
after them, for a chain or a token tree, greedy or sampled. Lossless by construction: greedy
output is the target's argmax path; sampled output follows the target's distribution p exactly
(speculative sampling: a draft token d drawn from q stands with probability min(1, p(d) / q(d)),
and on rejection the target's token is drawn from norm(max(0, p - q))).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specd.engine.caches import Rows, row_argmax
from specd.engine.speculation.drafters import Draft, DraftTree
from specd.engine.speculation.healing import Constraint
from specd.engine.speculation.sampling import SamplingParams, probabilities


def _row(rows: Rows, i: int, constraint: Constraint | None, before: Sequence[int]) -> torch.Tensor:
    """Row i of the logits, masked by the constraint after ``before`` when there is one."""
    logits = rows.row(i)
    return logits if constraint is None else constraint.row(logits, before)


def _choice(rows: Rows, i: int, constraint: Constraint, before: Sequence[int]) -> int:
    """The target's greedy token at row i under the constraint after ``before`` (unconstrained:
    ``rows.argmax(i)``, with no ``before`` to build)."""
    return row_argmax(constraint.row(rows.row(i), before))


def _stands(p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None) -> bool:
    """One step of speculative sampling: a draft ``token`` drawn from q (None: a point mass,
    q(token) = 1) stands with probability min(1, p(token) / q(token))."""
    q_token = q[token].item() if q is not None else 1.0
    return torch.rand((), generator=generator).item() < min(1.0, p[token].item() / q_token)


def _rejected(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """What p becomes once a draft ``token`` drawn from q was rejected: norm(max(0, p - q)); for a
    point mass, p with the token removed; p itself where that leaves nothing (p == q up to
    rounding: any draw from p is right)."""
    if q is not None:
        residual = (p - q).clamp(min=0.0)
    else:
        residual = p.clone()
        residual[token] = 0.0
    total = residual.sum()
    return p if total <= 0 else residual / total


def verify_greedy(rows: Rows, draft: Draft, out: Sequence[int],
                  constraint: Constraint | None = None) -> tuple[int, int]:
    """Greedy verification reading rows only as far as the draft stands: a draft token stands
    iff it is the target's argmax (under the constraint); the first mismatch is replaced by the
    argmax, and if all stand the last row gives a bonus token. Rows past the first mismatch are
    never computed (``LazyRows``)."""
    n, k = 0, len(draft)
    while True:
        choice = rows.argmax(n) if constraint is None else _choice(rows, n, constraint, [*out, *draft.tokens[:n]])
        if n == k or choice != draft.tokens[n]:
            return n, choice
        n += 1


def verify_tree_greedy(rows: Rows, tree: DraftTree, out: Sequence[int],
                       constraint: Constraint | None = None) -> tuple[list[int], int]:
    """``verify_greedy`` down a token tree (row 0: after the pending token; row i + 1: after
    node i): from the root, follow the child whose token is the target's argmax while there is
    one. Returns the path of nodes that stood and the target's own token after them; rows off the
    path are never computed."""
    children = tree.children()
    node, path, stood = -1, [], []
    while True:
        choice = rows.argmax(node + 1) if constraint is None else _choice(rows, node + 1, constraint, [*out, *stood])
        child = children.get(node, {}).get(choice)
        if child is None:
            return path, choice
        path.append(child)
        stood.append(choice)
        node = child


def verify_tree(rows: Rows, tree: DraftTree, sampling: SamplingParams, generator: torch.Generator | None,
                out: Sequence[int], constraint: Constraint | None = None) -> tuple[list[int], int]:
    """Speculative sampling down a token tree: at each node, the drafts offered after it are
    tested in turn as SpecInfer's multi-draft rule tests them, each as one step of ``verify``:
    draft d drawn from q stands with probability min(1, p(d) / q(d)) under the current p, and if
    it does not, p becomes norm(max(0, p - q)) for the next (a point mass: p with d removed).
    The first that stands moves down to its node; when none does, the target's own token is
    drawn from what p has become. Each test is an exact rejection step for a draft drawn
    independently of the others, so the token that comes out follows the target's p, as for a
    chain. Returns the path of nodes that stood and the target's own token after them."""
    offers = tree.offers()
    node, path, stood = -1, [], []
    while True:
        p = probabilities(_row(rows, node + 1, constraint, [*out, *stood]), sampling)
        for child, token, q in offers.get(node, []):
            if _stands(p, token, q, generator):
                break
            p = _rejected(p, token, q)
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(child)
        stood.append(token)
        node = child


def verify(logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
           generator: torch.Generator | None) -> tuple[int, int]:
    """Accepted draft count n and the target's own next token after them.

    logits: [k + 1, V]; row i is the target's distribution for the token after draft[:i].
    """
    k = len(draft)
    if sampling.greedy:
        # Greedy: a draft token stands iff it is the target's argmax; the first mismatch is
        # replaced by the argmax, and if all stand the last row gives a bonus token.
        choice = logits.argmax(-1).tolist()
        n = 0
        while n < k and choice[n] == draft.tokens[n]:
            n += 1
        return n, choice[n]
    p = probabilities(logits, sampling)  # [k + 1, V]
    for i, token in enumerate(draft.tokens):
        # Speculative sampling: accept d with probability min(1, p(d) / q(d)); on rejection
        # draw from norm(max(0, p - q)). A lookup draft is a point mass: q(d) = 1, so accept
        # with p(d), and the residual is p with d removed.
        q = draft.probs[i] if draft.probs is not None else None
        if not _stands(p[i], token, q, generator):
            return i, int(torch.multinomial(_rejected(p[i], token, q), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def accept_chain(rows: Rows, draft: Draft, sampling: SamplingParams, generator: torch.Generator | None,
                 out: Sequence[int], constraint: Constraint | None = None) -> tuple[int, int]:
    """Accepted draft count and the target's own token after them, for a chain's rows [k + 1, V]
    after ``out``: greedy reads rows only as far as the draft stands, sampling reads them all."""
    if sampling.greedy:
        return verify_greedy(rows, draft, out, constraint)
    logits = rows.dense()
    if constraint is not None:
        logits = constraint.rows(logits, out, draft.tokens)
    return verify(logits, draft, sampling, generator)  # reads the logits: a device sync


def accept_tree(rows: Rows, tree: DraftTree, sampling: SamplingParams, generator: torch.Generator | None,
                out: Sequence[int], constraint: Constraint | None = None) -> tuple[list[int], int]:
    """The path of tree nodes that stood and the target's own token after them."""
    if sampling.greedy:
        return verify_tree_greedy(rows, tree, out, constraint)
    return verify_tree(rows, tree, sampling, generator, out, constraint)
