"""`eagle2 chat`: an interactive REPL (prompt-toolkit) streaming EAGLE-2 answers with a live stats panel."""
from __future__ import annotations

import os
import sys

import click

from .options import common_options, constrain, constraint_options
from .ui import error, renamed_flag

HELP = """\
/help              this help
/reset             forget the conversation (keeps the system prompt)
/system TEXT       set the system prompt (/system alone shows it, /system - clears it)
/set key=value     change a setting: temperature, top_p, top_k, max_new_tokens, seed,
                   total_tokens (a number or auto), depth, tree_top_k, draft_shape, show_draft, compare
                   (/set alone lists them)
/stats             statistics of the session so far (and per turn: prompt tokens prefilled and reused)
/bench             re-measure vanilla tokens/s (the speedup baseline)
/save FILE         write the conversation and statistics as JSON
/exit              quit (also Ctrl-D); Ctrl-C stops the current answer
Multi-line input: end a line with \\ or press Esc then Enter; or wrap text in \"\"\" ... \"\"\"."""

EPILOG = """\b
Examples:
  eagle2 chat
  eagle2 chat --prompt "Hi" --max-new-tokens 32
  eagle2 chat --show-draft --compare -s "You are terse."
  echo "Tell me a joke" | eagle2 chat --no-baseline
  eagle2 chat --model meta-llama/Llama-3.1-8B-Instruct -t 0.7 --top-p 0.9
  eagle2 chat --json-schema person.json -p "Describe a pirate"
  eagle2 chat --regex '(yes|no)' -p "Is the sea blue?"
"""

UI_FLAGS = ("show_draft", "compare")


def _bool(v: str) -> bool:
    v = v.strip().lower()
    if v in ("1", "on", "true", "yes", "y"):
        return True
    if v in ("0", "off", "false", "no", "n"):
        return False
    raise ValueError(f"expected on or off, not {v!r}")


def prefill_line(s) -> str:
    """What a turn's prefill ran: "prompt 812 tokens: 790 reused, 22 prefilled in 0.05 s"."""
    return (f"prompt {s.prompt_tokens} tokens: {s.cached_tokens} reused, {s.prompt_tokens - s.cached_tokens} prefilled "
            f"in {s.prefill_s:.2f} s")


def history_path() -> str:
    from eagle2_core.loading import cache_dir

    return os.path.join(cache_dir(), "chat_history")


class ChatApp:
    """One chat session over a Runtime; terminal-free logic lives in eagle2_core.chat."""

    def __init__(self, rt, out, err, show_draft: bool = False, compare: bool = False, baseline_tokens: int = 32):
        from eagle2_core.chat import Conversation

        self.rt, self.out, self.err = rt, out, err
        self.conv = Conversation(system_prompt=rt.system_prompt)
        rt.system_prompt = None  # the conversation carries it as a message
        self.show_draft, self.compare = show_draft, compare
        self.baseline_tokens = baseline_tokens
        self.baseline = None       # vanilla Summary from the last baseline run
        self.baseline_when = ""
        self.vanilla_turns = []    # vanilla Summaries of --compare turns
        self.baseline_due = False  # measure the start-up baseline after the first answer, which comes first
        self.answered = False      # a first answer has been given: what loading deferred is due (`settle`)

    # -- baselines ----------------------------------------------------------------------------
    def measure_baseline(self, when: str) -> None:
        from eagle2_core.compare import measure_baseline

        from .ui import status

        n = min(self.baseline_tokens, max(1, self.rt.gen.max_new_tokens))
        with status(self.err, f"Measuring vanilla speed ({n} tokens)..."):
            self.baseline = measure_baseline(self.rt.vanilla(), self.rt.eagle(), self.rt.encode, self.rt.gen, n)
        self.baseline_when = when
        self.err.print(f"[dim]vanilla baseline: {self.baseline.tokens_per_s:.1f} tokens/s ({self.baseline.new_tokens} tokens, {when})[/]")

    def _basis(self, tps: float, vanilla=None) -> tuple[float | None, str]:
        if vanilla is not None:
            return (tps / vanilla.tokens_per_s if vanilla.tokens_per_s > 0 else None,
                    f"vs vanilla generate on this prompt ({vanilla.tokens_per_s:.1f} tok/s)")
        if self.baseline is not None and self.baseline.tokens_per_s > 0:
            return tps / self.baseline.tokens_per_s, f"vs vanilla generate measured at {self.baseline_when} ({self.baseline.tokens_per_s:.1f} tok/s, {self.baseline.new_tokens} tokens)"
        return None, "unknown: no vanilla baseline yet (/bench measures one)"

    def _panel(self, summary, tree_size, vanilla=None, extra=None, title=None):
        from .ui import stats_panel

        if title is None:  # the decoding is EAGLE-2's dynamic tree whichever head drafts it
            title = ("EAGLE-2, EAGLE-3 head" if getattr(self.rt.head, "kind", "") == "eagle3"
                     else "EAGLE-2, head-free drafts" if self.rt.head is None else "EAGLE-2")

        speedup, basis = self._basis(summary.tokens_per_s, vanilla)
        if self.compare and vanilla is None and self.baseline is None:
            basis = "vs vanilla generate: runs after the answer (--compare)"
        return stats_panel(summary, tree_size, speedup, basis, title=title, extra=extra)

    def settle(self) -> None:
        """After the first answer, what loading left for later (the int8 layout: Runtime.settle);
        a one-turn chat never pays for it."""
        if self.answered and getattr(self.rt, "settle", None) is not None:
            self.rt.settle()

    # -- one turn -----------------------------------------------------------------------------
    def answer(self, text: str) -> None:
        from eagle2_core.stats import first_difference
        from eagle2_core.chat import IncrementalDetokenizer, LiveStats
        from eagle2_core.events import Summary
        from eagle2_core.prompts import text_problem

        from .ui import AnswerView

        rt = self.rt
        why = text_problem(text)
        if why is not None:  # checked before it joins the conversation, which it would break for every later turn
            error(self.err, f"this turn {why}; it was not sent")
            return
        self.conv.add_user(text)
        ids = self.conv.encode(rt.tokenizer, rt.chat_template)
        if len(ids) >= rt.max_positions:
            self.conv.drop_last_user()
            error(self.err, f"the conversation is {len(ids)} tokens, the model's context is {rt.max_positions}; /reset to start over")
            return
        self.settle()
        self.answered = True
        detok = IncrementalDetokenizer(rt.tokenizer)
        live = LiveStats()
        summary, vanilla, extra, interrupted = None, None, None, False
        # kept after the answer (prefix.py): the next turn prefills only what it adds
        stream = rt.eagle().stream(ids, rt.gen, keep=rt.prefix_cache is not None)
        with AnswerView(self.out, self.err, self.show_draft) as view:
            try:
                for ev in stream:
                    if isinstance(ev, Summary):
                        summary = ev
                        break
                    view.add(detok.push(ev))
                    live.update(ev)
                    view.set_stats(self._panel(live.summary, live.summary.mean_tree_size))
                view.add([(detok.flush(), False)])
            except KeyboardInterrupt:
                interrupted = True
                stream.close()
                summary = live.summary
                summary.finish_reason = "interrupted"
                summary.prompt_tokens = len(ids)
            tree = summary.mean_tree_size
            extra = prefill_line(summary)
            if self.compare and not interrupted:
                view.set_stats(self._panel(summary, tree, extra="running vanilla on the same prompt..."))
                v_tokens, vanilla = rt.vanilla().generate(ids, rt.gen)
                self.vanilla_turns.append(vanilla)
                from eagle2_core.events import samples

                if not samples(rt.gen.temperature):
                    # in int8 vanilla `generate` runs the float32 model: a difference is said, not a fault
                    ref = "vanilla (float32)" if rt.arithmetic == "int8" else "vanilla"
                    i = first_difference(detok.ids, v_tokens)
                    extra += "; " + (f"identical to {ref}" if i is None else f"differs from {ref} from token {i}")
            view.set_stats(self._panel(summary, tree, vanilla, extra))
        # the answer's own ids continue the conversation (chat.Conversation); an interrupted one
        # too: its cache was kept if the stream closed between events, else the next turn prefills it
        self.conv.add_assistant(detok.text, summary, detok.ids, rt.tokenizer)
        if interrupted:
            self.err.print("[yellow]interrupted[/] (the partial answer stays in the conversation)")
        elif self.baseline_due:
            self.baseline_due = False
            self.measure_baseline("start-up")
            speedup, basis = self._basis(summary.tokens_per_s)
            if speedup is not None:
                self.err.print(f"[dim]this answer: speedup {speedup:.2f}x {basis}[/]", highlight=False)

    # -- commands -----------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False means exit."""
        from eagle2_core.chat import apply_setting, settings_view
        from eagle2_core.prompts import text_problem

        cmd, _, arg = line.strip().partition(" ")
        cmd, arg = cmd.lower(), arg.strip()
        err = self.err
        if cmd in ("/exit", "/quit", "/q"):
            return False
        if cmd in ("/help", "/?"):
            err.print(HELP, markup=False, highlight=False)
        elif cmd == "/reset":
            self.conv.reset()
            if self.rt.prefix_cache is not None:  # the conversation's kept cache goes with it
                self.rt.prefix_cache.clear()
            self.vanilla_turns.clear()
            err.print("conversation cleared")
        elif cmd == "/system":
            if not arg:
                err.print(f"system prompt: {self.conv.system_prompt!r}", markup=False)
            elif text_problem(arg):
                error(err, f"the system prompt {text_problem(arg)}; it was not changed")
            else:
                self.conv.system_prompt = None if arg == "-" else arg
                err.print("system prompt cleared" if arg == "-" else "system prompt set")
        elif cmd == "/set":
            if not arg:
                view = {**settings_view(self.rt.gen, self.rt.tree), "show_draft": self.show_draft, "compare": self.compare}
                err.print("  ".join(f"{k}={v}" for k, v in view.items()), markup=False, soft_wrap=True)
            for a in arg.split():
                try:
                    key = a.split("=", 1)[0].strip().lower().replace("-", "_")
                    if key in UI_FLAGS and "=" in a:
                        setattr(self, key, _bool(a.split("=", 1)[1]))
                    else:
                        self.rt.gen, self.rt.tree, key = apply_setting(self.rt.gen, self.rt.tree, a, auto_max=self.rt.auto_max,
                                                                      auto_tree=self.rt.auto_tree)
                    err.print(f"{key} = {getattr(self, key) if key in UI_FLAGS else settings_view(self.rt.gen, self.rt.tree)[key]}", markup=False)
                except ValueError as e:
                    error(err, str(e))
        elif cmd == "/stats":
            self.stats()
        elif cmd == "/bench":
            self.measure_baseline("/bench")
        elif cmd == "/save":
            if not arg:
                error(err, "usage: /save FILE")
            else:
                self.save(os.path.expanduser(arg))
        else:
            error(err, f"unknown command {cmd}; /help lists them")
        return True

    def stats(self) -> None:
        from eagle2_core.events import Summary

        tot = self.conv.totals()
        vanilla = None
        if self.vanilla_turns:
            vanilla = Summary()
            for v in self.vanilla_turns:
                vanilla.merge(v)
        tree = tot.mean_tree_size
        panel = self._panel(tot, tree, vanilla, extra=f"{len(self.conv.turns)} answers this session", title="session")
        if vanilla is not None:  # the basis says "this prompt": over the session it is all --compare turns
            speedup = tot.tokens_per_s / vanilla.tokens_per_s if vanilla.tokens_per_s else None
            from .ui import stats_panel

            panel = stats_panel(tot, tree, speedup, f"vs vanilla on the same {len(self.vanilla_turns)} prompts", title="session",
                                extra=f"{len(self.conv.turns)} answers this session")
        (self.out if self.out.is_terminal else self.err).print(panel)
        for i, t in enumerate(self.conv.turns, 1):
            self.err.print(f"turn {i}: {prefill_line(t)}", highlight=False, markup=False)

    def save(self, path: str) -> None:
        from eagle2_core.chat import settings_view

        extra = {"runtime": self.rt.describe()}
        if self.baseline is not None:
            extra["vanilla_baseline"] = self.baseline.to_dict()
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.conv.to_json(settings_view(self.rt.gen, self.rt.tree), extra) + "\n")
        self.err.print(f"saved {path}")

    def handle(self, line: str) -> bool:
        """One input: a slash command or a user turn. False means exit."""
        text = line.strip()
        if not text:
            return True
        if text.startswith('"""') and text.endswith('"""') and len(text) >= 6:
            text = text[3:-3].strip()
        elif text.startswith("/"):
            return self.command(text)
        if text:
            self.answer(text)
        return True

    # -- front ends ---------------------------------------------------------------------------
    def run_lines(self, lines) -> None:
        for line in lines:
            if not self.handle(line.rstrip("\n")):
                break

    def stdin_lines(self, stdin):
        """Piped input, one turn a line, decoded line by line: a line that is not UTF-8 gets an
        error line of its own and is skipped, where decoding the whole stream would end the run
        with a traceback at that line."""
        raw = getattr(stdin, "buffer", None)
        if raw is None:  # already text (a test's StringIO)
            yield from stdin
            return
        for n, line in enumerate(raw, 1):
            try:
                yield line.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                error(self.err, f"stdin line {n}: not UTF-8 text (byte 0x{line[e.start]:02x} at byte {e.start}); skipped")

    def repl(self, history_file: str | None = None, pt_input=None, pt_output=None) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        history = InMemoryHistory()
        if history_file:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(history_file)), exist_ok=True)
                history = FileHistory(history_file)
            except OSError:
                pass
        session = PromptSession(history=history, multiline=True, key_bindings=key_bindings(),
                                prompt_continuation="... ", input=pt_input, output=pt_output)
        self.err.print("[dim]/help for commands, Ctrl-D to quit[/]")
        while True:
            self.settle()  # while the user reads the answer, not after they send the next turn
            try:
                line = session.prompt(">>> ")
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            try:
                if not self.handle(line):
                    break
            except KeyboardInterrupt:  # between tokens it is handled in answer(); here, keep going
                continue


FLOATS_TOO_DEAR = 2e9  # float32 bytes a `generate` baseline may rebuild every step: a 1.7B model's already makes its tokens slow


def key_bindings():
    """Enter sends; a trailing backslash, Esc+Enter or an open triple quote make a new line."""
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("enter")
    def _(event):
        buf = event.current_buffer
        text = buf.document.text
        if text.endswith("\\") and buf.document.is_cursor_at_the_end:
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
        elif text.lstrip().startswith('"""') and text.count('"""') % 2 == 1:
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _(event):
        event.current_buffer.insert_text("\n")

    return kb


@click.command(epilog=EPILOG)
@click.option("--prompt", "-p", "prompts", multiple=True, metavar="TEXT",
              help="Run this turn and exit, without the REPL (repeatable; slash commands allowed).")
@click.option("--show-draft", is_flag=True, help="Colour the text that came from accepted draft tokens.")
@click.option("--compare", "compare_each", is_flag=True, help="Run vanilla generate on every turn too, for an exact speedup.")
@click.option("--no-baseline", is_flag=True, help="Skip the short vanilla baseline run at start-up (no speedup shown until /bench).")
@click.option("--baseline-tokens", type=click.IntRange(min=1), default=32, show_default=True, help="Tokens in the vanilla baseline run.")
@click.option("--no-calibrate", is_flag=True, hidden=True, callback=renamed_flag("--no-baseline"))
@click.option("--calibration-tokens", type=click.IntRange(min=1), default=None, hidden=True, callback=renamed_flag("--baseline-tokens"))
@click.option("--no-prefix-cache", is_flag=True,
              help="Prefill every turn's whole conversation again instead of continuing the kept cache of the last one.")
@click.option("--history", "history_file", type=click.Path(dir_okay=False), default=None,
              help="Input history file [default: ~/.cache/eagle2/chat_history, or under $XDG_CACHE_HOME / $EAGLE2_CACHE].")
@constraint_options
@common_options(no_speculation=True)
def chat(prompts, show_draft, compare_each, no_baseline, baseline_tokens, no_calibrate, calibration_tokens, no_prefix_cache,
         history_file, constraint, common):
    """Chat with a model, EAGLE-2 decoding, with live speed statistics.

    Streams each answer as tokens are accepted, under a panel with tau (tokens per target
    forward), tree size, acceptance by depth, tokens/s, and the speedup over vanilla generate
    (from a short vanilla baseline run at start-up, /bench, or --compare on every turn).
    When stdin is not a terminal, each input line is one turn.
    """
    from .ui import consoles

    out, err = consoles()
    if common.total_tokens == 1:  # plain decoding (--no-speculation, --total-tokens 1): nothing drafts
        common.total_tokens, common.no_speculation = None, True
    rt = common.load(err, defer_layout=True)  # the int8 layout after the first answer (ChatApp.settle)
    constrain(rt, constraint)
    if not no_prefix_cache:
        from eagle2_core.prefix import PrefixCache

        rt.prefix_cache = PrefixCache()
    if rt.generation_label() != "greedy":  # say where sampling or a penalty came from: flags or the model's generation_config
        err.print(f"[dim]generation: {rt.generation_label()} (the model's generation_config, flags override)[/]", highlight=False)
    app = ChatApp(rt, out, err, show_draft=show_draft, compare=compare_each, baseline_tokens=calibration_tokens or baseline_tokens)
    if not (no_baseline or no_calibrate) and not compare_each:
        if rt.target.floatless_bytes > FLOATS_TOO_DEAR:
            # `generate` would rebuild every float32 weight from the blocks at every step
            err.print(f"[dim]no vanilla baseline: `generate` would rebuild {rt.target.floatless_bytes / 1e9:.1f} GB of float32 "
                      "weights every token here (/bench measures it anyway)[/]")
        else:
            app.baseline_due = True  # after the first answer: nothing is measured before it
    if prompts:
        app.run_lines(prompts)
    elif sys.stdin is not None and sys.stdin.isatty() and sys.stdout.isatty():
        app.repl(history_file or history_path())
    else:
        app.run_lines(app.stdin_lines(sys.stdin))
    from .main import TEARDOWN_FREE

    TEARDOWN_FREE["ok"] = True  # every answer printed, /save's files closed: `eagle2` may skip the interpreter's teardown
