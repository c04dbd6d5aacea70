"""The baseline: Hugging Face `generate` on the same model object, dtype, device and sampling.

Behind the same API as the EAGLE-2 decoder (events, then a Summary), so every comparison is
like for like: same EOS ids, same token budget, and the same GenerationConfig the EAGLE-2 side
builds its logits processors from (sampling.generation_config_for: sampling on or off,
temperature, top-k, top-p, repetition penalty, and whatever else the model's config sets).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from transformers import LogitsProcessorList

from . import rowgemm
from .events import GenerationSettings, StepEvent, StopChecker, Summary, collect
from .sampling import generation_config_for
from .target import context_length, model_eos_ids


class VanillaDecoder:
    def __init__(self, model, tokenizer=None, compiled: bool = False, **generate_kwargs):
        self.model = model
        self.tokenizer = tokenizer
        self.extra = generate_kwargs  # e.g. prompt_lookup_num_tokens, assistant_model
        if compiled:
            # transformers' documented fast path: a static cache, and its decoding step through
            # torch.compile (CUDA graphs on a GPU; transformers compiles on CPUs only when asked).
            from transformers import CompileConfig

            cfg = CompileConfig(fullgraph=True, mode="reduce-overhead")
            if model.get_output_embeddings().weight.device.type == "cpu":
                cfg = CompileConfig(fullgraph=True, mode="default")
                cfg._compile_all_devices = True
            self.extra.update(cache_implementation="static", compile_config=cfg)

    @torch.no_grad()
    def stream(self, prompt_ids, gen: GenerationSettings | None = None) -> Iterator[StepEvent | Summary]:
        gen = gen or GenerationSettings()
        dev = self.model.get_output_embeddings().weight.device
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).view(1, -1)
        eos = sorted(gen.eos_token_ids if gen.eos_token_ids is not None else model_eos_ids(self.model, self.tokenizer))
        max_pos = context_length(self.model.config)
        max_new = max(0, min(gen.max_new_tokens, max_pos - ids.shape[1]))
        # Every setting in one explicit GenerationConfig, the one the EAGLE-2 side processes its
        # logits with; while generate runs it is also the model's own, because generate fills
        # each field left None from model.generation_config (bad_words_ids, say, even when the
        # settings say not to use the model's config).
        cfg = generation_config_for(gen, self.model.generation_config)
        model_kw = cfg.update(**self.extra)  # generation fields of the extras (prompt lookup, a static cache) go in too
        # set directly, not through update(): its validation refuses max_new_tokens 0 (no room: generate is not called)
        cfg.max_new_tokens, cfg.max_length, cfg.eos_token_id, cfg.pad_token_id = max_new, None, eos or None, (eos[0] if eos else 0)
        cfg.stop_strings, cfg.max_time = (list(gen.stop_strings) if gen.stop_strings and self.tokenizer is not None else None), None
        if not cfg.do_sample:  # unused when greedy; None keeps generate from warning about them
            cfg.temperature = cfg.top_k = cfg.top_p = cfg.min_p = None
        if cfg.stop_strings:
            model_kw["tokenizer"] = self.tokenizer
        if gen.constraint is not None:
            # the same grammar mask eagle2 applies, as generate's own `logits_processor` (after
            # its processors, before its warpers: where sampling.build_processors puts it)
            from .structured import GrammarMask

            vocab = self.model.get_output_embeddings().weight.shape[0]
            model_kw["logits_processor"] = LogitsProcessorList([GrammarMask(gen.constraint, self.tokenizer, vocab, ids.shape[1], eos)])
        if gen.seed is not None:
            torch.manual_seed(gen.seed)
        own = self.model.generation_config
        # A target held as blocks only rebuilds each float32 weight for transformers'
        # own F.linear as generate reaches it (rowgemm.FloatlessLinear): the bits of the float32
        # model, but time the float32 model does not spend, so it is taken out of the wall time.
        rebuilt0 = rowgemm.REBUILD["seconds"]
        t0 = time.perf_counter()
        try:
            self.model.generation_config = cfg
            with rowgemm.rebuild_scratch():
                out = self.model.generate(ids, generation_config=cfg, attention_mask=torch.ones_like(ids), **model_kw)[0, ids.shape[1]:].tolist() if max_new > 0 else []
        finally:
            self.model.generation_config = own
        wall = time.perf_counter() - t0 - (rowgemm.REBUILD["seconds"] - rebuilt0)
        stop = StopChecker(gen, self.tokenizer, set(eos), max_pos, ids.shape[1])
        emitted = stop.push(out)
        if not stop.reason:
            stop.reason = "length"
        yield StepEvent(emitted, accepted=0, tree_size=1, draft_s=0.0, verify_s=wall)
        summary = Summary(prompt_tokens=ids.shape[1], target_forwards=len(emitted), cycles=len(emitted))
        summary.finish(stop, wall)
        yield summary

    def generate(self, prompt_ids, gen: GenerationSettings | None = None) -> tuple[list[int], Summary]:
        return collect(self.stream(prompt_ids, gen))
