"""`reward.fn=math`: exact-match final answers of math solutions (GSM8K's `#### 42`, or `\\boxed{42}`)."""

import math
import re


def extract_answer(text: str) -> str | None:
    """The final answer in a solution: the content of the last `\\boxed{...}` (braces balanced), else the first line
    after the last `####` (GSM8K); None when there is neither (the last number in the text is not taken)."""
    start = text.rfind("\\boxed{")
    if start != -1:
        depth, i = 1, start + len("\\boxed{")
        begin = i
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[begin : i - 1].strip()
    marker = text.rfind("####")
    if marker != -1:
        rest = text[marker + 4 :].strip().splitlines()
        return rest[0].strip() if rest else None
    return None


def _normalize(answer: str) -> str:
    answer = re.sub(r"\\text\{([^}]*)\}", r"\1", answer)
    answer = answer.replace("\\$", "").replace("$", "").replace(",", "").replace("\\!", "").strip()
    return answer.rstrip(".").strip()


def equivalent(predicted: str, reference: str) -> bool:
    """Same answer: numerically when both are numbers (1,000 = 1000.0), else as normalized text."""
    a, b = _normalize(predicted), _normalize(reference)
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return a.replace(" ", "") == b.replace(" ", "")


def math_exact(prompt: str, response: str, answer: str) -> float:
    """1 if the response's final answer (`extract_answer`: the last `\\boxed{}`, else the line after the last `####`)
    equals the reference's (the same extraction, else the whole reference) after normalising $, commas, \\text{} and a
    final period, numerically when both are numbers; else 0."""
    predicted = extract_answer(response)
    reference = extract_answer(answer) or answer
    return float(predicted is not None and equivalent(predicted, reference))
