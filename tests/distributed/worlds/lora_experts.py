"""LoRA on the experts of MoE layers (issue #39): checks run by the MoE worlds (moe.py in a world of
one, moe_switch.py in the 4-rank world), not a world of its own.

* at each layout: B zero changes no log-prob bit against the base (the model, adapters off); with B drawn non-zero,
  one training step's reduced adapter gradients (megatron's DDP: experts' over their expert-DP
  group) equal a plain PyTorch LoRA on the whole weights (the (1,1,1) model with
  ``W x + s B A x`` hooks on every target linear, each expert's included);
* (4 ranks) the adapters and their Adam moments saved at one (P, D, T, E) and loaded at another;
  the switch of the LoRA actor to another E (the base laid out once, then the adapters only:
  exactly the adapter bytes each rank lacks) and the merged copy's log-probs equal to the training
  model's;
* (1 rank) the static MoE decode step refused on adapted experts; each MoE family's adapters
  exported for PEFT give puzzle's greedy tokens on transformers.
"""

import os

import torch
import torch.distributed as dist

from puzzle.config import ModelArch
from puzzle.dataflow.steps import lm_nll_step
from puzzle.engine.model_engine import ModelEngine, OptimConfig
from puzzle.lora_config import LoRAConfig
from puzzle.models.init import local_shard, tp_split
from puzzle.models.lora import adapter_init_value, target_linears
from puzzle.models.param_layout import shard_slices
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan as P
from tests.distributed.worlds.model_families import PROMPTS as PROMPTS_OF_EXPORT

LORA = LoRAConfig(dim=4, alpha=8.0)
#: 2 layers: layer 0 a MoE layer (4 experts of width 16, top-2), layer 1 dense
ARCH = ModelArch.llama(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                       vocab_size=100, make_vocab_size_divisible_by=64, seq_length=16, num_experts=4,
                       moe_ffn_hidden_size=16, moe_router_topk=2, moe_layer_pattern=(1, 0))
ROWS, LEN, SEED, B_STD = 4, 8, 7, 0.05


def _tokens(seed=2):
    return torch.randint(0, ARCH.vocab_size, (ROWS, LEN), generator=torch.Generator().manual_seed(seed))


def _my_rows(layout, seed=2):
    """This DP rank's rows (one micro-batch each): the batch split over D."""
    n = ROWS // layout.plan.D
    return _tokens(seed)[layout.d * n:(layout.d + 1) * n]


def _set_b(eng, std):
    """Every B to its layout-independent N(0, std) draw (a fresh adapter's B is zero)."""
    params = dict(eng.module.named_parameters())
    with torch.no_grad():
        for local, spec in eng.adapter_specs.items():
            if local.endswith("linear_out.weight"):
                params[local].copy_(local_shard(spec, adapter_init_value(spec, SEED, std), *tp_split(spec.name, eng.layout)))


def _logprobs(eng, rows):
    store = []
    with torch.no_grad():
        eng.forward_backward(lm_nll_step(ARCH.vocab_size, store), iter(rows.split(1)), len(rows), LEN, 1,
                             forward_only=True)
    return torch.cat(store) if store else None


def _grads_at(plan, arch=ARCH, keep=None):
    """At ``plan``: zero B's log-probs equal the base's (the same model, adapters off) bitwise; one
    backward (B non-zero) through megatron's DDP: this rank's reduced adapter gradients (spec, ways,
    index, grad). ``keep`` (a dict) gets the engine under ``plan``."""
    from puzzle.models.lora import adapters_disabled

    layout = layout_for(plan)
    eng = ModelEngine("actor", arch, layout, trainable=True, optim=OptimConfig(lr=1e-2), seed=SEED, lora=LORA)
    if keep is not None:
        keep[plan] = eng
    if not eng.member:
        return None
    rows = _my_rows(layout)
    lps = [_logprobs(eng, rows)]
    with adapters_disabled(eng.module):
        lps.append(_logprobs(eng, rows))
    _set_b(eng, B_STD)
    eng.zero_grad()
    eng.forward_backward(lm_nll_step(ARCH.vocab_size), iter(rows.split(1)), len(rows), LEN, 1, forward_only=False)
    params = dict(eng.module.named_parameters())
    return {"equal_bitwise": lps[0] is None or torch.equal(lps[0], lps[1]),
            "grads": [(spec, *tp_split(spec.name, layout), params[n].main_grad.detach().clone())
                      for n, spec in eng.adapter_specs.items()]}


def _reference_grads(specs: dict) -> dict:
    """Plain PyTorch LoRA on the whole weights (the (1,1,1) model): ``W x + s B A x`` on each target
    linear (every expert's linear_fc1 and linear_fc2 too), the token mean of the NLL over the whole
    batch, its gradients in A and B."""
    eng = ModelEngine("actor", ARCH, layout_for(P(1, 1, 1)), trainable=False, seed=SEED)
    leaves = {name: adapter_init_value(spec, SEED, B_STD).requires_grad_(True) for name, spec in specs.items()}
    for local, _, linear in target_linears(eng.module, LORA):
        a, b = leaves[f"{local}.adapter.linear_in.weight"], leaves[f"{local}.adapter.linear_out.weight"]
        linear.register_forward_hook(lambda m, args, out, a=a, b=b: (out[0] + LORA.scale * args[0] @ a.T @ b.T, out[1]))
    tokens = _tokens()
    logits = eng.module(tokens, torch.arange(LEN).unsqueeze(0).expand_as(tokens), None)
    lp = logits[:, :-1, :ARCH.vocab_size].float().log_softmax(-1).gather(-1, tokens[:, 1:, None])
    (-lp.mean()).backward()
    return {name: leaf.grad for name, leaf in leaves.items()}


def assemble(ranks):
    """{global name: whole tensor} from the (spec, ways, index, shard) of every rank; whether the
    replicas of each piece agree."""
    full, seen, agree = {}, set(), True
    for spec, ways, index, g in (x for r in ranks for x in r["grads"]):
        out = full.setdefault(spec.name, torch.zeros(spec.global_shape))
        boxes = shard_slices(spec, ways, index)
        k = spec.split_dim
        pieces = g.split([b[k][1] - b[k][0] for b in boxes], dim=k) if k is not None and ways > 1 else [g]
        for box, piece in zip(boxes, pieces):
            where = tuple(slice(a, b) for a, b in box)
            if (spec.name, box) in seen:
                agree &= torch.equal(out[where], piece.float())
            seen.add((spec.name, box))
            out[where] = piece.float()
    return full, agree


def check_expert_grads(plans, keep=None):
    """Zero-B log-probs and adapter gradients against the plain PyTorch reference at each of
    ``plans`` (name -> (plan, arch overrides)); rank 0 gets the results (``keep``: _grads_at's)."""
    from dataclasses import replace

    layout_for(P(1, 1, 1))  # collective: the reference's layout
    out, ref = {}, None
    for name, (plan, overrides) in plans.items():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, _grads_at(plan, replace(ARCH, **overrides), keep))
        if dist.get_rank() != 0:
            continue
        ranks = [g for g in gathered if g is not None]
        full, agree = assemble(ranks)
        if ref is None:
            ref = _reference_grads({spec.name: spec for r in ranks for spec, *_ in r["grads"]})
        out[name] = {"equal_bitwise": all(r["equal_bitwise"] for r in ranks), "replicas_agree": agree,
                     "names": sorted(full) == sorted(ref), "expert_adapters": sum(".mlp.experts." in n for n in ref),
                     "worst_relative_grad_error": max((full[n] - ref[n]).abs().max().item()
                                                      / ref[n].abs().max().item() for n in ref),
                     "min_grad_max": min(ref[n].abs().max().item() for n in ref)}
    return out if dist.get_rank() == 0 else None


def check_lean_decode_refused():
    """The static MoE decode step multiplies the experts' weights itself: with adapters on them it
    must not run (generation merges them into the copy instead)."""
    from puzzle.models.decode_layer import lean_step_covers

    layout = layout_for(P(1, 1, 1))
    if not layout.member:
        return None
    plain = ModelEngine("actor", ARCH, layout, trainable=False, seed=SEED)
    eng = ModelEngine("actor", ARCH, layout, trainable=False, seed=SEED,
                      lora=LoRAConfig(dim=4, target_modules=("linear_fc1", "linear_fc2")))
    return [[lean_step_covers(layer) for layer in e.module.decoder.layers] for e in (plain, eng)]


def _adam_state(eng, p, key):
    for leaf in getattr(eng.optimizer, "chained_optimizers", [eng.optimizer]):
        if p in leaf.optimizer.state:
            return leaf.optimizer.state[p][key]
    raise KeyError(f"no {key} for a parameter of shape {tuple(p.shape)}")


def _whole(eng, key=None):
    """{global name: whole tensor} of the adapters (or their Adam ``key``) on rank 0."""
    params = dict(eng.module.named_parameters()) if eng.member else {}
    mine = [(spec, *tp_split(spec.name, eng.layout),
             (params[n] if key is None else _adam_state(eng, params[n], key)).detach().clone())
            for n, spec in eng.adapter_specs.items()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"grads": mine})
    return assemble(gathered)[0] if dist.get_rank() == 0 else {}


def _checkpoint_reshards(eng, other):
    """The adapters and their Adam moments saved at ``eng``'s layout, loaded into ``other`` (another
    layout, other adapter values; puzzle.checkpointing's role state dict: the adapters alone),
    compared whole."""
    from tests.distributed.worlds.foundation import role_state_through_checkpoint

    role_state_through_checkpoint(eng, other)
    keys = (None, "exp_avg", "exp_avg_sq")
    whole = {(label, k): _whole(e, k) for label, e in (("saved", eng), ("loaded", other)) for k in keys}
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    out = {}
    for k in keys:
        a, b = whole["saved", k], whole["loaded", k]
        out[k or "weights"] = {"names_agree": sorted(a) == sorted(b) and any(".mlp.experts." in n for n in a),
                               "equal": all(torch.equal(a[n], b[n]) for n in a),
                               "nonzero": sum(bool(a[n].abs().sum() > 0) for n in a)}
    return out


def _shadow_logprobs(shadow, rows):
    """Next-token log-probs of ``rows`` through the generation copy (T = 1: whole logits)."""
    with torch.no_grad():
        logits = shadow.module(rows, torch.arange(LEN).unsqueeze(0).expand_as(rows), None)
    return logits[:, :-1, :ARCH.vocab_size].float().log_softmax(-1).gather(-1, rows[:, 1:, None])[..., 0]


def check_four_ranks():
    """(4 ranks) The adapter gradients at (1,2,2,E=2) (ETP = T = 2) and at (1,2,2) with ETP = 1 (whole
    experts on both tensor-parallel ranks, each routing its share of the tokens); then the first LoRA actor (its
    gradients ready, B non-zero): its switch to (1,4,1,E=1) lays the base out once, then the one
    overlapped with its optimizer step moves the adapters only (the adapter bytes each rank lacks),
    and the merged copy's log-probs are the training model's (the base's differ); its adapters and
    Adam state saved and loaded into the second (E = 1, ETP = 1: other adapter values, B drawn)."""
    from puzzle.dataflow.actor_switch import ActorSwitch
    from puzzle.models.lora import adapters_disabled
    from puzzle.switch.shadow import routing_table_for

    src, gen = P(1, 2, 2, E=2), P(1, 4, 1)
    keep = {}
    res = {"grads": check_expert_grads({"(1,2,2,E=2) ETP=2": (src, {}),
                                        "(1,2,2) ETP=1": (P(1, 2, 2, ETP=1), {})}, keep)}
    eng = keep[src]
    switch = ActorSwitch(eng, gen)
    shadow = switch.generation_engine()  # the first switch: base and adapters
    res["first_bytes"] = switch.last_stats.bytes_received
    switch.release()
    switch.optimizer_step_and_switch()  # the step (its gradients: check_expert_grads's) moves A and B
    res.update(second_bytes=switch.last_stats.bytes_received,
               adapter_bytes_lacking=routing_table_for(ARCH, "actor", src, gen, lora=LORA,
                                                       adapters_only=True).bytes_lacking(dist.get_rank()))
    rows = _my_rows(eng.layout, seed=5)  # the training model's rows: every rank of a TP pair the same
    train = _logprobs(eng, rows)
    with adapters_disabled(eng.module):
        base = _logprobs(eng, rows)
    merged = _shadow_logprobs(shadow, rows)
    res.update(logprob_diff=(merged - train).abs().max().item(), base_diff=(base - train).abs().max().item())
    switch.release()
    res["checkpoint"] = _checkpoint_reshards(eng, keep[P(1, 2, 2, ETP=1)])  # other E and ETP, other values
    return res


def check_peft_export(root: str, families) -> dict:
    """1 rank: each MoE family's HF checkpoint (``root``/<family>, made by moe.py) under a LoRA actor
    adapting every linear, the experts' too (B non-zero), exported as a PEFT adapter directory (the
    per-expert projection names of PEFT on transformers v4, which PEFT converts onto transformers
    v5's fused expert tensors): PEFT's greedy tokens on transformers against puzzle's generation; the
    base's differ."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return {"missing": "peft is not installed (pip install -e '.[test]')"}
    import transformers
    from peft import PeftModel

    from puzzle.models.hf_checkpoint import arch_from_hf_dir, load_hf_into_model
    from puzzle.models.lora import gather_adapters
    from puzzle.models.peft_export import write_peft_adapter
    from tests.distributed.worlds.model_families import _generate, _hf_greedy

    out = {}
    for fam, prefix in families.items():
        src = os.path.join(root, fam)
        arch = arch_from_hf_dir(src, make_vocab_size_divisible_by=64, seq_length=32)
        eng = ModelEngine("actor", arch, layout_for(P(1, 1, 1)), trainable=False, seed=5, lora=LORA,
                          layout_independent_init=False)
        load_hf_into_model(eng.module, arch, "actor", src)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in eng.module.named_parameters():
                if name.endswith("adapter.linear_out.weight"):
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        peft_dir = os.path.join(root, fam + "-peft")
        write_peft_adapter(arch, LORA, gather_adapters(eng.module, eng.adapter_specs), peft_dir, base_model=src)
        lm_cls = getattr(transformers, f"{prefix}ForCausalLM")
        base = lm_cls.from_pretrained(src).eval()
        base_tokens = _hf_greedy(base, PROMPTS_OF_EXPORT, eos=2)
        with torch.no_grad():
            peft_tokens = _hf_greedy(PeftModel.from_pretrained(base, peft_dir).eval(), PROMPTS_OF_EXPORT, eos=2)
        from safetensors import safe_open

        with safe_open(os.path.join(peft_dir, "adapter_model.safetensors"), "pt") as f:
            expert_keys = sum(".experts." in k for k in f.keys())
        out[fam] = {"ours": _generate(eng, eos_ids=(2,)), "peft": peft_tokens, "base": base_tokens,
                    "expert_keys": expert_keys}
    return out

