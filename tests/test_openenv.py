"""Environments served by OpenEnv servers (episodes/openenv.py), through openenv-core's own client
and server classes: real servers on localhost.   pytest tests/test_openenv.py"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("openenv.core", reason="openenv-core is not installed")

from config import ConfigError, load_config  # noqa: E402
from episodes.openenv import Server  # noqa: E402
from episodes.task import load_task  # noqa: E402
from episodes.turns import EpisodeEngine, start, step  # noqa: E402
from rollout import Completion  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a server that answers each step after 3 seconds: slow past a short tool_timeout
SLOW = """
import sys, time, uvicorn
from episodes import guess_server

class Slow(guess_server.GuessEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        time.sleep(3)
        return super().step(action)

uvicorn.run(guess_server.create_app(Slow, guess_server.Guess, guess_server.Said,
            max_concurrent_envs=4), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""

# a server whose /schema is the game's but whose WebSocket answers what is not OpenEnv's protocol
GARBAGE = """
import sys, uvicorn
from fastapi import FastAPI, WebSocket
from episodes import guess_server

app = FastAPI()

@app.get("/schema")
def schema():
    return {"action": guess_server.Guess.model_json_schema(),
            "observation": guess_server.Said.model_json_schema()}

@app.websocket("/ws")
async def ws(socket: WebSocket):
    await socket.accept()
    await socket.receive_text()  # reset: answered as OpenEnv's protocol does
    await socket.send_text('{"type": "observation", "data": {"observation": {"message": "Go."}, '
                           '"reward": null, "done": false}}')
    while True:
        await socket.receive_text()
        await socket.send_text("<html>502 Bad Gateway</html>")

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*command):
    """A server process on a free port, once it answers: (process, its url)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, *command, str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/schema", timeout=1)
            return process, url
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the server {command} exited") from None
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server {command} did not start")


@pytest.fixture(scope="module")
def guess():
    """The example server of the guessing game, 4 sessions at once."""
    process, url = serve("-m", "episodes.guess_server", "--sessions", "4", "--port")
    yield url
    process.kill()


@pytest.fixture()
def other():
    """A server of the test's own: SLOW or GARBAGE."""
    processes = []

    def start_server(code):
        process, url = serve("-c", code)
        processes.append(process)
        return url
    yield start_server
    for process in processes:
        process.kill()


def play(server, problem, guesses):
    """One episode through the turn loop's own start/step: (row, the steps' answers)."""
    row = Completion([], [], "", [], False, env_rewards={})
    env = start(row, server, problem, 5.0)
    said = []
    for g in guesses:
        said.append(step(row, env, g, 5.0, "sum"))
        if said[-1][1]:  # done
            break
    env.close()
    return row, said


def test_the_server_is_asked_its_schema_and_sessions_and_an_episode_plays_as_it_scores(guess):
    server = Server(guess, sessions=8, group_size=2, timeout=5.0)
    assert (server.action, server.observation, server.sessions) == ("message", "message", 4)
    import random

    secret = random.Random(7).randint(1, 8)  # the server's own draw from the seed
    low = 1 if secret != 1 else 2
    row, said = play(server, {"seed": 7}, [str(low), "x", str(secret), "5"])
    # a miss 0.1, a malformed guess 0, the find 1 + 0.1 for the one guess it did not need
    assert said[-1] == ("", True) and len(said) == 3  # the game says nothing once it is over
    assert row.env_rewards == {"env": pytest.approx(0.1 + 0 + 1.1)}
    assert said[0][0] == ("Higher." if secret > low else "Lower.")
    # each session its own game: the same seed, the same secret, in two sessions at once
    a, b = server({"seed": 7}), server({"seed": 7})
    assert a.reset() == b.reset()
    assert a.step(str(secret))[1:] == b.step(str(secret))[1:] == (pytest.approx(1.3), True)
    a.close()
    b.close()


def test_the_task_sums_the_servers_rewards_and_counts_the_solved(guess):
    cfg = load_config(overrides=["--task=openenv", f"--env_url={guess}", "--group_size=2",
                                 "--batch_size=4"])
    task = load_task(cfg)
    assert task.environment.sessions == 4 and task.weights == {"correct": 0.0}
    import random

    secret = random.Random(11).randint(1, 8)
    row, _ = play(task.environment, {"id": "a", "seed": 11}, [str(secret)])
    assert row.env_rewards == {"env": pytest.approx(1.3), "correct": 1.0}
    wrong = secret % 8 + 1
    row, _ = play(task.environment, {"id": "a", "seed": 11}, [str(wrong)] * 3)
    assert row.env_rewards["correct"] == 0.0


class Seeded:
    """An engine whose every row guesses 1 + seed % 8; records how many rows each call had."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, n, *, seeds, max_tokens, **_):
        self.calls.append(len(prompts))
        out = []
        for p, seed in zip(prompts, seeds):
            ids = self.tokenizer.encode(str(1 + seed % 8), add_special_tokens=False)
            out.append([Completion(list(p), ids, "", [-0.5] * len(ids), False)])
        return out


def test_a_batch_past_the_servers_sessions_runs_in_chunks_as_one_call_would(guess, tmp_path):
    from transformers import AutoTokenizer

    from model import build_tiny

    tokenizer = AutoTokenizer.from_pretrained(build_tiny(str(tmp_path / "tiny")))
    roomy, url = serve("-m", "episodes.guess_server", "--sessions", "16", "--port")
    problems = [{"id": str(i), "seed": i} for i in range(5)]
    runs = {}
    for at, sessions in ((guess, 4), (url, 10)):  # 10 rows: in chunks of 4, and at once
        cfg = load_config(overrides=["--task=openenv", f"--env_url={at}", "--group_size=2",
                                     "--batch_size=10"])
        task = load_task(cfg)
        assert task.environment.sessions == sessions
        engine = Seeded(tokenizer)
        groups = EpisodeEngine(engine, tokenizer, max_turns=3).generate(
            [[1, 2]] * 5, 2, seeds=list(range(10)), max_tokens=20, task=task,
            problems=problems, temperature=1.0)
        runs[sessions] = [(c.text, c.env_rewards) for g in groups for c in g]
        assert max(engine.calls) <= sessions
    roomy.kill()
    assert runs[4] == runs[10] and len(runs[4]) == 10
    assert all(set(r) == {"env", "correct"} for _, r in runs[4])


def test_two_tiny_steps_through_the_server(guess, tmp_path):
    import grpo

    grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), "--task=openenv",
               f"--env_url={guess}", "--engine=hf", "--max_steps=2", "--eval_every=0",
               "--group_size=2", "--batch_size=8", "--max_turns=2", "--max_completion_len=16",
               "--max_prompt_len=128", f"--out_dir={tmp_path / 'run'}"])
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    assert len(metrics) == 2
    assert all(m["reward/errors"] == 0 and "reward/env" in m for m in metrics)


def test_a_server_down_at_start_fails_before_a_model_loads(tmp_path):
    import grpo

    with pytest.raises(ConfigError, match="no OpenEnv server answers at"):
        grpo.main(["--config", os.path.join(ROOT, "config", "tiny.py"), "--task=openenv",
                   f"--env_url=http://127.0.0.1:{free_port()}", f"--out_dir={tmp_path / 'run'}"])
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_a_server_with_fewer_sessions_than_a_group_fails_at_start(guess):
    with pytest.raises(ConfigError, match="takes 4 sessions at once, fewer than group_size=8"):
        Server(guess, sessions=16, group_size=8)


@pytest.mark.parametrize("code, why", [(SLOW, "did not answer within"),
                                       (GARBAGE, "Expecting value")], ids=["slow", "garbage"])
def test_a_slow_or_garbled_server_ends_the_episode_as_a_counted_failure(other, code, why,
                                                                       capsys):
    import episodes.turns as turns

    server = Server(other(code), sessions=2, group_size=1, timeout=1.0)
    turns.REPORTED.discard("error")  # the first failure of a kind is printed
    row, _ = play(server, {"seed": 1}, ["4"])
    assert row.env_rewards == "error" and row.tool_errors == 1
    assert why in capsys.readouterr().err


def test_a_server_that_goes_down_mid_episode_ends_it_as_a_counted_failure():
    process, url = serve("-m", "episodes.guess_server", "--sessions", "2", "--port")
    try:
        server = Server(url, sessions=2, group_size=1, timeout=2.0)
        row = Completion([], [], "", [], False, env_rewards={})
        env = start(row, server, {"seed": 1}, 2.0)
        process.kill()
        process.wait()
        assert step(row, env, "4", 2.0, "sum") == (None, True)
        assert row.env_rewards == "error" and row.tool_errors == 1
    finally:
        process.kill()


def test_the_task_passes_the_audit_against_its_server(guess, capsys):
    from run.audit import audit

    assert audit("openenv", [f"--env_url={guess}", "--group_size=2", "--batch_size=4"]) == 0
    assert "environment turns; 0 failures: PASS" in capsys.readouterr().out
