"""The options every command shares, as one decorator, and the object they turn into.

Imports of torch/transformers/eagle2_core stay inside functions so `eagle2 --help` and shell
completion are instant.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields

import click


class UserInputError(click.ClickException):
    """Something the user handed us is wrong (model, head, file, option): one line, exit code 2,
    as Click gives for a bad option."""

    exit_code = 2


@dataclass
class CommonOptions:
    model: str | None
    draft: str | None
    draft_sources: str | None
    dtype: str
    device: str
    device_map: str | None
    load_in_8bit: bool
    load_in_4bit: bool
    trust_remote_code: bool
    exact: bool
    temperature: float | None   # None: the model's generation_config (sampling.settings_from_model)
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    no_repeat_ngram_size: int | None
    generation_config: bool     # False: --no-generation-config, the model's generation settings ignored
    max_new_tokens: int
    seed: int | None
    total_tokens: int | str | None
    depth: int | None
    tree_top_k: int | None
    draft_shape: str | None
    system_prompt: str | None
    chat_template: str | None
    compile: bool | None
    no_speculation: bool = False  # plain decoding: no head, no draft source, trees of one node

    def generation_overrides(self) -> dict:
        """The generation flags the user gave (None = not given: the model's generation_config decides)."""
        return {"max_new_tokens": self.max_new_tokens, "seed": self.seed, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "no_repeat_ngram_size": self.no_repeat_ngram_size}

    def tree_overrides(self) -> dict:
        return {"total_tokens": self.total_tokens, "depth": self.depth, "top_k": self.tree_top_k, "shape": self.draft_shape}

    def load(self, console=None, need_head: bool = True, sample_by_default: bool = True, defer_layout: bool = False):
        """Load model and head (a spinner on `console`, normally stderr) into a Runtime.
        `sample_by_default=False` (compare): greedy unless --temperature says otherwise, even
        where the model's generation_config samples; its other settings still apply.
        `defer_layout`: see Runtime.load (the caller calls `settle` after its first answer)."""
        import gc

        # Imports and loading make millions of objects that live as long as the process, so the
        # collector's passes over them are wasted start-up time; Runtime.load freezes them at the end
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._load(console, need_head, sample_by_default, defer_layout)
        finally:
            if collecting:
                gc.enable()

    def _load(self, console, need_head: bool, sample_by_default: bool, defer_layout: bool):
        from eagle2_core.prompts import InputError, load_chat_template, text_problem
        from eagle2_core.runtime import Runtime

        from .ui import status

        tree = self.tree_overrides()
        if tree["total_tokens"] == 1:  # plain decoding: a one-node tree, nothing to draft or load for drafting
            tree["total_tokens"], need_head = None, False
        need_head = need_head and not self.no_speculation
        if self.system_prompt and text_problem(self.system_prompt):  # argv bytes that are not UTF-8: said before loading
            raise InputError(text_problem(self.system_prompt), path="--system-prompt")
        quiet_transformers()
        template = load_chat_template(self.chat_template) if self.chat_template else None
        what = f"Loading {self.model or 'the default model (SmolLM2-135M-Instruct)'}"
        if self.device in ("cpu", "auto") and not native_at_hand():
            what += " (first run on this machine: building eagle2's CPU kernels, about a minute)"
        with status(console, what + "..."):
            rt = Runtime.load(self.model, self.draft, dtype=self.dtype, device=self.device, device_map=self.device_map,
                              load_in_8bit=self.load_in_8bit, load_in_4bit=self.load_in_4bit,
                              trust_remote_code=self.trust_remote_code, tree=tree,
                              gen_overrides=self.generation_overrides(), use_generation_config=self.generation_config,
                              sample_by_default=sample_by_default, system_prompt=self.system_prompt, chat_template=template,
                              need_head=need_head, compile=self.compile, draft_sources=self.draft_sources, exact=self.exact,
                              defer_layout=defer_layout)
        for line in rt.notices if console is not None else ():
            console.print(f"[yellow]note:[/] {line}", markup=True, highlight=False, soft_wrap=True)
        if need_head and rt.head_is_random and console is not None:
            console.print("[yellow]warning:[/] --draft random: an untrained draft head; output is still exact, but expect no speedup")
        return rt


def native_at_hand() -> bool:
    """Whether a CPU run finds eagle2's native build ready (no GPU, or the user chose the CPU)."""
    import torch

    from eagle2_core import native

    return torch.cuda.is_available() or native.is_built()


def quiet_transformers() -> None:
    """No tqdm bars or advisory warnings from transformers on our terminal (EAGLE2_DEBUG=1 keeps them)."""
    import os

    if os.environ.get("EAGLE2_DEBUG"):
        return
    import warnings

    # A warning that reaches the terminal (a capture that fell back, an unreadable cost profile)
    # is one line, as our errors are: not the file, line number and source line of where it was raised.
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()  # no "Retrying in 8s" lines before our own error when offline


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf (comparisons with nan are all false, so
    FloatRange alone lets `--temperature nan` through to the sampler)."""

    def convert(self, value, param, ctx):
        import math

        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


class CountOrAuto(click.ParamType):
    """An int >= 1, or `auto` (chosen from this machine's measured costs): `--total-tokens` (1: the
    root alone, plain decoding; auto: the per-cycle budget, budget.py) and `generate --batch-size`."""

    name = "N|auto"

    def __init__(self, one_means: str):
        self.one_means = one_means

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)
        if n < 1:
            self.fail(f"{n} is smaller than 1 (1: {self.one_means})", param, ctx)
        return n


def _options(max_new_tokens: int):
    o = click.option
    return [
        o("--model", "-m", default=None, envvar="EAGLE2_MODEL", show_envvar=True, metavar="MODEL",
          help="Target: hub id, local folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct."),
        o("--draft", "-d", default=None, envvar="EAGLE2_DRAFT", metavar="HEAD",
          help="EAGLE draft head: folder or hub id; 'none' to draft from the head-free sources alone; 'random' for an "
               "untrained head. Default: the shipped/registry head (none where no head is known)."),
        o("--draft-sources", default=None, envvar="EAGLE2_DRAFT_SOURCES", metavar="LIST",
          help="Which draft sources grow the tree, comma-separated: head, recycle (the target's own top-k after each "
               "token), match (continuations of the context). Default: all there are."),
        o("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
          help="Weights dtype (auto: float32 on CPU, bf16/fp16 on GPU)."),
        o("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1, mps or auto."),
        o("--device-map", default=None, help="Accelerate device map for large targets, e.g. auto."),
        o("--load-in-8bit", is_flag=True, help="Quantize the target to 8 bits: on a CPU eagle2's weight-only int8 "
          "(a float32 scale per row; 8-bit activations in the products unless --exact), on a GPU bitsandbytes' LLM.int8."),
        o("--load-in-4bit", is_flag=True, help="Quantize the target to 4 bits: on a CPU eagle2's Q4_0 blocks "
          "(32 values, an fp16 scale), on a GPU bitsandbytes."),
        o("--trust-remote-code", is_flag=True, help="Allow custom modelling code from the hub."),
        o("--exact", is_flag=True, envvar="EAGLE2_EXACT", help="On a CPU target held as blocks (GGUF, --load-in-8bit/4bit): "
          "multiply in float32, bitwise the dequantized float32 model, instead of the default int8 activations "
          "(several times cheaper per verify row; speculation stays bitwise equal to plain decoding in either)."),
        o("--temperature", "-t", type=FiniteFloat(min=0), default=None,
          help="Sampling temperature; 0 = greedy. [default: the model's generation_config, else greedy; compare: greedy]"),
        o("--top-p", type=FiniteFloat(0, 1, min_open=True), default=None, help="Nucleus sampling; 1 = off. [default: the model's]"),
        o("--top-k", type=click.IntRange(min=0), default=None,
          help="Top-k sampling; 0 = off. [default: the model's; generate()'s 50 where it sets none]"),
        o("--min-p", type=FiniteFloat(0, 1), default=None, help="Min-p sampling; 0 = off. [default: the model's]"),
        o("--repetition-penalty", type=FiniteFloat(min=0, min_open=True), default=None,
          help="Penalise tokens already in the context (CTRL's rule, as generate() applies it); 1 = off. [default: the model's]"),
        o("--no-repeat-ngram-size", type=click.IntRange(min=0), default=None, help="Never repeat an n-gram of this size; 0 = off. [default: the model's]"),
        o("--generation-config/--no-generation-config", default=True, show_default=True,
          help="Take the defaults above, and every other logits processor (bad_words_ids, suppress_tokens, ...), from the "
               "model's generation_config.json, as generate() does; --no-generation-config: greedy, nothing else, unless flags say."),
        o("--max-new-tokens", "-n", type=click.IntRange(min=0), default=max_new_tokens, show_default=True, help="Token budget per answer."),
        o("--seed", type=click.IntRange(-(2**63), 2**64 - 1), default=None, help="Random seed for sampling."),
        o("--total-tokens", type=CountOrAuto("the root alone, plain decoding"), default=None, metavar="N|auto",
          help="Draft tree size incl. root [CPU 4, CPU bf16 10, GPU 60]; auto: chosen every cycle from the draft's "
               "confidence and this machine's measured costs, up to 16 on CPU, 60 on GPU."),
        o("--depth", type=click.IntRange(min=1), default=None, help="Longest draft path [CPU 2, CPU bf16 3, GPU 6]."),
        o("--tree-top-k", type=click.IntRange(min=1), default=None, help="Children tried per expanded node [CPU 2, CPU bf16 4, GPU 10]."),
        o("--draft-shape", type=click.Choice(["dynamic", "static", "chain"]), default=None,
          help="dynamic: EAGLE-2 [default]; static: EAGLE-1 tree; chain: no tree."),
        o("--compile/--no-compile", default=None,
          help="Capture each decoding cycle (graph mode: fixed shapes, torch.compile; CUDA graphs on a GPU). [default: on for CUDA, "
               "off on CPU, where it was measured not to pay]"),
        o("--system-prompt", "-s", default=None, help="System message for chat-formatted prompts."),
        o("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
          help="Jinja chat template file (or JSON with chat_template) replacing the tokenizer's."),
    ]


COMMON_FIELDS = tuple(f.name for f in fields(CommonOptions))


NO_SPECULATION = click.option(
    "--no-speculation", is_flag=True,
    help="Plain decoding, the baseline speculation is measured against: one token per target forward, as --total-tokens 1, "
         "with no draft head or draft source loaded.")


def check_no_speculation(common: CommonOptions) -> None:
    """--no-speculation beside an option that asks for drafting is a usage error; a draft head named
    in the environment (EAGLE2_DRAFT, EAGLE2_DRAFT_SOURCES) is set aside instead, as the flag says."""
    from click.core import ParameterSource

    if not common.no_speculation:
        return
    ctx = click.get_current_context()
    for name in ("draft", "draft_sources"):
        if getattr(common, name) is not None and ctx.get_parameter_source(name) != ParameterSource.ENVIRONMENT:
            raise UserInputError(f"--no-speculation loads no draft: it cannot be combined with --{name.replace('_', '-')}")
        setattr(common, name, None)
    if common.total_tokens not in (None, 1):
        raise UserInputError(f"--no-speculation verifies one token per forward: it cannot be combined with --total-tokens "
                               f"{common.total_tokens}")
    common.total_tokens = 1


def common_options(f=None, *, max_new_tokens: int = 256, no_speculation: bool = False):
    """Add the shared options; the command receives them as one `common: CommonOptions` argument.
    `no_speculation`: the command takes --no-speculation too (the decoding commands).

    Put it directly above the function so command-specific options list first in --help.
    """
    def deco(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            common = CommonOptions(**{k: kwargs.pop(k) for k in COMMON_FIELDS if k in kwargs})
            if common.load_in_8bit and common.load_in_4bit:
                raise click.UsageError("--load-in-8bit and --load-in-4bit exclude each other")
            check_no_speculation(common)
            return func(*args, common=common, **kwargs)

        for opt in reversed(_options(max_new_tokens) + ([NO_SPECULATION] if no_speculation else [])):
            wrapper = opt(wrapper)
        return wrapper

    return deco(f) if f is not None else deco


def constraint_options(func):
    """--json-schema FILE, --regex TEXT, --grammar FILE: what every answer must match
    (eagle2_core/structured.py); the command receives one `constraint` argument (None: free text)."""
    o = click.option

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        kwargs["constraint"] = load_constraint(kwargs.pop("json_schema"), kwargs.pop("regex"), kwargs.pop("grammar"))
        return func(*args, **kwargs)

    for opt in reversed([
        o("--json-schema", type=click.Path(exists=True, dir_okay=False), default=None, metavar="FILE",
          help="Every answer is JSON matching this JSON schema (a file; OpenAI's {\"name\", \"schema\"} wrapper is read too)."),
        o("--regex", default=None, metavar="REGEX", help="Every answer matches this regular expression, whole."),
        o("--grammar", type=click.Path(exists=True, dir_okay=False), default=None, metavar="FILE",
          help="Every answer matches this grammar: Lark (rule `start`) or GBNF (rule `root`, told apart by `::=`)."),
    ]):
        wrapper = opt(wrapper)
    return wrapper


def load_constraint(json_schema: str | None, regex: str | None, grammar: str | None):
    """The structured.Constraint the flags ask for, or None; a bad file or pattern is one line (exit 2)."""
    given = [n for n, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} exclude each other: give one constraint")
    from eagle2_core import structured

    def read(path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserInputError(f"{path}: cannot read it ({e})") from None

    try:
        if json_schema is not None:
            text = read(json_schema)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise UserInputError(f"{json_schema}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
            if isinstance(obj, dict) and isinstance(obj.get("schema"), dict) and "type" not in obj:
                return structured.json_schema(obj["schema"], obj.get("name") if isinstance(obj.get("name"), str) else None)
            return structured.json_schema(obj)
        if regex is not None:
            return structured.regex(regex)
        return structured.grammar(read(grammar), "gbnf" if grammar.endswith(".gbnf") else "lark" if grammar.endswith(".lark") else "auto")
    except structured.ConstraintError as e:
        raise UserInputError(f"{given[0]}: {e}") from None


def constrain(rt, constraint) -> None:
    """The runtime's default settings constrained (chat's turns, generate's lines without a
    response_format of their own); the grammar's tokenizer is built now, once, so a tokenizer
    llguidance cannot read is said before the first answer."""
    if constraint is None:
        return
    import dataclasses

    from eagle2_core import structured

    try:
        structured.ll_tokenizer(rt.tokenizer, rt.model.get_output_embeddings().weight.shape[0])
    except structured.ConstraintError as e:
        raise UserInputError(str(e)) from None
    rt.gen = dataclasses.replace(rt.gen, constraint=constraint)
