"""Finished runs exit 0, every time (puzzle.parallel.launcher.exit_process, the end of every entry point).

A finished 4-rank MoE generate once died at interpreter exit with "terminate called without an
active exception" (SIGABRT, rc -6) in 1 of 4 runs, and torchrun reported the job failed. The
entry points now tear down in order (process groups destroyed, workers joined, exit handlers
run) and leave without the interpreter's finalisation. The order is checked in a world of one;
the 4-rank MoE generate (E = 2, T = 2) is launched GENERATE_RUNS times: exit status 0 and no abort
every time. Every run of a launch script in the suite (tests.harness.run_script) is checked for
the abort as well: the 4-rank tiny PPO run with the reward worker pool and a save is the README
quick start's (tests/e2e/test_tiny_ppo.py::test_tiny_run_learns)."""

import json
import subprocess
import sys

import pytest

from tests.harness import REPO, script_env

#: launches of the 4-rank MoE generate (the examples' learning runs, the saved run and the
#: checkpoint and fault tests add their own launches: tests.harness.run_script checks each too)
GENERATE_RUNS = 1
ABORT = "terminate called"

ORDER = r"""
import atexit, json, sys, threading, time
import torch.distributed as dist
from puzzle.parallel import launcher
from puzzle.parallel.groups import init_distributed

init_distributed()
dist.new_group([0])
seen = []
worker = threading.Thread(target=lambda: (time.sleep(0.3), seen.append("worker joined")))
worker.start()
atexit.register(lambda: print(json.dumps({"initialized": dist.is_initialized(), "seen": seen}), flush=True))
print("work done", flush=True)
launcher.exit_process(int(sys.argv[1]))
print("not reached")
"""


def test_exit_process_destroys_the_groups_joins_workers_then_exits():
    proc = subprocess.run([sys.executable, "-c", ORDER, "3"], cwd=REPO, env=script_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]  # the entry point's status, whatever it is
    lines = proc.stdout.splitlines()
    assert lines[0] == "work done" and "not reached" not in proc.stdout
    # the exit handlers ran after the process groups were destroyed and the worker thread joined
    assert json.loads(lines[-1]) == {"initialized": False, "seen": ["worker joined"]}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A transformers-made tiny Mixtral (4 experts, top-2) with its tokenizer, and one prompt."""
    import torch
    import transformers

    from tests.distributed.worlds.hf_import import _randomise
    from tests.distributed.worlds.model_families import COMMON, PROMPTS, _save, tiny_tokenizer

    root = tmp_path_factory.mktemp("mixtral")
    cfg = transformers.MixtralConfig(**dict(COMMON, intermediate_size=48, num_local_experts=4,
                                            num_experts_per_tok=2, tie_word_embeddings=False))
    torch.manual_seed(0)
    _save(_randomise(transformers.MixtralForCausalLM(cfg)).eval(), str(root / "model"))
    tiny_tokenizer().save_pretrained(str(root / "model"))
    (root / "prompts.jsonl").write_text(json.dumps({"prompt_ids": PROMPTS[0]}) + "\n")
    return root


def test_moe_generate_on_4_ranks_exits_0_every_time(mixtral):
    outputs = []
    for i in range(GENERATE_RUNS):
        out = mixtral / f"out{i}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
             "-m", "puzzle.tools.generate", "--load", str(mixtral / "model"), "--prompts",
             str(mixtral / "prompts.jsonl"), "--output", str(out), "--greedy", "--max-new-tokens", "4",
             "--seq-length", "32", "--make-vocab-size-divisible-by", "64",
             "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
            cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and ABORT not in proc.stderr, (i, proc.stderr[-3000:])
        outputs.append(json.loads(out.read_text())["tokens"])
    assert len(outputs[0]) == 4 and all(o == outputs[0] for o in outputs)

