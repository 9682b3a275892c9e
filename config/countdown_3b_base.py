# Qwen2.5-3B (the base model, no instruction tuning) on Countdown, R1-Zero style, on one 80 GB GPU.
#   python grpo.py --config config/countdown_3b_base.py
#   torchrun --nproc_per_node=8 grpo.py --config config/countdown_3b_base.py   # 8 GPUs, FSDP2
# TinyZero's setup: its raw "A conversation between User and Assistant ..." template ending in
# "Assistant: Let me solve this step by step.\n<think>" (tasks/countdown_base.py, no chat template),
# Countdown with 3-4 numbers, lr 1e-6, KL 0.001 (low-variance k3), 1024-token answers, 256 prompts a
# step. TinyZero reports that the 3B base model learns the format, then develops self-verification
# and search on its own ("the aha moment"), while Qwen2.5-0.5B base fails to learn reasoning.
# TinyZero used PPO; this is GRPO with G = 8 in place of the critic, so expect its shape, not its
# exact curve.
model = "Qwen/Qwen2.5-3B"
out_dir = "out/countdown_3b_base"
max_steps = 300
save_every = 50
eval_every = 25

task = "countdown_base"  # D1: the instruct run's problems and reward, TinyZero's raw prompt
train_size = 10000
test_size = 200
unparsed_penalty = 0.0  # W2: TinyZero: 0 without an answer, 0.1 for a wrong one, 1 for a right one
# W2: with the format weight 0 below, a parsed but wrong equation scores 0.1, as TinyZero's
wrong_penalty = 0.1
reward_weights = "format:0"  # W2: TinyZero's reward has no separate layout term

group_size = 8  # R3
batch_size = 256  # 32 prompts x 8 completions per optimizer step
max_prompt_len = 256
max_completion_len = 1024
micro_batch_tokens = 16384  # O3
# L6: no (B, T, V) logits; at a 152k vocabulary they and their gradient are ~10 GB here
fused_logprobs = True

temperature = 1.0  # R4
gpu_memory_utilization = 0.3  # R1: fp32 master weights + AdamW take ~48 GB beside it

beta = 0.001  # L4: TinyZero's kl_coef, with the k3 estimator (verl's low_var_kl)
lr = 1e-6  # O1
warmup_steps = 20  # O1
grad_clip = 1.0  # O2
dtype = "bfloat16"  # O5
gradient_checkpointing = True  # O5
