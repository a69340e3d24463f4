"""Prompt datasets and the deterministic, resumable, data-parallel prompt iterator.

``load_prompt_dataset`` reads local JSONL files itself, and Parquet / Arrow files or an HF hub
dataset name (``--prompt-data PATH|NAME``, ``--prompt-key KEY``) through HF ``datasets``;
it tokenizes every prompt once (optionally through the tokenizer's chat template) and applies
the prompt budget (``max_prompt_len``: truncate left or right, or drop), counting what it did in
``PromptDataset.stats``. ``--answer-key KEY`` names
the ground truth the reward functions read as the record's ``answer``. Both keys may name a
nested field with dots (verl's parquet files: ``--answer-key reward_model.ground_truth``); a
field whose own name contains the dots is taken first.

A malformed record raises ``PromptDataError`` naming the file and the line (JSONL, 1-based) or
the row (Parquet/Arrow, 0-based); with ``skip_bad_records=True`` it is skipped and counted.

``PromptLoader`` walks the dataset in epochs of ``len // global_batch`` global batches (each
epoch a fresh permutation seeded by (seed, epoch); the remainder of an epoch is not used) and
yields this DP rank's contiguous share of each global batch. Its position (epoch, batch) is
layout-independent: a state saved at one DP size resumes at another.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

OVERFLOW = ("truncate_left", "truncate_right", "drop")
# "name" or "org/name": read with datasets.load_dataset when no such local path exists
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


class PromptDataError(ValueError):
    """A prompt file that cannot be read (the message names the file and the line/row)."""


def bundled_prompts_path() -> str:
    """~64 short English prompts (key "prompt") shipped with the package, for tiny CPU runs."""
    return str(Path(__file__).resolve().parent / "bundled" / "tiny_prompts.jsonl")


@dataclass
class PromptStats:
    records: int = 0       # records read (blank JSONL lines excluded)
    loaded: int = 0        # prompts in the dataset
    bad_records: int = 0   # malformed records skipped (skip_bad_records=True)
    truncated: int = 0     # prompts longer than max_prompt_len, truncated
    dropped: int = 0       # prompts longer than max_prompt_len, dropped (overflow='drop')

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)


@dataclass
class PromptDataset:
    """Tokenized prompts (lists of ids) of one file; indexable like a sequence."""

    prompts: List[List[int]]
    source: str
    stats: PromptStats = field(default_factory=PromptStats)
    origins: List[str] = field(default_factory=list)  # "file:line" / "file:row" of each prompt
    records: List[Dict[str, Any]] = field(default_factory=list)  # each prompt's other fields (e.g. answer)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> List[int]:
        return self.prompts[i]


# ---- reading -----------------------------------------------------------------------------------
ANSWER_FIELD = "answer"  # the record field the reward functions read (reward_functions.builtin)


def nested_field(record: Any, key: str) -> Tuple[bool, Any]:
    """(found, value) of ``key`` in ``record``: the field of that name, else the dotted path
    (``reward_model.ground_truth``: the ``ground_truth`` field of the ``reward_model`` object)."""
    if isinstance(record, dict) and key in record:
        return True, record[key]
    head, dot, rest = key.partition(".")
    if not dot or not isinstance(record, dict) or head not in record:
        return False, None
    return nested_field(record[head], rest)


def _missing(record: Any, key: str, flag: str) -> str:
    """Why ``key`` is not in ``record``, naming the level where the path ends."""
    parts, node, path = key.split("."), record, []
    for part in parts:  # walk as far as the path goes
        if not isinstance(node, dict) or part not in node:
            break
        node, path = node[part], path + [part]
    keys = ", ".join(map(str, node)) if isinstance(node, dict) else ""
    if not path:
        detail = f"keys: {keys or 'none'}"
    elif isinstance(node, dict):
        detail = f"{'.'.join(path)!r} has {keys or 'no fields'}"
    else:
        detail = f"{'.'.join(path)!r} is {'null' if node is None else 'a ' + type(node).__name__}"
    return f"no key {key!r} ({detail}; see {flag})"


def _with_answer(others: Dict[str, Any], record: Dict[str, Any], answer_key: Optional[str]) -> Optional[str]:
    """Sets ``others["answer"]`` from ``answer_key`` (None: the record as it is); why not, if it cannot."""
    if answer_key is None:
        return None
    found, value = nested_field(record, answer_key)
    if not found or value is None:
        return _missing(record, answer_key, "--answer-key") if not found else f"{answer_key!r} is null"
    others[ANSWER_FIELD] = value
    return None


def _check_value(value: Any, chat: bool) -> Optional[str]:
    """None when ``value`` is a usable prompt, else why not."""
    if isinstance(value, str):
        return None if value.strip() else "empty prompt"
    if isinstance(value, (list, tuple)):
        if not chat:
            return "a list of messages; pass apply_chat_template=True (--apply-chat-template)"
        if not value:
            return "empty message list"
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return "messages must be objects with string 'role' and 'content'"
        return None
    return f"prompt must be a string{' or a list of messages' if chat else ''}, got {type(value).__name__}"


def _read_jsonl(path: str, key: str, chat: bool, skip: bool, stats: PromptStats, answer_key: Optional[str] = None
                ) -> Tuple[List[Any], List[str], List[Dict[str, Any]]]:
    values, origins, others = [], [], []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is an error of that line
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            stats.records += 1
            err = None
            try:
                line = raw.decode("utf-8")
                rec = json.loads(line)
            except UnicodeDecodeError as e:
                err = f"not UTF-8 ({e.reason} at byte {e.start} of the line)"
            except json.JSONDecodeError as e:
                err = f"invalid JSON ({e.msg} at column {e.colno})"
            else:
                other = {}
                if not isinstance(rec, dict):
                    err = f"not a JSON object (got {type(rec).__name__})"
                elif not nested_field(rec, key)[0]:
                    err = _missing(rec, key, "--prompt-key")
                else:
                    other = {k: v for k, v in rec.items() if k != key}
                    err = _check_value(nested_field(rec, key)[1], chat) or _with_answer(other, rec, answer_key)
            if err:
                if skip:
                    stats.bad_records += 1
                    continue
                raise PromptDataError(f"{path}:{lineno}: {err}")
            values.append(nested_field(rec, key)[1])
            origins.append(f"{path}:{lineno}")
            others.append(other)
    return values, origins, others


def _read_table(path: str, fmt: str, key: str, chat: bool, skip: bool, stats: PromptStats,
                cache_dir: Optional[str], split: str = "train", answer_key: Optional[str] = None
                ) -> Tuple[List[Any], List[str], List[Dict[str, Any]]]:
    import datasets

    try:
        if fmt == "hub":  # a dataset name on the HF hub (or in the local HF cache)
            ds = datasets.load_dataset(path, split=split, cache_dir=cache_dir)
        elif os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict) and split in ds:
                ds = ds[split]
            elif isinstance(ds, datasets.DatasetDict) and split == "train":  # the default: the first split
                ds = next(iter(ds.values()))
            elif split != "train":
                raise PromptDataError(f"--prompt-split {split!r}: {path} has "
                                      + (f"the splits {', '.join(ds)}" if isinstance(ds, datasets.DatasetDict)
                                         else "no splits"))
        else:
            ds = datasets.load_dataset(fmt, data_files=path, split="train", cache_dir=cache_dir)
    except PromptDataError:
        raise
    except Exception as e:
        what = f"the hub dataset (split {split!r})" if fmt == "hub" else fmt
        raise PromptDataError(f"{path}: cannot read as {what}: {e}") from e
    column = key if key in ds.column_names else key.partition(".")[0]  # a nested key: its top column
    if column not in ds.column_names:
        raise PromptDataError(f"{path}: no column {column!r} (columns: {', '.join(ds.column_names)}; "
                              f"see --prompt-key)")
    values, origins, others = [], [], []
    columns = {c: ds[c] for c in ds.column_names if c != column}
    for row, top in enumerate(ds[column]):
        stats.records += 1
        record = {column: top, **{c: col[row] for c, col in columns.items()}}
        found, value = nested_field(record, key)
        other = {c: col[row] for c, col in columns.items()}
        err = (_check_value(value, chat) if found else _missing(record, key, "--prompt-key")) \
            or _with_answer(other, record, answer_key)
        if err:
            if skip:
                stats.bad_records += 1
                continue
            raise PromptDataError(f"{path}: row {row}: {err}")
        values.append(value)
        origins.append(f"{path}:row{row}")
        others.append(other)
    return values, origins, others


def load_prompt_dataset(path: str, tokenizer, prompt_key: str = "prompt", *,
                        max_prompt_len: Optional[int] = None, overflow: str = "truncate_left",
                        apply_chat_template: bool = False, add_bos: bool = False,
                        skip_bad_records: bool = False, cache_dir: Optional[str] = None,
                        split: str = "train", answer_key: Optional[str] = None) -> PromptDataset:
    """Read and tokenize the prompts of a local JSONL / Parquet / Arrow file (or a directory
    written by ``datasets.Dataset.save_to_disk``).

    overflow: what to do with a prompt longer than ``max_prompt_len`` tokens:
    'truncate_left' (keep the last tokens: the end of a prompt is what the answer follows),
    'truncate_right' (keep the first tokens) or 'drop'. Counted in ``stats``.
    A string prompt with ``apply_chat_template`` becomes one user message. ``answer_key``: each
    record's ground truth, a field or a dotted path, kept as the record's ``answer`` (a record
    without it is malformed); None keeps the records as they are.
    """
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow must be one of {OVERFLOW}, got {overflow!r}")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    path = os.fspath(path)
    stats = PromptStats()
    if not os.path.exists(path):
        if not _HUB_NAME.match(path) or Path(path).suffix.lower() in FORMATS:
            raise FileNotFoundError(f"--prompt-data {path!r}: no such file or directory")
        fmt = "hub"
    elif os.path.isdir(path):
        fmt = "arrow"
    else:
        fmt = FORMATS.get(Path(path).suffix.lower())
        if fmt is None:
            raise PromptDataError(f"{path}: unknown prompt file type {Path(path).suffix!r} "
                                  f"(expected {', '.join(FORMATS)} or a save_to_disk directory)")
    if fmt != "hub" and not os.path.isdir(path) and split != "train":
        raise PromptDataError(f"--prompt-split {split!r}: {path} is one file, without splits")
    if fmt == "json":
        values, origins, others = _read_jsonl(path, prompt_key, apply_chat_template, skip_bad_records, stats,
                                              answer_key)
        if apply_chat_template:  # as a table's rows come: strings become one user message
            values = [[{"role": "user", "content": v}] if isinstance(v, str) else
                      [{"role": m["role"], "content": m["content"]} for m in v] for v in values]
    else:
        values, origins, others = _read_table(path, fmt, prompt_key, apply_chat_template, skip_bad_records,
                                              stats, cache_dir, split, answer_key)
    prompts, kept, kept_records = [], [], []
    for value, origin, other in zip(values, origins, others):
        if apply_chat_template:
            msgs = [{"role": "user", "content": value}] if isinstance(value, str) else list(value)
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        else:
            ids = tokenizer.encode(value, add_bos=add_bos)
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            if overflow == "drop":
                stats.dropped += 1
                continue
            stats.truncated += 1
            ids = ids[-max_prompt_len:] if overflow == "truncate_left" else ids[:max_prompt_len]
        prompts.append(ids)
        kept.append(origin)
        kept_records.append(other)
    stats.loaded = len(prompts)
    if not prompts:
        raise PromptDataError(f"{path}: no usable prompts ({stats.as_dict()})")
    return PromptDataset(prompts=prompts, source=path, stats=stats, origins=kept, records=kept_records)


# ---- iteration ---------------------------------------------------------------------------------
@dataclass
class PromptBatch:
    """This DP rank's prompts of one global batch."""

    iteration: int          # global batches yielded before this one (over all epochs)
    epoch: int
    indices: List[int]      # dataset indices
    prompts: List[List[int]]

    def __len__(self) -> int:
        return len(self.prompts)


class PromptLoader:
    """Deterministic, resumable, DP-sharded prompt iterator (infinite: epochs repeat reshuffled).

    Every DP rank builds the same permutation from (seed, epoch); global batch ``i`` of an epoch
    is ``perm[i*G : (i+1)*G]`` and DP rank ``r`` takes its ``r``-th contiguous ``G/dp_size``
    share. ``state_dict()`` is the position (epoch, batch within the epoch); it does not depend
    on ``dp_rank``/``dp_size``, so a run can resume at another data-parallel size.
    """

    def __init__(self, dataset: Sequence[List[int]], global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 1234, shuffle: bool = True):
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} is not divisible by dp_size={dp_size}")
        if len(dataset) < global_batch:
            raise ValueError(f"the prompt dataset has {len(dataset)} prompts, fewer than one "
                             f"global batch of {global_batch}")
        self.dataset, self.global_batch = dataset, global_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.batches_per_epoch = len(dataset) // global_batch
        self.epoch, self.batch = 0, 0
        self._perm_epoch, self._perm = None, None

    def _permutation(self, epoch: int) -> List[int]:
        if self._perm_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                import torch

                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(n, generator=g).tolist()
            else:
                self._perm = list(range(n))
            self._perm_epoch = epoch
        return self._perm

    @property
    def iteration(self) -> int:
        return self.epoch * self.batches_per_epoch + self.batch

    def __iter__(self) -> Iterator[PromptBatch]:
        return self

    def __next__(self) -> PromptBatch:
        perm = self._permutation(self.epoch)
        share = self.global_batch // self.dp_size
        start = self.batch * self.global_batch + self.dp_rank * share
        idx = perm[start:start + share]
        out = PromptBatch(iteration=self.iteration, epoch=self.epoch, indices=idx,
                          prompts=[list(self.dataset[i]) for i in idx])
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed,
                "global_batch": self.global_batch, "dataset_size": len(self.dataset),
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for k, mine in (("seed", self.seed), ("global_batch", self.global_batch),
                        ("dataset_size", len(self.dataset)), ("shuffle", int(self.shuffle))):
            if k in state and int(state[k]) != mine:
                raise ValueError(f"PromptLoader state has {k}={state[k]} but this loader has {mine}; "
                                 f"resume with the same prompt data, seed and global batch")
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if not 0 <= batch < self.batches_per_epoch or epoch < 0:
            raise ValueError(f"PromptLoader state position epoch={epoch} batch={batch} is invalid "
                             f"({self.batches_per_epoch} batches per epoch)")
        self.epoch, self.batch = epoch, batch
