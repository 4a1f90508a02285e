"""`kimi-vision batch --task caption|ocr|embed --input FILE.jsonl|DIR|LIST --output OUT.jsonl`

Runs every input line through the model (in this process by default, on a running server with
`--server`, or on Ray actors with `--engine ray`) and writes one line per input to OUT.jsonl, in input
order, in the OpenAI Batch output shape (as vLLM's `run_batch` writes it): `id`, `custom_id`,
`response` (`status_code`, `request_id`, `body`: a `chat.completion`, or for `embed` the
safetensors shard, key, shape and dtype under `OUT.jsonl.embeddings/`), `error` (`code`: the kind,
`message`), and this project's `kimi_vision` (the input `line`, `timings`). `--errors FILE` moves
failed lines there, as OpenAI's Batch API does. The options that change results are kept in
`OUT.jsonl.job.json`; `--resume` continues a stopped or killed job (each input ends up exactly
once) and refuses if those options changed.

Exit status: 0 done; 1 could not run or stopped on an error; 2 bad arguments or input;
75 done but some inputs failed transiently (rerun with --resume); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from service.cli.common import (
    add_image_limit_arguments,
    add_model_arguments,
    add_remote_image_arguments,
    checkpoint_dir,
    image_limits,
    positive_float,
    positive_int,
    remote_image_problem,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit status: 0 done (per-input errors are rows in the output); 1 could not run or stopped on "
                     "an error; 2 bad arguments or input; 75 done but some inputs failed transiently (rerun with "
                     "--resume); 130 interrupted (Ctrl-C; rerun with --resume)")
    parser.add_argument("--task", required=True, choices=("caption", "ocr", "embed"), help="what to compute")
    parser.add_argument("--input", required=True, metavar="FILE.jsonl|DIR|LIST",
                        help="an OpenAI-batch JSONL (custom_id, method, url, body; /v1/chat/completions for "
                             "caption/ocr, /v1/embeddings for embed), a directory (recursive, by image extension) "
                             "or a text file of image paths")
    parser.add_argument("--output", required=True, metavar="OUT.jsonl", help="result lines, in input order")
    parser.add_argument("--errors", metavar="FILE.jsonl",
                        help="write failed lines here instead of OUT.jsonl (as OpenAI's Batch API splits them)")
    parser.add_argument("--server", metavar="HOST:PORT", help="use a running kimi-vision server")
    parser.add_argument("--auth-token", metavar="TOKEN",
                        help="with --server: the bearer token the server requires (default: $KIMI_VISION_AUTH_TOKEN, "
                             "as serve; prefer the variable, flags show in the process list). Sent over gRPC's local "
                             "credentials, so the server must be on this machine; a refused token stops the job")
    add_model_arguments(parser)
    add_image_limit_arguments(parser, note="; not with --server, whose own limits apply (GetModelInfo reports them)")
    parser.add_argument("--concurrency", type=positive_int, metavar="N",
                        help="inputs in flight (default: 2 per encoder worker; 8 with --server; "
                             "with --engine ray: encoder actors when there is no GPU)")
    parser.add_argument("--max-new-tokens", type=positive_int, metavar="N",
                        help="caption/ocr length limit where a line sets no max_tokens (default 64 caption, 512 ocr)")
    parser.add_argument("--prompt", metavar="TEXT",
                        help="replace the task's default prompt (directory and path-list inputs; a JSONL line's "
                             "prompt is its messages)")
    parser.add_argument("--ignore-model", action="store_true",
                        help="run lines whose body.model names another model (default: an error row)")
    add_remote_image_arguments(parser, who="input lines")
    parser.add_argument("--resume", action="store_true",
                        help="continue OUT.jsonl: skip finished inputs, retry transient failures")
    parser.add_argument("--engine", choices=("local", "ray"), default="local", help="local (default) or ray")
    parser.add_argument("--ray-address", metavar="ADDR",
                        help="with --engine ray: an existing cluster (default: start Ray locally)")
    parser.add_argument("--log-every", type=positive_float, default=10.0, metavar="S",
                        help="seconds between progress lines when stderr is not a terminal (default 10)")


def _problem(args: argparse.Namespace) -> str | None:
    if (problem := remote_image_problem(args)) is not None:
        return problem
    if args.auth_token is not None and not args.server:
        return "--auth-token applies to --server (an in-process job needs no token)"
    if args.server and args.engine == "ray":
        return "--server and --engine ray exclude each other (Ray runs the model in its own actors)"
    if args.server and (args.checkpoint or args.devices != "auto"):
        return "--checkpoint and --devices do not apply with --server (the server has its own)"
    if args.server and (args.max_image_mb is not None or args.max_image_megapixels is not None):
        return ("--max-image-mb and --max-image-megapixels do not apply with --server (the job uses the limits "
                "the server reports, those of its own serve flags)")
    if args.engine == "ray" and args.devices != "auto":
        return "--devices does not apply with --engine ray (one model actor per GPU, or --concurrency CPU actors)"
    if args.ray_address and args.engine != "ray":
        return "--ray-address needs --engine ray"
    if args.task == "embed" and (args.prompt is not None or args.max_new_tokens is not None):
        return "--prompt and --max-new-tokens do not apply to --task embed"
    if args.prompt is not None and Path(args.input).suffix.lower() == ".jsonl" and not Path(args.input).is_dir():
        return "--prompt applies to directory and path-list inputs; a JSONL line's prompt is its own messages"
    if args.errors is not None and os.path.abspath(args.errors) == os.path.abspath(args.output):
        return "--errors must be another file than --output"
    return None


def _err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    problem = _problem(args)
    if problem:
        _err(problem)
        return 2

    from service.batch.inputs import InputError, base_dir, load_items
    from service.batch.journal import ResumeRefused
    from service.batch.runner import RunOptions
    from service.batch.spec import JobSpec

    spec = JobSpec(args.task, args.prompt, args.max_new_tokens, ignore_model=args.ignore_model,
                   allow_remote_images=args.allow_remote_images,
                   allowed_media_domains=tuple(args.allowed_media_domains or ()) or None,
                   media_fetch_timeout_s=args.media_fetch_timeout, max_media_fetches=args.max_media_fetches)
    try:
        items = load_items(args.input, spec)
    except InputError as e:
        _err(str(e))
        return 2
    output = Path(args.output)
    errors = None if args.errors is None else Path(args.errors)
    options = RunOptions(log_every_s=args.log_every)
    try:
        if args.engine == "ray":
            from service.batch.ray_engine import run_ray_job

            summary = run_ray_job(spec, items, output, resume=args.resume, checkpoint=checkpoint_dir(args.checkpoint),
                                  base_dir=base_dir(args.input), errors=errors, concurrency=args.concurrency,
                                  address=args.ray_address, options=options, limits=image_limits(args))
        else:
            summary = asyncio.run(_run_local(args, spec, items, output, errors, options))
    except ResumeRefused as e:
        _err(str(e))
        return 1
    except _CannotRun as e:
        _err(str(e))
        return 1
    print(summary.line(output, errors), flush=True)
    note = _random_weights_note(args, summary)
    if note:
        print(note, flush=True)
    return summary.exit_code


class _CannotRun(Exception):
    pass


async def _run_local(args: argparse.Namespace, spec, items, output, errors, options):
    from service.batch.backends import EngineBackend, ServerBackend
    from service.batch.inputs import base_dir
    from service.batch.journal import check, errors_name
    from service.batch.runner import Job
    from service.engine.identity import checkpoint_fingerprint
    from service.errors import ServiceError
    from vision.checkpoint import CheckpointError

    if args.server:
        try:
            backend = await ServerBackend.connect(args.server, token=_server_token(args))
        except (ServiceError, ValueError) as e:  # ValueError: AuthConfigError
            raise _CannotRun(str(e)) from None
        options.concurrency = args.concurrency or 8
    else:
        checkpoint = checkpoint_dir(args.checkpoint)
        if not checkpoint.is_dir():
            raise _CannotRun(f"--checkpoint {checkpoint}: not a directory")
        # Refuse a mismatched resume before spending minutes loading the model.
        fingerprint = spec.fingerprint(checkpoint_fingerprint(checkpoint), errors_name(output, errors))
        check(output, fingerprint, resume=args.resume, errors=errors)
        try:
            backend = await asyncio.get_running_loop().run_in_executor(
                None, lambda: EngineBackend.load(checkpoint, args.devices, trunk=spec.task != "embed",
                                                 limits=image_limits(args)))
        except (CheckpointError, ServiceError, ValueError, OSError, RuntimeError) as e:
            raise _CannotRun(f"cannot load the model from {checkpoint}: {e}") from None
        options.concurrency = args.concurrency or 2 * len(backend.engine.devices)
    print(f"batch {spec.task}: {len(items)} inputs on {backend.description}", file=sys.stderr, flush=True)
    try:
        job = Job(spec, items, output, backend, resume=args.resume, base_dir=base_dir(args.input), errors=errors,
                  options=options)
        summary = await job.run()
    finally:
        await backend.close()
    if summary.aborted:
        _err(summary.aborted)
    return summary


def _server_token(args: argparse.Namespace) -> str | None:
    """The token for --server (the flag, else the variable serve reads), or None; a token goes
    only to a server on this machine (batch has no TLS: it is never sent in plaintext over a network)."""
    import ipaddress

    from service.auth import resolve_token

    token = resolve_token(args.auth_token)
    if token is None:
        return None
    host = args.server.rpartition(":")[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"a token is only sent to a server on this machine (127.0.0.1, ::1, localhost), not to "
                         f"{host!r}: the job has no TLS, and the token would cross the network in plaintext")
    return token


def _random_weights_note(args: argparse.Namespace, summary) -> str | None:
    """Say so when the text came from the embedded default's random weights."""
    if summary.task == "embed" or args.checkpoint:
        return None
    if args.server:
        return ("note: if the server runs the embedded default checkpoint, its weights are random and the "
                "captions/OCR text are gibberish (expected)")
    return ("note: the embedded default checkpoint has random weights, so the captions/OCR text are gibberish "
            "(expected); pass --checkpoint for a real model")
