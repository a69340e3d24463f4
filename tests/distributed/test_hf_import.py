import pytest

from tests.harness import run_world

import safetensors  # noqa: F401  (the [hf] extra; installed by .ci/run)
import transformers  # noqa: F401


@pytest.fixture(scope="module")
def world():
    return run_world("distributed/worlds/hf_import.py", 4)


def test_import_matches_transformers_at_every_layout(world):
    res = world[0]["import"]
    assert -8 < res["ref_mean"] < -1 and res["ref_std"] > 0.3  # a non-degenerate reference
    for plan in ("(P=1, D=1, T=1)", "(P=1, D=1, T=2)", "(P=2, D=1, T=2)"):
        assert res[plan]["max_err"] < 1e-4, (plan, res[plan])
    # rank 0 reads only its shards: at T=2 (one stage of two at P=2) well under the file size
    assert res["(P=1, D=1, T=2)"]["bytes_read"] < 0.6 * res["file_bytes"]
    assert res["(P=2, D=1, T=2)"]["bytes_read"] < 0.4 * res["file_bytes"]


def test_critic_value_head_from_score_weight(world):
    assert world[0]["critic"]["max_err"] < 1e-4


def test_export_round_trips_bitwise(world):
    for plan, r in world[0]["export"].items():
        assert r["same_keys"] and r["bitwise"], (plan, r)
        assert "model.safetensors.index.json" not in r["files"] and len(r["files"]) > 2, r["files"]


def test_unsupported_architecture_error_names_the_file(world):
    r = world[0]["unsupported"]
    assert r["names_file"] and "model_type='qwen2_moe'" in r["error"], r


def test_tied_embeddings_and_rope_convention(world):
    r = world[0]["tied_rope"]
    assert r["tied_err"] < 1e-4, r
    assert r["tied_keys_have_lm_head"] is False  # tied: HF convention, no lm_head tensor
    # megatron rotary_interleaved=False == HF rotate_half: the interleaved layout is far off
    assert r["interleaved_err"] > 1e-2, r
