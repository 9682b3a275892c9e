"""Bring your own prompts: one JSON object per line.

    {"prompt": "How many ...?", "answer": "42"}                      # math (also "question" for "prompt")
    {"question": "...", "answer": "Natalia sold ... #### 72"}        # GSM8K style: the answer after ####
    {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"]}  # code (see rewards.code_reward)

An optional "id" names the problem (default: its line number). The test split is a fixed 10% of
the lines chosen by a hash of their content (data/split.py), so train and test never overlap.
"""

import json

from data.split import in_split


class DataError(ValueError):
    """A malformed line in a user's JSONL file; the message names the file and line."""


def _parse_line(path, lineno, line):
    where = f"{path}, line {lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object like {{\"prompt\": ..., \"answer\": ...}}")
    prompt = rec.get("prompt", rec.get("question"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: needs a non-empty string \"prompt\" (or \"question\")")
    if "tests" in rec:
        tests = rec["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, (str, dict)) for t in tests):
            raise DataError(f"{where}: \"tests\" must be a non-empty list of assert strings or "
                            "{call, expected} objects")
        return {"task": "code", "prompt": prompt, "tests": tests, "id": str(rec.get("id", lineno))}
    answer = rec.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(f"{where}: needs an \"answer\" (a string or number) or a \"tests\" list")
    answer = answer.split("####")[-1].strip()  # GSM8K keeps the final answer after ####
    return {"task": "math", "prompt": prompt, "answer": answer, "id": str(rec.get("id", lineno))}


def load_jsonl(path, split):
    """All problems of `split` in the file; raises DataError naming the first malformed line."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                problem = _parse_line(path, lineno, line)
                if in_split(f"jsonl:{line.strip()}", split):
                    out.append(problem)
    if not out:
        raise DataError(f"{path}: no {split} problems (the test split is ~10% of lines; add more lines)")
    return out
