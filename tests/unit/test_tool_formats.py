"""Chat families' tool-call formats (puzzle/reward_functions/tool_formats.py) with HF tokenizers
built here (no files are downloaded; the real Qwen/Llama templates are not available offline, so
these templates carry the markers of each family's template): the family read from the template,
any other template refused naming it, the observation wrapped in the family's tool response, and
token in, token out with a tokenizer whose detokenize/retokenize round trip is not the identity.
Also the byte calculator of the tiny tool run and the samples log's turns."""

import pytest
import torch

from puzzle.data.tokenizers import ByteTokenizer, HFTokenizer
from puzzle.dataflow.env_turns import EpisodeTurns, response_turns
from puzzle.reward_functions.env_runner import EnvRunner
from puzzle.reward_functions.environments import (ByteCalculator, Calculator, EnvSpec, StepResult, Turn,
                                                   check_turn_setup, turn_stop_strings)
from puzzle.reward_functions.tool_formats import LLAMA31, QWEN, json_tool_call, tool_format_of
from puzzle.rollout.turns import TurnTracker

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
QWEN_TEMPLATE = ("{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
                 "\n</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
                 "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
                 "{# tools: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> #}")
LLAMA_TEMPLATE = ("{%- for m in messages %}{%- if m.role == 'ipython' or m.role == 'tool' %}<|start_header_id|>ipython"
                  "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- else %}<|start_header_id|>{{ m.role }}"
                  "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}")
PLAIN_TEMPLATE = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"


def hf_tokenizer(tmp_path, specials, template, eos, merges=(("c", "a"), ("ca", "l"))):
    """A byte-level BPE tokenizer with a few merges (so retokenizing decoded text can merge what
    was sampled apart), ``specials`` as added special tokens, ``template`` as its chat template."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos)
    tok.add_special_tokens({"additional_special_tokens": [s for s in specials if s != eos]})
    tok.chat_template = template
    tok.save_pretrained(str(tmp_path))
    return HFTokenizer(str(tmp_path))


def test_the_family_is_read_from_the_template_and_others_are_refused(tmp_path):
    qwen = hf_tokenizer(tmp_path / "q", QWEN_SPECIALS, QWEN_TEMPLATE, "<|im_end|>")
    llama = hf_tokenizer(tmp_path / "l", LLAMA_SPECIALS, LLAMA_TEMPLATE, "<|eot_id|>")
    assert tool_format_of(qwen) is QWEN and tool_format_of(llama) is LLAMA31
    plain = hf_tokenizer(tmp_path / "m", ["</s>"], PLAIN_TEMPLATE, "</s>")
    with pytest.raises(ValueError, match=r"--max-turns with --apply-chat-template: the chat template of .*m "
                                         r"\('\{% for m in messages %\}\[INST\].*has no tool-call format"):
        tool_format_of(plain)
    with pytest.raises(ValueError, match="ByteLevelTokenizer .no HF chat template.* has no tool-call format"):
        check_turn_setup(EnvSpec.of("calculator"), 2, 64, ByteTokenizer(), chat_template=True)
    check_turn_setup(EnvSpec.of("calculator"), 2, 64, qwen, chat_template=True)
    assert turn_stop_strings(EnvSpec.of("calculator"), QWEN) == ["</tool_call>"]
    assert turn_stop_strings(EnvSpec.of("calculator")) == ["</calc>"]


def test_the_calculator_answers_the_families_json_calls():
    assert json_tool_call('x <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>') \
        == ("calculator", {"expression": "2+3"})
    assert json_tool_call('<|python_tag|>{"name": "calculator", "parameters": {"expression": "7*6"}}<|eom_id|>') \
        == ("calculator", {"expression": "7*6"})
    assert json_tool_call("<tool_call>not json</tool_call>") is None and json_tool_call("42") is None
    calc = Calculator()
    calc.reset({"answer": "5"})
    assert calc.step(Turn('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>', [])) \
        == StepResult("=5", None, False)
    assert calc.step(Turn('{"name": "calculator", "parameters": {"expression": "2*(1+2)"}}', [])).observation == "=6"
    wrong = calc.step(Turn('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', []))
    assert wrong.observation.startswith('=error: the tool is "calculator"') and not wrong.done
    assert calc.step(Turn("5", [])) == StepResult("", 1.0, True)


def run_rows(tracker, sampled, stop_ids):
    """Feed each row's sampled tokens (one call per step, every running row together) until all
    end at a stop id or the budget, pausing a row whose turn ended until its step's join, as the
    decode loop does."""
    rows = list(range(len(sampled)))
    ended, paused, clock = [False] * len(rows), set(), 0
    left = [list(s) for s in sampled]
    while not all(ended):
        live = [r for r in rows if not ended[r] and r not in paused]
        if live:
            tok = torch.tensor([left[r].pop(0) for r in live])
            tracker.record(live, tok)
            clock += 1
            finished = [t in stop_ids or len(tracker.tokens[r]) >= tracker.max_new for r, t in zip(live, tok.tolist())]
            for r, status in zip(live, tracker.end_turns(live, finished, clock)):
                ended[r] = status == "end"
                if status == "pause":
                    paused.add(r)
        else:
            clock = tracker.next_due()
        for r, _, goes_on in tracker.join(clock):
            paused.discard(r)
            ended[r] = not goes_on
    tracker.close()
    return [tracker.tokens[r] for r in rows]


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_token_in_token_out_with_the_familys_tool_response(tmp_path, family):
    """The sampled tokens spell the call with 'c', 'a', 'l' apart (a retokenization would merge
    them into 'cal'); the sequence keeps them as sampled, followed by the family's tool response
    holding the observation, then the model's next turn."""
    fmt, specials, template, eos = ((QWEN, QWEN_SPECIALS, QWEN_TEMPLATE, "<|im_end|>") if family == "qwen" else
                                    (LLAMA31, LLAMA_SPECIALS, LLAMA_TEMPLATE, "<|eot_id|>"))
    tok = hf_tokenizer(tmp_path, specials, template, eos)
    assert tool_format_of(tok) is fmt
    ids = lambda text: tok.encode(text)  # noqa: E731
    name = [i for ch in "calculator" for i in ids(ch)]  # one token per character, as sampled
    if family == "qwen":
        call = ids("<tool_call>") + ids('{"name": "') + name + ids('", "arguments": {"expression": "12+30"}}') \
            + ids("</tool_call>")
    else:
        call = ids('{"name": "') + name + ids('", "parameters": {"expression": "12+30"}}') + ids("<|eom_id|>")
    answer = ids("42") + [tok.eos_id]
    stops = [ids(s) for s in turn_stop_strings(EnvSpec.of("calculator"), fmt)]
    episodes = EpisodeTurns(EnvRunner(EnvSpec.of("calculator")), tok, [ids("q")], [{"answer": "42"}], 2, 16, stops, fmt)
    tracker = TurnTracker(type("H", (), {"stops": stops, "max_turns": 2, "step": episodes.step})(), 1, 200)
    observation = ids(fmt.response_open) + ids("=42") + ids(fmt.response_close)
    stop_ids = set(tok.eos_ids) - {s[0] for s in stops if len(s) == 1}  # Llama's <|eom_id|> continues
    out, = run_rows(tracker, [call + answer], stop_ids)
    assert out == call + observation + answer  # the trained sequence: sampled tokens + inserted ones
    assert tracker.observation_mask[0, :len(out)].tolist() == [False] * len(call) + [True] * len(observation) \
        + [False] * len(answer)
    assert tok.encode(tok.decode(out, skip_special_tokens=False)) != out  # the round trip would have changed it
    assert episodes.scores() == [(1.0, None)] and episodes.counts["tool_calls"] == 1
    text = tok.decode(out, skip_special_tokens=False)
    assert ("<tool_response>\n=42\n</tool_response>" if family == "qwen" else "ipython<|end_header_id|>\n\n=42<|eot_id|>") \
        in text


def test_the_byte_calculator_credits_a_call_then_the_answer():
    def episode(*turns):
        calc = ByteCalculator()
        calc.reset({"answer": "176"})
        return [calc.step(Turn(text, [], i, context)) for i, (text, context) in enumerate(turns)]

    call = ("]", "88+88=[88+88")
    assert episode(call, ("176", "88+88=[88+88]=176")) == [StepResult("=176", None, False), StepResult("", 1.0, True)]
    shaped = episode(call, ("17x", "88+88=[88+88]=176"))[1].reward
    assert shaped == pytest.approx(0.1 + (0.1 + 0.4) * 2 / 3)  # the call, 2 of 3 digits, a prefix of 2
    assert episode(("17x", "88+88=[88+88"))[0] == StepResult("", 0.0, True)  # no call: no shaping credit
    assert episode(("176", "88+88=[88+88"))[0] == StepResult("", 1.0, True)  # a right answer counts anyway
    assert episode(("x]", "88+88=[88+88"))[0].observation.startswith("=error")


def test_the_byte_calculator_answers_the_bundled_last_digit_task():
    calc = ByteCalculator()
    calc.reset({"prompt": "85*91%10=[85*91", "answer": "5"})
    assert calc.step(Turn("]", [], 0, "85*91%10=[85*91")) == StepResult("=7735", None, False)
    assert calc.step(Turn("5", [], 1, "85*91%10=[85*91]=7735")) == StepResult("", 1.0, True)
    calc.reset({"prompt": "85*91%10=[85*91", "answer": "5"})
    calc.step(Turn("]", [], 0, "85*91%10=[85*91"))
    assert calc.step(Turn("7", [], 1, "85*91%10=[85*91]=7735")).reward == pytest.approx(0.1 + 0.1)  # call, a digit


def test_the_samples_log_shows_the_turns():
    from puzzle.dataflow.batch import RolloutBatch
    from puzzle.metrics import rollout_sample_rows

    tok = ByteTokenizer()
    prompt, response = tok.encode("1+2=[1+2"), tok.encode("]=3") + tok.encode("3") + [tok.eos_id]
    mask = torch.tensor([[1.0, 0, 0, 1, 1, 1]])
    batch = RolloutBatch(torch.tensor([prompt + response]), torch.tensor([len(prompt)]),
                         torch.tensor([len(response)]), 6, loss_mask=mask, scores=torch.tensor([1.1]))
    row, = rollout_sample_rows(batch, tok, 3, 1)
    assert row["turns"] == [{"model": "]"}, {"observation": "=3"}, {"model": "3"}]
    assert row["tool_calls"] == 1 and row["observation_tokens"] == 2 and row["response"] == "]=33"
    assert response_turns([5, 6], [True, True], tok) == [{"observation": "\x05\x06"}]


def test_the_bundled_tool_last_digits_are_their_generators_balanced_and_held_out_apart():
    import json
    from collections import Counter

    from puzzle.data.tool_last_digits import EVAL_PATH, EVAL_PER_DIGIT, PATH, TRAIN_PER_DIGIT, make_records

    train, held_out = make_records()
    assert [json.loads(line) for line in PATH.read_text().splitlines()] == train
    assert [json.loads(line) for line in EVAL_PATH.read_text().splitlines()] == held_out
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert Counter(r["answer"] for r in train) == {str(d): TRAIN_PER_DIGIT for d in range(10)}
    assert Counter(r["answer"] for r in held_out) == {str(d): EVAL_PER_DIGIT for d in range(10)}
    for r in train + held_out:
        question, call = r["prompt"].split("%10=[")
        a, b = map(int, call.split("*"))
        assert question == call and 10 <= a <= 99 and 10 <= b <= 99 and a * b >= 1000
        assert r["answer"] == str(a * b)[-1]
