"""`serve`: configure logging, load a model, build the engine and the app, run uvicorn.

Stopping: the first SIGTERM or SIGINT drains (`EngineLoop.drain`: new requests get 503,
`/health` says `draining`, running ones finish within `--drain-timeout`, then the rest are
aborted); the loop ends, uvicorn closes, and the process exits 0. A second SIGINT exits at
once (code 130).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import signal
import sys
import threading

from chunk_llama.server.options import ChatArgs, DeployArgs, ServeArgs
from chunk_llama.settings import EngineArgs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SHUTDOWN_GRACE_S = 5  # uvicorn's wait for open connections once the engine loop has ended
logger = logging.getLogger("chunk_llama.server")


def model_name_for(path: str | None) -> str:
    """The id the server answers to: the model file's or folder's name (a hub id as given),
    or the default model's name."""
    if path is None:
        return DEFAULT_MODEL_NAME
    if os.path.exists(path):
        name = os.path.basename(os.path.normpath(path))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name
    return path


def configure_logging(level: str) -> None:
    """One format (time, level, logger) for the server, the engine, uvicorn and the libraries'
    warnings (`warnings.warn` included), set once at start-up."""
    logging.basicConfig(format=LOG_FORMAT, level=level.upper(), force=True)
    logging.captureWarnings(True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # through the root's handler and format
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`), reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def warn_if_exposed(host: str, keys: list[str]) -> None:
    """Warn when binding to an address others may reach without an API key."""
    if not keys and not is_loopback(host):
        logger.warning("serving on %s without an API key: anyone who reaches this port can use the model; give "
                       "--api-key or --api-key-file, or bind to 127.0.0.1 behind a proxy that authenticates", host)


def serve(engine_args: EngineArgs | None = None, serve_args=None, deploy: DeployArgs | None = None,
          chat: ChatArgs | None = None) -> None:
    """Load the model `engine_args` name (None: the default model, its defaults) and serve it
    as `serve_args` (`options.ServeArgs`: host, port, names and logging), `deploy` (keys,
    limits, timeouts, drain) and `chat` (reasoning and tool-call formats, template defaults, the
    Responses store) say, until a signal drains it (module doc)."""
    import uvicorn

    from chunk_llama.server.app import create_app
    from chunk_llama.server.http import uvicorn_config

    engine_args, args, deploy = engine_args or EngineArgs(), serve_args or ServeArgs(), deploy or DeployArgs()
    configure_logging(args.log_level)
    warn_if_exposed(args.host, deploy.keys())
    model = engine_args.model
    names = args.served_model_name or [model_name_for(model)]
    loaded, tokenizer = engine_args.load()
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        logger.warning("the tokenizer has no chat template: /v1/chat/completions will refuse requests "
                       "(give one with --chat-template)")
    engine = engine_args.build_engine(loaded, tokenizer)
    if tokenizer is not None:  # the first request with a grammar would otherwise wait for it
        try:
            engine.inputs.grammars.prepare()
        except ValueError as error:  # such requests will get this as their 400
            logger.warning("response_format and forced tool calls will be refused: %s", error)
    aliases = tuple(dict.fromkeys([*names[1:], *([model] if model is not None and model not in names else [])]))
    app = create_app(engine, names[0], aliases=aliases, loop_thread=False, allowed_origins=args.allowed_origins,
                     stats_interval=args.stats_interval, worker_id=args.worker_id, deploy=deploy, chat=chat)
    logger.info(engine.describe())
    print(f"serving {names[0]!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # The engine steps in this thread, which made the model's OpenMP teams (see
    # server/loop.py); uvicorn serves from another and ends the loop when it stops.
    loop = app.state.loop
    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           header_timeout=deploy.header_timeout,
                                           keep_alive_timeout=deploy.keep_alive_timeout, log_config=None,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))

    def serve_http():
        try:
            server.run()
        finally:
            loop.stop()

    signals_seen = itertools.count()

    def on_signal(signum, frame):
        # A second signal can run its handler inside this one, at any bytecode: `next` on a
        # count is one C call, so exactly one handler sees 0, and the drain starts before the
        # log line that tells a user (or a test) that a second SIGINT now exits.
        if next(signals_seen) == 0:
            loop.drain(deploy.drain_timeout)
            logger.info("%s: draining; new requests get 503, running ones have %g s to finish",
                        signal.Signals(signum).name, deploy.drain_timeout)
        elif signum == signal.SIGINT:
            print("second interrupt: exiting now", file=sys.stderr, flush=True)
            os._exit(130)

    http = threading.Thread(target=serve_http, name="chunk-llama-http")
    http.start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        loop.run()  # until drained, or stopped because the HTTP server ended
    finally:
        server.should_exit = True
        loop.stop()
        http.join(30)
    if not server.started:
        raise SystemExit(f"the HTTP server did not start on {args.host}:{args.port} (see its log above)")
