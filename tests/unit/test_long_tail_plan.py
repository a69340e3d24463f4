"""The long tail priced from a response-length distribution, and the advisory choice between
synchronous, partial rollouts and the lag-1 overlap (puzzle.plan_search.long_tail; pure, no torch)."""

import json

import pytest

from puzzle.arguments import ArgumentError, parse_args
from puzzle.config import PPOParams
from puzzle.parallel.plan import ParallelPlan
from puzzle.plan_search import LLAMA_SHAPES, CostModel, PPOWorkload, load_profile, ppo_roles
from puzzle.plan_search.long_tail import (OFF_POLICY_MARGIN, ModeEstimate, ResponseLengths, choose, compare_modes,
                                          from_metrics, simulate, trace_seconds)
from puzzle.plan_search.search import PPOJob

SHAPE = LLAMA_SHAPES["350M"]
CAP = 1024
PROMPTS, GROUP = 64, 8  # GRPO: 64 prompts x 8 samples


def _job(world: int, slots=None) -> PPOJob:
    w = PPOWorkload(rollout_batch_size=PROMPTS * GROUP, prompt_len=256, gen_len=CAP, micro_batch_size=8,
                    generation_micro_batch_size=slots)
    return PPOJob(world_size=world, actor=SHAPE, critic=SHAPE, workload=w, profile=load_profile("a100_80gb"),
                  roles=("actor",))


LONG_TAIL = ResponseLengths.from_percentiles(150, 900, CAP)
EQUAL = ResponseLengths("fixed", CAP)


def test_all_equal_lengths_price_as_the_stage_without_a_distribution():
    """Every response at the cap: the simulated stage is generation_cost's (waves of full-width steps)."""
    for slots in (None, 128):
        job = _job(1, slots)
        cm = CostModel(job.profile, job.workload)
        actor = ppo_roles(SHAPE, None)["actor"]
        plan = ParallelPlan(1, 1, 1)
        (tr,) = simulate(EQUAL, PROMPTS * GROUP, 1, slots=slots, prompt_len=256, iterations=1)
        assert trace_seconds(cm, actor, plan, tr) == pytest.approx(cm.generation_cost(actor, plan).total, rel=1e-9)


@pytest.mark.parametrize("world", [1, 4])
def test_all_equal_lengths_pick_synchronous(world):
    """KV-cache slots for one batch: partial rollouts have nothing to cut (every group finishes on
    the same step) and the overlap splits the ranks: neither gains, sync is chosen."""
    report = compare_modes(_job(world, slots=PROMPTS * GROUP), EQUAL, GROUP, 2.0)
    assert report.choice == "sync"
    sync, partial = report.estimate("sync"), report.estimate("partial")
    assert partial.iteration_s >= sync.iteration_s * (1 - OFF_POLICY_MARGIN)


@pytest.mark.parametrize("world", [1, 4])
def test_a_long_tail_picks_partial_rollouts_or_the_overlap(world):
    report = compare_modes(_job(world, slots=PROMPTS * GROUP), LONG_TAIL, GROUP, 2.0)
    assert report.choice in ("partial", "overlap")
    best = report.estimate(report.choice)
    assert best.iteration_s < 0.8 * report.estimate("sync").iteration_s
    doc = report.to_dict()
    assert doc["advisory"] and doc["choice"] == report.choice and [m["mode"] for m in doc["modes"]] == [
        "sync", "partial", "overlap"]
    text = "\n".join(report.lines())
    assert "advisory only: this run's own flags decide what runs" in text and "--rl-partial-rollouts" in text \
        or report.choice == "overlap"


def test_estimates_move_with_p99():
    """p50 fixed, a longer tail: the synchronous stage (it waits for the longest) grows, and what
    partial rollouts save grows with it."""
    job = _job(1, slots=PROMPTS * GROUP)
    sync, partial = [], []
    for p99 in (150, 300, 600, 1000):
        r = compare_modes(job, ResponseLengths.from_percentiles(150, p99, CAP), GROUP, 2.0)
        sync.append(r.estimate("sync").iteration_s)
        partial.append(r.estimate("partial").iteration_s)
    assert sync == sorted(sync) and sync[-1] > 2 * sync[0]
    gain = [s / p for s, p in zip(sync, partial)]
    assert gain[0] < 1 + OFF_POLICY_MARGIN < 1.5 < min(gain[2:])  # nothing to cut without a tail
    assert partial[-1] - partial[0] < sync[-1] - sync[0]


def test_partial_simulation_trains_the_quota_and_loses_nothing():
    """Each iteration trains exactly the batch's whole groups; served tokens are either trained
    or still carried; the stage stops before the longest response."""
    traces = simulate(LONG_TAIL, 16, 4, oversample=2.0, prompt_len=8, iterations=8, warmup=2)
    assert all(t.trained == 64 for t in traces)
    sync = simulate(LONG_TAIL, 16, 4, prompt_len=8, iterations=8)
    steps = lambda ts: sum(sum(t.steps.values()) for t in ts)
    assert steps(traces) < steps(sync)
    assert sum(t.carried_tokens for t in traces) > 0  # resumed samples are prefilled again
    # with the quota at every served group there is nothing to carry: the synchronous stage
    same = simulate(LONG_TAIL, 16, 4, oversample=1.0, prompt_len=8, iterations=4, warmup=0)
    assert [t.steps for t in same] == [t.steps for t in simulate(LONG_TAIL, 16, 4, prompt_len=8, iterations=4)]
    assert all(t.trained == 64 and t.carried_tokens == 0 for t in same)


def test_rows_at_the_cap_every_rollout():
    """``cap_every`` k: the samples of global index 0, k, 2k, ... at the cap (the first row of each
    rollout): every synchronous iteration of k samples lasts the cap, the uncapped draw's not all;
    with 2 replicas of k/2 samples each only the first one serves them; partial rollouts carry
    them and cut the stage short of the cap."""
    k, cap = 64, 192
    tail = ResponseLengths("exponential", cap, mean=0.16 * cap)
    capped = ResponseLengths("exponential", cap, mean=0.16 * cap, cap_every=k)
    assert [capped.length_of(i, 0.5) for i in (0, 1, k, k + 1)] == [cap, tail.quantile(0.5), cap, tail.quantile(0.5)]
    assert capped.expected_mean() == pytest.approx(tail.expected_mean() * (k - 1) / k + cap / k)
    assert "1 in 64 samples (the first of each rollout) at the cap" in capped.describe()
    longest = lambda tr: sum(tr.steps.values()) + 1  # the prefill samples each row's first token
    sync = simulate(capped, k, 1, iterations=6)
    assert all(longest(t) == cap for t in sync)
    assert not all(longest(t) == cap for t in simulate(tail, k, 1, iterations=6))
    first, second = (simulate(capped, k // 2, 1, iterations=6, seed=d, replica=(d, 2)) for d in (0, 1))
    assert all(longest(t) == cap for t in first) and not all(longest(t) == cap for t in second)
    partial = simulate(capped, k // 4, 4, oversample=2.0, iterations=6, warmup=4)
    assert all(longest(t) < cap for t in partial) and all(t.trained == k for t in partial)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="cap_every must be an integer >= 0"):
            ResponseLengths("exponential", cap, mean=10.0, cap_every=bad)


def test_choice_needs_the_margin():
    sync = ModeEstimate("sync", 10.0)
    assert choose([sync, ModeEstimate("partial", 9.8), ModeEstimate("overlap", why_not="x")]) == "sync"
    assert choose([sync, ModeEstimate("partial", 9.0), ModeEstimate("overlap", 8.0)]) == "overlap"


def test_overlap_needs_two_ranks_and_reports_why():
    report = compare_modes(_job(1), LONG_TAIL, GROUP, 2.0)
    assert not report.estimate("overlap").available and "2 ranks" in report.estimate("overlap").why_not
    over = compare_modes(_job(4, slots=PROMPTS * GROUP), LONG_TAIL, GROUP, 2.0).estimate("overlap")
    assert over.available and over.iteration_s == pytest.approx(
        max(over.generation_s, over.train_side_s) + over.switch_s)
    assert over.switch_s > 0  # every byte of the weights crosses to the other pool


def test_lengths_from_a_runs_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"iteration": i, "response_length_p10": 10, "response_length_p50": 40 + i,
             "response_length_p90": 300, "response_length_max": 900} for i in range(1, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"eval/reward": 1.0}) + "\n")
    d = from_metrics(str(path), CAP)
    assert d.quantile(0.5) == 46 and d.quantile(0.9) == 300 and d.quantile(0.9999) <= 900
    assert "measured" in d.describe()
    (tmp_path / "empty.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="no iteration with response_length"):
        from_metrics(str(tmp_path / "empty.jsonl"), CAP)


@pytest.mark.parametrize("flags, message", [
    (["--expected-response-length-p50", "100"], "--expected-response-length-p99: missing"),
    (["--expected-response-length-p99", "100"], "--expected-response-length-p50: missing"),
    (["--expected-response-length-p50", "0", "--expected-response-length-p99", "10"],
     "--expected-response-length-p50: must be > 0"),
    (["--expected-response-length-p50", "50", "--expected-response-length-p99", "40"],
     "--expected-response-length-p50: must be <= --expected-response-length-p99"),
    (["--expected-response-length-p50", "50", "--expected-response-length-p99", "400"],
     "--expected-response-length-p99: must be <= --max-new-tokens 256"),
])
def test_bad_length_flags_are_refused_naming_them(flags, message):
    args = parse_args(["--max-new-tokens", "256"] + flags)
    with pytest.raises(ArgumentError, match=message):
        PPOParams(max_new_tokens=256, expected_response_length_p50=args.expected_response_length_p50,
                  expected_response_length_p99=args.expected_response_length_p99)


def test_bad_distributions_are_refused():
    with pytest.raises(ValueError, match="p50: must be <= p99"):
        ResponseLengths.from_percentiles(300, 200, CAP)
    with pytest.raises(ValueError, match="p99: must be <= max_new_tokens"):
        ResponseLengths.from_percentiles(100, 2000, CAP)
    with pytest.raises(ValueError, match="oversample: must be >= 1"):
        compare_modes(_job(1), LONG_TAIL, GROUP, 0.5)


def _bench_argv(cap: int, *extra: str) -> list:
    from puzzle.bench.long_tail import MODEL, RUN

    return MODEL + RUN + ["--rl-partial-rollouts", "--rl-partial-rollouts-oversample", "2",
                          "--n-samples-per-prompt", "4", "--seq-length", str(cap + 16),
                          "--max-position-embeddings", str(cap + 16), "--max-new-tokens", str(cap), *extra]


def test_the_long_tail_bench_configurations():
    """puzzle.bench.long_tail's two distributions on one rank, priced with the profile measured for
    its model: partial rollouts on both (on the equal one F = 2 doubles the decode batch, whose step
    costs less per row when wider: the bench measured 1.04x and 1.36x, docs/ppo.md); with the
    KV cache limited to one batch, the equal lengths give nothing to cut."""
    from puzzle.plan_search.command import predict_mode

    cap = 192
    tail, equal = ResponseLengths("exponential", cap, mean=0.16 * cap), ResponseLengths("fixed", cap)
    assert predict_mode(_bench_argv(cap), tail, 1, "cpu_long_tail_1rank") == "partial"
    assert predict_mode(_bench_argv(cap), equal, 1, "cpu_long_tail_1rank") == "partial"
    one_batch = ("--generation-micro-batch-size", "64")
    assert predict_mode(_bench_argv(cap, *one_batch), equal, 1, "cpu_long_tail_1rank") == "sync"
    assert predict_mode(_bench_argv(cap, *one_batch), tail, 1, "cpu_long_tail_1rank") == "partial"


def test_search_plan_and_dry_run_print_the_choice(tmp_path, capsys):
    from puzzle.arguments import config_for_planning
    from puzzle.plan_search.command import print_dry_run, search_main

    tiny = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--swiglu", "--seq-length", "96", "--max-position-embeddings", "96", "--max-new-tokens", "64",
            "--advantage-estimator", "grpo", "--n-samples-per-prompt", "4", "--rollout-batch-size", "8",
            "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--kl-coef", "0"]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"response_length_p10": 2, "response_length_p50": 5, "response_length_p90": 30,
                                   "response_length_max": 64}) + "\n")
    assert search_main(["--world-size", "2", *tiny, "--response-lengths-from", str(metrics), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["long_tail"]
    assert doc["advisory"] and doc["response_lengths"].startswith("measured (p0 1, p10 2, p50 5, p90 30, p100 64)")
    assert {m["mode"] for m in doc["modes"]} == {"sync", "partial", "overlap"}
    cfg = config_for_planning(parse_args(tiny + ["--world-size", "2", "--expected-response-length-p50", "5",
                                                 "--expected-response-length-p99", "60"]))
    print_dry_run(cfg, load_profile("cpu_tiny_4ranks"))
    out = capsys.readouterr().out
    assert "long tail (responses: log-normal, p50 5, p99 60 of 64 tokens)" in out
    assert "colocated synchronous" in out and "disjoint asynchronous, lag 1" in out
    assert "advisory only: this run's own flags decide what runs" in out


def test_partial_rollouts_the_run_cannot_take_are_not_chosen():
    report = compare_modes(_job(1, slots=PROMPTS * GROUP), LONG_TAIL, GROUP, 2.0,
                           partial_refused="not with --advantage-estimator remax")
    assert report.choice == "sync" and "remax" in report.estimate("partial").why_not
