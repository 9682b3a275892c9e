# Tool calls inside a rollout:
# SmolLM2-135M-Instruct multiplies 3-digit by 2-digit numbers with a Python tool.
#   python grpo.py --config config/multiply_tools.py
# CPU, about 25 minutes. The model writes a ```python block, generation stops at its closing fence,
# the sandbox runs it, the output comes back as tokens the model does not train on
# (episodes/tools.py TextTools).
# tasks/multiply.py: the reward judges the number the model writes after the tool's output
task = "multiply"
out_dir = "out/multiply_tools"
max_steps = 20

tools = True
tool_tags = ("```python\n", "\n```\n")  # the format this small model writes; <python> it never does
max_tool_calls = 2
tool_output_chars = 200
max_completion_len = 96  # the model's tokens and the tool's together

group_size = 8
batch_size = 32  # 4 prompts x 8, so a CPU step stays near a minute
temperature = 0.7  # the temperature this run was measured at (docs/tools.md)
unparsed_penalty = 0.0  # the reward is correctness alone
test_size = 30
eval_n = 2
