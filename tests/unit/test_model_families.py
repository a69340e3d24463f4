"""Pure parts of the model families: parameter names under both layer specs, llama3 RoPE,
config.json <-> ModelArch per family, stop ids and chat templates of local HF tokenizers."""

import json

import pytest
import torch

from puzzle.config import ModelArch
from puzzle.models.hf_mapping import UnsupportedHFModel, arch_from_hf_config, hf_config_from_arch, hf_entries
from puzzle.models.init import param_specs
from puzzle.models.param_layout import gpt_param_specs
from puzzle.models.param_names import (canonical_param_name, drop_extra_state, names_for_impl,
                                       param_name_for_impl)
from puzzle.models.rope import arch_inv_freq, llama3_inv_freq, rope_inv_freq

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 4, "vocab_size": 200, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "hidden_act": "silu"}


def _family(mt, **kw):
    cfg = dict(BASE, model_type=mt, **kw)
    return arch_from_hf_config(cfg, make_vocab_size_divisible_by=64)


# ---- transformer_engine names ---------------------------------------------------------------------
@pytest.mark.parametrize("canonical, te", [
    ("decoder.layers.3.input_layernorm.weight", "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"),
    ("decoder.layers.0.input_layernorm.bias", "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias"),
    ("decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"),
    ("decoder.layers.12.pre_mlp_layernorm.bias", "decoder.layers.12.mlp.linear_fc1.layer_norm_bias"),
    ("decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.q_layernorm.weight"),
    ("decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.self_attention.linear_qkv.bias"),
    ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
])
def test_param_name_table_both_ways(canonical, te):
    assert param_name_for_impl(canonical, "transformer_engine") == te
    assert param_name_for_impl(canonical, "local") == canonical
    assert canonical_param_name(te) == canonical and canonical_param_name(canonical) == canonical
    with pytest.raises(ValueError, match="--transformer-impl"):
        param_name_for_impl(canonical, "te")


@pytest.mark.parametrize("mt, kw", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}),
                                    ("qwen3", {"head_dim": 16}), ("mistral", {})])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_te_model_names_from_the_local_spec(mt, kw, normalization):
    """The TE spec's named_parameters() of every family: fused norms sit with linear_qkv/linear_fc1,
    in TE's registration order, and map back to the canonical names one to one."""
    arch = _family(mt, **kw)
    specs = gpt_param_specs(arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads,
                            arch.num_query_groups, arch.padded_vocab_size, add_qkv_bias=arch.add_qkv_bias,
                            qk_layernorm=arch.qk_layernorm, kv_channels=arch.kv_channels,
                            normalization=normalization)
    local = [s.name for s in specs]
    te = names_for_impl(local, "transformer_engine")
    assert sorted(canonical_param_name(n) for n in te) == sorted(local) and len(set(te)) == len(te)
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in te)
    layer0 = [n[len("decoder.layers.0."):] for n in te if n.startswith("decoder.layers.0.")]
    expect = ["self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight"]
    if normalization == "LayerNorm":
        expect.append("self_attention.linear_qkv.layer_norm_bias")
    expect.append("self_attention.linear_qkv.weight")
    if arch.add_qkv_bias:
        expect.append("self_attention.linear_qkv.bias")
    for qk in ("q", "k") if arch.qk_layernorm else ():
        expect += [f"self_attention.{qk}_layernorm.weight"] + (
            [f"self_attention.{qk}_layernorm.bias"] if normalization == "LayerNorm" else [])
    expect.append("mlp.linear_fc1.layer_norm_weight")
    if normalization == "LayerNorm":
        expect.append("mlp.linear_fc1.layer_norm_bias")
    expect += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    assert layer0 == expect
    assert te[0] == "embedding.word_embeddings.weight" and te[-1].startswith(("decoder.final_layernorm", "output_layer"))


def test_layout_independent_init_is_the_same_under_te_names():
    from puzzle.models.init import global_init_value, spec_name_of

    arch = _family("qwen3", head_dim=16)
    specs = {s.name: s for s in param_specs(arch, "actor")}
    for canonical in ("input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight"):
        on_stage = f"decoder.layers.0.{canonical}"  # stage 1 of [1, 1] holds global layer 1 as local 0
        a = spec_name_of(on_stage, "actor", arch, 1, [1, 1])
        b = spec_name_of(param_name_for_impl(on_stage, "transformer_engine"), "actor", arch, 1, [1, 1])
        assert a == b == f"decoder.layers.1.{canonical}"
        assert torch.equal(global_init_value(specs[a], arch, 7), global_init_value(specs[b], arch, 7))


def test_drop_extra_state():
    sd = {"a._extra_state": 1, "b.weight": 2, "nested": {"c._extra_state": 3, "d": 4}}
    assert drop_extra_state(sd) == {"b.weight": 2, "nested": {"d": 4}}


# ---- llama3 RoPE ----------------------------------------------------------------------------------
def test_llama3_inv_freq_matches_transformers_and_honours_all_four_parameters():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 2.0,
            "high_freq_factor": 8.0, "original_max_position_embeddings": 256}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope, max_position_embeddings=2048)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    arch = arch_from_hf_config(dict(cfg.to_dict(), vocab_size=200, intermediate_size=512))
    assert arch.use_rope_scaling and arch.rope_original_max_position_embeddings == 256
    ours = arch_inv_freq(arch)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0), (ours, ref)
    # megatron-core's built-in llama3 scaling (low 1, high 4, original 8192) differs
    builtin = llama3_inv_freq(64, 500000.0, 4.0, 1.0, 4.0, 8192)
    assert not torch.allclose(builtin, ref)
    plain = rope_inv_freq(64, 500000.0)
    assert not torch.allclose(plain, ref) and torch.equal(plain[:2], ref[:2])  # high frequencies kept


# ---- config.json <-> ModelArch per family ---------------------------------------------------------
@pytest.mark.parametrize("mt, kw, expect", [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     dict(use_rope_scaling=True, rope_scaling_factor=32.0, rotary_base=500000)),
    ("qwen2", {"tie_word_embeddings": True}, dict(add_qkv_bias=True, untie_embeddings_and_output_weights=False)),
    ("qwen3", {"head_dim": 16}, dict(qk_layernorm=True, kv_channels=16)),
    ("mistral", {"sliding_window": 4096}, dict(sliding_window=4096, add_qkv_bias=False)),
])
def test_family_config_round_trips(mt, kw, expect):
    arch = _family(mt, **kw)
    for k, v in expect.items():
        assert getattr(arch, k) == v, (k, getattr(arch, k))
    assert arch.hf_model_type == mt
    cfg = json.loads(json.dumps(hf_config_from_arch(arch)))
    assert arch_from_hf_config(cfg, make_vocab_size_divisible_by=64) == arch
    crit = hf_config_from_arch(arch, "critic")
    assert crit["architectures"][0].endswith("ForSequenceClassification") and crit["num_labels"] == 1
    names = {n for e in hf_entries(arch, "actor") for n in e.hf}
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == arch.add_qkv_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == arch.qk_layernorm
    assert ("lm_head.weight" in names) == arch.untie_embeddings_and_output_weights


def test_transformers_accepts_the_exported_configs():
    import transformers

    for mt, cls in (("llama", "LlamaConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config"),
                    ("mistral", "MistralConfig")):
        arch = _family(mt, **({"head_dim": 16} if mt == "qwen3" else {}))
        cfg = getattr(transformers, cls)(**hf_config_from_arch(arch))
        assert cfg.num_key_value_heads == 4 and getattr(cfg, "head_dim", 8) == arch.kv_channels


def test_explicit_kv_channels_and_flags_in_model_arch():
    a = ModelArch.llama(hidden_size=64, num_attention_heads=8, kv_channels=16)
    assert a.kv_channels == 16 and ModelArch.llama(hidden_size=64, num_attention_heads=8).kv_channels == 8
    with pytest.raises(ValueError, match="sliding_window=32 is shorter than seq_length=64"):
        ModelArch.llama(seq_length=64, sliding_window=32)
    with pytest.raises(ValueError, match="--rope-high-freq-factor: 4.0 must exceed --rope-low-freq-factor 4.0"):
        ModelArch.llama(use_rope_scaling=True, rope_low_freq_factor=4.0, rope_high_freq_factor=4.0)


def test_unsupported_sliding_window_names_config_and_field():
    with pytest.raises(UnsupportedHFModel, match=r"/x/config.json: .*sliding_window=16"):
        arch_from_hf_config(dict(BASE, model_type="mistral", sliding_window=16), source="/x/config.json")


# ---- tokenizers -----------------------------------------------------------------------------------
def _tokenizer_dir(tmp_path, eos):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0")
    hf.chat_template = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
    hf.save_pretrained(tmp_path)
    if eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return str(tmp_path)


def test_hf_tokenizer_stop_ids_from_generation_config(tmp_path):
    from puzzle.data.tokenizers import build_tokenizer

    tok = build_tokenizer("HuggingFaceTokenizer", _tokenizer_dir(tmp_path, [9, 2, 9]))
    assert tok.eos_ids == (9, 2) and tok.eos_id == 2  # the tokenizer's eos, since it is a stop id
    assert tok.apply_chat_template([{"role": "user", "content": "t7 t8"}]) == [3, 7, 8, 4, 5]


def test_hf_tokenizer_stop_ids_fallbacks(tmp_path):
    from puzzle.data.tokenizers import build_tokenizer

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert build_tokenizer("HuggingFaceTokenizer", _tokenizer_dir(tmp_path / "a", None)).eos_ids == (2,)
    tok = build_tokenizer("HuggingFaceTokenizer", _tokenizer_dir(tmp_path / "b", 11))
    assert tok.eos_ids == (11,) and tok.eos_id == 11
    assert build_tokenizer().eos_ids == (258,)


def test_sampling_params_stop_ids():
    from puzzle.rollout.sampling import SamplingParams

    assert SamplingParams(4, eos_id=5, eos_ids=(7, 5)).stop_ids == (5, 7)
    assert SamplingParams(4).stop_ids == ()
    with pytest.raises(ValueError, match="eos_ids"):
        SamplingParams(4, eos_ids=[1])


# ---- flags ----------------------------------------------------------------------------------------
_RUN = ["--seq-length", "64", "--micro-batch-size", "2", "--rollout-batch-size", "8", "--max-new-tokens", "16",
        "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction"]


def _hf_dir(tmp_path, **kw):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="qwen3", head_dim=16, **kw)))
    return str(tmp_path)


def test_hf_path_alone_sets_the_shape(tmp_path):
    from puzzle.arguments import parse_args, validate_args

    d = _hf_dir(tmp_path)
    c = validate_args(parse_args(_RUN + ["--hf-actor-path", d, "--hf-critic-path", d]), 4, 150)
    a = c.roles["actor"].arch
    assert (a.num_layers, a.hidden_size, a.kv_channels, a.qk_layernorm, a.vocab_size) == (2, 64, 16, True, 200)
    assert c.roles["critic"].arch == a and c.roles["ref"].arch == a
    # a critic without a checkpoint of its own takes the actor's shape (its flags default to the actor's)
    c2 = validate_args(parse_args(_RUN + ["--hf-actor-path", d]), 4, 150)
    assert c2.roles["critic"].arch == a and c2.roles["critic"].hf_path is None
    # flags repeating the checkpoint are fine
    validate_args(parse_args(_RUN + ["--hf-actor-path", d, "--hf-critic-path", d, "--num-layers", "2",
                                     "--kv-channels", "16", "--qk-layernorm", "--normalization", "RMSNorm",
                                     "--swiglu", "--position-embedding-type", "rope"]), 4, 150)
    # the run's own choices apply on top of the checkpoint
    c3 = validate_args(parse_args(_RUN + ["--hf-actor-path", d, "--attention-backend", "local", "--hidden-dropout",
                                          "0.1", "--init-method-std", "0.01"]), 4, 150)
    a3 = c3.roles["actor"].arch
    assert (a3.attention_backend, a3.hidden_dropout, a3.init_method_std, a3.num_layers) == ("local", 0.1, 0.01, 2)


@pytest.mark.parametrize("extra, needle", [
    (["--num-layers", "4"], "--num-layers: 4 conflicts with .*config.json \\(num_hidden_layers=2\\)"),
    (["--kv-channels", "8"], "--kv-channels: 8 conflicts with .*\\(head_dim=16\\)"),
    (["--critic-hidden-size", "32"], "--critic-hidden-size: 32 conflicts"),
    (["--add-qkv-bias"], "--add-qkv-bias: conflicts with .*config.json"),
    (["--use-rope-scaling"], "--use-rope-scaling: conflicts"),
    (["--normalization", "LayerNorm"], "--normalization: LayerNorm conflicts with .*\\(normalization=RMSNorm\\)"),
    (["--rotary-base", "500"], "--rotary-base: 500 conflicts with .*config.json"),
    (["--vocab-size", "300"], "--vocab-size: 300 conflicts with .*\\(vocab_size=200\\)"),
])
def test_flag_conflicting_with_config_json_names_both(tmp_path, extra, needle):
    from puzzle.arguments import ArgumentError, parse_args, validate_args

    d = _hf_dir(tmp_path)
    with pytest.raises(ArgumentError, match=needle):
        validate_args(parse_args(_RUN + ["--hf-actor-path", d, "--hf-critic-path", d] + extra), 4, 150)


def test_hf_config_errors_name_the_flag_and_file(tmp_path):
    from puzzle.arguments import ArgumentError, parse_args, validate_args

    d = _hf_dir(tmp_path, num_experts=8)
    with pytest.raises(ArgumentError, match="--hf-actor-path: .*config.json: .*num_experts=8"):
        validate_args(parse_args(_RUN + ["--hf-actor-path", d, "--hf-critic-path", d]), 4, 150)
    d2 = tmp_path / "ok"
    d2.mkdir()
    _hf_dir(d2)
    # more tokenizer ids than rows is no error here (tests/unit/test_tokenizer_rows.py: which may be fed)
    c = validate_args(parse_args(_RUN + ["--hf-actor-path", str(d2), "--hf-critic-path", str(d2)]), 4, 300)
    assert c.roles["actor"].arch.valid_vocab_size == 200


def test_megatron_model_flags_are_honoured():
    from puzzle.arguments import ArgumentError, parse_args, validate_args

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--swiglu",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights"]
    c = validate_args(parse_args(_RUN + flags + ["--kv-channels", "16", "--add-qkv-bias", "--qk-layernorm",
                                                 "--use-rope-scaling", "--rope-scaling-factor", "32",
                                                 "--rope-original-max-position-embeddings", "4096"]), 4, 259)
    a = c.roles["actor"].arch
    assert (a.kv_channels, a.add_qkv_bias, a.qk_layernorm, a.use_rope_scaling) == (16, True, True, True)
    assert (a.rope_scaling_factor, a.rope_original_max_position_embeddings, a.rope_low_freq_factor) == (32.0, 4096, 1.0)
    assert c.roles["critic"].arch.kv_channels == 16
    with pytest.raises(ArgumentError, match="--rope-scaling-factor: .*--use-rope-scaling"):
        validate_args(parse_args(_RUN + flags + ["--rope-scaling-factor", "32"]), 4, 259)
