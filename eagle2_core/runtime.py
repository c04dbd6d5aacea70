"""A loaded target + draft head + settings, ready to build decoders: what every command starts from.

`--draft random` gives a freshly initialised head (no speedup; for tests and demos before a
trained head exists). No terminal code here.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass, field

import torch

from . import rowgemm
from .costs import BATCH_TREES, plan, prior_expected
from .engine import Engine
from .events import GenerationSettings
from .head import DraftHead, HeadSpec
from .loading import LoadedTarget, LoadError, chunk_checks, default_head_for, load_draft_head, load_target
from .measure import load_or_measure, load_or_measure_batch
from .prompts import SplicedIds, encode_chat
from .quantization import head_blocks
from .sources import parse_sources
from .sampling import generation_description, generation_label, settings_from_model
from .target import context_length
from .treesettings import BATCH_DEPTH, BATCH_TOP_K, TreeSettings, auto_max, device_trees
from .vanilla import VanillaDecoder

RANDOM_HEAD = "random"
NO_HEAD = "none"  # `--draft none`: the head-free draft sources alone (sources.py)


def supports_graph(tree: TreeSettings) -> bool:
    """Fixed mode (cycle.py: fixed shapes, captured) takes the dynamic tree with a constant budget; other trees run live."""
    return tree.shape == "dynamic" and tree.budget == "constant"


def uncaptured_notice(tree: TreeSettings) -> str:
    """The one line `--compile` gets for a tree it cannot capture, saying what runs instead."""
    if tree.budget == "auto":
        why = "the per-cycle budget (--total-tokens auto) sizes every cycle's tree anew, which graph mode (fixed shapes) cannot capture"
        fix = "--total-tokens N"
    else:
        why = f"the {tree.shape} draft shape has no graph-mode cycle to capture"
        fix = "--draft-shape dynamic with --total-tokens N"
    return f"--compile: {why}; running it uncaptured, as without --compile (capture needs {fix})"


def capture_choice(device, tree: TreeSettings, compile: bool | None) -> tuple[str | None, bool]:
    """(torch.compile backend or None, graph mode?) for `--compile/--no-compile` (None: the default).

    On CUDA the cycle runs on static buffers with one host read and is captured as CUDA graphs
    by default: host overhead is what a small model's cycle is made of there. On a CPU the
    uncaptured default path is kept: inductor's few-row products were measured slower than the
    eager path's rowgemm ones (docs/gpu.md), and a CPU does not wait on host reads."""
    kind = torch.device(device).type
    if not supports_graph(tree):
        return None, False
    if compile is None:
        compile = kind == "cuda"
    if not compile:
        return None, kind == "cuda"
    return ("cuda-graphs" if kind == "cuda" else "inductor"), True


def choose_arithmetic(target: LoadedTarget, exact: bool) -> tuple[str, str | None]:
    """(arithmetic, a note or None): int8 for a CPU float32 target held as blocks unless `exact`
    asks for the dequantized float32 model's bits; exact for everything else."""
    w = target.model.get_output_embeddings().weight
    held_as_blocks = target.block_bytes > 0 and w.device.type == "cpu" and w.dtype == torch.float32
    if exact or not held_as_blocks:
        return "exact", None
    if not rowgemm.have_int8():
        return "exact", "no int8 kernels are built here: products run exact (float32 over the dequantized blocks)"
    return "int8", None


def apply_arithmetic(target: LoadedTarget, exact: bool, interleave: bool = True) -> tuple[str, str | None]:
    """choose_arithmetic, then set it; in int8 the target's block weights get the layout the int8
    kernel streams (rowgemm.interleave), before anything is timed, unless `interleave` is False
    (the caller interleaves later: the same bits, a copy of every weight saved before a first answer)."""
    arith, why = choose_arithmetic(target, exact)
    rowgemm.set_arithmetic(arith)
    if arith == "int8" and interleave:
        rowgemm.interleave(target.model)
    return arith, why


def random_head(target: LoadedTarget, seed: int = 0) -> DraftHead:
    """An untrained head shaped for the target (tau near 1: for tests and demos only)."""
    g = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        head = DraftHead(HeadSpec.for_target(target.model.config))
    finally:
        torch.random.set_rng_state(g)
    head.metadata = {"random": True}
    return head.bind(target.model)


def load_head(draft: str | None, target: LoadedTarget) -> DraftHead | None:
    """`--draft` semantics: None = shipped/registry default (None where no head is known: the
    head-free sources draft alone), "none" = no head, "random" = untrained, else folder or hub id."""
    if draft == NO_HEAD or (draft is None and default_head_for(target.name) is None):
        return None
    if draft == RANDOM_HEAD:
        return random_head(target)
    try:
        return load_draft_head(draft, target)
    except LoadError as e:
        if draft is None:
            raise LoadError(f"{e} (or --draft random for an untrained head: correct output, no speedup)") from e
        raise


@dataclass
class Runtime:
    target: LoadedTarget
    head: DraftHead | None
    tree: TreeSettings
    gen: GenerationSettings
    system_prompt: str | None = None
    chat_template: str | None = None
    draft_name: str = ""
    costs: object = field(default=None, repr=False)  # the measured CostProfile, loaded on first need
    compile: str | None = None  # torch.compile backend of the fixed-mode cycle (cycle.py), None = uncaptured
    graph: bool = False         # graph mode: fixed shapes on static buffers (on with compile, and on CUDA by default)
    _decoders: dict = field(default_factory=dict, repr=False)  # one per setting: a captured cycle is compiled once
    auto_tree: TreeSettings | None = None  # the per-cycle budget's settings (`--total-tokens auto`, `compare --against auto`)
    constant_tree: TreeSettings | None = None  # the tree with a constant budget (`--total-tokens N`; graph mode, tree:N/D/K sweeps)
    notices: list[str] = field(default_factory=list)  # what was asked for and is not done, one line each, for the CLI to show
    sources: tuple = ()  # the draft sources every decoder runs (sources.py): "head", "recycle", "match"
    # kept sequences (prefix.py), shared by every decoder of this runtime: KV depends on the model
    # and head only, not on the tree or the generation settings. None: every prompt prefilled whole
    prefix_cache: object = field(default=None, repr=False)
    arithmetic: str = "exact"  # the products' arithmetic (rowgemm.ARITHMETICS): int8 or exact
    layout_due: bool = False  # int8 weights not yet in the kernel's interleaved layout (`settle`)
    checks_due: bool = False  # the floatless weights' chunking check not yet made (`settle`, `vanilla`)

    @classmethod
    def load(cls, model: str | None = None, draft: str | None = None, *, dtype: str = "auto", device: str = "auto",
             device_map: str | None = None, load_in_8bit: bool = False, load_in_4bit: bool = False,
             trust_remote_code: bool = False, tree: dict | None = None, gen: GenerationSettings | None = None,
             system_prompt: str | None = None, chat_template: str | None = None, need_head: bool = True,
             compile: bool | None = None, gen_overrides: dict | None = None, use_generation_config: bool = True,
             sample_by_default: bool = True, draft_sources: str | None = None, exact: bool = False,
             defer_layout: bool = False) -> "Runtime":
        """`gen` is used as given; without it the settings come from the model's generation_config
        with `gen_overrides` (the user's flags, None = not given) on top (sampling.settings_from_model).
        `defer_layout`: int8 weights stay in the file's layout until `settle` (a chat's first
        answer comes before the copy of every weight), and the floatless weights' chunking check
        (loading.chunk_checks) waits for `settle` or the first `vanilla`."""
        try:  # a bad EAGLE2_KERNEL is said before anything loads
            rowgemm.env_forced()
        except ValueError as e:
            raise LoadError(str(e)) from None
        target = load_target(model, dtype=dtype, device=device, device_map=device_map, load_in_8bit=load_in_8bit,
                             load_in_4bit=load_in_4bit, trust_remote_code=trust_remote_code, defer_checks=defer_layout)
        arith, why = apply_arithmetic(target, exact, interleave=not defer_layout)  # before the cost profile: its key names the arithmetic
        if why:
            target.notes = list(target.notes or []) + [why]
        model_gen = getattr(target.model, "generation_config", None)
        if gen is None:
            gen = settings_from_model(model_gen, gen_overrides, use_generation_config=use_generation_config,
                                      sample_by_default=sample_by_default)
        generation_description(gen, model_gen)  # a field eagle2 cannot apply exactly is refused now, in one line
        head = load_head(draft, target) if need_head else None
        try:
            sources = parse_sources(draft_sources, head is not None) if need_head else ()
        except ValueError as e:
            raise LoadError(str(e)) from None
        if head is not None and "head" not in sources:
            head = None  # pinned to head-free sources
        if head is not None and os.environ.get("EAGLE2_HEAD_BLOCKS", "1") != "0":
            head_blocks(head)  # a float32 head's weights as 8-bit rows on a CPU: a draft step reads a quarter (quantization.py)
        out = target.model.get_output_embeddings().weight
        tree = dict(tree or {})
        costs = None
        if out.device.type == "cpu" and (head is not None or sources):
            # measured once per machine, model, dtype and threads, then cached: the default tree of a
            # half-precision target and greedy acceptance's lm_head plan follow it. Before a first
            # answer only the quick probes run; the per-cycle budget refines them from its cycles
            costs = load_or_measure(target.model, head, quick=True)
        try:
            settings, auto, constant_tree = device_trees(out.device, out.dtype, costs, tree, compile)
        except ValueError as e:
            raise LoadError(str(e)) from None
        backend, graph = capture_choice(out.device, settings, compile)
        notices = ([uncaptured_notice(settings)] if compile and not supports_graph(settings) else []) + list(target.notes or [])
        if need_head and draft is None and head is None and sources:
            notices.append(f"no draft head known for {target.name}: drafting from the head-free sources ({' + '.join(sources)}); "
                           "output is the same, `eagle2 train` makes a head")
        if os.environ.get("EAGLE2_GC_FREEZE", "1") == "1":
            # What is loaded now (the model's modules and tensors, the tokenizer, the imported
            # libraries: millions of objects) lives as long as the process. Python's full
            # collections walk every tracked object, and a drafting cycle allocates enough small
            # ones (the sources' trees, lists of ids) to trigger them: perf found a steady share of
            # each decoding step there (docs/benchmarks.md). Frozen, a collection walks only what
            # was made after this point. No collection first: after loading SmolLM2 it freed next
            # to nothing and lengthened every start-up.
            gc.freeze()
        return cls(target, head, settings, gen, system_prompt, chat_template, arithmetic=arith, layout_due=arith == "int8" and defer_layout,
                   checks_due=defer_layout and bool(target.floatless_bytes),
                   draft_name=("none" if head is None and (need_head or tree.get("total_tokens") == 1) else draft or default_head_for(target.name) or ""), costs=costs,
                   compile=backend, graph=graph, auto_tree=auto, constant_tree=constant_tree, notices=notices, sources=sources)

    def settle(self) -> None:
        """What loading left for after a first answer (`defer_layout`): the int8 kernel's layout, the chunking check."""
        self._checks()
        if self.layout_due:
            self.layout_due = False
            rowgemm.interleave(self.model)

    def _checks(self) -> None:
        if self.checks_due:
            self.checks_due = False
            chunk_checks(self.model)

    @property
    def auto_max(self) -> int:
        """The largest tree `--total-tokens auto` may choose on this device."""
        return auto_max(self.model.get_output_embeddings().weight.device)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def model(self):
        return self.target.model

    @property
    def max_positions(self) -> int:
        return context_length(self.model.config)

    @property
    def head_is_random(self) -> bool:
        return bool((getattr(self.head, "metadata", None) or {}).get("random"))

    def describe(self) -> dict:
        """Model, head, device, dtype and all settings, for reports (compare --json, chat /save)."""
        return {"model": self.target.name, "source": self.target.source, "draft": self.draft_name,
                "head_kind": getattr(self.head, "kind", None),
                "device": str(self.model.get_output_embeddings().weight.device),
                "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
                "generation": self.generation_fields(), "generation_config": self.generation_settings(),
                "tree": dataclasses.asdict(self.tree), "gguf_block_bytes": self.target.block_bytes, "arithmetic": self.arithmetic}

    def generation_fields(self) -> dict:
        """`self.gen` as a dict, its constraint (structured.Constraint) by kind and source, not its compiled grammar."""
        g = dataclasses.asdict(dataclasses.replace(self.gen, constraint=None))
        c = self.gen.constraint
        g["constraint"] = None if c is None else {"kind": c.kind, "name": c.name, "source": c.source}
        return g

    def generation_settings(self) -> dict:
        """The generation_config fields that shape the target's scores, and its processors in
        order: what both the EAGLE-2 decoder and vanilla `generate` run with `self.gen`."""
        return generation_description(self.gen, getattr(self.model, "generation_config", None))

    def generation_label(self) -> str:
        """`generation_settings` in one line ("greedy: repetition_penalty 1.3")."""
        return generation_label(self.gen, getattr(self.model, "generation_config", None))

    def encode(self, messages: list[dict], spliced: SplicedIds | None = None, tools=None) -> list[int]:
        """Token ids of a conversation (and `tools`, OpenAI function specs, shown to the model);
        with `spliced`, continuing the ids its earlier turns were generated as (prompts.SplicedIds),
        so a kept cache of the earlier turn serves it whole."""
        if spliced is not None:
            return spliced.encode(self.tokenizer, messages, self.system_prompt, self.chat_template, tools)
        return encode_chat(self.tokenizer, messages, self.system_prompt, self.chat_template, tools)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def eagle(self, tree: TreeSettings | None = None, record_confidence: bool = False, compile: bool | None = None,
              graph: bool | None = None, sources: tuple | None = None) -> Engine:
        """A decoder with this runtime's settings; `tree`, `compile`, `graph` and the draft `sources` override them."""
        tree = tree or self.tree
        if self.head is None and not self.sources:  # nothing drafts (--no-speculation): plain decoding, whatever the tree
            tree = TreeSettings.for_device(self.model.get_output_embeddings().weight.device, self.model.dtype)
        if compile is None:
            backend = self.compile if supports_graph(tree) else None
        else:
            backend = capture_choice(self.model.get_output_embeddings().weight.device, tree, compile)[0]
        graph = bool(backend) or (self.graph if graph is None else graph) and supports_graph(tree)
        sources = self.sources if sources is None else sources
        key = (dataclasses.astuple(tree), record_confidence, graph, backend, id(self.head), sources)
        if key not in self._decoders:
            head = self.head if "head" in sources or not sources else None
            self._decoders[key] = Engine(self.model, head, self.tokenizer, tree,
                                         self.cost_profile() if tree.budget == "auto" else self.costs,
                                         record_confidence=record_confidence, graph=graph, compile=backend, sources=sources)
        self._decoders[key].prefix = self.prefix_cache  # set late: chat's --no-prefix-cache and /reset act on every decoder
        return self._decoders[key]

    def cost_profile(self, remeasure: bool = False):
        """This machine's measured costs for this model and head (cached; `eagle2 tune` remeasures)."""
        if remeasure or self.costs is None:
            self.costs = load_or_measure(self.model, self.head, remeasure=remeasure)
        return self.costs

    def vanilla(self, compiled: bool = False, **generate_kwargs) -> VanillaDecoder:
        self._checks()  # before `generate` rebuilds floats: the check's memory not on top of its
        return VanillaDecoder(self.model, self.tokenizer, compiled=compiled, **generate_kwargs)

    def batch_decoder(self, n_prompts: int, batch_size: int | None = None, tree_tokens: int | str | None = None,
                      depth: int | None = None, top_k: int | None = None, record_confidence: bool = False):
        """(Engine or None, plan) for a prompt file of `n_prompts` prompts.

        The batch size B that maximises tokens per second on this machine is chosen from the
        measured batch costs (costs.BatchCosts) and the head's expected acceptance
        (costs.prior_expected); each cycle's tree is then chosen by the engine's per-cycle
        budget (budget.py), costs keyed by (B, N), up to the grid's largest tree. `batch_size` and
        an int `tree_tokens` pin them (N = 1: plain decoding). None means batch 1 with this
        runtime's tree: `eagle()`, the same engine with one row.
        """
        if batch_size == 1 and tree_tokens != 1:
            return None, {"batch_size": 1, "tree_tokens": "per-prompt decoder", "reason": "pinned"}
        usable = self.head is not None and not self.head_is_random
        depth = depth or BATCH_DEPTH
        top_k = top_k or BATCH_TOP_K
        pinned_n = tree_tokens if isinstance(tree_tokens, int) else None
        if pinned_n is not None and pinned_n > 1 and self.head is None:
            raise LoadError("a tree of more than one node needs a draft head")
        n_max = max(BATCH_TREES) if pinned_n is None else pinned_n
        prior = prior_expected(self.head if usable else None, n_max)
        costs = None
        if batch_size is not None and pinned_n is not None:  # both pinned: nothing to measure or plan
            b, n, table = batch_size, pinned_n, {}
        else:
            costs = load_or_measure_batch(self.model, self.head, depth, top_k)
            b, n, table = plan(costs, n_prompts, prior, batch=batch_size, tree=pinned_n)
        info = {"batch_size": b, "tree_tokens": n, "depth": depth, "top_k": top_k, "expected_tok_s": {f"{k[0]}x{k[1]}": round(v, 1) for k, v in table.items()}}
        if b == 1 and pinned_n != 1:
            # one sequence: the engine with one row and the runtime's tree, whose per-cycle budget
            # already weighs a tree against the root alone
            return None, {**info, "tree_tokens": "per-prompt decoder"}
        head_free = tuple(x for x in self.sources if x != "head")
        if n == 1 and head_free and pinned_n is None and self.costs is not None:
            # the head-free sources cost no draft step: the per-cycle budget weighs their trees
            # against the root alone at every cycle (costs from the one-row profile at B x N rows)
            tree = TreeSettings(total_tokens=max(BATCH_TREES), depth=depth, top_k=top_k, budget="auto")
            return Engine(self.model, None, self.tokenizer, tree, self.cost_profile(), batch=b, sources=head_free,
                          prefix_cache=self.prefix_cache), {**info, "tree_tokens": "per cycle (head-free sources)"}
        if n == 1:
            return Engine(self.model, None, self.tokenizer, batch=b, costs=self.costs, prefix_cache=self.prefix_cache), info
        if pinned_n is not None:
            tree = TreeSettings(total_tokens=n, depth=depth, top_k=top_k)
        else:  # the per-cycle budget, up to the batch grid's largest tree
            tree = TreeSettings(total_tokens=n_max, depth=depth, top_k=top_k, budget="auto")
        profile = self.cost_profile() if self.model.get_output_embeddings().weight.device.type == "cpu" else None
        if tree.budget == "auto" and profile is None:
            tree = dataclasses.replace(tree, budget="constant", total_tokens=n)
        return Engine(self.model, self.head, self.tokenizer, tree, profile, batch=b, batch_costs=costs,
                      record_confidence=record_confidence, prefix_cache=self.prefix_cache, sources=self.sources), info
