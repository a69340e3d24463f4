"""4-rank world: Qwen3-MoE and Mixtral checkpoints made by transformers through import (log-probs,
critic values), greedy generation at (1,1,1,1) and through puzzle.tools.generate at (P, D, T, E)
layouts, and export (bitwise) through puzzle.tools.export_hf at E = 2. In a 1-rank world (the
1-rank group of tests/harness.py SHARED_WORLDS) only puzzle.tools.generate at (1,1,1,1)."""

import json
import os
import tempfile

import torch
import torch.distributed as dist

from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from tests.distributed.worlds.hf_import import _randomise
from tests.distributed.worlds.model_families import (COMMON, MAX_NEW, PROMPTS, _err, _forward, _generate,
                                                     _hf_greedy, _one, save_family)
from tests.harness import world_main

# Qwen3-MoE: a dense layer (mlp_only_layers), unnormalised top-k (norm_topk_prob false: the
# router's pre-softmax); Mixtral: every layer sparse, renormalised top-k
FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], head_dim=16,
                                   tie_word_embeddings=False)),
    "mixtral": ("Mixtral", dict(COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False)),
}
_T2, _P2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
_E2, _E4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
#: (family, layout name (P,D,T,E), flags) of puzzle.tools.generate over the 4 ranks (D fills the rest)
TOOL_RUNS = [("qwen3_moe", "(1,4,1,4)", _E4), ("mixtral", "(2,2,1,2)", _P2 + _E2),
             ("qwen3_moe", "(1,2,2,2)", _T2 + _E2), ("mixtral", "(1,2,2,2) ETP=1", _T2 + _E2 +
                                                    ["--expert-tensor-parallel-size", "1"])]
#: the same in a world of one rank: (P, D, T, E) = (1, 1, 1, 1)
ONE_RANK_TOOL_RUNS = [("qwen3_moe", "(1,1,1,1)", []), ("mixtral", "(1,1,1,1)", [])]
#: export_hf layouts per family
EXPORT_LAYOUTS = {"qwen3_moe": _P2 + _E2, "mixtral": _T2 + _E2}
_DIRS = {}


def _make_models():
    """Rank k makes family k (rank 0 both in a world of one): LM + sequence-classification dirs,
    reference log-probs, values, tokens."""
    import transformers

    obj = [tempfile.mkdtemp(prefix="puzzle-moe-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    root = _DIRS["root"] = obj[0]
    mine = {}
    for i, (fam, (prefix, cfg)) in enumerate(FAMILIES.items()):
        if i % dist.get_world_size() != dist.get_rank():
            continue
        config_cls = getattr(transformers, f"{prefix}Config")
        torch.manual_seed(0)
        lm = _randomise(getattr(transformers, f"{prefix}ForCausalLM")(config_cls(**cfg))).eval()
        crit = _randomise(getattr(transformers, f"{prefix}ForSequenceClassification")(
            config_cls(**cfg, num_labels=1))).eval()
        lp, values = save_family(lm, crit, root, fam)
        mine[fam] = {"lp": lp.tolist(), "values": values.tolist(), "greedy": _hf_greedy(lm, PROMPTS, eos=2)}
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    _DIRS["refs"] = {k: v for part in got for k, v in part.items()}


def _engine(fam, plan, role, **overrides):
    from puzzle.models.hf_checkpoint import arch_from_hf_dir, load_hf_into_model
    from puzzle.engine.model_engine import ModelEngine

    src = os.path.join(_DIRS["root"], fam + ("" if role == "actor" else "-critic"))
    arch = arch_from_hf_dir(src, make_vocab_size_divisible_by=64, seq_length=32, **overrides)
    eng = ModelEngine(role, arch, layout_for(plan), trainable=False, seed=5)
    load_hf_into_model(eng.module, arch, role, src)
    return eng, arch


def check_import():
    """Log-probs and critic values against transformers at (1,1,1,1) and with T / E > 1 (both
    token dispatchers); greedy generation at (1,1,1,1); the arch read. (A world of one: only the
    models, for check_tools.)"""
    _make_models()
    if dist.get_world_size() == 1:
        return {}
    res = {}
    plans = {"qwen3_moe": [(ParallelPlan(1, 1, 1), "allgather"), (ParallelPlan(1, 4, 1, E=4), "alltoall")],
             "mixtral": [(ParallelPlan(1, 1, 1), "alltoall"), (ParallelPlan(1, 2, 2, E=2), "allgather")]}
    for fam in FAMILIES:
        r = res[fam] = {"lp_err": {}, "value_err": {}}
        for plan, dispatcher in plans[fam]:
            eng, arch = _engine(fam, plan, "actor", moe_token_dispatcher_type=dispatcher)
            r["lp_err"][f"{plan} {dispatcher}"] = _err(_forward(eng.module, eng.layout), _DIRS["refs"][fam]["lp"])
            crit, _ = _engine(fam, plan, "critic", moe_token_dispatcher_type=dispatcher)
            r["value_err"][f"{plan} {dispatcher}"] = _err(_forward(crit.module, crit.layout, values=True),
                                                          _DIRS["refs"][fam]["values"])
        eng, _ = _engine(fam, ParallelPlan(1, 1, 1), "actor")
        r["greedy_1111"] = _generate(eng, eos_ids=(2,)) == _DIRS["refs"][fam]["greedy"]
        r["arch"] = {"num_experts": arch.num_experts, "topk": arch.moe_router_topk,
                     "pre_softmax": arch.moe_router_pre_softmax, "moe_ffn": arch.moe_ffn_hidden_size,
                     "ffn": arch.ffn_hidden_size, "pattern": arch.moe_layer_pattern}
    return res


def check_tools():
    """puzzle.tools.generate (greedy) at every TOOL_RUNS entry (ONE_RANK_TOOL_RUNS in a world of
    one) and export_hf at EXPORT_LAYOUTS (not in a world of one)."""
    from safetensors.torch import load_file

    from puzzle.models.hf_checkpoint import arch_from_hf_dir
    from puzzle.tools.export_hf import main as export_main
    from puzzle.tools.generate import main as generate_main

    root = _DIRS["root"]
    prompts = os.path.join(root, "prompts.jsonl")
    if dist.get_rank() == 0:
        with open(prompts, "w") as f:
            f.writelines(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS)
    dist.barrier()
    res = {fam: {"greedy": {}} for fam in FAMILIES}
    one_rank = dist.get_world_size() == 1
    for i, (fam, name, layout) in enumerate(ONE_RANK_TOOL_RUNS if one_rank else TOOL_RUNS):
        out = os.path.join(root, f"out{i}.jsonl")
        generate_main(["--load", os.path.join(root, fam), "--prompts", prompts, "--output", out, "--greedy",
                       "--max-new-tokens", str(MAX_NEW), "--seq-length", "32", "--make-vocab-size-divisible-by",
                       "64"] + layout)
        if dist.get_rank() == 0:
            res[fam]["greedy"][name] = [json.loads(line)["tokens"] for line in open(out)] == _DIRS["refs"][fam]["greedy"]
    for fam in () if one_rank else FAMILIES:
        src, r = os.path.join(root, fam), res[fam]
        out_dir = os.path.join(root, fam + "-export")
        export_main(["--load", src, "--save", out_dir, "--make-vocab-size-divisible-by", "64"] + EXPORT_LAYOUTS[fam])
        if dist.get_rank() == 0:
            orig = load_file(os.path.join(src, "model.safetensors"))
            back = load_file(os.path.join(out_dir, "model.safetensors"))
            r["export"] = {"same_keys": sorted(orig) == sorted(back),
                           "bitwise": all(torch.equal(orig[k], back[k]) for k in orig),
                           "same_arch": arch_from_hf_dir(out_dir) == arch_from_hf_dir(src)}
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return _one(res if dist.get_rank() == 0 else None)


def check_lora_experts():
    """(A world of one) LoRA on the experts (tests/distributed/worlds/lora_experts.py): zero B and the
    adapter gradients against plain PyTorch at (1,1,1,1), megatron's SequentialMLP and the grouped
    experts; the static MoE decode step refused on adapted experts; each family's adapters through
    PEFT on transformers."""
    if dist.get_world_size() != 1:
        return {}
    from puzzle.parallel.plan import ParallelPlan as P
    from tests.distributed.worlds import lora_experts

    return {"grads": lora_experts.check_expert_grads({"(1,1,1,1)": (P(1, 1, 1), {}),
                                                      "(1,1,1,1) grouped": (P(1, 1, 1), {"moe_grouped_gemm": True})}),
            "lean_decode": lora_experts.check_lean_decode_refused(),
            "peft": lora_experts.check_peft_export(_DIRS["root"], {f: p for f, (p, _) in FAMILIES.items()})}


if __name__ == "__main__":
    world_main([("import", check_import), ("lora_experts", check_lora_experts), ("tools", check_tools)])
