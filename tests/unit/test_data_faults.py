"""Prompt files with bytes that are not UTF-8: FILE:LINE, or skipped and counted."""

import pytest

from puzzle.data.prompts import PromptDataError, load_prompt_dataset
from puzzle.data.tokenizers import build_tokenizer


def test_non_utf8_line_is_named_or_skipped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "first"}\n\n{"prompt": "caf\xe9 latin-1"}\n{"prompt": "third"}\n')
    tok = build_tokenizer("ByteLevelTokenizer", None)
    with pytest.raises(PromptDataError, match=rf"^{path}:3: not UTF-8 \(invalid continuation byte at byte 15"):
        load_prompt_dataset(str(path), tok)
    ds = load_prompt_dataset(str(path), tok, skip_bad_records=True)
    assert [tok.decode(p) for p in ds.prompts] == ["first", "third"]
    assert (ds.stats.records, ds.stats.bad_records, ds.stats.loaded) == (3, 1, 2)
    assert ds.origins == [f"{path}:1", f"{path}:4"]
