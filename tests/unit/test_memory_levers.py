"""The memory levers of long sequences: their flags (Megatron-LM's names and meanings)."""

import pytest
import torch

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.config import Recompute
from tests.unit.test_arguments import BASE


def _cfg(*extra, world=4):
    return validate_args(parse_args(BASE + list(extra)), world, 259)


def test_recompute_flags():
    assert _cfg().recompute == Recompute()
    assert _cfg("--recompute-activations").recompute == Recompute("selective")  # Megatron-LM's alias
    assert _cfg("--recompute-granularity", "selective").recompute == Recompute("selective")
    full = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    assert _cfg(*full).recompute == Recompute("full", "block", 2)
    bad = [
        (["--recompute-granularity", "full"], "^--recompute-method: --recompute-granularity full needs"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform"],
         "^--recompute-num-layers: --recompute-granularity full needs --recompute-num-layers N"),
        (["--recompute-method", "uniform"], "^--recompute-method: needs --recompute-granularity full"),
        (["--recompute-activations", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
         "^--recompute-method: needs --recompute-granularity full"),
        (["--recompute-activations", "--recompute-granularity", "full"],
         "--recompute-activations means --recompute-granularity selective"),
        (full[:4] + ["--recompute-num-layers", "0"], "^--recompute-num-layers: must be >= 1"),
        (full[:4] + ["--recompute-num-layers", "3"], "^--recompute-num-layers: 3 exceeds the actor's 2 layers"),
    ]
    for extra, message in bad:
        with pytest.raises(ArgumentError, match=message):
            _cfg(*extra)


def _logprobs_and_grads(logits, targets, chunk, with_entropy=True, temperature=0.7):
    from puzzle.engine.vocab_parallel import logprobs_in_chunks, vocab_parallel_logprobs

    x = logits.detach().clone().requires_grad_(True)
    if chunk is None:
        out = vocab_parallel_logprobs(x, targets, None, 90, temperature, with_entropy)
    else:
        out = logprobs_in_chunks(x, targets, None, 90, temperature, with_entropy, chunk)
    lp, ent = out if with_entropy else (out, torch.zeros_like(out))
    w = torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)
    ((lp * w).sum() + (ent * w.flip(1)).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_whole(dtype):
    """Log-probs, entropy and their gradients a chunk of the sequence at a time equal the whole
    computation within fp32 rounding (padding ids >= 90 masked, temperature, uneven last chunk)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 11, 96, generator=g)).to(dtype)
    targets = torch.randint(0, 90, (3, 11), generator=g)
    ref = _logprobs_and_grads(logits, targets, None)
    assert torch.isfinite(ref[2]).all() and ref[2].abs().sum() > 0
    for chunk in (1, 4, 11):
        got = _logprobs_and_grads(logits, targets, chunk)
        for a, b in zip(ref, got):
            assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), (chunk, (a - b).abs().max())
    lp, _, grad = _logprobs_and_grads(logits, targets, 3, with_entropy=False)
    assert torch.allclose(lp, _logprobs_and_grads(logits, targets, None, with_entropy=False)[0], atol=1e-6)
    assert grad[..., 90:].abs().sum() == 0  # padding columns get no gradient


def test_chunk_size_follows_the_budget():
    from puzzle.engine.vocab_parallel import LOGITS_CHUNK_BYTES, sequence_chunk

    assert sequence_chunk((1, 64, 200)) == 64  # small logits: whole
    # 8k positions x 152k vocabulary on one rank: chunks of 441 positions (256 MiB of fp32 each)
    c = sequence_chunk((1, 8191, 152064))
    assert 4 * c * 152064 <= LOGITS_CHUNK_BYTES < 4 * (c + 1) * 152064
    assert sequence_chunk((4, 8191, 152064)) == c // 4
    assert sequence_chunk((64, 10, 10 ** 7)) == 1


def test_memory_model_knows_the_levers():
    import dataclasses

    from puzzle.parallel.plan import ParallelPlan
    from puzzle.model_shape import ModelShape
    from puzzle.plan_search.cost_model import CostModel, PPOWorkload, ppo_roles
    from puzzle.plan_search.memory_model import LOGITS_CHUNK_BYTES, MemoryModel
    from puzzle.plan_search.profile_data import load_profile
    from puzzle.engine import vocab_parallel

    assert LOGITS_CHUNK_BYTES == vocab_parallel.LOGITS_CHUNK_BYTES  # the planner's copy of the chunk
    shape = ModelShape(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                       num_query_groups=8, vocab_size=128256, swiglu=True)
    roles = ppo_roles(shape, None, shape, None)
    base = PPOWorkload(rollout_batch_size=512, prompt_len=512, gen_len=7680, micro_batch_size=2)
    prof, plan = load_profile("a100_80gb"), ParallelPlan(1, 4, 2)

    def items(w, kind, role="actor"):
        mm = MemoryModel(prof, w)
        got = mm.static_items(roles[role], plan, 0, kind) + (mm.items(kind, roles[role], plan, 0)
                                                              if role == "actor" else [])
        return dict(got)

    full = dataclasses.replace(base, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    act, act_full = items(base, "training")["actor activations"], items(full, "training")["actor activations"]
    assert act_full < act / 5  # layer inputs only, + one layer recomputed
    block = dataclasses.replace(full, recompute_method="block", recompute_num_layers=16)
    assert act_full < items(block, "training")["actor activations"] < act
    off = dataclasses.replace(base, offload_during_inference=True)
    assert "actor grads" in items(base, "generation") and "actor grads" not in items(off, "generation")
    assert "actor optimizer" in items(off, "training") and "ref weights" not in items(off, "generation", "ref")
    assert "ref weights" in items(off, "scoring", "ref")
    budget = dataclasses.replace(base, generation_micro_batch_size=16)
    assert items(budget, "generation")["actor KV cache"] * 8 == items(base, "generation")["actor KV cache"]
    cm, cm_full, cm_off = CostModel(prof, base), CostModel(prof, full), CostModel(prof, off)
    assert cm_full.train_cost(roles["actor"], plan).total > cm.train_cost(roles["actor"], plan).total
    assert cm.offload_cost(roles["actor"], plan) == 0 < cm_off.offload_cost(roles["actor"], plan)
    assert CostModel(prof, budget).generation_cost(roles["actor"], plan).total > \
        cm.generation_cost(roles["actor"], plan).total  # 8 waves of 16 sequences


def test_kv_budget_sets_the_generation_micro_batch():
    base = _cfg()
    gen = base.roles["actor"].gen_plan
    per_rank = base.ppo.num_samples // gen.D
    width = base.ppo.max_prompt_length + base.ppo.max_new_tokens
    per_seq = base.roles["actor"].arch.shape.kv_bytes_per_sequence(width, gen, 4)
    assert base.ppo.generation_micro_batch_size is None
    for fit, rows in ((per_rank, per_rank), (per_rank + 5, per_rank), (1, 1), (3, 2)):  # divisors of 2 per rank
        gib = (fit + 0.5) * per_seq / (1 << 30)
        c = _cfg("--inference-dynamic-batching-buffer-size-gb", str(gib))
        assert c.ppo.generation_micro_batch_size == min(rows, per_rank), (fit, per_rank)
    with pytest.raises(ArgumentError, match="^--inference-dynamic-batching-buffer-size-gb: .* holds no sequence"):
        _cfg("--inference-dynamic-batching-buffer-size-gb", str(0.5 * per_seq / (1 << 30)))
    with pytest.raises(ArgumentError, match="give one of them"):
        _cfg("--inference-dynamic-batching-buffer-size-gb", "1", "--generation-micro-batch-size", "1")
    with pytest.raises(ArgumentError, match="needs an actor generation layout with P=1"):
        _cfg("--inference-dynamic-batching-buffer-size-gb", "1", "--pipeline-model-parallel-size", "2")
    with pytest.raises(ArgumentError, match="^--inference-dynamic-batching-buffer-size-gb: must be > 0"):
        _cfg("--inference-dynamic-batching-buffer-size-gb", "0")
    assert _cfg("--rl-offload-optimizer-during-inference").levers.rl_offload_optimizer_during_inference


LLAMA_8B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
            "32", "--group-query-attention", "--num-query-groups", "8", "--max-position-embeddings", "32768",
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16", "--vocab-size", "128256",
            "--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "128",
            "--advantage-estimator", "grpo", "--n-samples-per-prompt", "8", "--rollout-batch-size", "64",
            "--kl-coef", "0", "--use-kl-loss", "--reward-fn", "puzzle.reward_functions.builtin:math_answer",
            "--max-prompt-length", "512", "--world-size", "8", "--ranks-per-node", "8", "--json"]


def test_the_search_turns_levers_on_only_where_memory_needs_them(capsys):
    import json

    from puzzle.plan_search.command import search_main

    def levers(*lengths):
        assert search_main(LLAMA_8B + list(lengths)) == 0
        return json.loads(capsys.readouterr().out)["levers"]

    assert levers("--seq-length", "1536", "--max-new-tokens", "1024") == {}
    long = levers("--seq-length", "16896", "--max-new-tokens", "16384")
    assert long and set(long) <= {"--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                                  "--rl-offload-optimizer-during-inference", "--generation-micro-batch-size"}
