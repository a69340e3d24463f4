"""A tiny PPO run whose actor, reference and critic are MoE models (4 experts, top-2, load-balancing
loss), one iteration at E = 1 and at E = 2 on 2 ranks: the aux loss is logged, and the two expert
layouts give the same generation, scores, losses and aux loss exactly and the same gradient norms
up to fp32 reduction order (at E = 2 an expert's gradient sums tokens of other ranks)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), NPROC="2")
FLAGS = ["--rollout-batch-size", "4", "--global-batch-size", "4", "--max-new-tokens", "8", "--micro-batch-size", "2",
         "--ppo-epochs", "1", "--train-iters", "1", "--tensor-model-parallel-size", "1",
         "--pipeline-model-parallel-size", "1", "--critic-tensor-model-parallel-size", "1",
         "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
         # E = 2 runs padded micro-batches (the gloo dispatcher); E = 1 too, so that the routers see the same tokens
         "--no-use-remove-padding"]
KEYS = ("reward_mean", "kl", "policy_loss", "value_loss", "entropy", "value_mean", "return_mean",
        "response_length_mean", "moe_aux_loss")


def _run(extra, log_dir):
    proc = subprocess.run(["bash", str(REPO / "examples/run_ppo_tiny.sh"), *FLAGS, *extra, "--log-dir", str(log_dir)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return {r["iteration"]: r for r in map(json.loads, (Path(log_dir) / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return _run([], root / "e1"), _run(["--expert-model-parallel-size", "2"], root / "e2")


def test_aux_loss_is_logged(runs):
    for rows in runs:
        assert sorted(rows) == [1]
        assert all(0.5 < rows[i]["moe_aux_loss"] < 4.0 for i in rows), [rows[i]["moe_aux_loss"] for i in rows]


def test_expert_layouts_agree(runs):
    e1, e2 = runs
    assert {k: e1[1][k] for k in KEYS} == {k: e2[1][k] for k in KEYS}
    for key in ("actor_grad_norm", "critic_grad_norm"):
        assert e2[1][key] == pytest.approx(e1[1][key], rel=1e-5), key


def test_generation_scoring_logprob_difference_is_logged(runs):
    """MoE generation records its sampled tokens' log-probs; against scoring's they differ by fp32
    rounding only (the routers chose the same experts): tests/distributed/test_vocab_rows.py's bound."""
    for rows in runs:
        m = rows[1]
        assert 0 <= m["gen_score_logprob_diff_mean"] <= m["gen_score_logprob_diff_max"] <= 2e-6, m
