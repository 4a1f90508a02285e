"""`kimi-vision serve`: run the gRPC service (and, with `--http-port`, the OpenAI-compatible HTTP
face) until SIGTERM (which drains both) or Ctrl-C."""

from __future__ import annotations

import argparse
import sys

from service.cli.common import (
    add_image_limit_arguments,
    add_model_arguments,
    add_vllm_arguments,
    checkpoint_dir,
    image_limits,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--components", choices=("all", "vision"), default="all",
                        help="all (default): tokenizer, vision tower, projector and trunk; vision: no trunk is "
                             "loaded (a vision frontend: everything but generation)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 = any free port)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics on this port, at /metrics (0 = any free port)")
    parser.add_argument("--health-port", type=int, metavar="PORT",
                        help="also serve the gRPC health service alone on this port, plaintext and without the "
                             "token, for Kubernetes' gRPC probes when the main port has TLS or a token "
                             "(0 = any free port)")
    parser.add_argument("--max-concurrency", type=int, default=4, metavar="N",
                        help="requests doing image work at once (Preprocess, CountTokens, Embed, Encode; a "
                             "generation takes no slot: the trunk's scheduler runs generations together); default 4")
    parser.add_argument("--max-queue", type=int, default=32, metavar="N",
                        help="more requests admitted beyond those slots, generations included; beyond that "
                             "RESOURCE_EXHAUSTED (default 32)")
    parser.add_argument("--max-num-seqs", type=int, default=32, metavar="N",
                        help="sequences the trunk decodes together in one batch (a request's n counts n; 1: one "
                             "sequence at a time); default 32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="N",
                        help="tokens per trunk step: one per running sequence, the rest for prefill chunks, so a "
                             "long prompt is prefilled over several steps (>= --max-num-seqs); default 512")
    parser.add_argument("--kv-cache-memory-gb", type=float, metavar="GB",
                        help="KV cache budget (GiB): a generation starts when its worst-case cache (n x (prompt + "
                             "max_tokens) tokens) fits beside the running ones, otherwise it waits; default: a "
                             "quarter of the trunk device's memory (CUDA: free after loading; CPU: physical)")
    parser.add_argument("--max-message-mb", type=int, default=64, metavar="MB",
                        help="largest request message, all its images together (default 64)")
    add_image_limit_arguments(parser, bounded_by="--max-message-mb")
    parser.add_argument("--max-images", type=int, default=16, metavar="N", help="images per request (default 16)")
    parser.add_argument("--cache-mb", type=int, default=1024, metavar="MB",
                        help="embedding cache budget (default 1024; 0 disables)")
    parser.add_argument("--ec-export-dir", metavar="DIR",
                        help="allow Encode(export_vllm_ec) to write vLLM encoder-cache files under DIR")
    parser.add_argument("--ec-role", choices=("producer",),
                        help="producer: every HTTP chat completion's images are written under --ec-export-dir "
                             "(named as vLLM looks them up) before the reply; max_tokens 1 skips the trunk")
    parser.add_argument("--http-port", type=int, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /health, "
                             "/v1/models) on this port (0 = any free port)")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="let HTTP requests name http(s) image URLs, which the server then fetches "
                             "(10 s timeout, the per-image byte limit, 3 redirects)")
    parser.add_argument("--served-model-name", action="append", metavar="NAME",
                        help="a name requests may give as `model` (repeatable; default: the vLLM model id)")
    add_vllm_arguments(parser)
    parser.add_argument("--drain-seconds", type=float, default=30.0, metavar="S",
                        help="on SIGTERM, how long in-flight requests may finish (default 30)")
    parser.add_argument("--auth-token", metavar="TOKEN",
                        help="require 'authorization: Bearer TOKEN' on every RPC except health (default: "
                             "$KIMI_VISION_AUTH_TOKEN; prefer the variable, flags show in the process list)")
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (needs --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", help="the TLS private key (needs --tls-cert)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text (default): one line per record; json: one JSON object per line")
    parser.add_argument("--log-health-checks", action="store_true",
                        help="write an access-log line for every health check too (default: not logged)")
    parser.add_argument("--otlp-endpoint", metavar="URL",
                        help="export OpenTelemetry traces over OTLP/gRPC to this collector (http://host:4317); "
                             "needs the otel extra (default: tracing off)")


def _problem(args: argparse.Namespace) -> str | None:
    for name in ("max_concurrency", "max_message_mb", "max_images", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    if args.max_num_batched_tokens < args.max_num_seqs:
        return (f"--max-num-batched-tokens {args.max_num_batched_tokens} is below --max-num-seqs {args.max_num_seqs}: "
                "every running sequence takes a token of each step")
    if args.kv_cache_memory_gb is not None and not args.kv_cache_memory_gb > 0:
        return f"--kv-cache-memory-gb must be > 0, got {args.kv_cache_memory_gb}"
    if args.max_image_mb is not None and args.max_image_mb > args.max_message_mb:
        return (f"--max-image-mb {args.max_image_mb} is larger than --max-message-mb {args.max_message_mb}: every "
                "image travels inside one request message; raise --max-message-mb or lower --max-image-mb")
    if args.max_queue < 0 or args.cache_mb < 0 or not 0 <= args.port <= 65535:
        return "--max-queue and --cache-mb must be >= 0 and --port in 0..65535"
    for name in ("http_port", "health_port", "metrics_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 65535:
            return f"--{name.replace('_', '-')} must be in 0..65535, got {value}"
    if args.ec_role == "producer" and not args.ec_export_dir:
        return "--ec-role producer needs --ec-export-dir (where the encoder-cache files go)"
    if args.ec_role == "producer" and args.http_port is None:
        return "--ec-role producer needs --http-port (vLLM's proxy calls the encoder over HTTP)"
    return None


def _security(args: argparse.Namespace) -> tuple[tuple, object | None, str | None]:
    """(interceptors, TLS server credentials or None, the token or None) from the flags; ValueError
    names a problem."""
    from service.auth import resolve_token
    from service.rpc.auth import BearerTokenInterceptor
    from service.rpc.proto_guard import MalformedRequestInterceptor
    from service.rpc.tls import server_credentials, tls_paths

    token = resolve_token(args.auth_token)
    paths = tls_paths(args.tls_cert, args.tls_key)
    credentials = server_credentials(*paths) if paths else None
    # In order (after the server's own observer, which logs and counts refused calls too): the
    # token check (before any request byte is parsed), then the parse itself (corrupt protobuf ->
    # INVALID_ARGUMENT).
    auth = (BearerTokenInterceptor(token),) if token else ()
    interceptors = (*auth, MalformedRequestInterceptor())
    return interceptors, credentials, token


def run(args: argparse.Namespace) -> int:
    problem = _problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        interceptors, credentials, token = _security(args)
    except ValueError as exc:  # AuthConfigError, TLSConfigError
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import asyncio

    from service import tracing
    from service.engine import EngineConfig
    from service.http.app import HttpConfig
    from service.logs import ServerLog
    from service.rpc.server import GrpcConfig
    from service.server import ServerConfig, VisionServer, serve

    if args.otlp_endpoint:
        try:
            tracing.configure(args.otlp_endpoint)
        except tracing.TracingUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    def announce(server: VisionServer) -> None:
        ports = (("http", server.http_port), ("health", server.health_port), ("metrics", server.metrics_port))
        more = "".join(f"; {name} on {args.host}:{port}" for name, port in ports if port is not None)
        print(f"kimi-vision: serving on {args.host}:{server.port} (health SERVING){more}", flush=True)

    # Before anything else is said (building the default checkpoint included), so all of it is in
    # the log's format; written off the event loop: a stuck log reader never stalls requests.
    server_log = ServerLog(log_format=args.log_format)
    try:
        config = ServerConfig(
            host=args.host, port=args.port, http_port=args.http_port, health_port=args.health_port,
            metrics_port=args.metrics_port, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
            drain_grace_s=args.drain_seconds, log_health_checks=args.log_health_checks,
            grpc=GrpcConfig(max_receive_bytes=args.max_message_mb << 20, credentials=credentials,
                            interceptors=interceptors),
            http=HttpConfig(max_body_bytes=args.max_message_mb << 20, token=token,
                            allow_remote_images=args.allow_remote_images, ec_producer=args.ec_role == "producer",
                            tls_files=(args.tls_cert, args.tls_key) if credentials else None),
        )
        engine_config = EngineConfig(
            checkpoint=checkpoint_dir(args.checkpoint), devices=args.devices, components=args.components,
            limits=image_limits(args, max_mb=args.max_message_mb), max_images=args.max_images,
            cache_bytes=args.cache_mb << 20, ec_export_dir=args.ec_export_dir, model_id=args.vllm_model_id,
            served_model_names=tuple(args.served_model_name or ()), hash_algorithm=args.mm_hasher_algorithm,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=None if args.kv_cache_memory_gb is None else max(1, int(args.kv_cache_memory_gb * 2**30)),
        )
        return asyncio.run(serve(config, engine_config, on_ready=announce))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()  # the spans still queued go out first
        server_log.close()
