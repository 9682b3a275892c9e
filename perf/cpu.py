"""On a CPU: what makes the default run fast there, and nothing a GPU run needs.

Four settings, each exact (the same numbers as without it):
    keep_freed_memory     glibc keeps freed memory in the process
    cap_kernel_cache      oneDNN keeps few compiled bf16 kernels (bf16 runs)
    grouped_heads         attention takes grouped key/value heads as they are, no copies
    VLLM_CPU_BLOCK_SIZE   vLLM's KV blocks short enough to share a group's prompt
and seed_vllm, how vLLM's CPU engine is seeded.
"""

import os

import numpy as np
import torch

# vLLM's prefix cache shares a prompt's keys and values between the G completions of its group only
# in whole blocks; its CPU backend picks 128-token blocks, longer than many prompts (the default
# run's are ~92 tokens), so every completion would prefill its prompt again. 32 is the CPU kernels'
# smallest fast size. On a GPU vLLM's own choice stays.
VLLM_CPU_BLOCK_SIZE = 32


def seed_vllm(seed):
    """vLLM's in-process CPU engine samples from torch's global generator (numpy's is seeded too,
    to be safe), so a call is seeded from its first row's seed: a per-request seed crashes there."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def keep_freed_memory():
    """On a CPU, glibc keeps freed memory in the process for the next allocation; True if set.

    By default each block over a threshold (32 MB at most) gets its own mapping and goes back to the
    kernel when freed, so every micro-batch's logits, gradients and activations are faulted back in
    and zeroed page by page (a fifth of the default run's update time on a 2-core VM). Without
    mappings, and with the heap's top kept, the next micro-batch reuses the same memory; the
    resident set then stays near its peak between steps.
    """
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt"):  # not glibc (macOS, musl): its allocator is left as it is
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


# oneDNN (PyTorch's CPU matmuls) keeps a compiled kernel for every shape it has met, up to 1024, and
# in bf16 each holds its own buffers (~7 MB for SmolLM2). An update's micro-batches come in a new
# (rows, length) shape almost every time, so with the default cache the default run's resident
# memory grew every step, 7.8 -> 10.7 GB over 30 steps. One micro-batch needs ~20-25 kernels (each
# weight shape forward and backward), reused by all its layers: 8 made the run 20% slower, 64 cost
# no time but held ~0.5 GB more than 8 (dev/LOG.md).
KERNEL_CACHE = 32


def cap_kernel_cache(capacity=KERNEL_CACHE):
    """Caps oneDNN's kernel cache (its ONEDNN_PRIMITIVE_CACHE_CAPACITY, read at its first kernel:
    call this before any bf16 compute). A capacity set in the environment stays."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       is_causal=None, **kwargs):
    """transformers' "sdpa" attention,
    with grouped-query key/value heads handed to the kernel as they are.

    Given a mask (any padded batch), transformers first copies each key/value head once per query
    head that shares it (repeat_kv), because CUDA's masked kernels lack grouped heads; PyTorch's CPU
    kernels have them (enable_gqa). The same attention without the copies: for a decoding step of
    SmolLM2 (9 query heads on 3 key/value heads) 7x faster on a CPU. query (b, Hq, T, d), key and
    value (b, Hkv, S, d) -> (b, T, Hq, d).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # nothing is copied there
    if attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                      is_causal, **kwargs)
    # with a mask transformers' version is exactly this call with repeated heads
    # (is_causal False, the mask says it)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value,
                                                           attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def grouped_heads(model):
    """A model on a CPU with transformers' sdpa attention uses sdpa_gqa_attention instead
    (the same masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register("sdpa_gqa", sdpa_gqa_attention)
    AttentionMaskInterface.register("sdpa_gqa", sdpa_mask)
    model.set_attn_implementation("sdpa_gqa")

