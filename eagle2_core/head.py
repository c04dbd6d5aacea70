"""The EAGLE-1/2 draft head, in the published checkpoint format.

The head is one decoder layer fed with `fc([embed(token_{t+1}); feature_t])`, where feature_t is
the target's last hidden state (after its final norm, i.e. the lm_head input). Layer 0 has no
input norm and there is no output norm: the draft's output goes straight into the target's
lm_head. Embeddings and lm_head are the target's own, shared, never copied (EAGLE paper 3.1).

Checkpoint format (what the reference code, vLLM and SGLang read): `config.json` with
LlamaConfig-like fields plus `bias`, and `model.safetensors` or `pytorch_model.bin` with keys
`fc.weight`, optional `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, and an
optional `embed_tokens.weight` that we ignore (after checking its shape).
Our additions live in separate files so strict loaders elsewhere are unaffected:
`eagle2_draft_vocab.safetensors` (the pruned draft vocabulary) and `eagle2.json` (metadata).
Reading a head folder of either kind is `headfiles.py`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from . import leanbody
from .rowgemm import floatless_rows, linear_rows, make_row_linears
from .target import text_config

DRAFT_VOCAB_FILE = "eagle2_draft_vocab.safetensors"
METADATA_FILE = "eagle2.json"


class HeadMismatchError(ValueError):
    """The draft head does not fit the target (hidden size, vocabulary, or tensor shapes)."""


@dataclass
class HeadSpec:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    bias: bool = True
    qkv_bias: bool = False
    head_dim: int | None = None
    hidden_act: str = "silu"

    @classmethod
    def from_config_dict(cls, d: dict) -> "HeadSpec":
        rope = d.get("rope_parameters") or {}
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"),
            # The reference code defaults `bias` to True when the key is absent (Vicuna heads).
            bias=d.get("bias", True),
            qkv_bias=d.get("qkv_bias", False),
            head_dim=d.get("head_dim"),
            hidden_act=d.get("hidden_act", "silu"),
        )

    def to_config_dict(self) -> dict:
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "hidden_act": self.hidden_act,
            "bias": self.bias,
        }
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.qkv_bias:
            d["qkv_bias"] = True
        if self.head_dim is not None:
            d["head_dim"] = self.head_dim
        return d

    def layer_config(self):
        cls = Qwen2Config if self.qkv_bias else LlamaConfig
        kw = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            hidden_act=self.hidden_act,
        )
        if self.rope_scaling:
            kw["rope_scaling"] = self.rope_scaling
        if self.head_dim is not None:
            kw["head_dim"] = self.head_dim
        cfg = cls(**kw)
        cfg._attn_implementation = "sdpa"
        return cfg

    @classmethod
    def for_target(cls, target_config, intermediate_size: int | None = None) -> "HeadSpec":
        """A head shaped like one layer of the target (what `eagle2 train` creates)."""
        c = text_config(target_config)
        rope = getattr(c, "rope_parameters", None) or {}
        head_dim = getattr(c, "head_dim", None)
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=intermediate_size or c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
            vocab_size=c.vocab_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            max_position_embeddings=c.max_position_embeddings,
            rope_theta=rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
            bias=False,
            head_dim=head_dim if head_dim and head_dim != c.hidden_size // c.num_attention_heads else None,
        )


class BaseHead(nn.Module):
    """What every head kind shares: its weights without the recomputed rotary tables, and
    writing them as a head folder (`config.json`, `model.safetensors`, optional `eagle2.json`)."""

    spec: HeadSpec

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary_emb")}

    def save(self, folder: str, metadata: dict | None = None, dtype: torch.dtype | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        sd = self.head_state_dict()
        if dtype is not None:  # integer maps (EAGLE-3's d2t, t2d) keep their type
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        cfg = self.spec.to_config_dict()
        cfg["torch_dtype"] = str(sd["fc.weight"].dtype).replace("torch.", "")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        save_file({k: v.cpu() for k, v in sd.items()}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        self.save_extra_files(folder)
        if metadata is not None:
            with open(os.path.join(folder, METADATA_FILE), "w") as f:
                json.dump(metadata, f, indent=2)

    def save_extra_files(self, folder: str) -> None:
        """Files of this kind beyond the published format's own (none by default)."""


class DraftHead(BaseHead):
    """EAGLE-1/2 draft head. Call `bind(target_model)` before use to share embeddings and lm_head.

    The interface every head kind offers the drafter, decoder and trainer (`eagle3.Eagle3Head`
    is the other): `feature_layers` (None: the target's final-norm hidden state is the feature;
    else the target layers whose inputs are fused), `project(target_features)` (the target
    feature -> the state a draft step takes), `forward(tokens, state, positions, mask, cache)`
    (one draft step; its output is the next step's state), `draft_logits(state)` over the draft
    vocabulary, `to_target_ids(draft_ids)`, `objective` (the training loss's settings), `save`.
    """

    kind = "eagle2"
    feature_layers = None
    # Training objective (EAGLE section 3.2): smooth-L1 feature regression + 0.1 x cross-entropy,
    # uniform noise on the input features.
    objective = {"noise": 0.2, "v_weight": 1.0, "p_weight": 0.1, "renormalise": False}

    def __init__(self, spec: HeadSpec, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        self.spec = spec
        cfg = spec.layer_config()
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=spec.bias)
        layer_cls = Qwen2DecoderLayer if spec.qkv_bias else LlamaDecoderLayer
        layer = layer_cls(cfg, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # EAGLE: the first layer has no input norm
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        make_row_linears(self)  # few-row products at memory speed on CPUs (rowgemm.py)
        # Pruned draft vocabulary (target token ids), as EAGLE-3's d2t map: drafting scores only
        # these rows of lm_head. Verification still uses the full vocabulary, so output is exact.
        self.register_buffer("draft_vocab", draft_vocab, persistent=False)
        self._shared: tuple[nn.Module, torch.Tensor] | None = None

    # -- wiring to the target -------------------------------------------------------------
    def bind(self, target_model) -> "DraftHead":
        check_head_fits(self.spec, target_model)
        embed = target_model.get_input_embeddings()
        lm_head = target_model.get_output_embeddings().weight
        device, dtype = lm_head.device, embed.weight.dtype if hasattr(embed, "weight") else lm_head.dtype
        if lm_head.dtype in (torch.float16, torch.bfloat16, torch.float32):
            dtype = lm_head.dtype
        self.to(device=device, dtype=dtype)
        if self.draft_vocab is not None:
            self.draft_vocab = self.draft_vocab.to(device)
        # the rows it scores, with their GGUF / 8-bit blocks where the target has them (a target
        # holding blocks only gives blocks only: rowgemm.floatless_rows)
        w = floatless_rows(lm_head, self.draft_vocab)
        self._shared = (embed, w)
        return self

    @property
    def embed(self):
        return self._shared[0]

    @property
    def draft_lm_head(self) -> torch.Tensor:
        return self._shared[1]

    # -- compute --------------------------------------------------------------------------
    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """EAGLE-1/2 feeds the target's feature itself (its fc takes it with the embedding)."""
        return target_features

    def forward(self, input_ids, features, position_ids, attention_mask=None, cache=None):
        """Draft hidden states for pairs (feature_t, token_{t+1}) at the given positions."""
        with torch.no_grad():
            emb = self.embed(input_ids)
        x = self.fc(torch.cat([emb.to(features.dtype), features], dim=-1))
        pos = self.rotary_emb(x, position_ids)
        fast = leanbody.head_layer(self, x, pos, attention_mask, cache)  # a draft step on a CPU: the native loop
        if fast is not None:
            return fast
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                      use_cache=cache is not None, position_embeddings=pos)
        return x

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (index into `draft_vocab` if pruned)."""
        return linear_rows(hidden, self.draft_lm_head.to(hidden.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    # -- checkpoints ----------------------------------------------------------------------
    def save_extra_files(self, folder: str) -> None:
        """The pruned draft vocabulary, beside the published format (strict loaders ignore it)."""
        if self.draft_vocab is not None:
            from safetensors.torch import save_file

            save_file({"draft_vocab": self.draft_vocab.cpu().long()}, os.path.join(folder, DRAFT_VOCAB_FILE))


def target_dims(target_model) -> tuple[int, int]:
    """(hidden size, vocabulary rows of lm_head) of a target model."""
    c = text_config(target_model.config)
    out = target_model.get_output_embeddings()
    vocab = out.weight.shape[0] if out is not None and getattr(out, "weight", None) is not None else c.vocab_size
    return c.hidden_size, vocab


def check_head_fits(spec: HeadSpec, target_model, where: str = "draft head") -> None:
    hidden, vocab = target_dims(target_model)
    if spec.hidden_size != hidden:
        raise HeadMismatchError(f"{where}: hidden_size {spec.hidden_size} does not match the target's {hidden}; this head was trained for another model")
    if spec.vocab_size != vocab:
        raise HeadMismatchError(f"{where}: vocab_size {spec.vocab_size} does not match the target's lm_head rows {vocab}; this head was trained for another model")


def build_draft_head(spec: HeadSpec, sd: dict[str, torch.Tensor], draft_vocab=None, where: str = "draft head") -> DraftHead:
    """An EAGLE-1/2 head with these weights, naming any missing, unexpected or misshapen key."""
    head = DraftHead(spec, draft_vocab)
    own = head.head_state_dict()
    emb = sd.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (spec.vocab_size, spec.hidden_size):
        raise HeadMismatchError(f"{where}: embed_tokens.weight has shape {tuple(emb.shape)}, config says {(spec.vocab_size, spec.hidden_size)}")
    weights = {k: v for k, v in sd.items() if k in own}
    missing = sorted(set(own) - set(weights))
    if missing:
        raise HeadMismatchError(f"{where}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}; not an EAGLE-1/2 head?")
    unknown = sorted(set(sd) - set(own) - {"embed_tokens.weight"})
    if unknown:
        raise HeadMismatchError(f"{where}: unexpected tensors {unknown[:4]} for an EAGLE-1/2 head")
    for k, v in weights.items():
        if v.shape != own[k].shape:
            raise HeadMismatchError(f"{where}: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)} from its config.json")
    head.load_state_dict(weights, strict=False)
    head.float()
    return head
