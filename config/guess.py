# An environment over turns: SmolLM2-135M-Instruct plays a guessing game (tasks/guess.py).
#   python grpo.py --config config/guess.py
# CPU, about 17 minutes. Each model turn is a guess; the environment answers "Higher." or "Lower."
# as the next user message (context: not trained on), up to 3 guesses, all in 64 tokens
# (episodes.turns.EpisodeEngine). The default run's settings otherwise.
task = "guess"
out_dir = "out/guess"
max_turns = 3
