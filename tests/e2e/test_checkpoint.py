"""--save/--load of whole PPO runs (CPU, gloo, sampled generation): what a checkpoint holds, resume
at other layouts (weights and optimizer state reshard), a save killed half way, a wrong model shape
(the exact resume at the same layout: tests/e2e/test_faults.py, the run stopped by SIGTERM).

The runs resume the session's saved run (tests/conftest.py ``saved_run``: 2 ranks, every model
at (1,2,1), checkpoints of iterations 4 and 6)."""

import json

import pytest

from puzzle import cli
from tests.harness import (SAVED_RUN_FLAGS, TINY_CLI, TINY_PPO, assert_same_metrics, by_iteration,
                           run_script)

# run_ppo_tiny.sh's layouts: actor/ref (P,D,T)=(2,1,2), critic (1,2,2) on 4 ranks
ON_4 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--critic-tensor-model-parallel-size", "2", "--critic-pipeline-model-parallel-size", "1"]
ON_2_TP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
           "--critic-tensor-model-parallel-size", "1", "--critic-pipeline-model-parallel-size", "2"]
ON_2_DP = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--critic-tensor-model-parallel-size", "1", "--critic-pipeline-model-parallel-size", "1"]
KEYS = ("reward_mean", "kl", "value_loss", "entropy", "value_mean", "return_mean",
        "response_length_mean", "actor_grad_norm", "critic_grad_norm", "kl_coef")


def _tiny(args, log_dir, nproc=2, env=None, check=True):
    """The saved run's flags, ``args`` on top: (process, {iteration: row})."""
    proc, rows = run_script(TINY_PPO, SAVED_RUN_FLAGS + list(args), log_dir, nproc=nproc, env=env, check=check)
    return proc, by_iteration(rows)


def _same(a, b, iterations):
    """Other layouts: other fp32 reduction orders."""
    assert_same_metrics(b, a, KEYS, iterations, rel=1e-4, abs=1e-5)
    for it in iterations:
        assert abs(a[it]["policy_loss"] - b[it]["policy_loss"]) < 1e-5


def test_saved_checkpoints_hold_every_trainable_role_and_each_ranks_rng(saved_run):
    """The saved run's checkpoints (iterations 4 and 6 kept). That a new process resumes one
    exactly (the same layout: every metric bit-identical) is checked by the resume of the run
    stopped by SIGTERM (tests/e2e/test_faults.py), which shares the saved run's flags."""
    a, rows = saved_run.ckpt, by_iteration(saved_run.rows)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert (a / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    for it in (4, 6):
        d = a / f"iter_{it:07d}"
        assert {p.name for p in d.iterdir()} == {"metadata.json", "trainer_state.json", "actor", "critic", "rng"}
        assert len(list((d / "rng").iterdir())) == 2  # one per rank
    assert not list(a.glob("*.tmp"))
    meta = json.loads((a / "iter_0000004" / "metadata.json").read_text())
    assert meta["roles"]["ref"]["source"] == {"hf_path": None, "seed": 1234} and meta["iteration"] == 4


def test_other_layouts_killed_save_and_distributed_optimizer(saved_run, tmp_path):
    """Resume at 4 ranks with other layouts for actor, ref and critic, then back at 2 ranks:
    weights and Adam states reshard (iterations 5..6 equal within fp32 tolerance; 6 depends on
    the restored moments). A save killed half way through on rank 1 leaves the previous
    checkpoint the latest one, and ends the job with one message naming the rank and the phase.
    Without the optimizer states (--no-load-optim) iteration 6 differs. That cold run uses the
    DistributedOptimizer ('fully_reshardable' format) with the actor at (1,1,2), the critic at
    (2,1,1), and saves; resumed at (1,2,1) with the actor generating at (1,1,2) through the switch,
    its iterations 6..7 repeat (7: the Adam step of iteration 6 used the loaded moments)."""
    rows, b = by_iteration(saved_run.rows), tmp_path / "b"
    proc, part = _tiny(ON_4 + ["--load", str(saved_run.ckpt), "--ckpt-step", "4", "--save", str(b),
                               "--save-interval", "1"], tmp_path / "log_c", nproc=4,
                       env={"PUZZLE_TEST_FAIL_SAVE_AT": "1:6"}, check=False)
    assert proc.returncode != 0
    # one line for the whole job, naming the rank and the phase; no traceback of ours
    assert proc.stderr.count("error: ") == 1 and "puzzle/" not in proc.stderr, proc.stderr[-3000:]
    assert (f"error: rank 1: saving checkpoint iteration 6 failed while writing actor: RuntimeError: injected "
            f"fault (rank 1): simulated failure in the middle of saving iteration 6; the latest checkpoint is "
            f"still iteration 5 ({b / 'iter_0000005'})") in proc.stderr
    assert sorted(part) == [5, 6]
    _same(rows, part, (5, 6))
    assert (b / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert (b / "iter_0000006.tmp").is_dir() and not (b / "iter_0000006").exists()
    _, rest = _tiny(ON_2_DP + ["--load", str(b)], tmp_path / "log_d")
    assert sorted(rest) == [6]
    _same(rows, rest, (6,))
    # without the optimizer states the Adam step at iteration 5 differs: iteration 6 shows it
    dist_opt, c = ["--use-distributed-optimizer", "--train-iters", "7"], tmp_path / "c"
    _, cold = _tiny(ON_2_TP + dist_opt + ["--load", str(saved_run.ckpt), "--ckpt-step", "4", "--no-load-optim",
                                          "--save", str(c), "--save-interval", "1"], tmp_path / "log_e")
    assert sorted(cold) == [5, 6, 7]
    assert cold[5]["value_loss"] == pytest.approx(rows[5]["value_loss"], rel=1e-4)
    assert cold[6]["critic_grad_norm"] != pytest.approx(rows[6]["critic_grad_norm"], rel=1e-2)
    _, resumed = _tiny(ON_2_DP + dist_opt + ["--actor-gen-tensor-model-parallel-size", "2",
                                             "--load", str(c), "--ckpt-step", "5"], tmp_path / "log_f")
    assert sorted(resumed) == [6, 7]
    _same(cold, resumed, (6, 7))


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _single(capsys, args):
    """train_ppo.py's driver in this process (it stops before any process group or model)."""
    rc = cli.run(TINY_CLI + ["--rollout-batch-size", "8", "--micro-batch-size", "2", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_wrong_shape_fails_before_allocation(saved_run, single_process, capsys):
    a = saved_run.ckpt
    rc, out, err = _single(capsys, ["--critic-hidden-size", "128", "--critic-num-attention-heads", "4",
                                    "--load", str(a)])
    assert rc == 2, out + err
    assert str(a / "iter_0000006" / "metadata.json") in err
    assert "role critic model shape differs" in err and "hidden_size: checkpoint 64 vs this run 128" in err
    assert "role actor" not in err and " iteration " not in out
    rc, _, err = _single(capsys, ["--seed", "7", "--load", str(a)])  # the frozen reference is rebuilt from --seed
    assert rc == 2 and "role ref (frozen, saved by reference)" in err
    rc, _, err = _single(capsys, ["--save-interval", "2"])
    assert rc == 2 and "--save-interval: needs --save DIR" in err
    rc, _, err = _single(capsys, ["--load", str(a), "--ckpt-step", "5"])
    assert rc == 2 and "--ckpt-step 5" in err
