"""A tokenizer with fewer ids than the model has vocabulary rows (tests/distributed/worlds/vocab_rows.py):
PPO and GRPO from flags (--vocab-size above the tokenizer's) and from a Qwen2 HF checkpoint whose
config.json has more rows than its tokenizer, at (1,1,1) and (2,1,2), over several sampled
iterations with the unused rows biased to hold most of the unmasked probability. No id the
tokenizer lacks is sampled, every log-prob is finite, and the log-prob each token was sampled with
is the one scoring computed. And a tokenizer with an id beyond the model's rows (an added pad) at
(1,1,1) and (2,1,2): fine unless an id beyond the rows would be fed.

The log-prob generation records for each token is the one computed from its sampling logits, and
the run's generation-vs-scoring difference (gen_score_logprob_diff_max) stays within FP32_LOGPROB_TOL:
on the same logits the two log-probs are equal bit for bit (tests/unit/test_rollout_correction.py),
but a decode step (one query against the KV cache) and scoring's forward of the whole packed
sequence are different fp32 reductions, so their logits, and the log-probs, differ by fp32 rounding
(one or two ulps of a log-prob of magnitude 4 to 8: 4.8e-7 each; measured <= 9.5e-7)."""

import math

import pytest

from tests.harness import run_world

TOKENS = 300
FP32_LOGPROB_TOL = 2e-6


@pytest.fixture(scope="module")
def worlds():
    return {1: run_world("distributed/worlds/vocab_rows.py", 1), 4: run_world("distributed/worlds/vocab_rows.py", 4)}


RUNS = [(1, "ppo_flags_111"), (1, "grpo_hf_111"), (4, "ppo_hf_212"), (4, "grpo_flags_212")]


@pytest.mark.parametrize("size,name", RUNS)
def test_sampled_tokens_are_tokenizer_ids_scored_as_sampled(worlds, size, name):
    ranks = [r["runs"][name] for r in worlds[size]]
    for run in ranks:
        assert run["arch"] == [400, TOKENS, 512]  # rows, ids a response may have, padded rows
        assert all(run["finite"].values()) and set(run["finite"]) >= {"old_logprobs", "ref_logprobs", "entropy"}
        assert run["max_response_id"] < TOKENS
        for m in run["metrics"]:
            assert all(math.isfinite(v) for v in m.values()), m
            assert 0 <= m["gen_score_logprob_diff_max"] <= FP32_LOGPROB_TOL, m
            assert 0 <= m["gen_score_logprob_diff_mean"] <= m["gen_score_logprob_diff_max"], m
            if name == "grpo_flags_212":  # --rl-inference-logprobs-is-correction, truncated at 2
                assert abs(m["is_weight_mean"] - 1) < 1e-5 and m["is_truncated_frac"] == 0, m
            else:
                assert "is_weight_mean" not in m
    for it in ("iter0", "iter1"):
        sampled = [r[it] for r in ranks if r[it]["compared"]]
        assert sum(s["compared"] for s in sampled) >= 16, it
        for s in sampled:
            assert s["mismatched"] == 0 and s["gap"] < 1e-4, (it, s)
            assert s["recorded_gap"] <= FP32_LOGPROB_TOL, (it, s)
            # without the mask most sampled tokens would be ids the tokenizer does not have
            assert s["unused_mass"] > 0.2, (it, s)


def test_whole_step_decode_path_samples_only_tokenizer_ids(worlds):
    for r in worlds[4]:
        g = r["runs"]["grpo_flags_212"]["graph"]
        assert (g["T"], g["P"]) == (2, 1) and g["whole_step_settings"] == 1
        assert g["same_tokens"] and g["max_id"] < TOKENS and g["unused_mass"] > 0.2
        # the whole-step graph records the log-probs too (static-shape decode: fp32 rounding apart)
        assert g["logprob_gap"] <= FP32_LOGPROB_TOL and g["logprobs_past_response"] == 0


@pytest.mark.parametrize("size", [1, 4])
def test_tokenizer_id_beyond_the_rows_is_fine_unless_fed(worlds, size):
    """The Qwen2 shape transformers makes: 301 rows, AutoTokenizer adds <|endoftext|> (id 301) as
    its pad. puzzle.tools.generate at (1,1,1) / (2,1,2) gives transformers' greedy tokens and never
    feeds the embedding an id beyond the rows; the same checkpoint stopping at id 301 is refused."""
    ranks = [r["added_pad"] for r in worlds[size]]
    made = ranks[0]["made"]
    assert made["ids"] == 302 and made["pad"] == ["<|endoftext|>", 301]
    assert ranks[0]["tokens"] == made["greedy"] and all(len(t) == 5 for t in made["greedy"])
    for r in ranks:
        assert r["rc"] == 0 and r["max_fed_id"] < 301 and r["refused_rc"] == 2
    assert ranks[0]["refusal"] == ("error: the stop (EOS) id 301 ('<|endoftext|>') has no row in the model: it has "
                                   "301 vocabulary rows (ids 0..300) and the tokenizer 302 ids; an id the run feeds "
                                   "or stops on needs a row\n")
    assert all(r["refusal"] == "" for r in ranks[1:])  # one line, from rank 0
    if size == 1:  # training: right-padded rows over exactly 301 embedding rows
        assert ranks[0]["ppo"]["iterations"] == 1 and 0 < ranks[0]["ppo"]["max_fed_id"] < 301
