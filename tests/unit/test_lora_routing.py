"""The LoRA adapters' routing tables (pure): the adapters-only switch moves exactly the adapter bytes
each rank lacks, a small fraction of the full switch's."""

import pytest

from puzzle.config import ModelArch
from puzzle.lora_config import LoRAConfig
from puzzle.parallel.plan import ParallelPlan
from puzzle.switch.lora_merge import adapter_bytes, adapter_param_specs
from puzzle.switch.shadow import routing_table_for

ARCH = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=4,
                       vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
LORA = LoRAConfig(dim=4, alpha=8.0)


def test_adapter_specs_split_like_their_linears():
    kinds = {s.name.split(".", 3)[3]: s.kind for s in adapter_param_specs(ARCH, "actor", LORA) if ".layers.0." in s.name}
    assert kinds == {"self_attention.linear_qkv.adapter.linear_in.weight": "replicated",
                     "self_attention.linear_qkv.adapter.linear_out.weight": "qkv",
                     "self_attention.linear_proj.adapter.linear_in.weight": "row",
                     "self_attention.linear_proj.adapter.linear_out.weight": "replicated",
                     "mlp.linear_fc1.adapter.linear_in.weight": "replicated",
                     "mlp.linear_fc1.adapter.linear_out.weight": "swiglu_fc1",
                     "mlp.linear_fc2.adapter.linear_in.weight": "row",
                     "mlp.linear_fc2.adapter.linear_out.weight": "replicated"}


@pytest.mark.parametrize("src, dst", [((1, 2, 2), (1, 1, 4)), ((2, 1, 2), (1, 2, 2)), ((4, 1, 1), (1, 1, 4))])
def test_adapters_only_table_moves_exactly_what_each_rank_lacks(src, dst):
    src, dst = ParallelPlan(*src), ParallelPlan(*dst)
    adapters = routing_table_for(ARCH, "actor", src, dst, lora=LORA, adapters_only=True)
    full = routing_table_for(ARCH, "actor", src, dst, lora=LORA)
    assert {s.name for s in adapters.specs} == {s.name for s in adapter_param_specs(ARCH, "actor", LORA)}
    for rank in range(4):
        assert adapters.bytes_received(rank) == adapters.bytes_lacking(rank) <= adapter_bytes(ARCH, "actor", LORA, 4)
        assert full.bytes_received(rank) == full.bytes_lacking(rank)
    assert 0 < adapters.total_bytes() < full.total_bytes() / 5  # (hidden 64, rank 4: the adapters are 7.5 % of the model)


def test_adapters_only_needs_the_lora_config():
    with pytest.raises(ValueError, match="adapters_only needs the LoRA config"):
        routing_table_for(ARCH, "actor", ParallelPlan(1, 1, 4), ParallelPlan(1, 4, 1), adapters_only=True)


MOE = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=4,
                      vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32, num_experts=4,
                      moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_pattern=(1, 0, 1, 1))
MOE_ALL = ModelArch(**{**vars(MOE), "moe_layer_pattern": None})  # the planner's average layer is exact per stage


@pytest.mark.parametrize("arch, src, dst", [
    (ARCH, (1, 2, 2), (1, 1, 4)), (ARCH, (2, 1, 2), (1, 2, 2)), (ARCH, (4, 1, 1), (1, 1, 4)),
    (MOE, (1, 4, 1, 2), (1, 4, 1, 1)), (MOE, (1, 2, 2, 2), (1, 4, 1, 1)), (MOE_ALL, (2, 2, 1, 2), (1, 4, 1, 4)),
    (MOE_ALL, (1, 2, 2, 2), (2, 2, 1, 2))])
def test_planner_prices_the_adapters_only_switch_at_the_routing_tables_bytes(arch, src, dst):
    """The cost model's switch of a LoRA actor (its base already on the generation ranks): the
    adapter bytes each rank lacks, as the adapters-only routing table moves them; the experts'
    adapters with their experts. (With dense and MoE layers unevenly over the stages the planner
    prices an average layer, as for the whole model's switch.)"""
    from puzzle.plan_search.cost_model import switch_bytes_per_rank

    src, dst = ParallelPlan(*src[:3], E=src[3] if len(src) > 3 else 1), ParallelPlan(*dst[:3], E=dst[3] if len(dst) > 3 else 1)
    table = routing_table_for(arch, "actor", src, dst, dtype_bytes=2, lora=LORA, adapters_only=True)
    priced = switch_bytes_per_rank(arch.shape, src, dst, dtype_bytes=2, adapters_of=(LORA.dim, LORA.target_modules))
    full = switch_bytes_per_rank(arch.shape, src, dst, dtype_bytes=2)
    for rank in range(4):
        assert sum(priced[rank]) == table.bytes_lacking(rank), rank
    assert 0 < max(map(sum, priced.values())) < max(map(sum, full.values())) / 5


def test_cost_model_switch_of_a_lora_actor_moves_adapters():
    from puzzle.plan_search.cost_model import LLAMA_SHAPES, CostModel, ModelRole, PPOWorkload
    from puzzle.plan_search.profile_data import load_profile

    cost = CostModel(load_profile("a100_80gb"), PPOWorkload(rollout_batch_size=64))
    plain = ModelRole("actor", LLAMA_SHAPES["7B"], True, True)
    lora = ModelRole("actor", LLAMA_SHAPES["7B"], True, True, lora=(8, LORA.target_modules))
    src, dst = ParallelPlan(1, 2, 4), ParallelPlan(1, 1, 8)
    (full_bytes, full_s), (lora_bytes, lora_s) = cost.switch(plain, src, dst), cost.switch(lora, src, dst)
    assert 0 < lora_bytes < full_bytes / 100 and lora_s < full_s / 100
