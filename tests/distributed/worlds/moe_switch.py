"""4-rank world: mixture-of-experts models between layouts of different E.

* the switch: a MoE actor moved between (P, D, T, E) layouts equals the model built at the
  destination (bitwise), each rank receiving exactly the bytes it lacks, also overlapped with
  the optimizer step;
* the tiny MoE PPO run saved at E = 2 and resumed with the actor and critic at E = 1, optimizer
  state included (experts keep an optimizer of their own at every E), repeats iteration 2 exactly;
* the tiny MoE PPO run trained at T = 2 without sequence parallelism (the actor's experts split over
  ETP = 2, the critic's whole at E = ETP = 1) for the straight run's iterations, to compare with it;
* the tiny MoE PPO run, saved after its first iteration and resumed with every model at another
  (P, D, E) layout and the actor generating through the switch at yet another (P, D, E), repeats
  the straight run's second iteration exactly (the switch moving the lower bound of bytes).
"""

import tempfile

import torch
import torch.distributed as dist

from puzzle.config import ModelArch
from puzzle.parallel.device import runtime
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan as P
from puzzle.switch.shadow import routing_table_for, switch_to_generation
from puzzle.training.engine import ModelEngine, OptimConfig
from puzzle.training.steps import lm_nll_step
from tests.harness import tiny_flags, train_in_world, world_main

# 4 experts of ffn 32, top-2; layer 1 dense (Qwen3-MoE's mlp_only_layers)
ARCH = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=4,
                       vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32, num_experts=4,
                       moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_pattern=(1, 0, 1, 1))
SEED = 7
#: (source, destination) layouts; sources at T = 1 train (MoE training runs at T = ETP = 1)
PAIRS = [(P(1, 4, 1, E=4), P(1, 4, 1)), (P(1, 4, 1, E=2), P(2, 2, 1)), (P(1, 4, 1, E=4), P(1, 2, 2, E=2)),
         (P(2, 2, 1, E=2), P(1, 1, 4, E=4, ETP=1)), (P(1, 4, 1), P(2, 2, 1, E=2))]


def _params_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return set(pa) == set(pb) and all(torch.equal(pa[n], pb[n]) for n in pa)


def check_pairs():
    """Each pair: the shadow equals the model built at the destination with the same seed, and
    the bytes received are the bytes the rank lacks (> 0 where it lacks experts)."""
    me = dist.get_rank()
    plans = list(dict.fromkeys(p for pair in PAIRS for p in pair))
    engines = {p: ModelEngine("actor", ARCH, layout_for(p), trainable=False, seed=SEED) for p in plans}
    out = {}
    for src, dst in PAIRS:
        shadow = switch_to_generation(engines[src], dst, segments=2, bucket_bytes=16 * 1024)
        out[f"{src}->{dst}"] = {"bitwise": _params_equal(shadow.module, engines[dst].module),
                                "received": shadow.switch_stats.bytes_received,
                                "lacking": shadow.table.bytes_lacking(me)}
        shadow.release()
    return out


def check_overlap():
    """The optimizer step overlapped with the switch in 3 segments (experts in their own
    optimizer): the shadow holds the stepped weights, like a plain step then a plain switch."""
    src, dst = P(1, 4, 1, E=2), P(2, 2, 1)
    out = {}
    for mode in ("plain", "K3"):
        eng = ModelEngine("actor", ARCH, layout_for(src), trainable=True, seed=SEED, optim=OptimConfig(lr=1e-2))
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, ARCH.vocab_size, (4, 16), generator=g)[eng.layout.d:eng.layout.d + 1]
        if mode == "plain":
            eng.train_step(lm_nll_step(ARCH.vocab_size, []), iter(tokens.split(1)), 1, 16, 1)
            shadow = switch_to_generation(eng, dst)
        else:
            eng.model.zero_grad_buffer()
            eng.optimizer.zero_grad()
            eng.forward_backward(lm_nll_step(ARCH.vocab_size, []), iter(tokens.split(1)), 1, 16, 1,
                                 forward_only=False)
            shadow = switch_to_generation(eng, dst, segments=3, optimizer_step=True)
        out[mode] = shadow
    res = {"same_shadow": _params_equal(out["plain"].module, out["K3"].module),
           "bytes_ok": out["K3"].switch_stats.bytes_received == out["K3"].table.bytes_lacking(dist.get_rank())}
    for s in out.values():
        s.release()
    return res


#: the tiny PPO model with 4 experts (top-2, load-balancing loss), every model at (1,4,1) with its
#: experts split over 2 ranks, 2 iterations, checkpointed after each
MOE_RUN = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "0.01", "--no-use-remove-padding", "--train-iters", "2", "--greedy",
           "--rollout-batch-size", "4", "--global-batch-size", "4", "--micro-batch-size", "1",
           "--max-new-tokens", "8", "--ppo-epochs", "1",
           "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--critic-tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2"]
#: resumed with the actor training at (P, D, T, E) = (2, 2, 1, 2) and generating at (1, 4, 1, 1) through
#: the switch, the critic at (1, 4, 1, 4), the frozen reference (rebuilt, its weights checked against
#: the saved fingerprint) at (1, 4, 1, 1)
RESUMED = ["--pipeline-model-parallel-size", "2", "--actor-gen-pipeline-model-parallel-size", "1",
           "--actor-gen-tensor-model-parallel-size", "1", "--actor-gen-expert-model-parallel-size", "1",
           "--critic-expert-model-parallel-size", "4",
           "--ref-pipeline-model-parallel-size", "1", "--ref-expert-model-parallel-size", "1"]
#: resumed with the actor and critic (and their optimizer state) at E = 1
AT_E1 = ["--expert-model-parallel-size", "1", "--critic-expert-model-parallel-size", "1"]
#: the actor trained at (P, D, T, E) = (1, 2, 2, 2) with ETP = T = 2 (the dispatcher gathers over T), the
#: critic at (1, 2, 2, 1) with ETP = 1 (its experts whole on both tensor-parallel ranks, their gradients
#: reduced over them): each tensor-parallel rank routes its share of the sequence
#: (megatron_patches.moe_tensor_parallel_without_sp)
TENSOR_PARALLEL = ["--tensor-model-parallel-size", "2", "--critic-tensor-model-parallel-size", "2",
                   "--critic-expert-model-parallel-size", "1", "--critic-expert-tensor-parallel-size", "1"]


def check_tiny_run():
    """The tiny MoE run straight, and resumed after its first iteration at other layouts with the
    actor generating through the switch at another E: the resumed run's iteration 2."""
    from puzzle.arguments import parse_args, validate_args
    from puzzle.data.tokenizers import build_tokenizer

    with tempfile.TemporaryDirectory(prefix="puzzle-moe-ckpt-") as d:
        ckpt = runtime().broadcast_object(d)
        straight = train_in_world(tiny_flags() + MOE_RUN + ["--save", ckpt, "--save-interval", "1"])
        resumed = train_in_world(tiny_flags() + MOE_RUN + RESUMED + ["--load", ckpt, "--ckpt-step", "1"])
        at_e1 = train_in_world(tiny_flags() + MOE_RUN + AT_E1 + ["--load", ckpt, "--ckpt-step", "1"])
    tensor_parallel = train_in_world(tiny_flags() + MOE_RUN + TENSOR_PARALLEL)
    from_scratch_at_e1 = train_in_world(tiny_flags() + MOE_RUN + AT_E1 + ["--train-iters", "1"])
    args = parse_args(tiny_flags() + MOE_RUN + RESUMED)
    vocab = build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
    roles = validate_args(args, dist.get_world_size(), vocab).roles
    actor = roles["actor"]
    table = routing_table_for(actor.arch, "actor", actor.plan, actor.gen_plan)
    return {"straight": straight["rows"], "resumed": resumed["rows"], "switch": resumed["switch"],
            "tensor_parallel": tensor_parallel["rows"], "at_e1": at_e1["rows"],
            "from_scratch_at_e1": from_scratch_at_e1["rows"],
            "at_e1_plans": _plans(tiny_flags() + MOE_RUN + AT_E1),
            "tensor_parallel_plans": _plans(tiny_flags() + MOE_RUN + TENSOR_PARALLEL),
            "plans": {r: str(s.plan) for r, s in roles.items()} | {"actor_gen": str(actor.gen_plan)},
            "lower_bound": max(table.bytes_lacking(r) for r in range(dist.get_world_size()))}


def _plans(argv) -> dict:
    """{role: its training or scoring plan with its ETP} of the run ``argv``."""
    from puzzle.arguments import parse_args, validate_args
    from puzzle.data.tokenizers import build_tokenizer

    args = parse_args(argv)
    vocab = build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
    return {r: f"{s.plan} ETP={s.plan.ETP}" for r, s in validate_args(args, dist.get_world_size(), vocab).roles.items()}


if __name__ == "__main__":
    world_main([("pairs", check_pairs), ("overlap", check_overlap), ("tiny_run", check_tiny_run)])
