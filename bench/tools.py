"""Benchmark: the tools users run against an OpenAI-compatible server, NVIDIA's `aiperf` (0.13) and
`guidellm` (0.8), against a real `kimi-vision serve --http-port` on 127.0.0.1.

    python -m bench.tools [--aiperf PATH] [--guidellm PATH] [--requests 32] [--prompt-tokens 64]
                          [--output-tokens 32] [--image 256] [--workloads text,image,completions]

Each tool runs streaming, the chat route with text alone (`text`) and with one PNG per request
(`image`), and `/v1/completions` with text (`completions`), at concurrency 1 and 8, against a
server with `--max-num-seqs 1` (one sequence at a time) and one with the default (continuous
batching), with the tokenizer the docs name (`kimi-vision checkpoint-path`).
Every run must finish with zero failed requests, and the aiperf runs must find the server's
metrics at aiperf's default URL (`<url>/metrics`); either failing stops the script. Reported per
run: requests/s, TTFT p50 and inter-token latency p50 as the tool measured them.

The tools are not the project's dependencies (aiperf pins another prometheus_client and
transformers than the project's, and the two tools pin different pandas): install each into a
virtual environment of its own, with `tiktoken` for the K3 tokenizer and guidellm's `vision` extra
for images (docs/BENCHMARKS.md has the commands); `--aiperf` and `--guidellm` name their commands.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.serving import REPO_ROOT, Server

TOOLS_HOME = Path.home() / ".cache" / "kimi-vision-bench"
CONCURRENCY = (1, 8)
WORKLOADS = ("text", "image", "completions")
MODEL = "moonshotai/Kimi-K3"  # the embedded checkpoint's served name


def tokenizer_dir() -> str:
    return subprocess.run([sys.executable, "-m", "service.cli", "checkpoint-path"], cwd=REPO_ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()


def aiperf(command: str, url: str, tokenizer: str, workload: str, concurrency: int, args: argparse.Namespace,
           out: Path) -> dict[str, float]:
    image = ["--image-width-mean", str(args.image), "--image-height-mean", str(args.image), "--image-batch-size", "1",
             "--image-format", "png"] if workload == "image" else []
    # aiperf asks for continuous_usage_stats (--per-chunk-usage) on its chat endpoint only
    endpoint = ["completions"] if workload == "completions" else ["chat", "--per-chunk-usage"]
    run([command, "profile", "--model", MODEL, "--url", url, "--endpoint-type", *endpoint, "--streaming",
         "--tokenizer", tokenizer, "--concurrency", str(concurrency), "--request-count", str(args.requests),
         "--warmup-request-count", str(concurrency), "--prompt-input-tokens-mean", str(args.prompt_tokens),
         "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.output_tokens),
         "--prompt-output-tokens-stddev", "0", *image, "--extra-inputs", "ignore_eos:true",
         "--use-server-token-count", "--output-artifact-dir", str(out), "--no-auto-plot"])
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    metrics = json.loads((out / "server_metrics_export.json").read_text())["summary"]
    if report["error_summary"] or report["request_count"]["avg"] != args.requests:
        raise SystemExit(f"aiperf: failed requests {report['error_summary']} (see {out})")
    if metrics["endpoints_successful"] != [f"{url}/metrics"]:
        raise SystemExit(f"aiperf did not read the server's metrics at {url}/metrics: {metrics}")
    return {"requests/s": report["request_throughput"]["avg"], "ttft_ms": report["time_to_first_token"]["p50"],
            "itl_ms": report["inter_token_latency"]["p50"]}


def guidellm(command: str, url: str, tokenizer: str, workload: str, concurrency: int, args: argparse.Namespace,
             out: Path) -> dict[str, float]:
    image = ["--data", f"kind=synthetic_image,width={args.image},height={args.image},images_per_request=1,format=png"]
    report_path = out / "guidellm.json"
    out.mkdir(parents=True, exist_ok=True)
    route = "/v1/completions" if workload == "completions" else "/v1/chat/completions"
    run([command, "run", "--backend", f"kind=openai_http,target={url},model={MODEL},request_format={route}",
         "--tokenizer", f"kind=hf_auto,model={tokenizer}",
         *(image if workload == "image" else []),
         "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
         "--profile", f"kind=concurrent,streams={concurrency}",
         "--constraint", f"kind=max_requests,count={args.requests}", "--constraint", "kind=max_errors,count=1",
         "--output", f"kind=json,path={report_path}", "--disable-console-interactive"])
    (bench,) = json.loads(report_path.read_text())["benchmarks"]
    metrics = bench["metrics"]
    totals = metrics["request_totals"]
    if totals["errored"] or totals["incomplete"] or totals["successful"] != args.requests:
        raise SystemExit(f"guidellm: requests {totals} (see {report_path})")
    return {"requests/s": metrics["requests_per_second"]["successful"]["mean"],
            "ttft_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
            "itl_ms": metrics["inter_token_latency_ms"]["successful"]["median"]}


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.tools", description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", default=str(TOOLS_HOME / "aiperf" / "bin" / "aiperf"))
    parser.add_argument("--guidellm", default=str(TOOLS_HOME / "guidellm" / "bin" / "guidellm"))
    parser.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--image", type=int, default=256, help="the side of each request's square PNG (default 256)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)} (default all)")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    if not set(workloads) <= set(WORKLOADS):
        parser.error(f"--workloads takes {', '.join(WORKLOADS)}")
    tokenizer = tokenizer_dir()
    rows: list[tuple[str, str, int, str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as tmp:
        for seqs in ("1", "default"):
            server = Server([] if seqs == "default" else ["--max-num-seqs", seqs])
            try:
                for tool, measure in (("aiperf", aiperf), ("guidellm", guidellm)):
                    for workload in workloads:
                        for concurrency in CONCURRENCY:
                            out = Path(tmp) / f"{tool}-{seqs}-{workload}-{concurrency}"
                            figures = measure(getattr(args, tool), server.http, tokenizer, workload, concurrency,
                                              args, out)
                            rows.append((tool, workload, concurrency, seqs, figures))
                            print(tool, workload, concurrency, seqs, figures, flush=True)
            finally:
                server.stop()
    print(f"\n{args.requests} requests a run, streaming, {args.prompt_tokens} prompt tokens (+ one "
          f"{args.image}x{args.image} PNG for image), {args.output_tokens} output tokens (ignore_eos); tokenizer "
          f"{tokenizer}\n")
    print("| tool | workload | concurrency | requests/s (seqs 1 / default) | TTFT p50 ms (1 / default) | "
          "ITL p50 ms (1 / default) |\n|---|---|---|---|---|---|")
    table = {(tool, workload, c, seqs): f for tool, workload, c, seqs, f in rows}
    for tool in ("aiperf", "guidellm"):
        for workload in workloads:
            for c in CONCURRENCY:
                one, batched = table[(tool, workload, c, "1")], table[(tool, workload, c, "default")]
                print(f"| {tool} | {workload} | {c} | {one['requests/s']:.2f} / {batched['requests/s']:.2f} "
                      f"({batched['requests/s'] / one['requests/s']:.2f}x) | {one['ttft_ms']:.0f} / "
                      f"{batched['ttft_ms']:.0f} | {one['itl_ms']:.1f} / {batched['itl_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
