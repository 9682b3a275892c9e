"""Tool calls inside a rollout (tools=True): the model may run Python mid-completion.

    <python>print(347 * 862)</python>          the model's tokens: trained on (mask 1)
    <output>299114</output>                    the tool's output: context only (mask 0)
    The answer is 299114.                      the model's tokens again

ToolEngine wraps either engine (rollout.py) and runs the turns; the code runs in the sandbox
(sandbox.run_python). The trainer masks the tool's tokens out of the loss, the KL and the
token-mean (grpo.pad_batch reads Completion.mask).
"""

import time

import parallel
from rollout import Completion, derive_seed


def turn_seed(seed, turn):
    """The seed of a tool rollout's turn: the row's own seed on the first turn,
    then one per turn from it."""
    return seed if turn == 0 else derive_seed(seed, "turn", turn)


TOOL_OUTPUT = "\n<output>\n{}\n</output>\n"  # what goes back into the model's context after a call


class ToolEngine:
    """Multi-turn rollouts on any engine: a completion may call a tool,
    and only the model's tokens are its own.

    Each turn generates every unfinished completion in one batched call, stopping at the close tag
    ("</python>"); for each one that closed a call, the code between the open tag ("<python>") and
    the close runs (`run`: the sandbox), its output (TOOL_OUTPUT) is appended as tokens with mask 0,
    and the next turn goes on from there, up to max_calls calls and max_tokens tokens in all (the
    tool's included). An output that does not fit is cut inside its tags, which always close (or
    left out), and the completion ends there as truncated. Token ids are never re-tokenised from
    text: the trainer gets exactly the sampled ids and the output's ids, concatenated.
    """

    def __init__(self, engine, tokenizer, max_calls, run, tags=("<python>", "</python>")):
        self.engine, self.tokenizer, self.max_calls = engine, tokenizer, max_calls
        self.run = run  # code -> (output text, ok): sandbox.run_python, or a test's scripted tool
        self.open, self.close = tags

    def wake(self, named_tensors):
        self.engine.wake(named_tensors)

    def sleep(self):
        self.engine.sleep()

    def generate(self, prompts, n, *, seeds, max_tokens, stop=None, progress=False, **sampling):
        """The engines' generate, in turns: n completions per prompt, each a row of its own from the
        first turn (seeds: one per row, as the engines take them). stop: the task's strings, which
        end a row for good; the close tag is added in the turns that may call."""
        stop = list(stop or [])
        rows = [Completion(list(p), [], "", [], False, mask=[]) for p in prompts for _ in range(n)]
        live = list(range(len(rows)))
        for turn in range(self.max_calls + 1):
            # every rank decides alike: FSDP's HF engine generates in lockstep
            if parallel.all_max(len(live)) == 0:
                break
            # the context so far is the next turn's prompt; vLLM's prefix cache still holds its keys
            # and values from the turn before, so only the tool's output is prefilled anew
            outs = self.engine.generate(
                [rows[r].prompt_ids + rows[r].completion_ids for r in live], 1,
                # each turn its own draw, the same on a resume
                seeds=[turn_seed(seeds[r], turn) for r in live],
                max_tokens=[max_tokens - len(rows[r].completion_ids) for r in live],
                # the last turn may not call
                stop=[*stop, self.close] if turn < self.max_calls else stop or None,
                progress=progress, **sampling)
            calls = []
            for r, [out] in zip(live, outs):
                self._append(rows[r], out.completion_ids, out.logprobs, model=True)
                rows[r].truncated = out.truncated
                if out.stop_string == self.close:
                    text = self.tokenizer.decode(out.completion_ids, skip_special_tokens=True)
                    calls.append((r, text))
            for r, text in calls:
                self._call(rows[r], text, max_tokens, sampled=sampling["temperature"] > 0)
            live = [r for r, _ in calls if not rows[r].truncated]
        for row in rows:
            row.text = self.tokenizer.decode(row.completion_ids, skip_special_tokens=True)
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _call(self, row, text, max_tokens, sampled):
        """Run the call that ends `text`
        (the model's last turn) and append its output in the token budget."""
        start = time.perf_counter()
        opened = text.rfind(self.open)
        if opened < 0:  # a close without an open: nothing to run, and the model is told so
            output, ok = f"error: no {self.open} before {self.close}", False
        else:
            output, ok = self.run(text[opened + len(self.open) : text.rfind(self.close)])
        room = max_tokens - len(row.completion_ids)
        ids, cut = self._output_ids(output.strip(), room)
        self._append(row, ids, [0.0] * len(ids) if sampled else [], model=False)
        row.truncated = cut or len(ids) >= room  # no room left for the model to go on
        row.tool_calls += 1
        row.tool_errors += not ok
        row.tool_seconds += time.perf_counter() - start

    def _output_ids(self, output, room):
        """(ids, cut): TOOL_OUTPUT around `output` if it fits in `room` tokens; else around as much
        of the output as fits, or nothing when not even the empty frame does. Never an output
        without its closing tag: a reward reading the model's last number would read the tool's."""
        ids = self.tokenizer.encode(TOOL_OUTPUT.format(output), add_special_tokens=False)
        if len(ids) <= room:
            return ids, False
        content = self.tokenizer.encode(output, add_special_tokens=False)
        frame = len(self.tokenizer.encode(TOOL_OUTPUT.format(""), add_special_tokens=False))
        # tokens may merge across the cut: check
        for k in range(min(len(content), room - frame), -1, -1):
            text = self.tokenizer.decode(content[:k])
            ids = self.tokenizer.encode(TOOL_OUTPUT.format(text), add_special_tokens=False)
            if len(ids) <= room:
                return ids, True
        return [], True

    @staticmethod
    def _append(row, ids, logprobs, model):
        row.completion_ids += ids
        row.logprobs += logprobs
        row.mask += [int(model)] * len(ids)

