"""Inter-stage switch (PUZZLE §5.1-5.2): executor, shadow model, overlap with the optimizer step.

One 4-rank gloo world (tests/distributed/worlds/switch.py) runs every check."""

import pytest

from tests.harness import run_world

PAIRS = ["(P=4, D=1, T=1)->(P=2, D=1, T=2)", "(P=2, D=1, T=2)->(P=1, D=1, T=4)",
         "(P=1, D=2, T=2)->(P=1, D=1, T=4)", "(P=2, D=2, T=1)->(P=1, D=2, T=2)",
         "(P=2, D=1, T=2)->(P=4, D=1, T=1)", "(P=1, D=1, T=4)->(P=2, D=1, T=2)",
         "(P=1, D=1, T=4)->(P=1, D=2, T=2)", "(P=1, D=2, T=2)->(P=2, D=2, T=1)"]


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/switch.py", 4, timeout=300)


@pytest.mark.parametrize("pair", PAIRS)
def test_shadow_holds_destination_slices_bitwise(world, pair):
    for r, res in enumerate(world):
        c = res["pairs"][pair]
        assert c["bitwise"], (r, pair, c["bad"])


@pytest.mark.parametrize("pair", PAIRS)
def test_bytes_moved_equal_lower_bound(world, pair):
    for r, res in enumerate(world):
        c = res["pairs"][pair]
        assert c["bytes_received"] == c["lacking"], (r, pair, c)
        assert c["bytes_sent"] == c["sent_expected"], (r, pair, c)
    assert sum(res["pairs"][pair]["bytes_received"] for res in world) == \
        sum(res["pairs"][pair]["bytes_sent"] for res in world)


@pytest.mark.parametrize("pair", PAIRS)
def test_shadow_logprobs_match_training_layout(world, pair):
    c = world[0]["pairs"][pair]
    assert c["n_lp"] == 4
    assert c["max_lp_diff"] < 1e-5, c["max_lp_diff"]


def test_release_frees_shadow_parameters(world):
    for r, res in enumerate(world):
        for pair in PAIRS:
            c = res["pairs"][pair]
            assert c["param_bytes_before_release"] > 0, (r, pair)
            assert c["param_bytes_after_release"] == 0 and c["module_gone"], (r, pair)
            assert c["tensors_alive"] == 0, (r, pair)  # freed at release, without a gc pass


def test_critic_value_head_switches(world):
    assert all(res["pairs"]["critic"]["bitwise"] for res in world)


@pytest.mark.parametrize("opt", ["nodo", "do"])
def test_segmented_step_is_bitwise_plain_step_then_switch(world, opt):
    for r, res in enumerate(world):
        c = res["overlap"][opt]
        assert c["changed"], (r, c)
        for k in ("K1", "K8"):
            assert c[f"{k}_train_equal"], (r, k, c)
            assert c[f"{k}_shadow_equal"], (r, k, c)
            assert c[f"{k}_bytes_ok"], (r, k, c)
        assert c["K8_segments"] == 8
        assert c["norms"]["K8"] == c["norms"]["plain"] == c["norms"]["K1"]
        assert c["lp_diff"] < 1e-5


@pytest.mark.parametrize("case,needle", [("world_size", "different ranks"),
                                         ("degrees", "num_layers=6 is not divisible by P=4"),
                                         ("tp_split", "num_query_groups=2 is not divisible by T=4"),
                                         ("not_a_plan", "must be a ParallelPlan")])
def test_bad_plans_raise_before_any_transfer(world, case, needle):
    for res in world:
        c = res["bad_plans"][case]
        assert c["raised"] and needle in c["msg"], c
        assert c["no_layout_built"], c
