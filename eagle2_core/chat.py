"""Chat session state, independent of any terminal: the conversation, `/set` parsing, running
statistics, and incremental detokenization that tells which text came from the draft.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field

from .treesettings import TreeSettings
from .events import GenerationSettings, StepEvent, Summary
from .prompts import SEED_MAX, SEED_MIN, SplicedIds

# /set keys: name -> (target object, field, type). "gen" = GenerationSettings, "tree" = TreeSettings.
SETTINGS = {
    "temperature": ("gen", "temperature", float),
    "top_p": ("gen", "top_p", float),
    "top_k": ("gen", "top_k", int),
    "max_new_tokens": ("gen", "max_new_tokens", int),
    "seed": ("gen", "seed", int),
    "total_tokens": ("tree", "total_tokens", int),
    "depth": ("tree", "depth", int),
    "tree_top_k": ("tree", "top_k", int),
    "draft_shape": ("tree", "shape", str),
}
ALIASES = {"max_tokens": "max_new_tokens", "shape": "draft_shape", "temp": "temperature"}


def _key(k: str) -> str:
    k = k.strip().lower().replace("-", "_").lstrip("_")
    return ALIASES.get(k, k)


def apply_setting(gen: GenerationSettings, tree: TreeSettings, assignment: str, auto_max: int = 16,
                  auto_tree: TreeSettings | None = None) -> tuple[GenerationSettings, TreeSettings, str]:
    """Parse `key=value` and return updated copies plus the canonical key; ValueError with a clear message.
    `total_tokens=auto` turns on the per-cycle budget (policy.py) with up to `auto_max` nodes, with
    the depth and expansion width of `auto_tree` (the settings `--total-tokens auto` would run:
    measured on a CPU, runtime.Runtime.load) where given."""
    if "=" not in assignment:
        raise ValueError(f"expected key=value, got {assignment!r}; keys: {', '.join(SETTINGS)}")
    raw_key, raw_val = assignment.split("=", 1)
    key = _key(raw_key)
    if key not in SETTINGS:
        raise ValueError(f"unknown setting {raw_key.strip()!r}; keys: {', '.join(SETTINGS)}")
    where, name, typ = SETTINGS[key]
    raw_val = raw_val.strip()
    if key == "seed" and raw_val.lower() in ("none", "off", ""):
        value = None
    elif key == "total_tokens" and raw_val.lower() == "auto":
        expansion = {"depth": auto_tree.depth, "top_k": auto_tree.top_k} if auto_tree is not None else {}
        return gen, dataclasses.replace(tree, budget="auto", shape="dynamic", total_tokens=max(auto_max, tree.total_tokens), **expansion), key
    else:
        try:
            value = typ(raw_val)
        except ValueError:
            raise ValueError(f"{key} must be {'an integer' if typ is int else 'a number' if typ is float else 'text'}, not {raw_val!r}") from None
    if typ is float and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, not {raw_val!r}")
    if key == "seed" and value is not None and not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"seed must be from {SEED_MIN} to {SEED_MAX}")
    if key == "temperature" and value < 0:
        raise ValueError("temperature must be >= 0 (0 = greedy)")
    if key == "top_p" and not 0 < value <= 1:
        raise ValueError("top_p must be in (0, 1]")
    if key in ("top_k", "max_new_tokens") and value < 0:
        raise ValueError(f"{key} must be >= 0")
    if where == "gen":
        return dataclasses.replace(gen, **{name: value}), tree, key
    new_tree = dataclasses.replace(tree, **{name: value}, **({"budget": "constant"} if key == "total_tokens" else {}))
    new_tree.validate()  # ValueError names the problem
    return gen, new_tree, key


def settings_view(gen: GenerationSettings, tree: TreeSettings) -> dict:
    g, t = dataclasses.asdict(gen), dataclasses.asdict(tree)
    if tree.budget == "auto":
        t["total_tokens"] = f"auto (up to {tree.total_tokens})"
    return {k: (g if where == "gen" else t)[name] for k, (where, name, _) in SETTINGS.items()}


@dataclass
class Conversation:
    """The messages, and the conversation as the model saw it: token ids, continued turn after
    turn from the generated ids (prompts.SplicedIds: a kept cache is only valid for the ids it
    was computed on)."""
    system_prompt: str | None = None
    messages: list[dict] = field(default_factory=list)   # user/assistant turns, no system message
    turns: list[Summary] = field(default_factory=list)   # one EAGLE-2 summary per answered turn
    ids: SplicedIds = field(default_factory=SplicedIds)

    @property
    def spliced(self) -> int:
        return self.ids.spliced

    def add_user(self, text: str) -> list[dict]:
        self.messages.append({"role": "user", "content": text})
        return self.full()

    def encode(self, tokenizer, chat_template: str | None = None) -> list[int]:
        """Token ids of the conversation plus the generation prompt (SplicedIds.encode)."""
        return self.ids.encode(tokenizer, self.full(), None, chat_template)

    def add_assistant(self, text: str, summary: Summary | None = None, token_ids: list[int] | None = None, tokenizer=None) -> None:
        """The answer, and with its `token_ids` (as generated) the ids the next turn continues."""
        self.messages.append({"role": "assistant", "content": text})
        if summary is not None:
            self.turns.append(summary)
        self.ids.answered(text, token_ids, tokenizer)

    def drop_last_user(self) -> None:
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self.ids.prompt = None

    def reset(self) -> None:
        self.messages.clear()
        self.turns.clear()
        self.ids.reset()

    def full(self) -> list[dict]:
        sys = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return sys + list(self.messages)

    def totals(self) -> Summary:
        s = Summary()
        for t in self.turns:
            s.merge(t)
        return s

    def to_json(self, settings: dict | None = None, extra: dict | None = None) -> str:
        return json.dumps({"system_prompt": self.system_prompt, "messages": self.messages, "settings": settings or {},
                           "turns": [t.to_dict() for t in self.turns], "totals": self.totals().to_dict(), **(extra or {})},
                          indent=2, ensure_ascii=False)


class IncrementalDetokenizer:
    """Turns streamed token ids into text pieces, holding back incomplete UTF-8 sequences.

    `push(event)` returns [(text, from_draft)]: the accepted draft tokens of a cycle are its first
    `accepted` tokens, the last one is the target's own (bonus) token.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _step(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def push(self, event: StepEvent) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        n_draft = min(event.accepted, len(event.token_ids))
        for i, t in enumerate(event.token_ids):
            piece = self._step(t)
            if piece:
                draft = i < n_draft
                if out and out[-1][1] == draft:
                    out[-1] = (out[-1][0] + piece, draft)
                else:
                    out.append((piece, draft))
        return out

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence at the very end)."""
        rest = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        self.prefix = self.read = len(self.ids)
        return rest[len(before):]

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=self.skip)


class LiveStats:
    """A running Summary built from StepEvents, for a panel that updates while tokens stream."""

    def __init__(self):
        self.summary = Summary()
        self.t0 = time.perf_counter()
        self._first = True

    def update(self, ev: StepEvent) -> Summary:
        s = self.summary
        if self._first:  # the prefill event: the target's own first token
            self._first = False
            s.target_forwards, s.prefill_s, s.cached_tokens = 1, ev.verify_s, ev.cached_tokens
        else:  # an event carries no tree depth: the live panel shows no acceptance rate, the turn's Summary has it
            s.record_cycle(ev.accepted, ev.tree_size, 0, ev.draft_s, ev.verify_s)
        s.new_tokens += len(ev.token_ids)
        s.wall_s = time.perf_counter() - self.t0
        return s
