"""Checkpoint saves that cannot deadlock, many in a row, and a failed write (tests/e2e/test_save_reliability.py).

- lock_held_across_a_save: a thread of this process holds a lock across a dist-checkpoint save, and
  the save's file writer needs that lock (megatron's ``_write_item`` is wrapped to take it). A
  writer forked while the lock is held (megatron-core 0.16's FileSystemWriterAsync) inherits it held
  by a thread that does not exist in the child and waits for ever: this check then ends the world
  after WATCHDOG_S with every thread's stack. Written from a thread of this process, the writer
  waits until the holder, seeing it asks, lets go; the save completes and loads back.
- twenty_saves: a tiny PPOTrainer (examples/run_ppo_tiny.sh: actor and ref at (2,1,2), critic at (1,2,2))
  saved SAVES times in a row through puzzle.checkpointing.save_checkpoint, the newest two kept:
  after each save the tracker names that iteration, published, with no ``.tmp`` left. Then one
  rank's write fails (disk full): every rank gets one SaveError, the coordinator's naming the
  failed rank and the phase; the tracker still names the last good save, which verifies and loads.

Both count the forks of this process (``os.register_at_fork``): none.
"""

import contextlib
import errno
import faulthandler
import functools
import multiprocessing
import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist

from tests.harness import checkpointed, tiny_flags, world_main

WATCHDOG_S = 60
ONE_RANK = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--critic-tensor-model-parallel-size", "1"]
SAVES = 20
_forks = [0]
os.register_at_fork(before=lambda: _forks.__setitem__(0, _forks[0] + 1))


@contextlib.contextmanager
def _watchdog(what: str):
    """End the world with every thread's stack when ``what`` is not done in WATCHDOG_S (forked
    writers stuck on an inherited lock are killed first: they would keep the output pipes open)."""
    done = threading.Event()

    def watch():
        if not done.wait(WATCHDOG_S):
            print(f"rank {dist.get_rank()}: {what} hung for {WATCHDOG_S}s", file=sys.stderr, flush=True)
            for child in multiprocessing.active_children():
                child.kill()
            faulthandler.dump_traceback(all_threads=True)
            os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        done.set()


@contextlib.contextmanager
def _writer_wrapped(wrapper):
    """megatron's per-item file write (filesystem_async._write_item) wrapped by ``wrapper(original)``."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._write_item
    filesystem_async._write_item = functools.wraps(original)(wrapper(original))  # keeps its signature
    try:
        yield
    finally:
        filesystem_async._write_item = original


def check_lock_held_across_a_save():
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    lock, held, asked = threading.Lock(), threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            asked.wait(timeout=2 * WATCHDOG_S)  # lets go once a writer in this process asks

    def needs_lock(original):
        def write(*args, **kwargs):
            asked.set()
            with lock:
                return original(*args, **kwargs)
        return write

    torch.manual_seed(rank)
    tensors = {f"w{i}": torch.randn(32, 16) for i in range(4)}
    sharded = {k: ShardedTensor.from_rank_offsets(k, v, (0, rank, world)) for k, v in tensors.items()}
    root = _shared_tmpdir("puzzle-lock-")
    forks = _forks[0]
    threading.Thread(target=holder, daemon=True).start()
    held.wait()
    with _writer_wrapped(needs_lock), _watchdog("a dist-checkpoint save with a lock held"):
        dist_checkpointing.save(sharded, root)
    blank = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(32, 16), (0, rank, world)) for k in tensors}
    loaded = dist_checkpointing.load(blank, root)
    return {"writer_asked": asked.is_set(), "forks": _forks[0] - forks,
            "same": all(torch.equal(loaded[k], tensors[k]) for k in tensors)}


def _shared_tmpdir(prefix: str) -> str:
    box = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _tiny_trainer():
    from dataclasses import replace

    from puzzle import cli
    from puzzle.arguments import parse_args, validate_args
    from puzzle.data.prompts import bundled_prompts_path, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer
    from puzzle.dataflow.trainer import PPOTrainer

    args = parse_args(tiny_flags() + (ONE_RANK if dist.get_world_size() == 1 else []))
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    cfg = replace(validate_args(args, dist.get_world_size(), tokenizer.vocab_size),
                  faults=cli.fault_injection_from_env({}))
    dataset = load_prompt_dataset(bundled_prompts_path(), tokenizer, cfg.prompt_key,
                                  max_prompt_len=cfg.ppo.max_prompt_length)
    return PPOTrainer(cfg, tokenizer, dataset)


def check_twenty_saves():
    from puzzle import checkpointing
    from puzzle.save_failures import SaveError

    root = os.path.join(_shared_tmpdir("puzzle-saves-"), "ckpt")
    trainer = _tiny_trainer()
    forks, published = _forks[0], []
    try:
        for eng in trainer.engines.values():
            if eng.trainable and eng.member:
                _adam_moments(eng.optimizer)
        weights = checkpointing.weight_fingerprint(trainer.engines["actor"])
        for it in range(1, SAVES + 2):
            trainer.iteration = it
            with _watchdog(f"save {it} of {SAVES} in a row"):
                if it > SAVES:
                    failed = _failed_save(trainer, root, checkpointing, SaveError)
                    break
                checkpointing.save_checkpoint(checkpointed(trainer), root, keep_last=2)
            published.append({"tracker": checkpointing.read_tracker(root), "dirs": sorted(os.listdir(root))})
            dist.barrier()  # every rank has looked before rank 0 starts the next save
        after = {"tracker": checkpointing.read_tracker(root), "dirs": sorted(os.listdir(root)),
                 "verified": checkpointing.verify_checkpoint(root)}
        with torch.no_grad():  # the load must bring the saved weights back
            for p in trainer.engines["actor"].module.parameters():
                p.add_(1.0)
        trainer.iteration = 0
        after["loaded"] = checkpointing.load_checkpoint(checkpointed(trainer), root)
        after["same_weights"] = checkpointing.weight_fingerprint(trainer.engines["actor"]) == weights
    finally:
        trainer.close()
    return {"published": published, "failed": failed, "after": after, "forks": _forks[0] - forks}


def _adam_moments(optimizer) -> None:
    """Adam's state, as a training step leaves it, in each torch optimizer of a megatron one
    (a fresh optimizer has none to save)."""
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = leaf.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p),
                                  "exp_avg_sq": torch.rand_like(p)}


def _failed_save(trainer, root, checkpointing, SaveError) -> dict:
    """One save whose file write fails on the last rank (disk full): the SaveError of each rank."""
    failing = dist.get_rank() == dist.get_world_size() - 1

    def disk_full(original):
        def write(*args, **kwargs):
            if failing:
                raise OSError(errno.ENOSPC, "No space left on device")
            return original(*args, **kwargs)
        return write

    with _writer_wrapped(disk_full):
        try:
            checkpointing.save_checkpoint(checkpointed(trainer), root, keep_last=2)
        except SaveError as e:
            return {"message": str(e), "informative": e.informative}
    return {"message": None}


if __name__ == "__main__":
    world_main([("lock", check_lock_held_across_a_save), ("saves", check_twenty_saves)])
