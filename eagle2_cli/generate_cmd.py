"""`eagle2 generate`: batch generation from a JSONL file, resumable."""
from __future__ import annotations

import sys
import time

import click

from .options import CountOrAuto, UserInputError, common_options, constrain, constraint_options

EPILOG = """\b
Input lines (JSONL; sampling keys such as max_new_tokens, temperature, top_p, top_k, seed,
stop, and a response_format (json_schema, json_object, regex, grammar) may be set per line):
  {"id": 1, "prompt": "Write a haiku"}
  {"id": 2, "messages": [{"role": "user", "content": "Hi"}]}
  {"question_id": 81, "turns": ["First question", "Follow-up"]}          (MT-bench)
  {"custom_id": "r1", "body": {"messages": [...], "max_tokens": 64}}      (OpenAI batch)

\b
Output lines echo the id with text (or turns), finish_reason, usage and metrics. Rerunning
with the same -o skips ids already done; failed lines get {"id" (if any), "line", "error"} records
and a stderr line, and the exit code is 1.

\b
Examples:
  eagle2 generate -f prompts.jsonl -o out.jsonl
  eagle2 generate -f eagle2_core/data/mt_bench/question.jsonl -o mt.jsonl -n 512
  eagle2 generate -f batch.jsonl -o out.jsonl --model Qwen/Qwen2-7B-Instruct -t 0.7 --seed 1
"""


@click.command(epilog=EPILOG)
@click.option("-f", "--file", "input_path", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Input JSONL ('-' for stdin; .gz allowed).")
@click.option("-o", "--output", "output_path", default="-", show_default=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Output JSONL, appended to and resumed; '-' for stdout.")
@click.option("--overwrite", "--restart", "overwrite", is_flag=True,
              help="Start the output file afresh instead of resuming it (a file that is not eagle2's output is refused without it).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--batch-size", "-b", type=CountOrAuto("one prompt at a time"), default="auto", show_default=True, metavar="N|auto",
              help="Sequences decoded together (continuous batching: a finished one's slot takes the next prompt). "
                   "auto: the size that this machine's measured costs say is fastest; 1: one prompt at a time.")
@click.option("--no-prefix-cache", is_flag=True,
              help="Prefill a conversation's later turns whole instead of continuing the kept cache of its earlier turn.")
@click.option("--logprobs", type=click.IntRange(0, 20), default=None, metavar="N",
              help="Record each answer token's log-probability and its N likeliest alternatives (0-20) in a `logprobs` "
                   "field (chat's logprobs.content shape; one list per turn for multi-turn lines). A line's own "
                   "logprobs / top_logprobs fields ask for them too.")
@constraint_options
@common_options(no_speculation=True)
def generate(input_path, output_path, overwrite, no_progress, batch_size, no_prefix_cache, logprobs, constraint, common):
    """Generate answers for every prompt in a JSONL file.

    MT-bench lines run turn by turn: each answer goes into the next turn's prompt.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from eagle2_core.batch import (ForeignOutput, OutputError, OutputWriter, plan_resume, prepare_output, run_batched, run_item,
                                   run_pending)
    from eagle2_core.prompts import ident
    from eagle2_core.outputlock import OutputLocked, lock_output
    from eagle2_core.prompts import InputError, read_prompt_file

    from .ui import consoles, error

    out, err = consoles()
    try:  # held until the command ends, so no two runs answer into one file
        click.get_current_context().with_resource(lock_output(output_path))
    except OutputLocked as e:
        raise click.ClickException(str(e)) from None
    entries = list(read_prompt_file(input_path))  # raises FileNotFoundError -> one clean line
    done: set = set()
    if output_path != "-":
        if overwrite:
            open(output_path, "w").close()
        known = {e.ident for e in entries if not isinstance(e, InputError)}
        known |= {ident(e.key, e.id) for e in entries if isinstance(e, InputError) and e.key}
        try:
            done = prepare_output(output_path, known)
        except OutputError as e:
            raise click.ClickException(str(e)) from None
        except ForeignOutput as e:
            raise UserInputError(str(e)) from None
    pending, skipped = plan_resume(entries, done)
    todo = sum(1 for e in pending if not isinstance(e, InputError))
    writer = OutputWriter(output_path, sys.stdout)
    if skipped:
        err.print(f"resuming {output_path}: {skipped} already done, {len(pending)} to go")
    tree_tokens = common.total_tokens
    if tree_tokens == 1:  # plain decoding: the engine's cycle with a tree of one node
        common.total_tokens = None
    rt = common.load(err) if todo else None
    if rt is not None:
        constrain(rt, constraint)
    if rt is not None and logprobs is not None:
        import dataclasses

        rt.gen = dataclasses.replace(rt.gen, logprobs=logprobs)
    if rt is not None and not no_prefix_cache:
        from eagle2_core.prefix import PrefixCache

        rt.prefix_cache = PrefixCache()
    batched, plan = (None, {})
    if rt is not None:
        batched, plan = rt.batch_decoder(todo, None if batch_size == "auto" else batch_size, tree_tokens,
                                         depth=common.depth, top_k=common.tree_top_k)
        if batched is not None:
            err.print(f"batch of {batched.batch}, {batched.label()}", highlight=False)
    decoder = rt.eagle() if rt is not None and batched is None else None
    progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[rate]}"),
                        console=err, disable=no_progress or not err.is_terminal, transient=False)
    totals = {"tokens": 0, "start": time.perf_counter()}

    def on_fail(e: InputError) -> None:
        e.path = e.path or input_path
        error(progress.console, e.describe())
        progress.update(task, advance=1)

    def on_done(entry, rec) -> None:
        totals["tokens"] += rec["usage"]["completion_tokens"]
        wall = time.perf_counter() - totals["start"]  # wall time, not the sum of records' (batched records overlap)
        rate = f"{totals['tokens'] / wall:.1f} tok/s" if wall > 0 else ""
        progress.update(task, advance=1, rate=rate)

    try:
        with progress:
            task = progress.add_task("generating", total=len(pending), rate="")
            if batched is not None:
                ok, failed = run_batched(rt, pending, writer, rt.gen, batched, on_fail, on_done)
            else:
                ok, failed = run_pending(pending, writer, lambda item: run_item(rt, decoder, item, rt.gen), on_fail, on_done)
    except OutputError as e:  # the file is cut back to its last whole record: the rerun resumes from there
        raise click.ClickException(str(e)) from None
    finally:
        writer.close()
    where = "" if output_path == "-" else f" -> {output_path}"
    err.print(f"{ok} done, {failed} failed, {skipped} skipped{where}", highlight=False)
    if failed:
        raise click.exceptions.Exit(1)
