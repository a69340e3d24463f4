"""4-rank world: HF LLaMA import at several layouts matches transformers; export round-trips."""

import json
import os
import tempfile

import torch
import torch.distributed as dist

from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.engine.model_engine import ModelEngine
from puzzle.engine.vocab_parallel import vocab_parallel_logprobs
from tests.harness import world_main

B, S, V = 2, 12, 200
PLANS = [ParallelPlan(1, 1, 1), ParallelPlan(1, 1, 2), ParallelPlan(2, 1, 2)]
_DIRS = {}


def _hf_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
    base.update(kw)
    return LlamaConfig(**base)


def _randomise(model):
    """Weights large enough that attention (and so RoPE) matters; norms not all ones."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model


def _tokens():
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))


def _shared_dir():
    """A temp dir made by rank 0 and broadcast to everyone."""
    obj = [tempfile.mkdtemp(prefix="puzzle-hf-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def _make_hf_models():
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    root = _shared_dir()
    _DIRS.update(lm=os.path.join(root, "lm"), critic=os.path.join(root, "critic"),
                 bad=os.path.join(root, "bad"),
                 tied=os.path.join(root, "tied"), interleaved=os.path.join(root, "interleaved"), out=os.path.join(root, "out"), root=root)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        _randomise(LlamaForCausalLM(_hf_config())).save_pretrained(_DIRS["lm"])
        _randomise(LlamaForCausalLM(_hf_config(tie_word_embeddings=True))).save_pretrained(_DIRS["tied"])
        _interleaved_copy(_DIRS["lm"], _DIRS["interleaved"])
        _randomise(LlamaForSequenceClassification(_hf_config(num_labels=1, pad_token_id=0))) \
            .save_pretrained(_DIRS["critic"])
        os.makedirs(_DIRS["bad"])
        cfg = json.load(open(os.path.join(_DIRS["lm"], "config.json")))
        cfg.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"])
        json.dump(cfg, open(os.path.join(_DIRS["bad"], "config.json"), "w"))
    dist.barrier()


def _interleaved_copy(src, dst):
    """The same model with q/k rows in the INTERLEAVED rotary order (Meta's original layout: HF's
    convert_llama_weights_to_hf permutes it into rotate_half order). Importing it must NOT match:
    a negative control showing that the rotary convention is exercised by the comparison."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    for k in list(sd):
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            w = sd[k]
            heads = w.shape[0] // 16  # head_dim 16
            # inverse of HF's permute(w) = w.view(h, d/2, 2, c).transpose(1, 2).reshape(...)
            sd[k] = w.view(heads, 2, 8, w.shape[1]).transpose(1, 2).reshape(w.shape).contiguous()
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def _hf_reference_logprobs(key="lm"):
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(_DIRS[key], dtype=torch.float32).eval()
    tok = _tokens()
    with torch.no_grad():
        logits = m(tok).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tok[:, 1:, None]).squeeze(-1)


def _forward_step(store, with_values=False):
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        pos = torch.arange(mb.shape[1]).unsqueeze(0).expand_as(mb)
        out = model(mb, pos, None)

        def loss_func(output):
            if with_values:
                store.append(output.detach().squeeze(-1))
            else:
                store.append(vocab_parallel_logprobs(output[:, :-1], mb[:, 1:], model.pg_collection.tp,
                                                     true_vocab=V).detach())
            return output.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        return out, loss_func

    return forward_step


def _import(plan, role, hf_dir):
    from puzzle.models.hf_checkpoint import arch_from_hf_dir, load_hf_into_model

    arch = arch_from_hf_dir(hf_dir, make_vocab_size_divisible_by=64, seq_length=S)
    eng = ModelEngine(role, arch, layout_for(plan), trainable=False, seed=3)
    stats = load_hf_into_model(eng.module, arch, role, hf_dir)
    return eng, arch, stats


def _run(eng, with_values=False):
    store = []
    if eng.member:
        tok = _tokens()
        with torch.no_grad():
            eng.forward_backward(_forward_step(store, with_values), iter(tok.split(1)), B, S, 1, forward_only=True)
    lay = eng.layout
    if eng.member and lay.is_last_stage and lay.t == 0:
        return torch.cat(store)
    return None


def _gather_one(x):
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    found = [g for g in got if g is not None]
    assert len(found) == 1, len(found)
    return found[0]


def check_import_matches_transformers():
    _make_hf_models()
    ref = _hf_reference_logprobs()
    out = {}
    for plan in PLANS:
        eng, arch, stats = _import(plan, "actor", _DIRS["lm"])
        lp = _gather_one(None if (r := _run(eng)) is None else r.tolist())
        out[str(plan)] = {"max_err": (torch.tensor(lp) - ref).abs().max().item(),
                          "bytes_read": _gather_one(stats["bytes_read"] if eng.member and eng.layout.rank == 0
                                                    else None)}
    out["ref_mean"] = ref.mean().item()
    out["ref_std"] = ref.std().item()
    full_bytes = sum(os.path.getsize(os.path.join(_DIRS["lm"], f)) for f in os.listdir(_DIRS["lm"])
                     if f.endswith(".safetensors"))
    out["file_bytes"] = full_bytes
    return out


def check_critic_head():
    """LlamaForSequenceClassification 'score.weight' -> value head: per-token values match HF."""
    from transformers import LlamaForSequenceClassification

    eng, arch, _ = _import(ParallelPlan(2, 1, 2), "critic", _DIRS["critic"])
    values = _gather_one(None if (r := _run(eng, with_values=True)) is None else r.tolist())
    m = LlamaForSequenceClassification.from_pretrained(_DIRS["critic"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = m.score(m.model(_tokens()).last_hidden_state).squeeze(-1)
    return {"max_err": (torch.tensor(values) - ref).abs().max().item()}


def check_export_round_trip():
    """Import at (2,1,2) and at (1,1,2), export each; transformers reloads the originals bitwise."""
    from safetensors.torch import load_file

    from puzzle.models.hf_checkpoint import export_hf

    res = {}
    for plan in (ParallelPlan(2, 1, 2), ParallelPlan(1, 1, 2)):
        eng, arch, _ = _import(plan, "actor", _DIRS["lm"])
        out_dir = os.path.join(_DIRS["out"], str(plan.P) + str(plan.T))
        files = export_hf(eng.module, arch, "actor", out_dir, max_shard_bytes=200_000)
        if dist.get_rank() == 0:
            from transformers import LlamaForCausalLM

            orig = load_file(os.path.join(_DIRS["lm"], "model.safetensors"))
            back = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).state_dict()
            res[str(plan)] = {
                "files": files,
                "same_keys": sorted(orig) == sorted(back),
                "bitwise": all(torch.equal(orig[k], back[k]) for k in orig),
            }
        dist.barrier()
    return res


def check_tied_and_rope_convention():
    """Tied embeddings at (2,1,2) (the last stage's output_layer copy) match transformers; the
    interleaved-rotary copy of the model does not (negative control)."""
    from puzzle.models.hf_checkpoint import export_hf
    from safetensors import safe_open

    res = {}
    eng, arch, _ = _import(ParallelPlan(2, 1, 2), "actor", _DIRS["tied"])
    lp = _gather_one(None if (r := _run(eng)) is None else r.tolist())
    res["tied_err"] = (torch.tensor(lp) - _hf_reference_logprobs("tied")).abs().max().item()
    out_dir = os.path.join(_DIRS["out"], "tied")
    export_hf(eng.module, arch, "actor", out_dir)
    if dist.get_rank() == 0:
        with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
            res["tied_keys_have_lm_head"] = "lm_head.weight" in f.keys()
    eng, arch, _ = _import(ParallelPlan(1, 1, 1), "actor", _DIRS["interleaved"])
    lp = _gather_one(None if (r := _run(eng)) is None else r.tolist())
    res["interleaved_err"] = (torch.tensor(lp) - _hf_reference_logprobs()).abs().max().item()
    return res


def check_unsupported_architecture():
    from puzzle.models.hf_checkpoint import UnsupportedHFModel, arch_from_hf_dir

    try:
        arch_from_hf_dir(_DIRS["bad"])
    except UnsupportedHFModel as e:
        res = {"error": str(e), "names_file": os.path.join(_DIRS["bad"], "config.json") in str(e)}
    else:
        res = {"error": None, "names_file": False}
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(_DIRS["root"], ignore_errors=True)
    return res


if __name__ == "__main__":
    world_main([("import", check_import_matches_transformers), ("critic", check_critic_head),
                ("export", check_export_round_trip), ("tied_rope", check_tied_and_rope_convention),
                ("unsupported", check_unsupported_architecture)])
