# A tiny randomly initialised model on a trivially learnable task: the smoke-test run.
#   python grpo.py --config config/tiny.py
# CPU, about 25 s with vLLM (most of it engine start-up): the share of digits climbs from ~0.07 to
# ~1.0 within 20 steps, the whole learning signal a random 2-layer model can show.
model = "tiny"
task = "digits"  # the share of digits in the completion: a reward a random model can climb
out_dir = "out/tiny"
max_steps = 20

group_size = 4
batch_size = 16
max_prompt_len = 64
max_completion_len = 32
micro_batch_tokens = 384

lr = 2e-2  # a random 2-layer model takes a far larger step than a pretrained one
warmup_steps = 2
dtype = "float32"
unparsed_penalty = 0.0  # the digits reward alone
