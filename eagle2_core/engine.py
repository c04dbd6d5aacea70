"""The decoding engine: a queue of requests, decoded B rows at a time by one cycle (cycle.py).

Chat is one request; a prompt file is a queue, and a row whose sequence ends takes the next
prompt (continuous batching). The engine owns what the cycle does not: admitting prompts into
free rows, stop handling and events, dropping idle rows once the queue runs dry, the drafting
policy (policy.py, which the live cycle asks what to draft and how much to verify), and the
lm_head plan from the measured costs. The cycle itself
(draft, verify, commit) and its two modes, live and fixed (captured), are cycle.py's; the KV
cache is kvcache.py's.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .accept import first_token, generation_seed
from .policy import CostCurve, Policy
from .cycle import Cycle, Slot, bucket
from .sources import DraftSources
from .events import GenerationSettings, StepEvent, StopChecker, Summary, collect
from .kvcache import KVCache, num_cache_layers
from .logprobs import token_logprobs
from .measure import load_or_measure
from .prefix import PrefixCache
from .target import TargetRunner, model_eos_ids
from .treesettings import TreeSettings

# re-exported: callers and tests import the cycle's and the cache's names from here too
__all__ = ["Engine", "Request", "new_slot", "pick_fn", "Cycle", "Slot", "bucket", "KVCache", "num_cache_layers"]


@dataclass
class Request:
    key: object            # the caller's handle (returned with the result)
    ids: list[int]         # the prompt, encoded
    gen: object            # GenerationSettings
    keep: bool = False     # when it ends, keep its KV for a request that continues it (the engine's prefix cache)


def new_slot(key, gen, stop, summary, model=None, prompt=(), eos=()) -> Slot:
    from .sampling import TargetProcessors

    vocab = model.get_output_embeddings().weight.shape[0] if gen.constraint is not None and model is not None else None
    procs = TargetProcessors(gen, getattr(model, "generation_config", None), list(prompt) or [0], sorted(eos), gen.max_new_tokens,
                             tokenizer=getattr(stop, "tokenizer", None), vocab_size=vocab)
    # a seeded answer depends on (seed, position) alone; unseeded, a fresh 64-bit seed per sequence
    return Slot(key=key, stop=stop, procs=procs, prompt=list(prompt), seed=generation_seed(gen.seed), summary=summary,
                started=time.perf_counter(), logprobs=gen.logprobs)


def pick_fn(slot: Slot):
    """The first token after a prompt: argmax of the processed scores, or the draw of output position 0."""
    def pick(logits):
        if slot.procs is not None and slot.procs.active:
            logits = slot.procs.scores(logits, torch.tensor([slot.prompt], dtype=torch.long, device=logits.device))
        if slot.procs is None or not slot.procs.sampling:
            token = int(logits.argmax(-1)[0])
        else:
            token = first_token(logits[0], slot.seed)
        if slot.logprobs is not None:
            slot.new_logprobs = token_logprobs(logits[:1], [token], slot.logprobs)
        return token
    return pick


def take_logprobs(slot: Slot, emitted: list[int]) -> list | None:
    """The logprobs of the tokens a prefill or cycle emitted (stop handling may cut some), kept
    for the answer's summary too; None when none were asked for."""
    got, slot.new_logprobs = slot.new_logprobs, None
    if slot.logprobs is None:
        return None
    got = list(got or ())[: len(emitted)]
    slot.summary.logprobs.extend(got)
    return got


# -- the engine: one loop over a queue of requests ---------------------------------------------------

class Engine:
    """EAGLE-2 decoding of a queue of requests with `batch` rows (continuous batching); `stream` is
    one request (chat), `run` a queue (prompt files, compare). `graph`/`compile`: fixed mode, and
    its torch.compile backend ("inductor", "aot_eager", "cuda-graphs"); else live mode."""

    def __init__(self, model, head, tokenizer=None, tree: TreeSettings | None = None, costs=None, *, batch: int = 1,
                 record_confidence: bool = False, graph: bool = False, compile: str | None = None, batch_costs=None,
                 prefix_cache: PrefixCache | None = None, sources: tuple[str, ...] | None = None):
        self.runner = run = TargetRunner(model)
        # kept sequences (prefix.py): every admit looks its prompt up there; None = every prompt prefilled whole
        self.prefix = prefix_cache
        # a prompt longer than this many new tokens, arriving while other rows decode, is prefilled
        # a chunk per cycle (a server sets it; None: whole, the fastest for it alone)
        self.prefill_chunk: int | None = None
        self._chunks: PrefixCache | None = None
        self.head, self.tokenizer, self.batch = head, tokenizer, max(1, batch)
        self.tree = tree or TreeSettings.for_device(run.device, run.dtype)
        self.tree.validate()
        self.graph = graph or compile is not None
        self.compile = compile
        self.record_confidence = record_confidence
        # the head-free draft sources (sources.py): host-side, so live mode's dynamic trees only; one
        # object for the engine's life, so its recycling table keeps learning across runs and turns
        names = tuple(s for s in (sources or ()) if s != "head")
        live = not self.graph and self.tree.shape == "dynamic"
        drafts = head is not None or (names and live)
        auto = drafts and live and self.tree.budget == "auto"
        # every live tree of the policy's goes through the merge (the head's alone too): one ranking, one sizing
        self.sources = DraftSources(names, model.get_output_embeddings().weight.shape[0]) if live and (names or auto) else None
        if costs is None and run.device.type == "cpu" and drafts:
            costs = load_or_measure(model, head)  # cached per machine, model, dtype and threads
        self.costs = costs
        # Greedy acceptance's lm_head plan: every tree row in one product (a GPU, fixed shapes, no
        # measured costs), or None: per cycle by its tree's rows, one product where this machine's
        # measured costs say it costs no more than internal rows first (costs.rows_are_cheap)
        self.one_product = True if self.graph or run.device.type != "cpu" or costs is None else None
        self.policy = None  # the drafting policy, kept across runs: a chat's later turns use what earlier ones learned
        if auto:
            if costs is None:
                raise ValueError("budget='auto' needs measured costs (measure.load_or_measure)")
            k, n = self.tree.top_k, self.tree.total_tokens
            self.policy = Policy(CostCurve(costs, n, lambda b: costs.draft_step_ms(k * b), batch_costs), n, head is not None, bool(names))
        self.cycle: Cycle | None = None
        self.eos_ids = None
        self.counter = None
        self.stats = {"cycles": 0, "tree_sizes": {}, "arms": {}}
        self.heartbeat = 0.0  # time.time() of the last completed cycle (a server's /health reads it)

    @property
    def capture_failure(self):
        return self.cycle.capture_failure if self.cycle is not None else None

    def label(self) -> str:
        """What each cycle verifies, in a few words ("trees of up to 6 nodes (chosen per cycle)")."""
        if self.head is None and self.sources is None:
            return "plain decoding"
        n = self.tree.total_tokens
        what = f"trees of up to {n} nodes (chosen per cycle)" if self.policy is not None else f"{self.tree.shape} trees of {n} nodes"
        return f"{what} from {self.source_label()}"

    def source_label(self) -> str:
        """Which draft sources feed the trees ("head + recycle + match")."""
        names = (["head"] if self.head is not None else []) + list(self.sources.active if self.sources is not None else ())
        return " + ".join(names) or "none"

    def _rows_for(self, waiting: int) -> int:
        """Rows a run needs for `waiting` requests: no more than the engine's batch, and in fixed
        mode a power of two (one capture per batch bucket)."""
        rows = min(self.batch, max(1, waiting))
        return min(self.batch, bucket(rows, least=1)) if self.graph else rows

    def _cycle_for(self, capacity: int, waiting: int) -> Cycle:
        rows = self._rows_for(waiting)
        c = self.cycle
        if c is None:
            c = self.cycle = Cycle(self.runner, self.head, self.tree, rows, capacity, fixed=self.graph, backend=self.compile,
                                   sources=self.sources)
        elif c.rows.batch < rows:
            c.rows.widen(rows)  # the same cycle, so its captured functions serve this run too
        c.reset()
        c.rows.fit()  # a run that ended early (an error, Ctrl-C) may have left long rows' buffers
        c.rows.ensure_capacity(capacity)
        c.policy = self.policy
        c.verifier.one_product, c.record_confidence, c.counter = self.one_product, self.record_confidence, self.counter
        c.verifier.cheap = self.costs.rows_are_cheap if self.costs is not None else None
        return c

    def _run(self, queue, poll=None) -> Iterator[tuple[object, object, list[int] | None]]:
        """Decode every request of `queue` (a deque the caller may extend meanwhile). Yields
        (key, StepEvent, None) as tokens come and (key, Summary, tokens) as each request ends.
        `poll(queue)`, if given, runs before every admission round and cycle (a server's engine
        thread: it moves new requests into `queue`) and returns the keys to cancel now: queued
        ones are dropped, running ones end at once ("cancelled") and free their rows."""
        run = self.runner
        if self.eos_ids is None:
            self.eos_ids = model_eos_ids(run.model, self.tokenizer)  # once: a tokenizer's vocabulary is slow to read
        # Fixed mode reserves what its first rows' `admit` asks (the prompt, every new token and one
        # more cell), so the first admits do not each change the capture's bucket. Live mode grows
        # as rows grow (Cycle.step, doubling): what a request may reach is not held for it before
        # it is reached, and a queued request holds nothing.
        first = list(queue)[: self.batch]
        longest = max((len(r.ids) + (r.gen.max_new_tokens if self.graph else 0) + 1 for r in first), default=1)
        cycle = self._cycle_for(min(run.max_positions, longest), len(queue))
        keeps: set[int] = set()  # id() of the slots whose request asked to be kept
        # id() of a request whose prompt is being prefilled in chunks -> [seconds so far, tokens its
        # first lookup restored, when it was first admitted, chunks run]
        chunked: dict[int, list] = {}

        def keep(b: int) -> None:
            s = cycle.rows.slots[b]
            if self.prefix is not None and id(s) in keeps:
                keeps.discard(id(s))
                self.prefix.add(cycle.kept_row(b, s.prompt + s.tokens))

        def finish(b: int):
            keep(b)
            s = cycle.release(b)
            cycle.rows.fit()  # the longest sequence may have left: the cells it held go with it
            s.summary.finish(s.stop, time.perf_counter() - s.started)
            return s.key, s.summary, s.tokens

        with cycle.session():
            try:
                while True:
                    if poll is not None:
                        cancel = set(poll(queue))
                        if cancel:
                            yield from self._cancel(cycle, queue, cancel, finish)
                    if not (queue or cycle.rows.busy):
                        break
                    if queue and not cycle.rows.free and cycle.rows.batch < self.batch:
                        self._widen(cycle, len(queue))  # requests joined a run whose idle rows were dropped (a server's)
                    deferred = []  # long prompts with a chunk prefilled this round: the rest after the next cycle
                    for b in cycle.rows.free:
                        if not queue:
                            break
                        req = queue.popleft()
                        eos = set(req.gen.eos_token_ids) if req.gen.eos_token_ids is not None else self.eos_ids
                        stop = StopChecker(req.gen, self.tokenizer, eos, run.max_positions, len(req.ids))
                        summary = Summary(prompt_tokens=len(req.ids), logprobs=[] if req.gen.logprobs is not None else None)
                        slot = new_slot(req.key, req.gen, stop, summary, run.model, req.ids, eos)
                        if stop.done:  # no room at all: nothing to generate
                            summary.finish(stop, 0.0)
                            yield req.key, summary, []
                            continue
                        t0 = time.perf_counter()
                        part = chunked.get(id(req))
                        store = self.prefix if self.prefix is not None or part is None else self._chunk_store()
                        kept, reuse = self._reusable(cycle, req.ids, store, record=part is None)
                        if part is None:
                            part = [0.0, reuse, t0, 0]
                        if self.prefill_chunk and cycle.rows.busy and len(req.ids) - reuse > self.prefill_chunk:
                            # A long prompt beside decoding rows: one chunk now, kept as a sequence of
                            # its own, and the rest after the next cycle, so the other rows' streams
                            # stall for a chunk's prefill at a time, not the whole prompt's.
                            end = reuse + self.prefill_chunk
                            cycle.admit(b, req.ids[:end], slot, lambda logits: 0, kept, reuse)  # its first token is not used
                            (self.prefix if self.prefix is not None else self._chunk_store()).add(cycle.kept_row(b, req.ids[:end]))
                            cycle.release(b)
                            part[0] += time.perf_counter() - t0
                            part[3] += 1
                            chunked[id(req)] = part
                            deferred.append(req)
                            continue
                        root = cycle.admit(b, req.ids, slot, pick_fn(slot), kept, reuse)
                        if chunked.pop(id(req), None) is not None and self.prefix is None:
                            self._chunks.discard(req.ids)  # its chunks served their purpose
                        slot.started = part[2]
                        if req.keep:
                            keeps.add(id(slot))
                        summary.target_forwards, summary.prefill_s = 1 + part[3], part[0] + time.perf_counter() - t0
                        summary.cached_tokens = reuse = part[1]
                        emitted = stop.push([root])
                        slot.tokens.extend(emitted)
                        yield req.key, StepEvent(emitted, accepted=0, tree_size=1, draft_s=0.0, verify_s=summary.prefill_s,
                                                 cached_tokens=reuse, logprobs=take_logprobs(slot, emitted)), None
                        if stop.done:
                            yield finish(b)
                    queue.extendleft(reversed(deferred))
                    if not cycle.rows.busy:
                        continue
                    if not queue and cycle.rows.batch > 1 and cycle.rows.busy <= cycle.rows.batch // 2:
                        self._compact(cycle)
                    rows = cycle.step()
                    self.stats["cycles"] += 1
                    self.heartbeat = time.time()
                    n, arm = cycle.last["tree"], cycle.last["arm"]
                    self.stats["tree_sizes"][n] = self.stats["tree_sizes"].get(n, 0) + 1
                    self.stats["arms"][arm] = self.stats["arms"].get(arm, 0) + 1
                    for b, toks, accepted in rows:
                        s = cycle.rows.slots[b]
                        emitted = s.stop.push(toks)
                        s.tokens.extend(emitted)
                        yield s.key, StepEvent(emitted, accepted=accepted, tree_size=n, draft_s=cycle.last["draft_s"],
                                               verify_s=cycle.last["verify_s"], logprobs=take_logprobs(s, emitted)), None
                        if s.stop.done:
                            yield finish(b)
            except GeneratorExit:
                # closed between events (a chat's Ctrl-C): every row is consistent here, so the
                # requests that asked to be kept keep what they emitted, with its cache
                for b, s in enumerate(cycle.rows.slots):
                    if s is not None:
                        keep(b)
                raise

    def _chunk_store(self) -> PrefixCache:
        """Where a long prompt's chunks wait between cycles when no prefix cache is kept."""
        if self._chunks is None:
            self._chunks = PrefixCache()
        return self._chunks

    def _reusable(self, cycle: Cycle, ids: list[int], store: PrefixCache | None = None, record: bool = True):
        """(kept sequence, cells to restore) for a prompt: the longest common prefix L of token ids
        with a kept sequence, less one (the first token's logits must come from a forward), and
        no more than the head kept when drafting (its cell t pairs f_t with x_{t+1}, so it lags
        the target; a head cell never computed would not change the text, only what is drafted)."""
        if store is None:
            return None, 0
        kept, common = store.lookup(ids)
        if kept is None:
            return None, 0
        reuse = min(common, len(ids)) - 1
        if cycle.speculative:
            reuse = min(reuse, kept.head_len if kept.head is not None else 0)
        reuse = max(0, reuse)
        if record:
            store.record_hit(reuse)
        return (kept, reuse) if reuse > 0 else (None, 0)

    def _cancel(self, cycle: Cycle, queue, keys: set, finish):
        """End the requests `keys` now: queued ones leave the queue, running ones free their rows."""
        for req in [r for r in queue if r.key in keys]:
            queue.remove(req)
            summary = Summary(prompt_tokens=len(req.ids), finish_reason="cancelled")
            yield req.key, summary, []
        for b, s in enumerate(cycle.rows.slots):
            if s is not None and s.key in keys:
                s.stop.reason = "cancelled"
                yield finish(b)

    def _widen(self, cycle: Cycle, waiting: int) -> None:
        """Rows for `waiting` new requests mid-run, up to the engine's batch: `_compact` dropped
        idle rows, or the run started with fewer requests. Only the rows they use: every row is a
        row of every product and of every K/V buffer."""
        cycle.rows.widen(max(cycle.rows.batch, self._rows_for(cycle.rows.busy + waiting)))

    def _compact(self, cycle: Cycle) -> None:
        """Drop idle rows once no prompt waits for them: every row costs a row of every product.
        Fixed mode keeps a power-of-two batch (one capture per batch bucket)."""
        keep = [i for i, s in enumerate(cycle.rows.slots) if s is not None]
        if cycle.fixed:
            size = bucket(len(keep), least=1)
            if size >= cycle.rows.batch:
                return
            keep += [i for i, s in enumerate(cycle.rows.slots) if s is None][: size - len(keep)]
        cycle.rows.compact(sorted(keep))

    @torch.no_grad()
    def run(self, queue, on_done) -> None:
        """Decode a queue of `Request`s; `on_done(key, tokens, summary)` as each ends (it may extend the queue)."""
        for key, ev, tokens in self._run(queue):
            if tokens is not None:
                on_done(key, tokens, ev)

    @torch.no_grad()
    def stream(self, prompt_ids, gen: GenerationSettings | None = None, keep: bool = False) -> Iterator[StepEvent | Summary]:
        """One request: a StepEvent per cycle (the first is the prefill's token), then the Summary.
        `keep`: its KV stays in the prefix cache for a request that continues it (a chat's next turn)."""
        ids = torch.as_tensor(prompt_ids).view(-1).tolist()
        for _, ev, _ in self._run(deque([Request(0, ids, gen or GenerationSettings(), keep)])):
            yield ev

    def generate(self, prompt_ids, gen: GenerationSettings | None = None, keep: bool = False) -> tuple[list[int], Summary]:
        return collect(self.stream(prompt_ids, gen, keep))

    @torch.no_grad()
    def serve(self, queue, poll) -> Iterator[tuple[object, object, list[int] | None]]:
        """`_run` for a long-lived caller (a server's engine thread): requests join `queue` through
        `poll` between cycles and leave as they end or are cancelled; returns once none is left."""
        yield from self._run(queue, poll)
