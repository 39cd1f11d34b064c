"""`make run`: start the server on the default model (gRPC and the OpenAI-compatible HTTP API), wait until
it is healthy, stream one demo answer through the real client, then keep serving until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

BIN = os.path.join(os.path.dirname(sys.executable), "lookahead-serve")


def wait_healthy(target: str, server: subprocess.Popen, timeout: float) -> None:
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with code {server.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service="lookahead.v1.LookaheadService"), timeout=1)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    print(f"[run] server healthy after {time.monotonic() - start:.1f} s", flush=True)
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() - start > timeout:
                raise SystemExit(f"the server was not healthy after {timeout:.0f} s")
            time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--no-wait", action="store_true", help="stop the server after the demo answer")
    args = ap.parse_args()
    target = f"{args.host}:{args.port}"
    print(f"[run] starting lookahead-serve on {target} (the first start converts the model once, ~20 s)", flush=True)
    server = subprocess.Popen([BIN, "serve", "--host", args.host, "--port", str(args.port),
                               "--http-port", str(args.http_port)])
    try:
        wait_healthy(target, server, args.startup_timeout)
        print(f"[run] demo request: {args.prompt!r}", flush=True)
        subprocess.run([BIN, "client", args.prompt, "--server", target, "--max-tokens", str(args.max_tokens)], check=False)
        if args.no_wait:
            return 0
        print(f"[run] serving gRPC on {target} and the OpenAI API on http://{args.host}:{args.http_port}/v1; try "
              f"`.venv/bin/lookahead-serve client \"Hello\"` or `curl http://{args.host}:{args.http_port}/v1/models`; "
              "Ctrl-C stops it", flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    sys.exit(main())
