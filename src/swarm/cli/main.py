"""`swarm` command line: one subcommand per role, all reading the same config file plus overrides."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from swarm import logs
from swarm.config import ConfigError, ConfigMismatch, SwarmConfig, load_config
from swarm.config.recipes import DEMO
from swarm.exiting import STOP_MARGIN, exit_now, on_stop_signals
from swarm.net.lifeline import CutOff, guard
from swarm.ops.faults import ACTIONS, FaultInjector

# optional packages, by the extra of the `swarm-parallel` distribution that installs them
EXTRAS = {"transformers": "hf", "tokenizers": "hf", "safetensors": "hf", "datasets": "hf",
          "prometheus_client": "monitor", "tensorboard": "monitor", "matplotlib": "plots"}


def _joining(p: argparse.ArgumentParser, listening: bool = True) -> None:
    """What every command that joins a swarm takes: its config and where to find it; and, but for a
    command that only looks (`listening` false), where its own peer listens."""
    p.add_argument("--config", help="TOML config file (defaults apply to anything it leaves out)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="override one config value, e.g. --set model.d_model=256 (repeatable)",
    )
    p.add_argument("--initial-peers", nargs="+",
                   help="multiaddrs of any peers of the swarm (printed by `swarm dht` and by every server)")
    p.add_argument("--secret", metavar="FILE", help="a private swarm's shared secret: strangers are kept out")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    if not listening:
        return
    p.add_argument("--host", help="IP address to listen on (default 0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, help="TCP port to listen on (default: any free one)")
    p.add_argument("--announce", nargs="+", metavar="MULTIADDR",
                   help="addresses to announce instead, e.g. /ip4/PUBLIC_IP/tcp/PORT behind a port forward")
    p.add_argument("--identity", metavar="FILE", help="private key file: keeps this peer's id across restarts")


def _common(p: argparse.ArgumentParser) -> None:
    _joining(p)
    p.add_argument("--run-dir", help="where logs, summaries and plots go")
    p.add_argument("--data", help="training text: a .txt/.jsonl file or a directory of them")


def _metered(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (net.metrics_port; 0: off)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dht", help="run a bootstrap DHT peer and print the addresses others join with")
    _common(p)
    p.add_argument("--addr-file", help="also write the addresses to this file")
    p = sub.add_parser("server", help="serve one stage of the model")
    _common(p)
    p.add_argument("--stage", help="the stage to serve, or 'auto': the one with the least capacity now")
    p.add_argument("--device", help="cpu, cuda or cuda:N")
    p.add_argument("--resume", metavar="DIR", help="checkpoint the stage into DIR, resuming from it if it holds one")
    p.add_argument("--fresh-stage", action="store_true",
                   help="serve the stage from its initial weights even mid-run when no replica or copy of it is "
                        "left (its training so far is lost); without it such a server waits for a copy")
    p.add_argument("--train", action="store_true",
                   help="also feed microbatches through the swarm from this process, as `swarm trainer` would "
                        "(its settings, --index included): one DHT peer and p2p daemon for both roles")
    p.add_argument("--index", type=int, help="with --train: a number naming the trainer's summary")
    _metered(p)
    p = sub.add_parser("backup", help="hold a copy of every stage's state, for stages that lose all replicas")
    _common(p)
    p = sub.add_parser("trainer", help="feed microbatches through the swarm")
    _common(p)
    p.add_argument("--index", type=int, help="a number naming this trainer's summary")
    _metered(p)
    for name, text in (("demo", "train the default model on a local swarm (the README's first command)"),
                       ("local", "run a local swarm from a config")):
        p = sub.add_parser(name, help=text)
        _common(p)
        p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("status", help="print the live swarm from the DHT: stages, servers, trainers, a verdict")
    _joining(p)
    p.add_argument("--json", action="store_true", help="one JSON object per snapshot, for scripts")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                   help="print a fresh snapshot every SECONDS (default 2) until Ctrl-C")
    p = sub.add_parser("monitor", help="serve a live web page (and JSON) of the swarm: servers, throughput, "
                                       "loss, epochs, moves")
    _joining(p, listening=False)
    p.add_argument("--host", dest="http_host", default="127.0.0.1", metavar="HOST",
                   help="address the page is served on (default 127.0.0.1; 0.0.0.0: all interfaces)")
    p.add_argument("--port", dest="http_port", type=int, default=8000, metavar="PORT",
                   help="the page's TCP port (default 8000; 0: any free one, printed)")
    p.add_argument("--every", type=float, default=2.0, metavar="SECONDS",
                   help="read the swarm from the DHT every SECONDS (default 2); the page follows at that pace")
    p = sub.add_parser("report", help="gather peers' results from their run directories into one report")
    p.add_argument("sources", nargs="+", metavar="PEER_RUN_DIR", help="each peer's --run-dir (copied from its host)")
    p.add_argument("--run-dir", required=True, help="where summary.json and the plots go")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p = sub.add_parser("export", help="gather every stage's newest weights into one model (a Hugging Face model "
                                      "directory for model.spec swarm.model.hf:build_stages)")
    _joining(p)
    p.add_argument("sources", nargs="*", metavar="DIR",
                   help="checkpoint directories (servers' --resume DIR) or run directories holding them; none: "
                        "download from the live swarm at --initial-peers")
    p.add_argument("--out", required=True, help="the directory to write the model to")
    p.add_argument("--tokenizer", metavar="DIR", help="copy this tokenizer's files into the model directory")
    p = sub.add_parser("fault", help="inject a fault into a running local swarm (see `swarm local`)")
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("peer", help="the peer's name, as in RUN_DIR/peers.json (e.g. server-s1-3, trainer-0)")
    p.add_argument("--run-dir", required=True, help="the local swarm's run directory")
    p.add_argument("--seconds", type=float, default=0.0, help="delay: added to every RPC message")
    p.add_argument("--drop", type=float, default=0.0, help="delay: probability that a message is lost")
    p.add_argument("--blackhole", action="store_true", help="delay: lose every message")
    p.add_argument("--methods", default="", help="delay: only these RPC methods, comma-separated "
                                                 "(e.g. forward,backward: a hung compute); default every one")
    p.add_argument("--mbit", type=float, default=10.0, help="shape: link rate in Mbit/s each way")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def _inject(args: argparse.Namespace) -> None:
    faults = FaultInjector(args.run_dir)
    if args.action == "delay":
        faults.delay(args.peer, args.seconds, args.drop, args.blackhole, [m for m in args.methods.split(",") if m])
    elif args.action == "shape":
        faults.shape(args.peer, args.mbit)
    else:
        getattr(faults, args.action)(args.peer)
    print(f"{args.action} {args.peer}: done (logged in {args.run_dir}/faults.jsonl)")


def _report(args: argparse.Namespace) -> None:
    from swarm.ops.report import gather, write_report

    out = Path(args.run_dir)
    gather([Path(d) for d in args.sources], out)
    summary = write_report(out)
    print(f"{summary['samples_completed']} samples, loss {summary['first_loss']} -> {summary['final_loss']}; "
          f"see {out}/summary.json, loss.png, throughput.png")


def _config(args: argparse.Namespace) -> SwarmConfig:
    overrides = list(args.overrides)
    if getattr(args, "fresh_stage", False):
        overrides.append("server.fresh_start=true")
    if getattr(args, "train", False):
        overrides.append("server.train=true")
    if getattr(args, "stage", None) == "auto":
        overrides.append("server.auto_stage=true")
        args.stage = None
    addresses = lambda v: "[" + ",".join(f'"{a}"' for a in v) + "]"  # noqa: E731
    flags = {
        "initial_peers": ("net.initial_peers", addresses),
        "host": ("net.host", lambda v: f'"{v}"'),
        "port": ("net.port", str),
        "announce": ("net.announce_addrs", addresses),
        "identity": ("net.identity_path", lambda v: f'"{v}"'),
        "secret": ("net.secret_path", lambda v: f'"{v}"'),
        "run_dir": ("run_dir", lambda v: f'"{v}"'),
        "data": ("data.path", lambda v: f'"{v}"'),
        "stage": ("server.stage", str),
        "device": ("server.device", lambda v: f'"{v}"'),
        "resume": ("server.checkpoint_dir", lambda v: f'"{v}"'),
        "index": ("trainer.index", str),
        "metrics_port": ("net.metrics_port", str),
    }
    for attr, (key, render) in flags.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides.append(f"{key}={render(value)}")
    base = DEMO if args.command == "demo" else None
    return load_config(args.config, overrides, base=base)


def _status(cfg: SwarmConfig, as_json: bool, every: float | None) -> None:
    """`swarm status`: the stage count comes from the servers' records (the config's is a first guess)."""
    from swarm.ops.status import SwarmStatus, follow
    from swarm.ops.status_view import render_text, status_json

    clear = every is not None and not as_json and sys.stdout.isatty()  # a terminal: redraw in place

    def show(status: SwarmStatus) -> None:
        if as_json:
            print(json.dumps(status_json(status, cfg.net.run_id)), flush=True)
        else:
            print(("\033[H\033[J" if clear else "") + render_text(status, cfg.net.run_id) + "\n", flush=True)

    if every is not None and every <= 0:
        raise ConfigError(f"--watch: SECONDS must be positive, got {every}")
    try:
        follow(cfg, show, every)
    except KeyboardInterrupt:  # how --watch ends
        if every is None:
            raise


def _serve_dht(cfg: SwarmConfig, addr_file: str | None) -> None:
    from swarm.net.bootstrap import open_bootstrap
    from swarm.net.node import start_dht, visible_addresses

    dht = start_dht(cfg.net)
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        on_stop_signals(loop, stop.set, STOP_MARGIN, "bootstrap peer")
        p2p = await open_bootstrap(dht, cfg.net)
        addrs = visible_addresses(dht)
        kept = f" (peer id kept in {cfg.net.identity_path})" if cfg.net.identity_path else ""
        print(f"Bootstrap peer is up{kept}. Join with:\n  --initial-peers " + " ".join(addrs), flush=True)
        if addr_file:
            Path(addr_file).write_text("\n".join(addrs) + "\n")
        await guard(stop.wait(), dht, p2p, cfg.net)

    try:
        asyncio.run(wait())
    finally:
        dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C (SIGINT) stops every command, even one started where SIGINT is ignored by inheritance: a shell
    # script starts its background jobs (`swarm server ... &`) with SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = _parser().parse_args(argv)
    logs.setup(args.verbose)
    try:
        if args.command == "fault":
            _inject(args)
            return 0
        if args.command == "report":
            _report(args)
            return 0
        cfg = _config(args)
        if args.command == "dht":
            _serve_dht(cfg, args.addr_file)
        elif args.command == "status":
            _status(cfg, args.json, args.watch)
        elif args.command == "monitor":
            from swarm.ops.monitor import run_monitor

            run_monitor(cfg, args.http_host, args.http_port, args.every)
        elif args.command == "server":
            from swarm.server.lifecycle import StageServer

            StageServer(cfg).run()
        elif args.command == "backup":
            from swarm.backup.role import run_backup_peer

            run_backup_peer(cfg)
        elif args.command == "export":
            from swarm.ops.export import export_model

            print(export_model(cfg, args.sources, args.out, args.tokenizer))
        elif args.command == "trainer":
            from swarm.trainer.trainer import Trainer

            Trainer(cfg).run()
        else:
            from swarm.ops.run import run_local

            run_local(cfg, progress=not args.no_progress)
    except ConfigMismatch as e:
        print(f"swarm: refused to join: {e}", file=sys.stderr)
        return 3
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"swarm {args.command}: this needs {e.name}, which comes with the '{extra}' extra: "
              f"pip install 'swarm-parallel[{extra}]'", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"swarm: bad configuration: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except CutOff as e:
        print(f"swarm {args.command}: cut off from the swarm: {e}", file=sys.stderr)
        return 5
    except ConnectionError as e:  # before OSError, which it is a kind of
        print(f"swarm: could not join the swarm: {e}", file=sys.stderr)
        return 4
    except (ValueError, OSError) as e:  # a fault the CLI could not inject, results it could not find
        if args.command not in ("fault", "report", "export"):
            raise
        print(f"swarm {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    """The `swarm` command: `main`, then a quick exit (see `swarm.exiting.exit_now`)."""
    exit_now(main())


if __name__ == "__main__":
    run()
