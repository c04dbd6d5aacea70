"""`eagle2 serve`: an OpenAI-compatible HTTP server (eagle2_core/server.py) on the one engine."""
from __future__ import annotations

import click

from .options import CountOrAuto, UserInputError, common_options

EPILOG = """\b
Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
GET /health (the engine thread's heartbeat), GET /metrics (Prometheus text).

\b
Examples:
  eagle2 serve                                   # the embedded SmolLM2 on http://127.0.0.1:8000/v1
  eagle2 serve --port 8080 --api-key sk-local --cors
  eagle2 serve --model Qwen/Qwen2-7B-Instruct --host 0.0.0.0 --batch-size 8
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}'
"""


@click.command(epilog=EPILOG)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 serves other machines).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: any free one, printed).")
@click.option("--api-key", default=None, envvar="EAGLE2_API_KEY", help="Every request must send 'Authorization: Bearer KEY' [env: EAGLE2_API_KEY].")
@click.option("--cors", is_flag=True, help="Answer browsers' cross-origin requests (any origin).")
@click.option("--batch-size", "-b", type=CountOrAuto("one request at a time"), default="auto", show_default=True, metavar="N|auto",
              help="Rows decoded together: requests join as rows free up and leave as they end. "
                   "auto: the size this machine's measured costs say is fastest for a full batch.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a row; past it, 429.")
@click.option("--grace", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM or Ctrl-C: seconds the running requests get to finish before they are cancelled.")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=256, show_default=True,
              help="A prompt longer than this, arriving while others decode, is prefilled this many tokens per cycle, "
                   "so the running streams never stall for a whole long prefill (0: whole).")
@click.option("--served-model-name", default=None, help="The model id /v1/models reports and responses carry [default: the model's name].")
@click.option("--no-prefix-cache", is_flag=True, help="Prefill every prompt whole instead of restoring kept sequences' prefixes.")
@click.option("--prefix-cache-mb", type=click.FloatRange(min=0), default=None,
              help="Memory for kept sequences (least recently used evicted first) [default: 1024, or an eighth of RAM if less].")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=16.0, show_default=True,
              help="Largest request body; a larger one is refused (413) before it is read whole.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a connection may take to send a whole request head before it is closed.")
@common_options(no_speculation=True)
def serve(host, port, api_key, cors, batch_size, max_queue, grace, prefill_chunk, served_model_name, no_prefix_cache, prefix_cache_mb,
          max_body_mb, header_timeout, common):
    """Serve the model over an OpenAI-compatible HTTP API, EAGLE-2 decoding.

    Every request joins the one engine's running batch (continuous batching) and carries its own
    max_tokens, temperature, top_p, stop, seed (and the extensions top_k, min_p,
    repetition_penalty); a client resending its conversation restores the kept prefix instead of
    prefilling it again. Binds 127.0.0.1 unless --host says otherwise.
    """
    import logging

    import uvicorn

    from eagle2_core.server import create_app, head_timeout_protocol

    from .ui import consoles

    _, err = consoles()
    if api_key is not None and not api_key.strip():
        raise UserInputError("--api-key is empty")
    tree_tokens = common.total_tokens
    if tree_tokens == 1:  # plain decoding (--no-speculation, --total-tokens 1): the engine's cycle with a tree of one node
        common.total_tokens = None
    rt = common.load(err)
    if not no_prefix_cache:
        from eagle2_core.prefix import PrefixCache

        rt.prefix_cache = PrefixCache(prefix_cache_mb)
    engine, plan = rt.batch_decoder(64, None if batch_size == "auto" else batch_size, tree_tokens, depth=common.depth,
                                    top_k=common.tree_top_k)
    if engine is None:
        engine = rt.eagle()
    engine.prefill_chunk = prefill_chunk or None
    name = served_model_name or rt.target.name
    app, worker = create_app(rt, engine, model_name=name, api_key=api_key, cors=cors, max_queue=max_queue, max_body_mb=max_body_mb)
    # uvicorn's own deadline comes a little after ours: at --grace the app ends what still runs
    # with a last event each, and uvicorn then only waits for those to be sent
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace + 10, lifespan="on",
                            http=head_timeout_protocol(header_timeout))

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            import asyncio

            asyncio.get_running_loop().call_later(grace, app.state.stopping.set)
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # uvicorn raises a caught signal again once it has shut down, which ends the process
            # by that signal; a graceful stop is what SIGTERM asks for here, so the exit status is 0
            self._captured_signals.clear()
            # past the grace period uvicorn cancels what still runs and logs each as a traceback:
            # expected here, and said in one line at the end instead
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)

    server = Server(config)

    started = server.startup

    async def startup(sockets=None):
        await started(sockets)
        for s in server.servers:
            for sock in s.sockets:
                h, p = sock.getsockname()[:2]
                err.print(f"eagle2 serving {name} on http://{h}:{p}/v1 (batch of {engine.batch}, {engine.label()}"
                          f"{'' if rt.prefix_cache is not None else ', no prefix cache'}); Ctrl-C or SIGTERM stops it",
                          highlight=False, soft_wrap=True)

    server.startup = startup
    server.run()
    if not server.started:  # the port was taken, or the address cannot be bound: uvicorn said why
        raise click.ClickException(f"could not serve on {host}:{port}")
    t = worker.totals
    err.print(f"eagle2 serve: stopped ({t['finished']} requests answered, {t['cancelled']} cancelled)", highlight=False)
