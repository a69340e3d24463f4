"""The tool-call formats of the chat families puzzle imports, for multi-turn samples of prompts in
the tokenizer's chat template (``--apply-chat-template`` with ``--max-turns`` > 1).

A family's format says where the model's tool-calling turn ends (the turn stop) and how the
environment's observation is written into the sequence: the tokens that close the model's turn,
open the tool's, hold the observation, close it and open the model's next turn, exactly as the
family's chat template renders a tool message after an assistant's tool call:

- Qwen2.5 / Qwen3 (ChatML, Hermes-style tools): a call is ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``; its turn ends at ``</tool_call>``; the observation goes into a user turn
  as ``<tool_response>\\n...\\n</tool_response>``.
- Llama-3.1: a call is ``<|python_tag|>`` code or a JSON ``{"name": ..., "parameters": {...}}``,
  ended by ``<|eom_id|>`` (end of message: a tool answers next); the observation is an ``ipython``
  turn. ``<|eom_id|>`` is one of Llama-3.1-Instruct's stop ids: multi-turn rows continue there.

The family is read from the chat template itself (its tool markers); a template without one of
these formats is refused at start, naming the tokenizer and the template's opening.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ToolFormat:
    family: str
    call_end: str        # the string that ends a tool-calling turn (the turn stop)
    response_open: str   # closes the model's turn, opens the tool's, before the observation
    response_close: str  # after the observation: closes the tool's turn, opens the model's next

    def wrap(self, observation: str) -> str:
        return self.response_open + observation + self.response_close


QWEN = ToolFormat("Qwen2.5/Qwen3 (<tool_call> JSON, <tool_response> in a user turn)", "</tool_call>",
                  "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                  "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
LLAMA31 = ToolFormat("Llama-3.1 (ipython role)", "<|eom_id|>",
                     "<|start_header_id|>ipython<|end_header_id|>\n\n",
                     "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
KNOWN = "Qwen2.5/Qwen3 (<tool_call>, <tool_response>) or Llama-3.1 (the ipython role)"


def chat_template_text(tokenizer) -> Optional[str]:
    """The tokenizer's chat template (an HF tokenizer's; the ``tool_use`` one of several), or None."""
    template = getattr(getattr(tokenizer, "tok", None), "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def template_name(tokenizer) -> str:
    """The tokenizer and its template's opening, for a message."""
    template = chat_template_text(tokenizer)
    where = getattr(tokenizer, "directory", None) or getattr(tokenizer, "name", type(tokenizer).__name__)
    if template is None:
        return f"the tokenizer {where} (no HF chat template: its plain 'role: content' lines)"
    opening = " ".join(template.split())[:60]
    return f"the chat template of {where} ({opening!r}...)"


def tool_format_of(tokenizer) -> ToolFormat:
    """The tool format of ``tokenizer``'s chat template; a ValueError names the template when it
    has none of the formats puzzle knows."""
    template = chat_template_text(tokenizer) or ""
    if "<tool_call>" in template and "<tool_response>" in template and "<|im_start|>" in template:
        return QWEN
    if "<|start_header_id|>" in template and "ipython" in template:
        return LLAMA31
    raise ValueError(f"--max-turns with --apply-chat-template: {template_name(tokenizer)} has no tool-call format "
                     f"puzzle knows ({KNOWN})")


def json_tool_call(text: str) -> Optional[tuple]:
    """``(name, arguments)`` of a family's JSON tool call at the end of a turn: Qwen's
    ``<tool_call>{...}</tool_call>`` or Llama-3.1's ``{"name": ..., "parameters": {...}}`` (after an
    optional ``<|python_tag|>``); None when the turn ends in no such call."""
    body = text.strip()
    if body.endswith(QWEN.call_end):
        start = body.rfind("<tool_call>")
        if start < 0:
            return None
        body = body[start + len("<tool_call>"):-len(QWEN.call_end)]
    else:
        for mark in (LLAMA31.call_end, "<|eot_id|>"):
            body = body[:-len(mark)].rstrip() if body.endswith(mark) else body
        body = body.split("<|python_tag|>")[-1]
        start = body.find("{")
        body = body[start:] if start >= 0 else ""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return (call["name"], args) if isinstance(args, dict) else None
