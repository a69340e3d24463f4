"""Mixture-of-experts models (pure parts): HF Qwen3-MoE / Mixtral config.json <-> ModelArch, the
parameter table, the HF mapping of routers and experts, and the refusals."""

import pytest
import torch

from puzzle.config import ModelArch
from puzzle.config_flags import ArgumentError
from puzzle.models.hf_mapping import (UnsupportedHFModel, arch_from_hf_config, hf_config_from_arch, hf_entries,
                                      hf_shapes, hf_to_ours, ours_to_hf)
from puzzle.models.init import param_specs
from puzzle.models.param_layout import check_tp_split

BASE = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
        "vocab_size": 200, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False}
QWEN3_MOE = dict(BASE, model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                 head_dim=16)
MIXTRAL = dict(BASE, model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)


def _arch(cfg, **kw):
    return arch_from_hf_config(dict(cfg, **kw), make_vocab_size_divisible_by=64)


def test_qwen3_moe_config():
    a = _arch(QWEN3_MOE)
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.ffn_hidden_size) == (4, 2, 32, 96)
    assert a.moe_layer_pattern == (1, 0, 1) and not a.moe_router_pre_softmax and a.qk_layernorm
    assert [a.is_moe_layer(i) for i in range(3)] == [True, False, True]
    # norm_topk_prob false: the top-k of the softmax over all experts (megatron's pre-softmax)
    assert _arch(QWEN3_MOE, norm_topk_prob=False).moe_router_pre_softmax
    # decoder_sparse_step 2: layers 1, 3, ... are sparse (HF: (i + 1) % step == 0)
    assert _arch(QWEN3_MOE, decoder_sparse_step=2, mlp_only_layers=[]).moe_layer_pattern == (0, 1, 0)
    assert _arch(QWEN3_MOE, mlp_only_layers=[]).moe_layer_pattern is None  # every layer sparse


def test_mixtral_config():
    a = _arch(MIXTRAL)
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.ffn_hidden_size) == (4, 2, 48, 48)
    assert a.moe_layer_pattern is None and not a.moe_router_pre_softmax and not a.qk_layernorm


@pytest.mark.parametrize("cfg", [QWEN3_MOE, MIXTRAL, dict(QWEN3_MOE, norm_topk_prob=False, mlp_only_layers=[])])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_config_round_trip(cfg, role):
    a = _arch(cfg)
    back = arch_from_hf_config(hf_config_from_arch(a, role), make_vocab_size_divisible_by=64)
    assert back == a
    assert hf_config_from_arch(a, role)["architectures"][0].endswith(
        "ForCausalLM" if role == "actor" else "ForSequenceClassification")


@pytest.mark.parametrize("change, needle", [
    ({"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size=64 \(shared experts"),
    ({"n_shared_experts": 1}, "n_shared_experts=1"),
    ({"kv_lora_rank": 16}, r"kv_lora_rank=16 \(multi-latent attention"),
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"num_experts_per_tok": None}, "needs num_experts"),
    ({"mlp_only_layers": [0, 1, 2]}, "leave no MoE layer"),
])
def test_unsupported_moe_fields_are_named(change, needle):
    with pytest.raises(UnsupportedHFModel, match=needle) as e:
        arch_from_hf_config(dict(QWEN3_MOE, **change), source="/ckpt/m/config.json")
    assert "/ckpt/m/config.json" in str(e.value)


def test_dense_family_with_experts_is_refused():
    with pytest.raises(UnsupportedHFModel, match="num_local_experts=8 .*supported: mixtral, qwen3_moe"):
        arch_from_hf_config(dict(BASE, model_type="llama", intermediate_size=96, num_local_experts=8))


def test_moe_arch_checks():
    with pytest.raises(ArgumentError, match="--moe-router-topk: 3 exceeds --num-experts 2"):
        ModelArch.llama(num_experts=2, moe_router_topk=3)
    with pytest.raises(ArgumentError, match="--num-experts: moe_ffn_hidden_size needs --num-experts"):
        ModelArch.llama(moe_ffn_hidden_size=8)
    with pytest.raises(ArgumentError, match="--num-experts: the MoE layer pattern"):
        ModelArch.llama(num_layers=2, num_experts=2, moe_layer_pattern=(1, 0, 1))
    with pytest.raises(ArgumentError, match="--moe-token-dispatcher-type: must be one of"):
        ModelArch.llama(num_experts=2, moe_token_dispatcher_type="flex")
    a = ModelArch.llama(num_layers=2, num_experts=2, moe_layer_pattern=[0, 1])  # JSON gives lists
    assert a.moe_layer_pattern == (0, 1) and a.moe_ffn_hidden_size == a.ffn_hidden_size


def test_param_table_of_moe_layers():
    a = _arch(QWEN3_MOE)
    names = [s.name for s in param_specs(a, "actor")]
    layer0 = [n[len("decoder.layers.0."):] for n in names if n.startswith("decoder.layers.0.mlp")]
    assert layer0 == ["mlp.router.weight"] + [f"mlp.experts.local_experts.{e}.linear_fc{k}.weight"
                                              for e in range(4) for k in (1, 2)]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names  # the dense layer
    specs = {s.name: s for s in param_specs(a, "actor")}
    fc1 = specs["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.global_shape == (64, 64) and fc1.kind == "swiglu_fc1"
    assert specs["decoder.layers.0.mlp.router.weight"].kind == "replicated"
    assert "moe_ffn_hidden_size=32 is not divisible by T=3" in check_tp_split(fc1, 3)


@pytest.mark.parametrize("cfg, router, gate, down", [
    (QWEN3_MOE, "mlp.gate.weight", "mlp.experts.1.gate_proj.weight", "mlp.experts.1.down_proj.weight"),
    (MIXTRAL, "block_sparse_moe.gate.weight", "block_sparse_moe.experts.1.w1.weight",
     "block_sparse_moe.experts.1.w2.weight")])
def test_hf_round_trip_bitwise(cfg, router, gate, down):
    a = _arch(cfg)
    g = torch.Generator().manual_seed(0)
    hf = {}
    entries = hf_entries(a, "actor")
    for e in entries:
        for name, shape in hf_shapes(e, a).items():
            hf[name] = torch.randn(shape, generator=g)
    assert f"model.layers.0.{router}" in hf and f"model.layers.2.{gate}" in hf and f"model.layers.0.{down}" in hf
    ours = {e.ours: hf_to_ours(e, hf, a) for e in entries}
    assert torch.equal(ours["decoder.layers.0.mlp.router.weight"], hf[f"model.layers.0.{router}"])
    up = gate.replace("gate_proj", "up_proj").replace(".w1.", ".w3.")
    assert torch.equal(ours["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"],
                       torch.cat([hf[f"model.layers.2.{gate}"], hf[f"model.layers.2.{up}"]]))
    back = {}
    for e in entries:
        back.update(ours_to_hf(e, ours[e.ours], a))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


# ---- expert parallelism in the plan (pure) ----------------------------------------------------------
def test_expert_groups_follow_megatron_order():
    from puzzle.parallel.plan import ParallelPlan

    p = ParallelPlan(1, 2, 2, E=2)  # ETP = T: the expert ranks of one TP rank span the DP replicas
    assert str(p) == "(P=1, D=2, T=2, E=2)" and p.ETP == 2 and p.EDP == 1
    assert p.ep_groups() == [[0, 2], [1, 3]] and p.expt_tp_groups() == [[0, 1], [2, 3]]
    assert p.tp_ep_groups() == [[0, 1, 2, 3]] and [p.expert_coords(r) for r in p.ranks] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)]
    q = ParallelPlan(1, 2, 2, E=2, ETP=1)  # experts whole, split over the TP ranks
    assert str(q) == "(P=1, D=2, T=2, E=2, ETP=1)"
    assert q.ep_groups() == [[0, 1], [2, 3]] and q.expt_dp_groups() == [[0, 2], [1, 3]]
    r = ParallelPlan(2, 2, 1, E=2)
    assert r.ep_groups() == [[0, 1], [2, 3]] and r.tp_ep_pp_groups() == [[0, 1, 2, 3]]
    dense = ParallelPlan(2, 2, 2)  # E = 1: the expert groups are the dense ones
    assert str(dense) == "(P=2, D=2, T=2)" and not dense.has_experts_split
    assert dense.expt_tp_groups() == dense.tp_groups() and dense.expt_dp_groups() == dense.dp_groups()
    assert sorted(dense.tp_ep_pp_groups()) == sorted(dense.mp_groups())


def test_generation_shares_keep_expert_groups_together():
    from puzzle.parallel.plan import ParallelPlan

    assert [ParallelPlan(1, 4, 1, E=4).generation_share(r) for r in range(4)] == [(0, 1)] * 4
    assert [ParallelPlan(1, 4, 1, E=2).generation_share(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [ParallelPlan(1, 2, 2, E=2, ETP=1).generation_share(r) for r in range(4)] == [(0, 2), (0, 2),
                                                                                        (1, 2), (1, 2)]


def test_expert_split_errors():
    from puzzle.models.builders import check_layout
    from puzzle.parallel.plan import ParallelPlan, PlanError

    with pytest.raises(PlanError, match="E=4 x expert tensor parallelism ETP=1 must divide the D\\*T=2"):
        ParallelPlan(1, 2, 1, E=4)
    moe = _arch(MIXTRAL)
    with pytest.raises(PlanError, match="actor cannot use plan .*num_experts=4 is not divisible by E=3"):
        check_layout(moe, ParallelPlan(1, 3, 1, E=3), "actor")
    with pytest.raises(PlanError, match="critic has no experts"):
        check_layout(ModelArch.llama(), ParallelPlan(1, 2, 1, E=2), "critic")


# ---- the run's flags ----------------------------------------------------------------------------------
def _run_cfg(*extra, world=4):
    from puzzle.arguments import parse_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--micro-batch-size", "2",
            "--rollout-batch-size", "8", "--max-new-tokens", "16", "--num-experts", "4",
            "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction"]
    return validate_args(parse_args(base + list(extra)), world, 259)


def test_expert_layout_flags_per_role():
    cfg = _run_cfg("--expert-model-parallel-size", "2", "--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.01",
                   "--moe-token-dispatcher-type", "alltoall", "--critic-expert-model-parallel-size", "4")
    actor, critic = cfg.roles["actor"], cfg.roles["critic"]
    assert (actor.plan.E, actor.plan.ETP, actor.gen_plan, critic.plan.E) == (2, 1, actor.plan, 4)
    assert actor.arch.moe_router_topk == 1 and actor.arch.moe_aux_loss_coeff == 0.01
    assert actor.arch.moe_token_dispatcher_type == "alltoall" and critic.arch.num_experts == 4
    # scoring-only roles may use T > 1 (their experts split over ETP = T)
    cfg = _run_cfg("--expert-model-parallel-size", "2", "--ref-tensor-model-parallel-size", "2")
    assert (cfg.roles["ref"].plan.T, cfg.roles["ref"].plan.ETP, cfg.roles["ref"].plan.E) == (2, 2, 2)
    # trained roles too, without sequence parallelism (megatron_patches.moe_tensor_parallel_without_sp)
    cfg = _run_cfg("--tensor-model-parallel-size", "2", "--critic-tensor-model-parallel-size", "2",
                   "--critic-expert-tensor-parallel-size", "1")
    assert [(cfg.roles[r].plan.T, cfg.roles[r].plan.ETP) for r in ("actor", "critic")] == [(2, 2), (2, 1)]


@pytest.mark.parametrize("extra, needle", [
    (["--expert-model-parallel-size", "3"], "num_experts=4 is not divisible by E=3|E=3 x expert tensor"),
    (["--moe-router-topk", "5"], "--moe-router-topk: 5 exceeds --num-experts 4"),
    (["--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss"],
     "--moe-router-load-balancing-type: seq_aux_loss of the actor.*--no-use-remove-padding"),
    (["--moe-grouped-gemm", "--moe-ffn-hidden-size", "20"],
     r"--moe-grouped-gemm: the actor at \(P=1, D=4, T=1\).*expert width per expert-tensor-parallel rank 20 "
     r"\(--moe-ffn-hidden-size 20 / ETP 1\) must be multiples of 8"),
    (["--moe-grouped-gemm", "--moe-ffn-hidden-size", "24", "--ref-tensor-model-parallel-size", "2",
      "--ref-expert-tensor-parallel-size", "2", "--ref-expert-model-parallel-size", "1"],
     "--moe-grouped-gemm: the ref at .*rank 12 .*ETP 2"),
])
def test_unsupported_moe_runs_are_refused(extra, needle):
    from puzzle.config_flags import ArgumentError

    with pytest.raises(ArgumentError, match=needle):
        _run_cfg(*extra)


def test_grouped_gemm_flag_reaches_every_moe_role():
    cfg = _run_cfg("--moe-grouped-gemm", "--moe-ffn-hidden-size", "32", "--expert-model-parallel-size", "2")
    assert all(spec.arch.moe_grouped_gemm for spec in cfg.roles.values() if spec.arch.is_moe)
    assert not any(spec.arch.moe_grouped_gemm for spec in _run_cfg("--moe-ffn-hidden-size", "32").roles.values())


def test_experts_split_over_ranks_score_and_train_packed():
    """E > 1 packs by default like E = 1 (the dispatchers take different token counts per rank:
    megatron_patches.moe_allgather_token_counts), and takes token-budget micro-batches."""
    from puzzle.arguments import parse_args, validate_args

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--micro-batch-size", "2",
             "--rollout-batch-size", "8", "--max-new-tokens", "16", "--transformer-impl", "local",
             "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction",
             "--num-experts", "4", "--moe-ffn-hidden-size", "32"]
    packed = lambda *extra: validate_args(parse_args(flags + list(extra)), 2, 259).ppo.use_remove_padding  # noqa: E731
    assert packed() and packed("--expert-model-parallel-size", "2")
    assert packed("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")
    assert not packed("--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
                      "--no-use-remove-padding")  # per-row balancing runs on padded rows
    ppo = validate_args(parse_args(flags + ["--expert-model-parallel-size", "2", "--use-dynamic-bsz",
                                            "--ppo-max-token-len-per-gpu", "128"]), 2, 259).ppo
    assert ppo.use_dynamic_bsz and ppo.use_remove_padding and ppo.log_prob_max_token_len_per_gpu == 128
