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
