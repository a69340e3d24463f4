"""A tokenizer with ids beyond the model's vocabulary rows (puzzle.data.tokenizers.fit_to_rows): the
Qwen2 shape transformers makes (a 301-id tokenizer saved beside a 301-row checkpoint; AutoTokenizer
adds <|endoftext|> as id 301, its pad, eos and unk) loads: its stop id comes from
generation_config.json and padding feeds it instead of the pad beyond the rows. A stop id, BOS or
prompt id beyond the rows is refused naming the id and its token."""

import json

import pytest

from puzzle.data.tokenizers import ByteTokenizer, HFTokenizer, fit_to_rows

ROWS, STOP = 301, 299


def byte_tokenizer_without_specials(n=ROWS):
    """A byte-level BPE PreTrainedTokenizerFast of ``n`` ids (the 256 byte symbols, then fillers)
    that declares no special token: AutoTokenizer adds Qwen2's <|endoftext|> to it."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"<extra_{i}>": len(vocab) + i for i in range(n - len(vocab))})
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def qwen2_shaped(path, eos_token_id=STOP):
    """config.json (qwen2, ROWS rows), generation_config.json (``eos_token_id``) and the tokenizer of
    byte_tokenizer_without_specials, as save_pretrained writes them."""
    byte_tokenizer_without_specials().save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": ROWS}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return path


def test_qwen2_tokenizer_with_an_added_pad_loads_and_pads_with_a_row(tmp_path):
    tok = HFTokenizer(str(qwen2_shaped(tmp_path)))
    assert tok.vocab_size == ROWS + 1 and tok.tok.pad_token == "<|endoftext|>" and tok.tok.pad_token_id == ROWS
    assert tok.pad_id == ROWS  # not bound to a model yet: the tokenizer's own pad
    fit_to_rows(tok, ROWS, [tok.encode("hello world"), [0, 300]])
    assert tok.eos_ids == (STOP,) and tok.eos_id == STOP and tok.bos_id is None
    assert tok.pad_id == STOP  # padding never indexes the embedding beyond its rows
    tok.model_rows = None
    fit_to_rows(tok, ROWS + 1, [[ROWS]])  # a model with a row for it: the pad stays the pad
    assert tok.pad_id == ROWS


def test_ids_fed_beyond_the_rows_are_refused_naming_id_and_token(tmp_path):
    tok = HFTokenizer(str(qwen2_shaped(tmp_path / "a", eos_token_id=ROWS)))
    with pytest.raises(ValueError, match=r"^the stop \(EOS\) id 301 \('<\|endoftext\|>'\) has no row in the model: "
                                         r"it has 301 vocabulary rows \(ids 0\.\.300\) and the tokenizer 302 ids"):
        fit_to_rows(tok, ROWS)
    tok = HFTokenizer(str(qwen2_shaped(tmp_path / "b")))
    prompt = tok.encode("hi <|endoftext|>")  # the special token's text becomes its id
    assert prompt[-1] == ROWS
    with pytest.raises(ValueError, match=r"^in\.jsonl: prompt 2: its id 301 \('<\|endoftext\|>'\) has no row"):
        fit_to_rows(tok, ROWS, [[5], prompt], source="in.jsonl")
    assert tok.model_rows is None and tok.pad_id == ROWS  # refused: not bound
    byte = ByteTokenizer()  # <pad> 256, <s> 257, </s> 258 over 258 rows: eos has none
    with pytest.raises(ValueError, match=r"^the stop \(EOS\) id 258 \('</s>'\) has no row"):
        fit_to_rows(byte, 258)
    byte.EOS = 250  # a BOS beyond the rows is fed at the start of every prompt
    with pytest.raises(ValueError, match=r"^the BOS id 257 \('<s>'\) has no row"):
        fit_to_rows(byte, 257)


def test_train_ppo_refuses_a_stop_id_beyond_the_rows_before_any_work(tmp_path, capsys, monkeypatch):
    from puzzle import cli

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    d = qwen2_shaped(tmp_path, eos_token_id=ROWS)
    (d / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", vocab_size=ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True)))
    rc = cli.run(["--seq-length", "64", "--micro-batch-size", "2", "--rollout-batch-size", "8", "--max-new-tokens",
                  "16", "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--hf-actor-path", str(d),
                  "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d), "--init-random"])
    out, err = capsys.readouterr()
    assert rc == 2 and err == ("error: the stop (EOS) id 301 ('<|endoftext|>') has no row in the model: it has 301 "
                               "vocabulary rows (ids 0..300) and the tokenizer 302 ids; an id the run feeds or stops "
                               "on needs a row\n"), (out, err)
