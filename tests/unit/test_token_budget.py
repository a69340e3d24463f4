"""Token-budget micro-batches and DP balancing by tokens (puzzle/dataflow/token_budget.py), the
batch carrier's use of them, and the flags' checks (--use-dynamic-bsz)."""

import random

import pytest
import torch

from puzzle.arguments import parse_args, validate_args
from puzzle.flag_checks import ArgumentError
from puzzle.dataflow.batch import RolloutBatch, world_rows
from puzzle.dataflow.micro_batching import micro_batch_rows, micro_batches, most_budget_micro_batches
from puzzle.dataflow.token_budget import balance_rows, budget_micro_batches, split_to_count


def _random_lengths(seed: int, n: int):
    r = random.Random(seed)
    return [r.randint(1, 200) if r.random() < 0.5 else int(r.expovariate(1 / 30)) + 1 for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_balance_rows_equal_counts_and_tokens_within_one_sequence(seed):
    D = random.Random(seed).choice([1, 2, 3, 4, 8])
    lengths = _random_lengths(seed, D * random.Random(seed + 1).randint(1, 12))
    parts = balance_rows(lengths, D)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert {len(p) for p in parts} == {len(lengths) // D}
    assert all(p == sorted(p) for p in parts)
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lengths)
    assert balance_rows(lengths, D) == parts  # deterministic: every rank computes the same shares


def test_balance_rows_beats_contiguous_shares_on_long_tailed_rows():
    lengths = [512, 500, 480, 470, 40, 30, 20, 10]  # sorted by length, as a length-sorted rollout may be
    contiguous = [sum(lengths[:4]), sum(lengths[4:])]
    balanced = [sum(lengths[i] for i in p) for p in balance_rows(lengths, 2)]
    assert max(balanced) < max(contiguous) and max(balanced) - min(balanced) <= 40


def test_balance_rows_refuses_uneven_shares():
    with pytest.raises(ValueError, match="7 rows into 2"):
        balance_rows([1] * 7, 2)


@pytest.mark.parametrize("seed", range(40))
def test_budget_micro_batches_fit_cover_and_are_few(seed):
    lengths = _random_lengths(seed, random.Random(seed).randint(1, 40))
    budget = max(lengths) + random.Random(seed + 2).randint(0, 300)
    groups = budget_micro_batches(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    assert len(groups) >= -(-sum(lengths) // budget)
    # never more micro-batches than first-fit decreasing needs
    bins = []
    for n in sorted(lengths, reverse=True):
        for b in bins:
            if b[0] + n <= budget:
                b[0] += n
                break
        else:
            bins.append([n])
    assert len(groups) <= len(bins)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_budget_micro_batches_group_short_rows_and_isolate_long_ones():
    lengths = [100, 10, 10, 10, 10, 100]
    groups = budget_micro_batches(lengths, 100)
    assert len(groups) == 3 and [0] in groups and [5] in groups and [1, 2, 3, 4] in groups


def test_budget_micro_batches_refuse_a_sequence_over_the_budget():
    with pytest.raises(ValueError, match="a 101-token sequence does not fit the micro-batch token budget 100"):
        budget_micro_batches([5, 101], 100)
    with pytest.raises(ValueError, match=">= 1"):
        budget_micro_batches([5], 0)


@pytest.mark.parametrize("seed", range(20))
def test_split_to_count_gives_exactly_count_micro_batches_within_the_budget(seed):
    lengths = _random_lengths(seed, random.Random(seed).randint(2, 30))
    budget = max(lengths) + random.Random(seed + 3).randint(0, 300)
    groups = budget_micro_batches(lengths, budget)
    for count in range(len(groups), len(lengths) + 1):
        split = split_to_count(lengths, groups, count)
        assert len(split) == count and all(split)
        assert sorted(i for g in split for i in g) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= budget for g in split)
        assert [g[0] for g in split] == sorted(g[0] for g in split)
    assert split_to_count(lengths, groups, len(groups)) == groups
    for bad in (len(groups) - 1, len(lengths) + 1):
        with pytest.raises(ValueError, match=f"into {bad}"):
            split_to_count(lengths, groups, bad)


def _batch(lengths, prompt=3):
    B, R = len(lengths), max(lengths)
    tokens = torch.arange(B * (prompt + R)).reshape(B, prompt + R) % 97
    return RolloutBatch(tokens, torch.full((B,), prompt), torch.tensor(lengths), R, advantages=torch.randn(B, R))


def test_rollout_batch_budget_micro_batches_carry_their_rows():
    batch = _batch([9, 1, 2, 8, 1, 1])
    mbs = micro_batches(batch, 2, packed=True, token_budget=14)
    rows = torch.cat([mb["rows"] for mb in mbs])
    assert sorted(rows.tolist()) == list(range(6))
    for mb in mbs:
        assert int(mb["packed_seq_params"].total) == int((batch.prompt_lengths + batch.response_lengths)[mb["rows"]].sum())
        assert int(mb["packed_seq_params"].total) <= 14
        assert torch.equal(mb["advantages"], batch.fields["advantages"][mb["rows"]])
    # outputs in micro-batch order go back to batch order through the rows
    out = world_rows(torch.cat([batch.fields["advantages"][mb["rows"]] for mb in mbs]), [0], 6, (9,),
                     torch.float32, torch.device("cpu"), rows=rows)
    assert torch.equal(out, batch.fields["advantages"])
    with pytest.raises(ValueError, match="packed"):
        micro_batches(batch, 2, packed=False, token_budget=14)


def test_default_micro_batches_unchanged():
    batch = _batch([9, 1, 2, 8])
    mbs = micro_batches(batch, 2)
    assert [mb["tokens"].shape[0] for mb in mbs] == [2, 2] and "rows" not in mbs[0]
    assert torch.equal(mbs[1]["tokens"], batch.tokens[2:4])


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "48",
         "--max-new-tokens", "12", "--rollout-batch-size", "8", "--reward-model", "random"]


def _validate(*extra):
    return validate_args(parse_args(MODEL + list(extra)), 4, 259)


def test_flags_default_off_and_scoring_budget_defaults_to_training_budget():
    ppo = _validate().ppo
    assert not ppo.use_dynamic_bsz and ppo.ppo_max_token_len_per_gpu is None
    ppo = _validate("--use-dynamic-bsz", "--ppo-max-token-len-per-gpu", "96").ppo
    assert ppo.use_dynamic_bsz and ppo.log_prob_max_token_len_per_gpu == 96


@pytest.mark.parametrize("extra, flag, words", [
    (["--use-dynamic-bsz"], "--use-dynamic-bsz", "needs --ppo-max-token-len-per-gpu"),
    (["--ppo-max-token-len-per-gpu", "96"], "--ppo-max-token-len-per-gpu", "needs --use-dynamic-bsz"),
    (["--use-dynamic-bsz", "--ppo-max-token-len-per-gpu", "96", "--no-use-remove-padding"], "--use-dynamic-bsz",
     "needs packed micro-batches"),
    (["--use-dynamic-bsz", "--ppo-max-token-len-per-gpu", "47"], "--ppo-max-token-len-per-gpu",
     "less than the longest sequence"),
    (["--use-dynamic-bsz", "--ppo-max-token-len-per-gpu", "96", "--log-prob-max-token-len-per-gpu", "40"],
     "--log-prob-max-token-len-per-gpu", "36 + max new tokens 12 = 48"),
])
def test_bad_budget_flags_are_refused(extra, flag, words):
    with pytest.raises(ArgumentError) as e:
        _validate(*extra)
    assert flag in str(e.value) and words in str(e.value)


# ---- schedules and the cost/memory models with micro-batches of unequal tokens -------------------
def test_unequal_makespans_are_eq1_with_equal_costs_and_time_sharing_never_loses():
    from puzzle.pipeline import eq1_makespans, unequal_makespans

    assert unequal_makespans(4, [[1.0] * 4, [1.0] * 4], [1.0, 1.0], [2.0, 2.0]) == eq1_makespans(4, 4, [1, 1], [2, 2])
    for seed in range(30):
        r = random.Random(seed)
        costs = [[r.uniform(0.1, 1.0) for _ in range(r.randint(1, 6))] for _ in range(r.randint(1, 3))]
        f = [r.uniform(0.5, 2.0) for _ in costs]
        seq, shared = unequal_makespans(r.choice([2, 3, 4]), costs, f, [2 * x for x in f])
        assert shared <= seq + 1e-9
        assert shared >= sum(3 * fk * sum(c) for fk, c in zip(f, costs)) - 1e-9  # the busy time of stage 0
    with pytest.raises(ValueError, match="one list of num_microbatches"):
        from puzzle.pipeline import ContextSpec, simulate

        simulate(2, [ContextSpec("a", 2)], [1.0], [1.0], microbatch_scale=[[1.0]])


def test_cheap_micro_batches_shorten_the_simulated_stream():
    from puzzle.pipeline import unequal_makespans

    full = unequal_makespans(2, [[1.0] * 4], [1.0], [2.0])
    tailed = unequal_makespans(2, [[1.0, 0.2, 0.2, 0.2]], [1.0], [2.0])
    assert tailed[0] < full[0] and tailed[1] < full[1]


def test_workload_prices_micro_batches_by_tokens():
    from puzzle.plan_search.cost_model import PPOWorkload

    padded = PPOWorkload(16, prompt_len=100, gen_len=900, micro_batch_size=2, packed=False, mean_gen_len=200)
    assert padded.micro_batches(8, "training") == (4, 2000.0, 2000.0)  # B x S
    cap = PPOWorkload(16, prompt_len=100, gen_len=900, micro_batch_size=2)  # every response at the cap
    assert cap.micro_batches(8, "training") == (4, 2000.0, 2000.0)
    packed = PPOWorkload(16, prompt_len=100, gen_len=900, micro_batch_size=2, mean_gen_len=200)
    assert packed.micro_batches(8, "training") == (4, 600.0, 2000.0)  # mean tokens; memory at the cap
    budget = PPOWorkload(16, prompt_len=100, gen_len=900, mean_gen_len=200, train_token_budget=1000,
                         score_token_budget=3000)
    assert budget.micro_batches(8, "training") == (3, 800.0, 1000.0)  # ceil(8 x 300 / 1000)
    assert budget.micro_batches(8, "scoring") == (1, 2400.0, 3000.0)


def test_cost_and_memory_models_read_the_token_pricing():
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.model_shape import ModelShape
    from puzzle.plan_search.cost_model import CostModel, PPOWorkload, ppo_roles
    from puzzle.plan_search.memory_model import MemoryModel
    from puzzle.plan_search.profile_data import load_profile

    shape = ModelShape(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                       num_query_groups=16, vocab_size=32000)
    actor = ppo_roles(shape, shape)["actor"]
    plan = ParallelPlan(P=2, D=2, T=2)
    work = dict(rollout_batch_size=32, prompt_len=256, gen_len=3840, micro_batch_size=2)
    cap, tailed = PPOWorkload(**work), PPOWorkload(**work, mean_gen_len=768)
    budget = PPOWorkload(**work, mean_gen_len=768, train_token_budget=8192, score_token_budget=8192)
    costs = [CostModel(load_profile(), w) for w in (cap, tailed, budget)]
    train = [c.train_cost(actor, plan) for c in costs]
    assert train[1].total < train[0].total and train[1].n_micro == train[0].n_micro == 8
    assert train[2].n_micro == 2 and train[2].total < train[0].total
    assert costs[2].forward_cost(actor, plan).n_micro < costs[0].forward_cost(actor, plan).n_micro
    big = PPOWorkload(**work, mean_gen_len=768, train_token_budget=16384)  # vs 2 x 4096 tokens at the cap
    mem = [dict(MemoryModel(load_profile(), w).train_items(actor, plan, 1)) for w in (cap, budget, big)]
    assert mem[1]["actor activations"] == mem[0]["actor activations"]  # priced at the largest micro-batch
    assert mem[2]["actor activations"] > mem[0]["actor activations"]


def test_most_budget_micro_batches_is_the_largest_dp_share_count():
    """MoE models with experts split over E > 1 ranks: every DP rank runs the count of the share
    that needs the most token-budget micro-batches (their dispatchers' collectives pair up)."""
    batch = _batch([9, 1, 1, 1, 9, 9, 1, 1])
    counts = []
    for d in range(2):
        share = balance_rows(batch.sequence_lengths, 2)[d]
        counts.append(len(micro_batch_rows(batch.rows(torch.tensor(share)), 1, 14)))
    assert most_budget_micro_batches(batch, 2, 14) == max(counts) and len(set(counts)) == 2
    for d in range(2):
        share = batch.rows(torch.tensor(balance_rows(batch.sequence_lengths, 2)[d]))
        assert len(micro_batches(share, 1, packed=True, token_budget=14, count=max(counts))) == max(counts)


def test_micro_batching_packs_each_row_once_and_shares_packings():
    """The same rows of the same batch get the very same packing (the actor and the reference in
    scoring, a training mini-batch again); a new batch unpads its rows again (negative control)."""
    from puzzle.dataflow.micro_batching import MicroBatching

    batch = _batch([9, 1, 2, 8, 1, 1])
    micro = MicroBatching.standalone()
    first = micro_batches(batch, 2, packed=True, packer=micro)
    again = micro_batches(batch, 2, packed=True, packer=micro)
    assert all(a.packed_seq_params is b.packed_seq_params and a.tokens is b.tokens for a, b in zip(first, again))
    assert micro.rows_unpadded == 6 and micro.groups_packed == 3
    fresh = micro_batches(batch, 2, packed=True)  # packed from the rows alone: equal values
    assert all(torch.equal(a.tokens, b.tokens) and a.tokens is not b.tokens for a, b in zip(first, fresh))
    micro_batches(_batch([9, 1, 2, 8, 1, 1]), 2, packed=True, packer=micro)
    assert micro.rows_unpadded == 12 and micro.groups_packed == 6


def test_rollout_batch_fields_are_written_once_by_their_stage():
    batch = _batch([3, 1])
    scored = batch.with_outputs("scoring", values=torch.zeros(2, 3))
    assert batch.values is None and scored.values is not None and "values" in scored.fields
    with pytest.raises(ValueError, match="written once"):
        scored.with_outputs("scoring", values=torch.ones(2, 3))
    with pytest.raises(ValueError, match="cannot write the batch field 'scores'"):
        batch.with_outputs("scoring", scores=torch.ones(2))
    with pytest.raises(TypeError):
        batch.fields["scores"] = torch.ones(2)
