"""Target-side logits processing: what Hugging Face `generate` applies to the target's logits, in its order.

Losslessness means the emitted tokens follow the target's *processed* distribution: greedy takes
the argmax of the processed scores, sampling draws from their softmax, exactly as `generate`
does. So the scores are built with transformers' own processor classes, in the order and under
the conditions of `GenerationMixin._get_logits_processor` (transformers 5.24): first the
processors (repetition penalty, no-repeat n-grams, bad words, minimum length, ...), then, when
sampling, the warpers (temperature, top-k, top-p, min-p, ...).

Many processors read the sequence so far (`input_ids`). In a draft tree each node has its own
sequence: the committed context plus the tokens on the path from the root to that node. Nodes at
one depth have sequences of one length, so `TargetProcessors.tree_scores` makes one processor
call per depth, each row with its own history: exact, and cheap.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor, EncoderRepetitionPenaltyLogitsProcessor, EpsilonLogitsWarper, EtaLogitsWarper,
    ExponentialDecayLengthPenalty, ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor,
    LogitNormalization, LogitsProcessorList, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
    NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopHLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

from .events import samples
from .loading import LoadError
from .structured import grammar_mask
from .tree import DraftTree

# Processors whose output depends on the scores alone (never on input_ids): applied to all rows at once.
HISTORY_FREE = (TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper, InfNanRemoveLogitsProcessor,
                SuppressTokensLogitsProcessor, LogitNormalization)

# generation_config fields eagle2 cannot reproduce exactly: (field, is it on?, why). Each is
# refused in one line rather than dropped. Classifier-free guidance runs a second, unconditional
# forward with its own cache; watermarking keys on state we would have to replay per node; the
# rest are other decoding algorithms (beams, contrastive, DoLa) or several sequences per prompt.
REFUSED = (
    ("guidance_scale", lambda v: v is not None and v != 1, "classifier-free guidance, a second unconditional forward"),
    ("watermarking_config", lambda v: v is not None, "watermarking"),
    ("num_beams", lambda v: v is not None and v > 1, "beam search"),
    ("num_beam_groups", lambda v: v is not None and v > 1, "group beam search"),
    ("diversity_penalty", lambda v: bool(v), "group beam search"),
    ("constraints", lambda v: bool(v), "constrained beam search"),
    ("force_words_ids", lambda v: bool(v), "constrained beam search"),
    ("penalty_alpha", lambda v: v is not None and v > 0, "contrastive search"),
    ("dola_layers", lambda v: v is not None, "DoLa decoding"),
    ("num_return_sequences", lambda v: v is not None and v > 1, "several sequences per prompt"),
    ("token_healing", lambda v: bool(v), "token healing, which rewrites the prompt"),
)
OFF_FLAG = "--no-generation-config"  # the CLI flag that ignores the model's generation_config


class UnsupportedGeneration(LoadError):
    """The model's generation_config asks for something eagle2 cannot apply exactly (one line: field, why, the flag)."""


def generation_config_for(gen, model_config: GenerationConfig | None) -> GenerationConfig:
    """The GenerationConfig both sides run (EAGLE-2 here, `generate` in vanilla.py).

    The model's generation_config when `gen.use_generation_config` (else transformers' plain
    one), its unset fields filled with transformers' global defaults as `generate` fills them,
    then `gen`'s own fields on top: do_sample = temperature > 0, temperature, top-p, top-k,
    min-p, repetition penalty, no-repeat n-gram size. Raises UnsupportedGeneration for a field
    of the model's that eagle2 cannot apply exactly (REFUSED).
    """
    base = model_config if (gen.use_generation_config and model_config is not None) else GenerationConfig()
    cfg = copy.deepcopy(base)
    cfg.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    for name, on, why in REFUSED:
        value = getattr(cfg, name, None)
        if on(value):
            raise UnsupportedGeneration(f"the model's generation_config sets {name}={value!r} ({why}), which eagle2 cannot "
                                        f"apply exactly; {OFF_FLAG} ignores the model's generation settings")
    sample = samples(gen.temperature)  # a temperature too small to divide by is greedy (events.GREEDY_BELOW)
    cfg.do_sample = sample
    cfg.temperature = float(gen.temperature) if sample else 1.0
    cfg.top_p, cfg.top_k = float(gen.top_p), int(gen.top_k)
    cfg.min_p = float(gen.min_p) if gen.min_p else None
    cfg.repetition_penalty = float(gen.repetition_penalty)
    cfg.no_repeat_ngram_size = int(gen.no_repeat_ngram_size)
    return cfg


def settings_from_model(model_config: GenerationConfig | None, overrides: dict | None = None, *, use_generation_config: bool = True,
                        sample_by_default: bool = True):
    """GenerationSettings with the model's generation_config as the default and `overrides`
    (the user's flags, None = not given) on top; `temperature` 0 means greedy.

    What the model's config says is read as `generate` reads it (unset fields take
    transformers' global defaults: top_k 50 when sampling unless the config says otherwise).
    Sampling is on by default when the config has do_sample; `sample_by_default=False` (compare,
    whose identity count needs greedy) ignores that unless the user gives a temperature. Without
    the model's config, eagle2's own defaults (greedy, top-k and top-p off).
    """
    from .events import GenerationSettings

    base = GenerationSettings(use_generation_config=use_generation_config)
    if use_generation_config and model_config is not None:
        cfg = copy.deepcopy(model_config)
        cfg.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
        base.temperature = float(cfg.temperature) if (cfg.do_sample and sample_by_default and cfg.temperature) else 0.0
        base.top_p = float(cfg.top_p) if cfg.top_p is not None else 1.0
        base.top_k = int(cfg.top_k or 0)
        base.min_p = float(cfg.min_p or 0.0)
        base.repetition_penalty = float(cfg.repetition_penalty or 1.0)
        base.no_repeat_ngram_size = int(cfg.no_repeat_ngram_size or 0)
    for k, v in (overrides or {}).items():
        if v is not None:
            setattr(base, k, v)
    return base


def build_processors(cfg: GenerationConfig, prompt: torch.Tensor, eos: torch.Tensor | None, device, extra=()) -> LogitsProcessorList:
    """The processors `generate` builds for `cfg` and a decoder-only prompt (1-D ids), in its order
    (`_get_logits_processor`, transformers 5.24) and with its classes; `cfg` is prepared as
    `generate` prepares it (max_length, min_length), `eos` the EOS ids tensor or None. `extra`
    (a grammar's mask) goes where `generate` puts a caller's own `logits_processor`: after its
    processors, before the warpers."""
    L = int(prompt.numel())
    procs = LogitsProcessorList()
    if cfg.sequence_bias is not None:
        procs.append(SequenceBiasLogitsProcessor(sequence_bias=cfg.sequence_bias))
    # generate hands a decoder-only model's prompt in as the "encoder" ids
    if cfg.encoder_repetition_penalty is not None and cfg.encoder_repetition_penalty != 1.0:
        procs.append(EncoderRepetitionPenaltyLogitsProcessor(penalty=cfg.encoder_repetition_penalty, encoder_input_ids=prompt[None]))
    if cfg.repetition_penalty is not None and cfg.repetition_penalty != 1.0:
        # generate passes the attention mask's padding lengths; an unpadded prompt has none, which is None here
        procs.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.no_repeat_ngram_size is not None and cfg.no_repeat_ngram_size > 0:
        procs.append(NoRepeatNGramLogitsProcessor(cfg.no_repeat_ngram_size))
    if cfg.encoder_no_repeat_ngram_size is not None and cfg.encoder_no_repeat_ngram_size > 0:
        procs.append(EncoderNoRepeatNGramLogitsProcessor(cfg.encoder_no_repeat_ngram_size, prompt[None]))
    if cfg.bad_words_ids is not None:
        procs.append(NoBadWordsLogitsProcessor(cfg.bad_words_ids, eos))
    if cfg.min_length is not None and eos is not None and cfg.min_length > 0:
        procs.append(MinLengthLogitsProcessor(cfg.min_length, eos, device=device))
    if cfg.min_new_tokens is not None and eos is not None and cfg.min_new_tokens > 0:
        procs.append(MinNewTokensLengthLogitsProcessor(L, cfg.min_new_tokens, eos, device=device))
    if cfg.forced_bos_token_id is not None:
        procs.append(ForcedBOSTokenLogitsProcessor(cfg.forced_bos_token_id))
    if cfg.forced_eos_token_id is not None:
        procs.append(ForcedEOSTokenLogitsProcessor(cfg.max_length, cfg.forced_eos_token_id, device=device))
    if cfg.remove_invalid_values is True:
        procs.append(InfNanRemoveLogitsProcessor())
    if cfg.exponential_decay_length_penalty is not None and eos is not None:  # it penalises EOS: nothing to do without one
        procs.append(ExponentialDecayLengthPenalty(cfg.exponential_decay_length_penalty, eos, L))
    if cfg.suppress_tokens is not None:
        procs.append(SuppressTokensLogitsProcessor(cfg.suppress_tokens, device=device))
    if cfg.begin_suppress_tokens is not None:
        begin = L if (L > 1 or cfg.forced_bos_token_id is None) else L + 1
        procs.append(SuppressTokensAtBeginLogitsProcessor(cfg.begin_suppress_tokens, begin, device=device))
    procs.extend(extra)
    if cfg.do_sample:  # the warpers, with one sequence (min_tokens_to_keep 1)
        if cfg.temperature is not None and cfg.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(cfg.temperature))
        if cfg.top_h is not None:
            procs.append(TopHLogitsWarper(top_h=cfg.top_h))
        if cfg.top_k is not None and cfg.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=cfg.top_k))
        if cfg.top_p is not None and cfg.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=cfg.top_p))
        if cfg.min_p is not None:
            procs.append(MinPLogitsWarper(min_p=cfg.min_p))
        if cfg.typical_p is not None and cfg.typical_p < 1.0:
            procs.append(TypicalLogitsWarper(mass=cfg.typical_p))
        if cfg.epsilon_cutoff is not None and 0.0 < cfg.epsilon_cutoff < 1.0:
            procs.append(EpsilonLogitsWarper(epsilon=cfg.epsilon_cutoff))
        if cfg.eta_cutoff is not None and 0.0 < cfg.eta_cutoff < 1.0:
            procs.append(EtaLogitsWarper(epsilon=cfg.eta_cutoff, device=device))
    if cfg.renormalize_logits is True:  # last, as in generate
        procs.append(LogitNormalization())
    return procs


# Fields that shape the scores, with the value that turns each off (what `describe` leaves out).
# Sampling always reports temperature, top_k and top_p; greedy ignores every warper.
WARPER_OFF = {"temperature": None, "top_k": None, "top_p": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
              "eta_cutoff": 0.0, "top_h": None}
PROCESSOR_OFF = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
                 "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "min_new_tokens": None,
                 "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
                 "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                 "renormalize_logits": False}


class TargetProcessors:
    """The target's logits processing for one generation: `generate`'s processors, in its order.

    Built once per generation from `gen` (GenerationSettings), the model's generation_config,
    the prompt (1-D ids), the EOS ids both sides stop at, and the new-token budget (for
    forced_eos_token_id's max_length; None = unbounded). Greedy takes the argmax of
    `tree_scores`, sampling their softmax (the warpers are in the same ordered list). With no
    processor at all (the default greedy run) every method returns the logits untouched.
    """

    def __init__(self, gen, model_config: GenerationConfig | None, prompt, eos_ids=(), max_new_tokens: int | None = None, device=None,
                 tokenizer=None, vocab_size: int | None = None):
        """`tokenizer` and `vocab_size` (the lm_head's rows): what a constrained `gen` (its
        `constraint`, structured.py) needs to build its grammar's mask."""
        prompt = torch.as_tensor(prompt, dtype=torch.long).view(-1)
        device = device if device is not None else prompt.device
        cfg = generation_config_for(gen, model_config)
        L = prompt.numel()
        # as generate prepares them: lengths count the prompt
        cfg.max_length = L + (max_new_tokens if max_new_tokens is not None else 1 << 30)
        if cfg.min_new_tokens is not None:
            cfg.min_length = cfg.min_new_tokens + L
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device) if eos_ids else None
        self.config = cfg
        self.sampling = bool(cfg.do_sample)
        # the grammar's mask (structured.GrammarMask): one more processor, reading each row's own sequence
        self.grammar = grammar_mask(gen, tokenizer, vocab_size, L, eos_ids)
        self.processors = build_processors(cfg, prompt.to(device), eos, device, () if self.grammar is None else (self.grammar,))
        self.reads_history = any(not isinstance(p, HISTORY_FREE) for p in self.processors)

    @property
    def active(self) -> bool:
        """Whether any processor runs (False: scores are the logits themselves)."""
        return len(self.processors) > 0

    def names(self) -> list[str]:
        return [type(p).__name__ for p in self.processors]

    def scores(self, logits: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """Processed scores [n, V] (float32) of `logits` [n, V] whose rows follow the sequences
        `input_ids` [n, L] (None only when no processor reads them)."""
        if not self.processors:
            return logits
        return self.processors(input_ids, logits.float())

    def tree_scores(self, logits: torch.Tensor, history: torch.Tensor, tree: DraftTree, nodes: torch.Tensor | None = None) -> torch.Tensor:
        """Processed scores for tree nodes: row r is node nodes[r]'s next-token scores.

        logits  [n, V] float32: the target's logits at the tree nodes `nodes` (LongTensor [n] of
                node indices, any order; None = all N nodes in index order, n = N);
        history LongTensor [L]: every token before the tree's root, i.e. the prompt plus all
                tokens emitted so far except the last one, which is the root (node 0). L is the
                committed length, the root's position;
        tree    the DraftTree whose node i sits at depth tree.depth[i].
        Node i's row gets the processors with input_ids = history + the tokens on the path
        root..i (length L + depth_i + 1), exactly what `generate` passes when that path has been
        emitted. One processor call per depth present. Returns the logits themselves when no
        processor applies, and one call over all rows when none reads input_ids.
        """
        if not self.processors:
            return logits
        if not self.reads_history:
            return self.processors(None, logits.float())
        dev = logits.device
        nodes = torch.arange(tree.size, device=dev) if nodes is None else nodes.to(dev)
        out = torch.empty(logits.shape, dtype=torch.float32, device=dev)
        depth = tree.depth.to(dev)[nodes]
        hist = history.to(dev).view(1, -1)
        for d in sorted(set(depth.tolist())):
            rows = torch.nonzero(depth == d).flatten()
            sel = nodes[rows]
            # ancestors rows, in index order, are the path root..node (parents precede children)
            anc = tree.ancestors.to(dev)[sel]
            path = tree.tokens.to(dev)[None].expand(sel.numel(), -1)[anc].view(sel.numel(), d + 1)
            ids = torch.cat([hist.expand(sel.numel(), -1), path], dim=1)
            out[rows] = self.processors(ids, logits[rows].float())
        if self.grammar is not None:  # back to the committed text: whatever the tree held leaves no trace
            self.grammar.commit(history[self.grammar.prompt_len :].tolist() + [int(tree.tokens[0])])
        return out

    def describe(self) -> dict:
        """The settings that shape the scores, as generation_config fields, and the processors in
        order: what both sides ran (vanilla.py hands `generate` this same config)."""
        cfg = self.config
        out = {"do_sample": bool(cfg.do_sample)}
        if cfg.do_sample:
            out.update(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
            out.update({k: getattr(cfg, k) for k, off in WARPER_OFF.items() if k not in out and getattr(cfg, k, off) not in (off, None)})
        out.update({k: getattr(cfg, k) for k, off in PROCESSOR_OFF.items() if getattr(cfg, k, off) not in (off, None)})
        if cfg.min_new_tokens is None and cfg.min_length:  # min_length counts the prompt; min_new_tokens sets it itself
            out["min_length"] = cfg.min_length
        out["processors"] = self.names()
        return out

    def label(self) -> str:
        """One line for a table title: greedy or sampling, and every field that shapes the scores."""
        d = {k: v for k, v in self.describe().items() if k not in ("do_sample", "processors")}
        head = "sampling" if self.sampling else "greedy"
        return head + (": " + ", ".join(f"{k} {v}" for k, v in d.items()) if d else "")


def generation_label(gen, model_config=None) -> str:
    """`TargetProcessors.label` without a prompt (for reports before any generation), the
    constraint (structured.py) named last."""
    c = getattr(gen, "constraint", None)
    label = TargetProcessors(_unconstrained(gen), model_config, torch.zeros(1, dtype=torch.long)).label()
    return label + (f", constrained to a {c.label()}" if c is not None else "")


def generation_description(gen, model_config=None) -> dict:
    c = getattr(gen, "constraint", None)
    out = TargetProcessors(_unconstrained(gen), model_config, torch.zeros(1, dtype=torch.long)).describe()
    if c is not None:
        out["constraint"] = c.label()
    return out


def _unconstrained(gen):
    """`gen` without its constraint: what reports build their processors from (no tokenizer there)."""
    return dataclasses.replace(gen, constraint=None) if getattr(gen, "constraint", None) is not None else gen
