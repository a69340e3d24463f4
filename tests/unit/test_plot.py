"""python -m puzzle.tools.plot: the panels of the fields present, one image, several runs overlaid."""

import json

import pytest

from puzzle.tools.plot import main, plan_panels, read_metrics, series


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 9, "cut')
    return path


def _grpo(n=6):
    rows = [{"iteration": 0, "eval/accuracy": 0.0, "eval/pass@2": 0.0, "eval/pass@16": 0.1, "time_eval": 0.5}]
    for i in range(1, n + 1):
        rows.append({"iteration": i, "reward_mean": 0.1 * i, "kl": 0.0, "entropy": 5 - 0.1 * i, "clip_frac": 0.01,
                     "response_length_mean": 2.0, "time_generate": 0.5, "time_score": 0.2, "time_train": 0.7})
    rows.append({"iteration": n, "eval/accuracy": 0.4, "eval/pass@2": 0.5, "eval/pass@16": 0.8, "time_eval": 0.5})
    return rows


def test_panels_follow_the_fields_present():
    grpo = _grpo()
    names = [name for name, _ in plan_panels({"a": grpo})]
    assert names == ["reward", "eval accuracy", "KL", "entropy", "response length", "clip fraction",
                     "stage times (s)"]
    assert dict(plan_panels({"a": grpo}))["eval accuracy"] == ["eval/accuracy", "eval/pass@2", "eval/pass@16"]
    no_eval = [{"iteration": 1, "reward_mean": 0.5, "time_generate": 1.0}]
    assert plan_panels({"a": no_eval}) == [("reward", ["reward_mean"]), ("stage times (s)", ["time_generate"])]
    assert series(grpo, "eval/accuracy") == ([0, 6], [0.0, 0.4])


def test_plot_writes_a_png_of_several_runs(tmp_path, capsys):
    matplotlib = pytest.importorskip("matplotlib")  # the [plot] extra (also in [test])
    a = _write(tmp_path / "grpo" / "metrics.jsonl", _grpo())
    b = _write(tmp_path / "ppo" / "metrics.jsonl", [{"iteration": i, "reward_mean": 0.2, "kl": 0.01 * i,
                                                      "value_loss": 1.0} for i in range(1, 5)])
    assert len(read_metrics(str(a))) == 8  # the cut line is skipped
    out = tmp_path / "curves.png"
    assert main([str(a), str(b), "-o", str(out)]) == 0
    assert "wrote " + str(out) + ": reward, eval accuracy, KL, entropy, response length" in capsys.readouterr().out
    image = matplotlib.image.imread(str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.shape[0] > 300 and image.shape[1] > 1000 and image[..., :3].std() > 0.05  # not blank
    assert main([str(a), "--labels", "x", "y"]) == 2
    assert main([str(tmp_path / "missing.jsonl")]) == 2
