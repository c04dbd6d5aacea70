"""`eagle2 tune`: measure this machine's verify and draft costs for a model and head, and show them."""
from __future__ import annotations

import click

from .options import common_options


@click.command("tune")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False, allow_dash=True), help="Also write the profile as JSON ('-' for stdout).")
@common_options
def tune(json_path, common):
    """Measure the target's verify cost by tree rows and the draft step's cost, and cache them.

    `--total-tokens auto` chooses each cycle's tree from this profile and the draft's own
    confidence; it is measured once per model, dtype, device, thread count and library
    versions, and this command measures it again.

    \b
    Examples:
      eagle2 tune
      eagle2 tune --model Qwen/Qwen2.5-0.5B-Instruct --dtype bfloat16 --json profile.json
    """
    from rich.table import Table

    from .ui import consoles, status, write_json

    out, err = consoles()
    rt = common.load(err)
    with status(err, "Measuring verify and draft costs..."):
        prof = rt.cost_profile(remeasure=True)
    t = Table(title=f"{prof.key['device_name']} ({prof.key['device']}, {prof.key['threads']} threads), {prof.key['dtype']}")
    t.add_column("tree rows", justify="right")
    t.add_column("verify ms", justify="right")
    t.add_column("x one row", justify="right")
    one = prof.verify_ms[min(prof.verify_ms)]
    for n, ms in sorted(prof.verify_ms.items()):
        t.add_row(str(n), f"{ms:.1f}", f"{ms / one:.2f}")
    out.print(t)
    out.print("draft step ms by rows: " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(prof.draft_ms.items())), highlight=False)
    if prof.lm_head_ms:
        out.print("lm_head ms by rows: " + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(prof.lm_head_ms.items()))
                  + f"  -> greedy acceptance puts {'all tree rows in one product' if prof.rows_are_cheap(rt.tree.total_tokens) else 'internal rows first, then the leaf'}",
                  highlight=False)
    if json_path:
        write_json(prof.to_json(), json_path, err)
