"""4-rank world: models with different layouts side by side (foundation issue)."""

import time

import torch
import torch.distributed as dist

from puzzle.config import ModelArch
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.dataflow.steps import lm_nll_step
from puzzle.lora_config import LoRAConfig
from puzzle.models.decode_layer import lean_step_covers
from puzzle.models.init import local_shard
from puzzle.models.lora import adapter_init_value, target_linears
from puzzle.models.param_layout import shard_slices
from tests.harness import world_main

ARCH = ModelArch.llama(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                       num_query_groups=4, vocab_size=200, make_vocab_size_divisible_by=64, seq_length=32)
B, S = 4, 12


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARCH.vocab_size, (B, S), generator=g)


def _logprobs_at(plan: ParallelPlan, role="actor"):
    layout = layout_for(plan)
    eng = ModelEngine(role, ARCH, layout, trainable=False, seed=7)
    if not eng.member:
        return None
    tokens = _tokens()
    # each DP rank takes its share of the batch
    share = B // plan.D
    mine = tokens[layout.d * share:(layout.d + 1) * share]
    store = []
    mbs = 1
    with torch.no_grad():
        eng.forward_backward(lm_nll_step(ARCH.vocab_size, store), iter(mine.split(mbs)), share // mbs, S, mbs,
                             forward_only=True)
    if not layout.is_last_stage or layout.t != 0:
        return None
    return {"d": layout.d, "lp": torch.cat(store).tolist()}


def check_layouts_agree():
    """Same seed -> same log-probs at every layout (layout-independent init + vocab-parallel lp)."""
    out = {}
    for plan in [ParallelPlan(1, 1, 1), ParallelPlan(1, 1, 4), ParallelPlan(2, 1, 2),
                 ParallelPlan(2, 2, 1), ParallelPlan(1, 2, 2), ParallelPlan(4, 1, 1)]:
        res = _logprobs_at(plan)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
        parts = sorted([g for g in gathered if g is not None], key=lambda g: g["d"])
        out[str(plan)] = [row for g in parts for row in g["lp"]]
    return out


def check_two_layouts_train():
    """actor (2,1,2) and critic (1,2,2) live together; each runs forward+backward+step."""
    la, lc = layout_for(ParallelPlan(2, 1, 2)), layout_for(ParallelPlan(1, 2, 2))
    actor = ModelEngine("actor", ARCH, la, trainable=True, optim=OptimConfig(lr=1e-3), seed=1)
    critic = ModelEngine("critic", ARCH, lc, trainable=True, optim=OptimConfig(lr=1e-3), seed=2)
    tokens = _tokens(1)
    res = {}
    before = [p.detach().clone() for p in actor.module.parameters()]
    store = []
    st = actor.train_step(lm_nll_step(ARCH.vocab_size, store), iter(tokens.split(1)), B, S, 1)
    res["actor_grad_norm"] = st["grad_norm"]
    res["actor_changed"] = any(not torch.equal(a, p) for a, p in zip(before, actor.module.parameters()))

    share = B // 2
    mine = tokens[lc.d * share:(lc.d + 1) * share]

    def value_step(data_iterator, model):
        mb = next(data_iterator)
        pos = torch.arange(mb.shape[1]).unsqueeze(0).expand_as(mb)
        values = model(mb, pos, None)

        def loss_func(v):
            loss = (v.squeeze(-1) - 1.0).pow(2).sum()
            return loss, torch.tensor(v.numel(), dtype=torch.int), {"v": v.detach().mean()}

        return values, loss_func

    cbefore = [p.detach().clone() for p in critic.module.parameters()]
    st = critic.train_step(value_step, iter(mine.split(1)), share, S, 1)
    res["critic_grad_norm"] = st["grad_norm"]
    res["critic_changed"] = any(not torch.equal(a, p) for a, p in zip(cbefore, critic.module.parameters()))
    res["value_shape"] = list(critic.module(mine[:1], torch.arange(S).unsqueeze(0), None).shape)
    return res


LORA = LoRAConfig(dim=4, alpha=8.0)
LORA_ARCH = ModelArch.llama(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                            vocab_size=100, make_vocab_size_divisible_by=64, seq_length=16)
LB, LS = 2, 8  # rows and tokens of the LoRA checks
LORA_B_STD = 0.05  # B drawn non-zero for the gradient check, so that A gets a gradient too


def _lora_tokens(seed):
    return torch.randint(0, LORA_ARCH.vocab_size, (LB, LS), generator=torch.Generator().manual_seed(seed))


def _lora_logprobs_and_grads(plan: ParallelPlan):
    """At ``plan``: whether the LoRA actor's log-probs (B zero) equal the plain actor's bitwise, then
    one backward with B non-zero: its adapters' gradient shards (global spec, T, t, grad)."""
    layout = layout_for(plan)
    plain = ModelEngine("actor", LORA_ARCH, layout, trainable=False, seed=7)
    eng = ModelEngine("actor", LORA_ARCH, layout, trainable=False, seed=7, lora=LORA)
    if not eng.member:
        return None
    tokens = _lora_tokens(2)
    lps = []
    for e in (plain, eng):
        store = []
        with torch.no_grad():
            e.forward_backward(lm_nll_step(LORA_ARCH.vocab_size, store), iter(tokens.split(1)), LB, LS, 1, forward_only=True)
        lps.append(torch.cat(store) if store else None)
    params = dict(eng.module.named_parameters())
    with torch.no_grad():
        for local, spec in eng.adapter_specs.items():
            params[local].requires_grad_(True)  # a frozen engine's adapters: trained here without DDP
            if local.endswith("linear_out.weight"):
                params[local].copy_(local_shard(spec, adapter_init_value(spec, 7, LORA_B_STD), plan.T, layout.t))
    # megatron's default loss convention: each micro-batch's token mean / micro-batches = the token mean
    eng.forward_backward(lm_nll_step(LORA_ARCH.vocab_size), iter(tokens.split(1)), LB, LS, 1, forward_only=False)
    return {"equal_bitwise": lps[0] is None or torch.equal(lps[0], lps[1]),
            # generation's lean decode step bypasses module calls: adapted layers must not take it
            "lean_decode": [[lean_step_covers(layer) for layer in e.module.decoder.layers] for e in (plain, eng)],
            "grads": [(spec, plan.T, layout.t, params[n].grad.clone()) for n, spec in eng.adapter_specs.items()]}


def _lora_optimizer_step():
    """The trainable LoRA actor at (2,1,2): the base is frozen, DDP and the optimizer hold the
    adapters only, and one step moves them and no base weight."""
    eng = ModelEngine("actor", LORA_ARCH, layout_for(ParallelPlan(2, 1, 2)), trainable=True, optim=OptimConfig(lr=1e-3),
                      seed=7, lora=LORA)
    params = dict(eng.module.named_parameters())
    base = {n: p.detach().clone() for n, p in params.items() if n not in eng.adapter_specs}
    adapters = {n: params[n].detach().clone() for n in eng.adapter_specs}
    eng.train_step(lm_nll_step(LORA_ARCH.vocab_size), iter(_lora_tokens(3).split(1)), LB, LS, 1)
    return eng, {"frozen_base": all(not params[n].requires_grad for n in base),
            "optimizer_numel": sum(p.numel() for g in eng.optimizer.param_groups for p in g["params"]),
            "ddp_grad_numel": sum(b.grad_data.numel() for b in eng.model.buffers),
            "adapter_numel": sum(p.numel() for p in adapters.values()),
            "base_unchanged": all(torch.equal(v, params[n]) for n, v in base.items()),
            "adapters_moved": sum(not torch.equal(v, params[n]) for n, v in adapters.items()),
            "adapters": len(adapters)}


def _reference_lora_grads(specs: dict) -> dict:
    """Plain PyTorch LoRA on the whole weights (the T=1 model): W x + (alpha/dim) B A x on each target
    linear, the token-mean NLL, its gradients in A and B."""
    eng = ModelEngine("actor", LORA_ARCH, layout_for(ParallelPlan(1, 1, 1)), trainable=False, seed=7)
    leaves = {name: adapter_init_value(spec, 7, LORA_B_STD).requires_grad_(True) for name, spec in specs.items()}
    for local, _, linear in target_linears(eng.module, LORA):
        a, b = leaves[f"{local}.adapter.linear_in.weight"], leaves[f"{local}.adapter.linear_out.weight"]
        linear.register_forward_hook(lambda m, args, out, a=a, b=b: (out[0] + LORA.scale * args[0] @ a.T @ b.T, out[1]))
    tokens = _lora_tokens(2)
    logits = eng.module(tokens, torch.arange(LS).unsqueeze(0).expand_as(tokens), None)
    lp = logits[:, :-1, :LORA_ARCH.vocab_size].float().log_softmax(-1).gather(-1, tokens[:, 1:, None])
    (-lp.mean()).backward()
    return {name: leaf.grad for name, leaf in leaves.items()}


def check_lora():
    """LoRA at (1,1,1), (1,1,2), (2,1,2): zero B changes no log-prob bit, the base is frozen (the
    optimizer holds the adapters only), and the adapters' gradients equal plain PyTorch's."""
    out = {}
    for plan in [ParallelPlan(1, 1, 1), ParallelPlan(1, 1, 2), ParallelPlan(2, 1, 2)]:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, _lora_logprobs_and_grads(plan))
        ranks = [g for g in gathered if g is not None]
        if dist.get_rank() != 0:
            continue
        full, replicas_agree = _assemble(ranks)
        if not out:  # the reference: specs are the same at every layout
            ref = _reference_lora_grads({spec.name: spec for r in ranks for spec, *_ in r["grads"]})
        worst = max((full[n] - ref[n]).abs().max().item() / ref[n].abs().max().item() for n in ref)
        out[str(plan)] = {"equal_bitwise": all(r["equal_bitwise"] for r in ranks),
                          "lean_decode_plain_lora": [r["lean_decode"] for r in ranks],
                          "replicas_agree": replicas_agree, "names": sorted(full) == sorted(ref),
                          "worst_relative_grad_error": worst,
                          "min_grad_max": min(ref[n].abs().max().item() for n in ref)}
    eng, step = _lora_optimizer_step()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, step)
    out["optimizer_step"] = gathered if dist.get_rank() == 0 else None
    out["reference_is_base"] = _lora_reference_is_base(eng)
    out["checkpoint"] = _lora_checkpoint_reshards(eng)
    return out


def check_lora_switch():
    """The LoRA actor trained at (1,2,2) generates at (1,4,1) through the switch: the first switch
    lays the base and the adapters out, the one overlapped with the next optimizer step moves only
    the adapters (the bytes each rank lacks: half of every split adapter here); generation with the
    merged adapters gives the training model's greedy tokens and log-probs (adapters unmerged, at
    T=2), and the base comes back bit for bit after it. (Trainable engines cover the world: megatron's
    optimizer gathers over it.)"""
    from puzzle.dataflow.actor_switch import ActorSwitch
    from puzzle.rollout import SamplingParams, generate

    dist.barrier()
    t0 = time.perf_counter()
    eng = ModelEngine("actor", LORA_ARCH, layout_for(ParallelPlan(1, 2, 2)), trainable=True,
                      optim=OptimConfig(lr=1e-2), seed=7, lora=LORA)
    switch = ActorSwitch(eng, ParallelPlan(1, 4, 1))
    prompts, greedy = [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(6, greedy=True)
    gen = switch.generation_engine()  # the first switch: base and adapters (B zero: the base model)
    res = {"member": gen.member, "first_bytes": switch.last_stats.bytes_received}
    base_lp = generate(gen, prompts, greedy, seed=0).logprobs if gen.member else None
    switch.release()
    base = [p.clone() for p in gen.module.parameters()] if gen.member else []
    mine = _lora_tokens(3)[eng.layout.d:eng.layout.d + 1]  # LB = 2 rows, one per DP rank
    eng.forward_backward(lm_nll_step(LORA_ARCH.vocab_size), iter([mine]), 1, LS, 1, forward_only=False)
    switch.optimizer_step_and_switch()  # the step (B moves) overlapped with the switch of the adapters
    res["second_bytes"] = switch.last_stats.bytes_received
    gen = switch.generation_engine()
    if gen.member:
        out, train = generate(gen, prompts, greedy, seed=0), generate(eng, prompts, greedy, seed=0)
        res.update(tokens_equal=out.responses() == train.responses(),
                   logprob_diff=(out.logprobs - train.logprobs).abs().max().item(),
                   base_logprob_diff=(out.logprobs - base_lp).abs().max().item())
        switch.release()
        res["base_restored"] = all(torch.equal(a, b) for a, b in zip(base, gen.module.parameters()))
    dist.barrier()
    res["seconds"] = time.perf_counter() - t0
    return res
def _lora_reference_is_base(eng):
    """The scoring stage of the trained LoRA actor with a KL term: no reference engine; the reference
    log-probs (the actor, adapters off) equal the plain base model's bitwise, the actor's differ."""
    from types import SimpleNamespace

    from puzzle.dataflow.batch import RolloutBatch
    from puzzle.dataflow.micro_batching import MicroBatching
    from puzzle.dataflow.scoring_stage import ScoringStage

    plain = ModelEngine("actor", LORA_ARCH, eng.layout, trainable=False, seed=7)
    R = LS - 3
    batch = RolloutBatch(_lora_tokens(4), torch.full((LB,), 3), torch.full((LB,), R), R)
    ppo = SimpleNamespace(greedy=True, temperature=1.0, batch_invariant_mode=False, log_prob_max_token_len_per_gpu=None)
    out = {}
    for name, engine, base in (("lora", eng, True), ("plain", plain, False)):
        cfg = SimpleNamespace(ppo=ppo, score_placement="sequential", reference_is_actor_base=base)
        engines = {"actor": engine}
        stage = ScoringStage(cfg, engines, MicroBatching(engines, 1, False, 1, 0), None, LORA_ARCH.vocab_size)
        out[name] = (stage.run(batch, 0)[0], [role for role, _ in stage.jobs(R)])
    (lora, jobs), (plain_f, _) = out["lora"], out["plain"]
    return {"jobs": jobs, "ref_equals_base": torch.equal(lora["ref_logprobs"], plain_f["old_logprobs"]),
            "actor_differs": not torch.equal(lora["old_logprobs"], plain_f["old_logprobs"])}


def _lora_checkpoint_reshards(eng):
    """The trained actor's adapters and Adam state saved at (2,1,2) (puzzle.checkpointing's role
    state dict: the adapters alone) and loaded at (1,4,1): the same adapters and moments, compared
    as whole tensors."""
    other = ModelEngine("actor", LORA_ARCH, layout_for(ParallelPlan(1, 4, 1)), trainable=True,
                        optim=OptimConfig(lr=1e-3), seed=9, lora=LORA)  # another seed: the load must set A
    role_state_through_checkpoint(eng, other)
    whole = {(label, what): _whole_adapters(e, what) for label, e in (("saved", eng), ("loaded", other))
             for what in (None, "exp_avg", "exp_avg_sq")}
    if dist.get_rank() != 0:
        return None
    out = {}
    for what in (None, "exp_avg", "exp_avg_sq"):
        a, b = whole["saved", what], whole["loaded", what]
        out[what or "weights"] = {"names_agree": sorted(a) == sorted(b) and len(a) > 0,
                                  "equal": all(torch.equal(a[n], b[n]) for n in a),
                                  "nonzero": sum(bool(a[n].abs().sum() > 0) for n in a)}
    return out


def role_state_through_checkpoint(eng, other) -> None:
    """``eng``'s role state dict (puzzle.checkpointing's: a LoRA actor's adapters alone, with their
    Adam state) saved by megatron's dist_checkpointing into a fresh directory and loaded into
    ``other`` (another layout); the directory removed."""
    import os
    import shutil
    import tempfile

    from megatron.core import dist_checkpointing

    from puzzle.checkpointing import _load_model_state, _role_sharded_state_dict

    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    path = os.path.join(root[0], "actor")
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save(_role_sharded_state_dict(eng, is_loading=False, with_optimizer=True), path)
    state = dist_checkpointing.load(_role_sharded_state_dict(other, is_loading=True, with_optimizer=True), path)
    _load_model_state(other, state["model"])
    other.optimizer.load_state_dict(state["optimizer"])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0], ignore_errors=True)


def _whole_adapters(eng, state_key=None):
    """{global name: whole tensor} of an engine's adapters (or of their Adam ``state_key``),
    assembled on rank 0 from every rank's shards."""
    params = dict(eng.module.named_parameters()) if eng.member else {}
    value = (lambda p: p) if state_key is None else (lambda p: eng.optimizer.optimizer.state[p][state_key])
    mine = [(spec, eng.layout.plan.T, eng.layout.t, value(params[n]).detach().clone())
            for n, spec in eng.adapter_specs.items()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"grads": mine})
    return _assemble(gathered)[0] if dist.get_rank() == 0 else {}


def _assemble(ranks):
    """The whole gradient of every adapter from its TP shards; whether the TP replicas of the
    unsplit ones are equal."""
    full, agree = {}, True
    for r in ranks:
        for spec, T, t, g in r["grads"]:
            if spec.name not in full:
                full[spec.name] = torch.zeros(spec.global_shape)
            boxes = shard_slices(spec, T, t)
            pieces = g.split([b[spec.split_dim][1] - b[spec.split_dim][0] for b in boxes], dim=spec.split_dim) \
                if spec.split_dim is not None and T > 1 else [g]
            for box, piece in zip(boxes, pieces):
                where = tuple(slice(a, b) for a, b in box)
                if spec.kind == "replicated" and t > 0:
                    agree &= torch.equal(full[spec.name][where], piece.float())
                full[spec.name][where] = piece.float()
    return full, agree


if __name__ == "__main__":
    world_main([("layouts_agree", check_layouts_agree), ("two_layouts_train", check_two_layouts_train),
                ("lora", check_lora), ("lora_switch", check_lora_switch)])
