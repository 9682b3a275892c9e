# Qwen2.5-3B-Instruct on GSM8K grade-school math with GRPO, on one 80 GB GPU.
#   python grpo.py --config config/gsm8k_3b.py                         # the hub's dataset (online)
#   python grpo.py --config config/gsm8k_3b.py --data_path=data/gsm8k  # a local parquet copy
# The task file is tasks/gsm8k.py: the question in a chat message, the answer judged against the
# number after "####" (7473 train, 1319 test problems, the dataset's own splits). Qwen reports 86.7
# on GSM8K for Qwen2.5-3B-Instruct, so the room is small: expect the layout to be learned first,
# then a few points of accuracy. Not yet run by us (no GPU here); the pipeline is tested on a local
# parquet copy.
model = "Qwen/Qwen2.5-3B-Instruct"
out_dir = "out/gsm8k_3b"
max_steps = 200
save_every = 50
eval_every = 25

task = "gsm8k"
data_path = "openai/gsm8k"  # D1: a hub name, or a local folder / parquet file
data_name = "main"  # the dataset's config ("main" or "socratic")
train_size = 7473  # all of the train split
test_size = 500  # eval on the first 500 of 1319 test problems (M2 runs greedy + 4 samples each)
unparsed_penalty = 0.0

group_size = 8  # R3
batch_size = 256  # 32 prompts x 8 completions per optimizer step
max_prompt_len = 512
max_completion_len = 768
micro_batch_tokens = 16384  # O3
# L6: no (B, T, V) logits; at a 152k vocabulary they and their gradient are ~10 GB here
fused_logprobs = True

temperature = 1.0  # R4
gpu_memory_utilization = 0.3  # R1

beta = 0.001  # L4
lr = 1e-6  # O1
warmup_steps = 20  # O1
grad_clip = 1.0  # O2
dtype = "bfloat16"  # O5
gradient_checkpointing = True  # O5
