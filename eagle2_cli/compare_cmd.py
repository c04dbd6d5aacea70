"""`eagle2 compare`: Hugging Face generate vs EAGLE-2 (and other baselines) on the same prompts."""
from __future__ import annotations

import click

from .options import common_options


EPILOG = """\b
Examples:
  eagle2 compare --vanilla --limit 4 -n 64
  eagle2 compare --vanilla --dataset mt-bench --json mt.json --plot mt.png
  eagle2 compare --vanilla --dataset humaneval --limit 20 --against pld,static,chain
  eagle2 compare --vanilla --dataset mt-bench --against tree:6/3/2,tree:12/4/3
  eagle2 compare --vanilla --dataset mt-bench --against graph,compiled,generate-compiled
  eagle2 compare --vanilla -f prompts.jsonl --against sps --assistant HuggingFaceTB/SmolLM2-135M-Instruct \\
      --model HuggingFaceTB/SmolLM2-1.7B-Instruct --draft my-head/
"""


def _against(ctx, param, value):
    if not value:
        return ()
    # Imported here, not at module level, so `--help` stays light; parsing rules live in the engine.
    from eagle2_core.methods import BASELINES, RENAMED, parse_batch_spec, parse_tree_spec
    from eagle2_core.treesettings import TreeSettings

    from .ui import old_spelling

    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    for n in set(names) & set(RENAMED):
        old_spelling(f"--against {n}", RENAMED[n])
    names = tuple(dict.fromkeys(RENAMED.get(n, n) for n in names))
    bad = [n for n in names if n not in BASELINES and parse_tree_spec(n) is None and parse_batch_spec(n) is None
           and not n.startswith("sources:")]
    if bad:
        raise click.BadParameter(f"unknown baseline {', '.join(bad)}; choose from {', '.join(BASELINES)}, tree:N/D/K, auto:N/D/K, batch:B[xN] or sources:A+B")
    for n in names:
        if (spec := parse_tree_spec(n)) is not None:
            try:
                TreeSettings(total_tokens=spec[0], depth=spec[1], top_k=spec[2]).validate()
            except ValueError:
                raise click.BadParameter(f"{n}: total tokens must be >= 2, depth and top-k >= 1") from None
    return names


def calibration_line(comp) -> str | None:
    """The draft's calibration (EAGLE-2 section 3) in one line, and what the drafting policy does about it."""
    from eagle2_core.policy import BADLY_CALIBRATED

    main = "eagle2" if "eagle2" in comp.runs else next(iter(comp.runs))
    run = comp.runs[main]
    gap = run.total.calibration_gap if run.speculative else None
    if gap is None:
        return None
    n, a, c = run.total.confidence_counts.double().sum(1).tolist()
    verdict = (f"badly calibrated (gap > {BADLY_CALIBRATED}): {'under' if a > c else 'over'}-confident"
               if gap > BADLY_CALIBRATED else f"well calibrated (gap <= {BADLY_CALIBRATED})")
    fix = "; the drafting policy corrects by each confidence bin's measured acceptance" if gap > BADLY_CALIBRATED else ""
    return f"calibration: mean draft confidence {c / n:.3f}, acceptance {a / n:.3f}, gap {gap:.3f}, {verdict}{fix}"


def source_lines(comp) -> list[str]:
    """Per method whose trees mixed draft sources (sources.py): each source's share of the
    output, nodes verified and accepted, and the calibration gap of its conditionals."""
    lines = []
    for name, run in comp.runs.items():
        table = run.total.source_table() if run.speculative and run.total.source_counts else {}
        if table:
            parts = [f"{src} {v['share']:.0%} of output ({v['nodes']} nodes, {v['accepted']} accepted"
                     + (f", gap {v['calibration_gap']:.3f})" if v["calibration_gap"] is not None else ")") for src, v in table.items()]
            lines.append(f"sources, {name}: " + "; ".join(parts))
    return lines


def divergence_text(d, decode, reference: str = "vanilla") -> str:
    """A difference's logit gap and verdict (divergence.py), for the line under the table;
    `reference`: the method whose token is the expected one."""
    if d.gap is None:
        return f"{d.note}; NOT a near-tie: a bug in eagle2, please report it"
    tok = lambda t: repr(decode([t]))  # noqa: E731
    f32 = f", {d.gap_float32:.3g} in float32" if d.gap_float32 is not None and d.dtype != "float32" else ""
    text = (f"the target's scores for {tok(d.expected)} ({reference}) and {tok(d.got)} differ by {d.gap:.3g} in {d.dtype}{f32}; "
            f"rounding there moves them by up to {d.tolerance:.3g}")
    if d.near_tie:
        return f"{text}: a near-tie, rounding decides it"
    return f"{text}{'; ' + d.note if d.note else ''}: NOT a near-tie, a bug in eagle2, please report it"


@click.command(epilog=EPILOG)
@click.option("--vanilla/--no-vanilla", default=True, show_default=True,
              help="Run Hugging Face generate as the baseline (speedups are over it; in float32 arithmetic identical outputs are "
                   "checked against it; in int8, the default for GGUF and 8/4-bit CPU targets, against eagle2's own plain "
                   "decoding, and generate's float32 model is only counted beside it; --exact checks against generate).")
@click.option("-f", "--file", "input_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Prompts in any `eagle2 generate` input format (first turns are used).")
@click.option("--dataset", type=click.Choice(["mt-bench", "humaneval"]), default=None,
              help="A vendored benchmark: MT-bench first turns or HumanEval prompts.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use the first N prompts.")
@click.option("--against", callback=_against, default="", metavar="LIST",
              help="Extra methods in the same run: pld (prompt lookup), sps (assisted generation, needs --assistant), static, chain, "
                   "tree:N/D/K (the dynamic tree with N tokens, depth D, top-k K; repeatable to sweep tree sizes), "
                   "auto or auto:N/D/K (the tree size chosen every cycle, up to N, from measured costs), "
                   "graph and compiled (EAGLE-2 in graph mode: fixed shapes, uncaptured and captured), "
                   "generate-compiled (HF generate with a static cache and torch.compile), "
                   "batch:auto, batch:B or batch:BxN (eagle2 batched at B sequences, trees of N; N=1: plain), "
                   "sources:A+B (only those draft sources).")
@click.option("--plain/--no-plain", "plain", default=None,
              help="Also run eagle2's own plain decoding (no draft, same kernels), so the speedup splits into kernels alone "
                   "(plain over generate) and speculation alone (eagle2 over plain). Default: on where the model runs on a CPU.")
@click.option("--assistant", default=None, metavar="MODEL", help="Small model for --against sps.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), default=None, help="Write the statistics as JSON ('-' for stdout).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="PNG: acceptance-length histogram and per-prompt speedup (needs matplotlib).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=None,
              help="Run the eagle2 row batched: N sequences per cycle (continuous batching), the tree size chosen by measured "
                   "cost; vanilla stays batch-1 generate, so identical counts are against it. See also --against batch:B[xN].")
@click.option("--warmup-tokens", type=click.IntRange(min=0), default=8, show_default=True, help="Tokens per method in the warm-up run.")
@common_options(max_new_tokens=128, no_speculation=True)
def compare(vanilla, input_path, dataset, limit, against, plain, assistant, json_path, plot_path, batch_size, warmup_tokens, common):
    """Compare EAGLE-2 with Hugging Face generate on the same prompts, in one process.

    Runs a warm-up, then every method on each prompt in turn. Reports tokens/s, speedup (total
    tokens over total time, and the mean of per-prompt ratios), tau, acceptance by depth and, at
    temperature 0, how many outputs are identical; for each that differs, the target's logit gap
    at the first differing token and whether rounding explains it (a near-tie), or not: then it
    is a bug, said in red, and the exit status is 1. Sampling with --seed, eagle2's methods are
    checked against its plain decoding (one uniform per output position, whatever the trees).
    Without -f or --dataset, a built-in short set.
    Greedy unless --temperature is given, even where the model's generation_config samples; its
    other settings (repetition penalty, ...) run on both sides, and the title and --json say which.
    """
    from eagle2_core.compare import run_comparison, split_by_context
    from eagle2_core.datasets import builtin_items, dataset_items
    from eagle2_core.methods import build_methods
    from eagle2_core.plot import plot_comparison
    from eagle2_core.prompts import InputError, read_prompt_file

    from .ui import consoles, print_compare, error, status, step_times_line, write_json

    out, err = consoles()
    if input_path and dataset:
        raise click.UsageError("give -f FILE or --dataset, not both")
    if "sps" in against and not assistant:
        raise click.UsageError("--against sps needs --assistant MODEL")
    bad = 0
    if input_path:
        items = []
        for entry in read_prompt_file(input_path):
            if isinstance(entry, InputError):
                bad += 1
                error(err, entry.describe(), " (skipped)")
            else:
                items.append(entry)
        source = input_path
    elif dataset:
        items, source = dataset_items(dataset), dataset
    else:
        items, source = builtin_items(), "built-in prompts"
    items = items[:limit] if limit else items
    if not items:
        raise click.ClickException("no prompts to run")

    rt = common.load(err, sample_by_default=False)  # greedy unless -t: the identity count needs it
    items, too_long = split_by_context(rt, items)
    for it, n in too_long:
        bad += 1
        error(err, f"{it.key} {it.id!r}: prompt is {n} tokens, the model's context is {rt.max_positions}", " (skipped)")
    if not items:
        raise click.ClickException("no prompt fits the model's context")
    helper = None
    if "sps" in against:
        from eagle2_core.loading import load_target

        with status(err, f"Loading assistant {assistant}..."):
            helper = load_target(assistant, dtype=common.dtype, device=common.device, trust_remote_code=common.trust_remote_code).model
    # in int8 eagle2's plain decoding is the reference every eagle2 method is checked against
    methods = build_methods(rt, against, vanilla=vanilla, assistant_model=helper, batch_size=batch_size,
                            plain=True if rt.arithmetic == "int8" else plain)

    t = rt.tree
    settings = {**rt.describe(), "source": source}
    if any(getattr(d, "tree", None) is not None and d.tree.budget == "auto" for d, _ in methods.values()):
        settings["cost_profile"] = rt.cost_profile().to_json()  # what the drafting policy chose from

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=err, disable=not err.is_terminal)
    with progress:
        task = progress.add_task("warm-up", total=len(items))

        def on_step(phase, i, item):
            desc = {"warmup": "warm-up", "explain": "measuring the logit gaps where answers differ"}.get(phase, "/".join(methods))
            progress.update(task, description=desc, **({} if phase == "explain" else {"completed": i}))

        comp = run_comparison(methods, items, rt.encode, rt.gen, baseline="vanilla" if vanilla else None,
                              warmup_tokens=warmup_tokens, on_step=on_step, settings=settings, model=rt.model, tokenizer=rt.tokenizer)

    title = (f"{len(items)} prompt{'s' if len(items) != 1 else ''} from {source}, {rt.gen.max_new_tokens} new tokens max, "
             f"{rt.generation_label()}, tree {t.label()}")
    if json_path == "-":
        out = err  # stdout carries the JSON
    print_compare(out, comp, title)
    if comp.reference:
        for name in methods:
            for item, i in comp.differences(name):
                d = comp.divergences.get(name, {}).get(str(item.id))
                line = f"{name}: {item.key} {item.id!r} differs from {comp.reference} from token {i}"
                if d is None:
                    out.print(line, style="bold red" if comp.int8 else "yellow", markup=False, soft_wrap=True)
                else:
                    out.print(f"{line}: {divergence_text(d, rt.decode, comp.reference)}", style="yellow" if d.near_tie else "bold red",
                              markup=False, soft_wrap=True, highlight=False)
    if not comp.greedy and vanilla:
        out.print("[dim]sampling: generate's outputs are not expected to match eagle2's token for token (same distribution, "
                  "different draws)" + ("; eagle2's methods are checked against its plain decoding (one uniform per "
                                        "position under --seed)" if comp.reference else "; with --seed, eagle2's methods "
                                        "are checked against its plain decoding") + "[/]")
    if line := step_times_line(comp):
        out.print(line, soft_wrap=True, highlight=False)
    if line := calibration_line(comp):
        out.print(line, soft_wrap=True, highlight=False)
    for line in source_lines(comp):
        out.print(line, soft_wrap=True, highlight=False)
    cats = comp.per_category("eagle2")
    if cats:
        out.print("tau by category: " + ", ".join(f"{c} {v['tau']:.2f}" for c, v in cats.items()), soft_wrap=True)
    if json_path:
        write_json(comp.to_json(), json_path, err)
    if plot_path:
        try:
            plot_comparison(comp, plot_path)
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        err.print(f"wrote {plot_path}")
    bugs = sum(comp.bugs(name) for name in comp.runs)
    if bugs and comp.int8:
        error(err, f"{bugs} answer{'s differ' if bugs > 1 else ' differs'} from eagle2's plain decoding in int8, where every "
                   "product is row-invariant: a bug in eagle2, please report it with this command line")
    elif bugs:  # after the JSON and plot: nothing measured is lost
        error(err, f"{bugs} answer{'s differ' if bugs > 1 else ' differs'} from vanilla where the target's candidates are "
                   "not within rounding of each other: a bug in eagle2, please report it with this command line")
    if bad or bugs:
        raise click.exceptions.Exit(1)
