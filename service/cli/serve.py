"""`kimi-vision serve`: run the gRPC service (and, with `--http-port`, the OpenAI-compatible HTTP
face) until SIGTERM (which drains both) or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from service.cli.common import (
    add_image_limit_arguments,
    add_model_arguments,
    add_remote_image_arguments,
    add_vllm_arguments,
    checkpoint_dir,
    config_default,
    image_limits,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    remote_image_problem,
)

if TYPE_CHECKING:
    from service.logs import ServerLog

log = logging.getLogger("kimi_vision.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every default below is the config's own (`config_default`), so the help shows what runs.
    from service.engine.config import CLIENT_UUIDS, COMPONENTS, EngineConfig
    from service.http.app import HttpConfig
    from service.rpc.server import GrpcConfig
    from service.server import ServerConfig

    engine, server = EngineConfig, ServerConfig
    add_model_arguments(parser)
    parser.add_argument("--components", choices=COMPONENTS, default=config_default(engine, "components"),
                        help="all (default): tokenizer, vision tower, projector and trunk; vision: no trunk is "
                             "loaded (a vision frontend: everything but generation)")
    host, port = config_default(server, "host"), config_default(server, "port")
    parser.add_argument("--host", default=host, help=f"address to listen on (default {host})")
    parser.add_argument("--port", type=port_number, default=port, help=f"port (default {port}; 0 = any free port)")
    parser.add_argument("--metrics-port", type=port_number, metavar="PORT",
                        help="serve Prometheus metrics on this port, at /metrics (0 = any free port)")
    parser.add_argument("--health-port", type=port_number, metavar="PORT",
                        help="also serve the gRPC health service alone on this port, plaintext and without the "
                             "token, for Kubernetes' gRPC probes when the main port has TLS or a token "
                             "(0 = any free port)")
    parser.add_argument("--threads-per-worker", type=positive_int, metavar="N",
                        help="torch and OpenCV threads in each encoder worker (default: the CPUs this process may "
                             "use, affinity and cgroup quota, split between the workers)")
    value = config_default(server, "max_concurrency")
    parser.add_argument("--max-concurrency", type=positive_int, default=value, metavar="N",
                        help="requests doing image work at once (Preprocess, CountTokens, Embed, Encode; a "
                             "generation takes no slot: the trunk's scheduler runs generations together); "
                             f"default {value}")
    value = config_default(server, "max_queue")
    parser.add_argument("--max-queue", type=non_negative_int, default=value, metavar="N",
                        help="more requests admitted beyond those slots, generations included; beyond that "
                             f"RESOURCE_EXHAUSTED (default {value})")
    value = config_default(engine, "max_num_seqs")
    parser.add_argument("--max-num-seqs", type=positive_int, default=value, metavar="N",
                        help="sequences the trunk decodes together in one batch (a request's n counts n; 1: one "
                             f"sequence at a time); default {value}")
    value = config_default(engine, "max_num_batched_tokens")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=value, metavar="N",
                        help="tokens per trunk step: one per running sequence, the rest for prefill chunks, so a "
                             "long prompt is prefilled over several steps (while sequences run, a chunk token also "
                             f"counts the earlier tokens its attention reads) (>= --max-num-seqs); default {value}")
    parser.add_argument("--kv-cache-memory-gb", type=positive_float, metavar="GB",
                        help="KV cache budget (GiB): a generation starts when its worst-case cache (n x (prompt + "
                             "max_tokens) tokens) fits beside the running ones, otherwise it waits; default: a "
                             "quarter of the trunk device's memory (CUDA: free after loading; CPU: physical, or the "
                             "cgroup's memory limit when lower)")
    value = config_default(GrpcConfig, "max_receive_bytes") >> 20
    parser.add_argument("--max-message-mb", type=positive_int, default=value, metavar="MB",
                        help=f"largest request message, all its images together (default {value})")
    add_image_limit_arguments(parser, bounded_by="--max-message-mb")
    value = config_default(engine, "max_images")
    parser.add_argument("--max-images", type=positive_int, default=value, metavar="N",
                        help=f"images (media items) per request (default {value})")
    parser.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="prompt tokens (images counted from their headers) plus max_tokens, per request, as "
                             "vLLM's flag; over it a request is refused before any pixel is decoded; max_tokens "
                             "absent means what the prompt leaves (default: the checkpoint's "
                             "max_position_embeddings)")
    value = config_default(engine, "cache_bytes") >> 20
    parser.add_argument("--cache-mb", type=non_negative_int, default=value, metavar="MB",
                        help=f"embedding cache budget (default {value}; 0 disables)")
    parser.add_argument("--ec-export-dir", metavar="DIR",
                        help="the encoder-cache store: vLLM encoder-cache files under DIR, which several instances "
                             "may share (a shared file system): an image is looked up there before it is encoded, "
                             "encoded by one instance at a time, and written there (rows in bf16); "
                             "Encode(export_vllm_ec) and --ec-role producer answer with its files; see docs/EPD.md")
    value = config_default(engine, "ec_lease_seconds")
    parser.add_argument("--ec-lease-seconds", type=positive_float, metavar="S",
                        help="how long an instance's claim on an image it encodes for the store lives; the others "
                             "wait for its file meanwhile, and take the claim over once it expires (an instance "
                             f"that died) (default {value:g})")
    parser.add_argument("--ec-store-max-gb", type=positive_float, metavar="GB",
                        help="bound the store (GiB of entries): after a write, least recently used entries are "
                             "evicted until the rest fit (default: unbounded)")
    value = config_default(engine, "ec_store_min_age_s")
    parser.add_argument("--ec-store-min-age", type=non_negative_float, metavar="S",
                        help="an entry younger than this is never evicted, so a decoder just told of a file finds "
                             f"it (default {value:g})")
    value = config_default(engine, "ec_client_uuids")
    parser.add_argument("--ec-client-uuids", choices=CLIENT_UUIDS, default=value,
                        help="which item uuids may name an exported file (a uuid is the file's key, shared by "
                             "every client; an existing file is never replaced, the first writer's stays): accept: "
                             "any of 1-128 letters, digits, '_', '-', where one shaped like a content hash (64 or "
                             "128 hex digits) must be the item's own (its vLLM mm_hash or the sha256 of its URL); "
                             "content: only the item's own content key, so no client can take a key another "
                             "client's image will be loaded by (vLLM's EPD proxy sends such keys: it keeps "
                             f"working); other uuids are 400 (default {value}; see docs/EPD.md)")
    parser.add_argument("--ec-role", choices=("producer",),
                        help="producer (vLLM's EPD encoder): every HTTP chat completion is an encode request: its "
                             "images are written under --ec-export-dir (named as vLLM looks them up), and the "
                             "reply has no completion tokens; see docs/EPD.md")
    parser.add_argument("--http-port", type=port_number, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /health, "
                             "/v1/models) and, without --epd-port, SGLang's encoder protocol (/encode, "
                             "/scheduler_receive_url, ...) on this port (0 = any free port)")
    parser.add_argument("--epd-port", type=port_number, metavar="PORT",
                        help="serve SGLang's encoder protocol (/encode, /scheduler_receive_url, /send, "
                             "/scheduler_receive_meta_data, /health_generate, and /health) on this port instead of "
                             "--http-port (which then answers 404 there), so the OpenAI API can face clients "
                             "while these routes, which take no token, face only the language servers "
                             "(0 = any free port); see docs/EPD.md")
    parser.add_argument("--epd-host", metavar="HOST",
                        help="address --epd-port listens on, e.g. the cluster network's (default: --host)")
    parser.add_argument("--epd-allowed-destinations", action="append", metavar="LIST",
                        help="where SGLang's pushes may connect (an /encode's or gRPC Encode's prefill_host:"
                             "embedding_port, a registered receive_url): a comma list (repeatable) of `peer` (the "
                             "address of the HTTP or gRPC caller naming or registering it), IP addresses, CIDRs "
                             "and host names (resolved at start), each with an optional :PORT or :LOW-HIGH ([v6]:PORT "
                             "for IPv6); anything else is refused (400; INVALID_ARGUMENT) before any connection, and "
                             "so is any of this server's own listening ports. Default: peer (a single node, or "
                             "language servers that name their own host, as SGLang's do)")
    parser.add_argument("--register-vllm-proxy", action="append", metavar="URL",
                        help="once serving, join this vLLM EPD proxy (run with --dynamic-registration) as an encode "
                             "instance: POST URL/instances with X-API-Key $ADMIN_API_KEY, again every 30 s (a "
                             "restarted proxy refills); DELETE at the start of a drain. Repeatable; needs --ec-role "
                             "producer; see docs/EPD.md")
    parser.add_argument("--register-sglang-bootstrap", action="append", metavar="URL",
                        help="once serving, join this SGLang encoder bootstrap server (the language side's "
                             "--encoder-bootstrap-port, http://HOST:8997): POST URL/register_encoder_url (again "
                             "every 30 s), DELETE URL/unregister_encoder_url at the start of a drain. Repeatable")
    parser.add_argument("--advertise-host", metavar="HOST",
                        help="the address or DNS name the --register-* flags announce this encoder by (default: "
                             "--host, or --epd-host for SGLang's routes; needed when that is a wildcard such as "
                             "0.0.0.0)")
    add_remote_image_arguments(parser, who="HTTP requests and SGLang's gRPC Encode")
    value = config_default(server, "max_bodies_in_flight")
    parser.add_argument("--max-bodies-in-flight", type=positive_int, default=value, metavar="N",
                        help="HTTP request bodies being read at once (each request takes its --max-queue place "
                             f"first; the others wait there) (default {value})")
    value = config_default(HttpConfig, "header_timeout_s")
    parser.add_argument("--http-header-timeout", type=positive_float, default=value, metavar="S",
                        help="seconds an HTTP connection has for its request line and headers, else 408 and "
                             f"closed (default {value:g})")
    value = config_default(HttpConfig, "body_timeout_s")
    parser.add_argument("--http-body-timeout", type=positive_float, default=value, metavar="S",
                        help="seconds an HTTP request body has to arrive once its reading starts, else 408 and "
                             f"closed (default {value:g})")
    value = config_default(HttpConfig, "max_header_bytes") >> 10
    parser.add_argument("--max-header-kb", type=positive_int, default=value, metavar="KB",
                        help=f"an HTTP request line and headers together, in KiB; larger is 431 (default {value})")
    parser.add_argument("--served-model-name", action="append", metavar="NAME",
                        help="a name requests may give as `model` (repeatable; default: the vLLM model id)")
    add_vllm_arguments(parser)
    value = config_default(server, "drain_grace_s")
    parser.add_argument("--drain-seconds", type=float, default=value, metavar="S",
                        help=f"on SIGTERM, how long in-flight requests may finish (default {value:g})")
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
    if args.max_num_batched_tokens < args.max_num_seqs:
        return (f"--max-num-batched-tokens {args.max_num_batched_tokens} is below --max-num-seqs {args.max_num_seqs}: "
                "every running sequence takes a token of each step")
    if args.max_image_mb is not None and args.max_image_mb > args.max_message_mb:
        return (f"--max-image-mb {args.max_image_mb} is larger than --max-message-mb {args.max_message_mb}: every "
                "image travels inside one request message; raise --max-message-mb or lower --max-image-mb")
    if (problem := remote_image_problem(args)) is not None:
        return problem
    if args.max_model_len is not None and args.max_model_len < 2:
        return f"--max-model-len must be >= 2 (a prompt token and a new one), got {args.max_model_len}"
    store_flags = {"--ec-lease-seconds": args.ec_lease_seconds, "--ec-store-max-gb": args.ec_store_max_gb,
                   "--ec-store-min-age": args.ec_store_min_age}
    if not args.ec_export_dir and (given := [flag for flag, value in store_flags.items() if value is not None]):
        return f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --ec-export-dir (the store they are about)"
    if args.ec_role == "producer" and not args.ec_export_dir:
        return "--ec-role producer needs --ec-export-dir (where the encoder-cache files go)"
    if args.epd_host is not None and args.epd_port is None:
        return "--epd-host needs --epd-port (the listener it places)"
    if args.ec_role == "producer" and args.http_port is None:
        return "--ec-role producer needs --http-port (vLLM's proxy calls the encoder over HTTP)"
    if args.register_vllm_proxy and args.ec_role != "producer":
        return "--register-vllm-proxy needs --ec-role producer (what vLLM's proxy calls an encode instance for)"
    if args.register_sglang_bootstrap and args.http_port is None and args.epd_port is None:
        return "--register-sglang-bootstrap needs --http-port or --epd-port (where SGLang's encoder routes are)"
    return None


def _security(args: argparse.Namespace) -> tuple[tuple, object | None, str | None]:
    """(interceptors, TLS server credentials or None, the token or None) from the flags; ValueError
    names a problem."""
    from service.auth import resolve_token
    from service.rpc.auth import BearerTokenInterceptor
    from service.rpc.tls import server_credentials, tls_paths

    token = resolve_token(args.auth_token)
    paths = tls_paths(args.tls_cert, args.tls_key)
    credentials = server_credentials(*paths) if paths else None
    # After the server's own observer (which logs and counts refused calls too) and before its
    # protobuf guard: a refused token never has a request byte parsed.
    interceptors = (BearerTokenInterceptor(token),) if token else ()
    return interceptors, credentials, token


def run(args: argparse.Namespace) -> int:
    from service.logs import ServerLog

    # Before anything else is said (a usage error, building the default checkpoint included), so all
    # of it is in the log's format; written off the event loop: a stuck log reader never stalls requests.
    server_log = ServerLog(log_format=args.log_format)
    try:
        return _run(args, server_log)
    finally:
        server_log.close()


def _run(args: argparse.Namespace, server_log: ServerLog) -> int:
    problem = _problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        interceptors, credentials, token = _security(args)
    except ValueError as exc:  # AuthConfigError, TLSConfigError
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from service.epd.destinations import DEFAULT, DestinationRule
    from service.epd.membership import ADMIN_KEY_ENV, MembershipConfig

    try:
        destinations = DestinationRule.parse(args.epd_allowed_destinations or DEFAULT)
        membership = MembershipConfig.parse(
            vllm_proxies=args.register_vllm_proxy or (), sglang_bootstraps=args.register_sglang_bootstrap or (),
            advertise_host=args.advertise_host, host=args.host,
            epd_host=args.epd_host,
            admin_key=os.environ.get(ADMIN_KEY_ENV))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import asyncio

    import torch

    from service import tracing
    from service.cpus import cpu_budget
    from service.engine import EngineConfig
    from service.http.app import HttpConfig
    from service.rpc.server import GrpcConfig
    from service.server import ServerConfig, VisionServer, serve

    if args.otlp_endpoint:
        try:
            tracing.configure(args.otlp_endpoint)
        except tracing.TracingUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    # This process's torch threads follow the CPUs it may use (torch's own default counts the
    # affinity mask, not a container's quota), unless OMP_NUM_THREADS says; a CPU trunk takes what
    # the CPU encoder workers leave (Engine.load).
    cpus = cpu_budget()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpus.usable)
    log.info("CPUs: %s", cpus)

    def announce(server: VisionServer) -> None:
        ports = (("http", args.host, server.http_port), ("epd", args.epd_host or args.host, server.epd_port),
                 ("health", args.host, server.health_port), ("metrics", args.host, server.metrics_port))
        more = "".join(f"; {name} on {host}:{port}" for name, host, port in ports if port is not None)
        server_log.announce(f"kimi-vision: serving on {args.host}:{server.port} (health SERVING){more}")

    try:
        config = ServerConfig(
            host=args.host, port=args.port, http_port=args.http_port, epd_port=args.epd_port,
            epd_host=args.epd_host, epd_destinations=destinations, health_port=args.health_port,
            metrics_port=args.metrics_port, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
            max_bodies_in_flight=args.max_bodies_in_flight, drain_grace_s=args.drain_seconds,
            log_health_checks=args.log_health_checks, membership=membership,
            grpc=GrpcConfig(max_receive_bytes=args.max_message_mb << 20, credentials=credentials,
                            interceptors=interceptors),
            http=HttpConfig(max_body_bytes=args.max_message_mb << 20, max_header_bytes=args.max_header_kb << 10,
                            header_timeout_s=args.http_header_timeout, body_timeout_s=args.http_body_timeout,
                            token=token, allow_remote_images=args.allow_remote_images,
                            allowed_media_domains=tuple(args.allowed_media_domains or ()) or None,
                            media_fetch_timeout_s=args.media_fetch_timeout, max_media_fetches=args.max_media_fetches,
                            ec_producer=args.ec_role == "producer",
                            tls_files=(args.tls_cert, args.tls_key) if credentials else None),
        )
        engine_config = EngineConfig(
            checkpoint=checkpoint_dir(args.checkpoint), devices=args.devices, components=args.components,
            threads_per_worker=args.threads_per_worker,
            limits=image_limits(args, max_mb=args.max_message_mb), max_images=args.max_images,
            cache_bytes=args.cache_mb << 20, ec_export_dir=args.ec_export_dir,
            **{name: value for name, value in (("ec_lease_seconds", args.ec_lease_seconds),
                                               ("ec_store_min_age_s", args.ec_store_min_age)) if value is not None},
            ec_store_max_bytes=None if args.ec_store_max_gb is None else max(1, int(args.ec_store_max_gb * 2**30)),
            ec_client_uuids=args.ec_client_uuids, model_id=args.vllm_model_id,
            served_model_names=tuple(args.served_model_name or ()), hash_algorithm=args.mm_hasher_algorithm,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=None if args.kv_cache_memory_gb is None else max(1, int(args.kv_cache_memory_gb * 2**30)),
        )
        return asyncio.run(serve(config, engine_config, on_ready=announce))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()  # the spans still queued go out first
