# Qwen2.5-3B-Instruct on the Countdown game (D1) with GRPO and LoRA, on one 24 GB GPU
# (RTX 3090/4090, A10, L4). Not yet run: pre-flight's estimate is what sized it (python -m
# infra.preflight --config config/countdown_3b_24gb.py --device_memory_gb=24), so treat it as a
# starting point.
#   python grpo.py --config config/countdown_3b_24gb.py
# Pre-flight for 24 GiB: update peak ~20.1 GiB; vLLM's share 8.4 + the trainer's resident 12.2.
# LoRA (rank 32 on every linear layer) keeps AdamW's moments and the gradients small; the frozen
# fp32 base weights (11.7 GiB) are the reference too (adapters off), so there is no second model.
# What to expect, from the full fine-tuning recipe this follows (config/countdown_3b.py): the reward
# climbs within ~100 steps as the answer format is learned, then accuracy rises slowly; LoRA at this
# lr usually learns the format as fast and the accuracy more slowly than full fine-tuning.
model = "Qwen/Qwen2.5-3B-Instruct"
out_dir = "out/countdown_3b_24gb"
max_steps = 300
save_every = 50
eval_every = 25

task = "countdown"  # D1: 3-4 numbers in 1..99, targets in 1..100
train_size = 10000
test_size = 200
unparsed_penalty = 0.0  # W2: the format component alone rewards the layout here

group_size = 8  # R3
batch_size = 128  # 16 prompts x 8 completions per optimizer step
max_prompt_len = 256
max_completion_len = 1024
micro_batch_tokens = 8192  # O3
fused_logprobs = True  # L6: no (B, T, V) logits; at a 152k vocabulary they would not fit here

temperature = 1.0  # R4
# R1: vLLM's bf16 weights (~6 GB) and its KV cache; asleep during the update
gpu_memory_utilization = 0.35

lora_rank = 32  # O5
lora_alpha = 64  # O5: scale 2
beta = 0.001  # L4: the reference is the base model with the adapters off
lr = 1e-5  # O1: LoRA takes ~10x full fine-tuning's lr
warmup_steps = 20  # O1
grad_clip = 1.0  # O2
dtype = "bfloat16"  # O5
gradient_checkpointing = True  # O5
