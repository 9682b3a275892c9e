# A tiny randomly initialised model on a trivially learnable task: the smoke-test run.
#   python grpo.py --config config/tiny.py
# CPU, a few steps in well under a minute; the numbers mean nothing beyond "the loop runs".
model = "tiny"
task = "digits"  # the share of digits in the completion: a reward a random model can climb
out_dir = "out/tiny"
max_steps = 8

group_size = 4
batch_size = 16
max_prompt_len = 64
max_completion_len = 32
micro_batch_tokens = 384

lr = 1e-3
warmup_steps = 2
dtype = "float32"
