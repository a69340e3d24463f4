"""Tokenizers, prompt datasets (JSONL / Parquet / Arrow) and the DP-sharded prompt loader."""

import json

import pytest

from puzzle.data import (ByteTokenizer, PromptDataError, PromptLoader, build_tokenizer,
                         bundled_prompts_path, load_prompt_dataset)


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture
def byte_tok():
    return build_tokenizer("ByteLevelTokenizer")


# ---- tokenizers --------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip(byte_tok):
    text = "Hello, wörld — 你好 🙂"
    ids = byte_tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert byte_tok.decode(ids) == text
    assert byte_tok.vocab_size == 259
    assert {byte_tok.pad_id, byte_tok.bos_id, byte_tok.eos_id} == {256, 257, 258}
    ids = byte_tok.encode("hi", add_bos=True) + [byte_tok.eos_id, byte_tok.pad_id]
    assert byte_tok.decode(ids) == "hi"
    assert byte_tok.decode(ids, skip_special_tokens=False) == "<s>hi</s><pad>"
    assert isinstance(build_tokenizer("ByteTokenizer"), ByteTokenizer)
    with pytest.raises(ValueError, match="unknown --tokenizer-type"):
        build_tokenizer("SentencePieceTokenizer")


def test_hf_tokenizer_missing_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        build_tokenizer("HuggingFaceTokenizer", str(missing))
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", None)


@pytest.fixture(scope="module")
def hf_tok_dir(tmp_path_factory):
    """A tiny word-level fast tokenizer with a chat template, saved locally (no downloads)."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "hello world what is the sun a of capital france user assistant : ? .".split()
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + words)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant : {% endif %}")
    d = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(str(d))
    return str(d)


def test_hf_tokenizer_round_trip_and_chat_template(hf_tok_dir, tmp_path):
    tok = build_tokenizer("HuggingFaceTokenizer", hf_tok_dir)
    ids = tok.encode("what is the sun ?")
    assert tok.decode(ids) == "what is the sun ?"
    assert tok.eos_id == 2 and tok.pad_id == 3 and tok.bos_id == 1
    assert tok.encode("hello", add_bos=True)[0] == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert tok.decode(chat) == "user : hello world assistant :"
    path = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"q": "hello world"}),
                                                 json.dumps({"q": [{"role": "user", "content": "what is the sun ?"}]})])
    ds = load_prompt_dataset(path, tok, "q", apply_chat_template=True)
    assert [tok.decode(p) for p in ds.prompts] == ["user : hello world assistant :",
                                                    "user : what is the sun ? assistant :"]


# ---- prompt files ------------------------------------------------------------------------------
def test_bundled_prompts(byte_tok):
    ds = load_prompt_dataset(bundled_prompts_path(), byte_tok)
    assert len(ds) == 64 and ds.stats.bad_records == 0
    assert byte_tok.decode(ds[0]) == "Write a short poem about the sea."


def test_jsonl_parquet_and_arrow_load_the_same(tmp_path, byte_tok):
    import datasets
    texts = ["alpha", "beta gamma", "delta"]
    jl = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)])
    table = datasets.Dataset.from_dict({"text": texts, "id": [0, 1, 2]})
    pq = str(tmp_path / "p.parquet")
    table.to_parquet(pq)
    disk = str(tmp_path / "saved")
    table.save_to_disk(disk)
    arrow = next(str(p) for p in (tmp_path / "saved").glob("*.arrow"))
    cache = str(tmp_path / "cache")
    for path in (jl, pq, disk, arrow):
        ds = load_prompt_dataset(path, byte_tok, "text", cache_dir=cache)
        assert [byte_tok.decode(p) for p in ds.prompts] == texts, path
    with pytest.raises(PromptDataError, match="no column 'prompt'"):
        load_prompt_dataset(pq, byte_tok, "prompt", cache_dir=cache)


def test_verl_parquet_with_a_nested_answer_key(tmp_path, byte_tok):
    """verl's layout read as it is: message-list prompts, the ground truth under
    reward_model.ground_truth (--answer-key) kept as the record's 'answer' that the reward
    functions read; a record without it is named; without --answer-key the records stay as they are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from puzzle.arguments import parse_args
    from puzzle.reward_functions.builtin import exact_match

    sums = [(1, 2), (4, 4), (9, 0)]
    rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": f"{a}+{b}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i}} for i, (a, b) in enumerate(sums)]
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    cache = str(tmp_path / "cache")
    ds = load_prompt_dataset(path, byte_tok, "prompt", apply_chat_template=True, cache_dir=cache,
                             answer_key="reward_model.ground_truth")
    assert [byte_tok.decode(p) for p in ds.prompts] == [f"user: {a}+{b}=\nassistant: " for a, b in sums]
    assert [r["answer"] for r in ds.records] == ["3", "8", "9"]
    assert ds.records[2]["reward_model"] == {"style": "rule", "ground_truth": "9"}
    assert exact_match([], ["3", "8", "8"], ds.records) == [1.0, 1.0, 0.0]
    plain = load_prompt_dataset(path, byte_tok, "prompt", apply_chat_template=True, cache_dir=cache)
    assert all("answer" not in r for r in plain.records)
    # the same nested key in JSONL; a record without it is malformed, named with where the path ends
    lines = [json.dumps({k: rows[i][k] for k in ("prompt", "reward_model")}) for i in range(3)]
    lines[1] = json.dumps({"prompt": rows[1]["prompt"], "reward_model": {"style": "rule"}})
    jl = _write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.raises(PromptDataError, match=r"p\.jsonl:2: no key 'reward_model\.ground_truth' "
                                              r"\('reward_model' has style; see --answer-key\)"):
        load_prompt_dataset(jl, byte_tok, apply_chat_template=True, answer_key="reward_model.ground_truth")
    ds = load_prompt_dataset(jl, byte_tok, apply_chat_template=True, answer_key="reward_model.ground_truth",
                             skip_bad_records=True)
    assert [r["answer"] for r in ds.records] == ["3", "9"] and ds.stats.bad_records == 1
    pq.write_table(pa.Table.from_pylist([dict(rows[0], reward_model=None)]), path)
    with pytest.raises(PromptDataError, match=r"row 0: no key 'reward_model.ground_truth' \('reward_model' is null"):
        load_prompt_dataset(path, byte_tok, apply_chat_template=True, cache_dir=cache,
                            answer_key="reward_model.ground_truth")
    assert parse_args(["--answer-key", "reward_model.ground_truth"]).answer_key == "reward_model.ground_truth"


def test_prompt_split_is_read_or_refused(tmp_path, byte_tok):
    import datasets
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a", "b"]}),
                                   "test": datasets.Dataset.from_dict({"prompt": ["c"]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    assert [byte_tok.decode(p) for p in load_prompt_dataset(str(tmp_path / "dd"), byte_tok, split="test").prompts] \
        == ["c"]
    assert len(load_prompt_dataset(str(tmp_path / "dd"), byte_tok).prompts) == 2
    with pytest.raises(PromptDataError, match="--prompt-split 'validation': .* has the splits train, test"):
        load_prompt_dataset(str(tmp_path / "dd"), byte_tok, split="validation")
    one = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "x"})])
    with pytest.raises(PromptDataError, match="--prompt-split 'test': .* is one file, without splits"):
        load_prompt_dataset(one, byte_tok, split="test")


def test_malformed_jsonl_names_file_and_line(tmp_path, byte_tok):
    lines = [json.dumps({"prompt": "ok one"}), "", json.dumps({"prompt": "ok two"}),
             '{"prompt": "broken', json.dumps({"other": 1}), json.dumps(["not", "a", "dict"]),
             json.dumps({"prompt": 17}), json.dumps({"prompt": "ok three"})]
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:4: invalid JSON"):
        load_prompt_dataset(path, byte_tok)
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:4: no key 'prompt'"):
        load_prompt_dataset(_write_jsonl(tmp_path / "bad.jsonl", lines[:3] + lines[4:]), byte_tok)
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    ds = load_prompt_dataset(path, byte_tok, skip_bad_records=True)
    assert [byte_tok.decode(p) for p in ds.prompts] == ["ok one", "ok two", "ok three"]
    assert ds.stats.bad_records == 4 and ds.stats.records == 7 and ds.stats.loaded == 3
    assert ds.origins[-1].endswith("bad.jsonl:8")
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_prompt_dataset(str(tmp_path / "nowhere.jsonl"), byte_tok)


def test_prompt_budget_truncates_or_drops(tmp_path, byte_tok):
    path = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": t}) for t in ["abcdefgh", "abc", "0123456789"]])
    left = load_prompt_dataset(path, byte_tok, max_prompt_len=4)
    assert [byte_tok.decode(p) for p in left.prompts] == ["efgh", "abc", "6789"]
    assert left.stats.truncated == 2 and left.stats.dropped == 0
    right = load_prompt_dataset(path, byte_tok, max_prompt_len=4, overflow="truncate_right")
    assert [byte_tok.decode(p) for p in right.prompts] == ["abcd", "abc", "0123"]
    drop = load_prompt_dataset(path, byte_tok, max_prompt_len=4, overflow="drop")
    assert [byte_tok.decode(p) for p in drop.prompts] == ["abc"]
    assert drop.stats.dropped == 2 and drop.stats.truncated == 0 and drop.stats.loaded == 1
    with pytest.raises(ValueError, match="overflow"):
        load_prompt_dataset(path, byte_tok, max_prompt_len=4, overflow="middle")


# ---- the loader --------------------------------------------------------------------------------
def _ids(n):
    return [[i] for i in range(n)]


def test_loader_is_deterministic_and_covers_each_epoch():
    a = [next(it).indices for it in [PromptLoader(_ids(20), 6, seed=3)] for _ in range(3)]
    it1, it2 = PromptLoader(_ids(20), 6, seed=3), PromptLoader(_ids(20), 6, seed=3)
    b1 = [next(it1).indices for _ in range(7)]
    assert b1 == [next(it2).indices for _ in range(7)]
    assert a == b1[:3]
    epoch0 = [i for b in b1[:3] for i in b]
    assert len(set(epoch0)) == 18  # 3 batches of 6 out of 20, no repeats
    assert b1[3] != b1[0]  # epoch 1 reshuffled
    assert PromptLoader(_ids(20), 6, seed=4).__next__().indices != b1[0]
    plain = PromptLoader(_ids(20), 6, shuffle=False)
    assert next(plain).indices == list(range(6))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        PromptLoader(_ids(3), 4)
    with pytest.raises(ValueError, match="not divisible by dp_size"):
        PromptLoader(_ids(30), 6, dp_rank=0, dp_size=4)


def test_loader_dp_shards_partition_the_global_batch():
    full = PromptLoader(_ids(40), 8, seed=1)
    ranks = [PromptLoader(_ids(40), 8, dp_rank=r, dp_size=4, seed=1) for r in range(4)]
    for _ in range(6):
        whole = next(full)
        parts = [next(r) for r in ranks]
        assert [i for p in parts for i in p.indices] == whole.indices
        assert all(len(p) == 2 and p.iteration == whole.iteration for p in parts)
        assert parts[1].prompts == [[i] for i in parts[1].indices]


def test_loader_resumes_from_state_at_any_dp_size():
    ref = PromptLoader(_ids(25), 4, seed=9)
    seq = [next(ref).indices for _ in range(10)]
    first = PromptLoader(_ids(25), 4, seed=9)
    for _ in range(7):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptLoader(_ids(25), 4, seed=9)
    resumed.load_state_dict(state)
    assert [next(resumed).indices for _ in range(3)] == seq[7:]
    halves = [PromptLoader(_ids(25), 4, dp_rank=r, dp_size=2, seed=9) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    assert next(halves[0]).indices + next(halves[1]).indices == seq[7]
    with pytest.raises(ValueError, match="seed=9"):
        PromptLoader(_ids(25), 4, seed=10).load_state_dict(state)


def test_hub_dataset_name(monkeypatch, byte_tok):
    """A name that is not a local path goes to datasets.load_dataset (faked: no network here)."""
    import datasets

    calls = []

    def fake_load_dataset(name, split=None, cache_dir=None, **kw):
        calls.append((name, split))
        if name == "org/missing":
            raise ConnectionError("offline")
        return datasets.Dataset.from_dict({"question": ["hello there", "", "a longer prompt here"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_prompt_dataset("org/prompts", byte_tok, "question", split="test", skip_bad_records=True,
                             max_prompt_len=12, overflow="drop")
    assert calls == [("org/prompts", "test")]
    assert [byte_tok.decode(p) for p in ds.prompts] == ["hello there"]
    assert ds.stats.as_dict() == {"records": 3, "loaded": 1, "bad_records": 1, "truncated": 0, "dropped": 1}
    with pytest.raises(PromptDataError, match=r"org/missing: cannot read as the hub dataset \(split 'train'\): offline"):
        load_prompt_dataset("org/missing", byte_tok, "question")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_prompt_dataset("missing/prompts.jsonl", byte_tok, "question")
