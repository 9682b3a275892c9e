# A TOOLS task: SmolLM2-135M-Instruct calls a plain Python function through its chat template.
#   python grpo.py --config config/multiply_call.py
# tasks/multiply_call.py: multiply(a, b) is the tool; config/tools_chatml.jinja lists it for
# SmolLM2 (its own template renders no tools), Hermes-style; vLLM's hermes parser reads the calls.
task = "multiply_call"
chat_template = "config/tools_chatml.jinja"
out_dir = "out/multiply_call"
max_steps = 20
eval_every = 5

max_turns = 2  # the call, then the answer after its result
max_prompt_len = 512  # the tool's schema and the worked exchange
max_completion_len = 96  # the model's and the tool's tokens: the call, its result, the answer
group_size = 8
batch_size = 64  # 8 prompts x 8
unparsed_penalty = 0.0  # the reward is correctness alone
test_size = 30
eval_n = 2
