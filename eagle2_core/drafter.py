"""The head's drafting in a cycle (cycle.py; EAGLE-2 section 4): the head absorbs every row's
pending pairs (f_t, x_{t+1}), then grows one tree per row, dynamic (expansion by path score,
then rerank) or static (EAGLE-1's tree, or a chain). `draft_fn` is captured in fixed mode.

Its pause is explicit state: while the policy skips the head at batch 1, the pairs it has not
absorbed wait in `paused`, and its next draft catches up on them in one forward."""
from __future__ import annotations

import numpy as np
import torch

from .rows import Rows
from .tree import (additive, batch_trees, causal_rows, chain_choices, choices_to_levels, context_and_tree, rerank_batch,
                   static_choices)
from .treesettings import TreeSettings


class Drafter:
    """The draft head over the rows' head cache. `policy` (live mode's, set by the engine; None:
    every cycle drafts its whole tree) chooses the depth; `merger` (merge.py; None: no sources)
    merges the head's pool with the head-free sources' candidates."""

    def __init__(self, head, tree: TreeSettings, rows: Rows, n_max: int, *, fixed: bool, merger=None):
        self.head, self.tree, self.rows, self.n_max, self.fixed, self.merger = head, tree, rows, n_max, fixed, merger
        self.k, self.depth = max(1, tree.top_k), max(1, tree.depth)
        if tree.shape != "dynamic":  # EAGLE-1's static tree or a chain: the same sibling ranks every cycle
            choices = chain_choices(self.depth) if tree.shape == "chain" else static_choices(tree.total_tokens, self.depth, self.k)
            self.levels = choices_to_levels(choices)
        self.policy = None
        self.absorb = 1           # live mode: the widest row of new pairs (accepted + 1, from the read-back)
        self.steps = 0            # head steps of the current draft: the absorb, then one per depth fed
        # while the head skips cycles at batch 1: the pairs (f_t, x_{t+1}) it has not absorbed, one
        # ([1, k] tokens, [1, k, F] features) per cycle, so that its next draft catches up in one
        # forward over them (a prefill of the head) rather than absorbing every cycle it does not
        # draft. None: nothing kept. (At batch > 1 a skipping head absorbs each cycle: `skip`.)
        self.paused: list | None = None

    def reset(self) -> None:
        """A new run: a skipping head kept nothing across runs, and resumes with one pair to absorb."""
        self.paused = None
        self.absorb = 1

    # -- the pause --------------------------------------------------------------------------
    def skip(self) -> None:
        """The head does not draft this cycle. At batch 1 its pending pairs wait in `paused` (the
        next draft absorbs every cycle's at once); at batch > 1, where rows come and go, it absorbs
        them now, which its arm's measured overhead then includes."""
        st = self.rows.state
        if st.new_features is None:
            return
        if self.rows.batch == 1:
            if self.paused is None:
                n = int(st.n_new[0])  # this cycle's pending pairs: the first the skipping head owes
                self.paused = [(st.new_tokens[:, :n].clone(), st.new_features[:, :n].clone())]
            return
        w = self.absorb
        self._absorb(st.new_tokens[:, :w], st.new_features[:, :w], st.head_len, 0)
        st.head_len = torch.where(st.active, st.head_len + st.n_new, st.head_len)  # the commit sets the next pending pairs

    def unpause(self) -> None:
        """A head that skipped cycles drafts again: its next draft first absorbs every pair of
        the cycles it missed, in one forward."""
        if self.paused is None:
            return
        st = self.rows.state
        st.new_tokens = torch.cat([t for t, _ in self.paused], 1)
        st.new_features = torch.cat([f for _, f in self.paused], 1)
        st.n_new = torch.full_like(st.n_new, st.new_tokens.shape[1])
        self.absorb = st.new_tokens.shape[1]
        self.paused = None

    def catch_up(self) -> None:
        """A paused head absorbs the pairs it missed, all but the last (which stays pending, as
        after any cycle), so a kept sequence (prefix.Kept) holds every head cell: a chat's next
        turn then reuses them instead of prefilling the answer again."""
        if self.paused is None:
            return
        self.unpause()
        st = self.rows.state
        w = st.new_tokens.shape[1]
        if w > 1:
            self._absorb(st.new_tokens[:, : w - 1], st.new_features[:, : w - 1], st.head_len, 1)
            st.head_len = torch.where(st.active, st.head_len + w - 1, st.head_len)
        st.new_tokens, st.new_features = st.new_tokens[:, w - 1 :].contiguous(), st.new_features[:, w - 1 :].contiguous()
        st.n_new = torch.ones_like(st.n_new)
        self.absorb = 1

    def verified(self, accepted_max: int) -> None:
        """After a cycle's read-back: the widest row's new pairs, kept too while the head is paused."""
        st = self.rows.state
        self.absorb = 1 + accepted_max
        if self.paused is not None:
            self.paused.append((st.new_tokens[:, : self.absorb].clone(), st.new_features[:, : self.absorb].clone()))

    # -- admission ----------------------------------------------------------------------------
    def cache_ready(self) -> None:
        """Allocate the head's cache at admission, never inside a capture: a one-token prompt has no
        pair to absorb here, and its first draft would otherwise allocate it (and run uncaptured)."""
        layer = self.rows.hcache.layers[0]
        if not layer.is_initialized:
            attn = next(m for m in self.head.modules() if hasattr(m, "head_dim") and hasattr(m, "k_proj"))
            z = torch.zeros(1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim, dtype=self.head.fc.weight.dtype,
                            device=self.rows.run.device)
            layer.lazy_initialization(z, z)

    def restore(self, b: int, kept, length: int) -> None:
        """Row b's first `length` head cells from a kept sequence."""
        if kept.head is None or kept.head_len < length:
            raise ValueError(f"the kept sequence has {kept.head_len} head cells, {length} asked for")
        self.cache_ready()
        self.rows.hcache.put(b, kept.head, length)

    def prefill(self, b: int, x, feats, pos, r: int, root) -> None:
        """The head absorbs row b's prompt pairs (f_t, x_{t+1}) from position r, all but the last,
        which stays pending for the next cycle's draft; `feats` are positions r .. n - 1's."""
        st, n, dev = self.rows.state, len(x), x.device
        self.cache_ready()
        if st.new_features is None:
            st.new_features = torch.zeros(self.rows.batch, self.rows.width, feats.shape[-1], dtype=feats.dtype, device=dev)
        if n - 1 > r:  # pairs (f_t, x_{t+1}) sit at position t (the EAGLE convention); those before r were restored
            h = self.rows.hcache
            h.row, h.cells, h.view = b, pos[r : n - 1], n - 1
            try:
                bias = additive(causal_rows(pos[None, r : n - 1], n - 1), self.head.fc.weight.dtype)
                self.head(x[None, r + 1 :], self.head.project(feats[None, : n - 1 - r]), pos[None, r : n - 1], attention_mask=bias,
                          cache=h)
            finally:
                h.row = None
        st.new_tokens[b, 0] = root
        st.new_features[b, 0] = feats[-1]
        st.head_len[b], st.n_new[b] = n - 1, 1
        if self.rows.batch == 1:
            self.absorb, self.paused = 1, None  # the row's only pair (what a skipping head kept was the last sequence's)

    # -- the draft: capturable when no policy runs ----------------------------------------------
    def draft_fn(self, new_tokens, new_features, head_len, n_new, root, active):
        """Absorb every row's new pairs, then grow one tree per row. Returns the trees
        (tokens, parents, depth, ancestors, path scores), each [B, N], and the head's new length."""
        head = self.head
        if not self.fixed:  # live: the width actually accepted (the last read-back says), not depth + 1
            new_tokens, new_features = new_tokens[:, : self.absorb], new_features[:, : self.absorb]
        b, w = new_tokens.shape
        out, view = self._absorb(new_tokens, new_features, head_len, self.depth * self.k)
        last = (n_new - 1).clamp(max=w - 1)  # an idle row may hold a wider stale count
        hid = out.gather(1, last[:, None, None].expand(b, 1, out.shape[-1]))[:, 0]  # each row's root state
        ctx = head_len + n_new                  # the head's context after the absorb = the root's position
        head_len = torch.where(active, ctx, head_len)
        logp = torch.log_softmax(head.draft_logits(hid).float(), dim=-1)
        if self.policy is not None:  # host bookkeeping: live mode only, never inside a capture
            self.steps = 1
        grow = self._grow_dynamic if self.tree.shape == "dynamic" else self._grow_static
        return grow(hid, logp, ctx, view, root) + (head_len,)

    def _absorb(self, new_tokens, new_features, head_len, extra: int):
        """The head takes pairs [B, w] (f_t, x_{t+1}) into its cache cells head_len .. + w - 1;
        `extra` rows may follow in the view (a tree's). Returns its outputs [B, w, H] and the view."""
        head, h = self.head, self.rows.hcache
        positions = head_len[:, None] + torch.arange(new_tokens.shape[1], device=new_tokens.device)
        view = self.rows.span(new_tokens.shape[1] + extra)
        h.cells, h.view = positions, view
        bias = additive(causal_rows(positions, view), head.fc.weight.dtype)
        return head(new_tokens, head.project(new_features), positions, attention_mask=bias, cache=h), view

    def head_step(self, tokens, front_h, ctx, d: int, visible, view):
        """Feed one depth of tree nodes [B, m] (depth d + 1, all at position ctx + d); `visible`
        [B, m, fed] marks which of the tree rows fed so far each sees. Their rows go to head-cache
        cells after the context, which the next absorb overwrites: tree tokens are not context.
        Returns the nodes' hidden states and their children's log-probabilities."""
        b, m = tokens.shape
        fed = visible.shape[2]
        hcache = self.rows.hcache
        hcache.cells, hcache.view = ctx[:, None] + torch.arange(fed - m, fed, device=tokens.device), view
        bias = additive(context_and_tree(ctx, visible, view), self.head.fc.weight.dtype)
        out = self.head(tokens, front_h, (ctx + d)[:, None].expand(b, m), attention_mask=bias, cache=hcache)
        if self.policy is not None:
            self.steps += 1
        return out, torch.log_softmax(self.head.draft_logits(out).float(), dim=-1)

    def _grow_dynamic(self, hid, logp, ctx, view, root):
        """EAGLE-2's dynamic tree: expand the top-k nodes by path score at each depth (section 4.1),
        then rerank every drafted node by path score and keep the best N - 1 (section 4.2). In
        live mode the policy chooses the depth (whether another step pays) and the size."""
        head, dev, policy = self.head, hid.device, self.policy
        b = hid.shape[0]
        k = min(self.k, logp.shape[-1])  # top_k may exceed a tiny (or pruned draft) vocabulary
        scores, ids = torch.topk(logp, k, dim=-1)          # [B, k]
        tokens = head.to_target_ids(ids)
        pool_t, pool_p, pool_s = [tokens], [torch.full((b, k), -1, dtype=torch.long, device=dev)], [scores]
        expanded = [torch.ones(b, k, dtype=torch.bool, device=dev)]
        front_idx, front_s = torch.arange(k, device=dev).expand(b, k), scores
        front_h = hid[:, None].expand(b, k, hid.shape[-1])
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        visible, size = eye, k
        if policy is not None:  # the busy rows' calibrated path probabilities, on the host
            busy = self.rows.busy_rows()
            front_c = policy.acceptance.conditionals("head", 1, scores[busy].exp().double().cpu().numpy())
            policy.note_children(front_c.max(-1), np.ones(len(busy)))
            pool_c = [front_c]
        for d in range(1, self.depth):
            if policy is not None and not policy.deeper(np.concatenate(pool_c, 1), front_c, self.steps, self.depth - d):
                break
            m = visible.shape[2]
            out_h, out_lp = self.head_step(tokens, front_h, ctx, d - 1, visible, view)
            child_lp, child_ids = torch.topk(out_lp, k, dim=-1)            # [B, k, k]
            path = (front_s[:, :, None] + child_lp).flatten(1)            # path score = product of confidences
            key = path if self.tree.expand_by == "path" else child_lp.flatten(1)  # "node": the paper's ablation
            sel = torch.topk(key, k, dim=1).indices
            if policy is not None:
                cond = policy.acceptance.conditionals("head", d + 1, child_lp[busy].exp().double().cpu().numpy())
                policy.note_children(cond.max(-1), front_c)
                path_c = (front_c[:, :, None] * cond).reshape(len(busy), -1)
                pool_c.append(path_c)
                front_c = np.take_along_axis(path_c, sel[busy].cpu().numpy(), 1)
            parent = sel // k
            pool_t.append(head.to_target_ids(child_ids).flatten(1))
            pool_p.append(front_idx.repeat_interleave(k, dim=1))
            pool_s.append(path)
            if not self.tree.rerank:
                expanded.append(torch.zeros(b, k * k, dtype=torch.bool, device=dev).scatter_(1, sel, True))
            tokens, front_idx, front_s = pool_t[-1].gather(1, sel), size + sel, path.gather(1, sel)
            front_h = out_h.gather(1, parent[:, :, None].expand(-1, -1, out_h.shape[-1]))
            visible = torch.cat([visible.gather(1, parent[:, :, None].expand(-1, -1, m)), eye], 2)
            size += k * k
        pool_t, pool_p, pool_s = torch.cat(pool_t, 1), torch.cat(pool_p, 1), torch.cat(pool_s, 1)
        if self.merger is not None:
            return self.merger.merge(pool_t, pool_p, pool_s, root, self.n_max, self.steps)
        n = min(self.n_max, size + 1)
        if not self.tree.rerank:  # ablation: the expanded nodes themselves, shallowest first
            pick = torch.cat(expanded, 1)
            pool_s = torch.where(pick, -torch.arange(size, device=dev, dtype=pool_s.dtype), float("-inf"))
            n = min(n, int(pick[0].sum()) + 1)
        return rerank_batch(pool_t, pool_p, pool_s, root, n - 1, self.depth)

    def _grow_static(self, hid, logp, ctx, view, root):
        """EAGLE-1's static tree, or a chain: the same sibling ranks below every root."""
        head, dev = self.head, hid.device
        b = hid.shape[0]
        toks, parents = [root[:, None]], [-1]
        front_h, front_lp, visible = hid[:, None], logp[:, None], None
        prev_first, first = 0, 1  # tree index of the first node of the previous level and of this one
        for d, level in enumerate(self.levels[: self.depth]):
            # choices are ordered by depth, so path index p is tree node p + 1 (-1: the root)
            par = torch.tensor([p + 1 - prev_first for p, _ in level], device=dev)  # parent within the fed level
            ranks = torch.tensor([r for _, r in level], device=dev)
            top = torch.topk(front_lp, int(ranks.max()) + 1, dim=-1).indices     # [B, fed, r]
            toks.append(head.to_target_ids(top[:, par, ranks]))
            parents += [p + 1 for p, _ in level]
            prev_first, first = first, first + len(level)
            if d + 1 >= min(self.depth, len(self.levels)):
                break
            eye = torch.eye(len(level), dtype=torch.bool, device=dev)
            visible = eye if visible is None else torch.cat([visible[par], eye], 1)
            front_h, front_lp = self.head_step(toks[-1], front_h[:, par], ctx, d, visible.expand(b, -1, -1), view)
        tokens = torch.cat(toks, 1)
        par_t = torch.tensor(parents, dtype=torch.long, device=dev).expand(b, -1)
        depth, anc = batch_trees(par_t, self.depth)
        return tokens, par_t, depth, anc, None
