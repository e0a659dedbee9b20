"""What drafting costs and buys on this machine, for this model pair, measured as it runs.

The planner (``planner.DraftPlanner``) chooses each step's draft to maximise expected tokens per
millisecond, so it needs two things per loaded pair:

- ``ForwardCosts``: milliseconds of a target forward by width (how many tokens it verifies),
  of each row of logits read when the forward path computes rows on demand (the lean path on a
  CPU, ``caches.LazyRows``: a step pays for the rows verification reads, 1 + accepted, not for
  all k + 1), of one draft-model step, and of the draft model catching up on tokens it has not
  seen. Seeded
  by ``calibrate`` at load (a few forwards of each width, off the request path) and kept current
  by every step the engine runs (exponential moving averages).
- ``Acceptance``: per kind of draft, the probability that a draft's first token stands
  (``first``) and that a later one does once every one before it stood (``then_at(depth)``,
  by ranges of depth), from decayed counts so the estimate follows the text being written.

Expected tokens of a step that verifies k drafted tokens: 1 + first (1 + t(1) + t(1) t(2) + ...
+ t(1) ... t(k-1)), t = ``then_at`` (the accepted prefix plus the target's own token after it).

The costs may also be another machine's (``CostProfile``, ``SimulatedCosts``): the planner then
decides as it would there while the forwards run here, and ``ForwardTally`` (what the steps ran,
by width) priced at those costs projects the time they would take there.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specd.engine.forward.measure import median_ms
from specd.engine.speculation.agreement import SAMPLE_TOKENS, AgreementSample, next_tokens, with_chains

EMA = 0.2  # weight of a new timing in the moving averages
DECAY = 0.97  # per-record decay of acceptance counts: about the last 30 drafts of a kind matter
RELAX = 0.02  # per step a kind could have drafted but did not, its counts move this far toward the prior
CALIBRATION_WIDTHS = (1, 2, 4, 8, 12, 16, 24, 32)
CALIBRATION_CONTEXT = SAMPLE_TOKENS  # tokens of context behind the calibration forwards
CALIBRATION_REPEATS = 3  # per width, after one warm-up forward; the median counts
# The timed rounds after the warm-up take about this long at most: a model whose round of widths
# is dear (a real model on a CPU) is timed once per width, since start-up waits on it and every
# step after it re-times width 1 and scales the table (``ForwardCosts.record_target``).
CALIBRATION_BUDGET_MS = 1500.0
# Draft catch-ups at least this long teach the per-token rate. A shorter one costs about a draft
# step, whose own cost moves by more than the catch-up adds: in the decode loop a short catch-up
# read as many times the per-token rate of a long one (docs/engine.md, "Planning each step").
CATCH_UP_MEASURED = 32


# Depths (a draft token's index; the first is depth 0) from which each ``Acceptance.then_at``
# rate holds, up to the next: a match that has stood for a few tokens goes on standing more
# often than one that has just begun (docs/engine.md, "Planning each step", has the rates).
THEN_DEPTHS = (1, 2, 3, 5, 9)
DEPTH_WEIGHT = 4.0  # pseudo-drafts at the range before's rate behind each deeper range's estimate


def depth_ranges() -> list[tuple[str, int]]:
    """Each ``THEN_DEPTHS`` range as it is shown ("1", "3-4", "9+") with its first depth."""
    ends = [*(start - 1 for start in THEN_DEPTHS[1:]), None]
    return [(str(start) if end == start else f"{start}+" if end is None else f"{start}-{end}", start)
            for start, end in zip(THEN_DEPTHS, ends)]


def _depth_bucket(depth: int) -> int:
    """The ``THEN_DEPTHS`` bucket of a later token at ``depth`` >= 1."""
    return bisect.bisect_right(THEN_DEPTHS, depth) - 1


@dataclass
class Acceptance:
    """Acceptance of one kind of draft, from decayed counts (the prior is a few pseudo-drafts):
    ``first``, that a draft's first token stands, and ``then_at(depth)``, that a later token
    stands given every one before it did, learnt apart for a few ranges of depth
    (``THEN_DEPTHS``): the first range from the prior and what drafts showed, each deeper one
    from what drafts showed there, shrunk toward the range before it (where no draft reached
    it yet, it is that range's rate). Drafts are mostly right or wrong from the start (a lookup
    match that holds, holds for a while): one geometric rate would price a kind whose drafts
    stand 40% of the time but run long when they do as if every token were a coin toss, and cut
    its drafts to a token or two. And the longer a draft has stood, the likelier its next token
    is to stand: one rate for every later token, learnt mostly from the second and third tokens
    that short drafts reach, would price the eighth as the second and keep drafts short where
    they run on.

    A kind the planner stops choosing would never be measured again, and one bad stretch (a
    file where lookup misses) would switch it off for good: so while it goes unchosen its counts
    relax toward the prior, and it is tried again after a while (and dropped again at once if
    it still loses)."""

    first_hits: float
    first_misses: float
    then_hits: list[float]  # per THEN_DEPTHS bucket: the first with the prior's pseudo-counts,
    then_misses: list[float]  # ... the deeper ones what drafts showed alone
    prior_first: float = 0.5
    prior_then: float = 0.5
    prior_weight: float = 4.0

    @classmethod
    def prior(cls, first: float, then: float | None = None, weight: float = 4.0) -> "Acceptance":
        then = first if then is None else then
        deeper = [0.0] * (len(THEN_DEPTHS) - 1)
        return cls(first * weight, (1.0 - first) * weight, [then * weight, *deeper],
                   [(1.0 - then) * weight, *deeper], first, then, weight)

    def relax(self) -> None:
        w = self.prior_weight
        self.first_hits += RELAX * (self.prior_first * w - self.first_hits)
        self.first_misses += RELAX * ((1.0 - self.prior_first) * w - self.first_misses)
        self.then_hits[0] += RELAX * (self.prior_then * w - self.then_hits[0])
        self.then_misses[0] += RELAX * ((1.0 - self.prior_then) * w - self.then_misses[0])
        for b in range(1, len(THEN_DEPTHS)):  # toward the range before it
            self.then_hits[b] -= RELAX * self.then_hits[b]
            self.then_misses[b] -= RELAX * self.then_misses[b]

    @property
    def first(self) -> float:
        return self.first_hits / (self.first_hits + self.first_misses)

    @property
    def then(self) -> float:
        """That a draft's second token stands once its first did (``then_at(1)``)."""
        return self.then_at(1)

    def _range_rates(self) -> list[float]:
        """``then_at`` of each ``THEN_DEPTHS`` range, each deeper one shrunk toward the one before."""
        rates = [self.then_hits[0] / (self.then_hits[0] + self.then_misses[0])]
        for hits, misses in zip(self.then_hits[1:], self.then_misses[1:]):
            rates.append((hits + DEPTH_WEIGHT * rates[-1]) / (hits + misses + DEPTH_WEIGHT))
        return rates

    def then_at(self, depth: int) -> float:
        """That the token at ``depth`` >= 1 stands once every one before it did."""
        return self._range_rates()[_depth_bucket(depth)]

    def later_rates(self, k: int) -> list[float]:
        """``then_at`` of depths 1 .. k - 1: a k-token draft's later tokens, in order."""
        rates = self._range_rates()
        return [rates[_depth_bucket(depth)] for depth in range(1, k)]

    def record(self, proposed: int, accepted: int) -> None:
        self.first_hits = self.first_hits * DECAY + (1.0 if accepted > 0 else 0.0)
        self.first_misses = self.first_misses * DECAY + (0.0 if accepted > 0 else 1.0)
        # Later tokens reached: depths 1 .. accepted (the one at ``accepted`` failed, if proposed).
        hits, misses = [0] * len(THEN_DEPTHS), [0] * len(THEN_DEPTHS)
        for depth in range(1, min(accepted, proposed - 1) + 1):
            if depth < accepted:
                hits[_depth_bucket(depth)] += 1
            else:
                misses[_depth_bucket(depth)] += 1
        for b in range(len(THEN_DEPTHS)):
            if hits[b] or misses[b]:  # a range no token reached keeps its counts undecayed
                self.then_hits[b] = self.then_hits[b] * DECAY + hits[b]
                self.then_misses[b] = self.then_misses[b] * DECAY + misses[b]

    def reach(self, depth: int) -> float:
        """That the first ``depth`` tokens of a draft all stand."""
        return math.prod(self.later_rates(depth), start=self.first) if depth > 0 else 1.0

    def expected_after_first(self, k: int) -> float:
        """Expected later tokens standing, of k - 1, given the first stood."""
        total, p = 0.0, 1.0
        for rate in self.later_rates(k):
            p *= min(rate, 0.999)
            total += p
        return total

    def expected(self, k: int) -> float:
        """Expected accepted tokens of a k-token draft."""
        return self.first * (1.0 + self.expected_after_first(k)) if k > 0 else 0.0


@dataclass
class ForwardCosts:
    """Milliseconds per forward: the target by width, the draft model per step and per catch-up token."""

    target: dict[int, float] = field(default_factory=dict)  # width -> ms (without on-demand rows)
    head_row: float = 0.0  # ms per row of logits computed on demand (0: rows come with the forward)
    draft_step: float | None = None  # one draft token after a synced cache
    draft_per_token: float | None = None  # draft catch-up (prefill) per token, beyond one step
    _table: list[float] = field(default_factory=list, repr=False, compare=False)  # target_table's
    _table_key: tuple = field(default=(), repr=False, compare=False)  # the measured widths it was made of

    def target_ms(self, width: int) -> float:
        """Interpolated between measured widths; beyond the widest, extended along the last slope."""
        if not self.target:
            return 1.0 + 0.05 * (width - 1)  # unmeasured: only ratios matter, assume nearly flat
        if width in self.target:
            return self.target[width]
        known = sorted(self.target)
        i = bisect.bisect_left(known, width)
        if i == 0:
            return self.target[known[0]]
        if i == len(known):
            if len(known) == 1:
                return self.target[known[0]]
            lo, hi = known[-2], known[-1]
        else:
            lo, hi = known[i - 1], known[i]
        slope = (self.target[hi] - self.target[lo]) / (hi - lo)
        return max(self.target[lo] + slope * (width - lo), 1e-3)

    def target_table(self, widest: int) -> list[float]:
        """``target_ms(w)`` for every width w up to at least ``widest`` (index 0 unused). The
        planner prices up to 17 widths a step, and a step of a small model on llama.cpp takes
        under a millisecond (docs/engine.md): the table is made in one pass and kept while the
        measured widths stay as they are (every step records one timing, so it is made again
        once a step)."""
        key = tuple(self.target.items())
        if key != self._table_key or len(self._table) <= widest:
            self._table_key = key
            self._table = self._interpolated(widest)
        return self._table

    def _interpolated(self, widest: int) -> list[float]:
        """``target_ms`` of widths 0..widest, walking the measured widths once."""
        if not self.target:
            return [0.0, *(self.target_ms(width) for width in range(1, widest + 1))]
        known = sorted(self.target.items())
        count = len(known)
        table = [0.0] * (widest + 1)
        i = 0  # known[i]: the first measured width at or above the width at hand
        for width in range(1, widest + 1):
            while i < count and known[i][0] < width:
                i += 1
            if i < count and known[i][0] == width or i == 0 or count == 1:
                table[width] = known[min(i, count - 1)][1]
                continue
            (lo, low_ms), (hi, high_ms) = known[-2:] if i == count else known[i - 1:i + 1]
            table[width] = max(low_ms + (high_ms - low_ms) / (hi - lo) * (width - lo), 1e-3)
        return table

    def draft_ms(self, catch_up: int, steps: int) -> float:
        """A draft chain of ``steps`` tokens whose first forward also runs ``catch_up`` tokens
        the draft cache has not seen."""
        step, per_token = self.draft_rates()
        return steps * step + max(0, catch_up - 1) * per_token

    def draft_rates(self) -> tuple[float, float]:
        """(ms of a draft step, ms per catch-up token beyond one), guessed from a target step
        until measured."""
        step = self.draft_step if self.draft_step is not None else self.target_ms(1) / 3
        return step, self.draft_per_token if self.draft_per_token is not None else step / 8

    def break_even_agreement(self, chain: int = 8) -> float:
        """The chance of standing a draft model's next chain token needs to pay for itself: its
        draft step and the row it adds to the verify (the mean over a chain of ``chain``),
        against the ms of a token from a plain step. Above 1: no token pays."""
        step, _ = self.draft_rates()
        widen = (self.target_ms(chain + 1) - self.target_ms(2)) / max(1, chain - 1)
        return (step + max(0.0, widen)) / self.target_ms(1)

    def record_target(self, width: int, ms: float) -> None:
        old = self.target.get(width)
        self.target[width] = ms if old is None else (1 - EMA) * old + EMA * ms
        if width == 1 and old:
            # A slower or faster machine (another process, a thermal limit) moves every width
            # alike: widths the planner has stopped using follow the one it always uses, so a
            # busy moment at calibration does not price drafting out for good.
            scale = self.target[1] / old
            for other in self.target:
                if other != 1:
                    self.target[other] *= scale

    def price(self, tally: "ForwardTally") -> float:
        """ms of the forwards ``tally`` counts, at these costs (rows of logits on demand aside)."""
        table = self.target_table(max(tally.target, default=1))
        step, per_token = self.draft_rates() if tally.draft_forwards else (0.0, 0.0)
        return (sum(table[width] * count for width, count in tally.target.items())
                + tally.draft_forwards * step + tally.draft_catch_up * per_token)

    def step_ms(self, width: int, rows: float) -> float:
        """A target step of ``width`` tokens that reads ``rows`` rows of logits (expected)."""
        return self.target_ms(width) + self.head_row * rows

    def record_head_row(self, ms: float) -> None:
        self.head_row = ms if not self.head_row else (1 - EMA) * self.head_row + EMA * ms

    def record_draft(self, catch_up: int, steps: int, ms: float) -> None:
        if steps <= 0:
            return
        if catch_up <= 2:
            step = ms / steps
            self.draft_step = step if self.draft_step is None else (1 - EMA) * self.draft_step + EMA * step
        elif catch_up >= CATCH_UP_MEASURED and self.draft_step is not None:
            per_token = max(0.0, ms - steps * self.draft_step) / (catch_up - 1)
            self.draft_per_token = per_token if self.draft_per_token is None else \
                (1 - EMA) * self.draft_per_token + EMA * per_token

    def describe(self) -> dict:
        # Keys as strings: wire maps are keyed by strings (msgpack's default Unpacker refuses
        # int keys, and JSON would turn them into strings anyway).
        return {"target_ms_by_width": {str(w): round(ms, 3) for w, ms in sorted(self.target.items())},
                "head_row_ms": round(self.head_row, 3),
                "draft_step_ms": None if self.draft_step is None else round(self.draft_step, 3),
                "draft_catch_up_ms_per_token": None if self.draft_per_token is None else round(self.draft_per_token, 4)}


@dataclass
class ForwardTally:
    """The forwards a planner's steps ran, for pricing at any costs (``ForwardCosts.price``): the
    target's by width (the pending token and its draft, or a token tree's nodes; prompt tokens
    riding with a request's first step are prefill and not counted), and the draft model's
    forwards with the catch-up tokens beyond the first of each chain."""

    target: dict[int, int] = field(default_factory=dict)  # width -> forwards
    draft_forwards: int = 0
    draft_catch_up: int = 0

    def add_target(self, width: int) -> None:
        self.target[width] = self.target.get(width, 0) + 1

    def add_draft(self, catch_up: int, forwards: int) -> None:
        """A draft chain of ``forwards`` forwards, the first of which also ran ``catch_up`` tokens."""
        if forwards > 0:
            self.draft_forwards += forwards
            self.draft_catch_up += max(0, catch_up - 1)

    @property
    def target_forwards(self) -> int:
        return sum(self.target.values())

    def copy(self) -> "ForwardTally":
        return ForwardTally(dict(self.target), self.draft_forwards, self.draft_catch_up)

    def since(self, earlier: "ForwardTally") -> "ForwardTally":
        """What ran after ``earlier`` (a ``copy`` of this tally) was taken."""
        target = {width: count - earlier.target.get(width, 0) for width, count in self.target.items()}
        return ForwardTally({width: count for width, count in target.items() if count},
                            self.draft_forwards - earlier.draft_forwards, self.draft_catch_up - earlier.draft_catch_up)


@dataclass(frozen=True)
class CostProfile:
    """Forward costs of a machine specd is not running on, from published figures. A target step
    (one token) costs ``step_ms``; a verify of up to ``flat_rows`` tokens ``flat_ratio`` steps;
    each token beyond those ``per_row`` of a step more. The draft model keeps the ratio of its
    step to the target's measured here, and its catch-up costs per token what a token beyond
    ``flat_rows`` costs the target, at that ratio. Rows of logits come with the forward."""

    name: str
    step_ms: float
    flat_rows: int
    flat_ratio: float
    per_row: float
    basis: str  # one line: the machine and model the figures stand for

    def target_ms(self, width: int) -> float:
        if width <= 1:
            return self.step_ms
        return self.step_ms * (self.flat_ratio + self.per_row * max(0, width - self.flat_rows))

    def simulate(self, measured: ForwardCosts) -> "SimulatedCosts":
        """Costs priced by this profile, the draft model's at its ratio in ``measured`` (this
        machine's, which keeps recording what the steps take here)."""
        widths = sorted({1, 2, self.flat_rows, self.flat_rows + 1})  # linear beyond: ``target_ms`` extends the last slope
        costs = SimulatedCosts(target={width: self.target_ms(width) for width in widths}, profile=self,
                               measured=measured)
        if measured.draft_step is not None:
            ratio = measured.draft_step / measured.target_ms(1)
            costs.draft_step = self.step_ms * ratio
            costs.draft_per_token = self.step_ms * self.per_row * ratio
        return costs

    def describe(self) -> dict:
        return {"name": self.name, "step_ms": self.step_ms, "flat_rows": self.flat_rows,
                "flat_ratio": self.flat_ratio, "per_row": self.per_row, "basis": self.basis}


# A 7B model in bfloat16 on one H100 SXM, batch 1 (docs/bench.md, "Simulated GPU costs"). Its
# decode step reads 13.5 GB of weights at 3.35 TB/s: 4.0 ms at the memory's peak, 5 ms at the
# 80% that compiled batch-1 decoders reach. A forward of w tokens does w flops per byte of weight
# it reads (a multiply-add per bf16 weight per token), and the H100's dense bf16 peak is 295
# flops per byte of its bandwidth: a verify of 8 tokens is still a weight read, +5% for attention
# over the extra queries and the wider activations. Beyond 8 each token is priced at its own
# matmuls (2 x 6.7 GFLOP at half the dense peak: 0.027 ms, 0.55% of a step) as if none of it hid
# under the read: dearer than the roofline, which stays flat past a hundred tokens.
GPU = CostProfile("gpu", step_ms=5.0, flat_rows=8, flat_ratio=1.05, per_row=0.0055,
                  basis="a 7B model in bf16 on one H100 SXM, batch 1: a verify of up to 8 tokens 1.05x a "
                        "step, +0.55% of a step per token beyond")
PROFILES = {profile.name: profile for profile in (GPU,)}
MEASURED = "measured"  # no profile: the costs this machine measures


@dataclass
class SimulatedCosts(ForwardCosts):
    """``ForwardCosts`` priced by a ``CostProfile``, not by this machine's clock: the planner
    decides as it would on that machine while the forwards run here, and outputs stay the same
    (the planner chooses drafts, never tokens). The prices stay fixed; what the steps take here
    goes to ``measured``, which reports show beside them."""

    profile: CostProfile | None = None
    measured: ForwardCosts = field(default_factory=ForwardCosts)

    def record_target(self, width: int, ms: float) -> None:
        self.measured.record_target(width, ms)

    def record_head_row(self, ms: float) -> None:
        self.measured.record_head_row(ms)

    def record_draft(self, catch_up: int, steps: int, ms: float) -> None:
        self.measured.record_draft(catch_up, steps, ms)

    def describe(self) -> dict:
        return {**super().describe(), "simulated": self.profile.name if self.profile else None,
                "measured": self.measured.describe()}


@dataclass
class Calibration:
    """What ``calibrate`` measured at load: the forward costs, and both models' greedy next
    tokens on the code it ran (None: no draft model, or no code sample was given)."""

    costs: ForwardCosts
    sample: AgreementSample | None = None


def calibrate(target_state_factory: Callable[[], object], draft_state_factory: Callable[[object], object] | None,
              vocab_size: int, max_width: int, device: torch.device, context: Sequence[int] | None = None,
              target_rows: int | None = None) -> Calibration:
    """Seed the costs: forwards of each width after ``CALIBRATION_CONTEXT`` tokens of context,
    for the target, and draft steps and catch-up for the draft model. KV states come from the
    factories (``KVState``s; the draft's is given the target's, which a feature head reads) and
    are thrown away.

    ``context``: code to use as that context (``agreement.code_sample``); then both models read
    it with every row of logits, and their greedy next tokens are kept (``AgreementSample``), at
    the cost of the target's rows for 256 tokens (the draft's prefill runs anyway). Without it
    the context is random ids and nothing is learnt of agreement. ``target_rows``: rows of the
    target's logits (default ``vocab_size``)."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    measure = context is not None and draft_state_factory is not None
    if context is None:
        generator = torch.Generator().manual_seed(0)
        context = torch.randint(0, vocab_size, (CALIBRATION_CONTEXT,), generator=generator).tolist()
    context = list(context)
    rows = target_rows or vocab_size
    costs, sample = ForwardCosts(), None
    state = target_state_factory()
    if measure:
        target_next, _ = next_tokens(state, context, rows)
    else:
        state.extend(context, last_only=True)
    draft = None
    if draft_state_factory is not None:
        # Before the verify timings below: a feature head reads the target's hidden states at
        # each position of the sample, and those timings' rollbacks keep only the last ones.
        draft = draft_state_factory(state)
        if measure:
            sample = AgreementSample(target_next, *next_tokens(draft, context, rows))
            # A head's chain reads its own predicted states: its second token is measured so.
            chained = draft.chained_next(context)
            if chained is not None:
                sample = with_chains(sample, context, chained)
        else:
            draft.extend(context, last_only=True)
    widths = [w for w in CALIBRATION_WIDTHS if w <= max_width]
    head_ms: list[float] = []

    def verify_ms(width: int) -> float:
        tokens = context[:width]
        synchronize()
        started = time.perf_counter()
        rows = state.extend_rows(tokens)
        rows.row(0)  # at least one row is always read (on demand: timed apart, head_ms)
        synchronize()
        ms = (time.perf_counter() - started) * 1000
        head_ms.append(rows.head_ms)
        state.rollback(len(context))
        return ms - rows.head_ms

    # Rounds over every width, not every width's repeats in a row: a busy moment of a shared
    # machine then slows one round of all widths rather than all of one width's forwards (a
    # 2-token verify timed at twice its cost kept the draft model priced out for good).
    warm_ms = sum(verify_ms(width) for width in widths)  # the warm-up round: first calls of a shape allocate
    head_ms.clear()
    times: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(max(1, min(CALIBRATION_REPEATS, int(CALIBRATION_BUDGET_MS // max(warm_ms, 1e-3))))):
        for width in widths:
            times[width].append(verify_ms(width))
    for width in widths:
        costs.target[width] = max(statistics.median(times[width]), 1e-3)
    if head_ms:
        costs.head_row = statistics.median(head_ms)
    if draft is not None:
        def one_step():
            draft.extend(context[:1], last_only=True)
            draft.rollback(len(context))

        costs.draft_step = median_ms(one_step, _nothing, CALIBRATION_REPEATS, synchronize)
        catch_up = CATCH_UP_MEASURED

        def catch_up_step():
            draft.extend(context[:catch_up], last_only=True)
            draft.rollback(len(context))

        costs.draft_per_token = max(0.0, median_ms(catch_up_step, _nothing, CALIBRATION_REPEATS, synchronize)
                                    - costs.draft_step) / (catch_up - 1)
    return Calibration(costs, sample)


def _nothing() -> None:
    """No reset between timed calls: each rolls its own state back."""
