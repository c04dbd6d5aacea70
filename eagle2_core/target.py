"""The target model, driven through its own transformers forward or, on CPUs, the lean body.

`TargetRunner` is a thin view over a loaded `*ForCausalLM`: it runs the decoder body on our
cache with our mask and positions, and applies lm_head only to the rows we need (the prompt's
last row, the tree's rows), which on a small model saves a large share of the work. For the
Llama family on a CPU the body is `leanbody.LeanBody` (the same arithmetic in plain tensor ops,
fused products); every other model runs its stock body.
"""
from __future__ import annotations

import torch

from contextlib import contextmanager

from . import leanbody
from .rowgemm import PLAIN_LINEARS, eligible, linear_rows, plain_linears
from .tree import additive

# End-of-turn markers of common chat templates; generation stops at these as at EOS.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>", "<|end_of_text|>")


def text_config(config):
    """The language model's own config: a multimodal config's text part, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(config) -> int:
    """The model's position limit (its text config's max_position_embeddings), or no limit."""
    c = text_config(config)
    return getattr(c, "max_position_embeddings", None) or 1 << 30


class TargetRunner:
    def __init__(self, model):
        self.model = model
        self.config = text_config(model.config)
        self.body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.device = self.lm_head.weight.device
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        # CPU linears take the measured product plan's kernel during our forwards only (rowgemm.py);
        # one that already has an instance-level forward (an accelerate hook) is left alone.
        self.cpu_linears = [m for m in plain_linears(self.body) if eligible(m.weight) and "forward" not in m.__dict__]
        # The Llama family's body in plain tensor ops on CPUs (leanbody.py); None: the stock body.
        self.lean = leanbody.for_model(self.body, self.config) if self.device.type == "cpu" else None
        self.max_positions = context_length(model.config)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        layer_types = getattr(self.config, "layer_types", None) or []
        window = getattr(self.config, "sliding_window", None)
        # Which mask each layer needs: a dict {layer type: mask} for hybrid models (Gemma 3),
        # a single mask (windowed or not) otherwise (Llama, Qwen2, Mistral with sliding_window).
        self.hybrid = "sliding_attention" in layer_types and "full_attention" in layer_types
        if self.hybrid or (layer_types and all(t == "sliding_attention" for t in layer_types)):
            self.window = window
        elif layer_types:
            self.window = None
        else:
            self.window = window if getattr(self.config, "use_sliding_window", True) else None

    def masks(self, allowed_fn):
        """The additive mask the body takes, from `allowed_fn(window)` -> [B, n, view] bool: one mask
        (windowed or not), or for hybrid models (Gemma 3) a dict by layer type."""
        if self.hybrid:
            return {"full_attention": additive(allowed_fn(None), self.dtype), "sliding_attention": additive(allowed_fn(self.window), self.dtype)}
        return additive(allowed_fn(self.window), self.dtype)

    def body_forward(self, tokens, positions, mask, cache, seen: dict, layers: tuple[int, ...] | None):
        """The body (lean or stock) on our cache, mask and positions ([B, n] each): final-norm hidden states
        [B, n, H], and the draft head's feature: the hidden state itself (EAGLE-1/2, `layers` None)
        or the residual streams entering `layers`, concatenated low to high (EAGLE-3 section 3.2),
        which hooks the caller installed put in `seen` (`capture_layer_inputs`)."""
        if self.lean is not None:
            hidden = self.lean(tokens, positions, mask, cache, seen, layers)
        else:
            hidden = self.body(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True).last_hidden_state
        return hidden, (hidden if layers is None else fuse(seen, layers))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if type(head) in PLAIN_LINEARS:  # a quantized lm_head keeps its own forward (eagle2's CPU 8-bit reads blocks here)
            logits = linear_rows(hidden, head.weight, head.bias).float()
        else:
            logits = head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@contextmanager
def capture_layer_inputs(body, layers: tuple[int, ...] | None):
    """Keep the hidden state entering each of `layers` during one forward of the stock body.

    Forward pre-hooks on just those layers: nothing else is kept (no `output_hidden_states`,
    which would hold every layer), and the hooks are gone after the block, so the model behaves
    as before outside our own forwards (`generate` included). The input of layer k is what
    transformers calls `hidden_states[k]`.
    """
    seen: dict[int, torch.Tensor] = {}
    if not layers:
        yield seen
        return
    stack = getattr(body, "layers", None)  # `model.layers` in every architecture transformers ships
    if stack is None:
        raise ValueError(f"{type(body).__name__} has no .layers; EAGLE-3 features cannot be captured from it")

    def keeper(k):
        def hook(module, args, kwargs):
            seen[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [stack[k].register_forward_pre_hook(keeper(k), with_kwargs=True) for k in sorted(set(layers))]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def fuse(seen: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([seen[k] for k in layers], dim=-1)


def model_eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        lookup = getattr(tokenizer, "convert_tokens_to_ids", None)
        if lookup is None:  # a minimal tokenizer: its vocabulary as a dict
            vocab = tokenizer.get_vocab()
            ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        else:
            # each token looked up alone (an unknown one comes back as the unknown token's id):
            # `get_vocab()` would copy the whole vocabulary at every `generate` call, a peak of
            # memory for every string of it and part of it left in the heap
            for t in END_OF_TURN_TOKENS:
                i = lookup(t)
                if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == t:
                    ids.add(i)
    return ids
