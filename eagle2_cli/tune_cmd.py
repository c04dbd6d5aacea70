"""`eagle2 tune`: measure this machine's verify and draft costs for a model and head, and show them."""
from __future__ import annotations

import click

from .options import common_options


@click.command("tune")
@click.option("--batch/--no-batch", "batch", default=True, show_default=True,
              help="Also measure batches: verify ms for B sequences x N tree nodes (what `generate` plans with).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False, allow_dash=True), help="Also write the profile as JSON ('-' for stdout).")
@common_options
def tune(batch, json_path, common):
    """Measure the target's verify cost by tree rows and the draft step's cost, and cache them.

    `--total-tokens auto` chooses each cycle's tree from this profile and the draft's own
    confidence; it is measured once per model, dtype, device, thread count and library
    versions, and this command measures it again.

    \b
    Examples:
      eagle2 tune
      eagle2 tune --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16 --json profile.json
    """
    from .ui import consoles, status, write_json

    out, err = consoles()
    rt = common.load(err)
    with status(err, "Measuring verify and draft costs..."):
        prof = rt.cost_profile(remeasure=True)
    out.print(verify_table(prof))
    out.print("draft step ms by rows: " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(prof.draft_ms.items())), highlight=False)
    if prof.lm_head_ms:
        out.print("lm_head ms by rows: " + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(prof.lm_head_ms.items()))
                  + f"  -> greedy acceptance puts {'all tree rows in one product' if prof.rows_are_cheap(rt.tree.total_tokens) else 'internal rows first, then the leaf'}",
                  highlight=False)
    if prof.stream_floor_ms:
        gbs = prof.weight_bytes / prof.stream_floor_ms / 1e6
        out.print(f"stream floor: reading the {prof.weight_bytes / 1e6:.0f} MB of target weights once takes {prof.stream_floor_ms:.1f} ms "
                  f"({gbs:.1f} GB/s); verify of 1 / 4 / 16 rows at "
                  + " / ".join(f"{prof.verify_table(n)[-1] / prof.stream_floor_ms:.2f}x" for n in (1, 4, 16)) + " of it", highlight=False)
    if rt.target.block_bytes and rt.target.floatless_bytes:
        out.print(f"weights: {rt.target.block_bytes / 1e6:.0f} MB of blocks in memory, in place of {rt.target.floatless_bytes / 1e6:.0f} MB "
                  "of float32 (no float32 copy kept; the block kernel reads them, bitwise the float32 product over the "
                  "rebuilt weights; EAGLE2_BLOCKS=0: float32 only, =keep: both)", highlight=False)
    elif rt.target.block_bytes:
        out.print(f"GGUF blocks: {rt.target.block_bytes / 1e6:.0f} MB of the file's own blocks beside the float32 weights; the plan "
                  "reads them where the block kernel is fastest (bitwise the float32 product; EAGLE2_BLOCKS=0: float32 only)",
                  highlight=False)
    if prof.key.get("body"):
        from eagle2_core import leanbody

        note = "" if prof.key["body"] != "lean" else f" ({leanbody.native_status()})"
        out.print(f"target body: {prof.key['body']}{note}", highlight=False)
    if prof.products:
        from eagle2_core import rowgemm
        from eagle2_core.costs import packing_spread, product_weights

        plan = prof.plan
        out.print(products_table(prof))
        out.print("plan: " + plan.describe().replace("\n", "; "), highlight=False)
        packed = rowgemm.packed_bytes(product_weights(rt.model, rt.head))
        spread = packing_spread(prof.products, plan)
        data_packed = {"packed_bytes": packed, "packing_spread": {k: round(v, 3) for k, v in spread.items()}}
        if packed:
            worst = max(spread, key=spread.get) if spread else None
            out.print(f"packed weights: {packed / 1e6:.0f} MB beside the model's own, one packing per weight"
                      + (f"; the farthest from the best packing at any row count: {worst}, {100 * (spread[worst] - 1):.0f}%" if worst else ""),
                      highlight=False)
    data = prof.to_json()
    data["verify_over_stream_floor"] = ({str(n): round(ms / prof.stream_floor_ms, 3) for n, ms in sorted(prof.verify_ms.items())}
                                        if prof.stream_floor_ms else None)
    if prof.products:
        data.update(data_packed)
    if batch:
        from eagle2_core.costs import BATCH_TREES, plan, prior_expected
        from eagle2_core.measure import load_or_measure_batch
        from eagle2_core.treesettings import BATCH_DEPTH, BATCH_TOP_K

        depth, top_k = common.depth or BATCH_DEPTH, common.tree_top_k or BATCH_TOP_K
        with status(err, "Measuring batched cycles (B sequences x N tree nodes)..."):
            bc = load_or_measure_batch(rt.model, rt.head, depth, top_k, remeasure=True)
        prior = prior_expected(None if rt.head_is_random else rt.head, max(BATCH_TREES))
        b, n, est = plan(bc, 1 << 20, prior)
        out.print(batch_table(bc, est, depth, top_k))
        out.print(f"a large prompt file would run at batch {b} with "
                  + ("plain decoding" if n == 1 else f"trees of {n} nodes"), highlight=False)
        data["batch"] = bc.to_json()
    if json_path:
        write_json(data, json_path, err)


# -- the tables: figures never wrap or shorten (no_wrap), a compact box, so each fits 80 columns
def _table(title: str):
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)


def verify_table(prof):
    t = _table(f"{prof.key['device_name']} ({prof.key['device']}, {prof.key['threads']} threads), {prof.key['dtype']}")
    for head in ("tree rows", "verify ms", "x one row"):
        t.add_column(head, justify="right", no_wrap=True)
    one = prof.verify_ms[min(prof.verify_ms)]
    for n, ms in sorted(prof.verify_ms.items()):
        t.add_row(str(n), f"{ms:.1f}", f"{ms / one:.2f}")
    return t


def products_table(prof):
    from eagle2_core import rowgemm

    from rich.console import Group

    plan = prof.plan
    # one table per set of kernels offered: weights held as blocks only (a GGUF's, a head's 8-bit
    # rows) have the block kernel alone, and beside the float kernels' columns would widen the table
    groups: dict[tuple, list] = {}
    for key, by_rows in sorted(prof.products.items()):
        kinds = tuple(sorted({k for c in by_rows.values() for k in c}))
        groups.setdefault(kinds, []).append((key, by_rows))
    tables = []
    for kinds, rows in groups.items():
        t = _table("products by weight shape: ms per run of that shape's weights (the chosen kernel in bold)" if not tables else "")
        t.add_column("weight", no_wrap=True)
        t.add_column("rows", justify="right", no_wrap=True)
        for k in kinds:
            t.add_column(k, justify="right", no_wrap=True)
        for key, by_rows in rows:
            for r, c in sorted(by_rows.items()):
                pick = plan.kernels[key][rowgemm.bucket(r)]
                t.add_row(key, str(r), *[(f"[bold]{c[k]:.2f}[/]" if k == pick else f"{c[k]:.2f}") if k in c else "" for k in kinds])
        tables.append(t)
    return Group(*tables)


def batch_table(bc, est, depth: int, top_k: int):
    from eagle2_core.costs import BATCH_TREES

    t = _table(f"batched cycles (expansion depth {depth}, top-k {top_k}), B sequences x N tree nodes: each cell is the "
               "verify ms over the est. tok/s from the head's expected acceptance")
    t.add_column("batch", justify="right", no_wrap=True)
    t.add_column("draft\nms", justify="right", no_wrap=True)
    for nn in BATCH_TREES:
        t.add_column(f"N={nn}" + ("\nplain" if nn == 1 else ""), justify="right", no_wrap=True)
    for bb in bc.batches:
        cells = [f"{bc.verify_ms[(bb, nn)]:.0f}\n{est[(bb, nn)]:.0f}" if (bb, nn) in bc.verify_ms else "" for nn in BATCH_TREES]
        t.add_row(str(bb), f"{bc.draft(bb):.0f}", *cells)
    return t
