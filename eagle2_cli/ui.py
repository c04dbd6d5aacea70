"""Rich rendering: consoles, spinners, the chat stats panel and streaming view, the compare table."""
from __future__ import annotations

import contextlib
import sys

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

DRAFT_STYLE = "bold cyan"


PIPE_WIDTH = 200  # a log or a pipe has no width: tables print whole rather than at Rich's default 80


def _width(stream) -> int | None:
    import os

    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH


def consoles() -> tuple[Console, Console]:
    """(stdout console, stderr console), created per invocation so test runners can capture them."""
    # soft_wrap: message lines (paths, errors) stay whole for grep; tables and panels still fit the width
    return (Console(file=sys.stdout, highlight=False, soft_wrap=True, width=_width(sys.stdout)),
            Console(file=sys.stderr, highlight=False, soft_wrap=True, width=_width(sys.stderr)))


@contextlib.contextmanager
def status(console: Console | None, message: str):
    if console is None or not console.is_terminal:
        yield
        return
    with console.status(message, spinner="dots"):
        yield


def fmt_depths(acc: list[float], limit: int = 8) -> str:
    if not acc:
        return "-"
    s = " ".join(f"{a:.2f}" for a in acc[:limit])
    return s + (" ..." if len(acc) > limit else "")


def stats_panel(summary, tree_size: float | None, speedup: float | None, basis: str, title: str = "EAGLE-2", extra: str | None = None) -> Panel:
    """tau, tree size, acceptance by depth, tokens/s and speedup, plus what the speedup is measured against."""
    t = Text()
    t.append("tau ", style="dim")
    t.append(f"{summary.tau:.2f}", style="bold")
    t.append("   tree ", style="dim")
    # the mean tree verified per cycle: fractional when the per-cycle budget (total_tokens=auto) chooses it
    t.append((f"{tree_size:.0f}" if abs(tree_size - round(tree_size)) < 0.05 else f"{tree_size:.1f}") if tree_size else "-")
    t.append("   tokens/s ", style="dim")
    t.append(f"{summary.tokens_per_s:.1f}")
    t.append("   speedup ", style="dim")
    t.append(f"{speedup:.2f}x" if speedup else "-", style="bold green" if speedup and speedup >= 1 else "bold yellow")
    t.append("\nacceptance by depth ", style="dim")
    t.append(fmt_depths(summary.acceptance_by_depth))
    t.append(f"   tokens {summary.new_tokens}   verify steps {summary.cycles}", style="dim")
    t.append(f"\nspeedup {basis}", style="dim")
    table = summary.source_table() if getattr(summary, "source_counts", None) else {}
    if table:  # which draft sources fed the answer (sources.py)
        t.append("\nfrom ", style="dim")
        t.append(", ".join(f"{src} {v['share']:.0%}" for src, v in table.items()))
        t.append(" of the tokens; the rest the target's own", style="dim")
    if extra:
        t.append("\n" + extra, style="dim")
    return Panel(t, title=title, title_align="left", border_style="blue", expand=False)


class AnswerView:
    """Streams an answer: on a terminal, finished lines scroll above a live panel holding the
    current line and the stats; elsewhere, plain text to `out` and the panel at the end to `err`."""

    def __init__(self, out: Console, err: Console, show_draft: bool = False):
        self.out, self.err, self.show_draft = out, err, show_draft
        self.live_mode = out.is_terminal
        self.line = Text()
        self.panel = None
        self.live: Live | None = None
        self.wrote = False

    def __enter__(self) -> "AnswerView":
        if self.live_mode:
            self.live = Live(self._render(), console=self.out, refresh_per_second=8, transient=False, auto_refresh=True)
            self.live.__enter__()
        return self

    def _render(self):
        return Group(self.line, self.panel) if self.panel is not None else self.line

    def add(self, pieces: list[tuple[str, bool]]) -> None:
        for text, from_draft in pieces:
            if not text:
                continue
            self.wrote = True
            if not self.live_mode:
                self.out.file.write(text)
                self.out.file.flush()
                continue
            style = DRAFT_STYLE if (self.show_draft and from_draft) else ""
            parts = text.split("\n")
            for i, part in enumerate(parts):
                if i > 0:  # a finished line goes above the live area for good, wrapped at word
                    self.live.console.print(self.line, soft_wrap=False)  # boundaries to the terminal width
                    self.line = Text()
                self.line.append(part, style=style)
        if self.live is not None:
            self.live.update(self._render())

    def set_stats(self, panel) -> None:
        self.panel = panel
        if self.live is not None:
            self.live.update(self._render())

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.update(self._render(), refresh=True)
            self.live.__exit__(*exc)
        else:
            if self.wrote:
                self.out.file.write("\n")
                self.out.file.flush()
            if self.panel is not None:
                self.err.print(self.panel)


def compare_rows(comp) -> tuple[list[tuple[str, str]], list[dict[str, str]]]:
    """The compare table's columns ([(key, header)]) and one dict of cells per method: every
    figure as text, so the table, the narrow-terminal form and the tests read the same cells."""
    split = "plain" in comp.runs  # speculation alone: over eagle2's own plain decoding (same kernels)
    same_head = "identical" if comp.reference in (None, comp.baseline) else f"same as\n{comp.reference}"
    cols = [("method", "method"), ("tok/s", "tok/s"), ("speedup", "speedup\n(total)"), ("mean", "speedup\n(mean)")]
    cols += [("over plain", "over own\nplain")] if split else []
    cols += [("tau", "tau"), ("identical", same_head)]
    if comp.int8 and comp.greedy and comp.baseline in comp.runs:  # said, not checked: generate runs the float32 model
        cols += [("to generate", "identical to\ngenerate\n(float32)")]
    n = len(comp.items)
    rows = []
    for name, run in comp.runs.items():
        sp, mean, same = comp.speedup(name), comp.mean_speedup(name), comp.identical(name)
        base = name == comp.baseline
        label = name
        if (run.backend_used or "").startswith("eager (capture failed"):
            label += " (uncaptured)"
        if name == "plain":
            label = "plain (no draft)"
        elif run.plan:  # a batched method: what it ran as
            tree = run.plan.get("tree_tokens")
            label += f" (batch {run.plan.get('batch_size')}, " + ("plain" if tree == 1 else f"tree {tree}") + ")"
        op = comp.over_plain(name) if split else None
        rows.append({
            "name": name, "method": label, "tok/s": f"{run.tokens_per_s:.1f}",
            "speedup": "1.00x" if base else (f"{sp:.2f}x" if sp else "-"),
            "mean": "" if base else (f"{mean:.2f}x" if mean else "-"),
            "over plain": ("1.00x" if name == "plain" else f"{op:.2f}x" if op else "") if split else "",
            "tau": f"{run.total.tau:.2f}" if run.speculative else "",
            "identical": "" if base or name == comp.reference else ("-" if same is None else f"{same}/{n}" + ties_note(comp, name)),
            "acceptance": fmt_depths(run.total.acceptance_by_depth, 8) if run.speculative else "",
            "to generate": "" if (g := comp.identical_to_generate(name)) is None else f"{g}/{n}",
        })
    return cols, rows


def compare_table(comp, title: str, cols_rows=None) -> Table:
    """Fits 80 columns with every figure whole: numbers never wrap or shorten (no_wrap), only the
    method's label and the near-tie note fold; acceptance by depth goes below the table."""
    cols, rows = cols_rows or compare_rows(comp)
    t = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for key, head in cols:
        if key == "method":
            t.add_column(head, overflow="fold", min_width=8)
        elif key == "identical":
            t.add_column(head, justify="right", overflow="fold", min_width=max(5, *(len(r[key].split(" ")[0]) for r in rows)))
        else:
            t.add_column(head, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(*(r[key] for key, _ in cols))
    return t


def print_compare(console: Console, comp, title: str) -> None:
    """The compare table, then acceptance by depth per speculative method. Where the terminal is
    narrower than the table's narrowest form, one line per method instead (wrapped, never cut)."""
    from rich.markup import escape

    cols, rows = compare_rows(comp)
    table = compare_table(comp, title, (cols, rows))
    # the narrowest table that keeps every figure whole: its natural width with the method's
    # label folded to 16 characters (Rich would squeeze the label to nothing rather than say so)
    label = max(len(r["method"]) for r in rows)
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    if natural - max(0, label - 16) <= console.width:
        console.print(table)
    else:
        console.print(escape(title), soft_wrap=False)
        for r in rows:
            cells = [f"{head.replace(chr(10), ' ')} {r[key]}" for key, head in cols[1:] if r[key]]
            console.print(f"[bold]{escape(r['method'])}[/]: " + ", ".join(cells), soft_wrap=False, highlight=False)
    for r in rows:
        if r["acceptance"] not in ("", "-"):
            console.print(f"acceptance by depth, {escape(r['method'])}: {r['acceptance']}", soft_wrap=False, highlight=False)


def ties_note(comp, name: str) -> str:
    """What the differing answers are: " (2 near-ties)", or in red how many are not (a bug)."""
    ties, others = comp.tie_counts(name)
    if others:
        return f" [bold red]({others} NOT near-tie{'s' if others > 1 else ''})[/]"
    return f" ({ties} near-tie{'s' if ties > 1 else ''})" if ties else ""


def step_times_line(comp) -> str:
    """Where the time goes, one line under the table (it would not fit in 80 columns as a column):
    ms per `generate` step, draft + verify ms per cycle for each speculative method."""
    parts = []
    for name, run in comp.runs.items():
        ms = run.step_ms()
        if not run.speculative:
            if ms["ms_per_token"] is not None:
                parts.append(f"{name} {ms['ms_per_token']:.0f} per token")
        elif ms["draft_ms_per_cycle"] is not None:
            parts.append(f"{name} {ms['draft_ms_per_cycle']:.0f} draft + {ms['verify_ms_per_cycle']:.0f} verify per cycle")
    return "ms: " + "; ".join(parts) if parts else ""


def error(console: Console, message: str, suffix: str = "") -> None:
    """One red `error:` line; the message is printed literally (no Rich markup)."""
    from rich.markup import escape

    console.print(f"[red]error:[/] {escape(message)}{suffix}", soft_wrap=True, highlight=False)


def old_spelling(old: str, new: str) -> None:
    """One stderr line for a renamed flag or method name whose old spelling still works."""
    print(f"note: {old} is now {new}; the old spelling still works for now", file=sys.stderr)


def renamed_flag(new: str):
    """A click callback for a hidden old flag: say that it is renamed, pass its value on."""
    def callback(ctx, param, value):
        if value not in (None, False):
            old_spelling(param.opts[0], new)
        return value
    return callback


def write_json(data: dict, path: str, err=None) -> None:
    """`--json FILE` for any command: indented JSON to the file, or to stdout for '-'."""
    import json

    import click

    payload = json.dumps(data, indent=2)
    if path == "-":
        click.echo(payload)
        return
    with open(path, "w") as f:
        f.write(payload + "\n")
    if err is not None:
        err.print(f"wrote {path}")
