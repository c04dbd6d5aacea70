"""The baseline: Hugging Face `generate` on the same model object, dtype, device and sampling.

Behind the same API as the EAGLE-2 decoder (events, then a Summary), so every comparison is
like for like: same EOS ids, same warpers (temperature, top-k, top-p), same token budget.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .events import GenerationSettings, StepEvent, StopChecker, Summary, collect
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
        kw = dict(max_new_tokens=max_new, eos_token_id=eos or None, pad_token_id=(eos[0] if eos else 0),
                  attention_mask=torch.ones_like(ids), **self.extra)
        if gen.temperature > 0:
            kw.update(do_sample=True, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if gen.stop_strings and self.tokenizer is not None:
            kw.update(stop_strings=list(gen.stop_strings), tokenizer=self.tokenizer)
        if gen.seed is not None:
            torch.manual_seed(gen.seed)
        t0 = time.perf_counter()
        out = self.model.generate(ids, **kw)[0, ids.shape[1]:].tolist() if max_new > 0 else []
        wall = time.perf_counter() - t0
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
