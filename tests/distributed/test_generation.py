import pytest

from tests.harness import run_world

MAX_NEW = 8
PROMPT_LENS = [5, 2, 7, 3]


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/generation.py", 4)


def _combined(entries, name):
    """Rows of the whole batch from per-rank entries; asserts all ranks of a DP group agree."""
    by_d = {}
    for e in entries:
        if e is None:
            continue
        out = e[name]
        if out["d"] in by_d:
            assert out["tokens"] == by_d[out["d"]]["tokens"], (name, out["p"], out["t"])
            assert out["response_lengths"] == by_d[out["d"]]["response_lengths"]
        else:
            by_d[out["d"]] = out
    rows = []
    for d in sorted(by_d):
        rows.extend(by_d[d]["responses"])
    return rows


def test_kv_cache_greedy_equals_no_cache_reference(world):
    ref = world[0]["reference"]
    assert ref["alone"]["greedy"] == ref["refs"]
    base = _combined(world[0]["layouts"]["(P=1, D=1, T=1)"], "greedy")
    assert base == ref["refs"]  # batched, left-padded prompts: same as each prompt alone


def test_left_padding_equals_each_prompt_alone(world):
    ref = world[0]["reference"]
    for name, alone in ref["alone"].items():
        assert _combined(world[0]["layouts"]["(P=1, D=1, T=1)"], name) == alone, name


def test_same_tokens_at_every_layout(world):
    layouts = world[0]["layouts"]
    base = {name: _combined(layouts["(P=1, D=1, T=1)"], name)
            for name in ("greedy", "t07_k20_p09", "t13_p08", "plain")}
    assert base["t07_k20_p09"] != base["greedy"]  # sampling does sample
    for plan, entries in layouts.items():
        assert any(e is not None for e in entries), plan
        for name, rows in base.items():
            assert _combined(entries, name) == rows, (plan, name)


def test_output_in_response_coordinates(world):
    out = next(e for e in world[0]["layouts"]["(P=1, D=1, T=1)"] if e)["plain"]
    assert out["prompt_lengths"] == PROMPT_LENS
    for row, n, resp in zip(out["tokens"], out["response_lengths"], out["responses"]):
        assert len(row) == MAX_NEW and n == MAX_NEW  # no EOS: every response runs to the budget
        assert row[:n] == resp and all(0 <= t < 200 for t in row)


def test_eos_stops_rows_and_masks(world):
    res = world[0]["eos_and_limits"]
    base, eos = res["base"], res["eos"]
    expected_len = [r.index(eos) + 1 if eos in r else MAX_NEW for r in base]
    assert expected_len[0] <= 3
    for plan in ("(P=1, D=1, T=1)", "(P=2, D=1, T=2)", "(P=1, D=2, T=2)"):
        entries = res[plan]
        rows = _combined(entries, "eos")
        assert rows == [r[:n] for r, n in zip(base, expected_len)], plan
        for e in entries:
            if e is None:
                continue
            out = e["eos"]
            for row, n in zip(out["tokens"], out["response_lengths"]):
                assert len(row) == MAX_NEW
                assert row[n:] == [3] * (MAX_NEW - n)  # pad_id=3 after EOS
                assert row[n - 1] == eos or n == MAX_NEW
            # the whole batch finished at its first token: one model call, not MAX_NEW
            one = e["all_done"]
            assert one["response_lengths"] == [1] and one["forward_passes"] == 1, plan


def test_max_new_tokens_respected(world):
    res = world[0]["eos_and_limits"]
    for plan in ("(P=1, D=1, T=1)", "(P=2, D=1, T=2)", "(P=1, D=2, T=2)"):
        for e in res[plan]:
            if e is None:
                continue
            short = e["short"]
            assert all(len(r) == 1 for r in short["tokens"])
            assert short["response_lengths"] == [1] * len(short["tokens"])
        rows = _combined(res[plan], "short")
        assert rows == [r[:1] for r in res["base"]]
    for e in world[0]["layouts"]["(P=2, D=1, T=2)"]:
        assert e["greedy"]["response_lengths"] == [MAX_NEW] * 4


def test_invalid_arguments_raise_value_errors(world):
    msgs = world[0]["errors"]
    assert "non-empty" in msgs["empty_prompt"]
    assert "outside [0, 200)" in msgs["bad_token"]
    assert "max_position_embeddings" in msgs["too_long"]
    assert "eos_id" in msgs["bad_eos"]
    assert "leaves nothing of max_new_tokens=2" in msgs["partial_full"]
    assert "holds a stop id" in msgs["partial_stop_id"]
    assert "1 partial tokens but 0 log-probs" in msgs["partial_logprobs"]
    assert "distinct" in msgs["sample_ids"]
    assert "groups_needed must be an int in [1, 1]" in msgs["quota"]


def test_continuous_batching_same_tokens_fewer_calls(world):
    res = world[0]["fast_loop"]
    cont = res["continuous"]
    for name, rows in {**res["base"], "greedy_eos": res["greedy_eos"], "t07_eos": res["t07_eos"]}.items():
        for mbs in (1, 3):
            assert cont[f"{name}/mbs{mbs}"]["responses"] == rows, (name, mbs)
    # one cache row: each prompt costs its prefill + one call per further token, nothing more
    for name in ("greedy_eos", "t07_eos"):
        lens = [len(r) for r in res[name]]
        assert cont[f"{name}/mbs1"]["forward_passes"] == sum(lens), name
    assert len({len(r) for r in res["greedy_eos"]}) > 1  # the rows did stop at different steps
    # three cache rows, refilled as rows finish, against micro-batches of 3 rows run to their
    # longest row (1 prefill + longest - 1 decode calls each)
    lens = [len(r) for r in res["greedy_eos"]]
    fixed = sum(max(lens[i:i + 3]) for i in range(0, len(lens), 3))
    assert cont["greedy_eos/mbs3"]["forward_passes"] < fixed


def test_sdpa_backend_same_tokens_at_every_layout(world):
    res = world[0]["fast_loop"]
    base = {name: rows[:6] for name, rows in res["base"].items()}
    for key, entries in res["sdpa"].items():
        for name, rows in base.items():
            assert _combined(entries, name) == rows, (key, name)


def test_graph_decode_step_same_tokens(world):
    res = world[0]["fast_loop"]
    st = res["static_decode"]
    assert st["width"] == 64  # longest prompt 8 + 8 new tokens, rounded up to 64
    for name in ("greedy", "t07_k20_p09"):
        assert st[name] == [res["base"][name]] * 3, name
    for name in ("greedy_eos", "t07_eos"):  # rows finish at different steps
        assert st[name] == [res[name]] * 3, name
    assert st["whole_step_settings"] == 4


def test_sdpa_module_matches_unfused_attention(world):
    m = world[0]["fast_loop"]["module"]
    assert m["causal_max_diff"] < 1e-5 and m["padded_max_diff"] < 1e-5, m
    assert m["padded_finite"] and m["grad_names_equal"]
    assert m["grad_max_rel_diff"] < 1e-4, m


def test_lean_decode_step_is_megatrons_forward_bit_for_bit(world):
    seen = {}
    for rank in world:
        seen.update(rank["lean_decode"])
    for plan in ("(P=1, D=1, T=1)", "(P=1, D=1, T=2)"):
        for name in ("llama_gqa", "qkv_bias_qk_norm_tied", "layernorm_gelu_bias_learned_pos"):
            for backend in ("local", "unfused"):
                r = seen[f"{plan}/{name}/{backend}"]
                assert r["layers"] == 2 and r["calls"] > 3, r  # prefills and decode steps
                assert r["lean_used"] == [True, True], (plan, name, backend, r)
                assert r["logits_equal"] and r["tokens_equal"], (plan, name, backend, r)


def test_moe_graph_decode_step_is_megatrons_moe_forward(world):
    """MoE models through the CUDA-graph decode without capture (HostSyncGuard on every step):
    eager generation's tokens; megatron's MoE forward's logits, bitwise when a matrix product's
    rows do not depend on how many rows it multiplies (fp32 GEMM kernels round a row differently
    at another row count: a few 1e-8 here)."""
    seen = {}
    for rank in world:
        seen.update(rank["moe_static_decode"])
    t2, t1 = seen["T2_ETP1"], seen["T1_dense_layer"]
    assert t2["tokens_equal"] == {"greedy/whole_step": True}, t2
    assert t1["tokens_equal"] == {"greedy/whole_step": True, "t07_k20_p09/bucketed": True}, t1
    assert t2["moe_and_lean"] == [[True, True], [True, True]]
    assert t1["moe_and_lean"] == [[True, True], [False, True]]  # the second layer is dense
    assert t1["row_by_row_logits_equal"] and t2["row_by_row_logits_equal"]
    assert t1["calls"] > 8 and 0 <= t1["max_logit_diff"] < 1e-6, t1
    assert seen["expert_parallel_refused"].startswith(
        "--cuda-graph-generation: MoE layer decoder.layers.0: experts split over E=2 expert-parallel ranks")


def test_partial_rollouts_stop_at_group_quota_and_resume(world):
    """A quota of 1 whole group (groups of 2 rows, 4 cache rows):
    generation stops early; finished rows are the unstopped run's, bit for bit; unfinished rows
    are a prefix of it (some with tokens, some never started); resumed with the same weights,
    seed and sample indices they end as the unstopped run's responses, log-probs bit for bit in
    batch-invariant mode (greedy and temperature 1), within float rounding without it."""
    res = world[0]["partial_rollouts"]
    for key in ("greedy/invariant", "greedy/default", "plain/invariant"):
        r = res[key]
        assert all(r["full_finished"]), key  # no quota: every row finishes
        fin = r["finished"]
        assert any(fin) and not all(fin), (key, fin)
        assert r["forward_passes"][0] < r["forward_passes"][1], (key, r["forward_passes"])
        assert r["finished_rows_equal"] and r["unfinished_prefix"], (key, r)
        complete = [g for g in range(len(fin) // 2) if fin[2 * g] and fin[2 * g + 1]]
        assert complete, (key, fin)  # the quota: a whole group
        left = [i for i, f in enumerate(fin) if not f]
        assert all(r["lengths"][i] < r["full_lengths"][i] for i in left), (key, r)
        assert r["resumed_finished"] == [True] * len(left)
        assert r["resumed_tokens_equal"] == [True] * len(left), (key, r)
        if key.endswith("invariant"):
            assert r["resumed_logprobs_equal"] and r["resumed_logprob_max_diff"] == 0.0, (key, r)
        else:
            assert r["resumed_logprob_max_diff"] < 1e-5, (key, r)
    lengths = res["plain/invariant"]["lengths"] + res["greedy/invariant"]["lengths"]
    partly = [i for i, f in enumerate(res["plain/invariant"]["finished"] + res["greedy/invariant"]["finished"])
              if not f and lengths[i] > 0]
    assert partly  # some rows resumed from tokens of their own, not from the prompt alone
    assert "P=1 only" in res["pipelined_refused"]
    # resume through 2 pipeline stages: the uninterrupted run's tokens; the kept log-probs as given
    pipe = res["pipelined_resume"]
    assert pipe["tokens_equal"] and pipe["kept_logprobs_equal"], pipe
    assert pipe["logprob_max_diff"] < 1e-5, pipe


def test_multi_turn_at_t2_inserts_the_broadcast_observations_on_every_tp_rank(world):
    res = world[0]["multi_turn"]
    ref = res["reference"]
    assert ref["counts"]["turns"] > 4 and ref["counts"]["observation_tokens"] > 0
    for r in res["t2"]:  # two replicas (D=2) of 2 prompts each, both TP ranks
        rows = slice(2 * r["d"], 2 * r["d"] + 2)
        assert r["tokens"] == ref["tokens"][rows] and r["mask"] == ref["mask"][rows], r
        assert r["calls"] == (r["counts"]["turns"] if r["t"] == 0 else 0)  # only TP rank 0 steps
