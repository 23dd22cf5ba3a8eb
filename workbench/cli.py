"""Command line: `python -m workbench <command> [--preset NAME] [section.key=value ...]`.

    python -m workbench sft    sft.steps=300 run_dir=runs/sft
    python -m workbench train  model.name=runs/sft/model trainer.total_steps=40 run_dir=runs/grpo
    python -m workbench eval   model.name=runs/sft/model --adapter runs/grpo/exports/global_step_40
    python -m workbench replay runs/grpo --step 7
    python -m workbench estimate runs/pilot --steps 100 --price-per-gpu-hour 3.5
    python -m workbench demo   (the whole SFT -> GRPO demo; see `make demo`)
    python -m workbench train  cluster.address=local cluster.num_workers=2   (on Ray actors)
    python -m workbench submit --address http://127.0.0.1:8265 --follow trainer.total_steps=40
    python -m workbench status|logs|stop <job_id> [--address ...]   (Ray Jobs)
    python -m workbench adapters list|publish|promote|rollback --store s3://bucket/prefix
    python -m workbench serve  --adapters s3://bucket/prefix [--replicas N] [--port P]
    python -m workbench serve  --engine vllm --model FOLDER --adapters runs/store   (GPU)
    python -m workbench session-server --api-key tml-KEY model.name=tiny-sft run_dir=runs/svc

`python -m workbench train --help` lists every key with its default and meaning.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from workbench.config import (
    FP8_STORY,
    PRESETS,
    ConfigError,
    RunConfig,
    apply_overrides,
    describe_keys,
    preset,
)
from workbench.engines import ENGINES
from workbench.estimate import EstimateError
from workbench.registry import ForeignBaseError, RegistryError
from workbench.rl.replay import ReplayError
from workbench.serve.engine import ServeSettings
from workbench.storage import StorageError


def _config(args: argparse.Namespace) -> RunConfig:
    return apply_overrides(preset(args.preset), args.overrides)


def _train(args: argparse.Namespace) -> None:
    from workbench.rl.train import train

    train(_config(args))


def _sft(args: argparse.Namespace) -> None:
    from workbench.rl.sft import run_sft

    print(f"SFT model written to {run_sft(_config(args))}")


def _eval(args: argparse.Namespace) -> None:
    from workbench.rl import format_table
    from workbench.rl.eval_model import evaluate_model

    record = evaluate_model(_config(args), adapter=args.adapter or "")
    print(format_table(record.results))


def _replay(args: argparse.Namespace) -> None:
    from workbench.rl.replay import replay

    result = replay(args.run_dir, args.step)
    for key in result.logged:
        print(f"{key:<28} logged {result.logged[key]!r:<24} replayed {result.replayed[key]!r}")
    print("exact" if result.exact else "DIFFERENT")
    if not result.exact:
        sys.exit(1)


def _estimate(args: argparse.Namespace) -> None:
    from workbench.estimate import estimate

    record = estimate(args.run_dir, args.steps, args.price_per_gpu_hour, args.price_per_hour)
    print("\n".join(record.lines()))


def _demo(args: argparse.Namespace) -> None:
    from workbench.demo import run_demo

    run_demo(args.out, long=args.long)


def _submit(args: argparse.Namespace) -> None:
    from workbench.jobs import follow_logs, submit_run

    _config(args)  # bad keys fail here, before anything is submitted
    env = dict(item.split("=", 1) for item in args.env)
    job_id = submit_run(args.overrides, args.address, args.preset, env)
    print(f"submitted {job_id}")
    if args.follow:
        status = follow_logs(job_id, args.address)
        print(f"job {job_id}: {status}")
        if status != "SUCCEEDED":
            sys.exit(1)


def _job(args: argparse.Namespace) -> None:
    from workbench import jobs

    if args.command == "status":
        print(jobs.job_status(args.job_id, args.address))
    elif args.command == "stop":
        print("stop requested" if jobs.stop_job(args.job_id, args.address) else "not running")
    elif args.follow:
        print(f"job {args.job_id}: {jobs.follow_logs(args.job_id, args.address)}")
    else:
        print(jobs.job_logs(args.job_id, args.address), end="")


def _job_commands(sub: argparse._SubParsersAction, keys: str) -> None:
    address = "Ray dashboard address, e.g. http://127.0.0.1:8265 (default: RAY_ADDRESS)"
    p = sub.add_parser("submit", help="submit a training run as a Ray Job", epilog=keys,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _with_overrides(p)
    p.add_argument("--address", default=None, help=address)
    p.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the job (repeatable)")
    p.set_defaults(func=_submit)
    for name, text in (("status", "a job's status"), ("stop", "stop a job"),
                       ("logs", "a job's logs")):
        q = sub.add_parser(name, help=text)
        q.add_argument("job_id")
        q.add_argument("--address", default=None, help=address)
        if name == "logs":
            q.add_argument("--follow", action="store_true", help="keep printing until it ends")
        q.set_defaults(func=_job)


def _adapters(args: argparse.Namespace) -> None:
    from workbench import registry
    from workbench.storage import open_store

    store = open_store(args.store, args.endpoint_url)
    if args.action == "publish":
        entry = registry.publish(store, args.export, args.name, overwrite=args.overwrite)
        print(f"published {entry.name} to {store.root}/{registry.ADAPTERS}/{entry.name}")
    elif args.action in ("promote", "rollback"):
        state = registry.promote(store, args.name) if args.action == "promote" \
            else registry.rollback(store)
        print(f"serving default: {state['default']} (previous: {state['history'][-1:] or 'none'})")
    entries = registry.list_adapters(store)
    print("\n".join(e.row() for e in entries) or f"no adapters in {store.root}")


def _until_stopped(stop: Callable[[], None]) -> None:
    """Wait for SIGTERM or Ctrl-C, then stop(): a server's command line after it started (the
    handler set after ray.init, which sets its own)."""
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop()


def _serve(args: argparse.Namespace) -> None:
    from workbench.serve.deploy import shutdown, start
    from workbench.serve.engine import key_hash

    settings = ServeSettings(
        model=args.model, served_name=args.served_name, adapters=args.adapters,
        endpoint_url=args.endpoint_url, cache_size=args.cache_size, num_replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica, host=args.host, port=args.port,
        api_key_sha256=key_hash(args.api_key), engine=args.engine, dtype=args.dtype,
        device="cuda" if args.engine == "vllm" else args.device,
        gpu_memory_utilization=args.gpu_memory_utilization, **{
            name: getattr(args, name) for name in LIMITS})
    endpoint = start(settings, args.address, args.num_cpus, args.temp_dir)
    # in this process: its server (and vLLM); else Serve
    _until_stopped(lambda: shutdown(endpoint, disconnect=True))


def _session_server(args: argparse.Namespace) -> None:
    from workbench.opener import session_spec
    from workbench.serve.engine import key_hash
    from workbench.service import ServiceSettings, start

    if args.api_key and not args.api_key.startswith("tml-"):
        raise ConfigError("--api-key must start with 'tml-': the tinker SDK sends no other key")
    config = _config(args)
    settings = ServiceSettings(api_key_sha256=key_hash(args.api_key), **{
        name: getattr(args, name) for name in SERVICE_LIMITS})
    server = start(session_spec(config, config.run_dir), settings, args.host, args.port)
    _until_stopped(server.stop)


SERVICE_LIMITS = {  # ServiceSettings field -> (type, help) of `session-server --max-queue` etc.
    "max_queue": (int, "calls accepted and not finished, over every user; past it 429"),
    "session_timeout_s": (float, "a session without a heartbeat this long is ended"),
    "poll_s": (float, "how long retrieve_future holds a call that is not done"),
    "max_body_bytes": (int, "request body in bytes; past it 413"),
    "body_timeout_s": (float, "seconds for a request's whole body to arrive; past it 408"),
    "max_image_pixels": (int, "pixels of one image; past it 400"),
    "default_max_tokens": (int, "a sample request's max_tokens when it names none"),
}


LIMITS = {  # ServeSettings field -> (type, help) of `serve --max-queue` etc. (serve.limits)
    "max_model_len": (int, "context in tokens, prompt + max_tokens; past it 400 "
                           "(0: the model's own, at most 16384)"),
    "max_body_bytes": (int, "request body in bytes; past it 413"),
    "body_timeout_s": (float, "seconds for a request's whole body to arrive; past it 408"),
    "max_image_pixels": (int, "pixels of one request's images together; past it 400"),
    "max_queue": (int, "requests a replica holds at once, running or waiting; past it 429"),
    "request_timeout_s": (float, "seconds from admission to reply; past it 504"),
}


def _limit_options(s: argparse.ArgumentParser, limits: dict[str, tuple[type, str]],
                   defaults: Any) -> None:
    """One `--name` option a limit (`--max-queue` ...), its default the settings record's."""
    for name, (kind, text) in limits.items():
        default = getattr(defaults, name)
        s.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                       help=f"{text} (default: {default})")


def _serving_commands(sub: argparse._SubParsersAction) -> None:
    store = os.environ.get("WORKBENCH_STORE", "runs/store")
    a = sub.add_parser("adapters", help="the adapter registry: list, publish, promote, rollback")
    actions = a.add_subparsers(dest="action", required=True)
    for name, text in (("list", "published adapters with their eval results (* = default)"),
                       ("publish", "copy an exported adapter into the registry"),
                       ("promote", "make an adapter the serving default"),
                       ("rollback", "restore the previous serving default")):
        q = actions.add_parser(name, help=text)
        q.add_argument("--store", default=store, help="s3://bucket/prefix or a folder "
                       "(default: $WORKBENCH_STORE or runs/store)")
        q.add_argument("--endpoint-url", default="", help="S3-compatible endpoint "
                       "(default: AWS_ENDPOINT_URL, else AWS)")
        if name == "publish":
            q.add_argument("export", help="an exports/global_step_N folder (or s3://...)")
            q.add_argument("--name", required=True, help="adapter name (letters, digits, ._-)")
            q.add_argument("--overwrite", action="store_true", help="replace a published name")
        if name == "promote":
            q.add_argument("name")
        q.set_defaults(func=_adapters)
    s = sub.add_parser("serve", help="OpenAI-compatible endpoint over base + adapters (Ray Serve)")
    s.add_argument("--model", default="tiny", help="base model: tiny, a folder or a hub id")
    s.add_argument("--served-name", default="", help="base id clients use (default: --model)")
    s.add_argument("--adapters", default="", help="registry store: s3://bucket/prefix or a folder")
    s.add_argument("--endpoint-url", default="", help="S3-compatible endpoint")
    s.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas")
    s.add_argument("--cache-size", type=int, default=4, help="adapters kept per replica (LRU)")
    s.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs per replica")
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free port)")
    s.add_argument("--api-key", default=os.environ.get("WORKBENCH_API_KEY", ""),
                   help="require 'Authorization: Bearer KEY' (default: $WORKBENCH_API_KEY)")
    s.add_argument("--address", default="local", help="Ray: local, auto or ray://host:10001; "
                   "'' = this process, one replica, no Ray")
    s.add_argument("--num-cpus", type=int, default=0, help="CPUs of a local Ray (0 = all)")
    s.add_argument("--temp-dir", default="", help="temp/log folder of a local Ray")
    s.add_argument("--engine", default="transformers", choices=tuple(ENGINES),
                   help="transformers (CPU or GPU, one request at a time) or vllm (GPU: vLLM's "
                        "async engine, concurrent requests batch)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="vllm: its share of the GPU's memory")
    s.add_argument("--device", default="cpu", help="transformers engine: cpu or cuda "
                   "(vllm always runs on CUDA)")
    s.add_argument("--dtype", default="float32", help="transformers: the weights dtype; vllm: "
                   "the dtype the adapters were trained in (the base is hashed in it; vLLM runs "
                   "bfloat16)")
    _limit_options(s, LIMITS, ServeSettings())
    s.set_defaults(func=_serve)
    ss = sub.add_parser("session-server", help="training sessions over HTTP for the tinker SDK "
                        "(docs/service.md): one session spec, many users, a LoRA each")
    _with_overrides(ss)
    ss.add_argument("--host", default="127.0.0.1", help="bind address")
    ss.add_argument("--port", type=int, default=8100, help="HTTP port (0: a free port)")
    ss.add_argument("--api-key", default=os.environ.get("WORKBENCH_SESSION_KEY", ""),
                    help="require 'X-API-Key: KEY' (tml-...; default: $WORKBENCH_SESSION_KEY)")
    from workbench.service.service import ServiceSettings

    _limit_options(ss, SERVICE_LIMITS, ServiceSettings())
    ss.set_defaults(func=_session_server)


def _with_overrides(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)}")
    sub.add_argument("overrides", nargs="*", metavar="section.key=value",
                     help="dotted config overrides (listed below)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-command per entry point."""
    keys = ("config keys (defaults of the tiny preset):\n" + describe_keys(RunConfig())
            + "\n\n" + FP8_STORY)
    parser = argparse.ArgumentParser(prog="python -m workbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in (("train", _train, "GRPO training loop"),
                           ("sft", _sft, "SFT baseline on oracle trajectories"),
                           ("eval", _eval, "evaluate a model (and adapter) on the fixed set")):
        p = sub.add_parser(name, help=text, description=text, epilog=keys,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _with_overrides(p)
        if name == "eval":
            p.add_argument("--adapter", default="", help="PEFT adapter folder to evaluate")
        p.set_defaults(func=fn)
    rp = sub.add_parser("replay", help="re-run a recorded step's update and compare")
    rp.add_argument("run_dir")
    rp.add_argument("--step", type=int, required=True)
    rp.set_defaults(func=_replay)
    es = sub.add_parser("estimate", help="a pilot run's phase times projected to a full run's "
                        "wall time and cost (workbench.estimate)")
    es.add_argument("run_dir", help="the pilot's run folder")
    es.add_argument("--steps", type=int, default=None,
                    help="steps of the full run (default: its trainer.total_steps)")
    es.add_argument("--price-per-gpu-hour", type=float, default=None,
                    help="price of one GPU-hour (times the config's GPUs)")
    es.add_argument("--price-per-hour", type=float, default=None,
                    help="price of one machine-hour, added (a CPU run has 0 GPUs)")
    es.set_defaults(func=_estimate)
    demo = sub.add_parser("demo", help="tiny-sft -> GRPO on held-out mazes, table and plots")
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.add_argument("--long", action="store_true",
                      help="8,000 more SFT steps first, then 60 GRPO steps (make demo-long)")
    demo.set_defaults(func=_demo)
    _job_commands(sub, keys)
    _serving_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse argv and run the chosen command; config errors print one clear line."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:  # overrides after an option (`eval m=x --adapter A env.size=5`) keep their order
        args.overrides = list(args.overrides) + extra
    try:
        args.func(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except ConnectionError as err:  # Ray unreachable, wrong versions, missing auth token
        print(f"connection error: {err}", file=sys.stderr)
        sys.exit(3)
    except (StorageError, RegistryError, ForeignBaseError, ReplayError, EstimateError) as err:
        # S3, registry, another base, a step without a record, not a run folder: one line each
        print(f"error: {err}", file=sys.stderr)
        sys.exit(4)
