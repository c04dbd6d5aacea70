"""Structured output: JSON schema, JSON object, regex and Lark/GBNF grammar constraints, as one
more logits processor on the target's scores (llguidance does the matching).

A `Constraint` is what a request asks for, checked when it is parsed (a bad schema or grammar
is one line, before anything runs). A `GrammarMask` is its matcher for one sequence: an HF
`LogitsProcessor` whose rows each follow their own sequence (`input_ids`), so the same object
masks a plain step, every node of a draft tree (`sampling.TargetProcessors.tree_scores` calls
processors once per depth, each row with the history plus its own path), and Hugging Face
`generate` in a comparison. The matcher moves between sequences by rolling back to the common
prefix and consuming the rest (`_goto`), never consuming a token it has not validated, so a
rejected branch cannot leave it in an error state; after every call it returns to the rows'
common prefix, which for a tree is the committed text. A token past the grammar's end, or on a
path that left the grammar, gets a row that allows only the end-of-turn ids: such a row is never
emitted (its parent's mask forbade the path), but it must be a distribution.

End of output: the model's end-of-turn ids are allowed exactly where the grammar accepts, and
are the only ids allowed once it can go no further; llguidance's own EOS bit is replaced by them.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessor

KINDS = ("json_schema", "json_object", "regex", "grammar")
SYNTAXES = ("auto", "lark", "gbnf")
# One line of JSON with a space after ',' and ':' (as json.dumps writes it): no whitespace to
# wander into, and a schema's own "x-guidance" may still say otherwise.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A schema, regex or grammar that cannot be compiled, or a response_format that is not one; one line."""


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a dependency of the package, but say what to do where it is missing
        raise ConstraintError("structured output needs the llguidance package: pip install llguidance") from e
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` (KINDS), the user's `source` text (a schema as JSON text,
    a regex, a grammar) and llguidance's compiled `grammar`; `name` (a JSON schema's name, a
    grammar's syntax) only labels it."""
    kind: str
    source: str
    grammar: str
    name: str | None = None

    def label(self) -> str:
        return self.kind + (f" {self.name}" if self.name else "")


def _checked(kind: str, source: str, grammar: str, name: str | None = None) -> Constraint:
    why = _llg().LLMatcher.validate_grammar(grammar)
    if why:
        raise ConstraintError(f"invalid {kind}: {_one_line(why)}")
    return Constraint(kind, source, grammar, name)


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return "; ".join(lines[:3])[:300] if lines else "rejected"


def json_schema(schema, name: str | None = None) -> Constraint:
    """A JSON schema (a dict, or its JSON text). Applied as given: properties not listed are
    allowed unless the schema says `additionalProperties: false`, as JSON Schema defines."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"the JSON schema is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"a JSON schema must be an object, not {type(schema).__name__}")
    text = json.dumps(schema)  # key order kept: properties are generated in the order the schema lists them
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    except ValueError as e:
        raise ConstraintError(f"invalid JSON schema: {_one_line(e)}") from None
    return _checked("json_schema", text, grammar, name)


def json_object() -> Constraint:
    """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
    c = json_schema({"type": "object"})
    return Constraint("json_object", c.source, c.grammar)


def regex(pattern: str) -> Constraint:
    """The whole output matches `pattern` (Rust regex syntax, anchored at both ends)."""
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError("a regex must be a non-empty string")
    return _checked("regex", pattern, _llg().LLMatcher.grammar_from_regex(pattern))


def grammar(text: str, syntax: str = "auto") -> Constraint:
    """A Lark grammar (llguidance's dialect, rule `start`) or a GBNF one (llama.cpp's, rule
    `root`); `auto` tells them apart by GBNF's `::=`."""
    if not isinstance(text, str) or not text.strip():
        raise ConstraintError("a grammar must be a non-empty string")
    if syntax not in SYNTAXES:
        raise ConstraintError(f"syntax must be one of {', '.join(SYNTAXES)}, not {syntax!r}")
    if syntax == "auto":
        syntax = "gbnf" if "::=" in text else "lark"
    llg = _llg()
    if syntax == "gbnf":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(text)
        except Exception as e:  # noqa: BLE001  (the converter raises plain Exceptions with a message)
            raise ConstraintError(f"invalid GBNF grammar: {_one_line(e)}") from None
    else:
        lark = text
    return _checked("grammar", text, llg.LLMatcher.grammar_from_lark(lark), syntax)


def from_response_format(obj, field: str = "response_format") -> Constraint | None:
    """A Constraint from an OpenAI `response_format` object (None for `{"type": "text"}`):
    `json_schema` (`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`) and
    `json_object` as OpenAI defines them, and eagle2's extensions `{"type": "regex", "regex": ...}`
    and `{"type": "grammar", "grammar": ..., "syntax": "lark" | "gbnf"}`. ConstraintError
    (one line, naming the field) otherwise."""
    if not isinstance(obj, dict):
        raise ConstraintError(f"{field} must be an object like {{\"type\": \"json_schema\", ...}}")
    kind = obj.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object()
    if kind == "json_schema":
        spec = obj.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintError(f"{field}.json_schema must be an object with name and schema")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise ConstraintError(f"{field}.json_schema.name must be a string")
        if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
            raise ConstraintError(f"{field}.json_schema.strict must be true or false")
        if "schema" not in spec:
            raise ConstraintError(f"{field}.json_schema.schema is missing")
        return json_schema(spec["schema"], name)
    if kind == "regex":
        return regex(obj.get("regex"))
    if kind == "grammar":
        syntax = obj.get("syntax") or "auto"
        return grammar(obj.get("grammar"), syntax)
    raise ConstraintError(f"{field}.type must be one of text, json_object, json_schema, regex, grammar, not {json.dumps(kind)}")


# -- the matcher's tokenizer: built once per process and tokenizer ----------------------------------

_TOKENIZERS: dict = {}
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for a fast HF tokenizer, over `vocab_size` ids (the lm_head's rows,
    which may exceed the tokenizer's: those extra ids are never allowed). Building it reads the
    whole vocabulary, so it is cached for the process."""
    n = max(int(vocab_size), len(tokenizer))
    key = (id(tokenizer), n)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        import llguidance.hf

        try:
            lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n)
        except ValueError as e:
            raise ConstraintError(f"structured output needs a fast tokenizer ({_one_line(e)})") from None
        _TOKENIZERS[key] = (tokenizer, lt)  # the tokenizer is held too, so its id is never reused here
        return lt


def bits_to_bool(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmask rows [n, W] (int32, token t at bit t % 32 of word t // 32) as a bool [n, vocab]."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()


class GrammarMask(LogitsProcessor):
    """One sequence's matcher as a logits processor: row r of `scores` gets -inf wherever the
    grammar forbids the next token after `input_ids[r]` (prompt of `prompt_len` tokens first).

    `eos_ids`: the end-of-turn ids of this generation. `mask_s` adds up the time spent on masks
    (the grammar's cost, for benchmarks)."""

    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int, prompt_len: int, eos_ids=()):
        llg = _llg()
        self.lt = ll_tokenizer(tokenizer, vocab_size)
        self.matcher = llg.LLMatcher(self.lt, constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"invalid {constraint.kind}: {_one_line(self.matcher.get_error())}")
        self.constraint = constraint
        self.prompt_len = int(prompt_len)
        self.eos = sorted(set(int(t) for t in eos_ids))
        self.eos_set = set(self.eos)
        self.at: list[int] = []   # the tokens after the prompt that the matcher has consumed
        self.words = (self.lt.vocab_size + 31) // 32
        own = set(self.lt.eos_tokens) - self.eos_set  # llguidance's EOS bits, replaced by the generation's own ids
        self.clear = torch.tensor(sorted(own), dtype=torch.long)
        self.mask_s = 0.0
        self.masks = 0

    # -- moving the matcher -----------------------------------------------------------------------
    def _goto(self, seq: list[int]) -> int:
        """Bring the matcher to the state after `seq` (tokens after the prompt) by rolling back to
        the common prefix and consuming the rest, never consuming a token it does not allow.
        Returns how many tokens of `seq` the matcher now holds (len(seq) when the grammar
        accepts all of it)."""
        at = self.at
        k = 0
        n = min(len(at), len(seq))
        while k < n and at[k] == seq[k]:
            k += 1
        if k < len(at):
            self.matcher.rollback(len(at) - k)
            del at[k:]
        if k < len(seq):
            got = self.matcher.try_consume_tokens(seq[k:])
            at.extend(seq[k : k + got])
        return len(at)

    def commit(self, tokens: list[int]) -> None:
        """The emitted tokens after the prompt: the state every later call starts from."""
        self._goto(list(tokens))

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    # -- masks ------------------------------------------------------------------------------------
    def allowed(self, seqs: list[list[int]], vocab: int) -> torch.Tensor:
        """Bool [len(seqs), vocab]: the tokens the grammar allows after each sequence (tokens after
        the prompt). Sequences are visited in sorted order (siblings next to each other: one
        rollback and one token each), and the matcher ends at their common prefix."""
        t0 = time.perf_counter()
        llg_numpy = _numpy_helpers()
        n = len(seqs)
        words = torch.zeros(n, self.words, dtype=torch.int32)
        ended = torch.zeros(n, dtype=torch.bool)
        accepting = torch.zeros(n, dtype=torch.bool)
        arr = words.numpy()
        for r in sorted(range(n), key=lambda i: seqs[i]):
            seq = seqs[r]
            cut = next((j for j, t in enumerate(seq) if t in self.eos_set), None)
            if cut is not None or self._goto(seq) < len(seq) or self.matcher.is_stopped():
                # past an end-of-turn id, off the grammar, or at its end: end-of-turn only
                ended[r] = True
                continue
            llg_numpy.fill_next_token_bitmask(self.matcher, arr, r)
            accepting[r] = self.matcher.is_accepting()
        if n:
            self._goto(_common_prefix(seqs))
        out = bits_to_bool(words, vocab)
        if self.clear.numel():
            out[:, self.clear[self.clear < vocab]] = False
        eos = torch.tensor([t for t in self.eos if t < vocab], dtype=torch.long)
        if eos.numel():
            out[:, eos] = False
            out[ended | accepting] = out[ended | accepting].index_fill(1, eos, True)
        if not eos.numel():
            # no end-of-turn id to allow: a row with nothing allowed keeps every token rather than
            # becoming a row of -inf (which no distribution is); such a row is never emitted
            # (off the grammar), or the grammar is complete and the token budget ends the answer
            empty = ~out.any(1)
            out[empty] = True
        self.mask_s += time.perf_counter() - t0
        self.masks += n
        return out

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        seqs = [row[self.prompt_len :] for row in input_ids.tolist()]
        ok = self.allowed(seqs, scores.shape[-1]).to(scores.device)
        return scores.masked_fill(~ok, float("-inf"))


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    first = min(seqs, key=len)
    k = 0
    while k < len(first) and all(s[k] == first[k] for s in seqs):
        k += 1
    return first[:k]


_NUMPY = None


def _numpy_helpers():
    global _NUMPY
    if _NUMPY is None:
        import llguidance.numpy

        _NUMPY = llguidance.numpy
    return _NUMPY


def grammar_mask(gen, tokenizer, vocab_size: int | None, prompt_len: int, eos_ids=()) -> GrammarMask | None:
    """The GrammarMask of one generation with settings `gen` (None when it has no constraint)."""
    c = getattr(gen, "constraint", None)
    if c is None:
        return None
    if tokenizer is None or vocab_size is None:
        raise ConstraintError("a constrained generation needs the model's tokenizer and vocabulary size")
    return GrammarMask(c, tokenizer, vocab_size, prompt_len, eos_ids)
