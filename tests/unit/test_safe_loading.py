"""Loading never runs code that comes with a file: RNG states of a checkpoint (tensors and
numbers, read with weights_only=True; files of earlier versions too) and a crafted checkpoint
refused in verification, before any model is built."""

import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch

from puzzle import checkpointing, rng_state
from puzzle.checkpointing import CheckpointError, read_rng_file


class CreatesAFile:
    """Unpickling this calls open(path, 'w'): what a tampered checkpoint could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _malicious_rng_file(path, marker):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"torch_cpu": torch.get_rng_state(), "python": CreatesAFile(str(marker))}, path)


def test_a_pickle_that_would_create_a_file_is_refused(tmp_path):
    marker = tmp_path / "created_by_the_checkpoint"
    path = tmp_path / "rng" / "rank_00000.pt"
    _malicious_rng_file(str(path), marker)
    with pytest.raises(CheckpointError) as e:
        read_rng_file(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}: refused") and "io.open" in msg and "--no-load-rng" in msg
    assert "\n" not in msg
    assert not marker.exists()


def test_not_a_state_file_is_a_clear_error(tmp_path):
    path = tmp_path / "rank_00000.pt"
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="refused"):
        read_rng_file(str(path))
    torch.save({"other": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="expected a dict with 'torch_cpu'"):
        read_rng_file(str(path))


def _draws():
    return torch.rand(3).tolist(), random.random(), np.random.rand()


def test_states_round_trip_in_this_and_the_earlier_format(tmp_path):
    """The new file (tensors only) and an earlier version's (numpy's ndarray, Python's tuple) both
    load with weights_only=True and restore the same draws."""
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    new = {"torch_cpu": torch.get_rng_state(),
           "python": {"version": version, "internal": torch.tensor(internal), "gauss_next": gauss},
           "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                     "has_gauss": has_gauss, "cached_gaussian": cached}}
    earlier = {"torch_cpu": torch.get_rng_state(), "python": random.getstate(), "tracker": {},
               "numpy": np.random.get_state()}
    expected = _draws()
    for i, state in enumerate((new, earlier)):
        path = tmp_path / f"rank_{i}.pt"
        torch.save(state, path)
        _draws()
        rng_state.set_rng_state(read_rng_file(str(path)))
        assert _draws() == expected


def _craft_checkpoint(root, cfg, marker):
    """iter_0000001 whose manifest matches its files (a tampered checkpoint would be consistent)."""
    d = root / "iter_0000001"
    _malicious_rng_file(str(d / "rng" / "rank_00000.pt"), marker)
    (d / "trainer_state.json").write_text("{}")
    meta = checkpointing.run_metadata(cfg)
    meta["iteration"] = 1
    meta["files"] = {rel: [os.path.getsize(d / rel), hashlib.sha256((d / rel).read_bytes()).hexdigest()]
                     for rel in ("trainer_state.json", "rng/rank_00000.pt")}
    (d / "metadata.json").write_text(json.dumps(meta))
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")


def test_a_crafted_checkpoint_is_refused_before_any_model(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    from puzzle import cli
    from puzzle.arguments import parse_args, validate_args

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--tokenizer-type", "ByteLevelTokenizer",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--critic-tensor-model-parallel-size", "1", "--rollout-batch-size", "2", "--micro-batch-size", "1",
            "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--train-iters", "1"]
    marker = tmp_path / "created_by_the_checkpoint"
    _craft_checkpoint(tmp_path / "ckpt", validate_args(parse_args(argv), 1, 259), marker)
    try:
        rc = cli.run(argv + ["--load", str(tmp_path / "ckpt")])
    finally:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err, (rc, out, err)
    assert "checkpoint iteration 1 is damaged" in err and "rank_00000.pt: refused" in err
    assert not marker.exists() and not dist.is_initialized()
