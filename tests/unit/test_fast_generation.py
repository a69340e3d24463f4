"""Pure parts of fast generation: attention-backend choice, CUDA-graph buckets, length buckets,
the KV cache's packed writes and RoPE."""

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
    from puzzle.model_shape import layer_params

    import dataclasses

    # a graphed step at its bound (the bundled profile carries an H100's measured fraction of it)
    prof = dataclasses.replace(load_profile("a100_80gb"), graph_decode_efficiency=1.0, layers={})
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


def test_graph_decode_efficiency_scales_graphed_steps_only():
    """A profile's measured fraction of the decode bound slows graph-replayed steps by its inverse
    (weights and KV cache alike) and leaves eager steps and the prefill alone; it round-trips
    through the JSON, is optional, and must lie in (0, 1]."""
    import dataclasses
    import json

    from puzzle.parallel.plan import ParallelPlan
    from puzzle.plan_search import LLAMA_SHAPES, ProfileError, load_profile, validate_profile
    from puzzle.plan_search.cost_model import CostModel, PPOWorkload, ppo_roles
    from puzzle.model_shape import layer_params

    bundled = load_profile("a100_80gb")
    assert 0 < bundled.graph_decode_efficiency < 1  # the H100 figure it carries
    prof = dataclasses.replace(bundled, graph_decode_efficiency=1.0, layers={})
    slow = dataclasses.replace(prof, graph_decode_efficiency=0.25, layers={})
    actor = ppo_roles(LLAMA_SHAPES["7B"], LLAMA_SHAPES["350M"])["actor"]

    def gen(p, **kw):
        return CostModel(p, PPOWorkload(128, prompt_len=256, gen_len=256, **kw)).generation_cost(actor,
                                                                                               ParallelPlan(1, 8, 1))

    half = dataclasses.replace(prof, graph_decode_efficiency=0.5, layers={})
    g1, g2, g4 = (gen(p, cuda_graphs=True) for p in (prof, half, slow))
    assert g4.extra == pytest.approx(g1.extra)  # prefill unchanged
    # the bound part of a step grows as 1 / efficiency: (1/0.25 - 1) = 3 x (1/0.5 - 1)
    split, repl = layer_params(LLAMA_SHAPES["7B"])
    assert g2.t_stage - g1.t_stage >= LLAMA_SHAPES["7B"].num_layers * prof.hbm_time((split + repl) * 2)
    assert g4.t_stage - g1.t_stage == pytest.approx(3 * (g2.t_stage - g1.t_stage))
    assert gen(slow).total == pytest.approx(gen(prof).total)  # eager steps: the profiled table
    doc = json.loads(json.dumps(slow.to_json()))
    assert doc["hardware"]["graph_decode_efficiency"] == 0.25
    assert validate_profile(doc).graph_decode_efficiency == 0.25
    assert "graph_decode_efficiency" not in prof.to_json()["hardware"]  # default 1.0, not written
    assert validate_profile(json.loads(json.dumps(prof.to_json()))).graph_decode_efficiency == 1.0
    for bad in (0, 1.5):
        doc["hardware"]["graph_decode_efficiency"] = bad
        with pytest.raises(ProfileError, match="graph_decode_efficiency must be in"):
            validate_profile(doc)


def test_kv_cache_rope_is_megatrons_bit_for_bit():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from puzzle.models.sdpa_attention import StaticKVCache

    g = torch.Generator().manual_seed(0)
    freqs = torch.rand(6, 1, 1, 16, generator=g) * 10
    t = torch.randn(6, 3, 4, 16, generator=g)
    cache = StaticKVCache(1, 8)
    cache.set_rope(torch.cos(freqs) * 1.0, torch.sin(freqs) * 1.0)  # as generation's hooks
    assert torch.equal(cache._rotate(t), _apply_rotary_pos_emb_bshd(t, freqs))
    strided = torch.randn(6, 3, 4, 40, generator=g)[..., 8:24]  # a view, as split q/k are
    assert torch.equal(cache._rotate(strided), _apply_rotary_pos_emb_bshd(strided, freqs))


def test_packed_prefill_and_decode_write_each_slots_positions():
    from puzzle.models.sdpa_attention import StaticKVCache, sdpa_attention

    g, d, heads = 2, 4, 4
    cache = StaticKVCache(3, 6)
    cache.prefill([2, 0], [3, 1])  # prompt 0 -> slot 2, prompt 1 -> slot 0
    assert cache.segments == [(0, 3), (3, 1)] and cache.pos.tolist() == [0, 1, 2, 0]
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(4, 1, g, d, generator=gen)
    val = torch.randn(4, 1, g, d, generator=gen)
    query = torch.randn(4, 1, heads, d, generator=gen)
    q, k, v = cache.store(1, query, key, val)
    assert q is query and k is key and v is val  # prefill attends to its own keys
    kb, vb = cache.buffers[1]
    assert torch.equal(kb[2, :, :3], key[:3, 0].transpose(0, 1))
    assert torch.equal(kb[0, :, :1], key[3:, 0].transpose(0, 1))
    assert torch.equal(vb[2, :, :3], val[:3, 0].transpose(0, 1))
    assert not kb[1].any() and not kb[2, :, 3:].any() and not kb[0, :, 1:].any()
    # each packed prompt attends causally over its own keys only
    packed = cache.prefill_attention(lambda a, b, c: sdpa_attention(a, b, c, None, True, 0.5),
                                      query, key, val)
    block = torch.ones(4, 4, dtype=torch.bool)
    block[:3, :3] = torch.ones(3, 3, dtype=torch.bool).triu(1)
    block[3, 3] = False
    ref = sdpa_attention(query, key, val, block[None, None], False, 0.5)
    assert packed.shape == (4, 1, heads * d) and torch.allclose(packed, ref, atol=1e-6)
    batched = StaticKVCache(3, 6)  # one call over the prompts padded to the longest (CUDA's way)
    batched.batch_prefill = True
    batched.prefill([2, 0], [3, 1])
    out = batched.prefill_attention(lambda a, b, c: sdpa_attention(a, b, c, None, True, 0.5),
                                    query, key, val)
    assert out.shape == packed.shape and torch.allclose(out, ref, atol=1e-6)
    # decode: slots 0..2 write one token each at their own positions, earlier keys kept
    pos = torch.tensor([1, 0, 3])
    cache.decode(3, pos, 4)
    k1, v1 = torch.randn(1, 3, g, d, generator=gen), torch.randn(1, 3, g, d, generator=gen)
    _, kd, vd = cache.store(1, torch.randn(1, 3, heads, d, generator=gen), k1, v1)
    for slot, p in enumerate(pos.tolist()):
        assert torch.equal(kb[slot, :, p], k1[0, slot]) and torch.equal(vb[slot, :, p], v1[0, slot])
    assert torch.equal(kb[2, :, :3], key[:3, 0].transpose(0, 1))
    assert torch.equal(kb[0, :, 0], key[3, 0])
    assert kd.shape == (3, g, 4, d) and cache.masked[:, 0, 0].tolist() == [
        [False, False, True, True], [False, True, True, True], [False, False, False, False]]


def test_host_sync_guard_refuses_what_graph_capture_cannot_record():
    from puzzle.rollout.cuda_graphs import HostSyncError, HostSyncGuard

    x = torch.arange(6.0).view(2, 3)
    syncs = {"item": lambda: x[0, 0].item(), "tolist": lambda: x.tolist(), "cpu": lambda: x.cpu(),
             "nonzero": lambda: x.nonzero(), "torch.nonzero": lambda: torch.nonzero(x),
             "bool": lambda: bool(x[0, 1]), "int": lambda: int(x[0, 1]), "equal": lambda: torch.equal(x, x),
             "masked_select": lambda: x.masked_select(x > 2), "mask_index": lambda: x[x > 2],
             "mask_write_rows": lambda: x.clone().__setitem__(x > 2, torch.ones(3)),
             "unique": lambda: torch.unique(x),
             "repeat_by_tensor": lambda: x.repeat_interleave(torch.tensor([1, 2]), 0)}
    for name, op in syncs.items():
        with HostSyncGuard(), pytest.raises(HostSyncError, match="in a CUDA-graph decode step"):
            op()
    with HostSyncGuard():  # static shapes, nothing read on the host
        y = x.clone()
        y[x > 2] = 0.0  # index_put_ of one scalar: masked_fill_
        probs, idx = torch.topk(torch.softmax(x, -1), 2)
        dense = torch.zeros_like(x).scatter(1, idx, probs)
        z = torch.where(x > 2, x, dense) @ torch.ones(3, 2) + x[torch.tensor([1, 0])][:, :2]
        r = x.repeat_interleave(2, 0)
    assert y.sum() == 3 and z.shape == (2, 2) and r.shape == (4, 3)


MOE_FLAGS = ["--num-experts", "4", "--cuda-graph-generation"]


@pytest.mark.parametrize("extra, gen_layout", [
    ([], (1, 1)),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], (1, 1)),
    (["--tensor-model-parallel-size", "2", "--actor-gen-expert-tensor-parallel-size", "1"], (1, 1)),
    (["--expert-model-parallel-size", "2", "--actor-gen-expert-model-parallel-size", "1"], (1, 1)),
    (["--tensor-model-parallel-size", "2"], "E=1, ETP=2"),
    (["--expert-model-parallel-size", "2"], "E=2, ETP=1"),
])
def test_moe_cuda_graph_generation_needs_whole_experts(monkeypatch, extra, gen_layout):
    """A MoE actor's graphed decode runs every expert on every row: its generation layout must
    hold every expert whole (E=1, ETP=1); training layouts may split them."""
    from puzzle.parallel import device

    monkeypatch.setattr(device, "accelerator_available", lambda: True)
    argv = BASE + MOE_FLAGS + extra
    if isinstance(gen_layout, str):
        with pytest.raises(ArgumentError, match=f"^--cuda-graph-generation: a MoE actor's graphed decode step "
                                                f"needs every expert whole .* has {gen_layout}; .*"
                                                f"--actor-gen-expert-model-parallel-size 1"):
            validate_args(parse_args(argv), 4, 259)
        return
    c = validate_args(parse_args(argv), 4, 259)
    gen = c.roles["actor"].gen_plan
    assert c.ppo.cuda_graph_generation and (gen.E, gen.ETP) == gen_layout
