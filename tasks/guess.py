"""A guessing game, the environment's turn after each of the model's: find a number from 1 to 8.

    python grpo.py --task=guess --max_turns=3

Each turn the model writes a guess; the environment answers "Higher." or "Lower." (a user message
through the chat template, context only: no gradient) until the guess is right or the turns run
out. Each turn's reward is summed over the episode (env_reward="sum"; Game says how). Three guesses
find any number by halving (4, then 2 or 6, then the one left); guessing blind finds it 3 times in
8.
"""

import random
import re

from data.split import in_split

LOW, HIGH = 1, 8
GUESSES = 3  # the game's own horizon (max_turns may allow more turns)


def problems(split, n, seed):
    """n games, each its own secret; a game's id decides its split, its secret follows from it."""
    rng, out, i = random.Random(f"guess:{split}:{seed}"), [], 0
    while len(out) < n:
        key = f"guess:{seed}:{i}"
        if in_split(key, split):
            out.append({"id": key, "secret": rng.randint(LOW, HIGH)})
        i += 1
    return out


def prompt(problem):
    return [{"role": "user", "content": f"I am thinking of a whole number from {LOW} to {HIGH}. "
                                        "Guess it: reply with one number only. After each guess "
                                        "I will tell you if my number is higher or lower."}]


class Game:
    """One episode of GUESSES guesses at most: step() takes the model's turn, answers it, scores it.

    A guess that is one number in range earns valid 0.1, and finding the number earns correct 1
    plus the valid 0.1 of each guess it did not need: any find with well-formed guesses sums to
    1.3, three well-formed misses to 0.3, a ramble to 0. No turn costs anything, so running out the
    token budget in one long turn never pays (a penalty per bad turn would make it pay).
    """

    def __init__(self, secret):
        self.secret, self.left = secret, GUESSES

    def reset(self):
        self.left = GUESSES
        return None  # nothing to add to the prompt: the secret stays hidden

    def step(self, action):
        self.left -= 1
        numbers = re.findall(r"-?\d+", action)
        # a guess of more than 10 digits is out of range (and int() refuses over 4,300 digits)
        guess = int(numbers[0]) if len(numbers) == 1 and len(numbers[0]) <= 10 else None
        if guess is None or not LOW <= guess <= HIGH:
            said = f"Reply with one number from {LOW} to {HIGH}."
            return said, {"correct": 0.0, "valid": 0.0}, self.left == 0
        if guess == self.secret:
            return None, {"correct": 1.0, "valid": 0.1 * (self.left + 1)}, True
        said = "Higher." if self.secret > guess else "Lower."
        return said, {"correct": 0.0, "valid": 0.1}, self.left == 0


def environment(problem):
    return Game(problem["secret"])

