"""Which prompts go into each step: shuffled epochs (D3), or a difficulty curriculum (D2).

Both samplers hand out prompt indices, are deterministic given their seed and history, and save
and restore their whole state through state_dict / load_state_dict (it goes in every checkpoint),
so a resumed run sees exactly the prompts it would have seen. The curriculum's history includes
each step's pass rates, which grpo.collect_rollouts gives it (update).
"""

import random


class PromptSampler:
    """D3: every prompt once per epoch, in an order shuffled from (seed, epoch)."""

    def __init__(self, num_prompts, seed):
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch, self.pos = 0, 0

    def sample(self, k, step=None):
        """The next k prompt indices (step: unused; the curriculum's ramp counts steps)."""
        out = []
        while len(out) < k:
            order = list(range(self.num_prompts))
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
            take = order[self.pos : self.pos + k - len(out)]
            out += take
            self.pos += len(take)
            if self.pos == self.num_prompts:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]


class CurriculumSampler:
    """D2: sample easy:medium:hard prompts 1:2:3 by their recent pass rate,
    the hard share ramped in.

    A prompt's pass rate is an exponential moving average of its groups' pass rates (weight `alpha`
    on the newest). easy: rate > easy_above; hard: rate < hard_below; medium otherwise, and a prompt
    never seen counts as medium. The hard weight grows linearly from 0 to its full value over
    `ramp_steps` training steps (common practice: jumping straight to mostly hard prompts
    destabilises training); a step's refills (R7) draw again at the same point of the ramp.
    """

    def __init__(self, num_prompts, seed, *, easy_above=0.8, hard_below=0.2, weights=(1, 2, 3),
                 ramp_steps=100, alpha=0.5):
        self.num_prompts, self.seed = num_prompts, seed
        self.easy_above, self.hard_below, self.weights = easy_above, hard_below, weights
        self.ramp_steps, self.alpha = ramp_steps, alpha
        self.pass_rate = {}  # prompt index -> EMA of its pass rate
        self.calls = 0

    def bucket(self, i):
        rate = self.pass_rate.get(i)
        if rate is None or self.hard_below <= rate <= self.easy_above:
            return 1  # medium
        return 0 if rate > self.easy_above else 2  # easy or hard

    def sample(self, k, step):
        """k distinct prompt indices (fewer only if there are fewer than k prompts in all) for
        training step `step`, which sets the hard share; every call draws afresh (a refill is
        another call, the same step)."""
        # deterministic from the seed and the history
        rng = random.Random(f"{self.seed}:{self.calls}")
        buckets = [[], [], []]
        for i in range(self.num_prompts):
            buckets[self.bucket(i)].append(i)
        ramp = min(1.0, step / self.ramp_steps) if self.ramp_steps else 1.0
        weights = [self.weights[0], self.weights[1], self.weights[2] * ramp]
        out = []
        for _ in range(min(k, self.num_prompts)):
            live = ([b for b in range(3) if buckets[b] and weights[b] > 0]
                    or [b for b in range(3) if buckets[b]])
            b = rng.choices(live, weights=[weights[b] or 1 for b in live])[0]
            out.append(buckets[b].pop(rng.randrange(len(buckets[b]))))
        self.calls += 1
        return out

    def update(self, ids, pass_rates):
        """Fold each prompt's newest group pass rate into its moving average."""
        for i, rate in zip(ids, pass_rates):
            old = self.pass_rate.get(i)
            self.pass_rate[i] = rate if old is None else self.alpha * rate + (1 - self.alpha) * old

    def state_dict(self):
        return {"calls": self.calls, "pass_rate": {str(i): r for i, r in self.pass_rate.items()}}

    def load_state_dict(self, state):
        self.calls = state["calls"]
        self.pass_rate = {int(i): r for i, r in state["pass_rate"].items()}


class MixtureSampler:
    """D4: a task mixture's prompts, each task's share of every batch by its weight.

    The problems are the tasks' one after another (sizes); each task has a sampler of its own over
    its problems (shuffled epochs or the curriculum, as above). Which task a prompt slot goes to is
    decided by quota, not by chance: the next slot goes to the task furthest below its share of
    the slots so far, (slots + 1) x weight / total - its count (ties: the first listed). So every
    prefix of the run holds each task to within one prompt of its weight (0.7/0.3, 8 prompts a
    step: 6 + 2, then 5 + 3, ...), and a resumed run, restoring the counts, draws the same prompts.
    """

    def __init__(self, samplers, sizes, weights):
        self.samplers, self.weights = samplers, [float(w) for w in weights]
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.counts = [0] * len(samplers)  # prompt slots each task has had

    def sample(self, k, step=None):
        """The next k prompt indices (into the tasks' problems one after another)."""
        total, picks = sum(self.weights), []
        for _ in range(k):
            slots = sum(self.counts) + 1
            deficit = [slots * w / total - c for w, c in zip(self.weights, self.counts)]
            part = deficit.index(max(deficit))
            self.counts[part] += 1
            picks.append(part)
        drawn = [iter(s.sample(picks.count(i), step)) for i, s in enumerate(self.samplers)]
        # a curriculum gives fewer than asked only when a task has fewer prompts than that
        return [self.starts[i] + j for i in picks for j in [next(drawn[i], None)] if j is not None]

    def update(self, ids, pass_rates):
        """The curriculum's (D2) pass rates, each to the sampler of its prompt's task."""
        for i, rate in zip(ids, pass_rates):
            part = max(p for p, start in enumerate(self.starts) if start <= i)
            self.samplers[part].update([i - self.starts[part]], [rate])

    def state_dict(self):
        return {"counts": list(self.counts), "parts": [s.state_dict() for s in self.samplers]}

    def load_state_dict(self, state):
        self.counts = list(state["counts"])
        for s, part in zip(self.samplers, state["parts"]):
            s.load_state_dict(part)
