"""Draft sources (sources.py): the context index, the recycling table, one merged tree per row.

Greedy identity and seeded-sampling identity with mixed trees (head + recycled + copied nodes,
and head-free trees alone) are in test_engine.py's parametrised suites ("mixed", "headfree");
here the pieces: what each source proposes, that the merge keeps a tree whose scores never rise
along a path, that a token proposed twice under one parent is one node with both proposers, that
a copied chain runs deeper than the head's depth, and that the calibration learns per source.
"""
from __future__ import annotations

import random

import pytest
import torch

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.cycle import Slot
from eagle2_core.engine import Request
from eagle2_core.policy import Acceptance
from eagle2_core.sources import MATCH_MAX, ContextIndex, DraftSources, RecyclingTable, RowTree, parse_sources, pad_trees, tokens_taken
from eagle2_core.tree import batch_trees

from test_engine import STEP, run_all


def test_context_index_proposes_what_followed_the_longest_suffix():
    ix = ContextIndex()
    ix.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # the suffix (6, 7) was followed by 8 once and 9 once: both, half each, match length 2 (3-gram (2, 6, 7) unseen before)
    got = sorted(ix.children(()))
    assert got == [(8, 0.5, 2), (9, 0.5, 2)]
    # the node's own path extends the suffix: context + (8,) ends in (6, 7, 8), seen once, followed by 1
    assert ix.children((8,)) == [(1, 1.0, 3)]
    # nothing seen: no proposal; a suffix of only its own last occurrence proposes nothing either
    assert ix.children((42,)) == []
    one = ContextIndex()
    one.extend([3])
    assert one.children(()) == []


def test_context_index_matches_at_most_match_max_tokens():
    ix = ContextIndex()
    seq = list(range(10, 10 + MATCH_MAX + 3))
    ix.extend(seq + [0] + seq[:-1])  # the whole run repeated but for its last token
    (tok, share, m), = ix.children(())
    assert tok == seq[-1] and share == 1.0 and m == MATCH_MAX


def test_recycling_table_keeps_the_latest_top_k_with_probabilities():
    table = RecyclingTable(vocab=10, k=3)
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0, -1.0, 0, 0, 0, 0, 0], [9.0, 0, 0, 0, 0, 0, 0, 0, 0, 8.0]])
    table.note(torch.tensor([4, 2]), logits)
    kids = table.children(4)
    assert [t for t, _ in kids] == [1, 3, 2]
    assert kids[0][1] == pytest.approx(float(torch.softmax(logits[0, [1, 3, 2]], -1)[0]))  # among the kept k
    table.note(torch.tensor([4]), logits[1:])  # the latest row after token 4 replaces the older one
    assert [t for t, _ in table.children(4)][:2] == [0, 9]
    assert table.children(11) == [] and table.children(7) == []


def _slot(prompt, tokens):
    return Slot(key=0, stop=None, prompt=list(prompt), tokens=list(tokens))


def test_merged_tree_is_best_first_closed_and_folds_duplicates():
    """Head pool + recycled + copied candidates: every node's parent comes first, a child's score
    never exceeds its parent's, no (parent, token) pair twice, and a token the head and the
    context both propose under the root is one node listing both."""
    src = DraftSources(("head", "recycle", "match"), vocab=20)
    logits = torch.full((20,), -5.0)
    logits[[3, 4, 5]] = torch.tensor([4.0, 3.0, 2.0])
    src.note_logits(torch.tensor([7]), logits[None])  # after token 7 the target liked 3, 4, 5
    slot = _slot([1, 7, 3, 9, 2, 1, 7], [])  # the root 7 follows 1; earlier "1 7" was followed by 3
    # the head's pool under root 7: tokens 3 (0.6) and 8 (0.3); under 3: token 9 (0.6 * 0.5)
    head = ([3, 8, 9], [-1, -1, 0], [0.6, 0.3, 0.3])
    tree = src.grow_row(slot, 7, 12, Acceptance(), head=head)
    seen = set()
    for i in range(1, len(tree.tokens)):
        p = tree.parents[i]
        assert 0 <= p < i
        assert tree.scores[i] <= tree.scores[p] + 1e-12
        assert (p, tree.tokens[i]) not in seen
        seen.add((p, tree.tokens[i]))
    three = [i for i in range(1, len(tree.tokens)) if tree.parents[i] == 0 and tree.tokens[i] == 3]
    assert len(three) == 1
    assert tree.keys[three[0]] == "head+match+recycle" and tree.head_of[three[0]] == 0
    # the copied chain "3 9 2 1 7" continues under node 3
    assert any(tree.parents[i] == three[0] and tree.tokens[i] == 9 for i in range(len(tree.tokens)))


def test_copied_chain_runs_past_the_heads_depth_and_pads_to_a_tree():
    src = DraftSources(("match",), vocab=50, max_depth=8)
    text = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    slot = _slot(text + [0] + text[:3], [])
    acc = Acceptance()
    for d in range(1, 9):  # a long run of accepted copies: the estimate learns copies pay
        for _ in range(40):
            acc.add("match", d, 0.75, True)
    tree = src.grow_row(slot, text[2], 10, acc)
    assert tree.tokens[1:9] == text[3:11]  # one chain, eight deep
    tokens, parents, scores, depth, anc = pad_trees([tree, None], 12, "cpu")
    assert tokens.shape == (2, 12) and parents[0, 9:].eq(0).all()  # padded with root children
    kids = [int(t) for t, p in zip(tokens[0, 1:], parents[0, 1:]) if p == 0]
    assert len(kids) == len(set(kids))  # none of them a token another root child carries
    ref_depth, ref_anc = batch_trees(parents, 11)  # the host's ancestry is the device pass's
    assert torch.equal(depth, ref_depth) and torch.equal(anc, ref_anc)
    assert int(depth[0].max()) == 8


def test_parse_sources():
    assert parse_sources(None, True) == ("head", "recycle", "match")
    assert parse_sources(None, False) == ("recycle", "match")
    assert parse_sources("match, recycle", True) == ("match", "recycle")
    with pytest.raises(ValueError, match="needs a draft head"):
        parse_sources("head", False)
    with pytest.raises(ValueError, match="unknown source 'ngram'"):
        parse_sources("ngram", True)
    with pytest.raises(ValueError, match="at least one"):
        parse_sources(" , ", True)


def test_head_free_trees_copy_a_repeated_text_and_stay_greedy(tiny_lm):
    """No head at all: on a prompt that repeats a passage the target then copies, the context
    source's chains are accepted several tokens a cycle, and every answer is plain greedy's."""
    model = tiny_lm("llama", vocab_size=12, max_position_embeddings=64)
    passage = [random.Random(3).randrange(1, 12) for _ in range(14)]
    prompts = [passage + passage[:4], passage + [0] + passage + passage[:2]]
    gen = GenerationSettings(max_new_tokens=20, eos_token_ids=())
    plain = run_all(Engine(model, None), [Request(i, p, gen) for i, p in enumerate(prompts)])
    tree = TreeSettings(total_tokens=10, depth=4, top_k=3, budget="auto")
    engine = Engine(model, None, tree=tree, costs=STEP, sources=("recycle", "match"))
    engine.policy.costs.frozen = True
    out = run_all(engine, [Request(i, p, gen) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert out[i][0] == plain[i][0]
    tables = [out[i][1].source_table() for i in range(len(prompts))]
    assert sum(t.get("match", {}).get("accepted", 0) for t in tables) > 0
    assert max(out[i][1].tau for i in range(len(prompts))) > 1.5


def test_argmax_from_the_top_k_pass_is_argmax_ties_included():
    """Greedy acceptance's argmax taken from the recycling table's top-k pass: equal to
    `argmax` on every row, rows whose two best scores tie exactly included (the first index wins)."""
    src = DraftSources(("recycle",), vocab=50)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    for r in range(0, 64, 4):  # exact ties between the best two, in either order of index
        i, j = sorted(torch.randperm(50, generator=g)[:2].tolist())
        logits[r, [i, j]] = logits[r].max() + 1.0
    tokens = torch.arange(64) % 50
    assert torch.equal(src.argmax_noted(tokens, logits), logits.argmax(-1))
    assert src.table.children(int(tokens[21]))[0][0] == int(logits[21].argmax())  # token 21 is on one row only
    keep = torch.zeros(64, dtype=torch.bool)
    keep[0] = True
    fresh = DraftSources(("recycle",), vocab=50)
    fresh.argmax_noted(tokens, logits, keep)
    assert fresh.table.children(0) and not fresh.table.children(1)  # only the kept rows were learned


def test_the_tokens_a_tree_would_have_taken_follow_the_targets_emitted_tokens():
    """sources.tokens_taken: what a greedy cycle verifying the first n nodes of a tree would have
    produced, from the tokens the target emitted (the head gate's counterfactual for the
    head-free tree): one more than the deepest node on the emitted path, a lower bound where a
    path follows every emitted token."""
    # root 0 -> 5 (1), 6 (2); 5 -> 7 (3), 8 (4); 7 -> 9 (5)
    tree = RowTree(tokens=[0, 5, 6, 7, 8, 9], parents=[-1, 0, 0, 1, 1, 3], scores=[1.0, 0.5, 0.3, 0.2, 0.1, 0.05])
    assert tokens_taken(tree, 6, [5, 7, 9, 4]) == 4     # 5, 7, 9 accepted, then the target's own token
    assert tokens_taken(tree, 6, [5, 8, 1]) == 3        # the second branch
    assert tokens_taken(tree, 6, [6, 2]) == 2
    assert tokens_taken(tree, 6, [4]) == 1              # nothing drafted was the target's: the bonus alone
    assert tokens_taken(tree, 5, [5, 7, 9, 4]) == 3     # node 5 (token 9) is past the verified size
    assert tokens_taken(tree, 3, [5, 7, 9, 4]) == 2
    assert tokens_taken(tree, 1, [5, 7]) == 1           # the root alone: a plain step
    assert tokens_taken(tree, 6, [5, 7]) == 3           # the path runs past what was emitted: counted as far as known
    # against a brute force over random trees and emitted paths
    rng = random.Random(0)
    for _ in range(200):
        m = rng.randint(1, 9)
        parents = [-1] + [rng.randrange(i) for i in range(1, m)]
        tokens = [0] + [rng.randrange(3) for _ in range(1, m)]
        t = RowTree(tokens=tokens, parents=parents, scores=[1.0] * m)
        emitted = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        n = rng.randint(1, m)
        best = 0
        for i in range(1, n):
            path, j = [], i
            while j > 0:
                path.append(tokens[j])
                j = parents[j]
            if path[::-1] == emitted[: len(path)] and len(path) <= len(emitted):
                best = max(best, len(path))
        assert tokens_taken(t, n, emitted) == best + 1

