"""4-rank world: KV-cache generation at several (P, D, T) layouts (rollout issue)."""

import torch
import torch.distributed as dist

from puzzle.config import ModelArch
from puzzle.parallel.groups import layout_for
from puzzle.parallel.plan import ParallelPlan
from puzzle.rollout import SamplingParams, generate
from tests.harness import world_main

ARCH = ModelArch(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
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


def _engine(plan):
    from puzzle.training.engine import ModelEngine

    if plan not in _ENGINES:
        _ENGINES[plan] = ModelEngine("actor", ARCH, layout_for(plan), trainable=False, seed=SEED)
    return _ENGINES[plan]


def _out(o):
    return {"tokens": o.tokens.tolist(), "attention_mask": o.attention_mask.tolist(),
            "prompt_mask": o.prompt_mask.tolist(), "response_mask": o.response_mask.tolist(),
            "prompt_lengths": o.prompt_lengths.tolist(), "response_lengths": o.response_lengths.tolist(),
            "responses": o.responses(), "prompt_length": o.prompt_length,
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
    }.items():
        try:
            call()
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


if __name__ == "__main__":
    world_main([("reference", check_reference), ("layouts", check_layouts),
                ("eos_and_limits", check_eos_and_limits), ("errors", check_errors)])
