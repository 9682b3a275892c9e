# An environment as a tool: SmolLM2-135M-Instruct multiplies 2-digit numbers with a calculator it
# writes to (tasks/calculator.py).
#   python grpo.py --config config/calculator.py
# CPU, about 6 minutes. A turn "calc: 37 * 58" gets "= 2146" back as the next user message
# (context: not trained on); a turn "answer: 2146" ends the episode (episodes.turns.EpisodeEngine).
task = "calculator"
out_dir = "out/calculator"
max_steps = 20
max_turns = 3
max_completion_len = 96  # the model's turns and the environment's together

group_size = 8
batch_size = 32  # 4 prompts x 8, so a CPU step stays near a minute
temperature = 0.7
unparsed_penalty = 0.0  # the reward is the environment's alone
test_size = 30
eval_n = 2
