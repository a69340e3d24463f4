"""Checkpoint saves that cannot deadlock (tests/distributed/worlds/save_reliability.py, 4 ranks):
a save completes while a thread of the process holds a lock its file writer needs (a writer forked
with the lock held waited for ever), twenty saves in a row through save_checkpoint publish each
one whole, and a write that fails on one rank (disk full) is one SaveError on every rank, the
coordinator's naming that rank and the phase, with the last good checkpoint verified and loaded.
No save forks this process."""

import pytest

from tests.harness import run_world

SAVES = 20


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/save_reliability.py", 4)


def test_save_completes_while_a_thread_holds_a_lock_the_writer_needs(world):
    for r in world:
        lock = r["lock"]
        assert lock["writer_asked"]  # the writer did need the held lock: the reproduction was live
        assert lock["same"] and lock["forks"] == 0, lock


def test_twenty_saves_in_a_row_each_published_whole(world):
    for rank, r in enumerate(world):
        saves = r["saves"]
        assert saves["forks"] == 0
        assert [p["tracker"] for p in saves["published"]] == list(range(1, SAVES + 1))
        for it, p in enumerate(saves["published"], 1):
            kept = [f"iter_{k:07d}" for k in (it - 1, it) if k >= 1]
            assert p["dirs"] == kept + ["latest_checkpointed_iteration.txt"], (it, p)  # no .tmp left


def test_a_write_failing_on_one_rank_is_one_error_and_the_last_save_resumes(world):
    messages = [r["saves"]["failed"] for r in world]
    speaking = [m for m in messages if m["informative"]]
    assert len(speaking) == 1 and speaking[0] is messages[0], messages  # megatron's coordinator
    assert speaking[0]["message"].startswith("rank 3: saving checkpoint iteration 21 failed while writing actor: ")
    assert "No space left on device" in speaking[0]["message"]
    for m in messages:
        assert "; the latest checkpoint is still iteration 20 (" in m["message"]
        assert m["message"].endswith("iter_0000020)"), m
    for r in world:
        after = r["saves"]["after"]
        assert after["tracker"] == 20 and after["verified"] == 20 and after["loaded"] == 20
        assert after["dirs"] == ["iter_0000019", "iter_0000020", "iter_0000021.tmp",
                                 "latest_checkpointed_iteration.txt"]
        assert after["same_weights"]  # the load overwrote weights moved after the save
