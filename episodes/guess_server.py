"""An OpenEnv server of the guessing game (tasks/guess.py's), written with OpenEnv's own server
classes as an environment of the OpenEnv hub is: an Action, an Observation, an Environment, and
create_app serving them over HTTP and WebSocket. Needs openenv-core (episodes/openenv.py).

    python -m episodes.guess_server --port 8000 --sessions 64 &
    python grpo.py --task=openenv --env_url=http://localhost:8000 --max_turns=3

reset(seed) picks the secret from the seed (every row of a problem plays the same game); each step
takes a guess and answers "Higher." / "Lower."; the reward is the step's: 0.1 for a well-formed
guess, 1 plus 0.1 for each guess not needed when it finds the number (the episode's sum is 1.3 for
any find, as tasks/guess.py pays).
"""

import argparse
import random
import re

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, GUESSES = 1, 8, 3


class Guess(Action):
    message: str  # the model's turn, as text


class Said(Observation):
    message: str = ""  # what the game says back


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance, nothing shared

    def __init__(self):
        super().__init__()
        self.secret, self.left, self._state = LOW, GUESSES, State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.secret = random.Random(seed).randint(LOW, HIGH)
        self.left, self._state = GUESSES, State(episode_id=episode_id, step_count=0)
        return Said(message=f"I am thinking of a whole number from {LOW} to {HIGH}. Guess it: "
                            "reply with one number only. After each guess I will tell you if my "
                            "number is higher or lower.", reward=None, done=False)

    def step(self, action, timeout_s=None, **kwargs):
        self.left -= 1
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        guess = int(numbers[0]) if len(numbers) == 1 and len(numbers[0]) <= 10 else None
        if guess is None or not LOW <= guess <= HIGH:
            return Said(message=f"Reply with one number from {LOW} to {HIGH}.", reward=0.0,
                        done=self.left == 0)
        if guess == self.secret:
            return Said(message="Right.", reward=1.0 + 0.1 * (self.left + 1), done=True)
        return Said(message="Higher." if self.secret > guess else "Lower.", reward=0.1,
                    done=self.left == 0)

    @property
    def state(self):
        return self._state


def app(sessions=64):
    return create_app(GuessEnvironment, Guess, Said, env_name="guess",
                      max_concurrent_envs=sessions)


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--sessions", type=int, default=64, help="max_concurrent_envs")
    args = parser.parse_args()
    uvicorn.run(app(args.sessions), host="127.0.0.1", port=args.port, log_level="warning")
