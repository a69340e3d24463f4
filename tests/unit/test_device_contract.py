"""The device contract (puzzle/parallel/device.py) and the batch moves built on it, on CPU."""

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from puzzle.parallel.device import Runtime, check_on_device
from puzzle.parallel.plan import ParallelPlan
from puzzle.tools.compare_metrics import compare, main as compare_main
from puzzle.dataflow.batch import right_padded_rows, rollout_from_generation

REPO = Path(__file__).resolve().parents[2]


def test_check_on_device_names_the_input():
    mb = {"tokens": torch.zeros(2, 3, dtype=torch.long), "note": "not a tensor"}
    check_on_device("forward_step", torch.device("cpu"), mb)  # all on the model's device
    with pytest.raises(RuntimeError, match=r"forward_step: input 'tokens' is on cpu, the model on meta"):
        check_on_device("forward_step", torch.device("meta"), mb)


def test_no_cuda_device_literal_outside_the_device_module():
    pattern = re.compile(r"""device\s*=\s*["']cuda|\.cuda\(|torch\.device\(\s*["']cuda|\.to\(\s*["']cuda""")
    offenders = []
    for path in (REPO / "puzzle").rglob("*.py"):
        if path.name == "device.py" and path.parent.name == "parallel":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "CUDA named outside puzzle/parallel/device.py:\n" + "\n".join(offenders)


def _right_pad_reference(prompts, resp, rlens, seq, pad):
    out = torch.full((len(prompts), seq), pad, dtype=torch.long)
    for b, p in enumerate(prompts):
        r = int(rlens[b])
        out[b, :len(p)] = torch.tensor(p)
        out[b, len(p):len(p) + r] = resp[b, :r]
    return out


def test_right_padded_rows_match_the_row_by_row_definition():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, Lp, R = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g)), \
            int(torch.randint(1, 5, (1,), generator=g))
        plens = torch.randint(1, Lp + 1, (B,), generator=g)
        prompts = [torch.randint(0, 100, (int(n),), generator=g).tolist() for n in plens]
        rlens = torch.randint(0, R + 1, (B,), generator=g)
        resp = torch.randint(0, 100, (B, R), generator=g)
        seq = int((plens + R).max()) + int(torch.randint(0, 3, (1,), generator=g))
        got = right_padded_rows(prompts, resp, rlens, seq, 999)
        assert torch.equal(got, _right_pad_reference(prompts, resp, rlens, seq, 999))


def test_rollout_from_generation_world_of_one_rounds_for_sequence_parallel():
    layout = SimpleNamespace(plan=ParallelPlan(), member=True, p=0, t=0, d=0,
                             generation_share=lambda: (0, 1, True))
    prompts = [[5, 6, 7], [8]]
    responses = torch.tensor([[1, 2, 0], [3, 0, 0]])
    lengths = torch.tensor([2, 1])
    batch = rollout_from_generation(prompts, responses, lengths, layout, 3, 0, torch.device("cpu"),
                                    seq_multiple=4)
    assert batch.tokens.shape == (2, 8)  # max(3 + 3, 1 + 3) = 6 -> 8
    assert batch.tokens[0].tolist() == [5, 6, 7, 1, 2, 0, 0, 0]
    assert batch.tokens[1].tolist() == [8, 3, 0, 0, 0, 0, 0, 0]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 0, 0]]
    assert batch.share_for(layout).size == 2


def test_runtime_reductions_without_a_world():
    rt = Runtime(device=torch.device("cpu"))
    assert rt.all_reduce([1.5, 2.0], op="max") == [1.5, 2.0]
    assert rt.broadcast_object({"a": 1}) == {"a": 1}
    assert rt.peak_memory_bytes() == 0 and not rt.on_accelerator


def test_compare_metrics_tolerances(tmp_path):
    a = [{"iteration": 1, "kl": 1.0, "clip_frac": 0.01, "time_train": 5.0}]
    b = [{"iteration": 1, "kl": 1.00005, "clip_frac": 0.02, "time_train": 9.0}]
    assert [d[1] for d in compare(a, b)] == ["clip_frac", "kl"]          # exact by default
    assert [d[1] for d in compare(a, b, rtol=1e-4)] == ["clip_frac"]     # timings never count
    assert compare(a, b, rtol=1e-4, field_atol={"clip_frac": 0.02}) == []
    assert compare(a, a + a)[0][1] == "lines"
    fa, fb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    fa.write_text(json.dumps(a[0]) + "\n")
    fb.write_text(json.dumps(b[0]) + "\n")
    assert compare_main([str(fa), str(fb), "--rtol", "1e-4"]) == 1
    assert compare_main([str(fa), str(fb), "--rtol", "1e-4", "--field-atol", "clip_frac=0.02"]) == 0


def test_launcher_reads_torchruns_variables_and_defaults_to_a_world_of_one(monkeypatch):
    from puzzle.parallel import launcher

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "")  # recorded, so teardown restores what default_to_world_of_one sets
        monkeypatch.delenv(var)
    assert not launcher.launched() and (launcher.rank(), launcher.world_size(), launcher.local_rank()) == (0, 1, 0)
    monkeypatch.setenv("MASTER_PORT", "29999")  # given by the user: kept
    launcher.default_to_world_of_one(12345)
    assert launcher.launched() and launcher.world_size() == 1
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "29999")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (launcher.rank(), launcher.world_size(), launcher.local_rank()) == (5, 8, 1)
    assert Runtime(device=torch.device("cpu")).timeout.total_seconds() == 600  # --distributed-timeout-minutes 10
