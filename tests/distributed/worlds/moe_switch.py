"""4-rank world: mixture-of-experts models between layouts of different E.

* the switch: a MoE actor moved between (P, D, T, E) layouts equals the model built at the
  destination (bitwise), each rank receiving exactly the bytes it lacks, also overlapped with
  the optimizer step;
* packed micro-batches holding different token counts per rank through an actor at E = 2 (T = 1
  and 2, both token dispatchers) and at E = 1; token-budget micro-batches at E = 2 against fixed-count
  ones; the load-balancing loss metric when DP ranks ran different numbers of micro-batches;
* the tiny MoE PPO run saved at E = 2 and resumed with the actor and critic at E = 1, optimizer
  state included (experts keep an optimizer of their own at every E), repeats iteration 2 exactly;
* the tiny MoE PPO run trained at T = 2 without sequence parallelism (the actor's experts split over
  ETP = 2, the critic's whole at E = ETP = 1) for the straight run's iterations, to compare with it;
* LoRA on the experts (tests/distributed/worlds/lora_experts.py);
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
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.dataflow.steps import lm_nll_step
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


#: packed micro-batches: rows of these lengths (tokens), 2 rows a micro-batch, each DP rank its share
#: (so the ranks of an expert group hold different token counts)
PACKED_LENGTHS = [5, 17, 9, 12, 6, 20, 8, 14]
#: name -> (layout, --moe-token-dispatcher-type): E = 1 (the reference), E = 2 with each dispatcher,
#: and T = 2 (ETP = 2: the all-to-all dispatcher gathers split sizes over T) with each
PACKED_LAYOUTS = {"E1": (P(1, 4, 1), "allgather"), "E2/allgather": (P(1, 4, 1, E=2), "allgather"),
                  "E2/alltoall": (P(1, 4, 1, E=2), "alltoall"), "T2E2/allgather": (P(1, 2, 2, E=2), "allgather"),
                  "T2E2/alltoall": (P(1, 2, 2, E=2), "alltoall")}


def _packed_nll_step(store: dict):
    """Negative log-likelihood of packed micro-batches (pack_rows), summed over the next-token
    predictions within each row; ``store`` gets each row's log-probs (batch row -> list)."""
    from functools import partial

    from puzzle.dataflow.steps import _run, _unwrap
    from puzzle.engine.vocab_parallel import vocab_parallel_logprobs

    def loss_func(mb, tp_group, output):
        lp = vocab_parallel_logprobs(output[:, :-1], mb.tokens[:, 1:], tp_group, ARCH.vocab_size)[0]
        rows = [lp[s:s + n - 1] for s, n in zip(mb.seq_starts.tolist(), mb.packed_seq_params.lengths)]
        store.update({r: x.detach().tolist() for r, x in zip(mb.rows.tolist(), rows)})
        total = torch.cat(rows)
        return -total.sum(), torch.tensor(total.numel(), dtype=torch.int), {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb, _unwrap(model).pg_collection.tp)

    return forward_step


def _packed_train_step(plan, dispatcher: str, grouped_gemm: bool = False):
    """One training step of the actor at ``plan`` on PACKED_LENGTHS' packed micro-batches (each DP
    rank its share, two rows per micro-batch), the load-balancing loss on: (the engine, its result
    row: gradient norm, load-balancing loss summed over the world, every row's log-probs, ...)."""
    from dataclasses import replace

    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from puzzle.dataflow.micro_batching import MicroBatch, pack_rows

    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, ARCH.vocab_size, (len(PACKED_LENGTHS), max(PACKED_LENGTHS)), generator=g)
    arch = replace(ARCH, moe_aux_loss_coeff=0.01, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped_gemm)
    eng = ModelEngine("actor", arch, layout_for(plan), trainable=True, seed=SEED, optim=OptimConfig(lr=1e-2))
    share = len(PACKED_LENGTHS) // plan.D
    micro = []
    for first in range(eng.layout.d * share, (eng.layout.d + 1) * share, 2):
        rows = [first, first + 1]
        lengths = [PACKED_LENGTHS[r] for r in rows]
        packing = pack_rows(tokens[rows], torch.tensor(lengths), torch.zeros(2, dtype=torch.long))
        micro.append(MicroBatch(packing.tokens, torch.tensor(lengths), torch.zeros(2, dtype=torch.long), None,
                                position_ids=packing.position_ids, seq_starts=packing.seq_starts,
                                packed_seq_params=packing.packed_seq_params, rows=torch.tensor(rows)))
    store = {}
    clear_aux_losses_tracker()
    norm = eng.train_step(_packed_nll_step(store), iter(micro), len(micro), max(PACKED_LENGTHS) * 2, 1)["grad_norm"]
    aux = sum(float(e["values"].sum()) for e in get_moe_layer_wise_logging_tracker().values())
    clear_aux_losses_tracker()
    sums = torch.tensor([aux], dtype=torch.float64)  # at T > 1 each TP rank holds its tokens' part
    dist.all_reduce(sums)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, store if eng.layout.t == 0 else {})
    logprobs = {r: lp for part in rows for r, lp in part.items()}
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([micro[0].tokens.shape[1]]))
    return eng, {"grad_norm": norm, "aux_loss_sum": float(sums[0]),
                 "logprobs": [logprobs[r] for r in sorted(logprobs)],
                 "first_micro_batch_tokens": [int(c) for c in counts], "packed_shape": list(micro[0].tokens.shape)}


def check_packed_experts():
    """The same packed micro-batches (each DP rank its own token count) through an actor at E = 1
    and at E = 2 (T = 1 and 2) with each token dispatcher, the load-balancing loss on: every row's
    log-probs, the gradient norm (experts' and routers' gradients included) and the load-balancing
    loss summed over the world, to compare within fp32 rounding."""
    return {name: _packed_train_step(plan, dispatcher)[1] for name, (plan, dispatcher) in PACKED_LAYOUTS.items()}


#: PACKED_LAYOUTS entries run again with --moe-grouped-gemm
GROUPED_LAYOUTS = ("E1", "E2/alltoall", "T2E2/allgather")


def check_grouped_gemm_experts():
    """--moe-grouped-gemm against megatron's SequentialMLP on the same packed training step: the
    row log-probs, the gradient norm, the load-balancing loss, and the max abs difference of every
    parameter's gradient and updated weight on this rank."""
    out = {}
    for name in GROUPED_LAYOUTS:
        plan, dispatcher = PACKED_LAYOUTS[name]
        ref_eng, ref = _packed_train_step(plan, dispatcher)
        eng, got = _packed_train_step(plan, dispatcher, grouped_gemm=True)
        experts = {type(m).__name__ for m in eng.module.modules() if hasattr(m, "local_experts")}
        pairs = list(zip(eng.module.parameters(), ref_eng.module.parameters()))
        out[name] = {"experts": sorted(experts), "ref": ref, "grouped": got,
                     "grad_max_diff": max(float((a.main_grad - b.main_grad).abs().max()) for a, b in pairs),
                     "params_max_diff": max(float((a - b).abs().max()) for a, b in pairs)}
    return out


def _rollout(seed: int = 5):
    """12 rows of prompts (4 tokens) and responses of different lengths, with PPO's fields: under a
    20-token budget two of four balanced DP shares fit one micro-batch, two need two."""
    from puzzle.dataflow.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    R, responses = 12, torch.tensor([1, 2, 1, 12, 3, 3, 1, 1, 1, 1, 3, 12])
    tokens = torch.randint(0, ARCH.vocab_size, (12, 4 + R), generator=g)
    old_logprobs = -5 - torch.rand(12, R, generator=g)
    return RolloutBatch(tokens, torch.full((12,), 4), responses, R, old_logprobs=old_logprobs,
                        advantages=torch.randn(12, R, generator=g))


def check_token_budget_experts():
    """Token-budget micro-batches (--use-dynamic-bsz, the stages' MicroBatching) against one row a
    micro-batch, for an actor with its experts split over E = 2 ranks (all-gather dispatcher): the
    gradients of one PPO mini-batch, the micro-batches each DP rank ran and the count its balanced
    share alone would need (ranks differ: an expert group's dispatcher collectives pair up only
    because MicroBatching gives every DP rank the same count)."""
    from dataclasses import replace

    from puzzle.pipeline.stage import run_stage
    from puzzle.dataflow import steps
    from puzzle.dataflow.micro_batching import MicroBatching, micro_batch_rows, share_rows

    arch = replace(ARCH, moe_token_dispatcher_type="allgather")  # no load-balancing loss: it is per micro-batch
    eng = ModelEngine("actor", arch, layout_for(P(1, 4, 1, E=2)), trainable=True, seed=SEED,
                      optim=OptimConfig(lr=1e-2))
    batch, budget = _rollout(), 20
    jobs = [("actor", steps.actor_train_step(ARCH.vocab_size, 1.0, batch.max_new_tokens, 0.2, 0.0))]
    out = {}
    for name, dynamic in (("fixed", False), ("budget", True)):
        micro = MicroBatching({"actor": eng}, 1, packed=True, seq_multiple=1, pad_id=0, dynamic_bsz=dynamic)
        eng.zero_grad()
        contexts = micro.contexts(batch, jobs, budget)
        run_stage(contexts, forward_only=False)
        out[name] = {"grads": torch.cat([b.grad_data.float().flatten() for b in
                                         eng.model.buffers + eng.model.expert_parallel_buffers]).clone(),
                     "micro_batches": contexts[0].num_microbatches}
    share = batch.rows(share_rows(batch, eng.layout, balance=True))
    diff = (out["fixed"]["grads"] - out["budget"]["grads"]).abs().max()
    return {"grad_diff": float(diff), "grad_scale": float(out["fixed"]["grads"].abs().max()),
            "micro_batches": [out["fixed"]["micro_batches"], out["budget"]["micro_batches"]],
            "share_alone_needs": len(micro_batch_rows(share, 1, budget))}


def check_aux_loss_metric_with_unequal_micro_batch_counts():
    """moe_aux_loss_metrics when DP rank r ran r + 1 micro-batches (--use-dynamic-bsz): megatron's
    tracker filled with known losses per micro-batch and MoE layer (3 of ARCH's 4 layers); the
    metric and the mean it must equal."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, save_to_aux_losses_tracker

    from puzzle.engine.moe_metrics import moe_aux_loss_metrics

    me = dist.get_rank()
    arch = ModelArch(**{**vars(ARCH), "moe_aux_loss_coeff": 0.01})
    layout = SimpleNamespace(t=0, p=0, plan=P(1, 4, 1))
    engine = SimpleNamespace(arch=arch, member=True, layout=layout)
    clear_aux_losses_tracker()
    values = []
    for k in range(me + 1):
        for layer in (0, 2, 3):
            values.append(1.0 + 0.1 * me + 0.01 * k + 0.001 * layer)
            save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(values[-1]), layer + 1, 4)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)
    every = [v for part in every for v in part]
    return {"metric": moe_aux_loss_metrics([engine], [me + 1], torch.device("cpu"))["moe_aux_loss"],
            "mean": sum(every) / len(every)}


#: the tiny PPO model with 4 experts (top-2, load-balancing loss), every model at (1,4,1) with its
#: experts split over 2 ranks, 2 iterations, checkpointed after each; packed micro-batches (the
#: default) holding different token counts on the ranks of an expert group
MOE_RUN = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "0.01", "--train-iters", "2", "--greedy",
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
    grouped_gemm = train_in_world(tiny_flags() + MOE_RUN + ["--moe-grouped-gemm"])
    args = parse_args(tiny_flags() + MOE_RUN + RESUMED)
    vocab = build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
    roles = validate_args(args, dist.get_world_size(), vocab).roles
    actor = roles["actor"]
    table = routing_table_for(actor.arch, "actor", actor.plan, actor.gen_plan)
    return {"straight": straight["rows"], "resumed": resumed["rows"], "switch": resumed["switch"],
            "tensor_parallel": tensor_parallel["rows"], "at_e1": at_e1["rows"],
            "from_scratch_at_e1": from_scratch_at_e1["rows"], "grouped_gemm": grouped_gemm["rows"],
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


def check_lora_experts():
    """LoRA on the experts at E = 2 (tests/distributed/worlds/lora_experts.py: gradients, the switch
    moving adapters only, checkpoints across layouts)."""
    from tests.distributed.worlds.lora_experts import check_four_ranks

    return check_four_ranks()


if __name__ == "__main__":
    world_main([("pairs", check_pairs), ("lora_experts", check_lora_experts), ("overlap", check_overlap), ("packed_experts", check_packed_experts),
                ("grouped_gemm_experts", check_grouped_gemm_experts),
                ("token_budget_experts", check_token_budget_experts),
                ("aux_loss_metric", check_aux_loss_metric_with_unequal_micro_batch_counts),
                ("tiny_run", check_tiny_run)])
