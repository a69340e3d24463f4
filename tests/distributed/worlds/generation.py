"""4-rank world: KV-cache generation at several (P, D, T) layouts (rollout issue)."""

from dataclasses import replace

import torch
import torch.distributed as dist

from puzzle.config import ModelArch
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.rollout import SamplingParams, generate
from tests.harness import world_main

ARCH = ModelArch.llama(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                       vocab_size=200, make_vocab_size_divisible_by=64, seq_length=64)
SEED = 11
MAX_NEW = 8
PROMPTS = [[17, 4, 99, 150, 3], [42, 7], [5, 6, 7, 8, 9, 10, 11], [199, 0, 64]]
PLANS = [ParallelPlan(1, 1, 1), ParallelPlan(1, 1, 2), ParallelPlan(2, 1, 2),
         ParallelPlan(1, 2, 2), ParallelPlan(2, 1, 1)]
PARAMS = {
    "greedy": SamplingParams(MAX_NEW, greedy=True),
    "t07_k20_p09": SamplingParams(MAX_NEW, temperature=0.7, top_k=20, top_p=0.9),
    "t13_p08": SamplingParams(MAX_NEW, temperature=1.3, top_p=0.8),
    "plain": SamplingParams(MAX_NEW),
}
_ENGINES = {}


def _engine(plan, backend="auto"):
    from dataclasses import replace

    from puzzle.engine.model_engine import ModelEngine

    if (plan, backend) not in _ENGINES:
        _ENGINES[plan, backend] = ModelEngine("actor", replace(ARCH, attention_backend=backend),
                                              layout_for(plan), trainable=False, seed=SEED)
    return _ENGINES[plan, backend]


def _out(o):
    return {"tokens": o.response_tokens.tolist(), "prompt_lengths": o.prompt_lengths.tolist(),
            "response_lengths": o.response_lengths.tolist(), "responses": o.responses(),
            "forward_passes": o.forward_passes}


def _gen_dp(eng, params, mbs=None, prompts=PROMPTS, seed=SEED):
    """Each DP rank generates its share of ``prompts``; returns this rank's output dict."""
    lay = eng.layout
    share = len(prompts) // lay.plan.D
    mine = prompts[lay.d * share:(lay.d + 1) * share]
    o = generate(eng, mine, params, seed=seed, micro_batch_size=mbs, sample_offset=lay.d * share)
    return dict(_out(o), d=lay.d, p=lay.p, t=lay.t)


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_reference():
    """(a)+(c) no-cache greedy reference, each prompt alone: a full forward re-run per step."""
    eng = _engine(ParallelPlan(1, 1, 1))
    if not eng.member:
        return None
    m = eng.module
    m.eval()
    refs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = list(p)
            for _ in range(MAX_NEW):
                x = torch.tensor([ids])
                logits = m(x, torch.arange(len(ids)).unsqueeze(0), None)[0, -1, :ARCH.vocab_size]
                ids.append(int(logits.argmax()))
            refs.append(ids[len(p):])
    # each prompt alone through generate (greedy and sampled, with its global sample index)
    alone = {name: [generate(eng, [p], prm, seed=SEED, sample_offset=i).responses()[0]
                    for i, p in enumerate(PROMPTS)] for name, prm in PARAMS.items()}
    return {"refs": refs, "alone": alone}


def check_layouts():
    """(b) every layout, every sampling setting: one entry per rank (None off-layout)."""
    res = {}
    for plan in PLANS:
        eng = _engine(plan)
        mbs = 1 if plan == ParallelPlan(2, 1, 1) else None  # 4 micro-batches through 2 stages
        mine = {name: _gen_dp(eng, prm, mbs) for name, prm in PARAMS.items()} if eng.member else None
        res[str(plan)] = _gather(mine)
    return res


def check_eos_and_limits():
    """(d) EOS stops rows (also early for the whole batch), masks; (e) max_new_tokens."""
    res = {}
    base = None
    eng1 = _engine(ParallelPlan(1, 1, 1))
    if eng1.member:
        base = generate(eng1, PROMPTS, PARAMS["greedy"], seed=SEED).responses()
    base = _gather(base)[0]
    eos = base[0][2]
    res["base"], res["eos"] = base, eos
    for plan in (ParallelPlan(1, 1, 1), ParallelPlan(2, 1, 2), ParallelPlan(1, 2, 2)):
        eng = _engine(plan)
        mine = None
        if eng.member:
            prm = SamplingParams(MAX_NEW, greedy=True, eos_id=eos, pad_id=3)
            mine = {"eos": _gen_dp(eng, prm),
                    "short": _gen_dp(eng, SamplingParams(1, greedy=True))}
            # everyone finishes at the first token: generation stops after one model call
            first = base[0][0]
            one = generate(eng, [PROMPTS[0]], SamplingParams(MAX_NEW, greedy=True, eos_id=first),
                           seed=SEED)
            mine["all_done"] = _out(one)
        res[str(plan)] = _gather(mine)
    return res


def _quota(rows, group_size, needed):
    from puzzle.rollout.partial import GroupQuota

    return GroupQuota.consecutive(rows, group_size, needed)


def check_errors():
    eng = _engine(ParallelPlan(1, 1, 1))
    if not eng.member:
        return None
    msgs = {}
    for name, call in {
        "empty_prompt": lambda: generate(eng, [[1], []], PARAMS["greedy"], seed=0),
        "bad_token": lambda: generate(eng, [[1, 500]], PARAMS["greedy"], seed=0),
        "too_long": lambda: generate(eng, [[1] * 60], SamplingParams(10), seed=0),
        "bad_eos": lambda: generate(eng, [[1]], SamplingParams(2, eos_id=250), seed=0),
        "partial_full": lambda: generate(eng, [[1]], SamplingParams(2), seed=0, partial_tokens=[[5, 6]],
                                         partial_logprobs=[[-1.0, -1.0]]),
        "partial_stop_id": lambda: generate(eng, [[1]], SamplingParams(4, eos_id=6), seed=0,
                                            partial_tokens=[[6]], partial_logprobs=[[-1.0]]),
        "partial_logprobs": lambda: generate(eng, [[1]], SamplingParams(4), seed=0, partial_tokens=[[5]],
                                             partial_logprobs=[[]]),
        "sample_ids": lambda: generate(eng, [[1], [2]], SamplingParams(2), seed=0, sample_ids=[3, 3]),
        "quota": lambda: generate(eng, [[1], [2]], SamplingParams(2), seed=0, stop=_quota(2, 2, 2)),
    }.items():
        try:
            call()
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


def check_fast_loop():
    """Continuous batching (P=1, fewer cache rows than prompts), length buckets and the SDPA
    backend give the tokens of the default path; SDPA attention matches megatron's unfused."""
    from puzzle.models.sdpa_attention import SDPACoreAttention, UnfusedCoreAttention

    res = {}
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [8], [2, 7, 1, 8, 2, 8]]  # 7 ragged prompts
    eng = _engine(ParallelPlan(1, 1, 1))
    base = None
    if eng.member:
        base = {name: generate(eng, prompts, prm, seed=SEED).responses() for name, prm in PARAMS.items()}
    base = _gather(base)[0]
    res["base"] = base
    eos = base["greedy"][0][1]  # rows stop at different steps: refills happen mid-decode
    eos_params = {"greedy_eos": SamplingParams(MAX_NEW, greedy=True, eos_id=eos),
                  "t07_eos": SamplingParams(MAX_NEW, temperature=0.7, top_k=20, top_p=0.9, eos_id=eos)}
    if eng.member:
        for name, prm in eos_params.items():
            res[name] = generate(eng, prompts, prm, seed=SEED).responses()
        cont = {}
        for mbs in (1, 3):
            for name, prm in {**PARAMS, **eos_params}.items():
                o = generate(eng, prompts, prm, seed=SEED, micro_batch_size=mbs)
                cont[f"{name}/mbs{mbs}"] = {"responses": o.responses(), "forward_passes": o.forward_passes}
        res["continuous"] = cont
    res["sdpa"] = {}
    for plan, mbs in ((ParallelPlan(1, 1, 1), None), (ParallelPlan(1, 1, 1), 2),
                      (ParallelPlan(1, 2, 2), None), (ParallelPlan(2, 1, 2), 1)):
        e = _engine(plan, "local")
        mine = None
        if e.member:
            assert all(isinstance(m.core_attention, SDPACoreAttention)
                       for m in e.module.modules() if hasattr(m, "core_attention"))
            mine = {name: _gen_dp(e, prm, mbs, prompts=prompts[:6]) for name, prm in PARAMS.items()}
        res["sdpa"][f"{plan}/mbs{mbs}"] = _gather(mine)
    # the CUDA-graph decode step (bucketed static buffers, whole-width mask, cache and RoPE
    # tables kept across generations) without the capture, on CPU
    e = _engine(ParallelPlan(1, 1, 1), "local")
    if e.member:
        from puzzle.rollout.cuda_graphs import DecodeGraphs

        e.module._puzzle_decode_graphs = DecodeGraphs(torch.device("cpu"), capture=False)
        static = {}
        for mbs in (None, None, 3):  # the second call reuses the first one's cache and tables
            for name in ("greedy", "t07_k20_p09", "greedy_eos", "t07_eos"):
                prm = {**PARAMS, **eos_params}[name]
                o = generate(e, prompts, prm, seed=SEED, micro_batch_size=mbs, cuda_graphs=True)
                static.setdefault(name, []).append(o.responses())
        static["width"] = e.module._puzzle_decode_graphs.width
        # once every prompt has a slot, the steps ran as whole-step graphs, one per setting
        static["whole_step_settings"] = len(e.module._puzzle_decode_graphs.fused)
        del e.module._puzzle_decode_graphs
        res["static_decode"] = static
    # the modules themselves: SDPA vs megatron's unfused math, forward and backward
    e1, e2 = _engine(ParallelPlan(1, 1, 1)), _engine(ParallelPlan(1, 1, 1), "local")
    if e1.member:
        assert all(isinstance(m.core_attention, UnfusedCoreAttention)
                   for m in e1.module.modules() if hasattr(m, "core_attention"))
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, ARCH.vocab_size, (3, 12), generator=g)
        pos = torch.arange(12).unsqueeze(0).expand(3, 12)
        pad = torch.zeros(3, 1, 12, 12, dtype=torch.bool)
        pad[0, :, :, :4] = True  # row 0: 4 masked keys (its first 4 queries see nothing)
        mask = torch.ones(12, 12, dtype=torch.bool).triu(1)[None, None] | pad
        outs = {}
        for name, e in (("unfused", e1), ("sdpa", e2)):
            m = e.module
            m.train()
            for p in m.parameters():
                p.requires_grad_(True)
                p.grad = None
            causal = m(tokens, pos, None)
            padded = m(tokens, pos, mask)
            # no loss at row 0's first 4 positions (no key to attend to): megatron's masked_fill
            # passes no gradient through a fully masked row, SDPA's additive mask does
            (causal.sum() + padded[0, 4:].sum() + padded[1:].sum()).backward()
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            for p in m.parameters():
                p.requires_grad_(False)
                p.grad = None
            outs[name] = (causal.detach(), padded.detach(), grads)
        (c1, p1, g1), (c2, p2, g2) = outs["unfused"], outs["sdpa"]
        res["module"] = {
            "causal_max_diff": float((c1 - c2).abs().max()),
            "padded_max_diff": float((p1 - p2).abs().max()),
            "padded_finite": bool(torch.isfinite(p2).all()),
            "grad_names_equal": sorted(g1) == sorted(g2) and len(g1) > 0,
            "grad_max_rel_diff": max(float((g1[n] - g2[n]).abs().max() / (g1[n].abs().max() + 1e-12))
                                     for n in g1),
        }
    return res


LEAN_ARCHS = {  # every architecture option of ModelArch the decode step meets
    "llama_gqa": ARCH,
    "qkv_bias_qk_norm_tied": ModelArch(num_layers=2, hidden_size=64, num_attention_heads=4,
                                       num_query_groups=2, vocab_size=200,
                                       make_vocab_size_divisible_by=64, seq_length=64,
                                       add_qkv_bias=True, qk_layernorm=True,
                                       untie_embeddings_and_output_weights=False),
    "layernorm_gelu_bias_learned_pos": ModelArch(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                 vocab_size=200, make_vocab_size_divisible_by=64,
                                                 seq_length=64, normalization="LayerNorm",
                                                 swiglu=False, add_bias_linear=True,
                                                 position_embedding_type="learned_absolute"),
}


def check_lean_decode():
    """DecodeTransformerLayer's lean decode step against megatron's own layer forward (the lean
    step switched off): the logits of every model call bitwise equal, the same tokens, at
    (1, 1, 1) and T=2, for every architecture option and both CPU backends."""
    from dataclasses import replace

    from puzzle.models.decode_layer import DecodeTransformerLayer
    from puzzle.rollout import generation as G
    from puzzle.engine.model_engine import ModelEngine

    res = {}
    prompts = PROMPTS + [[8], [2, 7, 1, 8, 2, 8]]
    params = SamplingParams(MAX_NEW, temperature=0.9, top_k=30)
    for plan in (ParallelPlan(1, 1, 1), ParallelPlan(1, 1, 2)):
        for name, arch in LEAN_ARCHS.items():
            for backend in ("local", "unfused"):
                eng = ModelEngine("actor", replace(arch, attention_backend=backend), layout_for(plan),
                                  trainable=False, seed=SEED)
                if not eng.member:
                    continue
                layers = [m for m in eng.module.modules() if isinstance(m, DecodeTransformerLayer)]
                runs = {}
                for lean in (True, False):
                    for layer in layers:
                        layer._lean = None if lean else False
                    logits, run = [], G.Stepper.run

                    def recorded(self, *args, _run=run, _out=logits):
                        out = _run(self, *args)
                        _out.append(out.clone())
                        return out

                    G.Stepper.run = recorded
                    try:
                        toks = generate(eng, prompts, params, seed=SEED, micro_batch_size=3).responses()
                    finally:
                        G.Stepper.run = run
                    runs[lean] = (toks, logits, [layer._lean for layer in layers])
                (t1, l1, used), (t0, l0, _) = runs[True], runs[False]
                res[f"{plan}/{name}/{backend}"] = {
                    "layers": len(layers), "lean_used": used, "tokens_equal": t1 == t0,
                    "calls": len(l1), "logits_equal": len(l1) == len(l0) and all(
                        torch.equal(a, b) for a, b in zip(l1, l0)),
                }
    return res


_MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, vocab_size=200,
            make_vocab_size_divisible_by=64, seq_length=64, num_experts=4, moe_router_topk=2,
            moe_ffn_hidden_size=32, attention_backend="local")
#: (name, plan, arch): every layer MoE, softmax before the top-k (Qwen3-MoE without norm_topk_prob),
#: alltoall at T=2 with the experts whole on each rank; a dense second layer (mlp_only_layers),
#: top-k then softmax (Mixtral), allgather, alone on rank 2
MOE_STATIC = [
    ("T2_ETP1", ParallelPlan(1, 1, 2, ETP=1),
     ModelArch.llama(**_MOE, moe_router_pre_softmax=True, moe_token_dispatcher_type="alltoall")),
    ("T1_dense_layer", ParallelPlan(1, 1, 1, offset=2), ModelArch.llama(**_MOE, moe_layer_pattern=[1, 0])),
]


class _RowByRowMatmul(torch.overrides.TorchFunctionMode):
    """Matrix products one row at a time: a row's result then no longer depends on how many rows
    the kernel multiplies (megatron multiplies each expert's routed rows, the static step all)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.matmul, torch.mm) and args[0].dim() >= 2 and args[1].dim() == 2:
            a, b = args
            rows = a.reshape(-1, a.shape[-1])
            out = torch.cat([func(rows[i:i + 1], b) for i in range(rows.shape[0])]) if len(rows) else func(rows, b)
            return out.view(*a.shape[:-1], b.shape[-1])
        return func(*args, **kwargs)


def _static_generate(eng, prompts, params, mbs=None, megatron_moe=False):
    """generate through the CUDA-graph decode without capture (HostSyncGuard on): (responses,
    logits of each decode call). ``megatron_moe``: MoELayer.forward in place of the static MoE
    step (its dispatchers synchronise: the guard is off then)."""
    import contextlib

    from puzzle.models import moe_decode
    from puzzle.rollout import cuda_graphs as CG
    from puzzle.rollout import generation as G

    logits, run, step, guard = [], G.Stepper.run, moe_decode.moe_decode_mlp, CG.HostSyncGuard

    def recorded(self, *args):
        out = run(self, *args)
        if args[2] is None:
            logits.append(out.clone())
        return out

    G.Stepper.run = recorded
    if megatron_moe:
        moe_decode.moe_decode_mlp, CG.HostSyncGuard = (lambda mlp, x: mlp(x)[0]), contextlib.nullcontext
    eng.module._puzzle_decode_graphs = CG.DecodeGraphs(torch.device("cpu"), capture=False)
    try:
        out = generate(eng, prompts, params, seed=SEED, micro_batch_size=mbs, cuda_graphs=True).responses()
    finally:
        G.Stepper.run, moe_decode.moe_decode_mlp, CG.HostSyncGuard = run, step, guard
        del eng.module._puzzle_decode_graphs
    return out, logits


def check_moe_static_decode():
    """The CUDA-graph decode of MoE models without capture: the same tokens as eager generation
    (megatron's MoE forward); each step's logits against the same step with megatron's MoELayer
    forward in place of the static MoE step (bitwise with row-by-row matrix products, else the
    max difference); an expert-parallel model is refused by DecodeGraphs.for_model."""
    from puzzle.models.decode_layer import DecodeTransformerLayer
    from puzzle.rollout.cuda_graphs import DecodeGraphs
    from puzzle.engine.model_engine import ModelEngine

    prompts = PROMPTS + [[8], [2, 7, 1, 8, 2, 8]]
    res = {}
    for name, plan, arch in MOE_STATIC:
        eng = ModelEngine("actor", arch, layout_for(plan), trainable=False, seed=SEED)
        if not eng.member:
            continue
        r = res[name] = {}
        # whole-step graphs (every prompt in a slot); at T=1 also per-bucket steps (prompts
        # waiting for slots) and the logits of each step against megatron's MoE forward
        greedy = _static_generate(eng, prompts, PARAMS["greedy"])[0]
        r["tokens_equal"] = {
            "greedy/whole_step": greedy == generate(eng, prompts, PARAMS["greedy"], seed=SEED).responses()}
        if plan.T == 1:
            sampled, ours = _static_generate(eng, prompts, PARAMS["t07_k20_p09"], 3)
            r["tokens_equal"]["t07_k20_p09/bucketed"] = sampled == generate(
                eng, prompts, PARAMS["t07_k20_p09"], seed=SEED, micro_batch_size=3).responses()
            megatron = _static_generate(eng, prompts, PARAMS["t07_k20_p09"], 3, megatron_moe=True)[1]
            r["calls"] = len(ours)
            r["max_logit_diff"] = max(float((a - b).abs().max()) for a, b in zip(ours, megatron))
        short = SamplingParams(4, greedy=True)
        with _RowByRowMatmul():
            ours = _static_generate(eng, prompts[:5], short, 3)[1]
            megatron = _static_generate(eng, prompts[:5], short, 3, megatron_moe=True)[1]
        r["row_by_row_logits_equal"] = len(ours) == len(megatron) > 2 and all(
            torch.equal(a, b) for a, b in zip(ours, megatron))
        r["moe_and_lean"] = [(l._moe, l._lean) for l in eng.module.modules()
                             if isinstance(l, DecodeTransformerLayer)]
    expert_parallel = ModelEngine("actor", MOE_STATIC[1][2], layout_for(ParallelPlan(1, 2, 1, offset=2, E=2)),
                                  trainable=False, seed=SEED)
    if expert_parallel.member:
        try:
            DecodeGraphs.for_model(expert_parallel.module, 1, torch.device("cpu"))
        except ValueError as e:
            res["expert_parallel_refused"] = str(e)
    return res


def check_batch_invariant_t4():
    """--batch-invariant-mode at T = 4 (the tensor-parallel sums over 4 ranks added in rank order,
    megatron's own all-reduce included): the log-probs generation records against a packed forward
    of the same sequences at the same layout, each in the mode; and the same comparison without it."""
    from puzzle.models.batch_invariant import batch_invariant_mode
    from puzzle.models.packed_attention import PackedSequences
    from puzzle.engine.vocab_parallel import vocab_parallel_logprobs

    eng = _engine(ParallelPlan(1, 1, 4))
    out = {}
    for invariant in (True, False):
        gen = generate(eng, PROMPTS, PARAMS["plain"], seed=SEED, batch_invariant=invariant)
        seqs = [p + gen.response_tokens[i, :int(gen.response_lengths[i])].tolist() for i, p in enumerate(PROMPTS)]
        lengths = [len(x) for x in seqs]
        ids = torch.tensor([sum(seqs, [])])
        pos = torch.tensor([[j for n in lengths for j in range(n)]])
        eng.module.eval()
        with torch.no_grad(), batch_invariant_mode(invariant):
            logits = eng.module(ids, pos, None, packed_seq_params=PackedSequences.of(lengths))
            lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], eng.layout.tp_group, ARCH.vocab_size)[0]
        start, diff = 0, 0.0
        for i, p in enumerate(PROMPTS):
            n = int(gen.response_lengths[i])
            scored = lp[start + len(p) - 1:start + len(p) - 1 + n]
            diff = max(diff, float((scored - gen.logprobs[i, :n]).abs().max()))
            start += lengths[i]
        out["invariant" if invariant else "default"] = diff
    return out


def _rows_equal(a, b, i, n=None):
    """Row i of outputs a and b: the same first n (default: a's length) tokens and log-probs."""
    n = int(a.response_lengths[i]) if n is None else n
    return torch.equal(a.response_tokens[i, :n], b.response_tokens[i, :n]) and \
        torch.equal(a.logprobs[i, :n], b.logprobs[i, :n])


def check_partial_rollouts():
    """Partial rollouts at (1, 1, 1): 4 prompts x 2 samples (groups of 2 consecutive rows), 4
    cache rows, rows stopping at an EOS: a quota of 1 whole group stops early, the finished rows
    are the full run's, the unfinished ones a prefix of it; resumed (same weights, seed and sample
    indices) they give the full run's responses: tokens, and log-probs bit for bit in
    batch-invariant mode (elsewhere a prefill's logits round differently from a decode step's)."""
    from puzzle.rollout.partial import GroupQuota

    res = {}
    pipelined = _engine(ParallelPlan(2, 1, 1))
    if pipelined.member:
        try:
            generate(pipelined, PROMPTS, PARAMS["greedy"], seed=SEED, stop=GroupQuota.consecutive(4, 2, 1))
        except ValueError as e:
            res["pipelined_refused"] = str(e)
        # resume at P=2 (length buckets through 2 stages): rows continuing 0, 3, 5, 7 of their tokens
        full = generate(pipelined, PROMPTS, PARAMS["plain"], seed=SEED, micro_batch_size=2)
        keep = [0, 3, 5, 7]
        again = generate(pipelined, PROMPTS, PARAMS["plain"], seed=SEED, micro_batch_size=2,
                         partial_tokens=[full.responses()[i][:k] for i, k in enumerate(keep)],
                         partial_logprobs=[full.logprobs[i, :k] for i, k in enumerate(keep)])
        res["pipelined_resume"] = {
            "tokens_equal": again.responses() == full.responses(),
            "kept_logprobs_equal": all(torch.equal(again.logprobs[i, :k], full.logprobs[i, :k])
                                       for i, k in enumerate(keep)),
            "logprob_max_diff": float((again.logprobs - full.logprobs).abs().max()),
            "forward_passes": [again.forward_passes, full.forward_passes]}
    eng = _engine(ParallelPlan(1, 1, 1))
    if not eng.member:
        return res
    rows = [p for p in PROMPTS for _ in range(2)]
    for name, modes in (("greedy", (True, False)), ("plain", (True,))):
        base = generate(eng, rows, PARAMS[name], seed=SEED, micro_batch_size=4)
        prm = replace(PARAMS[name], eos_id=int(base.response_tokens[0, 2]))
        for invariant in modes:
            run = dict(seed=SEED, micro_batch_size=4, batch_invariant=invariant)
            full = generate(eng, rows, prm, **run)
            part = generate(eng, rows, prm, stop=GroupQuota.consecutive(len(rows), 2, 1), **run)
            fin = part.finished.tolist()
            left = [i for i, f in enumerate(fin) if not f]
            resumed = generate(eng, [rows[i] for i in left], prm, sample_ids=left,
                               partial_tokens=[part.responses()[i] for i in left],
                               partial_logprobs=[part.logprobs[i, :int(part.response_lengths[i])] for i in left],
                               **run)
            diff = max((float((resumed.logprobs[j] - full.logprobs[i]).abs().max())
                        for j, i in enumerate(left)), default=0.0)
            res[f"{name}/{'invariant' if invariant else 'default'}"] = {
                "full_finished": full.finished.tolist(), "finished": fin,
                "full_lengths": full.response_lengths.tolist(),
                "lengths": part.response_lengths.tolist(),
                "forward_passes": [part.forward_passes, full.forward_passes],
                "finished_rows_equal": all(_rows_equal(part, full, i) and
                                           part.response_lengths[i] == full.response_lengths[i]
                                           for i in range(len(rows)) if fin[i]),
                "unfinished_prefix": all(_rows_equal(part, full, i) for i in left),
                "resumed_finished": resumed.finished.tolist(),
                "resumed_tokens_equal": [resumed.responses()[j] == full.responses()[i]
                                         for j, i in enumerate(left)],
                "resumed_logprobs_equal": all(torch.equal(resumed.logprobs[j], full.logprobs[i])
                                              for j, i in enumerate(left)),
                "resumed_logprob_max_diff": diff,
            }
    return res


class _ScriptedTurns:
    """Multi-turn rows for check_multi_turn: a turn ends at a token divisible by 4; each answer is
    3 observation tokens (depending on the history's length); 3 turns at most; the steps joined 2
    calls after their turns ended."""
    stops, max_turns, overlap_calls = [[t] for t in range(0, 200, 4)], 3, 2

    def __init__(self):
        self.calls = []

    def step(self, rows, turns, histories, final):
        self.calls += [(r, h, t, f) for r, h, t, f in zip(rows, histories, turns, final)]
        return [[100 + len(h) % 50] * 3 for h in histories]


def check_multi_turn():
    """Multi-turn generation at T=2 (every rank of the world at (1,2,2): two replicas of two TP
    ranks) against (1,1,1): the same tokens and observations; only each TP group's first rank
    steps the episodes (the other inserts the observations it broadcast)."""
    prm = SamplingParams(16)
    res = {}
    eng = _engine(ParallelPlan(1, 1, 1))
    if eng.member:
        out = generate(eng, PROMPTS, prm, seed=SEED, turns=_ScriptedTurns())
        res["reference"] = {"tokens": out.response_tokens.tolist(), "mask": out.observation_mask.tolist(),
                            "forward_passes": out.forward_passes, "counts": out.turn_counts}
    eng = _engine(ParallelPlan(1, 2, 2))
    lay, handler = eng.layout, _ScriptedTurns()
    out = generate(eng, PROMPTS[lay.d * 2:lay.d * 2 + 2], prm, seed=SEED, sample_offset=lay.d * 2, turns=handler)
    res["t2"] = _gather({"d": lay.d, "t": lay.t, "tokens": out.response_tokens.tolist(),
                         "mask": out.observation_mask.tolist(), "calls": len(handler.calls),
                         "counts": out.turn_counts})
    return res


if __name__ == "__main__":
    world_main([("reference", check_reference), ("layouts", check_layouts),
                ("eos_and_limits", check_eos_and_limits), ("errors", check_errors),
                ("fast_loop", check_fast_loop), ("lean_decode", check_lean_decode),
                ("moe_static_decode", check_moe_static_decode), ("batch_invariant_t4", check_batch_invariant_t4),
                ("partial_rollouts", check_partial_rollouts), ("multi_turn", check_multi_turn)])
