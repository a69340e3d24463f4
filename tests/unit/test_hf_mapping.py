"""The HF LLaMA <-> ParamSpec mapping table (pure: whole tensors, no distributed)."""

import json

import pytest
import torch

from puzzle.models.hf_mapping import (UnsupportedHFModel, arch_from_hf_config, assemble, hf_config_from_arch,
                                      hf_entries, hf_shapes, hf_to_ours, ours_to_hf)
from puzzle.models.init import local_shard, param_specs
from puzzle.models.param_layout import shard_slices

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 8, "vocab_size": 200, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
}


def _arch(**kw):
    return arch_from_hf_config(dict(HF_CONFIG, **kw), make_vocab_size_divisible_by=64)


def _random_hf(arch, role="actor", head_name="score.weight"):
    g = torch.Generator().manual_seed(0)
    out = {}
    for e in hf_entries(arch, role, head_name=head_name):
        for name, shape in hf_shapes(e, arch).items():
            out[name] = torch.randn(shape, generator=g)
    return out


def test_arch_from_hf_config():
    arch = _arch()
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size) == (2, 64, 96)
    assert (arch.num_attention_heads, arch.num_query_groups, arch.kv_channels) == (8, 2, 8)
    assert arch.rotary_base == 500000 and arch.norm_epsilon == 1e-6
    assert arch.untie_embeddings_and_output_weights and arch.padded_vocab_size == 256
    old_style = dict(HF_CONFIG, rope_theta=10000.0, tie_word_embeddings=True)
    old_style.pop("rope_parameters")
    a2 = arch_from_hf_config(old_style, seq_length=32)
    assert a2.rotary_base == 10000 and not a2.untie_embeddings_and_output_weights and a2.seq_length == 32
    assert a2.padded_vocab_size == 256  # Megatron's default multiple of 128


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "mixtral"}, "mixtral needs num_experts"),
    ({"model_type": "qwen2_moe"}, "model_type='qwen2_moe'"),
    ({"num_experts": 8}, "num_experts=8"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_parameters \(llama3\) lacks low_freq_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral", "sliding_window": 32}, "sliding_window=32 is shorter than seq_length=64"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}, "sliding_window=16"),
])
def test_unsupported_hf_config_names_the_file(change, needle):
    with pytest.raises(UnsupportedHFModel, match=needle) as e:
        arch_from_hf_config(dict(HF_CONFIG, **change), source="/ckpt/x/config.json")
    assert "/ckpt/x/config.json" in str(e.value)


@pytest.mark.parametrize("role, tied", [("actor", False), ("actor", True), ("critic", False)])
def test_round_trip_hf_ours_hf_bitwise(role, tied):
    arch = _arch(tie_word_embeddings=tied)
    hf = _random_hf(arch, role)
    entries = hf_entries(arch, role)
    expect = {"model.embed_tokens.weight", "model.norm.weight"}
    expect |= {"score.weight"} if role == "critic" else set() if tied else {"lm_head.weight"}
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expect |= {f"model.layers.{i}.{n}.weight" for i in range(2) for n in per_layer}
    assert set(hf) == expect
    ours = {e.ours: hf_to_ours(e, hf, arch) for e in entries}
    assert {s.name: s.global_shape for s in param_specs(arch, role)} == {k: tuple(v.shape) for k, v in ours.items()}
    back = {}
    for e in entries:
        back.update(ours_to_hf(e, ours[e.ours], arch))
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_is_group_major_and_fc1_is_gate_then_up():
    arch = _arch()
    hf = _random_hf(arch)
    e = {x.ours: x for x in hf_entries(arch)}
    qkv = hf_to_ours(e["decoder.layers.1.self_attention.linear_qkv.weight"], hf, arch)
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    hd, r = 8, 4  # 8 heads / 2 kv groups
    manual = []
    for g in range(2):
        manual += [q[g * r * hd:(g + 1) * r * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    assert torch.equal(qkv, torch.cat(manual))
    fc1 = hf_to_ours(e["decoder.layers.0.mlp.linear_fc1.weight"], hf, arch)
    assert torch.equal(fc1, torch.cat([hf["model.layers.0.mlp.gate_proj.weight"],
                                       hf["model.layers.0.mlp.up_proj.weight"]]))
    emb = hf_to_ours(e["embedding.word_embeddings.weight"], hf, arch)
    assert emb.shape == (256, 64) and torch.equal(emb[:200], hf["model.embed_tokens.weight"])
    assert not emb[200:].any()


@pytest.mark.parametrize("T", [1, 2])
def test_sharded_reads_equal_shards_of_the_whole_tensor(T):
    """What a TP rank assembles from partial HF reads == local_shard of the whole converted tensor."""
    arch = _arch()
    hf = _random_hf(arch)
    specs = {s.name: s for s in param_specs(arch, "actor")}
    reads = []

    def read(name, box):
        reads.append((name, box))
        return hf[name][tuple(slice(a, b) for a, b in box)]

    for e in hf_entries(arch):
        whole = hf_to_ours(e, hf, arch)
        for t in range(T):
            spec = specs[e.ours]
            parts = [assemble(e, box, arch, read) for box in shard_slices(spec, T, t)]
            got = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.split_dim)
            assert torch.equal(got, local_shard(spec, whole, T, t)), (e.ours, t)
    if T == 2:  # rank-sized reads: no read of a sharded tensor covers it whole
        q_reads = [b for n, b in reads if n == "model.layers.0.self_attn.q_proj.weight"]
        assert all(b[0][1] - b[0][0] == 32 for b in q_reads)


def test_hf_config_from_arch_round_trips():
    arch = _arch()
    cfg = json.loads(json.dumps(hf_config_from_arch(arch)))
    again = arch_from_hf_config(cfg, make_vocab_size_divisible_by=64)
    assert again == arch
    crit = hf_config_from_arch(arch, "reward")
    assert crit["architectures"] == ["LlamaForSequenceClassification"] and crit["num_labels"] == 1
