"""The recipe's rewards: is the answer the sum? The model may show its working ("23 + 45 = 68")."""

import re


def last_number(prompt, response, answer):
    """1 if the last number in the response is the sum: how the benchmark grades greedy answers."""
    numbers = re.findall(r"-?\d+", response.replace(",", ""))
    return float(bool(numbers) and numbers[-1] == answer)


def number_at_end(prompt, response, answer):
    """1 if the response ends with the sum (a period or spaces after it allowed). Unlike `last_number`, text after the
    answer scores 0 — a response cut off at rollout.max_tokens ("68.\n\nThe answer is"), tokens that replace the end
    of the turn ("68 Worksheeton") — so the policy keeps ending its turn after the answer."""
    match = re.search(r"(-?\d+)\.?\s*$", response.replace(",", ""))
    return float(match is not None and match.group(1) == answer)
