"""metrics.jsonl of fresh and resumed runs; TensorBoard receives the numbers of metrics.jsonl."""

import json

import pytest

from puzzle.config import Operations
from puzzle.metrics import MetricsLogger


def _metrics(it, **extra):
    m = {"iteration": it, "reward_mean": 0.1 * it, "kl": 0.01, "policy_loss": -1e-3 * it, "value_loss": 0.5,
         "clip_frac": 0.0, "entropy": 5.5, "response_length_mean": 8.0, "samples_per_sec": 3.0,
         "time_generate": 0.1, "time_score": 0.1, "time_train": 0.1, "prompts_loaded": 64}
    m.update(extra)
    return m


def _run(log_dir, iterations, ops=None):
    logger = MetricsLogger(str(log_dir), 1, 6, rank=0, ops=ops)
    for it in iterations:
        logger.log(_metrics(it))
    logger.close()
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_fresh_run_starts_a_fresh_file_and_a_resume_keeps_its_past(tmp_path, capsys):
    assert [r["iteration"] for r in _run(tmp_path, [1, 2, 3, 4])] == [1, 2, 3, 4]
    assert [r["iteration"] for r in _run(tmp_path, [1, 2])] == [1, 2]  # not appended to the old run
    _run(tmp_path, [1, 2, 3, 4])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 5, "rew')  # a line cut by a kill
    rows = _run(tmp_path, [3, 4, 5, 6])  # resumed from the checkpoint of iteration 2
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert capsys.readouterr().out.count(" iteration ") == 14


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(str(tmp_path), 1, 6, rank=1)
    logger.log(_metrics(1))
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_gets_the_metrics_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    rows = _run(tmp_path, [1, 2, 3], ops=Operations(tensorboard_dir=str(tb)))
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {k for k in rows[0] if k != "iteration"}
    for tag in tags:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx([r[tag] for r in rows], rel=1e-6)
