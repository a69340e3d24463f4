"""Watching a run: the rank-0 iteration line, ETA, learning rates, --log-samples rows, the
generation progress bar (terminal only)."""

import io
import json
from types import SimpleNamespace

import pytest
import torch

from puzzle.metrics import (GenerationProgress, MetricsLogger, SampleLog, eta_seconds, format_duration,
                            format_eval_line, format_iteration_line, learning_rates, open_run_jsonl,
                            rollout_sample_rows, sample_rows, tokens_per_second)

GRPO = {"iteration": 7, "reward_mean": 0.25, "solved_fraction": 0.25, "reward_group_std_mean": 0.1, "kl": 0.0,
        "policy_loss": 1e-3, "clip_frac": 0.01, "entropy": 5.0, "response_length_mean": 2.0,
        "actor_grad_norm": 0.5, "lr": 3e-3, "tokens_per_sec": 1234.5, "samples_per_sec": 100.0,
        "time_generate": 0.5, "time_score": 0.25, "time_train": 1.0}


def test_durations_and_eta():
    assert format_duration(0) == "0:00:00" and format_duration(3725.4) == "1:02:05"
    assert format_duration(100 * 3600) == "100:00:00"
    assert eta_seconds(30.0, 3, 7) == pytest.approx(70.0) and eta_seconds(5.0, 0, 7) is None


def test_iteration_line_has_megatrons_fields_and_only_the_roles_built():
    line = format_iteration_line(GRPO, 80, elapsed=65, eta=600)
    for part in (" iteration        7/      80", "elapsed: 0:01:05", "ETA: 0:10:00", "learning rate: 3.000E-03",
                 "solved: 0.250", "grad norm actor: 0.500", "tokens/s: 1234.5",
                 "time gen/score/train (s): 0.50/0.25/1.00"):
        assert part in line, (part, line)
    assert "value loss" not in line and "critic" not in line  # a critic-free run builds no critic
    ppo = dict(GRPO, value_loss=0.5, critic_grad_norm=2.0, critic_lr=1e-3)
    line = format_iteration_line(ppo, 80)
    assert "value loss: 5.0000E-01" in line and "grad norm actor/critic: 0.500/2.000" in line
    assert "critic learning rate: 1.000E-03" in line and "ETA" not in line


def test_eval_line():
    line = format_eval_line({"iteration": 20, "eval/reward": 0.5, "eval/accuracy": 0.5, "eval/pass@4": 0.75,
                             "eval/prompts": 220, "time_eval": 0.4})
    assert line == (" evaluation at iteration 20 | reward: 0.5000 | accuracy: 0.5000 | pass@4: 0.7500 | "
                    "prompts: 220 | time (s): 0.40")


def test_logger_prints_eval_and_iteration_lines_and_keeps_one_file(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), 1, 80, rank=0)
    logger.log({"iteration": 0, "eval/accuracy": 0.0, "time_eval": 0.1})
    logger.log(dict(GRPO, iteration=1))
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(" evaluation at iteration 0") and out[1].startswith(" iteration        1/      80")
    assert "ETA: " in out[1]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]


def test_run_jsonl_fresh_and_resumed(tmp_path):
    path = str(tmp_path / "s.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps({"iteration": i}) + "\n" for i in range(5)) + '{"iteration": 5, "x')
    open_run_jsonl(path, 2).close()  # resumed at 2: keeps 0..2, drops the unsaved rest and the cut line
    assert [json.loads(x)["iteration"] for x in open(path)] == [0, 1, 2]
    open_run_jsonl(path, 0).close()  # a fresh run
    assert open(path).read() == ""


def test_sample_rows_spread_over_the_batch():
    assert sample_rows(4, 64) == [0, 16, 32, 48] and sample_rows(3, 2) == [0, 1] and sample_rows(0, 8) == []


def _batch():
    # prompts "ab" and "c", responses "xy<eos>" and "z" (byte ids; eos 1), right-padded with 0
    tokens = torch.tensor([[97, 98, 120, 121, 1], [99, 122, 0, 0, 0]])
    return SimpleNamespace(tokens=tokens, prompt_lengths=torch.tensor([2, 1]), response_lengths=torch.tensor([3, 1]),
                           size=2, scores=torch.tensor([0.5, 1.0]))


def test_log_samples_rows(tmp_path):
    tok = SimpleNamespace(eos_id=1, decode=lambda ids: bytes(ids).decode())
    rows = rollout_sample_rows(_batch(), tok, iteration=3, count=5)
    assert rows == [
        {"iteration": 3, "sample": 0, "prompt": "ab", "response": "xy", "response_length": 3, "reward": 0.5},
        {"iteration": 3, "sample": 1, "prompt": "c", "response": "z", "response_length": 1, "reward": 1.0}]
    log = SampleLog(str(tmp_path), 5, rank=0, resumed_from=0)
    log.write(rows)
    log.close()
    assert [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == rows
    assert SampleLog(str(tmp_path / "other"), 5, rank=1, resumed_from=0).file is None  # rank 0 writes
    m = {"time_generate": 1.0, "time_score": 0.5, "time_train": 0.5}
    assert tokens_per_second(_batch(), m) == pytest.approx(7 / 2.0)


def test_learning_rates_of_the_trainable_roles():
    class Runtime:
        def all_reduce(self, values, op):
            assert op == "max"
            return list(values)

    def engine(lr, trainable=True):
        opt = SimpleNamespace(param_groups=[{"lr": lr}])
        return SimpleNamespace(trainable=trainable, scheduler=object() if trainable else None, optimizer=opt)

    assert learning_rates({"actor": engine(3e-3), "ref": engine(0.0, False)}, Runtime()) == {"lr": 3e-3}
    both = learning_rates({"actor": engine(3e-3), "critic": engine(1e-3)}, Runtime())
    assert both == {"lr": 3e-3, "critic_lr": 1e-3}


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_rank_0_of_a_terminal():
    assert GenerationProgress.for_terminal(0, lambda: "gen", io.StringIO()) is None  # a log file: silent
    assert GenerationProgress.for_terminal(1, lambda: "gen", _Terminal()) is None
    screen = _Terminal()
    bar = GenerationProgress.for_terminal(0, lambda: "iteration 3 generation", screen)
    for done in (0, 5, 9):
        bar(done, 16)
        assert bar.bar.n == done and bar.bar.total == 16
    bar(16, 16)
    assert bar.bar is None  # closed (and cleared) at the end
    assert "iteration 3 generation" in screen.getvalue()


def test_generation_reports_finished_rows_from_the_slot_batches_host_state():
    from puzzle.rollout.generation import _progress_report

    seen = []
    prefill, decode = SimpleNamespace(prefill=True), SimpleNamespace(prefill=False)
    a = SimpleNamespace(queue=[5, 6], host_active=[0, 1], call=prefill, call_slots=[2, 3],  # 2 rows entering
                        paused=[], appends=[])
    # b: one row decoding, one paused (its environment step in flight), one joined (its observation
    # waiting for the next prefill): multi-turn rows out of the decode calls are not finished
    b = SimpleNamespace(queue=[], host_active=[0], call=decode, call_slots=[0], paused=[4], appends=[5])
    report = _progress_report(lambda done, rows: seen.append((done, rows)), [a, b], 12)
    report()
    assert seen == [(12 - 2 - 2 - 2 - 1 - 1 - 1, 12)]
    a.queue, a.host_active, a.call = [], [], None
    b.paused, b.appends = [], []
    report()
    assert seen[-1] == (11, 12) and _progress_report(None, [a, b], 12) is None
