"""compare_metrics --max-diffs: each numeric field's largest absolute and relative difference."""

from puzzle.tools.compare_metrics import main, max_differences


def test_largest_difference_per_field():
    a = [{"iteration": 1, "kl": 0.5, "time_train": 1.0, "name": "x"}, {"iteration": 2, "kl": 0.25}]
    b = [{"iteration": 1, "kl": 0.5, "time_train": 9.0, "name": "y"}, {"iteration": 2, "kl": 0.5}]
    d = max_differences(a, b)
    assert set(d) == {"iteration", "kl"}  # timings and strings are not compared
    assert d["kl"] == (0.25, 0.5, 2) and d["iteration"] == (0, 0.0, None)


def test_cli_prints_the_largest_differences(tmp_path, capsys):
    for name, v in (("a", 1.0), ("b", 1.5)):
        (tmp_path / f"{name}.jsonl").write_text(f'{{"iteration": 1, "loss": {v}}}\n')
    assert main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--max-diffs"]) == 1
    assert "max diff loss: abs 0.5 rel 0.333 (iteration 1)" in capsys.readouterr().out


def test_fields_of_a_ignores_only_fields_the_baseline_lacks():
    from puzzle.tools.compare_metrics import compare

    base = [{"iteration": 1, "kl": 0.5}]
    newer = [{"iteration": 1, "kl": 0.5, "lr": 0.002}]
    assert compare(base, newer) == [(1, "lr", None, 0.002)]  # a new field counts by default
    assert compare(base, newer, fields_of_a=True) == []
    assert compare(newer, base, fields_of_a=True) == [(1, "lr", 0.002, None)]  # a lost field always counts
