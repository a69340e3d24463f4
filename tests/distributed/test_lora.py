"""LoRA on megatron-core's parallel linears (issue #39), checked in the 4-rank foundation world."""

import pytest

from tests.harness import run_world

PLANS = ("(P=1, D=1, T=1)", "(P=1, D=1, T=2)", "(P=2, D=1, T=2)")


@pytest.fixture(scope="module")
def lora():
    return run_world("distributed/worlds/foundation.py", 4)[0]["lora"]


@pytest.mark.parametrize("plan", PLANS)
def test_zero_b_leaves_logprobs_bitwise_equal(lora, plan):
    assert lora[plan]["equal_bitwise"]


@pytest.mark.parametrize("plan", PLANS)
def test_adapted_layers_skip_the_lean_decode_step(lora, plan):
    for plain, adapted in lora[plan]["lean_decode_plain_lora"]:
        assert plain and all(plain) and not any(adapted), (plain, adapted)


@pytest.mark.parametrize("plan", PLANS)
def test_adapter_grads_equal_plain_pytorch_lora(lora, plan):
    res = lora[plan]
    assert res["names"], "the adapters' global names differ from the reference's"
    assert res["replicas_agree"], "TP replicas of an unsplit adapter differ"
    assert res["min_grad_max"] > 1e-4, "a reference gradient is zero: the check would pass vacuously"
    assert res["worst_relative_grad_error"] < 1e-5, res


def test_base_frozen_and_optimizer_holds_adapters_only(lora):
    for rank, step in enumerate(lora["optimizer_step"]):
        assert step["frozen_base"] and step["base_unchanged"], (rank, step)
        assert step["optimizer_numel"] == step["ddp_grad_numel"] == step["adapter_numel"] > 0, (rank, step)
        # B starts at zero, so A's first gradient is zero and only the Bs move
        assert step["adapters_moved"] == step["adapters"] // 2 > 0, (rank, step)


def test_the_reference_is_the_actor_with_its_adapters_off(lora):
    res = lora["reference_is_base"]
    assert res["jobs"] == ["actor", "ref"], res  # a reference job, run on the actor: no reference engine
    assert res["ref_equals_base"] and res["actor_differs"], res


def test_adapters_and_their_optimizer_state_resume_at_another_layout(lora):
    for what, res in lora["checkpoint"].items():  # saved at (2,1,2), loaded at (1,4,1)
        assert res["names_agree"] and res["equal"], (what, res)
    assert lora["checkpoint"]["exp_avg"]["nonzero"] > 0  # the moments hold something to compare


@pytest.fixture(scope="module")
def export():
    return run_world("distributed/worlds/tiny_runs.py", 1)[0]["lora_export"]


def test_exported_adapter_gives_puzzles_greedy_tokens_in_peft(export):
    assert "missing" not in export, export["missing"]  # peft is the test extra's: without it this fails
    assert export["peft"] == export["ours"], export  # the PEFT adapter directory on the HF base
    assert export["merged"] == export["ours"], export  # --merge-lora: the merged HF model
    assert export["base"] != export["ours"], export  # the adapters change the tokens: the check has teeth
    assert export["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])


@pytest.fixture(scope="module")
def lora_switch():
    return run_world("distributed/worlds/foundation.py", 4)


def _split_adapter_bytes_lacking():
    """Analytic: from (1,2,2) to (1,4,1) each generation rank lacks the other half of every split adapter
    (B of linear_qkv and linear_fc1, A of linear_proj and linear_fc2), fp32."""
    from puzzle.lora_config import target_shapes
    from tests.distributed.worlds.foundation import LORA, LORA_ARCH

    shapes = target_shapes(LORA_ARCH)
    per_layer = sum(shapes[t][0] for t in ("linear_qkv", "linear_fc1")) + sum(shapes[t][1] for t in ("linear_proj", "linear_fc2"))
    return LORA_ARCH.num_layers * per_layer * LORA.dim // 2 * 4


def test_lora_switch_moves_only_adapter_bytes_after_the_first(lora_switch):
    members = [r["lora_switch"] for r in lora_switch if r["lora_switch"]["member"]]
    assert len(members) == 4
    lacking = _split_adapter_bytes_lacking()
    for res in members:
        assert res["second_bytes"] == lacking > 0, (res, lacking)
        assert res["first_bytes"] > 5 * lacking, res  # the first switch laid the base out too


def test_lora_generation_copy_matches_the_training_model(lora_switch):
    for res in (r["lora_switch"] for r in lora_switch if r["lora_switch"]["member"]):
        assert res["tokens_equal"], res
        assert res["logprob_diff"] < 1e-4 < 1e-2 < res["base_logprob_diff"], res  # the adapters count
        assert res["base_restored"], res


@pytest.fixture(scope="module")
def lora_critic():
    return run_world("distributed/worlds/tiny_runs.py", 1)[0]["lora_critic"]


def test_lora_critic_equals_plain_pytorch_and_trains_its_head_whole(lora_critic):
    """--critic-lora-*: zero B leaves the values bitwise; the adapters' and the value head's gradients
    equal a plain PyTorch LoRA's; the optimizer holds those only; a step moves them and no base weight."""
    res = lora_critic
    assert res["equal_bitwise"] and res["trained"], res
    assert res["min_grad_max"] > 1e-4 and res["worst_relative_grad_error"] < 1e-5, res
    assert res["optimizer_numel"] == res["trained_numel"] > 0, res
    assert res["base_frozen"] and res["base_unchanged"] and res["head_moved"], res
    assert res["adapters_moved"] == res["adapters"] > 0, res
