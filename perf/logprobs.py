"""Token logprobs without the (B, T, V) fp32 tensors: chunked_logprobs and fused_logprobs (L6).

The plain definition is loss.token_logprobs: log_softmax(logits / T) gathered at the tokens. It
keeps a full (B, T, V) fp32 copy alive for backward: at V = 152k and 8k tokens, 5 GB. Two exact ways
around it, each tested against the plain one (tests/test_perf.py):

    chunked_sequence_logprobs  the model's logits as they are; log p and the entropy in fp32, one
                               chunk of positions at a time, the backward recomputing each chunk's
                               softmax
    fused_sequence_logprobs    no logits at all: the output layer itself computes log p and the
                               entropy from the hidden states, chunk by chunk (Liger Kernel's,
                               Unsloth's idea)
"""

import contextlib

import torch

from infra.memory import head_chunk


def chunked_sequence_logprobs(logits, ids, temperature):
    """(logprobs, entropy), each (b, T-1) fp32, of the tokens ids[:, 1:] from (b, T, V) logits."""
    # every position gets a token, the last a dummy one (it predicts nothing and is cut below): the
    # backward then writes the logits' gradient whole, where a slice logits[:, :-1] would cost a
    # (b, T, V) zero fill and copy
    tokens = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # (b, T)
    logprobs, entropy = logprobs_and_entropy(logits, tokens, temperature)
    return logprobs[:, :-1], entropy[:, :-1]


def fused_sequence_logprobs(model, ids, temperature, **inputs):
    """chunked_sequence_logprobs of one forward of `model` over ids, the logits never built."""
    tokens = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # (b, T), as above
    with head_returns_logprobs(model, tokens, temperature):
        out = model(input_ids=ids, **inputs).logits  # (b, T, 2)
    return out[:, :-1, 0], out[:, :-1, 1]


# config fields of models whose logits are not just lm_head(h): softcapping (Gemma 2), a scale
# (Cohere, Granite)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def fused_head_unsupported(model):
    """Why the fused head (linear_logprobs_and_entropy) cannot stand in for this model's logits,
    or None."""
    model = getattr(model, "module", model)  # DDP's wrapper
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"its output layer is a {type(head).__name__}, not a plain Linear"
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    transforms = [name for name in LOGIT_TRANSFORMS
                  if getattr(config, name, None) not in (None, 1, 1.0)]
    if transforms:
        return f"its logits are transformed after the output layer ({', '.join(transforms)})"
    return None


@contextlib.contextmanager
def head_returns_logprobs(model, tokens, temperature):
    """While open, the model's output layer returns (b, T, 2) [log p(tokens), entropy] instead of
    (b, T, V) logits.

    The head is swapped inside the model's own forward, so FSDP2's gathered weights, DDP's hooks and
    gradient checkpointing all see an ordinary forward; only the logits are never built (loss.py).
    """
    head = getattr(model, "module", model).get_output_embeddings()

    def logprobs(hidden):  # (b, T, H) -> (b, T, 2)
        return torch.stack(linear_logprobs_and_entropy(hidden, head.weight, tokens, temperature,
                                                       head.bias), -1)

    head.forward = logprobs
    try:
        yield
    finally:
        del head.forward  # the class's forward again


class _LogprobsEntropy(torch.autograd.Function):
    """log p(token) and entropy per position from logits, chunk by chunk in fp32.

    A plain `log_softmax(logits.float())` keeps a full (B, T, V) fp32 copy alive for backward:
    at V = 152k, 8k tokens that is 5 GB. Here forward keeps only the logits (which the model holds
    anyway) and two (B, T) fp32 tensors; backward recomputes softmax one chunk at a time.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk):
        ctx.set_materialize_grads(False)
        B, T, _ = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 under gradcheck
        logp = logits.new_empty(B, T, dtype=dtype)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        for b, s in _chunks(B, T, chunk):
            # (c, V): the only fp32 copy, one chunk at a time
            z = logits[b, s].to(dtype) / temperature
            lse[b, s], logp[b, s], entropy[b, s] = _softmax_stats(z, tokens[b, s])
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)  # the chunks cover every position: nothing to zero first
        for b, s in _chunks(logits.shape[0], logits.shape[1], ctx.chunk):
            # (c, V), a fresh chunk
            log_p = logits[b, s].to(lse.dtype) / ctx.temperature - lse[b, s, None]
            grad[b, s] = _softmax_grad(log_p, tokens[b, s], entropy[b, s],
                                       grad_logp[b, s] if grad_logp is not None else None,
                                       grad_entropy[b, s] if grad_entropy is not None else None,
                                       ctx.temperature)
        return grad, None, None, None


def _chunks(B, T, chunk):
    """(row, time-slice) pairs covering a (B, T) grid, at most `chunk` positions each."""
    return [(b, slice(t, t + chunk)) for b in range(B) for t in range(0, T, chunk)]


def logprobs_and_entropy(logits, tokens, temperature=1.0, chunk=1024):
    """Log-probability of each token and the entropy of each position, in fp32 (L6).

    logits: (B, T, V) any float dtype; logits[:, t] is the distribution that produced tokens[:, t]
            (so a caller passes model logits[:, :-1] with input_ids[:, 1:]). Non-contiguous is fine.
    tokens: (B, T) long.
    temperature: the sampler's temperature; both sides of the ratio use logits / temperature (R5).
    Returns (logprobs, entropy), each (B, T) fp32 (fp64 for fp64 logits), both differentiable.

    Example: logits [[[0, ln 3]]] (one position, two tokens), tokens [[1]] -> logprob ln(3/4).
    """
    return _LogprobsEntropy.apply(logits, tokens, float(temperature), chunk)


class _LinearLogprobsEntropy(torch.autograd.Function):
    """log p(token) and entropy per position from the final hidden states and the output matrix.

    The fused linear + cross-entropy idea (Liger Kernel, Unsloth): the logits h W^T are computed one
    chunk of positions at a time, inside forward and again inside backward, so neither the (N, V)
    logits nor their gradient ever exist whole. Forward keeps the hidden states and two (N,) fp32
    tensors; the price is one more head matmul in backward. The matmul runs in `compute_dtype` (bf16
    under autocast, as the model's own head would), the softmax in fp32 (L6). Positions are flat
    (N, H).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk, compute_dtype):
        ctx.set_materialize_grads(False)
        dtype = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 under gradcheck
        logp = hidden.new_empty(len(hidden), dtype=dtype)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        w = weight.to(compute_dtype)
        for s in range(0, len(hidden), chunk):
            s = slice(s, s + chunk)
            # (c, V), one chunk
            z = _head(hidden[s], w, bias, compute_dtype).to(dtype) / temperature
            lse[s], logp[s], entropy[s] = _softmax_stats(z, tokens[s])
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        cd = ctx.compute_dtype
        w = weight.to(cd)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight,
                                       dtype=torch.promote_types(weight.dtype, torch.float32))
        grad_bias = torch.zeros_like(grad_weight[:, 0]) if bias is not None else None
        for s in range(0, len(hidden), ctx.chunk):
            s = slice(s, s + ctx.chunk)
            h = hidden[s].to(cd)  # (c, H)
            log_p = _head(h, w, bias, cd).to(lse.dtype) / ctx.temperature - lse[s, None]  # (c, V)
            g = _softmax_grad(log_p, tokens[s], entropy[s],
                              grad_logp[s] if grad_logp is not None else None,
                              grad_entropy[s] if grad_entropy is not None else None,
                              ctx.temperature)
            if bias is not None:
                grad_bias += g.sum(0).to(grad_bias.dtype)
            g = g.to(cd)  # both products take it in the compute dtype
            grad_hidden[s] = (g @ w).to(grad_hidden.dtype)  # dL/dh = g W
            _add_weight_grad(grad_weight, g, h)  # dL/dW += g^T h
        grad_bias = grad_bias.to(bias.dtype) if bias is not None else None
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None, None


def _add_weight_grad(grad_weight, g, h):
    """grad_weight (V, H) += g^T h for one chunk, g (c, V) and h (c, H) in the compute dtype, in
    place: no (V, H) temporary per chunk (at V = 152k, H = 2048 a bf16 product and its fp32 copy
    would take 1.7 GiB a chunk).

    fp32 (or fp64) compute: addmm_ in place. bf16 compute into an fp32 gradient: on CUDA, cuBLAS
    multiplies the bf16 operands and adds into the fp32 gradient itself (addmm with out_dtype);
    CPU kernels lack that mixed-dtype call, so there the bf16 operands are widened to fp32 first
    (one (c, V) chunk) and multiplied exactly.
    """
    if grad_weight.dtype == g.dtype:
        grad_weight.addmm_(g.T, h)
    elif g.is_cuda:
        torch.addmm(grad_weight, g.T, h, out_dtype=grad_weight.dtype, out=grad_weight)
    else:
        grad_weight.addmm_(g.T.to(grad_weight.dtype), h.to(grad_weight.dtype))


def _head(h, w, bias, compute_dtype):
    """h W^T (+ b) in compute_dtype: the logits of one chunk of positions."""
    z = h.to(compute_dtype) @ w.T
    return z + bias.to(compute_dtype) if bias is not None else z


def _softmax_stats(z, tokens):
    """(logsumexp, log p(token), entropy), each (c,), of one chunk of (c, V) scaled logits and its
    (c,) tokens.

    z is the caller's scratch copy and is overwritten: log p is computed in its memory, so a chunk
    costs one (c, V) buffer besides z (at V = 152k every pass over a chunk is memory traffic, not
    arithmetic).
    """
    lse = torch.logsumexp(z, dim=-1)
    log_p = z.sub_(lse[:, None])  # (c, V), in z's memory
    token_logp = log_p.gather(-1, tokens[:, None]).squeeze(-1)
    # H = -sum p log p; the equal form lse - sum p z loses ~1e-5 to cancellation in fp32
    entropy = torch.exp(log_p).mul_(log_p).sum(-1).neg_()
    return lse, token_logp, entropy


def _softmax_grad(log_p, tokens, entropy, grad_logp, grad_entropy, temperature):
    """d(loss)/d(logits) for logits -> z = logits / T -> (log p(token), entropy): (c, V) fp32, from
    the upstream (c,) gradients g_k, g_H (None = zero). With d log p_k / dz = onehot(k) - p and
    dH / dz = -p (log p + H):

        d(loss)/dz = onehot(k) g_k - p (g_k + g_H (log p + H)),   and d(loss)/d(logits) = that / T.

    The 1/T goes on the (c,) gradients first. log_p is a scratch chunk and is overwritten, as is p:
    two (c, V) buffers, five passes over them.
    """
    g_k = grad_logp / temperature if grad_logp is not None else None
    p = torch.exp(log_p)  # (c, V)
    if grad_entropy is not None:
        # g_H (log p + H)
        inner = log_p.add_(entropy[:, None]).mul_((grad_entropy / temperature)[:, None])
    else:
        inner = log_p.zero_()
    if g_k is not None:
        inner.add_(g_k[:, None])
    grad = p.mul_(inner).neg_()  # -p (g_k + g_H (log p + H))
    if g_k is not None:
        grad.scatter_add_(-1, tokens[:, None], g_k[:, None])  # + onehot(k) g_k
    return grad


def linear_logprobs_and_entropy(hidden, weight, tokens, temperature=1.0, bias=None, chunk=None):
    """logprobs_and_entropy(hidden @ weight.T + bias, tokens, temperature) without the logits.

    hidden: (B, T, H) the model's final hidden states (after its last norm);
    hidden[:, t] produced tokens[:, t].
    weight: (V, H) the output matrix (lm_head.weight; the embedding when tied), bias (V,) or None.
    tokens: (B, T) long. chunk: positions per chunk; default: head_chunk for the device.
    The head's matmul runs in the autocast dtype when autocast is on (bf16 logits, as the model's
    own head would give), else in the weight's dtype; logprobs and entropy in fp32. Both
    differentiable in hidden, weight and bias.

    Example: hidden [[[1, 0]]], weight [[0, 0], [ln 3, 0]], tokens [[1]] -> logprob ln(3/4), as for
    logits [[[0, ln 3]]].
    """
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    compute_dtype = (torch.get_autocast_dtype(device) if autocast
                     else torch.promote_types(hidden.dtype, weight.dtype))
    chunk = chunk or head_chunk(device, weight.shape[0])
    B, T, H = hidden.shape
    # the casts are explicit, in forward and backward alike
    with torch.autocast(device, enabled=False):
        logp, entropy = _LinearLogprobsEntropy.apply(hidden.reshape(B * T, H), weight, bias,
                                                     tokens.reshape(B * T),
                                                     float(temperature), chunk, compute_dtype)
    return logp.view(B, T), entropy.view(B, T)
