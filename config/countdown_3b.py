# Qwen2.5-3B-Instruct on the Countdown game (D1) with GRPO, on one 80 GB GPU.
#   python grpo.py --config config/countdown_3b.py
#   torchrun --nproc_per_node=8 grpo.py --config config/countdown_3b.py  # FSDP2, 4 prompts a GPU
# Settings follow ms-swift's GRPO Countdown recipe (G=8, beta=0.001, 1024-token completions, grad
# clip 1.0) with TinyZero's lr of 1e-6 (the recipe uses 5e-7). Expect the reward to climb within
# ~100 steps as the format is learned, then accuracy to rise slowly; the recipe reports 75% -> 95%
# test accuracy.
model = "Qwen/Qwen2.5-3B-Instruct"
out_dir = "out/countdown_3b"
max_steps = 300
save_every = 50
eval_every = 25

task = "countdown"  # D1: 3-4 numbers in 1..99, targets in 1..100
train_size = 10000
test_size = 200
unparsed_penalty = 0.0  # W2: the format component alone rewards the layout here

group_size = 8  # R3
batch_size = 256  # 32 prompts x 8 completions per optimizer step
max_prompt_len = 256
max_completion_len = 1024
micro_batch_tokens = 16384  # O3
# L6: no (B, T, V) logits; at a 152k vocabulary they and their gradient are ~10 GB here
fused_logprobs = True

temperature = 1.0  # R4
gpu_memory_utilization = 0.3  # R1: fp32 master weights + AdamW take ~48 GB beside it

beta = 0.001  # L4
lr = 1e-6  # O1
warmup_steps = 20  # O1
grad_clip = 1.0  # O2
dtype = "bfloat16"  # O5
gradient_checkpointing = True  # O5
