"""Environments (--env): the protocol's checks, the calculator, the observation cap, the faults
through the reward worker pool, the single-turn wrapper's scores = the reward function's."""

import pytest

from puzzle.reward_functions.env_runner import EnvRunner, SingleTurnEpisodes
from puzzle.reward_functions.environments import (MAX_OBSERVATION_CHARS, TRUNCATION_MARKER, Calculator, EnvCall,
                                                   EnvFactory, EnvSpec, StepResult, Turn, call_steps,
                                                   cap_observation, check_step)
from puzzle.reward_functions.runner import RewardScorer, Sample
from puzzle.reward_functions.loader import load_reward_fn

FX = "tests.unit.env_fixtures"


def calls(*texts, record=None):
    return [EnvCall(i, record or {}, Turn(t, list(t.encode()))) for i, t in enumerate(texts)]


def test_check_step_accepts_the_protocol_and_names_garbage():
    assert check_step(("obs", None, False)) == (StepResult("obs", None, False), None)
    assert check_step(StepResult("", 1, True)) == (StepResult("", 1.0, True), None)
    assert check_step((None, 0.5, 1))[0] == StepResult("", 0.5, True)
    for bad, why in [({"a": 1}, "not (observation, reward, done)"), ((3, None, True), "not str"),
                     (("", "0.5", True), "reward returned str"), (("", float("inf"), True), "reward returned inf"),
                     (("", None, "yes"), "not a bool")]:
        step, reason = check_step(bad)
        assert step is None and why in reason, (bad, reason)
    step, _ = check_step(("y" * (MAX_OBSERVATION_CHARS + 5), None, False))
    assert step.observation == "y" * MAX_OBSERVATION_CHARS + TRUNCATION_MARKER


def test_cap_observation_cuts_with_the_marker():
    assert cap_observation([1, 2, 3], 3, [9, 9]) == ([1, 2, 3], False)
    assert cap_observation([1, 2, 3, 4, 5], 4, [9, 9]) == ([1, 2, 9, 9], True)
    with pytest.raises(ValueError, match="truncation marker"):
        cap_observation([1, 2, 3], 1, [9, 9])


def test_unknown_env_is_refused_naming_it():
    for spec, why in [("calculatr", "unknown environment"), ("no_such_module_x:Env", "cannot import"),
                      (f"{FX}:NotAnEnvironment", ".* has no class 'NotAnEnvironment' with a step")]:
        with pytest.raises(ValueError, match=f"--env '{spec}': {why}"):
            EnvSpec.of(spec)
    with pytest.raises(ValueError, match="needs --reward-fn"):
        EnvSpec.of("single_turn")
    assert EnvSpec.of("calculator").path.endswith(":Calculator")


def test_calculator_evaluates_tool_calls_without_eval_and_scores_the_answer():
    calc = Calculator()
    calc.reset({"answer": "579"})
    assert calc.step(Turn("<calc>123+456</calc>", [])) == StepResult("=579", None, False)
    assert calc.step(Turn("so <calc>2*(3+4)</calc>\n", [])).observation == "=14"
    assert calc.step(Turn("<calc>1/4</calc>", [])).observation == "=1/4"
    for expr in ("__import__('os')", "x+1", "1/0"):
        assert calc.step(Turn(f"<calc>{expr}</calc>", [])).observation.startswith("=error"), expr
    assert calc.step(Turn(" 579", [])) == StepResult("", 1.0, True)
    assert calc.step(Turn("578", [])) == StepResult("", 0.0, True)
    assert calc.step(Turn("<calc>1+1", [])) == StepResult("", 0.0, True)  # never closed: an answer, wrong


def test_the_episode_instance_travels_from_step_to_step():
    factory = EnvFactory(EnvSpec.of(f"{FX}:Counter"))
    (first, why), = call_steps(factory, calls("a"))
    assert why is None and first.step == StepResult("step 1", None, False)
    (second, _), = call_steps(factory, [EnvCall(0, {}, Turn("b", []), env=first.env)])
    assert second.step == StepResult("step 2", None, True)


def test_faults_cost_their_timeout_and_are_counted():
    """A step that hangs, raises, returns garbage, NaN or 100k characters: an outcome each, the
    run goes on, the faults are counted (one worker process, 0.5 s per step)."""
    runner = EnvRunner(EnvSpec.of(f"{FX}:Faulty"), workers=1, timeout=0.5)
    try:
        out = runner.step(calls("hang", "raise", "garbage", "nan", "huge", "fine"))
    finally:
        runner.close()
    whys = [why for _, why in out]
    assert "timed out after 0.5 s" in whys[0]
    assert whys[1] == "raised RuntimeError: tool broke"
    assert "not (observation, reward, done)" in whys[2] and "reward returned nan" in whys[3]
    huge, fine = out[4][0].step, out[5][0].step
    assert whys[4] is None and len(huge.observation) == MAX_OBSERVATION_CHARS + len(TRUNCATION_MARKER)
    assert fine == StepResult("ok fine", 1.0, True)
    assert dict(runner.stats) == {"env_steps": 6, "env_step_errors": 4, "env_step_timeouts": 1}


def test_single_turn_wrapper_scores_as_the_reward_function():
    spec = "puzzle.reward_functions.builtin:answer_prefix"
    samples = [Sample(i, "3+4=", r, [1, 2], list(r.encode()), {"answer": "7"}) for i, r in enumerate(["7", "8", "71"])]
    direct = RewardScorer(load_reward_fn(spec)).score(samples)
    wrapped = SingleTurnEpisodes(EnvRunner(EnvSpec.of("single_turn", spec))).score(samples)
    assert wrapped == direct == [(1.0, None), (0.0, None), (1.0, None)]
    no_answer = [Sample(0, "p", "7", [1], [55], {})]
    (value, why), = SingleTurnEpisodes(EnvRunner(EnvSpec.of("single_turn", spec))).score(no_answer)
    assert value is None and "no 'answer' field" in why


def test_episodes_decode_turns_step_them_and_encode_capped_observations():
    from puzzle.data.tokenizers import ByteTokenizer
    from puzzle.dataflow.env_turns import EpisodeTurns
    from puzzle.reward_functions.env_runner import error_observation
    from puzzle.reward_functions.environments import check_turn_setup

    tok = ByteTokenizer()
    runner = EnvRunner(EnvSpec.of(f"{FX}:Shouty"))
    ep = EpisodeTurns(runner, tok, [tok.encode("p0"), tok.encode("p1"), tok.encode("p2")], [{}, {}, {}], 3, 20,
                      [tok.encode(";")])
    obs = ep.step([0, 1, 2], [tok.encode(t) for t in ("long;", "boom;", "hm;")], [[], [], []], [False] * 3)
    assert obs[0] == tok.encode("y" * 6 + TRUNCATION_MARKER)  # 20 tokens, the marker last
    assert tok.decode(obs[1]) == error_observation("raised RuntimeError: boom")[:20 - 14] + TRUNCATION_MARKER
    assert obs[2] == tok.encode("fine")
    assert ep.step([0, 1], [tok.encode("end;") + [tok.eos_id], tok.encode("boom")], [obs[0], obs[1]],
                   [False, True]) == [None, obs[1]]
    assert ep.scores() == [(1.25, None), (None, "raised RuntimeError: boom"), (0.0, None)]
    assert ep.counts == {"tool_calls": 3, "observations_truncated": 3}
    assert dict(runner.stats) == {"env_steps": 5, "env_step_errors": 2, "env_step_timeouts": 0}
    with pytest.raises(ValueError, match="declares no turn_stops"):
        check_turn_setup(EnvSpec.of(f"{FX}:Faulty"), 2, 64, tok)
    with pytest.raises(ValueError, match="--max-observation-tokens 5: below the 14 tokens"):
        check_turn_setup(EnvSpec.of("calculator"), 2, 5, tok)
    check_turn_setup(EnvSpec.of(f"{FX}:Faulty"), 1, 5, tok)  # one turn: nothing to check
