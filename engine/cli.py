"""The ``lookahead-serve`` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype; auto = bfloat16 on CUDA and on CPUs with native bf16 "
                        "(avx512_bf16 or AMX), else float32 (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output token cap (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV cache size (default: %(default)s)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "sdpa", "invariant"],
                   help="auto = invariant in bfloat16/float16 (a token's bits never depend on its batch), sdpa in "
                        "float32; torch = the log-sum-exp split reference (default: %(default)s)")
    p.add_argument("--lookahead-policy", default="adaptive", choices=["fixed", "adaptive"],
                   help="fixed: every request runs its (W,N,G); adaptive: each step picks (w,n,g) up to it from a "
                        "step-cost model profiled once per machine and cached (default: %(default)s)")
    p.add_argument("--lookahead-objective", choices=["throughput", "makespan"], default=None,
                   help="what the adaptive policy maximises: throughput (tokens per second; the default for serve) "
                        "or makespan (the whole batch done soonest; the default for generate)")
    p.add_argument("--log-schedule", action="store_true",
                   help="log every step's tokens, chosen (w,n,g) and predicted vs observed time")


def _lookahead(text: str):
    from engine import LookaheadParams

    if text == "off":
        return LookaheadParams(enabled=False)
    try:
        w, n, g = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected off or W,N,G (e.g. 7,5,7), got {text!r}") from None
    try:
        return LookaheadParams(w, n, g)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _generate(args: argparse.Namespace) -> int:
    from engine import SamplingParams

    llm = _engine_from_args(args, "makespan")
    prompt = args.prompt
    if not args.raw:
        prompt = llm.engine.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, lookahead=args.lookahead)
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


def _engine_from_args(args: argparse.Namespace, objective: str):
    """objective: the --lookahead-objective to use when the flag is not given."""
    from engine import LLM

    if args.log_schedule:
        import logging

        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("engine.schedule").setLevel(logging.INFO)
    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
               kv_cache_memory_gib=args.kv_cache_memory_gib, attention_backend=args.attention_backend,
               lookahead_policy=args.lookahead_policy, lookahead_objective=args.lookahead_objective or objective,
               log_schedule=args.log_schedule)


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
    import os

    from engine.async_engine import AsyncLLMEngine
    from engine.loader import DEFAULT_MODEL_NAME
    from proto.server import serve_forever

    options = _serve_options(args)
    llm = _engine_from_args(args, "throughput")  # requests come and go: every token counts alike
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else os.path.basename(os.path.normpath(args.model)))
    engine = AsyncLLMEngine(llm.engine, max_live_requests=args.max_live_requests)
    try:  # SIGTERM and SIGINT drain the server and return; Ctrl-C before it is up lands here
        asyncio.run(serve_forever(engine, name, args.host, args.port, args.metrics_port,
                                  shutdown_grace=args.shutdown_grace, **options))
    except KeyboardInterrupt:
        engine.shutdown()
    return 0


def _client(args: argparse.Namespace) -> int:
    import os

    import grpc

    from proto.lookahead.v1 import lookahead_pb2 as pb
    from proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    if args.raw:
        request.text = args.prompt.encode()
    else:
        request.chat.messages.add(role="user", content=args.prompt)
    if args.seed is not None:
        request.sampling.seed = args.seed
    if args.lookahead is not None:
        la = args.lookahead
        request.lookahead.CopyFrom(pb.LookaheadParams(enabled=not la.is_plain, window_size=la.window_size,
                                                      ngram_size=la.ngram_size, verification_set_size=la.verification_set_size))
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


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--lookahead", type=_lookahead, default=None, metavar="W,N,G|off",
                   help="lookahead window, n-gram size and verification set size, or off (default: the engine's, 5,3,5)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookahead-serve", description="LLM serving engine with lookahead decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one answer from the model to the terminal")
    _add_sampling_args(gen)
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: %(default)s)")
    _add_engine_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve the model over gRPC (LookaheadService, health, reflection)")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port (default: %(default)s)")
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
    _add_sampling_args(cli)
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
        return args.func(args)
    except ValueError as e:
        print(f"lookahead-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
