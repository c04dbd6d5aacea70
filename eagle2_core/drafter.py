"""Drafting: run the draft head to grow a tree of candidate tokens (EAGLE-2 section 4).

The head keeps its own KV cache over the committed context. Each cycle it first absorbs the
newly committed (feature, next token) pairs, then expands the tree depth by depth; the tree
tokens' KV entries are dropped again at the end, since only verified tokens become context.
Positions follow the EAGLE convention: the pair (feature_t, token_{t+1}) sits at position t, and
all nodes at one tree depth share a position.
"""
from __future__ import annotations

import torch

from .kvcache import StaticKVCache, TreeKVCache
from .tree import (DraftTree, additive, appended_visible, causal_attention_bias, choices_to_levels, chain_choices, rerank, select_expansion,
                   static_causal_bias, static_choices, static_visible, tree_from_parents)
from .treesettings import TreeSettings


class Drafter:
    """Owns the draft head's KV cache for one generation and builds one tree per cycle."""

    def __init__(self, head, settings: TreeSettings, capacity: int = 1024, chooser=None, graph: bool = False):
        settings.validate()
        self.head = head
        self.settings = settings
        # graph: the GPU path's static buffers (`draft_graph`); capacity must then cover the whole
        # generation plus one cycle's tree rows, since a static cache cannot grow.
        self.graph = graph
        if graph and (settings.shape != "dynamic" or settings.budget != "constant"):
            raise ValueError("graph mode needs a dynamic tree with a constant budget")
        dev = head.fc.weight.device
        self.cache = StaticKVCache(1, capacity, dev) if graph else TreeKVCache(1, capacity)
        # With budget="auto", the decoder's budget.BudgetChooser: measured costs and calibration.
        self.chooser = chooser if settings.budget == "auto" and settings.shape == "dynamic" else None
        self.steps = 1  # head steps of the last tree (the absorb, then one per depth), kept for the chooser
        if self.chooser is None and settings.budget == "auto" and settings.shape == "dynamic":
            raise ValueError("budget='auto' needs a budget.BudgetChooser (measured costs)")
        if settings.shape != "dynamic":
            choices = chain_choices(settings.depth) if settings.shape == "chain" else static_choices(settings.total_tokens, settings.depth, settings.top_k)
            self.levels = choices_to_levels(choices)

    def _step(self, tokens, hidden, pos, visible: torch.Tensor, ctx_len):
        """Feed one depth of tree nodes; returns their draft hidden states and log-probs.

        `visible` [n, m] says which of the m tree rows fed so far each node sees. Eager: `pos` and
        `ctx_len` are ints and the rows are appended to the cache (dropped after the tree).
        Graph mode: they are device scalars; the rows go to the slots after the context, and the mask
        covers the whole static cache.
        """
        n = tokens.shape[0]
        if self.graph:
            self.cache.slots = ctx_len + torch.arange(visible.shape[1] - n, visible.shape[1], device=tokens.device)  # this depth's rows
            bias = additive(static_visible(visible, ctx_len, self.cache.capacity), hidden.dtype)
            positions = (pos + torch.zeros(1, n, dtype=torch.long, device=tokens.device))
        else:
            bias, positions = additive(appended_visible(visible, ctx_len), hidden.dtype), torch.full((1, n), pos, device=tokens.device)
        h = self.head(tokens[None], hidden[None], positions, attention_mask=bias, cache=self.cache)[0]
        return h, torch.log_softmax(self.head.draft_logits(h).float(), dim=-1)

    @torch.no_grad()
    def draft(self, new_tokens: torch.Tensor, new_features: torch.Tensor, start_pos: int, root: torch.Tensor, budget: int | None = None, max_depth: int | None = None) -> DraftTree:
        """Absorb the new context pairs, then build a tree below `root`.

        new_tokens[i] is the token following the position whose target feature is new_features[i];
        the last pair is (feature of the last committed token, root). `budget` and `max_depth`
        may shrink the tree near the context limit.
        """
        s = self.settings
        self.steps = 1  # head steps this cycle (the absorb, then one per depth): what drafting cost
        budget = min(s.total_tokens if budget is None else budget, s.total_tokens) - 1
        depth = min(s.depth if max_depth is None else max_depth, s.depth)
        dev = new_tokens.device
        n = new_tokens.shape[0]
        ctx = self.cache.length
        # Target features enter through `project` (EAGLE-3's fc; EAGLE-1/2 takes them as they are);
        # deeper steps below feed the head's own output back.
        h = self.head(new_tokens[None], self.head.project(new_features[None]), torch.arange(start_pos, start_pos + n, device=dev)[None],
                      attention_mask=causal_attention_bias(n, ctx, self.head.fc.weight.dtype, dev), cache=self.cache)[0, -1:]
        ctx = self.cache.length
        logp = torch.log_softmax(self.head.draft_logits(h).float(), dim=-1)
        if budget <= 0 or depth <= 0:
            return tree_from_parents(root.view(1), torch.tensor([-1], device=dev))
        pos = start_pos + n  # position of depth-1 nodes when fed as inputs
        if s.shape == "dynamic":
            tree = self._dynamic(h, logp, pos, ctx, root, budget, depth)
        else:
            tree = self._static(h, logp, pos, ctx, root, budget, depth)
        self.cache.truncate(ctx)  # tree tokens are not context
        return tree

    @torch.no_grad()
    def draft_graph(self, new_tokens: torch.Tensor, new_features: torch.Tensor, start_pos: torch.Tensor, n_new: torch.Tensor,
                    root: torch.Tensor) -> DraftTree:
        """`draft` in graph mode: fixed shapes and no host reads (the GPU path, issue 16).

        The new pairs come padded to a fixed width (depth + 1 rows, `n_new` of them real) at
        positions start_pos...; the padding rows are written to head-cache slots past the new
        context length, which later masks hide and later writes overwrite. The tree always has
        `total_tokens` nodes: the candidate pool (top_k + (depth-1) * top_k^2) is larger.
        """
        s = self.settings
        dev, w = new_tokens.device, new_tokens.shape[0]
        positions = start_pos + torch.arange(w, device=dev)
        self.cache.slots = positions  # committed context: slot = position
        bias = static_causal_bias(positions, self.cache.capacity, self.head.fc.weight.dtype)
        h = self.head(new_tokens[None], self.head.project(new_features[None]), positions[None], attention_mask=bias, cache=self.cache)[0]
        h = h.index_select(0, (n_new - 1).view(1))  # the root's row: the last real pair
        logp = torch.log_softmax(self.head.draft_logits(h).float(), dim=-1)
        ctx = start_pos + n_new  # context length after this absorb = the root's position
        return self._dynamic(h, logp, ctx, ctx, root, s.total_tokens - 1, s.depth)

    def _dynamic(self, h, logp, pos, ctx, root, budget, depth) -> DraftTree:
        k = min(self.settings.top_k, logp.shape[-1])  # top_k may exceed a tiny (or pruned draft) vocabulary
        scores, ids = torch.topk(logp[0], k)
        tokens = self.head.to_target_ids(ids)
        pool_tokens, pool_parents, pool_scores, pool_expanded = [tokens], [torch.full((k,), -1, device=ids.device)], [scores], [torch.ones(k, dtype=torch.bool, device=ids.device)]
        front_idx = torch.arange(k, device=ids.device)          # pool index of the nodes to feed
        front_scores, front_hidden = scores, h.expand(k, -1)
        visible = torch.eye(k, dtype=torch.bool, device=ids.device)  # fed-node ancestry, grows each depth
        pool_size = k
        if self.chooser is not None:
            self.chooser.note_children(scores[None])  # the root's children: seen every cycle, so the share never goes unmeasured
        for d in range(1, depth):
            if self.chooser is not None and not self.chooser.worth_expanding(torch.cat(pool_scores), front_scores, self.steps, depth - d):
                break  # depth chosen per cycle: deeper levels are not expected to pay (budget.py)
            out_h, out_logp = self._step(tokens, front_hidden, pos + d - 1, visible, ctx)
            child_logp, child_ids = torch.topk(out_logp, k, dim=-1)                 # [k, k]
            if self.chooser is not None:  # (host-side bookkeeping: never on the captured graph-mode path)
                self.steps += 1
                self.chooser.note_children(child_logp)
            path = front_scores[:, None] + child_logp                              # path score = product of confidences
            key = path if self.settings.expand_by == "path" else child_logp
            sel = select_expansion(key.flatten(), k)
            slot = sel // k
            pool_tokens.append(self.head.to_target_ids(child_ids.flatten()))
            pool_parents.append(front_idx.repeat_interleave(k))
            pool_scores.append(path.flatten())
            expanded = torch.zeros(k * k, dtype=torch.bool, device=ids.device).index_fill_(0, sel, True)
            pool_expanded.append(expanded)
            tokens = pool_tokens[-1][sel]
            front_idx = pool_size + sel
            front_scores, front_hidden = path.flatten()[sel], out_h[slot]
            visible = torch.cat([visible[slot], torch.eye(k, dtype=torch.bool, device=ids.device)], dim=1)
            pool_size += k * k
        pool_tokens, pool_parents, pool_scores = torch.cat(pool_tokens), torch.cat(pool_parents), torch.cat(pool_scores)
        if self.chooser is not None and self.settings.rerank:
            # Per-cycle budget (budget.py): the reranked prefix that buys the most expected tokens
            # (1 + sum of path probabilities, EAGLE-2 section 3) per measured ms.
            best = torch.topk(pool_scores, min(budget, pool_size)).values
            budget = self.chooser.choose(best.exp(), self.steps) - 1
        if not self.settings.rerank:
            # Ablation: the tree is just the nodes chosen during expansion, shallowest first.
            pool_scores = torch.where(torch.cat(pool_expanded), -torch.arange(pool_size, device=ids.device, dtype=torch.float), float("-inf"))
            budget = min(budget, int(torch.cat(pool_expanded).sum()))
        return rerank(pool_tokens, pool_parents, pool_scores, root, budget, max_depth=depth)

    def _static(self, h, logp, pos, ctx, root, budget, depth) -> DraftTree:
        """EAGLE-1 static tree or a chain: the same sibling ranks every cycle."""
        dev = root.device
        all_tokens, all_parents = [root.view(1)], [torch.tensor([-1], device=dev)]
        n_nodes = 1
        prev_first = 0        # tree index of the first node of the previous level
        prev_paths: list[int] = []  # path index of each fed node of the previous level
        path_to_tree: dict[int, int] = {}
        hidden, lp = h, logp  # hidden states / log-probs of the previous level's nodes (root level: 1 row)
        visible = None
        path_counter = 0
        for d, level in enumerate(self.levels[:depth]):
            level = level[: max(0, budget - (n_nodes - 1))]
            if not level:
                break
            if d == 0:
                parent_rows = torch.zeros(len(level), dtype=torch.long, device=dev)
            else:
                slot_of = {p: i for i, p in enumerate(prev_paths)}
                parent_rows = torch.tensor([slot_of[p] for p, _ in level], device=dev)
            ranks = torch.tensor([r for _, r in level], device=dev)
            max_rank = int(ranks.max()) + 1
            top_ids = torch.topk(lp, max_rank, dim=-1).indices
            tokens = self.head.to_target_ids(top_ids[parent_rows, ranks])
            parents_tree = torch.zeros_like(parent_rows) if d == 0 else torch.tensor([path_to_tree[p] for p, _ in level], device=dev)
            all_tokens.append(tokens)
            all_parents.append(parents_tree)
            paths = list(range(path_counter, path_counter + len(level)))
            for j, p in enumerate(paths):
                path_to_tree[p] = n_nodes + j
            path_counter += len(self.levels[d])
            n_nodes += len(level)
            if d + 1 >= min(depth, len(self.levels)):
                break
            eye = torch.eye(len(level), dtype=torch.bool, device=dev)
            visible = eye if visible is None else torch.cat([visible[parent_rows], eye], dim=1)
            hidden, lp = self._step(tokens, hidden[parent_rows], pos + d, visible, ctx)
            prev_paths = paths
        return tree_from_parents(torch.cat(all_tokens), torch.cat(all_parents), max_depth=depth)
