"""Any environment an OpenEnv server serves, over its protocol and client (episodes/openenv.py).

    python -m episodes.guess_server --port 8000 &          # or any OpenEnv server
    python grpo.py --task=openenv --env_url=http://localhost:8000 --max_turns=3

A problem is a seed: reset(seed=...) opens every row of a problem on the same episode (a server
whose reset takes no seed gives each row its own). The prompt is the reset observation's text, as
the user's message. The reward is the server's, each step's summed over the episode (env_reward),
the component "env"; an episode that ends with a step's reward >= env_solved counts as solved
("correct": accuracy and pass@k; weight 0, so the server's reward alone pays). The model's text is
the action's text field, the observation's text field what it reads back: env_action and
env_observation name them where the server's schema has several.
"""

import random

from data.split import in_split
from episodes.openenv import Server

OPTIONS = {"env_url": "http://localhost:8000", "env_action": "", "env_observation": "",
           "env_solved": 1.0}
WEIGHTS = {"correct": 0.0}  # a count of the solved; the server's reward is the reward
environment = None  # the Server, made by configure() once the run's settings are known


def problems(split, n, seed):
    """n seeds; a seed's split follows from its key."""
    rng, out, i = random.Random(f"openenv:{split}:{seed}"), [], 0
    while len(out) < n:
        key = f"openenv:{seed}:{i}"
        if in_split(key, split):
            out.append({"id": key, "seed": rng.randrange(2**31)})
        i += 1
    return out


def prompt(problem):
    return [{"role": "user", "content": ""}]  # the reset observation's text ends it


def configure(cfg):
    """The server asked now, before any model loads: down, or too few sessions, fails here."""
    global environment
    options = cfg.task_options
    solved = float(options["env_solved"])

    def reward(value, done):
        return {"env": value, "correct": float(done and value >= solved)}

    environment = Server(options["env_url"], sessions=cfg.batch_size, group_size=cfg.group_size,
                         timeout=cfg.tool_timeout, action=options["env_action"],
                         observation=options["env_observation"], reward=reward)
