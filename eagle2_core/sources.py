"""Draft sources: who proposes the nodes of a row's tree, and how sure each one is.

EAGLE-2 (section 3) rests on one finding: a drafted node's path probability, the product of the
draft's confidences along its path, approximates the chance that verification accepts it. The
dynamic tree (section 4) then grows and reranks by that estimate. Nothing in that mechanism needs
the estimate to come from one draft head. Here three sources propose children for the nodes of one
tree, each child with an estimate of the chance the target takes it after its parent (a
*conditional*); a node's score is the product of the conditionals along its path, so a child never
outscores its parent and a best-first prefix of the nodes is always a tree (the rerank's
invariant). The sources:

  * "head": the trained draft head's nodes (the cycle's own expansion, cycle.py), its confidence
    corrected by the per-bin calibration the budget chooser measures (budget.calibrate);
  * "recycle": the target's own top-k next tokens after each token, kept from the logits of every
    verified tree row, accepted or not (Token Recycling, arXiv 2408.08696), with their probability;
  * "match": the continuation of the longest suffix of the context (prompt, earlier turns, the
    answer so far, and the node's own path) seen earlier in it (prompt lookup / suffix matching),
    branching where several continuations were seen, by count.

The head-free sources cost a host lookup, not a draft step, and may extend any node, the head's
included. Each source's conditionals are calibrated online per bin (of its raw confidence, or of
match length) from what verification did, then corrected per depth and by whether the other
sources agreed at that parent (`Agreement`), so a head node, a recycled node and a copied node
are ranked on one scale and the budget chooser (budget.py) sizes the merged tree by the same
expected-tokens-per-ms rule: a source whose nodes do not pay their verify rows simply loses its
place in the tree. Growth stops where no larger tree could pay (`budget.growth_floor`). A token
proposed twice under one parent is one node. Only which tokens are
verified changes, so the output stays the target's (greedy identity; the keyed sampling rule,
accept.py, is indifferent to how the tree was made).

Host-side code on lists and numpy arrays: the live cycle only (a captured cycle drafts with the head).
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from .tree import host_ancestry

SOURCES = ("head", "recycle", "match")
HEAD_FREE = ("recycle", "match")
SOURCE_DEPTH = 8        # the deepest node a head-free source grows (a copied chain may run past the head's depth)
RECYCLE_K = 8           # next tokens kept per token in the recycling table
MATCH_MAX = 4           # longest suffix (in tokens) the context index matches
MATCH_RECENT = 16       # occurrences of a suffix counted for its continuations (the most recent ones)
CAL_BINS = 10           # bins of the predicted conditional in the reported calibration


def parse_sources(text: str | None, have_head: bool) -> tuple[str, ...]:
    """`--draft-sources` ("head,recycle,match", or None for the default: every source there is)
    as a tuple, checked: the head only where one is loaded. Raises ValueError with the one line to show."""
    if text is None:
        return SOURCES if have_head else HEAD_FREE
    names = tuple(dict.fromkeys(s.strip().lower() for s in text.split(",") if s.strip()))
    if not names:
        raise ValueError(f"--draft-sources: name at least one of {', '.join(SOURCES)} (plain decoding: compare --against plain)")
    bad = [s for s in names if s not in SOURCES]
    if bad:
        raise ValueError(f"--draft-sources: unknown source {bad[0]!r} (choose from {', '.join(SOURCES)})")
    if "head" in names and not have_head:
        raise ValueError("--draft-sources: 'head' needs a draft head (this run has none: --draft none or no known head)")
    return names


class Calibration:
    """Measured acceptance of one source's children given their parent was accepted, per bin of
    the source's own raw confidence: (accepted + w * prior) / (proposed + w). With no evidence
    the prior stands (for the table, its own probability; section 3's finding); with much, the
    measured rate does."""

    def __init__(self, prior: np.ndarray, weight: float = 10.0):
        self.prior = np.asarray(prior, dtype=np.float64)
        self.nodes = np.zeros_like(self.prior)
        self.accepted = np.zeros_like(self.prior)
        self.weight = weight

        self._rates: list[float] | None = None

    def rate(self, b: int) -> float:
        if self._rates is None:  # read per candidate in tree growth: a list, refreshed after new evidence
            self._rates = ((self.accepted + self.weight * self.prior) / (self.nodes + self.weight)).tolist()
        return self._rates[b]

    def add(self, b: int, accepted: bool) -> None:
        self.nodes[b] += 1
        self.accepted[b] += accepted
        self._rates = None


def prob_bin(p: float, bins: int = CAL_BINS) -> int:
    return min(bins - 1, max(0, int(p * bins)))


ALONE, WITH, AGAINST = 0, 1, 2  # a candidate's agreement: no other source spoke at its parent; another proposed it too; others proposed only other tokens


class Agreement:
    """A correction of each source's calibrated conditional by agreement and depth.

    The per-source calibration is marginal over nodes where the sources agree and where they
    disagree, and over depths. Measured on SmolLM2 (mt16, float32 weights, accepted over
    predicted): a token one source proposed beside another source's different token 0.43-0.71,
    one two sources proposed 1.29-1.76. Per (source, agreement, depth 1 / 2 / 3+, bin of the
    conditional): accepted over predicted, shrunk toward the same ratio over the agreement state
    and depth (`table`), a factor on the conditional (1 with no evidence). (What selection does
    to whole path scores is corrected where the tree is sized: budget.calibrate_by_depth.)"""

    DEPTHS = 3

    def __init__(self, bins: int = CAL_BINS):
        self.bins = bins
        self.accepted: dict[str, np.ndarray] = {}
        self.predicted: dict[str, np.ndarray] = {}
        self._factors: dict[str, list] = {}  # src -> [state][depth][bin] as lists, refreshed after new evidence

    def _arrays(self, src: str):
        if src not in self.accepted:
            self.accepted[src] = np.zeros((3, self.DEPTHS, self.bins))
            self.predicted[src] = np.zeros((3, self.DEPTHS, self.bins))
        return self.accepted[src], self.predicted[src]

    def factor(self, src: str, state: int, depth: int, c: float) -> float:
        f = self._factors.get(src)
        if f is None:
            f = self._factors[src] = self.table(src).tolist()
        return f[state][min(depth, self.DEPTHS) - 1][prob_bin(c, self.bins)]

    def table(self, src: str) -> np.ndarray:
        """[state, depth, bin] factors, each level shrunk toward the one above it: a state's
        factor over all its depths and bins (toward 1), a depth's toward its state's, a bin's
        toward its depth's, each with one predicted acceptance of pseudo-evidence. Shrunk toward 1
        directly, the 90 cells of a source each held a few predicted acceptances after a chat's
        worth of cycles and stayed near 1: recycled tokens proposed beside another source's
        different token were accepted at about half their prediction (0.08 of 0.15, SmolLM2, mt16)
        and displaced the head's better nodes."""
        acc, pred = self._arrays(src)
        by_state = (acc.sum((1, 2)) + 1.0) / (pred.sum((1, 2)) + 1.0)
        by_depth = (acc.sum(2) + by_state[:, None]) / (pred.sum(2) + 1.0)
        return (acc + by_depth[..., None]) / (pred + 1.0)

    def add(self, src: str, state: int, depth: int, c: float, accepted: bool) -> None:
        acc, pred = self._arrays(src)
        cell = (state, min(depth, self.DEPTHS) - 1, prob_bin(c, self.bins))
        acc[cell] += accepted
        pred[cell] += c
        self._factors.pop(src, None)


class RecyclingTable:
    """token -> the target's own top-k next tokens and their probabilities, from its latest
    verified row after that token (Token Recycling's adjacency table). One per engine: every row
    and turn of a process reads and refines it (its size: vocab x k x 8 bytes, 9.7 MB for Qwen's
    151,936 tokens at k = 8)."""

    def __init__(self, vocab: int, k: int = RECYCLE_K):
        self.ids = np.full((vocab, k), -1, dtype=np.int32)
        self.probs = np.zeros((vocab, k), dtype=np.float32)
        self.k = k

    def note(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Rows of `logits` [r, V] are the target's scores after tokens [r] (last write wins).

        The k best are kept with their softmax *among themselves*: a normaliser over the whole
        vocabulary would cost a second pass over every row (as much again as the top-k, which
        already costs about what greedy acceptance's argmax does), and the number is only a raw
        confidence whose bin the calibration maps to a measured acceptance."""
        if tokens.numel() == 0:
            return
        self.note_top(tokens, *torch.topk(logits, min(self.k, logits.shape[-1]), dim=-1))

    def note_top(self, tokens: torch.Tensor, top: torch.Tensor, ids: torch.Tensor) -> None:
        """`note` from rows' top-k already taken (values and ids, best first)."""
        probs = torch.softmax(top.float(), -1)
        t = tokens.cpu().numpy()
        ok = (t >= 0) & (t < self.ids.shape[0])
        ids_np, probs_np = ids.cpu().numpy(), probs.cpu().numpy()
        k = ids_np.shape[1]
        self.ids[t[ok], :k] = ids_np[ok]
        self.probs[t[ok], :k] = probs_np[ok]

    def children(self, token: int) -> list[tuple[int, float]]:
        if not 0 <= token < self.ids.shape[0]:
            return []
        return [(t, q) for t, q in zip(self.ids[token].tolist(), self.probs[token].tolist()) if t >= 0]


class ContextIndex:
    """Every n-gram (n <= MATCH_MAX) of one sequence's context, with where each occurrence ends:
    the suffix matcher's index. Fed as the context grows (prompt, then each emitted token)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple, list[int]] = {}

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(int(t))
            n = len(toks)
            for m in range(1, min(MATCH_MAX, n) + 1):
                self.ends.setdefault(tuple(toks[n - m:]), []).append(n)  # toks[n] follows, once known

    def children(self, path: tuple[int, ...]) -> list[tuple[int, float, int]]:
        """Continuations of the context followed by `path`: (token, share of occurrences, match
        length) for the longest suffix seen earlier with a known next token."""
        toks, n = self.tokens, len(self.tokens)
        for m in range(min(MATCH_MAX, n + len(path)), 0, -1):
            gram = tuple(path[-m:]) if len(path) >= m else tuple(toks[n - (m - len(path)):]) + tuple(path)
            # ends ascend, and only the last can be n (the context's own end: no next token yet)
            ends = [e for e in self.ends.get(gram, ())[-MATCH_RECENT - 1:] if e < n][-MATCH_RECENT:]
            if ends:
                counts = Counter(toks[e] for e in ends)
                total = len(ends)
                return [(t, c / total, m) for t, c in counts.most_common()]
        return []


def match_bin(length: int, share: float) -> int:
    """The match calibration's bin: match length (1 .. MATCH_MAX) x whether every occurrence agreed."""
    return 2 * (min(length, MATCH_MAX) - 1) + (share >= 0.999)


MATCH_PRIOR = np.array([0.15, 0.3, 0.25, 0.45, 0.35, 0.6, 0.45, 0.7])


@dataclass
class RowTree:
    """One row's merged tree in best-first order (node 0 the root): what verification reads and
    what the calibration learns from. `proposers[i]`: (source, bin, predicted conditional) of
    every source that proposed node i."""
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    proposers: list[list[tuple[str, int, float]]] = field(default_factory=list)
    head_raw: list[float | None] = field(default_factory=list)  # the head's uncalibrated path probability, where it proposed the node
    states: list[list[tuple[int, float]]] = field(default_factory=list)  # per proposer: (agreement, conditional before its correction)


class DraftSources:
    """The head-free sources of one engine, and the merge of every source's candidates into one
    tree per row. `active` names the sources that run ("head" among them or not)."""

    def __init__(self, active: tuple[str, ...], vocab: int, max_depth: int = SOURCE_DEPTH):
        self.active = tuple(active)
        self.vocab, self.max_depth = vocab, max_depth
        self.table = RecyclingTable(vocab) if "recycle" in self.active else None
        self.cal = {"recycle": Calibration((np.arange(CAL_BINS) + 0.5) / CAL_BINS * 0.6),
                    "match": Calibration(MATCH_PRIOR)}
        self.agree = Agreement()
        self._index: dict[int, tuple[object, ContextIndex]] = {}  # id(slot) -> (slot, its context index)
        self.last: list[RowTree | None] = []

    @property
    def head_free(self) -> bool:
        return any(s in self.active for s in HEAD_FREE)

    def note_logits(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's scores after `tokens` (verified tree rows, a prompt's last token)."""
        if self.table is not None:
            self.table.note(tokens.reshape(-1), logits)

    def argmax_noted(self, tokens: torch.Tensor, logits: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy acceptance's argmax of each row of `logits` [r, V], with the recycling table fed
        from the same pass: the top-k's first index is the argmax except where the best two scores
        tie exactly, where `argmax` itself decides (its first maximal index, as `generate`'s). One
        pass over the vocabulary instead of two. `keep` [r] bool: the rows the table learns from."""
        if self.table is None or logits.shape[-1] < 2:
            return logits.argmax(-1)
        top, ids = torch.topk(logits, min(self.table.k, logits.shape[-1]), dim=-1)
        best = ids[:, 0]
        tie = top[:, 0] == top[:, 1]
        if bool(tie.any()):
            best = torch.where(tie, logits.argmax(-1), best)
        if keep is None:
            self.table.note_top(tokens.reshape(-1), top, ids)
        else:
            self.table.note_top(tokens.reshape(-1)[keep], top[keep], ids[keep])
        return best

    def _context(self, slot) -> ContextIndex:
        key = id(slot)
        got = self._index.get(key)
        if got is None or got[0] is not slot:
            got = self._index[key] = (slot, ContextIndex())
        index = got[1]
        have, prompt = len(index.tokens), slot.prompt
        if have < len(prompt):
            index.extend(prompt[have:])
            have = len(prompt)
        index.extend(slot.tokens[have - len(prompt):])  # the root (the last emitted token) included
        return index

    def forget(self, live_slots) -> None:
        """Drop the indexes of sequences no longer decoding."""
        keep = {id(s) for s in live_slots if s is not None}
        for k in [k for k in self._index if k not in keep]:
            del self._index[k]

    def grow_row(self, slot, root: int, cap: int, head=None, floor=None) -> RowTree:
        """Best-first growth of one row's tree to `cap` nodes (root included), by score.

        `head`: the head's pool for this row as lists (tokens, pool parents, calibrated path
        probabilities, raw path probabilities), or None. A head node's conditional is its
        calibrated path probability over its pool parent's; the head-free sources extend any node
        the tree takes, to `max_depth`. `floor` (budget.TreePolicy.growth_floor): growth stops
        where the best candidate left scores below floor[size] times the tree's expected tokens
        so far, where no larger tree can pay its verify rows (a tree grown to 16 nodes of which
        the budget verifies 5 spent most of its host time on nodes never verified)."""
        use_rec = self.table is not None
        use_match = "match" in self.active
        index = self._context(slot) if use_match else None
        kids: dict[int, list[int]] = {}
        if head is not None:
            for j, p in enumerate(head[1]):
                kids.setdefault(p, []).append(j)
        tokens, parents, scores, depth = [root], [-1], [1.0], [0]
        paths: list[tuple[int, ...]] = [()]
        head_of: list[int | None] = [-1 if head is not None else None]
        proposers: list[list] = [[]]
        head_raw: list[float | None] = [None]
        where: dict[tuple[int, int], int] = {}
        heap: list = []
        seq = 0
        offered: dict[int, dict[str, set]] = {}
        agree = self.agree
        states: list[list[tuple[int, float]]] = [[]]

        def offer(i: int, cands: list) -> None:
            """Push node i's candidates (token, source, head index, bin, conditional), each
            conditional corrected by its agreement with the other sources speaking at node i."""
            nonlocal seq
            said = offered.setdefault(i, {})
            for t, src, _, _, _ in cands:
                said.setdefault(src, set()).add(t)
            for t, src, hj, b, c in cands:
                others = [x for x in said if x != src]
                state = ALONE if not others else (WITH if any(t in said[x] for x in others) else AGAINST)
                cc = min(1.0, c * agree.factor(src, state, depth[i] + 1, c))
                heapq.heappush(heap, (-scores[i] * cc, seq, i, t, src, hj, b, cc, state, c))
                seq += 1

        def head_kids(i: int) -> list:
            hp = head_of[i]
            if hp is None or hp not in kids:
                return []
            base = head[2][hp] if hp >= 0 else 1.0
            out = []
            for j in kids[hp]:
                c = min(1.0, head[2][j] / base) if base > 0 else 0.0
                out.append((head[0][j], "head", j, prob_bin(c), c))
            return out

        def push(i: int) -> None:
            cands = head_kids(i)
            if depth[i] < self.max_depth:
                if use_rec:
                    cal = self.cal["recycle"]
                    for t, p in self.table.children(tokens[i]):
                        b = prob_bin(p)
                        cands.append((t, "recycle", -1, b, cal.rate(b)))
                if use_match:
                    cal = self.cal["match"]
                    for t, share, m in index.children(paths[i]):
                        b = match_bin(m, share)
                        cands.append((t, "match", -1, b, cal.rate(b) * (share if share < 0.999 else 1.0)))
            offer(i, cands)

        push(0)
        expected = 1.0
        while heap and len(tokens) < cap:
            if floor is not None and -heap[0][0] < expected * floor[len(tokens)]:
                break
            neg, _, par, tok, src, hj, b, c, state, c0 = heapq.heappop(heap)
            node = where.get((par, tok))
            if node is not None:  # proposed again under the same parent: one node, every proposer noted
                proposers[node].append((src, b, c))
                states[node].append((state, c0))
                if hj >= 0 and head_of[node] is None:
                    head_of[node], head_raw[node] = hj, head[3][hj]
                    offer(node, head_kids(node))
                continue
            node = len(tokens)
            where[(par, tok)] = node
            tokens.append(tok)
            parents.append(par)
            scores.append(-neg)
            expected -= neg
            depth.append(depth[par] + 1)
            paths.append(paths[par] + (tok,))
            head_of.append(hj if hj >= 0 else None)
            proposers.append([(src, b, c)])
            states.append([(state, c0)])
            head_raw.append(head[3][hj] if hj >= 0 else None)
            push(node)
        return RowTree(tokens, parents, scores, proposers, head_raw, states)

    def observe(self, path: list[list[int]], accepted: list[int], rows: list[int], summaries, verified: int,
                emitted: list[list[int]]) -> tuple[int, list]:
        """A verified cycle: per busy row its accepted path (node indices, root first) and count;
        `verified`: how many of each tree's best-first nodes went through the target (the budget's
        size); `emitted`: per busy row the tokens it produced (accepted + the bonus).

        Every grown node whose parent is on the target's path learns whether it is too, verified
        or not (`on_target`): the target's token after a node on its path is the next one emitted
        (greedy: the argmax; sampling: the keyed rule's draw from the node's p and its position's
        uniform, which no tree changes), so the node would have been accepted exactly when its
        token is that one. Learning from verified nodes only, or counting the rest as rejected,
        taught the calibration that the nodes the budget left out fail, which is what the budget
        reads to leave them out (section 3's estimate, biased by its own choice). The summaries
        (events.Summary) count verified nodes, accepted nodes and calibration per source.
        Returns (how many accepted nodes exist because of the head: those it alone proposed and
        the accepted nodes below them, what it adds to the others; per busy row its
        `known_outcomes`, for the merged calibration the budget sizes trees on, or None)."""
        only_head, known = 0, []
        for j, (b, summary) in enumerate(zip(rows, summaries)):
            tree = self.last[b] if b < len(self.last) else None
            if tree is None:
                known.append(None)
                continue
            fate, deep = on_target(tree, emitted[j])
            known.append(known_outcomes(tree, emitted[j], (fate, deep)))
            # what the head adds: accepted nodes only it proposed, and the accepted nodes below
            # them (the others' extensions of a node only the head proposed exist because of it)
            owed = False
            for i in path[b][1 : accepted[b] + 1]:
                if i >= len(tree.tokens):  # a padding node (pad_trees) the target happened to take: no source's
                    break
                owed = owed or all(src == "head" for src, _, _ in tree.proposers[i])
                only_head += owed
            for i in range(1, len(tree.tokens)):
                checked = i < verified
                # the parent is (or, unverified, would have been) accepted and the target's token
                # after it is known: the conditional outcome each proposer is calibrated on
                conditional = fate[tree.parents[i]] == 1 and fate[i] >= 0
                if not (conditional or checked):
                    continue
                got = fate[i] == 1
                agreed = tree.states[i] if i < len(tree.states) else ()
                for k, (src, bn, pred) in enumerate(tree.proposers[i]):
                    if conditional and src in self.cal:
                        self.cal[src].add(bn, got)
                    if conditional and k < len(agreed):
                        state, c0 = agreed[k]
                        self.agree.add(src, state, deep[i], c0, got)
                    if summary is not None and checked:
                        summary.record_source(src, got, pred if conditional else None)
        return only_head, known


def on_target(tree: RowTree, emitted: list[int]) -> tuple[list[int], list[int]]:
    """Each node's fate against the tokens the target emitted after the root (`emitted`: accepted
    path plus bonus; greedy or under the keyed sampling rule, the token the target takes after a
    node depends on the node's path alone), verified or not, and its depth: 1 where its path is the target's
    tokens, 0 once its path leaves them, -1 where it follows every emitted token and runs deeper
    (what the target takes there was never computed)."""
    n = len(tree.tokens)
    state, deep = [1] + [0] * (n - 1), [0] * n
    for i in range(1, n):
        p = tree.parents[i]
        d = deep[i] = deep[p] + 1
        state[i] = state[p] if state[p] != 1 else (-1 if d > len(emitted) else int(tree.tokens[i] == emitted[d - 1]))
    return state, deep


def tokens_taken(tree: RowTree, n: int, emitted: list[int]) -> int:
    """Tokens a cycle would have produced verifying the first `n` nodes of `tree`
    (`on_target`): one more than the deepest of them on the target's path. A path that runs past
    the emitted tokens counts as far as they go (a lower bound there)."""
    state, deep = on_target(tree, emitted)
    return 1 + max((min(deep[i], len(emitted)) for i in range(min(n, len(state))) if state[i] != 0), default=0)


def known_outcomes(tree: RowTree, emitted: list[int], fate=None) -> tuple[list[float], list[int], list[bool]]:
    """Every grown node whose fate the emitted tokens decide (`on_target`, or its result `fate`),
    verified or not: (scores, depths, accepted)."""
    state, deep = fate or on_target(tree, emitted)
    keep = [i for i in range(1, len(state)) if state[i] >= 0]
    return [tree.scores[i] for i in keep], [deep[i] for i in keep], [state[i] == 1 for i in keep]


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth (the root 0) of a tree whose parents precede their children."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def pad_trees(trees: list[RowTree | None], n: int, device, vocab: int = 1 << 62):
    """B row trees cut to their first `n` nodes (best-first order keeps each a tree), padded to `n`
    with root children (verified like any node, so never wrong, only a wasted row) whose tokens no
    other root child carries (a duplicate would make two accepted candidates for one depth), as
    tensors: (tokens, parents, scores as log path probabilities, depths), each [B, n], and the
    ancestor masks [B, n, n] (tree.host_ancestry)."""
    tok = np.zeros((len(trees), n), dtype=np.int64)
    par = np.zeros((len(trees), n), dtype=np.int64)
    sc = np.full((len(trees), n), -30.0, dtype=np.float64)
    par[:, 0] = -1
    sc[:, 0] = 0.0
    for b, t in enumerate(trees):
        if t is None:
            continue
        m = min(n, len(t.tokens))
        tok[b, :m] = t.tokens[:m]
        par[b, :m] = t.parents[:m]
        sc[b, :m] = np.log(np.maximum(np.asarray(t.scores[:m], dtype=np.float64), 1e-13))
        if m < n:
            used = {t.tokens[i] for i in range(1, m) if t.parents[i] == 0}
            free = [x for x in range(min(vocab, n + len(used) + 1)) if x not in used]  # a tiny vocabulary may run out: then 0
            tok[b, m:] = [free[i] if i < len(free) else 0 for i in range(n - m)]
    depth, anc = host_ancestry(par)
    return (torch.from_numpy(tok).to(device), torch.from_numpy(par).to(device), torch.from_numpy(sc).float().to(device),
            torch.from_numpy(depth).to(device), torch.from_numpy(anc).to(device))
