"""Where each role's weights come from (puzzle/weight_sources.py) and Megatron-LM checkpoints read
from their files alone (puzzle/models/megatron_checkpoint.py): no process group, no model."""

import argparse
import json
from dataclasses import replace

import pytest
import torch

from puzzle import checkpointing, weight_sources
from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.config import ModelArch
from puzzle.models.megatron_checkpoint import (MegatronCheckpointError, arch_from_megatron_args,
                                               find_megatron_checkpoint, megatron_args_from_arch)
from tests.harness import TINY_CLI

NO_INIT = [f for f in TINY_CLI if f != "--init-random"]


def _megatron_args(**kw):
    """pretrain_gpt.py's args of the tiny model (examples/run_ppo_tiny.sh MODEL_ARGS)."""
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
                num_query_groups=2, kv_channels=16, padded_vocab_size=384, make_vocab_size_divisible_by=128,
                seq_length=64, max_position_embeddings=64, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
                position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
                untie_embeddings_and_output_weights=True, add_bias_linear=False, tensor_model_parallel_size=2)
    base.update(kw)
    return argparse.Namespace(**base)


def _megatron_dir(root, tracker="7", **kw):
    """The files of a Megatron-LM torch_dist checkpoint that are read before any model exists."""
    d = root / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                 "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"args": _megatron_args(**kw), "iteration": 7, "checkpoint_version": 3.0}, d / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return str(root)


def _cfg(*extra):
    return validate_args(parse_args(NO_INIT + list(extra)), 4, 259)


def test_random_trainable_roles_need_init_random(tmp_path):
    with pytest.raises(ArgumentError) as e:
        weight_sources.check(_cfg())
    msg = str(e.value)
    assert msg.startswith("--init-random: the actor and critic would start from random weights")
    assert "--hf-actor-path" in msg and "--pretrained-checkpoint" in msg and "--critic-pretrained-checkpoint" in msg
    weight_sources.check(_cfg("--init-random"))
    # the actor from a Megatron-LM checkpoint: only the critic is named now
    ckpt = _megatron_dir(tmp_path / "sft")
    with pytest.raises(ArgumentError, match=r"the critic would start from random weights") as e:
        weight_sources.check(_cfg("--pretrained-checkpoint", ckpt))
    assert "the actor's" not in str(e.value)
    lines = weight_sources.source_lines(_cfg("--pretrained-checkpoint", ckpt, "--init-random"))
    assert lines[1] == f"  actor   Megatron-LM checkpoint {ckpt} (--pretrained-checkpoint)"
    assert lines[2] == "  critic  random init (seed 1235, --init-random)"
    assert lines[3].startswith(f"  ref     Megatron-LM checkpoint {ckpt}")


def test_megatron_checkpoint_sets_the_shape_and_flags_must_agree(tmp_path):
    ckpt = _megatron_dir(tmp_path / "sft", num_layers=3)
    with pytest.raises(ArgumentError, match=r"--num-layers: 2 conflicts with .*common.pt"):
        _cfg("--pretrained-checkpoint", ckpt)
    flags = [f if f != "2" or i == 0 or NO_INIT[i - 1] != "--num-layers" else "3" for i, f in enumerate(NO_INIT)]
    cfg = validate_args(parse_args(flags + ["--pretrained-checkpoint", ckpt, "--init-random"]), 4, 259)
    assert cfg.roles["actor"].arch.num_layers == cfg.roles["critic"].arch.num_layers == 3
    assert cfg.roles["actor"].arch.padded_vocab_size == 384
    with pytest.raises(ArgumentError, match="--pretrained-checkpoint: --hf-actor-path .* give one of them"):
        _cfg("--pretrained-checkpoint", ckpt, "--hf-actor-path", str(tmp_path))
    with pytest.raises(ArgumentError, match="--critic-pretrained-checkpoint: .* is not a Megatron-LM checkpoint"):
        _cfg("--critic-pretrained-checkpoint", str(tmp_path))


def test_megatron_checkpoint_at_load_is_named_and_needs_finetune(tmp_path):
    ckpt = _megatron_dir(tmp_path / "sft")
    with pytest.raises(ArgumentError, match=r"--load: .* \(iteration 7\) is a Megatron-LM checkpoint, not a puzzle "
                                            r"run: .* with --finetune"):
        _cfg("--load", ckpt)
    cfg = _cfg("--load", ckpt, "--finetune", "--init-random")
    assert cfg.roles["actor"].pretrained_checkpoint == cfg.roles["ref"].pretrained_checkpoint == ckpt
    assert "(--load --finetune)" in weight_sources.source_lines(cfg)[1]
    assert checkpointing.check_checkpoint(cfg, ckpt) is None  # nothing to resume: the actor's weights
    with pytest.raises(checkpointing.CheckpointError, match="is a Megatron-LM checkpoint, not a puzzle run"):
        checkpointing.check_checkpoint(replace(cfg, finetune=False), ckpt)
    with pytest.raises(ArgumentError, match="--finetune: needs --load DIR"):
        _cfg("--finetune")


def test_reward_model_from_a_megatron_checkpoint(tmp_path):
    ckpt = _megatron_dir(tmp_path / "rm", tracker="release")
    assert find_megatron_checkpoint(ckpt).release
    cfg = validate_args(parse_args(NO_INIT[:-2] + ["--reward-fn", "", "--reward-model", ckpt, "--init-random"]), 4, 259)
    assert cfg.roles["reward"].pretrained_checkpoint == ckpt and cfg.roles["reward"].hf_path is None
    assert weight_sources.source_lines(cfg)[-1] == f"  reward  Megatron-LM checkpoint {ckpt} (--reward-pretrained-checkpoint)"


@pytest.mark.parametrize("arch", [
    ModelArch.llama(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=2, vocab_size=1000,
                    qk_layernorm=True, hf_model_type="qwen3"),
    ModelArch.llama(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=512, num_experts=8,
                    moe_ffn_hidden_size=64, moe_router_topk=2, moe_layer_pattern=(0, 1, 1, 1), hf_model_type="mixtral"),
    ModelArch(num_layers=2, vocab_size=256),  # Megatron-LM's own defaults: LayerNorm, learned positions, GeLU
])
def test_args_round_trip(arch):
    back = arch_from_megatron_args(megatron_args_from_arch(arch), "x", seq_length=arch.seq_length)
    assert replace(back, hf_model_type=arch.hf_model_type) == replace(arch, vocab_size=arch.padded_vocab_size)


def test_unsupported_megatron_model_is_named(tmp_path):
    with pytest.raises(MegatronCheckpointError, match=r"^/ckpt: unsupported Megatron-LM model: "
                                                      r"multi_latent_attention=True \(multi-latent attention\)"):
        arch_from_megatron_args(_megatron_args(multi_latent_attention=True), "/ckpt")
    puzzle_run = tmp_path / "run"
    (puzzle_run / "iter_0000003").mkdir(parents=True)
    (puzzle_run / "iter_0000003" / "metadata.json").write_text(json.dumps({"format": 1}))
    (puzzle_run / "latest_checkpointed_iteration.txt").write_text("3")
    assert find_megatron_checkpoint(str(puzzle_run)) is None and weight_sources.holds_run_checkpoint(str(puzzle_run))
