"""The recipe's reward: 1 if the last number in the response is the sum, else 0 (the model may show its working)."""

import re


def last_number(prompt, response, answer):
    numbers = re.findall(r"-?\d+", response.replace(",", ""))
    return float(bool(numbers) and numbers[-1] == answer)
