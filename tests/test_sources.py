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
from eagle2_core.sources import (MATCH_MAX, ContextIndex, DraftSources, RecyclingTable, RowTree, known_outcomes, parse_sources,
                                 pad_trees, tokens_taken)
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
    head = ([3, 8, 9], [-1, -1, 0], [0.6, 0.3, 0.3], [0.6, 0.3, 0.3])
    tree = src.grow_row(slot, 7, cap=12, head=head)
    seen = set()
    for i in range(1, len(tree.tokens)):
        p = tree.parents[i]
        assert 0 <= p < i
        assert tree.scores[i] <= tree.scores[p] + 1e-12
        assert (p, tree.tokens[i]) not in seen
        seen.add((p, tree.tokens[i]))
    three = [i for i in range(1, len(tree.tokens)) if tree.parents[i] == 0 and tree.tokens[i] == 3]
    assert len(three) == 1
    names = {s for s, _, _ in tree.proposers[three[0]]}
    assert names == {"head", "recycle", "match"}
    assert tree.head_raw[three[0]] == 0.6
    # the copied chain "3 9 2 1 7" continues under node 3
    assert any(tree.parents[i] == three[0] and tree.tokens[i] == 9 for i in range(len(tree.tokens)))


def test_copied_chain_runs_past_the_heads_depth_and_pads_to_a_tree():
    src = DraftSources(("match",), vocab=50, max_depth=8)
    text = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    slot = _slot(text + [0] + text[:3], [])
    for _ in range(40):  # a long run of accepted copies: the calibration learns copies pay
        src.cal["match"].add(7, True)
    tree = src.grow_row(slot, text[2], cap=10)
    assert tree.tokens[1:9] == text[3:11]  # one chain, eight deep
    tokens, parents, scores, depth, anc = pad_trees([tree, None], 12, "cpu")
    assert tokens.shape == (2, 12) and parents[0, 9:].eq(0).all()  # padded with root children
    kids = [int(t) for t, p in zip(tokens[0, 1:], parents[0, 1:]) if p == 0]
    assert len(kids) == len(set(kids))  # none of them a token another root child carries
    ref_depth, ref_anc = batch_trees(parents, 11)  # the host's ancestry is the device pass's
    assert torch.equal(depth, ref_depth) and torch.equal(anc, ref_anc)
    assert int(depth[0].max()) == 8


def test_calibration_follows_what_verification_did():
    src = DraftSources(("recycle",), vocab=10)
    b = 9  # confident table rows (probability 0.9 and up)
    before = src.cal["recycle"].rate(b)
    for _ in range(200):
        src.cal["recycle"].add(b, False)
    assert src.cal["recycle"].rate(b) < 0.1 < before


def test_nodes_the_budget_left_out_are_judged_by_what_the_target_emitted():
    """A tree grown to 5 nodes of which the budget verified 3: the calibration of a node past the
    verified size learns from the target's own next token (what was emitted after its accepted
    parent: greedy, and sampled under the keyed rule alike), not as a rejection; a node whose
    parent's outcome is unknown teaches nothing; the summary counts verified nodes only."""
    from eagle2_core.events import Summary
    from eagle2_core.sources import RowTree

    def fresh():
        src = DraftSources(("recycle",), vocab=20)
        # root 7; node 1 = 3 (verified, accepted), node 2 = 4 (verified, rejected), node 3 = 5 under
        # node 1 (unverified; the target emitted 5 after 3), node 4 = 6 under the root (unverified)
        tree = RowTree([7, 3, 4, 5, 6], [-1, 0, 0, 1, 0], [1.0, 0.6, 0.3, 0.5, 0.2],
                       [[], *([("recycle", 2, 0.25)] for _ in range(4))], [None] * 5)
        src.last = [tree]
        return src

    def counts(src):
        c = src.cal["recycle"]
        return int(c.nodes[2]), int(c.accepted[2])

    path, emitted = [[0, 1, 0]], [[3, 5]]  # accepted 1 (node 1), bonus 5
    src, summary = fresh(), Summary()
    src.observe(path, [1], [0], [summary], 3, emitted)
    assert counts(src) == (4, 2)  # nodes 1, 2 verified (1 accepted); 3 would have been (5 after 3); 4 would not (3 came)
    assert summary.source_counts["recycle"]["nodes"] == 2 and summary.source_counts["recycle"]["accepted"] == 1
    src = fresh()
    src.observe(path, [1], [0], [None], 3, [[3, 7]])  # the target took 7 after 3: node 3 rejected
    assert counts(src) == (4, 1)
    src = fresh()
    src.observe([[0, 0, 0]], [0], [0], [None], 3, [[6]])  # nothing accepted, the target took 6: node 4 (6) would have been
    assert counts(src) == (3, 1)  # nodes 1, 2, 4; node 3 sits under a rejected node (no conditional outcome)


def test_what_the_head_adds_counts_the_nodes_below_its_own():
    """DraftSources.observe's return, the head's evidence (budget.head_pays, HeadGate): accepted
    nodes only the head proposed, and every accepted node below one of them (a copied chain that
    continues a node only the head proposed exists because of the head); a node the head proposed
    with another source is not its alone."""
    from eagle2_core.sources import RowTree

    src = DraftSources(("recycle", "match"), vocab=20)
    head, both, match = [("head", 0, 0.5)], [("head", 0, 0.5), ("match", 0, 0.5)], [("match", 0, 0.9)]
    # root 7 -> 3 (head and match) -> 4 (head alone) -> 5 (match) -> 6 (match); 8 under the root (head)
    tree = RowTree([7, 3, 4, 5, 6, 8], [-1, 0, 1, 2, 3, 0], [1.0, 0.6, 0.4, 0.35, 0.3, 0.2],
                   [[], both, head, match, match, head], [None] * 6)
    src.last = [tree]
    assert src.observe([[0, 1, 2, 3, 4]], [4], [0], [None], 6, [[3, 4, 5, 6, 9]])[0] == 3  # 4, then 5 and 6 below it
    assert src.observe([[0, 1, 0, 0, 0]], [1], [0], [None], 6, [[3, 9]])[0] == 0
    assert src.observe([[0, 5, 0, 0, 0]], [1], [0], [None], 6, [[8, 9]])[0] == 1


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
    engine.chooser.learn_costs = False
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


def test_agreement_corrects_a_candidate_by_what_the_other_sources_said():
    """sources.Agreement: a recycled token proposed beside a copied different token ("against")
    and one both propose ("with") start at the recycling calibration's rate; after evidence that
    tokens against another source fail and tokens with one pass, the first is ranked below the
    second's rate, the state and the uncorrected conditional are what each proposer learns from,
    and a tree grown with no other source speaking is untouched."""
    from eagle2_core.sources import AGAINST, ALONE, WITH

    src = DraftSources(("recycle", "match"), vocab=20)
    src.table.note(torch.tensor([5]), torch.tensor([[0.0] * 3 + [4.0, 4.0] + [0.0] * 15]))  # after 5: 3 and 4, half each
    slot = _slot([1, 5, 3, 9, 5], [])  # the context copied 3 after 5 once
    tree = src.grow_row(slot, 5, cap=3)
    states = {tree.tokens[i]: [s for s, _ in tree.states[i]] for i in range(1, len(tree.tokens)) if tree.parents[i] == 0}
    assert sorted(states[3]) == [WITH, WITH] and states[4] == [AGAINST]
    def root_scores(t):
        return {t.tokens[i]: t.scores[i] for i in range(1, len(t.tokens)) if t.parents[i] == 0}

    before = root_scores(tree)
    for _ in range(50):
        c4 = tree.states[tree.tokens.index(4)][0][1]
        src.agree.add("recycle", AGAINST, 1, c4, False)
        src.agree.add("recycle", WITH, 1, c4, True)
    got = root_scores(src.grow_row(slot, 5, cap=16))
    assert got.get(4, 0.0) < 0.1 * before[4] and got[3] >= before[3]  # ranked below the cap, or far down
    alone = DraftSources(("recycle",), vocab=20)
    alone.table = src.table
    lone = alone.grow_row(_slot([1, 5], []), 5, cap=3)
    assert all(s == ALONE for st in lone.states[1:] for s, _ in st)


def test_agreement_pools_thin_evidence_by_state_then_depth():
    """sources.Agreement.table: evidence spread over many (depth, bin) cells of one state, where
    tokens were accepted at half their prediction, moves a cell that saw none of it to about half
    (each level shrunk toward the one above: state, then depth, then bin), not to 1 (a cell shrunk
    toward 1 alone stayed near 1 after a chat's worth of cycles); a state with no evidence stays
    at 1, and a cell's own ample evidence still decides it."""
    from eagle2_core.sources import AGAINST, WITH, Agreement

    ag = Agreement()
    rng = random.Random(3)
    for b in range(1, 10):  # depth 1, bins 1..9: 40 candidates each, accepted at half their conditional
        c = (b + 0.5) / 10
        for _ in range(40):
            ag.add("recycle", AGAINST, 1, c, rng.random() < 0.5 * c)
    pooled = ag.factor("recycle", AGAINST, 3, 0.05)  # depth 3, bin 0: no evidence of its own
    assert 0.35 < pooled < 0.65
    assert ag.factor("recycle", WITH, 2, 0.55) == 1.0 and ag.factor("match", AGAINST, 1, 0.55) == 1.0
    for _ in range(400):  # ample evidence in one cell that its tokens pass at their prediction
        ag.add("recycle", AGAINST, 2, 0.95, True)
    assert ag.factor("recycle", AGAINST, 2, 0.95) > 0.95


def test_growth_stops_where_no_larger_tree_can_pay():
    """budget.BudgetChooser.growth_floor: a next node scoring below E * floor[k] (E the expected
    tokens of the k-node tree so far) cannot make any larger size beat size k, even with every
    further node at its score; one above it can for some size. And grow_row stops there."""
    from eagle2_core.budget import BudgetChooser

    rng = random.Random(5)
    for _ in range(20):
        v = torch.tensor(sorted(rng.uniform(10, 30) for _ in range(8)), dtype=torch.float64)
        d = rng.uniform(0, 3)
        ch = BudgetChooser.__new__(BudgetChooser)
        ch.verify_table, ch._table, ch.draft_cost = (lambda v=v: v), (lambda v=v: v.numpy()), (lambda steps, d=d: d)
        ch._state = lambda: {}
        ch.merged_counts = torch.zeros(3, 3, 10, dtype=torch.float64)
        ch.prior_nodes, ch._ratio_cache, ch._floor_cache, ch.counts = 50.0, None, None, torch.zeros(3, 10, dtype=torch.float64)
        floor = ch.growth_floor(1)
        for k in range(1, 8):
            e = rng.uniform(1, 3)
            for p, pays in ((0.98 * e * floor[k], False), (1.02 * e * floor[k], True)):
                best = max((e + (m - k) * p) / (float(v[m - 1]) + d) for m in range(k + 1, 9))
                assert (best > e / (float(v[k - 1]) + d)) == pays
    src = DraftSources(("match",), vocab=20)
    slot = _slot(list(range(10)) + [0] + list(range(9)), [])
    full = src.grow_row(slot, 8, cap=8)
    cut = src.grow_row(slot, 8, cap=8, floor=[0.0, 0.0, 0.0, 1.0] + [1.0] * 6)  # at 3 nodes no candidate pays
    assert len(full.tokens) > 3 and len(cut.tokens) == 3 and cut.tokens == full.tokens[:3]


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


def test_a_grown_node_is_judged_wherever_the_emitted_tokens_decide_it():
    """sources.known_outcomes (the chooser's merged calibration learns from every grown node, not
    only the verified ones): a node is accepted exactly when its path is the target's tokens,
    rejected once its path leaves them, and left out where its path follows every emitted token
    and runs deeper. Against a brute force over random trees."""
    tree = RowTree(tokens=[0, 5, 6, 7, 8, 9, 3], parents=[-1, 0, 0, 1, 1, 3, 2], scores=[1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.04])
    scores, depths, on = known_outcomes(tree, [5, 7])
    assert scores == [0.5, 0.3, 0.2, 0.1, 0.04] and depths == [1, 1, 2, 2, 2] and on == [True, False, True, False, False]
    assert known_outcomes(tree, [5, 7, 9])[2][-2:] == [True, False]  # token 9 below 5, 7 now decided
    rng = random.Random(1)
    for _ in range(200):
        m = rng.randint(1, 9)
        parents = [-1] + [rng.randrange(i) for i in range(1, m)]
        tokens = [0] + [rng.randrange(3) for _ in range(1, m)]
        emitted = [rng.randrange(3) for _ in range(rng.randint(1, 4))]
        want = []
        for i in range(1, m):
            path, j = [], i
            while j > 0:
                path.append(tokens[j])
                j = parents[j]
            path = path[::-1]
            k = next((d for d in range(min(len(path), len(emitted))) if path[d] != emitted[d]), None)
            if k is not None:
                want.append((i / 10, len(path), False))
            elif len(path) <= len(emitted):
                want.append((i / 10, len(path), True))
        got = known_outcomes(RowTree(tokens=tokens, parents=parents, scores=[i / 10 for i in range(m)]), emitted)
        assert list(zip(*got)) == want
