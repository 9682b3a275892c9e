"""An OpenEnv server of the guessing game, tasks/guess.py's own Game, written with OpenEnv's server
classes as an environment of the OpenEnv hub is: an Action, an Observation, an Environment, and
create_app serving them over HTTP and WebSocket. Needs openenv-core (episodes/openenv.py).

    python -m episodes.guess_server --port 8000 --sessions 64 &
    python grpo.py --task=openenv --env_url=http://localhost:8000 --max_turns=3

reset(seed) picks the secret from the seed (every row of a problem plays the same game) and says
tasks/guess.py's prompt; each step plays one guess on its Game, whose named rewards OpenEnv's one
reward sums (weights 1, as the task's): a find sums to 1.3 over the episode, as in-process.
"""

import argparse
import random

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from config import task_path
from episodes.task import import_file

GUESS = import_file(task_path("guess"))  # the task file's game, not a copy of its rules


class Guess(Action):
    message: str  # the model's turn, as text


class Said(Observation):
    message: str = ""  # what the game says back ("" once it is over)


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance, nothing shared

    def __init__(self):
        super().__init__()
        self.game, self._state = GUESS.Game(GUESS.LOW), State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.game = GUESS.Game(random.Random(seed).randint(GUESS.LOW, GUESS.HIGH))
        self.game.reset()
        self._state = State(episode_id=episode_id, step_count=0)
        [question] = GUESS.prompt({})
        return Said(message=question["content"], reward=None, done=False)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        said, rewards, done = self.game.step(action.message)
        return Said(message=said or "", reward=sum(rewards.values()), done=done)

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
