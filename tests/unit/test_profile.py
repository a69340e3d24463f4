"""The on-machine profiler (puzzle.tools.profile) and SearchResult -> train_ppo.py flags."""

import json

import pytest

from puzzle.parallel.plan import ParallelPlan
from puzzle.plan_search import SearchResult, load_profile, save_profile, validate_profile
from puzzle.bench.calibration import PlanFlagsError, plan_flags
from puzzle.tools.profile import SHAPES, run_profile
from tests.harness import TINY_CLI


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "cpu.json"
    spec = {"shape": dict(SHAPES["tiny"]), "tp_sizes": [1], "micro_batch_sizes": [1, 4], "seq_lengths": [32],
            "decode_batch_sizes": [1, 4], "procs": 1, "repeats": 3, "decode_steps": 4, "name": "test-cpu"}
    raw = run_profile(spec, str(out), timeout=300, log=lambda m: None)
    return out, raw


def test_profile_round_trips(tiny_profile, tmp_path):
    path, _ = tiny_profile
    prof = load_profile(str(path))
    assert prof.name == "test-cpu"
    again = tmp_path / "again.json"
    save_profile(prof, str(again))
    assert validate_profile(json.loads(again.read_text())).to_json() == prof.to_json()


def test_profile_tables_positive(tiny_profile):
    path, raw = tiny_profile
    prof = load_profile(str(path))
    assert len(prof.layers) == 1
    tab = next(iter(prof.layers.values()))
    assert (tab.hidden_size, tab.ffn_hidden_size, tab.num_attention_heads, tab.num_query_groups, tab.swiglu) == \
        (64, 128, 4, 2, True)
    assert sorted(tab.fwd_s) == sorted(tab.bwd_s) == sorted(tab.decode_s) == [1]
    assert [x for x, _ in tab.fwd_s[1]] == [32.0, 128.0] and [x for x, _ in tab.decode_s[1]] == [1.0, 4.0]
    # measured times: positive; how they grow with the inputs is not asserted (no timed asserts:
    # a shared machine measured a 4x larger input at less than half the time)
    for rows in (tab.fwd_s[1], tab.bwd_s[1], tab.decode_s[1]):
        assert all(y > 0 for _, y in rows)
    tr = raw["train"]["1"]
    assert len(tr) == 2 and all(m["fwd_s"] > 0 and m["bwd_s"] > 0 for m in tr)  # micro-batches 1 and 4
    for k in ("peak_flops", "hbm_bandwidth", "device_memory_bytes"):
        assert getattr(prof, k) > 0
    assert prof.decode_step_overhead_s >= 0


def _result(layout, plans, placements):
    return SearchResult("hand", layout, plans, placements, {}, 0.0, 0, 0.0, [0.0], 0, 0, 0.0)


def _validate(flags):
    from puzzle.arguments import parse_args, validate_args

    base = TINY_CLI + ["--micro-batch-size", "2", "--rollout-batch-size", "16", "--max-new-tokens", "16"]
    return validate_args(parse_args(base + flags), world_size=4, vocab_size=259)


def test_plan_flags_colocated():
    A, G, C = ParallelPlan(2, 1, 2), ParallelPlan(1, 2, 2), ParallelPlan(1, 2, 2)
    res = _result("colocated", {"actor": {"generation": G, "scoring": A, "training": A},
                                "critic": {"scoring": C, "training": C}, "ref": {"scoring": A},
                                "reward": {"scoring": C}},
                  {"generation": "single", "scoring": "time-sharing", "training": "sequential"})
    flags = plan_flags(res)
    # actor/ref (2,1,2) and critic (1,2,2) share ranks with different layouts: the trainer cannot
    # time-share them, so scoring falls back to sequential
    assert flags[-4:] == ["--score-placement", "sequential", "--train-placement", "sequential"]
    cfg = _validate(flags)
    assert cfg.roles["actor"].plan == A and cfg.roles["actor"].gen_plan == G
    assert cfg.roles["critic"].plan == C and cfg.roles["ref"].plan == A
    assert cfg.score_placement == "sequential"
    with pytest.raises(PlanFlagsError):
        plan_flags(res, strict=True)


def test_plan_flags_disjoint_and_time_sharing():
    A, C = ParallelPlan(1, 2, 1), ParallelPlan(1, 2, 1, offset=2)
    res = _result("disjoint@2", {"actor": {"generation": A, "scoring": A, "training": A},
                                 "critic": {"scoring": C, "training": C}, "ref": {"scoring": A},
                                 "reward": {"scoring": C}},
                  {"generation": "single", "scoring": "disjoint", "training": "disjoint"})
    flags = plan_flags(res)
    assert flags[-4:] == ["--score-placement", "disjoint", "--train-placement", "disjoint"]
    cfg = _validate(flags)
    assert cfg.roles["critic"].plan == C and cfg.roles["actor"].plan == A and cfg.score_placement == "disjoint"
    assert cfg.roles["ref"].plan == A and cfg.roles["actor"].gen_plan == A
    # colocated, equal layouts: time-sharing survives and validates
    P = ParallelPlan(2, 2, 1)
    ts = _result("colocated", {"actor": {"generation": ParallelPlan(1, 4, 1), "scoring": P, "training": P},
                               "critic": {"scoring": P, "training": P}, "ref": {"scoring": P}, "reward": {"scoring": P}},
                 {"generation": "single", "scoring": "time-sharing", "training": "time-sharing"})
    f = plan_flags(ts)
    assert f[-4:] == ["--score-placement", "time-sharing", "--train-placement", "time-sharing"]
    assert _validate(f).train_placement == "time-sharing"
    # generation on ranks the actor does not train on: not expressible
    bad = _result("disjoint@2", {"actor": {"generation": ParallelPlan(1, 4, 1), "scoring": A, "training": A},
                                 "critic": {"scoring": C, "training": C}, "ref": {"scoring": A},
                                 "reward": {"scoring": C}}, {"scoring": "disjoint", "training": "disjoint"})
    with pytest.raises(PlanFlagsError):
        plan_flags(bad)


def test_merge_raw_means_every_measured_time_and_keeps_the_points():
    from puzzle.tools.profile import merge_raw

    def raw(scale, wall):
        return {"train": {"1": [{"tokens": 32, "mbs": 1, "seq": 32, "fwd_s": 2.0 * scale, "bwd_s": 4.0 * scale}]},
                "decode": {"1": [{"seqs": 4, "step_s": 1.0 * scale, "layer_s": 0.5 * scale}]},
                "allreduce": [[1024, 0.1 * scale]], "p2p": [[1024, 0.2 * scale]], "peak_flops": 10.0 * scale,
                "gemm_half_flops": 1.0, "hbm_bandwidth": 5.0, "padded_vocab": 384, "wall_s": wall}

    m = merge_raw([raw(1.0, 30.0), raw(3.0, 40.0)])
    assert m["train"]["1"][0] == {"tokens": 32, "mbs": 1, "seq": 32, "fwd_s": 4.0, "bwd_s": 8.0}
    assert m["decode"]["1"][0] == {"seqs": 4, "step_s": 2.0, "layer_s": 1.0}
    assert m["allreduce"] == [[1024, pytest.approx(0.2)]] and m["p2p"] == [[1024, pytest.approx(0.4)]]
    assert m["peak_flops"] == 20.0 and m["padded_vocab"] == 384
    assert m["wall_s"] == 70.0 and m["worlds"] == 2
    with pytest.raises(ValueError, match="no raw results"):
        merge_raw([])


def test_pooled_medians_pool_the_iterations_of_every_run():
    from puzzle.bench.calibration import pooled_medians

    a = {"generation": [1.0, 2.0], "scoring": [1.0, 1.0], "training": [5.0, 5.0], "iteration": [7.0, 8.0]}
    b = {"generation": [9.0, 10.0, 11.0], "scoring": [3.0, 3.0, 3.0], "training": [1.0, 1.0, 1.0],
         "iteration": [13.0, 14.0, 15.0]}
    m = pooled_medians([a, b])
    assert m["generation"] == 9.0 and m["scoring"] == 3.0 and m["training"] == 1.0 and m["iteration"] == 13.0
    assert m["iterations_timed"] == 5


def test_generation_steps_bench_refuses_a_layout_of_another_world():
    from puzzle.bench.generation_steps import main

    with pytest.raises(SystemExit, match="not a layout of 4 ranks"):
        main(["--layouts", "2,2,2"])
