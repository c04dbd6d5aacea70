"""The verify of a cycle (cycle.py; EAGLE-2 section 3): every row's tree in one forward of the
target (the trees go in as an additive mask and positions), acceptance per row, and the commit
of the accepted KV in place with each row's next state. `verify_fn` has no host step and is
captured in fixed mode; `verify_host` is the path with host-side steps (processors, sampling,
logprobs, the two-pass lm_head)."""
from __future__ import annotations

import torch

from .accept import accept_greedy_batch, accept_greedy_row, accept_sampling_keyed, position_uniforms
from .logprobs import token_logprobs
from .rows import Rows, Slot
from .tree import causal_rows, context_and_tree, row_tree, windowed


class Verifier:
    """Forward, accept, commit over the rows' caches. `width` is the accepted path's width (1 when
    nothing drafts); `noting` whether the verified rows feed the recycling table (sources.py)."""

    def __init__(self, run, rows: Rows, sources, width: int):
        self.run, self.rows, self.sources, self.width = run, rows, sources, width
        self.one_product = True   # lm_head over every tree row at once (False: internal rows first; None: `cheap` decides per tree)
        self.cheap = None         # rows -> whether one product over them costs no more than internal rows first
        self.noting = sources is not None
        self.seen: dict = {}      # EAGLE-3's captured layer inputs, while a session runs
        self.layers = None        # the head's feature layers (None: no head drafts)

    def prefill(self, b: int, x, pos, r: int):
        """Row b's prompt `x` from position r, alone, into the target's cache (cells r .. n - 1).
        Returns the last position's logits and the features of positions r .. n - 1."""
        n, c = len(x), self.rows.cache
        c.row, c.cells, c.view = b, pos[r:], n
        mask = self.run.masks(lambda w: windowed(causal_rows(pos[None, r:], n), pos[None, r:], pos[None], w))
        try:
            hidden, feats = self.run.body_forward(x[None, r:], pos[None, r:], mask, c, self.seen, self.layers)
        finally:
            c.row = None
        return self.run.logits(hidden[0, -1:]), feats

    def forward_tree(self, tokens, depth, anc, seq_len):
        """Every row's tree in one target forward: node i at cell seq_len + i, position seq_len +
        depth (nodes past the context limit are verified, never emitted: clamped). Nothing is
        committed: the next forward writes the same cells. Returns (hidden states, features)."""
        b, n = tokens.shape
        dev, rows = tokens.device, self.rows
        q_pos = seq_len[:, None] + depth
        view = rows.span(n)
        c = rows.cache
        c.cells, c.view = seq_len[:, None] + torch.arange(n, device=dev), view
        c.start = rows.host_len[0] if b == 1 and not rows.fixed else None
        k_pos = torch.arange(view, device=dev).expand(b, view).scatter(1, c.cells, q_pos)
        mask = self.run.masks(lambda win: windowed(context_and_tree(seq_len, anc, view), q_pos, k_pos, win))
        return self.run.body_forward(tokens, q_pos.clamp(max=self.run.max_positions - 1), mask, c, self.seen, self.layers)

    def tree_argmax(self, tokens, depth, anc, seq_len):
        """`forward_tree`, then lm_head over every node and its argmax: what greedy acceptance
        checks (one product for all rows). Returns (argmax [B, N], features)."""
        hidden, feats = self.forward_tree(tokens, depth, anc, seq_len)
        b, n = tokens.shape
        logits = self.run.logits(hidden.reshape(b * n, -1))
        if self.noting:  # live mode only (never captured): the recycling table learns every busy row
            busy = self.rows.state.active[:, None].expand(b, n).reshape(-1)
            return self.sources.argmax_noted(tokens, logits, busy).view(b, n), feats
        return logits.argmax(-1).view(b, n), feats

    def commit_fn(self, tokens, depth, path, accepted, bonus, feats, seq_len, root, n_new, new_features, active):
        """The accepted KV into place, per row, and each row's next state; idle rows stay where
        they are. Returns (seq_len, root, n_new, new_tokens, new_features, readout)."""
        w = path.shape[1]
        if w > 1:
            self.rows.cache.commit(seq_len[:, None] + path, seq_len[:, None] + torch.arange(w, device=path.device))
            col = torch.arange(w, device=path.device)[None]
            new_tokens = torch.where(col == accepted[:, None], bonus[:, None], torch.cat([tokens.gather(1, path[:, 1:]), bonus[:, None]], 1))
            if new_features is not None and feats is not None:  # the head's pending pairs (none without a head)
                new_features = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1])).to(new_features.dtype)
            n_new = torch.where(active, accepted + 1, n_new)
        else:
            new_tokens = bonus[:, None]
            if new_features is not None and feats is not None:  # the root's pair, for a skipping head (drafter.skip)
                new_features = feats[:, :1].to(new_features.dtype)
                n_new = torch.where(active, 1, n_new)
        seq_len = torch.where(active, seq_len + accepted + 1, seq_len)
        root = torch.where(active, bonus, root)
        readout = torch.cat([accepted[:, None], depth[:, -1:], new_tokens], 1)  # nodes are in depth order
        return seq_len, root, n_new, new_tokens, new_features, readout

    def one_product_for(self, rows: int) -> bool:
        """Whether lm_head takes a tree of `rows` rows in one product (else internal rows first)."""
        if self.one_product is not None:
            return self.one_product
        return self.cheap is None or self.cheap(rows)

    def verify_fn(self, tokens, parents, depth, anc, seq_len, root, n_new, new_features, active):
        """Greedy verification with no host step: all rows through lm_head, accept, commit. Captured in fixed mode."""
        argmax, feats = self.tree_argmax(tokens, depth, anc, seq_len)
        path, accepted, bonus = accept_greedy_batch(tokens, parents, depth, anc, argmax, self.width)
        return (path,) + self.commit_fn(tokens, depth, path, accepted, bonus, feats, seq_len, root, n_new, new_features, active)

    def verify_live(self, tokens, parents, depth, anc):
        """`verify_fn` for live mode on a CPU, its small steps in plain Python on the trees' few
        nodes: the mask, acceptance (`accept_greedy_batch`) and the rows' next state (`commit_fn`),
        a few calls in all where each tensor op on them is one more call. Returns (path, read-back values)."""
        rows, st, run = self.rows, self.rows.state, self.run
        b, n = tokens.shape
        w = self.width if n > 1 else 1  # a root alone accepts nothing: its next state is one pair wide, as without a draft
        tok, par, dep, lens, active = tokens.tolist(), parents.tolist(), depth.tolist(), st.seq_len.tolist(), st.active.tolist()
        view, c, low, top = rows.span(n), rows.cache, torch.finfo(run.dtype).min, run.max_positions - 1
        mask = torch.zeros(b, 1, n, view, dtype=run.dtype)  # context_and_tree: each row's context, then the nodes `anc` marks
        tree = torch.zeros(b, n, n, dtype=run.dtype).masked_fill_(~anc, low) if n > 1 else None
        for j, ln in enumerate(lens):
            if ln + n < view:
                mask[j, 0, :, ln + n :] = low
            if tree is not None:
                mask[j, 0, :, ln : ln + n] = tree[j]
        c.cells, c.view, c.start = torch.tensor([[ln + i for i in range(n)] for ln in lens]), view, lens[0] if b == 1 else None
        pos = torch.tensor([[min(ln + d, top) for d in dr] for ln, dr in zip(lens, dep)])
        hidden, feats = run.body_forward(tokens, pos, mask, c, self.seen, self.layers)
        logits = run.logits(hidden.reshape(b * n, -1))
        keep = None if all(active) else st.active[:, None].expand(b, n).reshape(-1)  # the rows the recycling table learns from
        flat = (self.sources.argmax_noted(tokens, logits, keep).tolist() if self.noting
                else logits.numpy().argmax(-1).tolist())  # numpy's argmax: its first maximal index, as torch's, in one thread
        paths, values, news, seq, roots, n_new = [], [], [], [], st.root.tolist(), st.n_new.tolist()
        for j in range(b):
            t, d = tok[j], dep[j]
            path, acc, bonus = accept_greedy_row(t, par[j], d, flat[j * n : (j + 1) * n], w)
            new = [t[x] for x in path[1:]] + [bonus] if w > 1 else [bonus]
            new[acc] = bonus
            paths.append(path)
            news.append(new)
            values.append([acc, d[-1]] + new)
            seq.append(lens[j] + acc + 1 if active[j] else lens[j])
            if active[j]:  # idle rows keep their state
                roots[j], n_new[j] = bonus, acc + 1
        path_t = torch.tensor(paths)
        if w > 1:
            if b == 1:
                c.commit([lens[0] + x for x in paths[0]])
            else:
                c.commit(torch.tensor(lens)[:, None] + path_t, torch.tensor(lens)[:, None] + torch.arange(w))
        if st.new_features is not None and feats is not None:
            st.new_features = (feats.gather(1, path_t[:, :, None].expand(-1, -1, feats.shape[-1])) if w > 1 else feats[:, :1]).to(st.new_features.dtype)
        st.seq_len, st.root, st.n_new, st.new_tokens = torch.tensor(seq), torch.tensor(roots), torch.tensor(n_new), torch.tensor(news)
        return path_t, values

    def verify_host(self, tokens, parents, depth, anc, scores):
        """Verification with host-side steps: the target's processors on each node with its own
        history (sampling.TargetProcessors.tree_scores), lossless sampling (the keyed rule), and
        greedy acceptance's two-pass lm_head: children are checked against their parent's argmax,
        so only internal nodes need logits up front, and a leaf only when the path ends there. On a
        small model lm_head is a large share of a verify, and about half a tree's nodes are leaves;
        where extra rows are nearly free (measured, per tree: `one_product_for`) all rows go in one product."""
        slots = self.rows.slots
        hidden, feats = self.forward_tree(tokens, depth, anc, self.rows.state.seq_len)
        b, n = tokens.shape
        dev, w = tokens.device, self.width
        two_pass = n > 1 and not self.one_product_for(b * n)
        internal = torch.zeros(b, n, dtype=torch.bool, device=dev)
        if n > 1:
            internal.scatter_(1, parents[:, 1:], True)
        plain = torch.tensor([s is not None and not s.host_side for s in slots], device=dev)
        need = (internal if two_pass else torch.ones_like(internal)) & plain[:, None]
        argmax = torch.full((b, n), -1, dtype=torch.long, device=dev)
        idx = need.flatten().nonzero().flatten()
        if idx.numel():
            logits = self.run.logits(hidden.reshape(b * n, -1)[idx])
            argmax.view(-1)[idx] = (self.sources.argmax_noted(tokens.reshape(-1)[idx], logits) if self.noting
                                    else logits.argmax(-1))
        sampled, kept = {}, {}
        for i, s in enumerate(slots):
            if s is None or not s.host_side:
                continue
            tree = row_tree(tokens, parents, depth, anc, scores, i)
            sampling = s.procs is not None and s.procs.sampling
            # a row whose logprobs are asked for scores every node: its accepted path's rows are read below
            nodes = internal[i].nonzero().flatten() if two_pass and not sampling and s.logprobs is None else None
            logits = self._scored(s, hidden[i] if nodes is None else hidden[i, nodes], tree, nodes)
            if s.logprobs is not None:
                kept[i] = logits
            if sampling:
                u = position_uniforms(s.seed, len(s.tokens), w)  # the uniforms of this sequence's next output positions
                sampled[i] = accept_sampling_keyed(tree, torch.softmax(logits.float(), -1), u)
            elif nodes is None:
                argmax[i] = logits.argmax(-1)
            else:
                argmax[i, nodes] = logits.argmax(-1)
        path, accepted, bonus = accept_greedy_batch(tokens, parents, depth, anc, argmax, w)
        if two_pass:  # paths that end at a leaf: one more lm_head row each
            leaf = [i for i, v in enumerate(bonus.tolist()) if v < 0 and slots[i] is not None and i not in sampled]
            if leaf:
                rows = torch.tensor(leaf, device=dev)
                last = path[rows, accepted[rows]]
                for j, i in enumerate(leaf):
                    s = slots[i]
                    tree = row_tree(tokens, parents, depth, anc, scores, i) if s.host_side else None
                    bonus[i] = self._scored(s, hidden[i, last[j : j + 1]], tree, last[j : j + 1]).argmax(-1)[0]
        for i, (p, tok) in sampled.items():
            path[i] = torch.tensor(p + [0] * (w - len(p)), device=dev)
            accepted[i], bonus[i] = len(p) - 1, tok
        for i, rows in kept.items():  # each emitted token's logprobs from the node whose scores decided it
            on = path[i, : int(accepted[i]) + 1]
            emitted = tokens[i, on[1:]].tolist() + [int(bonus[i])]
            slots[i].new_logprobs = token_logprobs(rows[on], emitted, slots[i].logprobs)
        bonus.clamp_(min=0)  # idle rows (no slot) got no logits: keep their next root a valid id (never emitted)
        return path, accepted, bonus, feats

    def _scored(self, slot: Slot, hidden, tree, nodes):
        logits = self.run.logits(hidden)
        if self.noting and tree is not None:
            self.sources.note_logits(tree.tokens if nodes is None else tree.tokens[nodes], logits)
        if slot.procs is not None and slot.procs.active:
            hist = torch.tensor(slot.prompt + slot.tokens[:-1], dtype=torch.long, device=hidden.device)  # every token before the root
            logits = slot.procs.tree_scores(logits, hist, tree, nodes)
        return logits
