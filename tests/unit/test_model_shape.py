"""ModelShape, the one model-shape type of the planner and the runs, and its KV-cache formula,
which the memory model and --inference-dynamic-batching-buffer-size-gb both use."""

import pytest

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.config import ModelArch
from puzzle.model_shape import ModelShape
from puzzle.parallel.plan import ParallelPlan as PP
from puzzle.plan_search import LLAMA_SHAPES, MemoryModel, ModelRole, PPOWorkload, load_profile
from tests.unit.test_arguments import BASE

MiB = 1 << 20
#: Qwen3-style attention: 128-wide heads, wider than hidden / heads = 64
QWEN3_LIKE = ModelShape(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                        num_query_groups=4, vocab_size=151936, kv_channels=128)

# (shape, tokens, plan, bf16 bytes of one sequence's keys and values on a rank), by hand:
# tokens x 2 (K and V) x groups x head size / T x 2 bytes x layers / P
KV_CASES = [
    (LLAMA_SHAPES["7B"], 1024, PP(1, 1, 1), 1024 * 2 * 32 * 128 * 2 * 32),     # MHA: 512 MiB
    (LLAMA_SHAPES["7B"], 1024, PP(2, 1, 2), 1024 * 2 * 16 * 128 * 2 * 16),     # 128 MiB
    (LLAMA_SHAPES["70B"], 4096, PP(1, 1, 8), 4096 * 2 * 1 * 128 * 2 * 80),     # GQA, 8 groups: 160 MiB
    (QWEN3_LIKE, 2048, PP(1, 2, 2), 2048 * 2 * 2 * 128 * 2 * 48),              # 96 MiB
]


def test_kv_bytes_by_hand():
    assert [c[3] // MiB for c in KV_CASES] == [512, 128, 160, 96]
    for shape, tokens, plan, expected in KV_CASES:
        assert shape.kv_bytes_per_sequence(tokens, plan, 2) == expected, (shape, plan)
    assert QWEN3_LIKE.kv_dim == 512 and LLAMA_SHAPES["70B"].kv_dim == 1024 and LLAMA_SHAPES["7B"].kv_dim == 4096


@pytest.mark.parametrize("shape,tokens,plan,expected", KV_CASES)
def test_the_memory_model_uses_the_shape_formula(shape, tokens, plan, expected):
    workload = PPOWorkload(8, prompt_len=tokens // 2, gen_len=tokens // 2)
    mem = MemoryModel(load_profile("a100_80gb"), workload)
    assert mem.kv_bytes_per_sequence(ModelRole("actor", shape, True, True), plan) == expected


def test_model_arch_shape_is_the_planner_shape():
    arch = ModelArch.llama(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                           num_query_groups=8, vocab_size=128000, make_vocab_size_divisible_by=384)
    assert arch.shape == ModelShape(32, 4096, 14336, 32, 8, 128256, kv_channels=128)
    moe = ModelArch.llama(num_layers=4, hidden_size=64, num_attention_heads=4, num_experts=8, moe_router_topk=2,
                          moe_ffn_hidden_size=32, moe_layer_pattern=(0, 1, 1, 1))
    assert moe.shape == ModelShape(4, 64, 256, 4, 4, 256, num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                                   moe_layers=3, moe_dispatcher="allgather", kv_channels=16)


def test_the_kv_budget_uses_the_shape_formula():
    """--inference-dynamic-batching-buffer-size-gb on a GQA actor (2 layers, 2 groups of 16-wide
    heads, fp32 on CPU): 64 tokens x 2 x 2 x 16 x 4 bytes x 2 layers = 32 KiB a sequence; 2
    sequences per rank of (P=1, D=4, T=1)."""
    per_seq = 64 * 2 * 2 * 16 * 4 * 2
    flags = BASE + ["--group-query-attention", "--num-query-groups", "2", "--max-prompt-length", "48"]

    def rows(gib):
        return validate_args(parse_args(flags + ["--inference-dynamic-batching-buffer-size-gb", str(gib)]),
                             4, 259).ppo.generation_micro_batch_size

    c = validate_args(parse_args(flags), 4, 259)
    assert c.roles["actor"].arch.shape.kv_bytes_per_sequence(64, c.roles["actor"].gen_plan, 4) == per_seq
    assert rows(1.5 * per_seq / (1 << 30)) == 1 and rows(2.5 * per_seq / (1 << 30)) == 2
    with pytest.raises(ArgumentError, match=r"holds no sequence of 64 tokens \(0.00 GiB each\)"):
        rows(0.9 * per_seq / (1 << 30))
