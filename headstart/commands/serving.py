"""`headstart serve` and `headstart loadtest`: the OpenAI-compatible server and its load test."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from headstart.commands import common
from headstart.runtime.drafters.registry import option_names
from headstart.runtime.prompts import load_prompts
from headstart.runtime.sizing.policy import POLICIES, Switches, policy_name


def add_parsers(sub) -> None:
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, FIFO queue)")
    common.add_model_args(sv, "auto")
    common.add_prepack_arg(sv)
    common.add_adapter_args(sv)
    common.add_drafter_args(sv)
    sv.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` clients pass (default: --model's last path part, never a path)",
    )
    sv.add_argument("--max-body-mb", type=float, default=None, help="largest request body, larger gets 413 (default 4)")
    sv.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $HEADSTART_API_KEY, else none)",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429 (default 64)")
    sv.add_argument("--time-limit", type=float, default=None, help="seconds per request (default 300)")
    sv.add_argument("--max-batch", type=int, default=None, help="requests decoded at once (default 32)")
    sv.add_argument(
        "--prefill-chunk", type=int, default=None, help="prompt tokens prefilled a round while others decode"
    )
    sv.add_argument(
        "--kv-cache-gb", type=float, default=None, help="KV cache budget; requests wait until they fit (default 4)"
    )
    sv.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=None,
        help="finished prompts' keys and values kept for prompts that start the same way (default 1; 0: off)",
    )
    sv.add_argument(
        "--no-suffix-pool",
        action="store_true",
        help="X+suffix: keep no pool of finished requests (one request can time what others asked: docs/serving.md)",
    )
    sv.add_argument(
        "--per-request-spec-decode-metrics",
        choices=("none", "summary"),
        default=None,
        help="summary: each answer carries its acceptance in `metrics.speculative_decoding`, as vLLM's (default none)",
    )
    sv.add_argument(
        "--speculation",
        choices=POLICIES,
        default=None,
        help="budget: every round's trees sized by load (the default); fixed: each request's own tree, off under the "
        "switches below (the default when one is given); off: plain decoding",
    )
    sv.add_argument(
        "--speculate-up-to",
        type=int,
        default=None,
        help="a switch instead of the budget: up to this many decoding requests draft their whole trees, more decode "
        "plainly (0: never; default: every round's trees sized by the budget, docs/tuning.md)",
    )
    sv.add_argument(
        "--step-aside-queue",
        type=int,
        default=None,
        help="decode plainly while more than this many requests wait (default: never)",
    )
    sv.add_argument(
        "--min-acceptance",
        type=float,
        default=None,
        help="decode plainly a while when recent rounds make fewer tokens a pass",
    )
    sv.set_defaults(run=cmd_serve)

    lt = sub.add_parser("loadtest", help="latency and throughput of a running `headstart serve`")
    lt.add_argument("--url", default="http://127.0.0.1:8000")
    lt.add_argument("--api-key", default=None, metavar="KEY", help="the server's key (default: $HEADSTART_API_KEY)")
    lt.add_argument("--clients", default="1,2,4,8,16,32", help="comma list of concurrency levels")
    lt.add_argument("--requests-per-client", type=int, default=4)
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--prompts", default=None, help=f"JSONL prompt file (default: Spec-Bench at {common.SPEC_BENCH})")
    lt.add_argument("--out", default=None, help="also write the results as JSON here")
    lt.add_argument(
        "--soak",
        type=float,
        default=None,
        metavar="SECONDS",
        help="instead: a soak of valid, malformed, disconnecting and oversized requests from --clients "
        "clients (one level) for SECONDS; counts by kind and status, /health p99, server RSS",
    )
    lt.add_argument(
        "--check-answers",
        nargs="?",
        const="",
        default=None,
        metavar="MODEL",
        help="with --soak: teacher-force every greedy chat answer through MODEL (default: the served model's name; "
        "loaded here in float32, so serve float32 too): each token must be its argmax or tie with it; exit 1 if not",
    )
    lt.set_defaults(run=cmd_loadtest)


def served_name(model: str, given: str | None) -> str:
    """The id clients pass as `model`: `given`, else the last part of --model (never a filesystem path)."""
    return given or Path(model.rstrip("/")).name.removesuffix(".gguf")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def cmd_serve(args: argparse.Namespace, argv: list[str]) -> int:

    import uvicorn

    from headstart.runtime.apps.server.app import ServeConfig, build_app

    if not 0 < args.port < 65536:
        raise common.UserError(f"--port must be in 1..65535, got {args.port}")
    limits = (
        ("--max-queue", args.max_queue),
        ("--time-limit", args.time_limit),
        ("--max-batch", args.max_batch),
        ("--kv-cache-gb", args.kv_cache_gb),
        ("--prefill-chunk", args.prefill_chunk),
    )
    for flag, value in limits:
        if value is not None and value <= 0:
            raise common.UserError(f"{flag} must be > 0, got {value}")
    for flag, value in (
        ("--step-aside-queue", args.step_aside_queue),
        ("--speculate-up-to", args.speculate_up_to),
        ("--prefix-cache-gb", args.prefix_cache_gb),
    ):
        if value is not None and value < 0:
            raise common.UserError(f"{flag} must be >= 0, got {value}")
    options = {
        "max_queue": args.max_queue,
        "time_limit_s": args.time_limit,
        "step_aside_queue": args.step_aside_queue,
        "min_acceptance": args.min_acceptance,
        "max_batch": args.max_batch,
        "kv_cache_gb": args.kv_cache_gb,
        "prefix_cache_gb": args.prefix_cache_gb,
        "prefill_chunk": args.prefill_chunk,
        "speculate_up_to": args.speculate_up_to,
        "speculation": args.speculation,
        "per_request_spec_decode_metrics": args.per_request_spec_decode_metrics,
    }
    if args.max_body_mb is not None:
        if args.max_body_mb <= 0:
            raise common.UserError(f"--max-body-mb must be > 0, got {args.max_body_mb}")
        options["max_body_bytes"] = int(args.max_body_mb * (1 << 20))
    config = ServeConfig(
        served_name(args.model, args.served_model_name), **{k: v for k, v in options.items() if v is not None}
    )
    api_key = common.given_api_key(args)
    if api_key is None and args.host not in LOOPBACK:
        print(
            f"headstart: warning: serving on {args.host} without an API key: anyone who reaches it can use it "
            "(--api-key or HEADSTART_API_KEY)",
            file=sys.stderr,
        )
    if args.drafter is None:
        args.drafter = common.default_drafter(args.model, args.adapter)
    try:  # the policy and its switches agree (runtime/sizing/policy.py), before the model loads
        policy_name(args.speculation, Switches(args.speculate_up_to, args.step_aside_queue, args.min_acceptance), "")
    except ValueError as e:
        raise common.UserError(str(e)) from None
    if args.no_suffix_pool:
        if "pool_tokens" not in option_names(args.drafter):
            raise common.UserError(f"--no-suffix-pool: --drafter {args.drafter} keeps no pool (suffix, X+suffix do)")
        if args.suffix_pool_tokens:
            raise common.UserError("--no-suffix-pool or --suffix-pool-tokens N, not both")
        args.suffix_pool_tokens = 0
    engine = common.load_engine(args)
    auth = "an API key required" if api_key else "no API key"
    print(
        f"headstart: serving {config.model_name} on http://{args.host}:{args.port}/v1, {auth} "
        f"({dataclasses.asdict(config)})",
        file=sys.stderr,
    )
    try:
        app = build_app(engine, config, api_key, worker_thread=False)
    except ValueError as e:  # the KV budget cannot hold one full-length sequence
        raise common.UserError(f"{e}: raise --kv-cache-gb") from None
    print(f"headstart: warmed up in {app.state.worker.warm_up():.1f} s", file=sys.stderr)
    # HTTP on a thread, decoding on this one (the thread that loaded the model: runtime/apps/server/worker.py says why)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    http = threading.Thread(target=server.run, name="headstart-http", daemon=True)
    http.start()
    signal.signal(signal.SIGTERM, stop_on_signal(server, app.state.worker))
    try:
        while not server.started and http.is_alive():
            time.sleep(0.05)
        if not http.is_alive():
            raise common.UserError(f"could not serve on {args.host}:{args.port} (see the log above)")
        threading.Thread(target=_stop_with, args=(http, app.state.worker), daemon=True).start()
        app.state.worker.serve()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
    return 0


def stop_on_signal(server, worker) -> Callable[..., None]:
    """SIGTERM's handler: it only sets flags. It runs on the worker's thread between two bytecodes, maybe inside the
    lock of the queue an idle worker waits on, so taking a lock there can deadlock (seen: `Worker.stop`'s put hung
    a server for good). The worker ends after its round; the HTTP server stops, and `_stop_with` wakes an idle
    worker."""

    def handler(*_) -> None:
        worker.stopping = True
        server.should_exit = True

    return handler


def _stop_with(http, worker) -> None:
    """The worker stops when the HTTP server does."""
    http.join()
    worker.stop()


def server_info(url: str, api_key: str | None) -> dict:
    """headstart's /health ({"model", "drafter", ...}); another OpenAI server (vLLM, SGLang): its first model from
    /v1/models, the drafter named after the server."""
    import httpx

    from headstart.runtime.apps.server.loadtest import auth

    url = url.rstrip("/")
    try:
        health = httpx.get(url + "/health", timeout=10)
        if health.headers.get("content-type", "").startswith("application/json") and "model" in health.json():
            return health.json()
        models = httpx.get(url + "/v1/models", timeout=10, headers=auth(api_key)).json()["data"]
        return {"model": models[0]["id"], "drafter": "peer", "server": models[0].get("owned_by", "openai")}
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise common.UserError(f"no OpenAI-compatible server at {url}: {e}") from e


def cmd_loadtest(args: argparse.Namespace, argv: list[str]) -> int:
    from pathlib import Path

    from headstart.runtime.apps.server import loadtest

    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError as e:
        raise common.UserError(f"--clients takes a comma list of integers: {e}") from e
    if min(levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        raise common.UserError("--clients, --requests-per-client and --max-tokens must be >= 1")
    prompts = [p.text for p in load_prompts(common.bench_prompts(args.prompts))]
    api_key = common.given_api_key(args)
    health = server_info(args.url, api_key)
    if args.check_answers is not None and args.soak is None:
        raise common.UserError("--check-answers checks a soak's answers: give --soak SECONDS too")
    if args.soak is not None:
        answers = [] if args.check_answers is not None else None
        result = loadtest.soak(
            args.url, health["model"], prompts, args.soak, max(levels), api_key=api_key, answers=answers
        )
        if answers is not None:
            from headstart.runtime.apps.server.answers import check_answers
            from headstart.runtime.models import load_model

            model, tokenizer = load_model(args.check_answers or health["model"], dtype="float32")
            result["answers"] = check_answers(model, tokenizer, answers)
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps({"server": health, "soak": result}, indent=2))
        return 1 if result["status_5xx"] or (answers is not None and result["answers"]["wrong"]) else 0
    rows = [
        loadtest.run_level(args.url, health["model"], prompts, c, args.requests_per_client, args.max_tokens, api_key)
        for c in levels
    ]
    print(loadtest.markdown(rows, health["drafter"]))
    if args.out:
        Path(args.out).write_text(json.dumps({"server": health, "levels": rows}, indent=2))
    return 0
