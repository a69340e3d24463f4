"""4-rank world: Llama-3.x, Qwen2, Qwen3 and Mistral checkpoints made by transformers go through
every path: import (log-probs), critic head, greedy generation at three layouts and through
puzzle.tools.generate (stop ids from generation_config.json), export, the switch, and a dist
checkpoint saved at one layout and loaded at another."""

import json
import os
import re
import tempfile

import torch
import torch.distributed as dist

from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from tests.distributed.worlds.hf_import import _randomise  # weights large enough for RoPE to matter
from tests.harness import world_main

V, S, MAX_NEW = 256, 12, 6
P = ParallelPlan
PROMPTS = [[17, 4, 99, 150, 3], [42, 7], [5, 6, 7, 8, 9, 10, 11], [199, 0, 64, 255]]
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=None,
              eos_token_id=None, pad_token_id=0)
FAMILIES = {
    # non-default llama3 parameters: megatron-core's built-in scaling would get them wrong
    "llama3": ("Llama", dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 2.0,
        "high_freq_factor": 8.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True)),                     # q/k/v bias, tied
    "qwen3": ("Qwen3", dict(tie_word_embeddings=False, head_dim=16)),        # qk-norm, head_dim != 64/8
    "mistral": ("Mistral", dict(tie_word_embeddings=False, sliding_window=128)),  # window >= sequence
}
_DIRS = {}


def _cls(family, kind):
    import transformers

    prefix, _ = FAMILIES[family]
    return getattr(transformers, f"{prefix}{kind}"), getattr(transformers, f"{prefix}Config")


def _tokens():
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))


def _hf_greedy(model, prompts, eos=None):
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def tiny_tokenizer():
    """A word-level HF tokenizer over ids 0..V-1 ("t0".."t255") with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t0")
    hf.chat_template = ("{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
                        "{% if add_generation_prompt %}t5{% endif %}")
    return hf


def _save(model, path):
    """save_pretrained from this rank (transformers writes only on rank 0 of an initialised world)."""
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(path)


def save_family(lm, crit, root: str, fam: str):
    """Save an HF LM (with the tiny tokenizer) and its *ForSequenceClassification critic under
    root/fam and root/fam-critic; returns transformers' reference (log-probs, values) of _tokens()."""
    _save(lm, os.path.join(root, fam))
    tiny_tokenizer().save_pretrained(os.path.join(root, fam))
    _save(crit, os.path.join(root, fam + "-critic"))
    tok = _tokens()
    with torch.no_grad():
        lp = torch.log_softmax(lm(tok).logits.float()[:, :-1], -1).gather(-1, tok[:, 1:, None]).squeeze(-1)
        values = crit.score(crit.model(tok).last_hidden_state).squeeze(-1)
    return lp, values


def _make_models():
    """Rank k makes family k: an LM and a *ForSequenceClassification dir, the reference log-probs,
    values and greedy tokens (without and with two stop ids, which go to generation_config.json)."""
    obj = [tempfile.mkdtemp(prefix="puzzle-families-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    root = obj[0]
    _DIRS["root"] = root
    mine = {}
    for i, (fam, (_, extra)) in enumerate(FAMILIES.items()):
        if i % dist.get_world_size() != dist.get_rank():
            continue
        lm_cls, cfg_cls = _cls(fam, "ForCausalLM")
        cls_cls, _ = _cls(fam, "ForSequenceClassification")
        torch.manual_seed(0)
        lm = _randomise(lm_cls(cfg_cls(**COMMON, **extra))).eval()
        crit = _randomise(cls_cls(cfg_cls(**COMMON, **extra, num_labels=1))).eval()
        lp, values = save_family(lm, crit, root, fam)
        greedy = _hf_greedy(lm, PROMPTS)
        stops = [greedy[0][2], greedy[2][3]]
        with open(os.path.join(root, fam, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": stops, "pad_token_id": 0}, f)
        mine[fam] = {"lp": lp.tolist(), "values": values.tolist(), "greedy": greedy, "stops": stops,
                     "greedy_eos": _hf_greedy(lm, PROMPTS, eos=stops)}
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    refs = {k: v for part in got for k, v in part.items()}
    _DIRS["refs"] = refs
    return refs


def _arch(fam, critic=False):
    from puzzle.models.hf_checkpoint import arch_from_hf_dir

    return arch_from_hf_dir(os.path.join(_DIRS["root"], fam + ("-critic" if critic else "")),
                            make_vocab_size_divisible_by=64, seq_length=32)


def _engine(fam, plan, role="actor", load=True):
    from puzzle.models.hf_checkpoint import load_hf_into_model
    from puzzle.engine.model_engine import ModelEngine

    arch = _arch(fam, critic=role != "actor")
    eng = ModelEngine(role, arch, layout_for(plan), trainable=False, seed=5)
    if load:
        load_hf_into_model(eng.module, arch, role, os.path.join(_DIRS["root"], fam + ("" if role == "actor" else "-critic")))
    return eng


def _one(x):
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    found = [g for g in got if g is not None]
    assert found, "no rank produced a result"
    return found[0]


def _forward(module, layout, values=False):
    """Log-probs (or values) of _tokens() through ``module`` at ``layout``, on every rank."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from puzzle.dataflow.steps import lm_nll_step

    res = None
    if module is not None:
        tok = _tokens()
        store = []
        if values:
            def step(it, model):
                x = next(it)
                out = model(x, torch.arange(S).unsqueeze(0).expand_as(x), None)
                store.append(out.detach().squeeze(-1))
                return out, lambda o: (o.sum() * 0, torch.tensor(1, dtype=torch.int), {})
        else:
            step = lm_nll_step(V, store)
        fb = get_forward_backward_func(pp_size=layout.plan.P)
        module.eval()
        with torch.no_grad():
            fb(forward_step_func=step, data_iterator=iter(tok.split(1)), model=[module], num_microbatches=2,
               seq_length=S, micro_batch_size=1, forward_only=True,
               p2p_communicator=layout.p2p_communicator(module.config), pg_collection=layout.pg_collection)
        if layout.is_last_stage and layout.t == 0 and layout.d == 0:
            res = torch.cat(store).tolist()
    return _one(res)


def _err(a, b):
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


def _generate(eng, eos_ids=()):
    from puzzle.rollout import SamplingParams, generate

    out = None
    if eng.member:
        o = generate(eng, PROMPTS, SamplingParams(MAX_NEW, greedy=True, eos_ids=tuple(eos_ids)), seed=1)
        if eng.layout.p == 0 and eng.layout.t == 0:
            out = o.responses()
    return _one(out)


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()} if module is not None else None


def _params_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _sharded_keys(module):
    """Checkpoint keys of a model's tensors (megatron stacks the layers: no layer index)."""
    from puzzle.checkpointing import _sharding_metadata
    from types import SimpleNamespace

    sd = module.sharded_state_dict(prefix="", metadata=_sharding_metadata(SimpleNamespace(layout=module.puzzle_layout)))
    return {v.key for v in sd.values() if hasattr(v, "key") and not v.key.endswith("_extra_state")}


def _all(flag):
    t = torch.tensor([int(bool(flag))])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def check_families():
    from puzzle.checkpointing import load_role_weights, save_role_weights
    from puzzle.models.hf_checkpoint import export_hf
    from puzzle.models.param_names import names_for_impl
    from puzzle.models.init import param_specs
    from puzzle.switch.shadow import switch_to_generation

    refs = _make_models()
    res = {}
    for fam in FAMILIES:
        r = res[fam] = {}
        ref = refs[fam]
        arch = _arch(fam)
        r["arch"] = {"qkv_bias": arch.add_qkv_bias, "qk_layernorm": arch.qk_layernorm,
                     "kv_channels": arch.kv_channels, "rope_scaling": arch.use_rope_scaling,
                     "tied": not arch.untie_embeddings_and_output_weights}
        engines = {plan: _engine(fam, plan) for plan in (P(1, 1, 1), P(2, 1, 2), P(1, 1, 4))}
        # the local spec's named_parameters() are the spec names, in order
        m = engines[P(1, 1, 1)].module
        r["names_in_spec_order"] = _one(None if m is None else [n for n, _ in m.named_parameters()] ==
                                        names_for_impl([s.name for s in param_specs(arch, "actor")], "local"))
        r["ckpt_keys_are_te_names"] = _one(None if m is None else _sharded_keys(m) == {
            re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", n)
            for n in names_for_impl([s.name for s in param_specs(arch, "actor")], "transformer_engine")})
        r["lp_err"] = {str(p): _err(_forward(e.module, e.layout), ref["lp"]) for p, e in engines.items()}
        crit = _engine(fam, P(2, 1, 2), role="critic")
        r["value_err"] = _err(_forward(crit.module, crit.layout, values=True), ref["values"])
        r["greedy"] = {str(p): _generate(e) == ref["greedy"] for p, e in engines.items()}
        r["greedy_eos"] = _generate(engines[P(2, 1, 2)], ref["stops"]) == ref["greedy_eos"]
        r["eos_shortens"] = any(len(x) < MAX_NEW for x in ref["greedy_eos"])
        # export from (2,1,2): transformers reloads the original tensors bitwise
        out_dir = os.path.join(_DIRS["root"], fam + "-export")
        export_hf(engines[P(2, 1, 2)].module, arch, "actor", out_dir)
        dist.barrier()
        if dist.get_rank() == list(FAMILIES).index(fam) % dist.get_world_size():
            from safetensors.torch import load_file

            lm_cls, _ = _cls(fam, "ForCausalLM")
            orig = load_file(os.path.join(_DIRS["root"], fam, "model.safetensors"))
            back = lm_cls.from_pretrained(out_dir, dtype=torch.float32).state_dict()
            saved = load_file(os.path.join(out_dir, "model.safetensors"))
            r["export"] = {"same_keys": sorted(orig) == sorted(saved),
                           "bitwise": all(torch.equal(orig[k], back[k]) for k in orig)}
        r["export"] = _one(r.get("export"))
        # the switch (2,1,2) -> (1,1,4): the destination slices bitwise and the same log-probs
        shadow = switch_to_generation(engines[P(2, 1, 2)], P(1, 1, 4))
        r["switch_bitwise"] = _all(_params_equal(_params(shadow.module), _params(engines[P(1, 1, 4)].module)))
        r["switch_lp_err"] = _err(_forward(shadow.module, shadow.layout), ref["lp"])
        shadow.release()
        # a dist checkpoint saved at (2,1,2), loaded at (1,1,4) into a model not loaded from HF
        ckpt = os.path.join(_DIRS["root"], fam + "-ckpt", "iter_0000001", "actor")
        save_role_weights(engines[P(2, 1, 2)], ckpt)
        fresh = _engine(fam, P(1, 1, 4), load=False)
        differs_before = not _all(_params_equal(_params(fresh.module), _params(engines[P(1, 1, 4)].module)))
        load_role_weights(fresh, ckpt)
        r["resume"] = {"differs_before": differs_before,
                       "bitwise": _all(_params_equal(_params(fresh.module), _params(engines[P(1, 1, 4)].module)))}
        if fam == "llama3" and dist.get_rank() == 0:  # a puzzle checkpoint root for the tool
            from dataclasses import asdict

            croot = os.path.join(_DIRS["root"], fam + "-ckpt")
            with open(os.path.join(croot, "iter_0000001", "metadata.json"), "w") as f:
                json.dump({"roles": {"actor": {"arch": asdict(arch)}}}, f)
            with open(os.path.join(croot, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1\n")
        dist.barrier()
    return res


def check_generate_tool():
    """python -m puzzle.tools.generate (its main, in this world) from an HF dir at (2,1,2) and at
    D=4, and from a puzzle checkpoint: stop ids from generation_config.json, transformers' tokens."""
    from puzzle.tools.generate import main

    root = _DIRS["root"]
    prompts = os.path.join(root, "prompts.jsonl")
    if dist.get_rank() == 0:
        with open(prompts, "w") as f:
            for p in PROMPTS:
                f.write(json.dumps({"prompt_ids": p}) + "\n")
    refs = {fam: r["greedy_eos"] for fam, r in _DIRS["refs"].items()}  # the stops of generation_config.json
    dist.barrier()
    res = {}
    runs = [(fam, os.path.join(root, fam), ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
            for fam in FAMILIES]
    runs.append(("llama3", os.path.join(root, "llama3"), []))  # D = 4
    runs.append(("llama3", os.path.join(root, "llama3-ckpt"), ["--tensor-model-parallel-size", "4",
                                                                "--tokenizer-model", os.path.join(root, "llama3")]))
    for i, (fam, src, layout) in enumerate(runs):
        out = os.path.join(root, f"out{i}.jsonl")
        main(["--load", src, "--prompts", prompts, "--output", out, "--greedy", "--max-new-tokens", str(MAX_NEW),
              "--seq-length", "32", "--make-vocab-size-divisible-by", "64"] + layout)
        if dist.get_rank() == 0:
            rows = [json.loads(line) for line in open(out)]
            got = [row["tokens"] for row in rows]
            key = f"{i}:{fam}:{os.path.basename(src)}:{' '.join(layout)}"
            res[key] = {"equal": got == refs[fam], "fields": sorted(rows[0])}
    # python -m puzzle.tools.export_hf from the puzzle checkpoint at T=4: the original tensors back
    from puzzle.tools.export_hf import main as export_main

    out_dir = os.path.join(root, "llama3-ckpt-export")
    export_main(["--load", os.path.join(root, "llama3-ckpt"), "--save", out_dir, "--tensor-model-parallel-size", "4",
                 "--make-vocab-size-divisible-by", "64"])
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        orig = load_file(os.path.join(root, "llama3", "model.safetensors"))
        back = load_file(os.path.join(out_dir, "model.safetensors"))
        res["export_tool"] = {"same_keys": sorted(orig) == sorted(back),
                              "bitwise": all(torch.equal(orig[k], back[k]) for k in orig),
                              "model_type": json.load(open(os.path.join(out_dir, "config.json")))["model_type"]}
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return res


if __name__ == "__main__":
    world_main([("families", check_families), ("tool", check_generate_tool)])
