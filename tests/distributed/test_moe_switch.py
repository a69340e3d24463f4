"""Mixture-of-experts models between layouts of different E: the switch (bitwise, exactly the
bytes each rank lacks, overlapped with the optimizer step) and the tiny MoE run checkpointed and
resumed at other layouts, generating through it. One 4-rank world (tests/distributed/worlds/moe_switch.py)."""

import pytest

from tests.harness import assert_same_metrics, run_world

#: generation's own log-probs against scoring's: fp32 rounding differs between generation
#: layouts (the same bound as tests/distributed/test_vocab_rows.py's)
LOGPROB_DIFF = ("gen_score_logprob_diff_mean", "gen_score_logprob_diff_max")


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/moe_switch.py", 4)


def test_switch_between_expert_layouts_is_bitwise_and_minimal(world):
    pairs = [r["pairs"] for r in world]
    assert len(pairs[0]) == 5
    for rank, res in enumerate(pairs):
        for name, r in res.items():
            assert r["bitwise"], (rank, name)
            assert r["received"] == r["lacking"], (rank, name, r)
    # every rank lacks experts when E grows or shrinks from a split layout; none from a full replica
    for name, r in pairs[0].items():
        assert (r["lacking"] == 0) == name.startswith("(P=1, D=4, T=1)->"), (name, r)


def test_step_overlapped_with_expert_switch(world):
    for r in world:
        assert r["overlap"] == {"same_shadow": True, "bytes_ok": True}


def test_tiny_moe_run_resumed_at_other_layouts_through_the_switch(world):
    """Saved after iteration 1 with the actor, reference and critic at (1,4,1,E=2); resumed with the
    actor training at (2,2,1,E=2) and generating at (1,4,1,E=1) through the switch, the critic at
    (1,4,1,E=4), the reference at (1,4,1,E=1): iteration 2 samples the straight run's responses and
    rewards exactly, and its losses, gradient norms and load-balancing loss agree up to fp32
    reduction order (other D, other E, other P: the sums group differently)."""
    run = world[0]["tiny_run"]
    assert run["plans"] == {"actor": "(P=2, D=2, T=1, E=2)", "critic": "(P=1, D=4, T=1, E=4)",
                            "ref": "(P=1, D=4, T=1)", "actor_gen": "(P=1, D=4, T=1)"}
    assert run["switch"] and [r["iteration"] for r in run["straight"]] == [1, 2]
    assert [r["iteration"] for r in run["resumed"]] == [2]
    straight, resumed = {2: run["straight"][1]}, {2: run["resumed"][0]}
    sampled = [k for k in straight[2] if k.startswith(("reward", "response_length", "prompts_"))]
    assert len(sampled) >= 4
    assert_same_metrics(resumed, straight, keys=sampled)  # the same samples and rewards, exactly
    assert_same_metrics(resumed, straight, skip=("switch_bytes_max_rank",) + LOGPROB_DIFF, rel=1e-6, abs=1e-7)
    assert resumed[2]["switch_bytes_max_rank"] == run["lower_bound"] > 0
    for row in (straight[2], resumed[2]):
        assert 0 <= row["gen_score_logprob_diff_mean"] <= row["gen_score_logprob_diff_max"] <= 2e-6, row
        assert 0.5 < row["moe_aux_loss"] < 4.0


def test_tiny_moe_run_at_two_expert_layouts_agrees(world):
    """The tiny MoE run's first iteration with every model's experts split over E = 2 ranks and
    whole (E = 1): the same generation, rewards, scores, losses and aux loss, the gradient norms up
    to fp32 reduction order (at E = 2 an expert's gradient sums tokens of other ranks)."""
    run = world[0]["tiny_run"]
    e2, e1 = {1: run["straight"][0]}, {1: run["from_scratch_at_e1"][0]}
    norms = ("actor_grad_norm", "critic_grad_norm")
    assert_same_metrics(e1, e2, skip=norms + LOGPROB_DIFF)
    assert_same_metrics(e1, e2, keys=norms, rel=1e-5)
    for row in (e1[1], e2[1]):
        assert 0 <= row["gen_score_logprob_diff_mean"] <= row["gen_score_logprob_diff_max"] <= 2e-6, row
        assert 0.5 < row["moe_aux_loss"] < 4.0


def test_tiny_moe_run_with_grouped_gemm_experts_agrees(world):
    """--moe-grouped-gemm (every model's experts one grouped GEMM per projection, E = 2): the tiny
    MoE run's two iterations give the straight run's metrics bit for bit (on CPU torch's grouped
    product is one product per group, the one megatron's linear layers make)."""
    run = world[0]["tiny_run"]
    grouped, straight = run["grouped_gemm"], run["straight"]
    assert [r["iteration"] for r in grouped] == [1, 2]
    assert_same_metrics(grouped, straight)


@pytest.mark.parametrize("plan", ["(1,2,2,E=2) ETP=2", "(1,2,2) ETP=1"])
def test_expert_adapters_at_t2_equal_plain_pytorch(world, plan):
    """LoRA on the experts at T = 2: split over ETP = 2 with E = 2, or whole on both tensor-parallel
    ranks (ETP = 1; tests/distributed/worlds/lora_experts.py): zero B changes no log-prob bit; the
    reduced adapter gradients equal a plain PyTorch LoRA's."""
    res = world[0]["lora_experts"]["grads"][plan]
    assert res["equal_bitwise"] and res["names"] and res["replicas_agree"], res
    assert res["expert_adapters"] == 16 and res["min_grad_max"] > 1e-4, res
    assert res["worst_relative_grad_error"] < 1e-5, res


def test_expert_adapters_switch_moves_adapter_bytes_only(world):
    """The LoRA actor (1,2,2,E=2) -> (1,4,1,E=1): the first switch lays the base out, the second
    (overlapped with the step) moves exactly the adapter bytes each rank lacks; the merged copy
    computes the training model's log-probs, and the adapters count."""
    for rank, r in enumerate(x["lora_experts"] for x in world):
        assert r["second_bytes"] == r["adapter_bytes_lacking"] > 0, (rank, r)
        assert r["first_bytes"] > 5 * r["second_bytes"], (rank, r)
        assert r["logprob_diff"] < 1e-5 < 1e-2 < r["base_diff"], (rank, r)


def test_expert_adapters_and_moments_resume_at_another_expert_layout(world):
    """Saved at (1,2,2,E=2) with ETP=2, loaded at (1,2,2) with ETP=1: the same adapters and Adam
    moments, whole."""
    for what, r in world[0]["lora_experts"]["checkpoint"].items():
        assert r["names_agree"] and r["equal"] and r["nonzero"] > 0, (what, r)
