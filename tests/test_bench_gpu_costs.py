"""specd bench --costs gpu: the planner prices forwards as a 7B model on an H100 would cost them
while they run here. The profile's prices; simulated costs that stay fixed, keep the draft model
at its measured ratio and still record what runs here; a tally of the forwards priced at them;
the planner drafting wider at them than at a dear verify; and the bench through its real CLI on
the tiny pair: outputs identical to measured costs' (and hf_greedy's), the JSON and the table
marked simulated with tokens per forward and projected times, the planner's table the profile's."""

from __future__ import annotations

import json

import pytest

from bench_helpers import bench_cli, module_bench_env
from specd.bench.report import format_table
from specd.engine.speculation import costs as costs_module
from specd.engine.speculation.costs import GPU, Acceptance, CostProfile, ForwardCosts, ForwardTally
from specd.engine.speculation.drafters import Draft, LookupDrafter
from specd.engine.speculation.planner import DraftPlanner, PlannerMemory
from test_planner import FixedLookup

# A verify that costs 30% of a step more per drafted token: what a CPU's is like, dearer.
DEAR = CostProfile("dear", step_ms=5.0, flat_rows=1, flat_ratio=1.0, per_row=0.3,
                   basis="a test machine whose verify costs 30% of a step a token")


def test_gpu_profile_prices_a_verify_of_up_to_8_tokens_at_1_05_steps():
    assert GPU.target_ms(1) == 5.0
    assert all(GPU.target_ms(width) == pytest.approx(5.25) for width in range(2, 9))
    assert GPU.target_ms(16) == pytest.approx(5.0 * (1.05 + 8 * 0.0055))
    measured = ForwardCosts(target={1: 20.0, 2: 30.0, 8: 80.0}, head_row=0.5, draft_step=4.0, draft_per_token=0.5)
    costs = GPU.simulate(measured)
    table = costs.target_table(48)
    assert all(table[width] == pytest.approx(GPU.target_ms(width)) for width in range(1, 49))
    assert costs.head_row == 0.0  # a GPU's rows of logits come with the forward
    assert costs.draft_step == pytest.approx(5.0 * 4.0 / 20.0)  # the draft model at its measured ratio
    assert costs.draft_per_token == pytest.approx(5.0 * 0.0055 * 4.0 / 20.0)


def test_simulated_prices_stay_while_what_runs_here_is_recorded():
    measured = ForwardCosts(target={1: 20.0, 8: 80.0}, draft_step=4.0, draft_per_token=0.5)
    costs = GPU.simulate(measured)
    costs.record_target(1, 40.0)
    costs.record_target(8, 200.0)
    costs.record_draft(1, 2, 20.0)
    costs.record_head_row(1.0)
    assert costs.target_ms(1) == 5.0 and costs.target_ms(8) == pytest.approx(5.25)
    assert costs.draft_step == pytest.approx(1.0) and costs.head_row == 0.0
    assert measured.target[1] > 20.0 and measured.draft_step > 4.0 and measured.head_row == 1.0
    described = costs.describe()
    assert described["simulated"] == "gpu" and described["target_ms_by_width"]["1"] == 5.0
    assert described["measured"]["target_ms_by_width"]["1"] > 20.0


def test_a_tally_of_forwards_is_priced_width_by_width():
    costs = GPU.simulate(ForwardCosts(target={1: 20.0}, draft_step=4.0, draft_per_token=0.5))
    tally = ForwardTally()
    for width in (1, 1, 1, 9):
        tally.add_target(width)
    tally.add_draft(catch_up=40, forwards=3)  # a chain of 3 whose first forward caught up 40 tokens
    assert tally.target_forwards == 4 and (tally.draft_forwards, tally.draft_catch_up) == (3, 39)
    step, per_token = costs.draft_rates()
    assert costs.price(tally) == pytest.approx(3 * 5.0 + GPU.target_ms(9) + 3 * step + 39 * per_token)
    earlier = tally.copy()
    tally.add_target(5)
    assert tally.since(earlier) == ForwardTally({5: 1})
    assert costs.price(ForwardTally()) == 0.0


def _chosen_length(profile: CostProfile) -> int:
    """The length of a 16-token lookup draft the planner verifies at ``profile``'s costs, for a
    kind whose drafts stand 70% of the time, and 80% token to token after that."""
    tokens = list(range(100, 116))
    kind = LookupDrafter.kind(Draft(tokens, "lookup:current", None, 4))
    memory = PlannerMemory(profile.simulate(ForwardCosts()))
    memory.acceptance[kind] = Acceptance.prior(0.7, 0.8, weight=1000)
    draft = DraftPlanner(memory, [FixedLookup(tokens)]).propose(list(range(50)), room=40)
    assert draft.kind == kind
    return len(draft)


def test_the_planner_drafts_wider_at_gpu_costs_than_at_a_dear_verify():
    at_gpu, at_dear = _chosen_length(GPU), _chosen_length(DEAR)
    assert at_gpu >= 8 > at_dear >= 1, (at_gpu, at_dear)


def test_the_planner_tallies_each_forward_once_by_width():
    memory = PlannerMemory(GPU.simulate(ForwardCosts()))
    planner = DraftPlanner(memory, [])
    planner.record(Draft([1, 2, 3], "lookup:current", None, 4), 2, ms=None)  # untimed: still counted
    planner.record(Draft([], "none", None), 0, ms=3.0)
    assert memory.ran == ForwardTally({4: 1, 1: 1})


# -- the bench, through its real CLI ---------------------------------------------------------

@pytest.fixture(scope="module")
def reports(llama_pair, corpus_dir, tmp_path_factory):
    """{costs: JSON report} of one short edit_replay bench per cost mode on the tiny pair: the
    same completions, specd against hf_greedy and the ablation without lookup."""
    out = tmp_path_factory.mktemp("gpu-costs-out")
    results = {}
    with module_bench_env(out), pytest.MonkeyPatch.context() as patch:
        patch.setitem(costs_module.PROFILES, DEAR.name, DEAR)
        for mode in ("measured", "gpu", "dear"):
            code, stdout, stderr = bench_cli("--workloads", "edit_replay", "--limit", "2", "--max-tokens", "12",
                                             "--methods", "hf_greedy,specd,specd_no_lookup", "--no-forward-costs",
                                             "--costs", mode, "--json", pair=llama_pair, corpus=corpus_dir)
            assert code == 0, stderr
            results[mode] = json.loads(stdout)
    return results


def test_outputs_are_identical_at_every_cost_mode(reports):
    for mode, report in reports.items():
        assert report["identical"] is True and report["identical_evidence"] > 0, mode
        methods = report["workloads"]["edit_replay"]["methods"]
        assert methods["specd"]["matched_nonempty"] > 0
    # every mode's specd wrote the same tokens (each equal to hf_greedy's, which the modes share)
    tokens = {mode: report["workloads"]["edit_replay"]["methods"]["specd"]["tokens"] for mode, report in reports.items()}
    assert len(set(tokens.values())) == 1, tokens


def test_the_report_marks_costs_simulated_and_projects_decode_time(reports):
    measured, gpu = reports["measured"], reports["gpu"]
    assert measured["costs"] == {"mode": "measured", "simulated": False}
    assert "--costs" not in measured["command"] and "--costs gpu" in gpu["command"]
    costs = gpu["costs"]
    assert costs["simulated"] is True and costs["mode"] == "gpu" and costs["profile"]["flat_ratio"] == 1.05
    # what the planner priced at: the profile's table, with this machine's measured one beside it
    planner = costs["planner"]
    assert planner["simulated"] == "gpu" and planner["target_ms_by_width"]["1"] == 5.0
    assert planner["target_ms_by_width"]["8"] == pytest.approx(5.25)
    assert planner["measured"]["target_ms_by_width"]["1"] != 5.0
    methods = gpu["workloads"]["edit_replay"]["methods"]
    reference, specd = methods["hf_greedy"], methods["specd"]
    # the reference decodes a token a forward: its projection is its forwards at a step each
    assert reference["projected_ms"] == pytest.approx(reference["target_forwards"] * 5.0)
    assert specd["projected_ms"] > 0 and specd["mean_tokens_per_forward"] > 0
    assert sum(specd["target_forwards_by_width"].values()) == specd["target_forwards"]
    assert specd["projected_speedup_vs"]["hf_greedy"] == pytest.approx(
        reference["projected_ms"] / specd["projected_ms"], rel=1e-2)
    assert measured["workloads"]["edit_replay"]["methods"]["specd"]["projected_ms"] is None
    table = format_table(gpu)
    assert "forward costs SIMULATED (gpu:" in table and "H100" in table
    assert "projected at gpu costs" in table and "tok/fwd" in table and "vs hf_greedy" in table
    assert "median ms" in table  # the wall times measured here, still there
    assert "SIMULATED" not in format_table(measured)


def test_the_planner_drafts_by_the_simulated_costs(reports):
    """At the GPU's flat verify the planner runs wider forwards than at a dear verify, on the same
    completions with the same outputs."""
    def mean_width(mode: str) -> float:
        widths = reports[mode]["workloads"]["edit_replay"]["methods"]["specd"]["target_forwards_by_width"]
        return sum(int(w) * n for w, n in widths.items()) / sum(widths.values())

    assert mean_width("gpu") > mean_width("dear")
    assert reports["dear"]["costs"]["planner"]["target_ms_by_width"]["2"] == pytest.approx(6.5)
