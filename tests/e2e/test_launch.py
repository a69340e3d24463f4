"""The launch scripts' last line, ``python -m puzzle.tools.launch [torchrun flags] train_ppo.py ...``:
bad input is one ``error:`` line and exit 2 before torchrun starts, and a failure under torchrun
ends with rank 0's line and its status, not torchrun's report.

Every refusal of the tiny examples' bad-flag tests (tests/e2e/test_tiny_ppo.py, test_checkpoint.py,
test_faults.py) goes through the launcher with the exact command line that the script builds
(recorded by a ``python3`` stand-in on its PATH), in this process; one refusal runs the script
itself, and one failure that only the ranks can find (a checksum) runs under torchrun."""

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.harness import REPO, SAVED_RUN_FLAGS, SAVED_RUN_NPROC, TINY_GRPO, TINY_PPO, run_script, script_env


def _script_command(script, tmp_path, *extra, nproc=None):
    """What ``bash script *extra`` runs: the arguments of its ``python3`` (the stand-in records them)."""
    shim, record = tmp_path / "bin", tmp_path / "argv"
    shim.mkdir(exist_ok=True)
    (shim / "python3").write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{record}"\n')
    (shim / "python3").chmod(0o755)
    env = script_env(PATH=f"{shim}{os.pathsep}{os.environ['PATH']}", **({"NPROC": str(nproc)} if nproc else {}))
    subprocess.run(["bash", str(script), *extra], cwd=REPO, env=env, check=True, timeout=60)
    argv = record.read_bytes().decode().split("\0")[:-1]
    assert argv[:2] == ["-m", "puzzle.tools.launch"], argv
    return argv[2:]


@pytest.fixture
def launcher(monkeypatch, capfd):
    """launch.main as the script calls it, in this process; torchrun must never start."""
    import torch.distributed.run as torchrun

    from puzzle.tools import launch

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)

    def started(*a, **k):
        raise AssertionError("torchrun started")

    monkeypatch.setattr(torchrun, "main", started)
    monkeypatch.chdir(REPO)

    def refused(argv):
        rc = launch.main(argv)
        out, err = capfd.readouterr()
        return rc, out, err

    return refused


def _one_line(rc, out, err, message):
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err, \
        (rc, out, err)


def _tiny_ppo_refusals(tmp_path, ckpt):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n{"text": "no key"}\n')
    return [  # test_tiny_ppo.py
        (["--seq-length", "32", "--max-new-tokens", "40"], "exceeds --seq-length 32"),
        (["--seq-length", "32", "--reward-fn", "puzzle.nope:missing"], "cannot import module 'puzzle.nope'"),
        (["--prompt-data", str(bad)], f"{bad}:2: prompt must be a string, got int"),
        # test_checkpoint.py::test_wrong_shape_fails_before_allocation
        (["--critic-hidden-size", "128", "--critic-num-attention-heads", "4", "--load", str(ckpt)],
         "hidden_size: checkpoint 64 vs this run 128"),
        (["--seed", "7", "--load", str(ckpt)], "role ref (frozen, saved by reference)"),
        (["--save-interval", "2"], "--save-interval: needs --save DIR"),
        (["--load", str(ckpt), "--ckpt-step", "5"], "--ckpt-step 5"),
    ]


def test_every_tiny_refusal_is_one_line_and_exit_2_under_the_launch_scripts(saved_run, tmp_path, launcher):
    damaged = tmp_path / "damaged"
    shutil.copytree(saved_run.ckpt, damaged)
    for extra, message in _tiny_ppo_refusals(tmp_path, saved_run.ckpt):
        _one_line(*launcher(_script_command(TINY_PPO, tmp_path, *extra)), message)
    # test_faults.py: a truncated and a missing file (their sizes are in the metadata: found here)
    resume = [*SAVED_RUN_FLAGS, "--micro-batch-size", "2", "--load", str(damaged)]
    f = damaged / "iter_0000006" / "actor" / "__0_0.distcp"
    os.truncate(f, f.stat().st_size // 2)
    _one_line(*launcher(_script_command(TINY_PPO, tmp_path, *resume, nproc=SAVED_RUN_NPROC)),
              f"{f}: {f.stat().st_size} bytes, saved with")
    (damaged / "iter_0000004" / "trainer_state.json").unlink()
    _one_line(*launcher(_script_command(TINY_PPO, tmp_path, *resume, "--ckpt-step", "4", nproc=SAVED_RUN_NPROC)),
              "trainer_state.json: missing")
    # the GRPO script goes through the same launcher
    _one_line(*launcher(_script_command(TINY_GRPO, tmp_path, "--lr", "-1")), "--lr: must be >= 0")
    # --help and --dry-run end in the launcher's process too
    rc, out, err = launcher(_script_command(TINY_PPO, tmp_path, "--dry-run"))
    assert rc == 0 and "dry run: every flag is valid; world size 4" in out and err == "", (out, err)
    rc, out, _ = launcher(_script_command(TINY_PPO, tmp_path, "--help"))
    assert rc == 0 and out.startswith("usage: train_ppo.py"), out[:300]


def test_the_script_itself_prints_one_line(tmp_path):
    proc, _ = run_script(TINY_PPO, ["--seq-length", "32", "--max-new-tokens", "40"], tmp_path, check=False)
    _one_line(proc.returncode, proc.stdout, proc.stderr, "--max-new-tokens")


def test_a_failure_found_by_the_ranks_ends_with_rank_0s_line(saved_run, tmp_path):
    """A checksum mismatch is found after torchrun started the ranks (they share the reading; one
    rank here): rank 0's line is the last one printed, once, and the script exits 2 (bad input)."""
    damaged = tmp_path / "ckpt"
    shutil.copytree(saved_run.ckpt, damaged)
    f = damaged / "iter_0000006" / "critic" / "__0_1.distcp"
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    proc, _ = run_script(TINY_PPO, [*SAVED_RUN_FLAGS, "--load", str(damaged)], tmp_path / "log", nproc=1,
                         check=False)
    err = proc.stderr
    assert proc.returncode == 2, (proc.stdout + err)[-3000:]
    assert err.splitlines()[-1].startswith(f"error: checkpoint iteration 6 is damaged: {f}: checksum mismatch")
    assert err.count("error:") == 1 and "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]


def test_the_run_records_its_configuration_and_times_its_phases(saved_run):
    """The session's saved run (2 ranks, 6 iterations, saves at 2, 4, 6): --log-dir/config.json
    holds the command line, the resolved flags, the plan and the versions; rank 0 printed a timed
    line as each phase started and ended."""
    import torch

    doc = json.loads((saved_run.root / "log" / "config.json").read_text())
    assert " ".join(SAVED_RUN_FLAGS) in " ".join(doc["command"])
    assert doc["command"][-2:] == ["--log-dir", str(saved_run.root / "log")]
    assert doc["world_size"] == SAVED_RUN_NPROC and doc["args"]["train_iters"] == 6
    assert doc["args"]["world_size"] == SAVED_RUN_NPROC and doc["args"]["lr"] == 2e-3  # defaults resolved
    assert doc["plan"] == {role: {"layout": "(P=1, D=2, T=1)", "ranks": [0, 1], "trainable": role != "ref",
                                  **({"generation_layout": "(P=1, D=2, T=1)"} if role == "actor" else {})}
                           for role in ("actor", "critic", "ref")}
    assert doc["config"]["roles"]["critic"]["arch"]["hidden_size"] == 64
    assert doc["config"]["ppo"]["rollout_batch_size"] == 8
    assert doc["versions"]["torch"] == torch.__version__ and doc["versions"]["megatron-core"].startswith("0.")
    lines = saved_run.stdout.splitlines()
    ended = [m.group(1) for m in map(re.compile(r"^\[phase\] (.+): \d+\.\d\d s$").match, lines) if m]
    started = [line[len("[phase] "):-len(" ...")] for line in lines if line.startswith("[phase] ") and
               line.endswith(" ...")]
    stages = [f"iteration {i} {s}" for i in range(1, 7) for s in ("generation", "reward", "scoring", "training")]
    saves = [f"checkpoint saving (iteration {i})" for i in (2, 4, 6)]
    assert started == ended == ["model building"] + stages[:8] + saves[:1] + stages[8:16] + saves[1:2] \
        + stages[16:] + saves[2:], lines[:40]
    assert lines.index("[phase] iteration 1 training ...") < next(i for i, x in enumerate(lines)
                                                               if x.startswith(" iteration        1/"))
