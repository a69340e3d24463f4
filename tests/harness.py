"""Spawn a gloo world with torchrun, run one world script (several checks), collect per-rank JSON.

World scripts call ``world_main(checks)``: each check runs on every rank and returns a
JSON-serialisable dict; results land in $PUZZLE_TEST_OUT/rank{R}.json. The scripts of a group
in ``SHARED_WORLDS`` run together in one world (tests/distributed/worlds/shared.py).

Also here, for every test file: the tiny runs' flags read from their launch scripts
(``tiny_flags``, ``TINY_MODEL``, ``TINY_CLI``), running those scripts (``run_script``,
``launch_script``, ``read_metrics``), one comparison of metric rows (``assert_same_metrics``),
a tiny run inside a world (``train_in_world``) and the session's saved run's flags (``SAVED_RUN_*``,
the fixture ``saved_run`` is in tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


#: World scripts that share one world, as (ranks, scripts): each group runs whole in one torchrun
#: (one start-up, one import of torch and megatron per rank), started in the background once a
#: session's tests are collected (tests/conftest.py) or else by the first test asking for any
#: script of it at that rank count, and each test still gets its own script's results. A script in no
#: group, or run with arguments or another rank count, gets a world of its own. A failing check
#: fails its group. Every world runs once per session: test files asking for the same world share
#: its results. Every 4-rank script shares one world: each start-up of one costs about 10 s of
#: the suite's 8 minutes.
SHARED_WORLDS = (
    (4, ("distributed/worlds/foundation.py", "distributed/worlds/switch.py", "distributed/worlds/time_sharing.py",
         "distributed/worlds/generation.py",
         "distributed/worlds/grpo_layouts.py", "distributed/worlds/tiny_runs.py", "distributed/worlds/packing.py",
         "distributed/worlds/vocab_rows.py", "distributed/worlds/token_budget.py",
         "distributed/worlds/save_reliability.py",
         "distributed/worlds/hf_import.py", "distributed/worlds/model_families.py", "distributed/worlds/moe.py",
         "distributed/worlds/moe_switch.py", "distributed/worlds/long_context.py",
         "distributed/worlds/megatron_checkpoint.py")),  # last: it sets megatron's global state up and down
    (1, ("distributed/worlds/tiny_runs.py", "distributed/worlds/vocab_rows.py", "distributed/worlds/moe.py")),
)
SHARED_TIMEOUT = 1150  # under scripts/test.sh's per-test --timeout
_SEP = "::"
_shared_results: dict = {}
_collect = None  # tests/distributed/worlds/shared.py: world_main hands its checks over here


def run_world(script: str, nproc: int, *args: str, timeout: int = 600) -> list:
    """Run tests/<script> on ``nproc`` ranks; return the per-rank result dicts (rank order)."""
    group = next((g for g in SHARED_WORLDS if g[0] == nproc and script in g[1]), None)
    if group is None or args:  # a world of its own (run once per session)
        key = (script, nproc, args)
        if key not in _shared_results:
            _shared_results[key] = _World(script, nproc, *args).results(timeout)
        return _shared_results[key]
    if group not in _shared_results:
        try:
            world = _started_groups.pop(group, None) or _World("distributed/worlds/shared.py", nproc, *group[1])
            _shared_results[group] = world.results(SHARED_TIMEOUT)
        except AssertionError as e:
            _shared_results[group] = e
    results = _shared_results[group]
    if isinstance(results, AssertionError):
        raise results
    prefix = script + _SEP
    return [{name[len(prefix):]: v for name, v in r.items() if name.startswith(prefix)} for r in results]


#: the shared worlds started ahead (``start_shared_worlds``), not yet collected
_started_groups: dict = {}


def start_shared_worlds(wanted) -> None:
    """Start now, in the background, every SHARED_WORLDS group holding one of the ``wanted``
    (script, ranks) worlds: tests/conftest.py calls this with the worlds the session's tests read
    and runs those tests last, so the worlds' ranks (mostly waiting on each other's collectives)
    share the cores with the tests run meanwhile."""
    for group in SHARED_WORLDS:
        if not any((script, group[0]) in wanted for script in group[1]):
            continue
        if group not in _shared_results and group not in _started_groups:
            _started_groups[group] = _World("distributed/worlds/shared.py", group[0], *group[1], background=True)


def stop_shared_worlds() -> None:
    """End the worlds started ahead that no test collected (a deselected run)."""
    while _started_groups:
        _started_groups.popitem()[1].stop()


def _in_background() -> None:
    """In a child before it starts: run under SCHED_IDLE, so that the tests in the foreground take
    the cores first and this process takes only what they leave (the ranks of a tiny run, waiting
    on each other's collectives, leave much). A plain low priority is not enough: a waking rank
    of the foreground would wait its turn behind the background at every collective. Every
    Python process under it does the same at its start (``background_env``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed here: the run goes on as it is
        pass


def _yield_session(proc: subprocess.Popen) -> None:
    """The lowest weight (nice 19) for the autogroup of ``proc``'s session (started with a session
    of its own): the kernel shares the cores between sessions before it shares them between the
    processes of one."""
    try:
        Path(f"/proc/{proc.pid}/autogroup").write_text("19")
    except OSError:
        pass


def background_env(env: dict) -> dict:
    """``env`` for a run in the background: tests/background_site/sitecustomize.py first on
    PYTHONPATH, so that each of its Python processes, the ranks in their own sessions included,
    yields the cores at its start (SCHED_IDLE, and nice 19 for its session's autogroup)."""
    site = str(REPO / "tests" / "background_site")
    path = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    return dict(env, PUZZLE_TEST_BACKGROUND="1", PYTHONPATH=path)


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and every process under it (torchrun's ranks run in sessions of their own)."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.kill()
    proc.wait()


class _World:
    """One torchrun of a world script, started at construction (``background``: under
    SCHED_IDLE); its output goes to files (a pipe nobody reads while it runs would fill and stall it)."""

    def __init__(self, script: str, nproc: int, *args: str, background: bool = False):
        self.name, self.nproc = f"{script} x{nproc}", nproc
        self.out = Path(tempfile.mkdtemp(prefix="puzzle-world-"))
        env = dict(os.environ, PUZZLE_TEST_OUT=str(self.out), OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(REPO / "tests" / script), *args]
        self.log = open(self.out / "output.log", "w+")
        self.proc = subprocess.Popen(cmd, env=background_env(env) if background else env, cwd=REPO,
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_in_background if background else None, start_new_session=background)
        if background:
            _yield_session(self.proc)

    def results(self, timeout: float) -> list:
        """Wait for the world (at most ``timeout`` s more); its per-rank results, or an
        AssertionError with the failing checks and the output's tail."""
        try:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"world {self.name} ran past {timeout} s") from None
            results = []
            for r in range(self.nproc):
                f = self.out / f"rank{r}.json"
                results.append(json.loads(f.read_text()) if f.exists() else None)
            if self.proc.returncode != 0 or any(r is None for r in results):
                self.log.seek(0)
                tail = "\n".join(self.log.read().splitlines()[-80:])
                errors = [f"rank {r}, check {name}:\n{v['error']}" for r, res in enumerate(results) if res
                          for name, v in res.items() if isinstance(v, dict) and "error" in v and len(v) == 1]
                raise AssertionError(f"world {self.name} failed (rc={self.proc.returncode}):\n"
                                     + "\n".join(errors[:2] + [tail]))
            return results
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:  # torchrun passes SIGTERM on to its ranks
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_tree(self.proc)
        self.log.close()
        shutil.rmtree(self.out, ignore_errors=True)


def world_main(checks) -> None:
    """Entry of a world script: apply patches, init dist, run every check, write results."""
    if _collect is not None:  # a shared world is gathering the checks of its scripts
        _collect.append(checks)
        return
    import megatron_patches

    megatron_patches.apply()
    import torch.distributed as dist

    from puzzle.parallel.groups import init_distributed

    rank, _ = init_distributed()
    results, seconds = {}, {}
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            results[name] = fn()
            seconds[name] = round(time.perf_counter() - t0, 2)
        except Exception:  # recorded and re-raised so the test shows the traceback
            results[name] = {"error": traceback.format_exc()}
            Path(os.environ["PUZZLE_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(results))
            raise
    dist.barrier()
    Path(os.environ["PUZZLE_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(results))
    if rank == 0 and os.environ.get("PUZZLE_WORLD_SECONDS"):  # each check's wall time (to see what to trim)
        with open(os.environ["PUZZLE_WORLD_SECONDS"], "a") as f:
            f.write(json.dumps({"world_size": dist.get_world_size(), "seconds": seconds}) + "\n")
    dist.destroy_process_group()


# ---- the tiny runs' flags: read from their launch scripts, the one copy ----------------------
TINY_PPO = REPO / "examples" / "run_ppo_tiny.sh"
TINY_GRPO = REPO / "examples" / "run_grpo_tiny.sh"


def script_arrays(script: Path = TINY_PPO) -> dict:
    """The bash arrays of a launch script (``NAME=( ... )``, comments dropped), in file order."""
    import re
    import shlex

    arrays, name, body = {}, None, []
    for line in Path(script).read_text().splitlines():
        if name is None:
            m = re.match(r"^([A-Z_]+)=\((.*)$", line.strip())
            if not m:
                continue
            name, line = m.group(1), m.group(2)
            body = []
        head, closed, _ = line.partition(")") if not line.lstrip().startswith("#") else (line, "", "")
        body.extend(shlex.split(head, comments=True))
        if closed:
            arrays[name], name = body, None
    return arrays


def tiny_flags(script: Path = TINY_PPO, *, model_only: bool = False) -> list:
    """What ``script`` passes to train_ppo.py before the caller's own flags (MODEL_ARGS alone
    with ``model_only``): the tiny model and its run, one definition shared by every test."""
    arrays = script_arrays(script)
    if model_only:
        return list(arrays["MODEL_ARGS"])
    return [flag for name, flags in arrays.items() if name != "DISTRIBUTED_ARGS" for flag in flags]


#: the tiny PPO model (examples/run_ppo_tiny.sh MODEL_ARGS) plus a reward: enough for train_ppo.py
#: to check its flags in this process (cli.run) before any process group or model exists
TINY_MODEL = tiny_flags(model_only=True)
TINY_CLI = TINY_MODEL + ["--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction"]


# ---- launching the tiny runs -----------------------------------------------------------------
def script_env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)


def read_metrics(log_dir) -> list:
    """The rows of ``log_dir``/metrics.jsonl ([] when there is none)."""
    path = Path(log_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def launch_script(script: Path, args, log_dir, nproc=None, env=None) -> subprocess.Popen:
    """Start ``bash script *args --log-dir log_dir`` (NPROC ranks when given); stdout/stderr piped."""
    extra = dict(env or {}, **({"NPROC": str(nproc)} if nproc is not None else {}))
    return subprocess.Popen(["bash", str(script), *args, "--log-dir", str(log_dir)], cwd=REPO,
                            env=script_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class LaunchedAhead:
    """A launch script's run started when the session's tests are collected (tests/conftest.py,
    the ``launch_ahead`` marker) and read by its test later: it runs in the background, under
    SCHED_IDLE, alongside the tests between. Output goes to files: a pipe nobody reads while it
    runs could fill and stall it."""

    def __init__(self, script: Path, args, nproc: int):
        self.dir = Path(tempfile.mkdtemp(prefix="puzzle-ahead-"))
        self.log_dir = self.dir / "log"
        self._out, self._err = open(self.dir / "stdout", "w+"), open(self.dir / "stderr", "w+")
        self.proc = subprocess.Popen(["bash", str(script), *args, "--log-dir", str(self.log_dir)], cwd=REPO,
                                     env=background_env(script_env(NPROC=str(nproc))), stdout=self._out,
                                     stderr=self._err, text=True, preexec_fn=_in_background, start_new_session=True)
        _yield_session(self.proc)

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the run (at most ``timeout`` s more); its exit status and output."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.stop(keep_files=True)
        self._out.seek(0)
        self._err.seek(0)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self._out.read(), self._err.read())

    def stop(self, keep_files: bool = False) -> None:
        if self.proc.poll() is None:
            _kill_tree(self.proc)
        if not keep_files:
            self._out.close()
            self._err.close()
            shutil.rmtree(self.dir, ignore_errors=True)


_launched_ahead: dict = {}


def launched_ahead(script: Path, args, nproc: int) -> LaunchedAhead:
    """The run of ``script`` with ``args`` on ``nproc`` ranks started ahead (started now if not)."""
    key = (str(script), tuple(args), nproc)
    if key not in _launched_ahead:
        _launched_ahead[key] = LaunchedAhead(script, args, nproc)
    return _launched_ahead[key]


def stop_launched_ahead() -> None:
    while _launched_ahead:
        _launched_ahead.popitem()[1].stop()


def run_script(script: Path, args, log_dir, nproc=None, env=None, check=True, timeout=600):
    """Run a launch script to its end: (CompletedProcess, metrics rows); ``check``: exit 0, no abort."""
    extra = dict(env or {}, **({"NPROC": str(nproc)} if nproc is not None else {}))
    proc = subprocess.run(["bash", str(script), *args, "--log-dir", str(log_dir)], cwd=REPO,
                          env=script_env(**extra), capture_output=True, text=True, timeout=timeout)
    if check:  # (an abort at exit of a finished run: tests/e2e/test_clean_exit.py)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.stdout + proc.stderr)[-6000:]
    return proc, read_metrics(log_dir)


def by_iteration(rows) -> dict:
    """{iteration: row} of metric rows (each iteration once)."""
    if isinstance(rows, dict):
        return rows
    out = {r["iteration"]: r for r in rows}
    assert len(out) == len(rows), [r["iteration"] for r in rows]
    return out


def assert_same_metrics(actual, expected, keys=None, iterations=None, rel=None, abs=None, skip=()):
    """Metric rows of two runs agree: per iteration (``iterations``, else the same iterations in
    both), per key (``keys``, else every key of both rows but ``skip``). Exactly equal when
    neither ``rel`` nor ``abs`` is given, else ``actual == pytest.approx(expected, rel, abs)``
    (the tolerance is relative to ``expected``). Rows: lists of metrics.jsonl rows or
    {iteration: row}."""
    import pytest

    a, b = by_iteration(actual), by_iteration(expected)
    if iterations is None:
        assert sorted(a) == sorted(b), (sorted(a), sorted(b))
        iterations = sorted(b)
    for it in iterations:
        names = keys if keys is not None else sorted((set(a[it]) | set(b[it])) - set(skip))
        for key in names:
            if rel is None and abs is None:
                assert key in a[it] and key in b[it] and a[it][key] == b[it][key], (it, key, a[it].get(key),
                                                                                     b[it].get(key))
            else:
                assert a[it][key] == pytest.approx(b[it][key], rel=rel, abs=abs), (it, key, a[it][key],
                                                                                  b[it][key])


# ---- a run in this world's processes (world scripts) -----------------------------------------
def checkpointed(trainer, loader=None):
    """What a checkpoint of ``trainer`` holds (puzzle.checkpointing.Checkpointed), for the tests
    that save and load outside ``PPOTrainer.train``."""
    from puzzle.checkpointing import Checkpointed

    return Checkpointed(trainer.cfg, trainer.engines, trainer.state, loader)


def train_in_world(argv, *, print_plan: bool = False) -> dict:
    """What train_ppo.py does with ``argv`` (its flag checks, --plan auto, the prompt loader, the
    loop, --save/--save-interval and --load/--ckpt-step), in this already started world instead of
    a new torchrun: a PPOTrainer is built, runs to --train-iters, and is closed. Returns {"rows":
    the metric rows of this run's iterations with timings left out, "roles", "switch", and with
    ``print_plan`` "stdout": what the flag checks printed on this rank}."""
    import contextlib
    import io
    from dataclasses import replace

    import torch.distributed as dist

    from puzzle import checkpointing, cli, weight_sources
    from puzzle.arguments import parse_args, validate_args
    from puzzle.data.prompts import PromptLoader, bundled_prompts_path, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer, fit_to_rows
    from puzzle.dataflow.trainer import PPOTrainer

    out = io.StringIO()
    with contextlib.redirect_stdout(out) if print_plan else contextlib.nullcontext():
        args = parse_args(argv)
        layouts = cli._plan_layouts(args)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    cfg = validate_args(args, dist.get_world_size(), tokenizer.vocab_size, layouts=layouts)
    weight_sources.check(cfg)  # a trainable role at random weights needs --init-random, as in cli.run
    cfg = replace(cfg, faults=cli.fault_injection_from_env({}))
    dataset = load_prompt_dataset(cfg.prompt_data or bundled_prompts_path(), tokenizer, cfg.prompt_key,
                                  max_prompt_len=cfg.ppo.max_prompt_length, overflow=cfg.prompt_overflow,
                                  split=cfg.prompt_split, apply_chat_template=cfg.apply_chat_template,
                                  skip_bad_records=cfg.skip_bad_records)
    fit_to_rows(tokenizer, cfg.roles["actor"].arch.vocab_size, dataset.prompts)
    step = cfg.ckpt_step
    if cfg.load:
        checkpointing.check_checkpoint(cfg, cfg.load, step)
        step = checkpointing.verify_checkpoint(cfg.load, step)
    loader = PromptLoader(dataset.prompts, cfg.ppo.rollout_batch_size, dp_rank=0, dp_size=1, seed=cfg.seed)

    def next_prompts():
        pb = next(loader)
        return pb.prompts, [dataset.records[i] if dataset.records else {} for i in pb.indices]

    trainer = PPOTrainer(cfg, tokenizer, dataset)
    rows = []
    try:
        if cfg.load and step is not None:
            checkpointing.load_checkpoint(checkpointed(trainer, loader), cfg.load, load_optim=cfg.load_optim,
                                          load_rng=cfg.load_rng, iteration=step)
        saved = trainer.iteration
        while trainer.iteration < cfg.train_iters:
            m = trainer.step(*next_prompts(), refill=next_prompts)
            rows.append({k: v for k, v in m.items() if not k.startswith(("time_", "switch_seconds"))
                         and k != "samples_per_sec"})
            if cfg.save and cfg.save_interval and trainer.iteration % cfg.save_interval == 0:
                checkpointing.save_checkpoint(checkpointed(trainer, loader), cfg.save,
                                              keep_last=cfg.ops.keep_last_checkpoints)
                saved = trainer.iteration
        if cfg.save and saved != trainer.iteration:
            checkpointing.save_checkpoint(checkpointed(trainer, loader), cfg.save,
                                          keep_last=cfg.ops.keep_last_checkpoints)
    finally:
        trainer.close()
    dist.barrier()
    res = {"rows": rows, "roles": sorted(trainer.engines), "switch": trainer.switch is not None}
    if print_plan:
        res["stdout"] = out.getvalue()
    return res


# ---- the session's saved run (tests/conftest.py `saved_run`) ---------------------------------
#: examples/run_ppo_tiny.sh on 2 ranks, every model at (P,D,T) = (1,2,1), sampled generation,
#: 6 iterations of 8 prompts
SAVED_RUN_NPROC = 2
SAVED_RUN_FLAGS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                   "--critic-tensor-model-parallel-size", "1", "--rollout-batch-size", "8",
                   "--global-batch-size", "8", "--max-new-tokens", "8", "--ppo-epochs", "1", "--train-iters", "6"]
#: the critic's gradients are poisoned at iteration 2 and that optimizer step is skipped: a run
#: that should repeat the saved run's numbers takes these flags and this environment too
SAVED_RUN_SKIP_FLAGS = ["--skip-nonfinite-iterations", "1"]
SAVED_RUN_ENV = {"PUZZLE_TEST_NONFINITE_AT": "critic:2"}
