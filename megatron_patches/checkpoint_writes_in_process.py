"""Patch: dist-checkpoint saves write their files from threads of the saving process; nothing forks.

Target: megatron.core.dist_checkpointing.strategies.filesystem_async
(``FileSystemWriterAsync.write_preloaded_data_multiproc`` and ``_get_write_results_queue``) and
strategies.async_utils (``TemporalAsyncCaller`` / ``PersistentAsyncCaller.schedule_async_call``),
checked on megatron-core 0.16.0 and 0.16.1.

Reason: the torch_dist save strategy (``TorchDistSaveShardedStrategy``, the default of
``dist_checkpointing.save``) writes each rank's shards from ``write_preloaded_data_multiproc``,
which starts one writer process per bucket with the "fork" start method after ``count_queue.put``
has started a queue-feeder thread, in a process that already runs gloo's threads, the reward
worker pool's threads and the allocator's. A lock held by any of them at the fork stays held
forever in the child: the classic fork-after-threads deadlock. Seen: rank 0 waiting for ever at
``count_queue.join()``, its writer stuck in ``futex_wait`` at ``Popen._launch``, the other ranks
in the save's barrier. ``_get_write_results_queue`` also starts a ``multiprocessing`` Manager
process per rank (the reason entry scripts needed an ``if __name__ == "__main__"`` guard).

The fix: the buckets are written by threads of this process (one per bucket, joined before the
function returns; the same ``write_preloaded_data`` megatron runs in each child, so the files,
their names and the write results are unchanged), and the results travel through a plain
``queue.Queue`` made for each writer. puzzle saves synchronously (``dist_checkpointing.save``
without ``async_sharded_save``); megatron's background savers, which fork or spawn the whole
writer, are refused with a message instead (their results could not cross a thread queue).

Remove when: megatron-core writes the buckets without forking (upstream replaced the forked
writers with threads, NVIDIA/Megatron-LM#3633) and makes no Manager process for a synchronous save.
"""

from __future__ import annotations

import queue
import threading

_applied = False


def write_buckets_in_threads(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``write_preloaded_data_multiproc`` without processes: each bucket is written by
    ``FileSystemWriterAsync.write_preloaded_data`` in a thread of its own; the results (or the
    first bucket's exception) go into ``global_results_queue`` as megatron's version puts them."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    local_results, count_queue = queue.Queue(), queue.Queue()
    kwargs = {"use_msc": True} if use_msc else {}
    threads = []
    for i, bucket in enumerate(write_buckets):
        count_queue.put(i)  # write_preloaded_data takes one item off and marks it done
        threads.append(threading.Thread(
            target=FileSystemWriterAsync.write_preloaded_data, name=f"checkpoint-writer-{i}",
            args=(transform_list, i, bucket, local_results, count_queue, True), kwargs=kwargs, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results: dict = {}
    for n in range(len(write_buckets)):
        try:
            idx, result = local_results.get_nowait()
        except queue.Empty:  # a thread ended by something other than an Exception
            results = RuntimeError(f"checkpoint writer threads returned {n} of {len(write_buckets)} results")
            break
        if isinstance(result, BaseException):
            results = result
            break
        results[idx] = result
    global_results_queue.put(results)


def _refuse_background_save(self, async_req) -> None:
    raise NotImplementedError(
        "megatron's background checkpoint savers fork or spawn the writer; puzzle saves synchronously "
        "(megatron_patches.checkpoint_writes_in_process)")


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_buckets_in_threads)
    filesystem_async._get_write_results_queue = queue.Queue  # a fresh in-process queue per writer
    async_utils.TemporalAsyncCaller.schedule_async_call = _refuse_background_save
    async_utils.PersistentAsyncCaller.schedule_async_call = _refuse_background_save
    _applied = True
