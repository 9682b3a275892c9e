"""Models: load the policy and its tokenizer, build the tiny test model, LoRA, and the weights to push.

The policy keeps fp32 master weights; compute runs in cfg.dtype under autocast (see grpo.py), so a
learning rate of 1e-6 is not rounded away as it would be in bf16 weights.
"""

import os

import torch

from config import SHAPES, ConfigError

TINY_CORPUS = [
    "Write only digits, like 4 2 7: 1 2 3 4 5 6 7 8 9 0 10 42 99",
    "Using the numbers [1, 2, 3], create an equation that equals 6. <think> 1 + 2 = 3 </think><answer>(1 + 2) * 3</answer>",
    "What is 12 + 30? <think> add </think><answer>\\boxed{42}</answer> user assistant system",
]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny(folder, seed=0):
    """A tiny Llama (2 layers, hidden 64, head_dim 32) and a byte-level BPE tokenizer trained here; cached."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=SHAPES["tiny"]["vocab_size"], special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TINY_CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    shape = {**SHAPES["tiny"], "vocab_size": len(tokenizer)}  # no rows the tokenizer cannot decode
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None))
    tmp = f"{folder}.tmp{os.getpid()}"  # written whole, then renamed: a killed build leaves no half model
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def model_path(cfg):
    """The folder (or hub name) the weights come from: the tiny model is built into out_dir once."""
    if cfg.model == "tiny":
        return build_tiny(os.path.join(cfg.out_dir, "tiny_model"), seed=cfg.seed)
    return cfg.model


def check_model_source(path):
    """Fail before any expensive work if a local-looking model path does not exist."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"model folder {path} has no config.json; point --model at a saved HF model")
    elif path.startswith((".", "/", "~")) or path.count("/") > 1:  # a path, not an org/name on the hub
        raise ConfigError(f"model folder {path} not found; set --model to a folder or a hub name like "
                                f"Qwen/Qwen2.5-3B-Instruct")


def load_policy(cfg, path, device, adapter=None):
    """(tokenizer, policy) in fp32 on `device`; LoRA-wrapped when cfg.lora_rank > 0 (O5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    if cfg.lora_rank:
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter:  # resuming: the trained adapter from a checkpoint
            policy = PeftModel.from_pretrained(policy, adapter, is_trainable=True)
        else:
            lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules="all-linear")
            policy = get_peft_model(policy, lora)
    return tokenizer, policy


def push_weights_iter(policy):
    """(name, tensor) pairs in the base model's names, as an inference engine loads them.

    A LoRA policy is merged for the copy and unmerged after; the caller consumes the iterator
    inside the merge. Tied embeddings: HF's state_dict lists lm_head.weight too, which vLLM needs.
    """
    if not hasattr(policy, "merge_adapter"):
        yield from policy.state_dict().items()
        return
    policy.merge_adapter()
    try:
        for name, tensor in policy.state_dict().items():
            if "lora_" in name:
                continue
            yield name.replace("base_model.model.", "", 1).replace(".base_layer", ""), tensor
    finally:
        policy.unmerge_adapter()
