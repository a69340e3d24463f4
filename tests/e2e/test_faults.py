"""Fault suite (CPU, gloo, 2 ranks): SIGTERM then resume, a stopped rank, damaged checkpoints,
a deleted tracker, non-finite gradients, metrics.jsonl of fresh and resumed runs.

The session's saved run (tests/conftest.py ``saved_run``: checkpoints at 2, 4 and 6, the newest
two kept, the critic's NaN step at iteration 2 skipped) is the uninterrupted run the other cases
repeat, copy and damage; the corruption cases run the CLI in this process (they fail before any
model exists)."""

import json
import os
import shutil
import signal
import time

import psutil
import pytest

from tests.harness import (SAVED_RUN_ENV, SAVED_RUN_FLAGS, SAVED_RUN_NPROC, SAVED_RUN_SKIP_FLAGS, TINY_CLI,
                           TINY_PPO, assert_same_metrics, launch_script, read_metrics)

FLAGS = SAVED_RUN_FLAGS
# the critic's gradients are poisoned at iteration 2 in every run of the scenario
SKIP = SAVED_RUN_ENV
SKIP_FLAGS = SAVED_RUN_SKIP_FLAGS
TIMING = ("samples_per_sec", "tokens_per_sec", "time_generate", "time_score", "time_train", "switch_seconds")


def _launch(args, log_dir, env=None):
    return launch_script(TINY_PPO, FLAGS + list(args), log_dir, nproc=SAVED_RUN_NPROC, env=env)


_rows = read_metrics


def _workers(proc, n=2, timeout=120):
    """rank -> psutil.Process of the torchrun workers (they run in their own sessions)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = {}
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                rank = child.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None and "train_ppo.py" in " ".join(child.cmdline()):
                found[int(rank)] = child
        if len(found) == n:
            return found
        time.sleep(0.2)
    raise AssertionError("workers not found")


def _wait_for_iteration(proc, log_dir, iteration, timeout=240):
    """Until this run has logged ``iteration`` (its first line rewrites an older run's file)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        rows = _rows(log_dir)
        if rows and rows[-1]["iteration"] == len(rows) >= iteration and rows[0].get("_old") is None:
            return
        time.sleep(0.05)
    raise AssertionError(f"iteration {iteration} never logged (rc={proc.poll()})")


def _finish(proc, workers=(), timeout=300):
    """Wait for the job; whatever happens, no process of it is left behind."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        for w in list(workers):
            try:
                w.send_signal(signal.SIGCONT)
                w.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def _same(a, b):
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    assert_same_metrics(a, b, skip=TIMING)


@pytest.fixture
def straight(saved_run):
    """Six uninterrupted iterations, checkpoints at 2, 4 and 6, the newest two kept; the critic's
    step at iteration 2 has NaN gradients and is skipped (--skip-nonfinite-iterations 1)."""
    return saved_run.root, saved_run.rows, saved_run.stdout, saved_run.stderr


def test_nonfinite_step_is_skipped_and_counted_and_warnings_print_once(straight):
    _, rows, out, err = straight
    warned = [x for x in err.splitlines() if "megatron" in x and "Warning:" in x]
    assert warned and len(warned) == len(set(warned))  # megatron-core's warnings: rank 0 only
    assert [r["nonfinite_skipped_steps"] for r in rows] == [0, 1, 1, 1, 1, 1]
    assert out.count("warning: non-finite gradient norm (pipeline stage 0) of the critic model at "
                     "iteration 2 (training stage, PPO epoch 1, mini-batch 1 of 1): optimizer step "
                     "skipped (1/1, --skip-nonfinite-iterations)") == 1
    assert all(r["value_loss"] == r["value_loss"] for r in rows)  # training went on, finite


def test_nonfinite_without_allowance_stops_naming_model_stage_iteration(tmp_path):
    rc, out, err = _finish(_launch(["--train-iters", "2"], tmp_path, env={"PUZZLE_TEST_NONFINITE_AT": "actor:1"}))
    assert rc == 3, err[-3000:]  # rank 0's status through the launcher, its line the last one
    assert err.splitlines()[-1].startswith("error: non-finite gradient norm") and "ChildFailedError" not in err
    assert err.count("error: non-finite gradient norm (pipeline stage 0) of the actor model at iteration 1 "
                     "(training stage, PPO epoch 1, mini-batch 1 of 1); --skip-nonfinite-iterations N "
                     "skips up to N such steps") == 1, err[-3000:]
    assert "puzzle/dataflow/trainer.py" not in err  # no traceback of ours, nor torchrun's report


def test_sigterm_finishes_the_iteration_saves_and_resumes_identically(straight, tmp_path):
    """SIGTERM to rank 1 only: both ranks stop after the same iteration, save, exit 0. The resume
    in a new process (tracker deleted: the newest verified checkpoint is found) repeats the
    uninterrupted run bit for bit, every metric but the timings: the suite's exact-resume check."""
    _, rows, _, _ = straight
    ckpt, log = tmp_path / "b", tmp_path / "log_b"
    proc = _launch(["--save", str(ckpt), "--exit-signal-handler", *SKIP_FLAGS], log, env=SKIP)
    workers = _workers(proc)
    _wait_for_iteration(proc, log, 1)
    workers[1].send_signal(signal.SIGTERM)
    rc, out, err = _finish(proc, workers.values())
    assert rc == 0, (out + err)[-5000:]
    stopped = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= stopped < 6 and f"exiting after iteration {stopped}: a signal was received" in out
    assert "rank 1: received signal 15: stopping after the current iteration" in err
    assert len(_rows(log)) == stopped
    os.remove(ckpt / "latest_checkpointed_iteration.txt")
    with open(log / "metrics.jsonl", "a") as f:  # a line logged after the last save, then lost
        f.write(json.dumps(dict(rows[stopped], reward_mean=-1.0, iteration=stopped + 1)) + "\n")
    rc, out, err = _finish(_launch(["--load", str(ckpt), *SKIP_FLAGS], log, env=SKIP))
    assert rc == 0, (out + err)[-5000:]
    assert (f"no latest_checkpointed_iteration.txt under {ckpt}: resuming from the newest complete "
            f"and verified checkpoint, iteration {stopped}") in out
    _same(_rows(log), rows)  # the resumed run kept lines 1..stopped, dropped the stale one


def test_stopped_rank_ends_the_job_naming_it(straight, tmp_path):
    """SIGSTOP on rank 1: rank 0's next collective times out (--distributed-timeout-minutes 0.25)
    and the job ends non-zero, naming rank 1; a fresh run in an old log dir starts a fresh file."""
    root, rows, _, _ = straight
    log = tmp_path / "log"
    log.mkdir()
    (log / "metrics.jsonl").write_text("".join(json.dumps(dict(r, _old=1)) + "\n" for r in rows))  # another run's
    proc = _launch(["--distributed-timeout-minutes", "0.25"], log)
    workers = _workers(proc)
    _wait_for_iteration(proc, log, 1)
    workers[1].send_signal(signal.SIGSTOP)
    t0 = time.time()
    workers[0].wait(timeout=120)  # rank 0 gives up after the timeout
    assert time.time() - t0 < 60
    workers[1].send_signal(signal.SIGCONT)  # torchrun's SIGTERM, pending while stopped, ends it
    rc, out, err = _finish(proc, workers.values(), timeout=120)
    assert rc != 0
    assert "error: rank 0: a collective timed out after --distributed-timeout-minutes 0.25 in iteration" in err, err[-3000:]
    assert "waiting for rank 1 (last seen in iteration" in err
    assert 1 <= len(_rows(log)) < 6 and all("_old" not in r for r in _rows(log))  # a fresh file
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers.values())


# ---- damaged checkpoints: the CLI in this process, before any model or process group ------------
@pytest.fixture
def damaged(saved_run, tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    copy = tmp_path / "ckpt"
    shutil.copytree(saved_run.ckpt, copy)
    yield copy
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)


def _resume(copy, capsys, *extra):
    from puzzle import cli

    argv = [*TINY_CLI, "--micro-batch-size", "2", *FLAGS, "--load", str(copy), *extra]
    rc = cli.run(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("error:") == 1 and "Traceback" not in err, (rc, out, err)
    return err


INTACT_4 = "the newest intact checkpoint is iteration 4: resume it with --ckpt-step 4"


def test_truncated_file(damaged, capsys):
    f = damaged / "iter_0000006" / "actor" / "__0_0.distcp"
    size = f.stat().st_size
    os.truncate(f, size // 2)
    err = _resume(damaged, capsys)
    assert (f"checkpoint iteration 6 (named by {damaged}/latest_checkpointed_iteration.txt) is damaged: "
            f"{f}: {size // 2} bytes, saved with {size} (truncated or overwritten); {INTACT_4}") in err


def test_bit_flip(damaged, capsys):
    import torch.distributed as dist

    f = damaged / "iter_0000006" / "critic" / "__0_1.distcp"
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    err = _resume(damaged, capsys)
    assert f"checkpoint iteration 6 is damaged: {f}: checksum mismatch (the file is damaged); {INTACT_4}" in err
    assert not dist.is_initialized()  # verified with a world of one, then shut down


@pytest.mark.parametrize("rel", ["actor/common.pt", "critic/.metadata", "trainer_state.json",
                                 "rng/rank_00001.pt", "metadata.json"])
def test_missing_file(damaged, capsys, rel):
    f = damaged / "iter_0000004" / rel
    f.unlink()
    err = _resume(damaged, capsys, "--ckpt-step", "4")
    assert f"checkpoint iteration 4 (given by --ckpt-step) is damaged: {f}: missing" in err
    assert "the newest intact checkpoint is iteration 6: resume it with --ckpt-step 6" in err


def test_deleted_tracker_takes_the_newest_complete(damaged):
    from puzzle.checkpointing import resume_iteration

    (damaged / "latest_checkpointed_iteration.txt").unlink()
    assert resume_iteration(str(damaged)) == (6, "scan")
    os.truncate(damaged / "iter_0000006" / "rng" / "rank_00000.pt", 10)
    shutil.copytree(damaged / "iter_0000004", damaged / "iter_0000008.tmp")  # an unfinished save
    assert resume_iteration(str(damaged)) == (4, "scan")


def test_keep_last_and_checkpoint_exception_summary(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from puzzle.checkpointing import _delete_older, _summarize, saved_iterations

    for it in (2, 4, 6, 8):
        (tmp_path / f"iter_{it:07d}").mkdir()
    _delete_older(str(tmp_path), 2)
    assert saved_iterations(str(tmp_path)) == [8, 6]
    try:
        raise KeyError("optimizer.state.0.exp_avg")
    except KeyError as e:
        exc = CheckpointException("load", {0: _wrap_exception(e), 1: _wrap_exception(e)})
    assert not isinstance(exc, Exception)  # why checkpointing catches BaseException
    assert _summarize(exc) == "KeyError: 'optimizer.state.0.exp_avg' (ranks 0, 1)"
