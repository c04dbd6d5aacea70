"""Draft-tree construction: the pure functions of `eagle2_core.tree`, checked against brute force.

No model is involved except in the last section, where a random draft head (the target is not
run) checks that `cycle.Cycle.draft_fn` builds the tree it claims: every node's children are
the head's top-ranked tokens at that node, recomputed without any KV cache or tree mask.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from eagle2_core.tree import (additive, batch_trees, host_ancestry, causal_rows, chain_choices, choices_to_levels, rerank, rerank_batch,
                              static_choices, tree_from_parents, windowed)

NEG = torch.finfo(torch.float32).min


def random_parents(n: int, rng: random.Random) -> torch.Tensor:
    return torch.tensor([-1] + [rng.randrange(i) for i in range(1, n)])


def chain_of(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


# -- tree_from_parents ------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_ancestors_and_depth_match_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    parents = random_parents(n, rng)
    tokens = torch.tensor([rng.randrange(50) for _ in range(n)])
    tree = tree_from_parents(tokens, parents)
    p = parents.tolist()
    assert tree.size == n and torch.equal(tree.tokens, tokens) and torch.equal(tree.parents, parents)
    for i in range(n):
        anc = set(chain_of(p, i))
        assert {j for j in range(n) if tree.ancestors[i, j]} == anc
        assert int(tree.depth[i]) == len(anc) - 1
        if i:
            assert p[i] < i  # parents before children
            assert int(tree.depth[i]) == int(tree.depth[p[i]]) + 1
    # depth is the position offset of each node: the number of strict ancestors
    assert torch.equal(tree.depth, tree.ancestors.sum(1) - 1)


def test_single_node_and_deep_chain():
    root = tree_from_parents(torch.tensor([7]), torch.tensor([-1]))
    assert root.size == 1 and root.depth.tolist() == [0] and root.ancestors.tolist() == [[True]]
    n = 25
    chain = tree_from_parents(torch.arange(n), torch.arange(-1, n - 1))
    assert chain.depth.tolist() == list(range(n))
    assert torch.equal(chain.ancestors, torch.tril(torch.ones(n, n, dtype=torch.bool)))


# -- EAGLE-2 expansion and rerank ---------------------------------------------------------------

def random_pool(rng: random.Random, k: int, depth: int, vocab: int = 20, tie_prob: float = 0.0):
    """A drafting pool like the drafter's: depth by depth, k children for each of the k best nodes.

    Tokens are unique per pool entry (token = 1000 + pool index) so kept nodes can be identified.
    Child score = parent score + log q(child) <= parent score; with `tie_prob` some children get
    log q = 0 exactly, i.e. the same score as their parent.
    """
    parents, scores, depths = [], [], []
    front = [(-1, 0.0)]
    for d in range(1, depth + 1):
        level = []
        for par, ps in front:
            logq = sorted((math.log(rng.random() + 1e-9) for _ in range(k)), reverse=True)
            for lq in logq:
                if rng.random() < tie_prob:
                    lq = 0.0
                level.append(len(parents))
                parents.append(par)
                scores.append(ps + lq)
                depths.append(d)
        best = sorted(level, key=lambda i: -scores[i])[:k]
        front = [(i, scores[i]) for i in best]
    n = len(parents)
    return (torch.arange(n) + 1000, torch.tensor(parents), torch.tensor(scores, dtype=torch.float32), depths)


def closed_subsets_best_sum(parents: list[int], scores: list[float], size: int) -> float:
    best = -math.inf
    for sub in itertools.combinations(range(len(parents)), size):
        s = set(sub)
        if all(parents[i] < 0 or parents[i] in s for i in sub):
            best = max(best, sum(scores[i] for i in sub))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_rerank_keeps_highest_path_scores(seed):
    rng = random.Random(seed)
    k, depth = rng.randint(1, 4), rng.randint(1, 4)
    tokens, parents, scores, depths = random_pool(rng, k, depth, tie_prob=0.2 if seed % 3 == 0 else 0.0)
    n = tokens.numel()
    budget = rng.randint(0, n + 2)
    tree = rerank(tokens, parents, scores, torch.tensor(5), budget)
    kept_budget = min(budget, n)
    assert tree.size == kept_budget + 1
    assert tree.tokens[0] == 5 and tree.parents[0] == -1
    kept = [int(t) - 1000 for t in tree.tokens[1:]]
    assert len(set(kept)) == kept_budget
    # the kept scores are the top-`budget` path scores of the whole pool
    assert sorted(scores[kept].tolist(), reverse=True) == pytest.approx(sorted(scores.tolist(), reverse=True)[:kept_budget])
    # the kept set is a tree: parents before children, each node's tree parent is its pool parent
    tp = tree.parents.tolist()
    for i, pool_i in enumerate(kept, start=1):
        assert 0 <= tp[i] < i
        pool_parent = int(parents[pool_i])
        assert (tp[i] == 0) if pool_parent < 0 else (kept[tp[i] - 1] == pool_parent)
        assert int(tree.depth[i]) == depths[pool_i]
    # brute force: no ancestry-closed set of the same size has a higher total score
    if n <= 14:
        assert sum(scores[kept].tolist()) == pytest.approx(closed_subsets_best_sum(parents.tolist(), scores.tolist(), kept_budget))


def test_rerank_ties_keep_parents():
    """Children with the parent's exact score (draft confidence 1): a cut inside the tie group
    must never keep a child without its parent."""
    #           a    b    a1   a2   b1   a1x
    parents = torch.tensor([-1, -1, 0, 0, 1, 2])
    scores = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    tokens = torch.arange(6) + 1000
    for budget in range(7):
        tree = rerank(tokens, parents, scores, torch.tensor(0), budget)
        kept = {int(t) - 1000 for t in tree.tokens[1:]}
        assert len(kept) == budget
        assert all(int(parents[i]) < 0 or int(parents[i]) in kept for i in kept), (budget, kept)
        assert kept == set(range(budget))  # ties go to the earlier (shallower) pool entry
    # a child tied with its parent above a better-scored sibling subtree
    parents = torch.tensor([-1, -1, 0, 2])
    scores = torch.tensor([-0.5, -2.0, -0.5, -0.5])
    tree = rerank(torch.arange(4) + 1000, parents, scores, torch.tensor(0), 3)
    assert [int(t) - 1000 for t in tree.tokens[1:]] == [0, 2, 3] and tree.parents.tolist() == [-1, 0, 1, 2]


@pytest.mark.parametrize("seed", range(10))
def test_batched_functions_match_one_tree_each(seed):
    """batch_trees and rerank_batch on B rows (different pools, one budget) give, row by row,
    what the one-tree wrappers give: rows never mix."""
    rng = random.Random(100 + seed)
    k, depth = rng.randint(1, 3), rng.randint(1, 3)
    pools = [random_pool(rng, k, depth) for _ in range(3)]  # one shape (k, depth), different scores
    n = pools[0][0].numel()
    budget = rng.randint(0, n)
    roots = torch.tensor([5, 6, 7])
    toks = torch.stack([p[0] + 100 * r for r, p in enumerate(pools)])
    t, par, d, a, sc = rerank_batch(toks, torch.stack([p[1] for p in pools]), torch.stack([p[2] for p in pools]), roots, budget, depth)
    for r, pool in enumerate(pools):
        one = rerank(toks[r], pool[1], pool[2], roots[r], budget, depth)
        assert torch.equal(t[r], one.tokens) and torch.equal(par[r], one.parents) and torch.equal(d[r], one.depth)
        assert torch.equal(a[r], one.ancestors) and torch.equal(sc[r], one.scores)
    parents = torch.stack([random_parents(9, rng) for _ in range(4)])
    depth_b, anc_b = batch_trees(parents, 8)
    for r in range(4):
        one = tree_from_parents(torch.zeros(9, dtype=torch.long), parents[r])
        assert torch.equal(depth_b[r], one.depth) and torch.equal(anc_b[r], one.ancestors)
    host_depth, host_anc = host_ancestry(parents.numpy())  # the host's one pass (trees grown by sources.py)
    assert torch.equal(torch.from_numpy(host_depth), depth_b) and torch.equal(torch.from_numpy(host_anc), anc_b)


# -- static trees and chains ----------------------------------------------------------------------

def prior(path, top_k, decay=0.45):
    return sum(math.log(1 - decay) + r * math.log(decay) for r in path) + (len(path) - 1) * math.log(0.7)


@pytest.mark.parametrize("total,depth,top_k", [(2, 1, 1), (5, 4, 1), (8, 3, 2), (12, 4, 3), (24, 5, 6), (60, 6, 10), (40, 2, 3), (100, 3, 2)])
def test_static_choices_shape(total, depth, top_k):
    ch = static_choices(total, depth, top_k)
    n_every = sum(top_k ** d for d in range(1, depth + 1))
    assert len(ch) == min(total - 1, n_every)
    assert len(set(ch)) == len(ch)
    assert ch == sorted(ch, key=lambda p: (len(p), p))
    for p in ch:
        assert 1 <= len(p) <= depth and all(0 <= r < top_k for r in p)
        assert len(p) == 1 or p[:-1] in ch  # closed under prefixes: a tree
    # the chosen paths have the highest prior scores of all candidate paths (ties in any order).
    # Brute force over every path scoring at least the lowest chosen one (a path's prior only
    # drops as it grows, so the search prunes there without missing any).
    floor = min(prior(p, top_k) for p in ch) - 1e-9
    every, stack = [], [()]
    while stack:
        base = stack.pop()
        for r in range(top_k):
            p = base + (r,)
            if len(p) <= depth and prior(p, top_k) >= floor:
                every.append(p)
                stack.append(p)
    assert set(ch) <= set(every)
    best = sorted((prior(p, top_k) for p in every), reverse=True)[: len(ch)]
    assert sorted((prior(p, top_k) for p in ch), reverse=True) == pytest.approx(best)
    levels = choices_to_levels(ch)
    assert [len(lv) for lv in levels] == [sum(len(p) == d for p in ch) for d in range(1, len(levels) + 1)]
    for d, lv in enumerate(levels, start=1):
        paths = [p for p in ch if len(p) == d]
        for (parent, rank), p in zip(lv, paths):
            assert rank == p[-1]
            assert parent == (-1 if d == 1 else ch.index(p[:-1]))


def test_chain_choices_and_orphans():
    assert chain_choices(1) == [(0,)]
    assert chain_choices(4) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    assert choices_to_levels(chain_choices(3)) == [[(-1, 0)], [(0, 0)], [(1, 0)]]
    with pytest.raises(ValueError, match="no parent path"):
        choices_to_levels([(0,), (1, 0)])


# -- attention masks (batched: a cache cell has one index in every row) ----------------------------

def brute_tree_mask(past: int, parents: list[int], view: int, window):
    """[n, view] bool from first principles: node i (at cell past + i, position past + depth(i))
    sees the context cells < past and its own ancestors in the tree (itself included), and with a
    sliding window only keys less than `window` positions behind it; cells past the tree are junk."""
    n = len(parents)
    depth = [len(chain_of(parents, i)) - 1 for i in range(n)]
    out = torch.zeros(n, view, dtype=torch.bool)
    for i in range(n):
        q = past + depth[i]
        anc = set(chain_of(parents, i))
        for j in range(view):
            if j < past:
                ok, k_pos = True, j
            elif j - past < n:
                ok, k_pos = (j - past) in anc, past + depth[j - past]
            else:
                ok, k_pos = False, j
            if window is not None:
                ok = ok and k_pos > q - window
            out[i, j] = ok
    return out


@pytest.mark.parametrize("seed", range(25))
def test_context_and_tree_mask_brute_force(seed):
    """The verify mask as verifier.Verifier.forward_tree builds it, for a batch of trees of one size
    whose rows have different context lengths, against brute force per row."""
    from eagle2_core.tree import additive, batch_trees, context_and_tree, windowed

    rng = random.Random(seed)
    b, n = rng.randint(1, 3), rng.randint(1, 12)
    pasts = [rng.choice([0, 1, 3, 9]) for _ in range(b)]
    window = rng.choice([None, 1, 2, 4, 7])
    parents = torch.stack([random_parents(n, rng) for _ in range(b)])
    depth, anc = batch_trees(parents, n)
    past = torch.tensor(pasts)
    view = max(pasts) + n + rng.randint(0, 3)  # cells past a row's tree are junk it must not see
    q_pos = past[:, None] + depth
    cells = past[:, None] + torch.arange(n)
    k_pos = torch.arange(view).expand(b, view).scatter(1, cells, q_pos)
    allowed = windowed(context_and_tree(past, anc, view), q_pos, k_pos, window)
    assert allowed.shape == (b, n, view)
    for r in range(b):
        assert torch.equal(allowed[r], brute_tree_mask(pasts[r], parents[r].tolist(), view, window)), (r, pasts[r], window)
    # every row can see at least itself, so attention never sees an all-masked row
    assert allowed.any(dim=2).all()
    bias = additive(allowed, torch.float32)
    assert bias.shape == (b, 1, n, view)
    assert torch.equal(bias[:, 0] == 0, allowed) and (bias[:, 0][~allowed] == NEG).all()


@pytest.mark.parametrize("seed", range(10))
def test_context_and_tree_partial_visibility(seed):
    """The draft head's form: n queries (one depth) over m tree rows fed so far, any visibility."""
    from eagle2_core.tree import context_and_tree

    g = torch.Generator().manual_seed(seed)
    b, n, m = 2, 3, 7
    past = torch.tensor([2, 5])
    visible = torch.rand(b, n, m, generator=g) < 0.5
    view = 14
    allowed = context_and_tree(past, visible, view)
    for r in range(b):
        for i in range(n):
            for j in range(view):
                p = int(past[r])
                want = j < p or (p <= j < p + m and bool(visible[r, i, j - p]))
                assert bool(allowed[r, i, j]) == want


@pytest.mark.parametrize("window", [None, 1, 3])
def test_chain_tree_mask_is_causal_mask(window):
    from eagle2_core.tree import batch_trees, causal_rows, context_and_tree, windowed

    for n, past in [(1, 0), (5, 0), (4, 6), (7, 2)]:
        parents = torch.arange(-1, n - 1)[None]
        depth, anc = batch_trees(parents, n)
        view = past + n + 2
        q_pos = past + depth
        k_pos = torch.arange(view)[None]
        tree = windowed(context_and_tree(torch.tensor([past]), anc, view), q_pos, k_pos, window)
        causal = windowed(causal_rows(q_pos, view), q_pos, k_pos, window)
        assert torch.equal(tree, causal)


def test_causal_rows_brute_force():
    from eagle2_core.tree import causal_rows

    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    m = causal_rows(pos, 9)
    assert m.shape == (2, 3, 9)
    for r in range(2):
        for i in range(3):
            assert m[r, i].tolist() == [j <= int(pos[r, i]) for j in range(9)]


def causal_attention_bias(q_len: int, past_len: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The ordinary causal additive mask [1, 1, q_len, past_len + q_len], composed as the cycle composes a prefill's."""
    q = past_len + torch.arange(q_len)[None]
    k = torch.arange(past_len + q_len)[None]
    return additive(windowed(causal_rows(q, past_len + q_len), q, k, window), dtype)


def test_causal_attention_bias_brute_force():
    for q_len, past, window in [(1, 0, None), (5, 0, None), (3, 4, None), (6, 2, 3), (1, 9, 2)]:
        b = causal_attention_bias(q_len, past, torch.bfloat16, window)
        assert b.shape == (1, 1, q_len, past + q_len)
        for i in range(q_len):
            for j in range(past + q_len):
                ok = j <= past + i and (window is None or j > past + i - window)
                assert float(b[0, 0, i, j]) == (0.0 if ok else float(torch.finfo(torch.bfloat16).min))


# -- the engine's drafting builds the tree it claims ---------------------------------------------

@pytest.fixture(scope="module")
def random_head(tiny_lm):
    from eagle2_core.head import DraftHead, HeadSpec

    model = tiny_lm("llama", vocab_size=16, max_position_embeddings=64)
    torch.manual_seed(3)
    head = DraftHead(HeadSpec.for_target(model.config)).bind(model)
    with torch.no_grad():  # sharpen: peaked attention makes positions and masks matter to the ranking
        for name, w in head.named_parameters():
            if name.endswith("proj.weight") or name.startswith("fc."):
                w.mul_(3.0)
    return model, head


@torch.no_grad()
def brute_logp(head, ctx_tokens, ctx_feats, path_tokens):
    """Head log-probs after the context pairs and a tree path, recomputed with no cache/tree mask.

    The pair fed for a drafted token is (draft hidden state of its parent, token), one position
    after its parent, exactly the EAGLE recurrence; run causally from scratch every time.
    """
    toks, feats = list(ctx_tokens), [f for f in ctx_feats]
    for t in [None] + list(path_tokens):
        if t is not None:
            toks.append(t)
            feats.append(h_last)
        n = len(toks)
        h = head(torch.tensor([toks]), torch.stack(feats)[None], torch.arange(n)[None],
                 attention_mask=causal_attention_bias(n, 0, torch.float32))[0]
        h_last = h[-1]
    return torch.log_softmax(head.draft_logits(h_last[None]).float(), -1)[0]


@pytest.mark.parametrize("fixed", [False, True], ids=["live", "fixed"])
@pytest.mark.parametrize("shape", ["dynamic", "static", "chain"])
def test_draft_children_are_head_top_ranks(random_head, shape, fixed, monkeypatch):
    """cycle.Cycle.draft_fn on two rows with different contexts, over three cycles: children of
    every node are the head's top-ranked tokens there (dynamic: a prefix of the ranking;
    static/chain: the ranks the shape names), recomputed without any KV cache or tree mask; for
    dynamic trees every candidate's path score handed to rerank equals the brute-force sum of
    log-probs along its path; the head's context grows by the absorbed pairs only (tree rows and
    the absorb's padding rows are not context), and an idle row's context stays where it is.
    Live mode attends over the longest row; fixed mode over the whole capacity bucket, whose
    stale cells must stay hidden."""
    import eagle2_core.cycle as cycle_mod
    import eagle2_core.drafter as drafter_mod
    from eagle2_core.target import TargetRunner
    from eagle2_core.tree import row_tree
    from eagle2_core.treesettings import TreeSettings

    pools = []

    def spy_rerank(pool_tokens, pool_parents, pool_scores, *args, **kw):
        pools.append((pool_tokens.tolist(), pool_parents.tolist(), pool_scores.tolist()))
        return rerank_batch(pool_tokens, pool_parents, pool_scores, *args, **kw)

    monkeypatch.setattr(drafter_mod, "rerank_batch", spy_rerank)
    model, head = random_head
    settings = TreeSettings(shape=shape, total_tokens=10 if shape != "chain" else 4, depth=3, top_k=3)
    cycle = cycle_mod.Cycle(TargetRunner(model), head, settings, batch=2, capacity=8, fixed=fixed)
    w = cycle.width
    assert w == settings.depth + 1
    g = torch.Generator().manual_seed(0)
    hidden = head.spec.hidden_size
    ctx_t, ctx_f = [[], []], [[], []]
    head_len = torch.zeros(2, dtype=torch.long)
    # pairs absorbed per cycle and row (at most depth + 1), as decoding does, and the absorb's
    # width: the fixed width (fixed mode), or the busy rows' widest (live mode: the last read-back
    # says). Columns past a row's n_new are padding (junk here) that must not matter. The last
    # cycle leaves row 1 idle with a stale n_new wider than the absorb.
    plan = [([4, 1], [True, True], w), ([2, 3], [True, True], 3), ([1, 4], [True, False], 1)]
    for cycle_i, (n_new, active, absorb) in enumerate(plan):
        cycle.drafter.absorb = absorb  # (fixed mode always absorbs the full width)
        new_t = torch.randint(0, 16, (2, w), generator=g)
        new_f = torch.randn(2, w, hidden, generator=g)
        n_new_t, active_t = torch.tensor(n_new), torch.tensor(active)
        root = new_t[torch.arange(2), n_new_t - 1]
        cycle.rows.host_len = [int(head_len[r]) + n_new[r] for r in range(2)]  # the target's lengths (the live view)
        tokens, parents, depth, anc, scores, new_len = cycle.draft_fn(new_t, new_f, head_len.clone(), n_new_t, root, active_t)
        for r in range(2):
            if active[r]:
                ctx_t[r] += new_t[r, : n_new[r]].tolist()
                ctx_f[r] += list(new_f[r, : n_new[r]])
        assert new_len.tolist() == [len(ctx_t[r]) if active[r] else int(head_len[r]) for r in range(2)]
        head_len = new_len
        for r in range(2):
            if not active[r]:
                continue
            tree = row_tree(tokens, parents, depth, anc, scores, r)
            assert tree.tokens[0] == root[r] and tree.size <= settings.total_tokens
            assert int(tree.depth.max()) <= settings.depth
            if shape == "dynamic":
                assert tree.size == settings.total_tokens
            if shape == "chain":
                assert tree.parents.tolist() == [-1, 0, 1, 2]
            p, toks = tree.parents.tolist(), tree.tokens.tolist()
            assert tree.depth.tolist() == [len(chain_of(p, i)) - 1 for i in range(tree.size)]
            kids = [[c for c in range(1, tree.size) if p[c] == i] for i in range(tree.size)]
            for i in range(tree.size):
                if not kids[i]:
                    continue
                path = [toks[j] for j in reversed(chain_of(p, i)[:-1])]
                ranked = torch.topk(brute_logp(head, ctx_t[r], ctx_f[r], path), 16).indices.tolist()
                got = [toks[c] for c in kids[i]]
                if shape == "dynamic":
                    assert got == ranked[: len(got)], (cycle_i, r, i, got, ranked)  # a prefix of the ranking
                else:
                    # static/chain nodes follow the choices list in order; a child's rank is its path's last entry
                    choices = static_choices(10, 3, 3) if shape == "static" else chain_choices(3)
                    assert got == [ranked[choices[c - 1][-1]] for c in kids[i]], (cycle_i, r, i)
            if shape == "dynamic":
                ptoks, ppar, pscores = (x[r] for x in pools[-1])
                assert len(ptoks) == 3 + 9 + 9  # k first-level candidates, then k x k per expanded level
                memo = {}
                for j in range(len(ptoks)):
                    chain = [j]
                    while ppar[chain[-1]] >= 0:
                        chain.append(ppar[chain[-1]])
                    path_toks = [ptoks[c] for c in reversed(chain)]
                    brute = 0.0
                    for d in range(len(path_toks)):
                        key = tuple(path_toks[:d])
                        if key not in memo:
                            memo[key] = brute_logp(head, ctx_t[r], ctx_f[r], list(key))
                        brute += float(memo[key][path_toks[d]])
                    assert pscores[j] == pytest.approx(brute, rel=1e-4, abs=1e-3), (cycle_i, r, j, path_toks)
                # the tree keeps the pool's best path scores (rerank), and reports them
                kept = sorted(tree.scores[1:].tolist(), reverse=True)
                assert kept == pytest.approx(sorted(pscores, reverse=True)[: tree.size - 1], rel=1e-6)
            else:
                choices = static_choices(10, 3, 3) if shape == "static" else chain_choices(3)
                assert tree.size == len(choices) + 1
                assert p == [-1] + [0 if len(c) == 1 else choices.index(c[:-1]) + 1 for c in choices]


def test_calibration_table_from_recorded_cycles():
    """A hand-made example: two cycles of a 4-node dynamic tree (3 drafted nodes) with known path
    probabilities and known acceptance."""
    from eagle2_core.events import Summary

    s = Summary()
    # cycle 1: nodes 0.95 (accepted), 0.55 (accepted, child of the first), 0.05 (a rejected sibling)
    s.record_confidence(torch.tensor([0.95, 0.55, 0.05]), torch.tensor([1.0, 1.0, 0.0]))
    # cycle 2: nodes 0.92 (rejected), 0.52 (rejected), 0.08 (accepted)
    s.record_confidence(torch.tensor([0.92, 0.52, 0.08]), torch.tensor([0.0, 0.0, 1.0]))
    s.record_confidence(torch.zeros(0), torch.zeros(0))  # a one-node tree: nothing drafted
    other = Summary()
    other.merge(s)  # merging carries the bins
    table = {tuple(b["bin"]): b for b in other.calibration_table}
    assert set(table) == {(0.0, 0.1), (0.5, 0.6), (0.9, 1.0)}
    assert table[(0.9, 1.0)]["nodes"] == 2 and table[(0.9, 1.0)]["accepted"] == 0.5
    assert table[(0.9, 1.0)]["confidence"] == pytest.approx(0.935, abs=1e-4)
    assert table[(0.5, 0.6)]["accepted"] == 0.5 and table[(0.0, 0.1)]["accepted"] == 0.5
    assert Summary().calibration_table == []
