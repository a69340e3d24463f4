"""Pure parts of fast generation: attention-backend choice, CUDA-graph buckets, length buckets."""

import pytest
import torch

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.models.attention_backend import resolve_attention_backend
from puzzle.rollout.cuda_graphs import DecodeGraphs, bucket_for, graph_buckets, graph_width
from puzzle.rollout.generation import service_order
from tests.unit.test_arguments import BASE


def test_attention_backend_choice():
    # auto: TE when present, SDPA on CUDA, megatron's unfused on CPU
    assert resolve_attention_backend("auto", te=True, cuda=True) == ("te", "auto")
    assert resolve_attention_backend("auto", te=False, cuda=True) == ("sdpa", None)
    assert resolve_attention_backend("auto", te=False, cuda=False) == ("unfused", None)
    assert resolve_attention_backend("local", te=True, cuda=True) == ("sdpa", None)
    assert resolve_attention_backend("local", te=False, cuda=False) == ("sdpa", None)
    assert resolve_attention_backend("unfused", te=False, cuda=True) == ("unfused", None)
    for kind in ("flash", "fused", "unfused"):
        assert resolve_attention_backend(kind, te=True, cuda=True) == ("te", kind)
    for kind in ("flash", "fused"):
        with pytest.raises(ValueError, match=f"--attention-backend {kind} needs transformer-engine"):
            resolve_attention_backend(kind, te=False, cuda=True)
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        resolve_attention_backend("sdpa", te=False, cuda=False)


def test_graph_buckets_cover_every_batch():
    for top in (1, 3, 8, 20, 64, 100, 256):
        b = graph_buckets(top)
        assert b == sorted(set(b)) and b[-1] == top and b[0] == 1
        for n in range(1, top + 1):
            N = bucket_for(n, b)
            assert n <= N <= top and N in b
            assert not any(n <= x < N for x in b)  # the smallest one
    assert graph_buckets(256)[:11] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(256)[11:] == [96, 128, 160, 192, 224, 256]
    with pytest.raises(ValueError, match="no CUDA-graph bucket"):
        bucket_for(9, graph_buckets(8))
    with pytest.raises(ValueError):
        graph_buckets(0)
    assert [graph_width(w) for w in (1, 64, 65, 130)] == [64, 64, 128, 192]


def test_cuda_graphs_refused_off_cuda():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="--cuda-graph-generation needs a CUDA device"):
        DecodeGraphs.for_model(model, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="P=1"):
        DecodeGraphs.for_model(model, 2, torch.device("cuda"))
    model._puzzle_decode_graphs = DecodeGraphs(torch.device("cpu"), capture=False)
    assert DecodeGraphs.for_model(model, 1, torch.device("cpu")) is model._puzzle_decode_graphs


def test_service_order_is_length_buckets():
    prompts = [[1] * 3, [1] * 7, [1] * 3, [1], [1] * 7, [1] * 5]
    assert service_order(prompts) == [1, 4, 5, 0, 2, 3]  # longest first, ties in row order


def test_flags():
    c = validate_args(parse_args(BASE + ["--attention-backend", "local"]), 4, 259)
    assert all(r.arch.attention_backend == "local" for r in c.roles.values())
    assert not c.ppo.cuda_graph_generation
    if not torch.cuda.is_available():
        with pytest.raises(ArgumentError, match="^--cuda-graph-generation: needs a CUDA device"):
            validate_args(parse_args(BASE + ["--cuda-graph-generation"]), 4, 259)
        with pytest.raises(ArgumentError, match="^--attention-backend flash needs transformer-engine"):
            validate_args(parse_args(BASE + ["--attention-backend", "flash"]), 4, 259)
    with pytest.raises(Exception, match="--attention-backend: invalid choice: 'sdpa'"):
        parse_args(BASE + ["--attention-backend", "sdpa"])


def _config_or_error(argv):
    try:
        return validate_args(parse_args(BASE + argv), 4, 259)
    except ArgumentError as e:
        return str(e)


def test_use_flash_attn_is_attention_backend_flash():
    """Megatron-LM's older flag: the same configuration on a machine with TE, the same error without."""
    assert _config_or_error(["--use-flash-attn"]) == _config_or_error(["--attention-backend", "flash"])
    assert _config_or_error(["--use-flash-attn", "--attention-backend", "flash"]) == \
        _config_or_error(["--attention-backend", "flash"])
    assert _config_or_error(["--use-flash-attn", "--attention-backend", "local"]).startswith(
        "--use-flash-attn/--attention-backend: --use-flash-attn means --attention-backend flash")


def test_cost_model_follows_the_decode_loop():
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.plan_search import LLAMA_SHAPES, load_profile
    from puzzle.plan_search.cost_model import CostModel, PPOWorkload, ppo_roles
    from puzzle.plan_search.profile_data import layer_params

    prof = load_profile("a100_80gb")
    actor = ppo_roles(LLAMA_SHAPES["7B"], LLAMA_SHAPES["350M"])["actor"]

    def gen(plan=ParallelPlan(1, 8, 1), **kw):
        return CostModel(prof, PPOWorkload(128, prompt_len=256, gen_len=256, **kw)).generation_cost(actor, plan)

    full, waves = gen(), gen(generation_micro_batch_size=4)  # 16 prompts per rank: 4 cache waves
    one_wave = CostModel(prof, PPOWorkload(32, prompt_len=256, gen_len=256)).generation_cost(actor, ParallelPlan(1, 8, 1))
    assert waves.total == pytest.approx(4 * one_wave.total)  # 4 prompts per rank, one wave
    assert waves.extra == pytest.approx(4 * one_wave.extra)  # one prefill per wave
    assert full.total < waves.total
    graphs = gen(cuda_graphs=True)
    assert graphs.total < full.total
    split, repl = layer_params(LLAMA_SHAPES["7B"])
    assert graphs.t_stage >= LLAMA_SHAPES["7B"].num_layers * prof.hbm_time((split + repl) * 2)
    # P > 1: micro-batches of the given size (length buckets), default min(P, b)
    pp = ParallelPlan(2, 4, 1)
    assert gen(pp).n_micro == 2 and gen(pp, generation_micro_batch_size=8).n_micro == 4
