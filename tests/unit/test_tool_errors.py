"""The tools fail like train_ppo.py: bad input is one ``error:`` line from rank 0 (nothing from
the other ranks), exit status 2, no traceback and no process group. In process: every check runs
before the process group starts, so the launcher's environment (RANK, WORLD_SIZE) is enough."""

import json

import pytest

LLAMA_2_KV_HEADS = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259,
                    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "hidden_act": "silu"}


def _hf_dir(path, **cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def world(monkeypatch):
    """launcher.world_size()/rank() from torchrun's environment; no process group may be left."""
    import torch.distributed as dist

    def set_world(size, rank=0):
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", str(rank))
    yield set_world
    assert not dist.is_initialized()


def _fails(main, argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err + out, (rc, out, err)
    return err


def _prompts(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "1+1="}\n')
    return ["--prompts", str(f), "--output", str(tmp_path / "out.jsonl"), "--tokenizer-type", "ByteLevelTokenizer"]


def test_generate(tmp_path, world, capsys):
    from puzzle.tools.generate import main

    gemma = _hf_dir(tmp_path / "gemma2", **dict(LLAMA_2_KV_HEADS, model_type="gemma2"))
    llama = _hf_dir(tmp_path / "llama", **LLAMA_2_KV_HEADS)
    world(1)
    err = _fails(main, ["--load", gemma, *_prompts(tmp_path)], capsys)
    assert err.count("\n") == 1 and err.startswith("error: ") and "gemma2" in err and "config.json" in err
    world(4)
    err = _fails(main, ["--load", llama, "--tensor-model-parallel-size", "4", *_prompts(tmp_path)], capsys)
    assert err == "error: actor cannot use plan (P=1, D=1, T=4): num_query_groups=2 is not divisible by T=4\n"
    world(4, rank=1)  # the other ranks stay silent
    assert _fails(main, ["--load", llama, "--tensor-model-parallel-size", "4", *_prompts(tmp_path)], capsys) == ""
    world(1)
    err = _fails(main, ["--load", llama, "--role", "critic", *_prompts(tmp_path)], capsys)
    assert err == "error: --role: generation needs an LM (actor or ref), got critic\n"
    err = _fails(main, ["--load", llama, "--prompts", str(tmp_path / "missing.jsonl"), "--output", "o"], capsys)
    assert err.startswith("error: [Errno 2] No such file or directory") and "missing.jsonl" in err
    err = _fails(main, ["--load", llama, "--bogus"], capsys)
    assert err == ("error: the following arguments are required: --prompts, --output "
                   "(see python -m puzzle.tools.generate --help)\n")


def test_export_hf(tmp_path, world, capsys):
    from puzzle.tools.export_hf import main

    gemma = _hf_dir(tmp_path / "gemma2", **dict(LLAMA_2_KV_HEADS, model_type="gemma2"))
    llama = _hf_dir(tmp_path / "llama", **LLAMA_2_KV_HEADS)
    world(1)
    err = _fails(main, ["--load", gemma, "--save", str(tmp_path / "out")], capsys)
    assert err.count("\n") == 1 and "gemma2" in err
    world(4)
    err = _fails(main, ["--load", llama, "--save", str(tmp_path / "out"), "--tensor-model-parallel-size", "4"], capsys)
    assert "num_query_groups=2 is not divisible by T=4" in err and err.count("\n") == 1
    world(2)
    err = _fails(main, ["--load", llama, "--save", str(tmp_path / "out"), "--tensor-model-parallel-size", "4"], capsys)
    assert err == ("error: --tensor-model-parallel-size/--pipeline-model-parallel-size: T*P = 4 does not divide "
                   "the world size 2\n")
    world(1)
    err = _fails(main, ["--load", str(tmp_path / "nothing"), "--save", str(tmp_path / "out")], capsys)
    assert "neither an HF directory (config.json) nor a puzzle checkpoint" in err
    err = _fails(main, ["--load", llama, "--save", str(tmp_path / "out"), "--merge-lora"], capsys)
    assert err.startswith("error: --merge-lora: ") and "holds no LoRA adapters" in err, err
    assert not (tmp_path / "out").exists()


def test_megatron_tools(tmp_path, world, capsys):
    from puzzle.tools.export_megatron import main as export
    from puzzle.tools.make_value_model import main as make

    llama = _hf_dir(tmp_path / "llama", **LLAMA_2_KV_HEADS)
    world(1)
    err = _fails(export, ["--load", str(tmp_path / "nothing"), "--save", str(tmp_path / "out")], capsys)
    assert "nor a Megatron-LM one" in err and err.count("\n") == 1
    err = _fails(make, ["--load", llama, "--save", str(tmp_path / "out"), "--role", "actor"], capsys)
    assert err == "error: --role: critic or reward (the model made), not actor\n"
    err = _fails(make, ["--load", llama, "--save", str(tmp_path / "out"), "--head-init-std", "0.1"], capsys)
    assert err.startswith("error: --head-init-std: a std > 0 for --head-init normal")
    err = _fails(make, ["--load", str(tmp_path), "--save", str(tmp_path / "out")], capsys)
    assert "neither an HF directory (config.json) nor a Megatron-LM checkpoint" in err
    assert not (tmp_path / "out").exists()


def test_profile_and_search_plan(tmp_path, capsys):
    from puzzle.plan_search.command import search_main
    from puzzle.tools.profile import main

    out = ["--out", str(tmp_path / "p.json")]
    err = _fails(main, out + ["--tp-sizes", "1,3"], capsys)
    assert err == "error: --tp-sizes: must be powers of two, got [1, 3]\n"
    err = _fails(main, out + ["--num-attention-heads", "4", "--num-query-groups", "2", "--tp-sizes", "4"], capsys)
    assert "num_query_groups=2 is not divisible by T=4" in err and err.count("\n") == 1
    assert _fails(main, out + ["--seq-lengths", "x"], capsys) == \
        "error: --seq-lengths: expected positive integers, got 'x'\n"
    assert _fails(main, ["--bogus"], capsys).startswith("error: ")
    assert not (tmp_path / "p.json").exists()
    err = _fails(search_main, ["--world-size", "3", "--num-layers", "2", "--hidden-size", "64",
                               "--num-attention-heads", "4", "--seq-length", "64"], capsys)
    assert err.startswith("error: ") and err.count("\n") == 1
    assert _fails(search_main, ["--bogus"], capsys) == "error: unrecognized arguments: --bogus (see search_plan.py --help)\n"
