"""puzzle.bench.long_tail's three modes on 4 ranks priced at the layouts each really runs
(puzzle.plan_search.command.predict_modes), the choice and where it flips, and the profile terms
that price them: all-reduce latency per group size, the decode step's host share per T, and a
CPU host's cores shared by its ranks (pure Python, no torch)."""

import argparse
import json

import pytest

from puzzle.bench.long_tail import MODES, RANKS, mode_argv, prediction, response_lengths
from puzzle.parallel.plan import ParallelPlan
from puzzle.plan_search import CostModel, PPOWorkload, load_profile, ppo_roles, save_profile
from puzzle.plan_search.command import (job_from_config, long_tail_report, predict_mode, predict_modes,
                                       shapes_from_config)
from puzzle.plan_search.profile_data import ProfileError, validate_profile

CAP = 192
TAIL, EQUAL = (response_lengths(k, CAP, 64) for k in ("long_tailed", "all_equal"))  # the bench's planted ones
PROFILE = "cpu_long_tail_4ranks"


def _bench_args():
    return argparse.Namespace(max_new_tokens=CAP, n_samples=4, oversample=2.0, profile=PROFILE)


def _argvs():
    return {m: mode_argv(_bench_args(), m) for m in MODES}


def _config(mode: str):
    from puzzle.arguments import build_parser, config_for_planning

    return config_for_planning(build_parser(prog="t", raise_errors=True).parse_args(
        _argvs()[mode] + ["--world-size", str(RANKS)]))


def _profile_file(tmp_path, name: str, **hardware) -> str:
    """The bundled 4-rank profile with ``hardware`` fields changed (None: removed), as a file."""
    doc = load_profile(PROFILE).to_json()
    for k, v in hardware.items():
        doc["hardware"].pop(k, None) if v is None else doc["hardware"].__setitem__(k, v)
    path = tmp_path / f"{name}.json"
    save_profile(validate_profile(doc), str(path))
    return str(path)


def test_each_mode_is_priced_at_the_layouts_the_bench_runs():
    report = predict_modes(_argvs(), TAIL, RANKS, PROFILE)
    assert report.estimate("sync").layout == "actor (1,4,1) gen (1,1,4)"
    assert report.estimate("partial").layout == "actor (1,4,1) gen (1,1,4)"
    over = report.estimate("overlap")
    assert over.layout == "generation (1,1,2)@2 on ranks 2..3; training pool actor (1,2,1)"
    # the overlap's flags only change its estimate: the searched pool generates at (1,2,1)@2
    searched = predict_modes({"sync": _argvs()["sync"]}, TAIL, RANKS, PROFILE, gen_ranks=[2]).estimate("overlap")
    assert "(1,1,2)@2" not in searched.layout
    with pytest.raises(ValueError, match="no generation pool"):
        predict_modes({**_argvs(), "overlap": _argvs()["sync"]}, TAIL, RANKS, PROFILE)


def test_the_bench_choice_matches_its_measurement_and_flips_on_an_idle_host(tmp_path):
    """The profile was measured beside a background load of 8.7: partial rollouts on the long
    tail (its rows at the cap), the overlap on equal lengths (docs/benchmarks.md: each the fastest
    in every run of the bench). On an idle host the overlap's generation pool (2 of the 4 ranks on
    the 2 cores) gets the cores its waiting training pool leaves and the long tail flips to the
    overlap; with a device per rank (no shared cores) it stays with partial rollouts, which cut
    the tail on all 4 ranks, and the overlap lasts its longer pool."""
    assert predict_modes(_argvs(), TAIL, RANKS, PROFILE).choice == "partial"
    assert predict_modes(_argvs(), EQUAL, RANKS, PROFILE).choice == "overlap"
    idle = _profile_file(tmp_path, "idle", host_background_load=None)
    assert predict_modes(_argvs(), TAIL, RANKS, idle).choice == "overlap"
    assert predict_modes(_argvs(), EQUAL, RANKS, idle).choice == "overlap"
    own_devices = _profile_file(tmp_path, "own_devices", host_cores=None)
    over = predict_modes(_argvs(), TAIL, RANKS, own_devices)
    assert over.choice == "partial"
    o = over.estimate("overlap")
    assert o.iteration_s == pytest.approx(max(o.generation_s, o.train_side_s) + o.switch_s)


def test_the_t4_step_pays_the_latency_of_a_group_of_four(tmp_path):
    """2 all-reduces per layer and the sampling's exchange, each at the 4-rank group's latency
    (4 ranks on 2 cores: several times a pair's); without the table every group pays a pair's."""
    prof = load_profile(PROFILE)
    lat4, pair = prof.allreduce_latency(4, False), prof.intra_node_latency_s
    assert lat4 > 2 * pair
    pairs_only = load_profile(_profile_file(tmp_path, "pairs", allreduce_latency_s_by_ranks=None))
    w = PPOWorkload(64, prompt_len=16, gen_len=CAP)
    shape = shapes_from_config(_config("sync"))["actor"]
    actor = ppo_roles(shape, None)["actor"]
    t4 = ParallelPlan(1, 1, 4)
    step, step_pairs = (CostModel(p, w).decode_step_seconds(actor, t4, 64) for p in (prof, pairs_only))
    assert step - step_pairs == pytest.approx((2 * shape.num_layers + 1) * (lat4 - pair), rel=1e-9)
    t1 = ParallelPlan(1, 1, 1)  # no collectives at T=1: the same price
    assert CostModel(prof, w).decode_step_seconds(actor, t1, 64) == CostModel(pairs_only, w).decode_step_seconds(
        actor, t1, 64)


def _hardware(**extra) -> dict:
    hw = {"device_memory_bytes": 2 ** 30, "memory_reserved_bytes": 0, "ranks_per_node": 4,
          "intra_node_bandwidth": 1e9, "inter_node_bandwidth": 1e8, "intra_node_latency_s": 0.001,
          "inter_node_latency_s": 0.01, "hbm_bandwidth": 1e10, "peak_flops": 1e11, "gemm_efficiency": 1.0,
          "gemm_half_efficiency_flops": 1e6, "layer_overhead_s": 1e-5, "decode_step_overhead_s": 0.02}
    return {"name": "t", "hardware": {**hw, **extra}, "layers": []}


def test_profile_tables_by_group_size_and_tp():
    prof = validate_profile(_hardware(allreduce_latency_s_by_ranks={"2": 0.001, "4": 0.006},
                                      decode_step_overhead_s_by_tp={"1": 0.01, "4": 0.05}, host_cores=2))
    assert prof.allreduce_latency(4, False) == 0.006 and prof.allreduce_latency(2, False) == 0.001
    assert prof.allreduce_latency(8, False) == pytest.approx(0.006 * 7 / 3)  # a ring's hops beyond the table
    assert prof.allreduce_latency(4, True) == 0.01  # across nodes: the scalar
    assert prof.allreduce_time(8, 4, False) == pytest.approx(1.5 * 8 / 1e9 + 0.006)
    assert [prof.decode_step_overhead(T) for T in (1, 2, 4)] == [0.01, 0.02, 0.05]  # T=2 unmeasured: the scalar
    assert validate_profile(json.loads(json.dumps(prof.to_json()))).to_json() == prof.to_json()
    plain = validate_profile(_hardware())
    assert plain.allreduce_latency(4, False) == 0.001 and plain.decode_step_overhead(4) == 0.02
    assert "allreduce_latency_s_by_ranks" not in plain.to_json()["hardware"]
    for bad, msg in (({"3": 0.1}, "3 is not a power of two"), ({"x": 0.1}, "'x' is not a number of ranks"),
                     ({"2": -1}, r"allreduce_latency_s_by_ranks\[2\] must be a finite non-negative"),
                     ([0.1], "must be an object")):
        with pytest.raises(ProfileError, match=msg):
            validate_profile(_hardware(allreduce_latency_s_by_ranks=bad))


def test_busy_ranks_factor_of_a_shared_host():
    shared = validate_profile(_hardware(host_cores=2))
    assert [shared.busy_ranks_factor(b) for b in (1, 2, 3, 4, 8)] == pytest.approx([0.5, 0.5, 0.75, 1.0, 1.0])
    loaded = validate_profile(_hardware(host_cores=2, host_background_load=8))  # 2 busy: (2/12) / (2/10)
    assert [loaded.busy_ranks_factor(b) for b in (1, 2, 4)] == pytest.approx([9 / 12, 10 / 12, 1.0])
    devices = validate_profile(_hardware())  # host_cores 0: a device per rank
    assert all(devices.busy_ranks_factor(b) == 1.0 for b in (1, 2, 4))


def test_the_overlap_iteration_on_a_shared_host():
    """Both pools busy for the shorter one's work, then the longer one's rest at its factor."""
    report = predict_modes(_argvs(), EQUAL, RANKS, PROFILE)
    prof = load_profile(PROFILE)
    over = report.estimate("overlap")
    both = min(over.generation_s, over.train_side_s)
    f = prof.busy_ranks_factor(2)  # (either pool has 2 ranks)
    rest = (over.generation_s - both) * f + (over.train_side_s - both) * f
    assert prof.busy_ranks_factor(2) < 1.0
    assert over.iteration_s == pytest.approx(both + rest + over.switch_s)
    assert over.iteration_s < max(over.generation_s, over.train_side_s)


def test_a_runs_own_generation_pool_is_priced_by_dry_run():
    cfg = _config("overlap")
    report = long_tail_report(cfg, load_profile(PROFILE), own_layouts=True, lengths=TAIL)
    assert report.estimate("overlap").layout.startswith("generation (1,1,2)@2 on ranks 2..3")
    assert "gen (1,1,2)@2" not in report.estimate("sync").layout  # the colocated modes: searched
    assert job_from_config(cfg, load_profile(PROFILE)).world_size == RANKS


def test_the_bench_prediction_row():
    row = prediction(_bench_args(), "long_tailed", {"partial": 3.30, "overlap": 2.72})
    assert row["predicted"] == "partial" and row["measured_fastest"] == "partial" and row["matches"]
    assert set(row["estimated_s_per_iteration"]) == {"sync", "partial", "overlap"}
    assert row["estimated_ratio_over_sync"]["partial"] > 1 and "exponential" in row["lengths"]
    slower = prediction(_bench_args(), "all_equal", {"partial": 0.9, "overlap": 0.95})
    assert slower["measured_fastest"] == "sync" and not slower["matches"]
    assert "1 in 64 samples (the first of each rollout) at the cap" in row["lengths"]
    uncapped = prediction(_bench_args(), "long_tailed_uncapped", {"partial": 2.57, "overlap": 3.03})
    assert "at the cap" not in uncapped["lengths"] and uncapped["measured_fastest"] == "overlap"
    assert uncapped["estimated_s_per_iteration"]["sync"] < row["estimated_s_per_iteration"]["sync"]
    # predict_mode (the sync flags' layouts, the overlap searched over its splits) still answers
    assert predict_mode(_argvs()["sync"], TAIL, RANKS, PROFILE, gen_ranks=[2]) in ("partial", "overlap")


def test_the_bench_refuses_an_unknown_distribution(capsys):
    from puzzle.bench.long_tail import main

    with pytest.raises(SystemExit):
        main(["--distributions", "long_tailed,heavy"])
    assert "--distributions: unknown heavy (known: long_tailed, all_equal, long_tailed_uncapped)" in capsys.readouterr().err


def test_profiler_builds_the_tables_from_its_measurements():
    from puzzle.tools.profile import build_profile

    shape = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                 swiglu=True, seq_length=48, vocab_size=259)
    spec = {"shape": shape, "tp_sizes": [1, 4], "seq_lengths": [32], "procs": 4, "decode_steps": 4, "name": "t"}
    train = [{"tokens": 128, "fwd_s": 0.02, "bwd_s": 0.03, "layer_fwd_s": 0.005}]
    raw = {"elem_bytes": 4, "background_load": 3.5, "allreduce": [[1024, 0.001], [4096, 0.0011]],
           "p2p": [[1024, 0.001], [4096, 0.0012]],
           "allreduce_by_ranks": {"4": [[1024, 0.004], [4096, 0.0041]]}, "device_memory_bytes": 2 ** 30,
           "reserved_bytes": 0, "ranks_per_node": 4, "hbm_bandwidth": 1e10, "peak_flops": 1e10,
           "gemm_half_flops": 1e6, "padded_vocab": 384, "train": {"1": train, "4": train},
           "decode": {"1": [{"seqs": 1, "step_s": 0.01, "layer_s": 0.001, "layer_comm_s": 0.0}],
                      "4": [{"seqs": 1, "step_s": 0.06, "layer_s": 0.009, "layer_comm_s": 0.008}]},
           "device_name": "cpu-2cores-4ranks", "torch": "x", "dtype": "float32", "omp": "1", "wall_s": 1.0,
           "host_cores": 2}
    prof = build_profile(spec, raw)
    assert prof.host_cores == 2 and prof.host_background_load == 3.5
    assert set(prof.allreduce_latency_s_by_ranks) == {2, 4}
    assert prof.allreduce_latency_s_by_ranks[4] == pytest.approx(0.004 - 1.5 * 1024 * 0.0001 / (1.5 * 3072), rel=1e-3)
    by_tp = prof.decode_step_overhead_s_by_tp
    assert set(by_tp) == {1, 4} and by_tp[4] > by_tp[1] >= 0
    assert validate_profile(json.loads(json.dumps(prof.to_json()))).to_json() == prof.to_json()
