"""search_plan.py, plan files and dry runs (no allocation, no torch.distributed)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from puzzle.arguments import ArgumentError, config_for_planning, parse_args, plan_flags, validate_args
from puzzle.plan_search.command import search_main
from puzzle.plan_layouts import read_plan_document

REPO = Path(__file__).resolve().parents[2]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--tokenizer-type",
         "HuggingFaceTokenizer", "--tokenizer-model", "/nonexistent", "--vocab-size", "32000"]
SEVEN_B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
           "--num-attention-heads", "32", "--seq-length", "1024", *LLAMA]
CRITIC_350M = ["--critic-num-layers", "24", "--critic-hidden-size", "1024", "--critic-ffn-hidden-size",
               "4096", "--critic-num-attention-heads", "16"]
BATCH = ["--rollout-batch-size", "128", "--global-batch-size", "64", "--micro-batch-size", "4",
         "--max-new-tokens", "256", "--use-distributed-optimizer"]


def test_search_plan_json_and_plan_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = search_main(["--world-size", "8", "--ranks-per-node", "8", *SEVEN_B, *CRITIC_350M, *BATCH,
                      "--exhaustive", "--json", "--save-plan", str(out)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 8 and doc["gap"] <= 0.02 and doc["peak_memory_gib"] <= 80
    assert set(doc["plans"]) == {"actor", "critic", "ref", "reward"}
    assert set(doc["plans"]["actor"]) == {"generation", "scoring", "training"}
    assert json.loads(out.read_text())["plans"] == doc["plans"]
    # the plan's flags are a valid run configuration on 8 ranks
    flags = plan_flags(doc)
    cfg = validate_args(parse_args(SEVEN_B + CRITIC_350M + BATCH + ["--reward-model", "random"] + flags),
                        8, 32000, check_paths=False)
    train = cfg.roles["actor"].plan
    assert f"({train.P},{train.D},{train.T})" == doc["plans"]["actor"]["training"].split("@")[0]
    gen = cfg.roles["actor"].gen_plan
    assert f"({gen.P},{gen.D},{gen.T})" == doc["plans"]["actor"]["generation"].split("@")[0]
    # the plan applied to the configuration directly (what train_ppo.py --plan-file does) gives the
    # same configuration as its flags, and leaves the parsed flags as they were
    args = parse_args(SEVEN_B + CRITIC_350M + BATCH + ["--reward-model", "random"])
    before = dict(vars(args))
    direct = validate_args(args, 8, 32000, check_paths=False, layouts=read_plan_document(doc))
    assert vars(args) == before
    assert direct == cfg


def test_search_help_shows_its_own_options_first_and_a_valid_example(capsys):
    import shlex

    with pytest.raises(SystemExit) as e:
        search_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: search_plan.py --world-size N")
    assert out.index("--save-plan SAVE_PLAN") < out.index("--num-layers NUM_LAYERS") < out.index("--world-size WORLD")
    example = out[out.index("  python search_plan.py "):].split("\n\n")[0]
    argv = shlex.split(example.replace("\\\n", " "))[2:]
    assert argv[-2:] == ["--save-plan", "plan.json"]  # the rest: valid train_ppo.py flags for 16 ranks
    assert config_for_planning(parse_args(argv[:-2])).world_size == 16


def test_searched_time_sharing_runs_as_searched():
    """A plan the search prices with time-sharing is one the trainer time-shares: validate_args takes
    it (strict: no downgrade to sequential) with the search's placements (PUZZLE's 7B/7B on 16 ranks)."""
    from puzzle.plan_search import LLAMA_SHAPES, PPOJob, PPOWorkload, similarity_search

    job = PPOJob(16, LLAMA_SHAPES["7B"], LLAMA_SHAPES["7B"],
                 PPOWorkload(256, prompt_len=256, gen_len=256, micro_batch_size=4))
    doc = similarity_search(job).to_dict()
    assert doc["placements"]["training"] == doc["placements"]["scoring"] == "time-sharing"
    assert read_plan_document(doc, strict=True).placements == {"scoring": "time-sharing", "training": "time-sharing"}
    cfg = validate_args(parse_args(SEVEN_B + BATCH + ["--reward-model", "random"] + plan_flags(doc, strict=True)),
                        16, 32000, check_paths=False)
    assert cfg.score_placement == cfg.train_placement == "time-sharing"
    assert len({cfg.roles[r].plan for r in ("actor", "critic", "ref", "reward")}) == 1


def test_plan_document_time_sharing_at_equal_p():
    """A plan document's 'time-sharing' stage keeps equal P at another (D, T) on shared ranks; unequal
    P, or experts split at another plan, becomes 'sequential' (strict: an error naming both plans)."""
    def doc(critic):
        return {"plans": {"actor": {"training": "2,1,2", "scoring": "2,1,2"},
                          "critic": {"training": critic, "scoring": critic}},
                "placements": {"scoring": "time-sharing", "training": "time-sharing"}}

    both = {"scoring": "time-sharing", "training": "time-sharing"}
    assert read_plan_document(doc("2,2,1"), strict=True).placements == both
    assert read_plan_document(doc("1,4,1"), strict=False).placements == dict.fromkeys(both, "sequential")
    with pytest.raises(ArgumentError, match=r"--plan-file: scoring: time-sharing of actor \(P=2, D=1, T=2\) "
                                            r"and critic \(P=1, D=4, T=1\) on shared ranks: unequal P"):
        read_plan_document(doc("1,4,1"), strict=True)
    with pytest.raises(ArgumentError, match="experts split"):
        read_plan_document(doc("2,2,1,E=2"), strict=True)


def test_infeasible_request_explains(capsys):
    seventy_b = ["--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672",
                 "--num-attention-heads", "64", "--group-query-attention", "--num-query-groups", "8",
                 "--seq-length", "1024", *LLAMA]
    rc = search_main(["--world-size", "8", "--ranks-per-node", "8", *seventy_b, *BATCH])
    err = capsys.readouterr().err
    assert rc == 3 and "no plan fits" in err and "GiB" in err


def test_plan_flags_refuse_generation_on_other_ranks():
    doc = {"plans": {"actor": {"training": "(1,2,1)", "scoring": "(1,2,1)", "generation": "(1,4,1)"}},
           "placements": {}}
    with pytest.raises(ArgumentError, match="--plan-file: the actor generates on"):
        plan_flags(doc)
    with pytest.raises(ArgumentError, match="--plan-file: not a plan document"):
        plan_flags({"plans": {"actor": {"training": "bogus"}}})


def _script_command(tmp_path, *extra):
    """The train_ppo.py flags that examples/run_ppo_7b.sh --dry-run EXTRA runs: the script itself
    runs, with a ``python3`` on its PATH that records its arguments instead of starting."""
    shim, record = tmp_path / "bin", tmp_path / "argv"
    shim.mkdir(exist_ok=True)
    (shim / "python3").write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{record}"\n')
    (shim / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["bash", str(REPO / "examples/run_ppo_7b.sh"), "--dry-run", *extra], cwd=REPO, env=env,
                   check=True, timeout=60)
    argv = record.read_bytes().decode().split("\0")[:-1]
    assert argv[0] == "train_ppo.py"
    return argv[1:]


def test_dry_run_of_the_7b_script_on_a_cpu_machine(tmp_path, monkeypatch, capfd):
    """The script's own command, run in this process as train_ppo.py would run it."""
    from puzzle import cli

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert cli.run(_script_command(tmp_path)) == 0
    out = capfd.readouterr().out
    assert "dry run: every flag is valid; world size 8" in out
    assert "per-device memory estimate" in out and "DOES NOT FIT" not in out
    assert cli.run(_script_command(tmp_path, "--rollout-batch-size", "1024", "--global-batch-size", "128",
                                   "--inference-dynamic-batching-buffer-size-gb", "70")) == 3
    assert "exceeds device memory" in capfd.readouterr().out
    assert cli.run(_script_command(tmp_path, "--tensor-model-parallel-size", "3")) == 2
    assert "--tensor-model-parallel-size" in capfd.readouterr().err
