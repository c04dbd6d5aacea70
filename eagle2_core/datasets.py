"""Prompt sets for comparisons: a few built-in prompts and the vendored benchmarks (`--dataset`).

Prompt files a user passes (`-f`) are read by prompts.py; these are the sets shipped with the
package, as the same `PromptItem`s.
"""
from __future__ import annotations

import gzip
import json
import os

from .prompts import PromptItem

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
DATASETS = ("mt-bench", "humaneval")

BUILTIN_PROMPTS = [
    "Give three tips for staying healthy.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what speculative decoding is in two sentences.",
    "List the first ten prime numbers.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
    "Summarise the plot of Romeo and Juliet in a short paragraph.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
]


def builtin_items() -> list[PromptItem]:
    return [PromptItem("id", i, [{"role": "user", "content": p}]) for i, p in enumerate(BUILTIN_PROMPTS)]


def dataset_items(name: str) -> list[PromptItem]:
    """A vendored benchmark as single-turn items: MT-bench first turns (with category), HumanEval prompts."""
    if name == "mt-bench":
        items = []
        with open(os.path.join(DATA_DIR, "mt_bench", "question.jsonl"), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    q = json.loads(line)
                    items.append(PromptItem("question_id", q["question_id"], [{"role": "user", "content": q["turns"][0]}], category=q.get("category")))
        return items
    if name == "humaneval":
        with gzip.open(os.path.join(DATA_DIR, "humaneval", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
            return [PromptItem("task_id", p["task_id"], [{"role": "user", "content": p["prompt"]}]) for p in map(json.loads, f) if p]
    raise ValueError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")
