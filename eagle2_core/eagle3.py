"""The EAGLE-3 draft head, in the published checkpoint format (Li et al. 2025, arXiv 2503.01840).

What changes against EAGLE-1/2 (`head.py`), and nothing else does (tree, verify, accept):
  * the feature is not the target's last hidden state but the residual streams entering a low,
    a middle and a high target layer (2, L//2, L-3), concatenated and projected by `fc`
    (EAGLE-3 section 3.2). `fc` applies only to that target feature: deeper draft steps feed
    back the head's own pre-norm output;
  * one draft step is `x = cat(input_layernorm(embed(token)), hidden_norm(h))`,
    `h = h + attn(x)`, `h = h + mlp(post_attention_layernorm(h))`: the attention reads 2H wide,
    the residual is the feature, not the embedding;
  * the head has its own final norm and an lm_head over a pruned draft vocabulary, mapped to
    target ids by `d2t` (target id = draft id + d2t[draft id]); `t2d` marks the target ids kept;
  * it is trained by training-time test alone, without feature regression (section 3.1).

Checkpoint (what the reference code, vLLM and SGLang read): `config.json` with Llama fields,
`architectures` ["LlamaForCausalLMEagle3"], `num_hidden_layers` 1, `vocab_size` (the target's),
`draft_vocab_size`, optional `target_hidden_size`, `tie_word_embeddings` false; weights
`fc.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`. The target's embedding is shared; a head whose hidden size
differs from the target's carries its own `embed_tokens.weight`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from .head import BaseHead, HeadMismatchError, HeadSpec, target_dims
from .rowgemm import float_rows, linear_rows, make_row_linears
from .target import text_config

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Custom feature layers, as vLLM reads them: "the input of layer k" (SGLang reads the same key
# with another convention, so we write it only when a head does not use the default layers).
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
MIN_TARGET_LAYERS = 7  # the smallest L for which 2 < L//2 < L-3: three distinct layers


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Inputs of target layers 2, L//2 and L-3 (transformers' hidden_states[2], [L//2], [L-3])."""
    return (2, num_layers // 2, num_layers - 3)


def num_target_layers(target_config) -> int:
    return text_config(target_config).num_hidden_layers


@dataclass
class Eagle3Spec(HeadSpec):
    draft_vocab_size: int = 0                  # 0: the full target vocabulary
    target_hidden_size: int | None = None      # None: the head's own hidden size
    aux_layers: tuple[int, ...] | None = None  # None: default_feature_layers(L)
    bias: bool = False

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_width(self) -> int:
        return 3 * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_config_dict(cls, d: dict) -> "Eagle3Spec":
        aux = d.get(AUX_LAYERS_KEY) or (d.get("eagle_config") or {}).get(AUX_LAYERS_KEY)
        return cls.extend(HeadSpec.from_config_dict(d), qkv_bias=False, draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                          target_hidden_size=d.get("target_hidden_size"), aux_layers=tuple(aux) if aux else None)

    @classmethod
    def extend(cls, base: HeadSpec, **extra) -> "Eagle3Spec":
        """An EAGLE-3 spec from the Llama fields of `base` (EAGLE-3 layers have no biases)."""
        return cls(**{**dataclasses.asdict(base), "bias": False, **extra})

    def to_config_dict(self) -> dict:
        d = super().to_config_dict()
        d.pop("bias", None)
        d.update(architectures=[EAGLE3_ARCHITECTURE], draft_vocab_size=self.draft_vocab, tie_word_embeddings=False)
        if self.target_hidden_size and self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.aux_layers:
            d[AUX_LAYERS_KEY] = list(self.aux_layers)
        return d

    @classmethod
    def for_target(cls, target_config, intermediate_size: int | None = None, draft_vocab_size: int = 0) -> "Eagle3Spec":
        base = HeadSpec.for_target(target_config, intermediate_size)
        return cls.extend(base, draft_vocab_size=draft_vocab_size or base.vocab_size)


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (`midlayer`): attention over cat(embedding, feature), 2H wide."""

    def __init__(self, cfg):
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = LlamaAttention(cfg, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the published heads read 2H: embedding and feature
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * H, old.out_features, bias=False))
        self.mlp = LlamaMLP(cfg)
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, emb, h, attention_mask, position_ids, cache, position_embeddings):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        a, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                              use_cache=cache is not None, position_embeddings=position_embeddings)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(BaseHead):
    """EAGLE-3 draft head behind the same interface as `DraftHead`: `bind`, `project`, `forward`,
    `draft_logits`, `to_target_ids`, `save`, `feature_layers`."""

    kind = "eagle3"
    # Training objective (EAGLE-3 section 3.1): training-time test only, no feature regression,
    # no input noise; soft cross-entropy against the target's distribution renormalised over the
    # draft vocabulary, counted where the target's top token is in it.
    objective = {"noise": 0.0, "v_weight": 0.0, "p_weight": 1.0, "renormalise": True}

    def __init__(self, spec: Eagle3Spec):
        super().__init__()
        self.spec = spec
        cfg = spec.layer_config()
        H = spec.hidden_size
        self.fc = nn.Linear(spec.feature_width, H, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(H, eps=spec.rms_norm_eps)
        self.lm_head = nn.Linear(H, spec.draft_vocab, bias=False)
        # d2t: offsets from draft to target ids; t2d: which target ids are drafted. Identity by default.
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(spec.vocab_size, dtype=torch.bool) if spec.draft_vocab == spec.vocab_size
                             else torch.zeros(spec.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(spec.vocab_size, H) if self.owns_embedding else None
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        make_row_linears(self)
        self._shared: tuple[nn.Module, ...] = ()  # the target's embedding, kept out of our state_dict
        self.feature_layers: tuple[int, ...] | None = spec.aux_layers

    @property
    def owns_embedding(self) -> bool:
        return bool(self.spec.target_hidden_size) and self.spec.target_hidden_size != self.spec.hidden_size

    # -- wiring to the target -------------------------------------------------------------
    def bind(self, target_model) -> "Eagle3Head":
        check_eagle3_fits(self.spec, target_model)
        lm = target_model.get_output_embeddings().weight
        self.to(device=lm.device, dtype=lm.dtype if lm.dtype in (torch.float16, torch.bfloat16, torch.float32) else None)
        if not self.owns_embedding:
            self._shared = (target_model.get_input_embeddings(),)
        self.feature_layers = self.spec.aux_layers or default_feature_layers(num_target_layers(target_model.config))
        return self

    def set_draft_vocab(self, target_ids: torch.Tensor | None) -> None:
        """Draft vocabulary = these target ids (sorted, as the reference writes d2t)."""
        V = self.spec.vocab_size
        ids = torch.arange(V) if target_ids is None else torch.sort(target_ids.long().cpu()).values
        if ids.numel() != self.spec.draft_vocab:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, the head {self.spec.draft_vocab}")
        self.d2t.copy_((ids - torch.arange(ids.numel())).to(self.d2t.device))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        self.t2d.copy_(t2d.to(self.t2d.device))

    def init_lm_head_from(self, target_model) -> None:
        """Start the draft lm_head from the target's rows for the draft vocabulary (same width only)."""
        w = target_model.get_output_embeddings().weight
        if w.shape[1] == self.spec.hidden_size:
            with torch.no_grad():
                self.lm_head.weight.copy_(float_rows(w, self.draft_ids().to(w.device)).to(self.lm_head.weight))

    @property
    def draft_vocab(self) -> torch.Tensor:
        return self.draft_ids()

    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    # -- compute --------------------------------------------------------------------------
    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """The fused low/middle/high target feature [.., 3H_target] -> the head's state [.., H]."""
        return self.fc(target_features.to(self.fc.weight.dtype))

    def forward(self, input_ids, h, position_ids, attention_mask=None, cache=None):
        """One draft step for pairs (state_t, token_{t+1}); returns the pre-norm state fed back next."""
        if self.embed_tokens is None:
            with torch.no_grad():  # the target's embedding, shared and frozen
                emb = self._shared[0](input_ids)
        else:
            emb = self.embed_tokens(input_ids)
        emb = emb.to(h.dtype)
        pos = self.rotary_emb(h, position_ids)
        return self.midlayer(emb, h, attention_mask, position_ids, cache, pos)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear_rows(self.norm(h), self.lm_head.weight)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def check_eagle3_fits(spec: Eagle3Spec, target_model, where: str = "EAGLE-3 head") -> None:
    hidden, vocab = target_dims(target_model)
    want = spec.target_hidden_size or spec.hidden_size
    if want != hidden:
        name = "target_hidden_size" if spec.target_hidden_size else "hidden_size"
        raise HeadMismatchError(f"{where}: {name} {want} does not match the target's {hidden}; this head was trained for another model")
    if spec.vocab_size != vocab:
        raise HeadMismatchError(f"{where}: vocab_size {spec.vocab_size} does not match the target's lm_head rows {vocab}; this head was trained for another model")
    L = num_target_layers(target_model.config)
    layers = spec.aux_layers or default_feature_layers(L)
    if spec.aux_layers is None and L < MIN_TARGET_LAYERS:
        raise HeadMismatchError(f"{where}: the target has {L} layers; an EAGLE-3 head reads the inputs of layers 2, L//2 and L-3, "
                                f"which needs at least {MIN_TARGET_LAYERS}")
    if len(layers) != 3 or not all(0 <= k < L for k in layers):
        raise HeadMismatchError(f"{where}: feature layers {list(layers)} are not three layers of a {L}-layer target")


def check_eagle3_weights(spec: Eagle3Spec, sd: dict[str, torch.Tensor], where: str) -> None:
    """Shapes and the d2t range, before any weight is copied."""
    lm = sd.get("lm_head.weight")
    if lm is not None and lm.shape[0] != spec.draft_vocab:
        raise HeadMismatchError(f"{where}: lm_head.weight has {lm.shape[0]} rows but draft_vocab_size is {spec.draft_vocab}")
    d2t = sd.get("d2t")
    if d2t is not None:
        if d2t.dim() != 1 or d2t.numel() != spec.draft_vocab or d2t.is_floating_point():
            raise HeadMismatchError(f"{where}: d2t must be {spec.draft_vocab} integer offsets, has shape {tuple(d2t.shape)} ({d2t.dtype})")
        target = torch.arange(d2t.numel()) + d2t.long()
        if int(target.min()) < 0 or int(target.max()) >= spec.vocab_size:
            raise HeadMismatchError(f"{where}: d2t maps draft ids to target ids {int(target.min())}..{int(target.max())}, "
                                    f"outside the vocabulary 0..{spec.vocab_size - 1}")
    elif spec.draft_vocab != spec.vocab_size:
        raise HeadMismatchError(f"{where}: no d2t, but draft_vocab_size {spec.draft_vocab} differs from vocab_size {spec.vocab_size}")
    owns = bool(spec.target_hidden_size) and spec.target_hidden_size != spec.hidden_size
    if owns and "embed_tokens.weight" not in sd:
        raise HeadMismatchError(f"{where}: hidden size {spec.hidden_size} differs from target_hidden_size {spec.target_hidden_size}, "
                                "so the head needs its own embed_tokens.weight, and it has none")


def build_eagle3_head(spec: Eagle3Spec, sd: dict[str, torch.Tensor], where: str = "EAGLE-3 head") -> Eagle3Head:
    check_eagle3_weights(spec, sd, where)
    head = Eagle3Head(spec)
    own = head.head_state_dict()
    sd = dict(sd)
    if "d2t" not in sd:  # a full-vocabulary head may leave out the identity maps
        sd["d2t"], sd["t2d"] = own["d2t"], own["t2d"]
    sd.setdefault("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool).index_fill_(0, torch.arange(spec.draft_vocab) + sd["d2t"].long(), True))
    missing = sorted(set(own) - set(sd))
    if missing:
        raise HeadMismatchError(f"{where}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}; not an EAGLE-3 head?")
    unknown = sorted(set(sd) - set(own))
    if unknown:
        raise HeadMismatchError(f"{where}: unexpected tensors {unknown[:4]} for an EAGLE-3 head")
    for k, v in sd.items():
        if v.shape != own[k].shape:
            raise HeadMismatchError(f"{where}: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)} from its config.json")
    head.load_state_dict({k: (v.long() if k == "d2t" else v.bool() if k == "t2d" else v) for k, v in sd.items()})
    head.float()
    return head
