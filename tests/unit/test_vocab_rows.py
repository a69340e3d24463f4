"""Model vocabulary rows vs tokenizer ids: ModelArch.valid_vocab_size is the tokenizer's size,
set by validate_args on every role (flags and HF checkpoints), all the rows when the tokenizer has
more ids (tests/unit/test_tokenizer_rows.py: which of those ids may be fed); sampling never picks an id at or above it and its distribution is the one the scoring
log-probs use (T=1 here; T>1, P>1 and the trainer in tests/distributed/test_vocab_rows.py)."""

import json
from dataclasses import asdict

import pytest
import torch

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.config import ModelArch
from puzzle.rollout.sampling import SamplingParams, mask_padding, sample_tokens
from puzzle.engine.vocab_parallel import vocab_parallel_logprobs
from tests.unit.test_arguments import BASE

TOKENS, ROWS = 300, 400


def test_valid_vocab_size_is_the_tokenizers():
    a = ModelArch(vocab_size=ROWS, tokenizer_vocab_size=TOKENS)
    assert (a.vocab_size, a.valid_vocab_size, a.padded_vocab_size) == (ROWS, TOKENS, 512)
    same = ModelArch(vocab_size=TOKENS, tokenizer_vocab_size=TOKENS)
    # a tokenizer as large as the model is the one form "every row" (checkpoint metadata unchanged)
    assert same == ModelArch(vocab_size=TOKENS) and same.tokenizer_vocab_size is None
    assert same.valid_vocab_size == TOKENS and asdict(same)["tokenizer_vocab_size"] is None
    # more ids than rows (an added pad): every row is a token; fit_to_rows refuses a fed id beyond them
    more = ModelArch(vocab_size=TOKENS, tokenizer_vocab_size=TOKENS + 1)
    assert more == same and more.valid_vocab_size == TOKENS


def test_flags_set_the_tokenizers_ids_on_every_role():
    c = validate_args(parse_args(BASE + ["--vocab-size", str(ROWS)]), 4, TOKENS)
    for spec in c.roles.values():
        assert (spec.arch.vocab_size, spec.arch.valid_vocab_size) == (ROWS, TOKENS)
    c = validate_args(parse_args(BASE), 4, TOKENS)  # default: the model has the tokenizer's rows
    assert all((s.arch.vocab_size, s.arch.tokenizer_vocab_size) == (TOKENS, None) for s in c.roles.values())
    with pytest.raises(ArgumentError, match=f"^--vocab-size: 299 is smaller than the tokenizer's vocabulary "
                                            f"\\({TOKENS}\\)$"):
        validate_args(parse_args(BASE + ["--vocab-size", "299"]), 4, TOKENS)


def test_hf_checkpoint_with_more_rows_than_its_tokenizer(tmp_path):
    cfg = dict(model_type="qwen2", vocab_size=ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
               tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run = ["--seq-length", "64", "--micro-batch-size", "2", "--rollout-batch-size", "8", "--max-new-tokens", "16",
           "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--hf-actor-path", str(tmp_path)]
    c = validate_args(parse_args(run), 4, TOKENS)
    assert all((s.arch.vocab_size, s.arch.valid_vocab_size) == (ROWS, TOKENS) for s in c.roles.values())
    # a tokenizer with an id beyond the checkpoint's rows (an added pad) is not refused here
    c = validate_args(parse_args(run), 4, ROWS + 1)
    assert all((s.arch.vocab_size, s.arch.valid_vocab_size) == (ROWS, ROWS) for s in c.roles.values())


def _biased_logits(n=64, seed=0):
    """Logits over 512 rows whose rows >= TOKENS hold almost all the probability."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g)
    x[:, TOKENS:] += 6.0
    return x


@pytest.mark.parametrize("params", [SamplingParams(8, greedy=True), SamplingParams(8, temperature=0.7),
                                    SamplingParams(8, top_k=5), SamplingParams(8, top_p=0.9)],
                         ids=["greedy", "temperature", "top_k", "top_p"])
def test_sampling_never_picks_a_row_beyond_the_tokenizer(params):
    x = _biased_logits()
    assert float(torch.softmax(x, -1)[:, TOKENS:].sum(-1).min()) > 0.9
    for step in range(4):
        tok = sample_tokens(x, params, true_vocab=TOKENS, seed=3, sample_ids=torch.arange(len(x)), step=step)
        assert int(tok.max()) < TOKENS
        if params.greedy:
            assert tok.tolist() == x[:, :TOKENS].argmax(-1).tolist()


def test_scoring_gives_sampled_tokens_the_sampling_distribution():
    """The log-prob scoring computes for a token is log softmax over the tokenizer's ids, the
    distribution sample_tokens draws from."""
    x = _biased_logits(n=8)
    temperature = 0.7
    tok = sample_tokens(x, SamplingParams(8, temperature=temperature), true_vocab=TOKENS, seed=1,
                        sample_ids=torch.arange(8))
    lp = vocab_parallel_logprobs(x.unsqueeze(0), tok.unsqueeze(0), None, TOKENS, temperature=temperature)[0]
    ref = torch.log_softmax(x[:, :TOKENS] / temperature, -1).gather(1, tok.unsqueeze(1)).squeeze(1)
    assert torch.isfinite(lp).all() and torch.allclose(lp, ref, atol=1e-5)
    # T=2: the second rank's slice [256, 512) keeps ids 256..299 only
    assert torch.isinf(mask_padding(x[:, 256:], 256, TOKENS)[:, TOKENS - 256:]).all()
    assert torch.equal(mask_padding(x[:, 256:], 256, TOKENS)[:, :TOKENS - 256], x[:, 256:TOKENS])
