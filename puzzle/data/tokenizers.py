"""Tokenizers with one small interface: ``encode``, ``decode``, ``vocab_size``, ``eos_id``,
``eos_ids`` (every id that ends a response), ``pad_id``, ``bos_id`` and ``apply_chat_template``.

Names follow Megatron-LM's ``--tokenizer-type`` / ``--tokenizer-model`` flags:

``ByteLevelTokenizer``    built in, no files: ids 0..255 are the UTF-8 bytes, then the specials
                          pad=256, bos=257, eos=258 (vocab_size 259). For the tiny CPU runs and
                          tests. (Megatron-LM has no byte tokenizer; its ``NullTokenizer`` reads
                          whitespace-separated integers, a different thing — so the name differs.)
                          ``ByteTokenizer`` is accepted as an alias.
``HuggingFaceTokenizer``  ``transformers.AutoTokenizer`` from a LOCAL directory
                          (``--tokenizer-model DIR``); nothing is downloaded. The family's chat
                          template comes with it; the stop ids from the directory's
                          ``generation_config.json`` ``eos_token_id`` (an id or a list: Llama-3
                          Instruct stops at <|eot_id|> or <|end_of_text|>), else the tokenizer's eos.

A tokenizer may have ids beyond the model's vocabulary rows (a pad or special token added without
resizing the embeddings: AutoTokenizer gives a Qwen2 checkpoint's tokenizer <|endoftext|> as one
more id, its pad; Llama-2 fine-tunes add [PAD] as id 32000). ``fit_to_rows`` accepts them as long as
nothing the run feeds the model is among them: the stop ids, BOS and every prompt id (chat-template
tokens included) must have rows, else one ValueError names the id and its token; padding then
feeds the EOS id instead of a pad beyond the rows (padded positions are masked everywhere; their
token only has to exist). Sampling never picks a row the tokenizer has no id for, nor an id beyond
the rows (ModelArch.valid_vocab_size).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad / bos / eos. Lossless for any text."""

    PAD, BOS, EOS = 256, 257, 258
    _SPECIALS = {256: "<pad>", 257: "<s>", 258: "</s>"}

    name = "ByteLevelTokenizer"
    model_rows: Optional[int] = None  # fit_to_rows: the model's vocabulary rows

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def pad_id(self) -> int:
        """The pad id padding feeds the model: <pad>, or eos when <pad> has no row (fit_to_rows)."""
        return self.PAD if self.model_rows is None or self.PAD < self.model_rows else self.EOS

    def token_text(self, i: int) -> str:
        return self._SPECIALS.get(int(i)) or bytes([int(i)]).decode("latin-1")

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def eos_ids(self) -> tuple:
        return (self.EOS,)

    def encode(self, text: str, add_bos: bool = False) -> List[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if i not in self._SPECIALS:
                raise ValueError(f"ByteLevelTokenizer: id {i} outside the vocabulary (0..258)")
            if not skip_special_tokens:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(self._SPECIALS[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: List[Dict[str, str]], add_generation_prompt: bool = True
                            ) -> List[int]:
        """A plain-text template ("role: content" lines, then "assistant: "); for tests only."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text)


class HFTokenizer:
    """``transformers.AutoTokenizer`` loaded from a local directory (never downloads)."""

    name = "HuggingFaceTokenizer"
    model_rows: Optional[int] = None  # fit_to_rows: the model's vocabulary rows

    def __init__(self, directory: str):
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"--tokenizer-model {directory!r}: no such directory (HuggingFaceTokenizer loads "
                f"a local tokenizer directory, e.g. one written by save_pretrained)")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - the [hf] extra
            raise ImportError("HuggingFaceTokenizer needs transformers: pip install -e '.[hf]'") from e
        try:
            self.tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as e:
            raise ValueError(f"--tokenizer-model {directory!r}: could not load a tokenizer: {e}") from e
        self.directory = directory
        self._eos_ids = generation_eos_ids(directory)
        if self.tok.eos_token_id is None and not self._eos_ids:
            raise ValueError(f"tokenizer in {directory!r} has no eos token (and no generation_config.json "
                             f"eos_token_id)")
        if not self._eos_ids:
            self._eos_ids = (int(self.tok.eos_token_id),)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def eos_id(self) -> int:
        """The tokenizer's eos when it is a stop id, else the first stop id."""
        eos = self.tok.eos_token_id
        return int(eos) if eos is not None and int(eos) in self._eos_ids else self._eos_ids[0]

    @property
    def eos_ids(self) -> tuple:
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        """The pad id padding feeds the model: the tokenizer's pad token, else eos (LLaMA tokenizers
        have none), and eos when the pad token has no row in the model (fit_to_rows)."""
        pid = self.tok.pad_token_id
        if pid is None or (self.model_rows is not None and int(pid) >= self.model_rows):
            return self.eos_id
        return int(pid)

    def token_text(self, i: int) -> str:
        """The token of id ``i`` as the tokenizer writes it (special tokens by name)."""
        text = self.tok.convert_ids_to_tokens(int(i))
        return str(text) if text is not None else f"<id {int(i)}>"

    @property
    def bos_id(self) -> Optional[int]:
        bid = self.tok.bos_token_id
        return int(bid) if bid is not None else None

    def encode(self, text: str, add_bos: bool = False) -> List[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: List[Dict[str, str]], add_generation_prompt: bool = True
                            ) -> List[int]:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"tokenizer in {self.directory!r} has no chat template "
                             f"(drop --apply-chat-template or use a chat tokenizer)")
        out = self.tok.apply_chat_template(messages, tokenize=True,
                                           add_generation_prompt=add_generation_prompt)
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]


def generation_eos_ids(directory: str) -> tuple:
    """The ``eos_token_id`` (an int or a list) of ``directory/generation_config.json`` as a tuple;
    () when the file or the field is absent."""
    import json

    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an id or a list of ids (got {eos!r})")
    return tuple(dict.fromkeys(ids))


def fit_to_rows(tokenizer, rows: int, prompts: Sequence[Sequence[int]] = (), source: str = "prompts") -> None:
    """Bind ``tokenizer`` to a model of ``rows`` vocabulary rows (see the module docstring): a
    ValueError naming the id and its token when a stop id, BOS or an id of ``prompts`` (token ids
    as fed: BOS and chat-template tokens included; ``source`` names them) has no row; else padding
    feeds only ids with rows from now on."""
    def beyond(what: str, i: int) -> ValueError:
        return ValueError(f"{what} id {i} ({tokenizer.token_text(i)!r}) has no row in the model: it has {rows} "
                          f"vocabulary rows (ids 0..{rows - 1}) and the tokenizer {tokenizer.vocab_size} ids; "
                          f"an id the run feeds or stops on needs a row")

    if tokenizer.vocab_size > rows:
        for i in tokenizer.eos_ids:
            if i >= rows:
                raise beyond("the stop (EOS)", i)
        if tokenizer.bos_id is not None and tokenizer.bos_id >= rows:
            raise beyond("the BOS", tokenizer.bos_id)
        for n, ids in enumerate(prompts, 1):
            bad = next((int(i) for i in ids if int(i) >= rows), None)
            if bad is not None:
                raise beyond(f"{source}: prompt {n}: its", bad)
    tokenizer.model_rows = rows


BYTE_NAMES = ("ByteLevelTokenizer", "ByteTokenizer")
HF_NAMES = ("HuggingFaceTokenizer",)


def build_tokenizer(tokenizer_type: str = "ByteLevelTokenizer", tokenizer_model: Optional[str] = None):
    """Megatron-style factory: ``--tokenizer-type`` and ``--tokenizer-model``."""
    if tokenizer_type in BYTE_NAMES:
        return ByteTokenizer()
    if tokenizer_type in HF_NAMES:
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
        return HFTokenizer(tokenizer_model)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; "
                     f"expected one of {', '.join(BYTE_NAMES + HF_NAMES)}")
