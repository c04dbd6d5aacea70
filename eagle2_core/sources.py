"""Draft sources: who proposes the nodes of a row's tree, and how sure each one is.

EAGLE-2 (section 3) rests on one finding: a drafted node's path probability, the product of the
draft's confidences along its path, approximates the chance that verification accepts it. The
dynamic tree (section 4) then grows and reranks by that estimate. Nothing in that mechanism needs
the estimate to come from one draft head. Here three sources propose children for the nodes of one
tree, each child with an estimate of the chance the target takes it after its parent (a
*conditional*); a node's score is the product of the conditionals along its path, so a child never
outscores its parent and a best-first prefix of the nodes is always a tree (the rerank's
invariant). The sources:

  * "head": the trained draft head's nodes (the cycle's own expansion, cycle.py);
  * "recycle": the target's own top-k next tokens after each token, kept from the logits of every
    verified tree row, accepted or not (Token Recycling, arXiv 2408.08696), with their probability;
  * "match": the continuation of the longest suffix of the context (prompt, earlier turns, the
    answer so far, and the node's own path) seen earlier in it (prompt lookup / suffix matching),
    branching where several continuations were seen, by count.

The head-free sources cost a host lookup, not a draft step, and may extend any node, the head's
included. A token proposed by several sources under one parent is one node, and its conditional
is the policy's one acceptance estimate for that set of proposers, its depth and its raw
confidence (policy.Acceptance), so a head node, a recycled node and a copied node are ranked on
one scale and the policy sizes the merged tree by the expected-tokens-per-ms rule: a source whose
nodes do not pay their verify rows simply loses its place in the tree. Growth stops where no
larger tree could pay (`policy.Policy.growth_floor`). Only which tokens are verified changes, so
the output stays the target's (greedy identity; the keyed sampling rule, accept.py, is
indifferent to how the tree was made).

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
        self.note_top(tokens.cpu().numpy(), *(x.cpu().numpy() for x in torch.topk(logits, min(self.k, logits.shape[-1]), dim=-1)))

    def note_top(self, t: np.ndarray, top: np.ndarray, ids: np.ndarray) -> None:
        """`note` from rows' top-k already taken (values and ids as arrays, best first): the
        softmax over k values in numpy, fewer calls than a dispatched op and its read-back."""
        e = np.exp(top - top[:, :1])
        ok = (t >= 0) & (t < self.ids.shape[0])
        self.ids[t[ok], : ids.shape[1]] = ids[ok]
        self.probs[t[ok], : ids.shape[1]] = (e / e.sum(-1, keepdims=True))[ok]

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


def match_confidence(length: int, share: float) -> float:
    """The matcher's raw confidence: the share of the suffix's occurrences that continued so,
    times m / (m + 1) for a suffix of m tokens (the rule of succession: the longer the suffix
    seen to continue, the likelier it goes on)."""
    m = min(length, MATCH_MAX)
    return share * m / (m + 1)


@dataclass
class RowTree:
    """One row's merged tree in best-first order (node 0 the root): what verification reads and
    what the acceptance model learns from. Per node: its proposers' key ("head+match"), its raw
    confidence (the most confident proposer's) and, where the head proposed it, its index in the
    head's pool."""
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    keys: list[str] = field(default_factory=list)
    raws: list[float] = field(default_factory=list)
    head_of: list[int | None] = field(default_factory=list)


class DraftSources:
    """The head-free sources of one engine, and the merge of every source's candidates into one
    tree per row. `active` names the sources that run ("head" among them or not)."""

    def __init__(self, active: tuple[str, ...], vocab: int, max_depth: int = SOURCE_DEPTH):
        self.active = tuple(active)
        self.vocab, self.max_depth = vocab, max_depth
        self.table = RecyclingTable(vocab) if "recycle" in self.active else None
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
        top, ids = (x.cpu().numpy() for x in torch.topk(logits, min(self.table.k, logits.shape[-1]), dim=-1))
        tie = top[:, 0] == top[:, 1]
        best = np.where(tie, logits.argmax(-1).cpu().numpy(), ids[:, 0]) if tie.any() else ids[:, 0].copy()
        keep = slice(None) if keep is None else keep.cpu().numpy()
        self.table.note_top(tokens.reshape(-1).cpu().numpy()[keep], top[keep], ids[keep])
        return torch.from_numpy(best).to(logits.device)

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

    def grow_row(self, slot, root: int, cap: int, acceptance, head=None, floor=None) -> RowTree:
        """Best-first growth of one row's tree to `cap` nodes (root included), by score.

        `head`: the head's pool for this row as lists (tokens, pool parents, raw path
        probabilities), or None. At each node taken, every source proposes its children at once;
        a token proposed by several is one candidate, whose conditional is `acceptance`'s for
        those proposers (policy.Acceptance), and its score the parent's times it. The head-free
        sources extend any node to `max_depth`. `floor` (policy.Policy.growth_floor): growth stops
        where the best candidate left scores below floor[size] times the tree's expected tokens
        so far, where no larger tree can pay its verify rows."""
        use_rec, use_match = self.table is not None, "match" in self.active
        index = self._context(slot) if use_match else None
        kids: dict[int, list[int]] = {}
        if head is not None:
            for j, p in enumerate(head[1]):
                kids.setdefault(p, []).append(j)
        tree = RowTree([root], [-1], [1.0], [""], [1.0], [-1 if head is not None else None])
        depth, paths = [0], [()]
        heap: list = []

        def push(i: int) -> None:
            said: dict[int, list] = {}  # token -> [proposers, raw confidence, head pool index]

            def say(t: int, src: str, raw: float, hj: int | None = None) -> None:
                got = said.get(t)
                if got is None:
                    said[t] = [[src], raw, hj]
                else:
                    got[0].append(src)
                    got[1] = max(got[1], raw)
                    got[2] = hj if hj is not None else got[2]

            hp = tree.head_of[i]
            if hp is not None and hp in kids:
                base = head[2][hp] if hp >= 0 else 1.0
                for j in kids[hp]:
                    say(head[0][j], "head", min(1.0, head[2][j] / base) if base > 0 else 0.0, j)
            if depth[i] < self.max_depth:
                if use_rec:
                    for t, p in self.table.children(tree.tokens[i]):
                        say(t, "recycle", p)
                if use_match:
                    for t, share, m in index.children(paths[i]):
                        say(t, "match", match_confidence(m, share))
            d = depth[i] + 1
            for t, (srcs, raw, hj) in said.items():
                key = "+".join(sorted(srcs))
                score = tree.scores[i] * acceptance.conditional(key, d, raw)
                heapq.heappush(heap, (-score, len(heap), i, t, key, raw, hj))

        push(0)
        expected = 1.0
        while heap and len(tree.tokens) < cap:
            if floor is not None and -heap[0][0] < expected * floor[len(tree.tokens)]:
                break
            neg, _, par, tok, key, raw, hj = heapq.heappop(heap)
            tree.tokens.append(tok)
            tree.parents.append(par)
            tree.scores.append(-neg)
            tree.keys.append(key)
            tree.raws.append(raw)
            tree.head_of.append(hj)
            expected -= neg
            depth.append(depth[par] + 1)
            paths.append(paths[par] + (tok,))
            push(len(tree.tokens) - 1)
        return tree

    def observe(self, rows: list[int], summaries, verified: int, emitted: list[list[int]]) -> list:
        """A verified cycle: per busy row (`rows`, indices into `last`) its summary and the tokens
        it produced (`emitted`: accepted + the bonus); `verified`: how many of each tree's
        best-first nodes went through the target.

        Every grown node whose parent is on the target's path learns whether it is too, verified
        or not (`on_target`): the target's token after a node on its path is the next one emitted
        (greedy: the argmax; sampling: the keyed rule's draw from the node's p and its position's
        uniform, which no tree changes), so the node would have been accepted exactly when its
        token is that one. Learning from verified nodes only taught the estimate that the nodes
        the policy left out fail, which is what it reads to leave them out (section 3's estimate,
        biased by its own choice). Returns those nodes as (proposers, depth, raw confidence,
        accepted); the summaries (events.Summary) count verified nodes per source."""
        nodes = []
        for b, summary, out in zip(rows, summaries, emitted):
            tree = self.last[b] if b < len(self.last) else None
            if tree is None:
                continue
            fate, deep = on_target(tree, out)
            for i in range(1, len(tree.tokens)):
                conditional = fate[tree.parents[i]] == 1 and fate[i] >= 0
                got = fate[i] == 1
                if conditional:
                    nodes.append((tree.keys[i], deep[i], tree.raws[i], got))
                if summary is not None and i < verified:
                    pred = tree.scores[i] / tree.scores[tree.parents[i]] if conditional else None
                    for src in tree.keys[i].split("+"):
                        summary.record_source(src, got, pred)
        return nodes


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
