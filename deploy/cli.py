"""The ``lookahead-serve`` command line. It sits above the engine: it knows the gRPC server and client."""

from __future__ import annotations

import argparse
import logging
import sys
import time

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """A flag for every engine config field (deploy.flags), and the log flags."""
    from lookahead_serve.deploy.flags import add_config_flags

    add_config_flags(p, skip)
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="root log level (default: %(default)s)")
    p.add_argument("--log-schedule", action="store_true",
                   help="log every step's tokens, chosen (w,n,g) and predicted vs observed time")


def configure_logging(args: argparse.Namespace) -> None:
    """Root logging to stderr at --log-level; --log-schedule turns the step log on, --disable-log-requests the
    per-request log (logger lookahead_serve.requests, INFO) off."""
    if not hasattr(args, "log_level"):  # the client logs nothing
        return
    logging.basicConfig(format=LOG_FORMAT)  # a no-op when the root logger has handlers already
    logging.getLogger().setLevel(args.log_level.upper())
    if args.log_schedule:
        logging.getLogger("lookahead_serve.schedule").setLevel(logging.INFO)
    if getattr(args, "disable_log_requests", False):
        logging.getLogger("lookahead_serve.requests").setLevel(logging.WARNING)


def model_arg(args: argparse.Namespace) -> str | None:
    """The model: serve's positional MODEL or --model (vLLM takes either); both and different is an error."""
    flag, positional = vars(args)["model.model"], getattr(args, "model_tag", None)
    if flag is not None and positional is not None and flag != positional:
        raise ValueError(f"two models given: {positional!r} (positional) and --model {flag!r}; pass one")
    return positional if positional is not None else flag


def _generate(args: argparse.Namespace) -> int:
    from lookahead_serve.engine import SamplingParams

    llm = _engine_from_args(args)
    prompt = args.prompt
    if not args.raw:
        prompt = llm.engine.chat_prompt([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens)  # lookahead: the engine's default (--lookahead)
    start = time.perf_counter()
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None:
        n = last.num_generated_tokens
        ttft = last.metrics.time_to_first_token or 0.0
        print(
            f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s, {last.tokens_per_step:.2f} tokens/step, "
            f"time to first token {ttft * 1000:.0f} ms, finish: {last.outputs[0].finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _engine_from_args(args: argparse.Namespace):
    from lookahead_serve.deploy.flags import engine_config
    from lookahead_serve.engine import LLM

    return LLM.from_config(engine_config(args, model=model_arg(args)), log_schedule=args.log_schedule)


def _served_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the model's default name (engine.loader.default_served_name)."""
    from lookahead_serve.engine.loader import default_served_name

    return args.served_model_name or default_served_name(model_arg(args))


def _read_pem(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _serve_options(args: argparse.Namespace) -> dict:
    """start_server's keyword arguments from the flags, checked before the model loads."""
    import os

    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be positive, got {args.max_request_bytes}")
    if args.shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
    options = {"max_receive_message_bytes": args.max_request_bytes,
               "api_key": args.api_key or os.environ.get("LOOKAHEAD_API_KEY") or None}
    if args.ssl_certfile is not None:
        options["ssl_cert_pem"] = _read_pem(args.ssl_certfile, "--ssl-certfile")
        options["ssl_key_pem"] = _read_pem(args.ssl_keyfile, "--ssl-keyfile")
    return options


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from lookahead_serve.engine.async_engine import AsyncLLMEngine
    from lookahead_serve.proto.server import serve_forever

    options = _serve_options(args)
    name = _served_name(args)
    llm = _engine_from_args(args)
    engine = AsyncLLMEngine(llm.engine, max_live_requests=args.max_live_requests)
    try:  # SIGTERM and SIGINT drain the server and return; Ctrl-C before it is up lands here
        asyncio.run(serve_forever(engine, name, args.host, args.port, args.metrics_port, http_port=args.http_port,
                                  shutdown_grace=args.shutdown_grace, **options))
    except KeyboardInterrupt:
        engine.shutdown()
    return 0


def _client(args: argparse.Namespace) -> int:
    import os

    import grpc

    from lookahead_serve.proto.convert import to_lookahead_proto
    from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
    from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    if args.raw:
        request.text = args.prompt.encode()
    else:
        request.chat.messages.add(role="user", content=args.prompt)
    if args.seed is not None:
        request.sampling.seed = args.seed
    if args.lookahead is not None:
        request.lookahead.CopyFrom(to_lookahead_proto(args.lookahead))
    api_key = args.api_key or os.environ.get("LOOKAHEAD_API_KEY")
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    if args.ssl_ca_certfile is not None:
        credentials = grpc.ssl_channel_credentials(_read_pem(args.ssl_ca_certfile, "--ssl-ca-certfile"))
        channel = grpc.secure_channel(args.server, credentials)
    else:
        channel = grpc.insecure_channel(args.server)
    start = time.perf_counter()
    with channel:
        try:
            last = None
            stub = pb_grpc.LookaheadServiceStub(channel)
            for chunk in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as e:
            print(f"\nlookahead-serve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None:
        u = last.usage
        print(f"[{u.completion_tokens} tokens in {elapsed:.2f} s: {u.completion_tokens / elapsed:.1f} tokens/s, "
              f"{u.tokens_per_step:.2f} tokens/step, finish: {last.finish_reason}]", file=sys.stderr)
    return 0


def _add_sampling_args(p: argparse.ArgumentParser, lookahead: bool) -> None:
    """The request's flags; ``lookahead``: a per-request --lookahead (the client's; generate sets the engine's)."""
    from lookahead_serve.deploy.flags import lookahead_arg

    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    if lookahead:
        p.add_argument("--lookahead", type=lookahead_arg, default=None, metavar="W,N,G|off",
                       help="lookahead window, n-gram size and verification set size, or off (default: the server's)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookahead-serve", description="LLM serving engine with lookahead decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one answer from the model to the terminal")
    _add_sampling_args(gen, lookahead=False)
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: %(default)s)")
    _add_engine_args(gen, skip=("seed",))  # --seed is the request's
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve the model over gRPC (LookaheadService, health, reflection) and HTTP")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model, as --model (default: the embedded SmolLM2-135M-Instruct)")
    _add_engine_args(srv)
    srv.add_argument("--disable-log-requests", action="store_true",
                     help="no log line per finished request (logger lookahead_serve.requests)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port (default: %(default)s)")
    srv.add_argument("--http-port", type=int, default=8000,
                     help="OpenAI-compatible HTTP API port (default: %(default)s)")
    srv.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    srv.add_argument("--served-model-name", default=None, help="name clients may put in GenerateRequest.model")
    srv.add_argument("--max-live-requests", type=int, default=256,
                     help="requests held at once; more get RESOURCE_EXHAUSTED (default: %(default)s)")
    srv.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                     help="largest request message; larger ones get RESOURCE_EXHAUSTED (default: %(default)s = 4 MiB)")
    srv.add_argument("--shutdown-grace", type=float, default=30.0,
                     help="on SIGTERM/SIGINT, seconds live streams may take to finish before they are ended with "
                          "UNAVAILABLE (default: %(default)s)")
    srv.add_argument("--api-key", default=None,
                     help="require the metadata 'authorization: Bearer KEY' on every LookaheadService call "
                          "(default: env LOOKAHEAD_API_KEY, which keeps the key out of the process list)")
    srv.add_argument("--ssl-certfile", default=None, help="serve TLS with this PEM certificate chain")
    srv.add_argument("--ssl-keyfile", default=None, help="the PEM private key of --ssl-certfile")
    srv.set_defaults(func=_serve)

    cli = sub.add_parser("client", help="stream an answer from a running server")
    _add_sampling_args(cli, lookahead=True)
    cli.add_argument("--server", default="127.0.0.1:50051", help="host:port (default: %(default)s)")
    cli.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds (default: %(default)s)")
    cli.add_argument("--api-key", default=None, help="the server's API key (default: env LOOKAHEAD_API_KEY)")
    cli.add_argument("--ssl-ca-certfile", default=None,
                     help="connect with TLS, trusting this PEM CA (or self-signed server) certificate")
    cli.set_defaults(func=_client)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configure_logging(args)
        return args.func(args)
    except ValueError as e:
        print(f"lookahead-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
