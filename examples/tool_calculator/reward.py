"""The example's reward (``--custom-rm-path examples.tool_calculator.reward.final_answer_reward``): 1.0 when the
final assistant turn's answer equals the label, else 0.0. Nothing else is rewarded: not calling the tool, not the
format.

Only the last turn counts. The response holds every turn and every tool segment (the ``<tool_response>`` user
message and the next assistant header, decoded with special tokens skipped), so scoring the whole response would
pay a sample that calls the calculator and then writes nothing: the right number is in the tool's response. The
final turn is the text after the last ``</tool_response>`` minus the assistant header the chat template put
there; a final turn that still calls a tool (cut by ``--max-turns``) scores 0.
"""

from __future__ import annotations

import re

from miles_async.rollout.sample import Sample

_RESPONSE_END = "</tool_response>"
# What the template (ChatML) writes between the tool response and the model's next turn, with or without the
# special tokens left in the decoded text.
_HEADER = re.compile(r"^\s*(?:<\|im_end\|>)?\s*(?:<\|im_start\|>)?\s*assistant\s*\n")
_INTEGER = re.compile(r"-?\d+")


def final_turn(response: str) -> str:
    """The text of the response's last assistant turn (the whole response when no tool was called)."""
    if _RESPONSE_END not in response:
        return response
    return _HEADER.sub("", response.rsplit(_RESPONSE_END, 1)[1], count=1)


def final_answer(response: str) -> int | None:
    """The last integer of the final turn (thousands separators allowed), or None when the final turn has none
    or still calls a tool."""
    turn = final_turn(response)
    if "<tool_call>" in turn:
        return None
    found = _INTEGER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", turn))
    return int(found[-1]) if found else None


def final_answer_reward(sample: Sample) -> float:
    answer = final_answer(sample.response)
    return float(answer is not None and answer == int(str(sample.label).strip()))
