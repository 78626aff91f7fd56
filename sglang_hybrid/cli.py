"""`sglang-hybrid` command line: make-checkpoint and serve."""

from __future__ import annotations

import argparse
import os
import sys

from sglang_hybrid.checkpoints.presets import PRESETS

# launch_server arguments `serve` adds on a host without a GPU, unless given.
CPU_DEFAULTS = {
    "--device": "cpu",
    "--dtype": "float32",
    "--disable-cuda-graph": None,
    "--mem-fraction-static": "0.05",
    "--max-total-tokens": "16384",
    "--max-running-requests": "32",
    "--max-mamba-cache-size": "64",
    "--skip-server-warmup": None,
    "--sleep-on-idle": None,  # an idle scheduler otherwise polls at 100% of a core
}


def default_checkpoint_dir() -> str:
    root = os.environ.get("SGLANG_HYBRID_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sglang-hybrid"))
    return os.path.join(root, "tiny")


def ensure_tiny_checkpoint(path: str | None = None) -> str:
    """The tiny checkpoint in the cache folder, made on first use."""
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    path = path or default_checkpoint_dir()
    if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        print(f"sglang-hybrid: making the tiny checkpoint in {path}", file=sys.stderr)
        make_checkpoint("tiny", path)
    return path


def launch_server_argv(launch_args: list[str]) -> list[str]:
    """The launch_server command for this host: SGLang's own, plus CPU defaults without a GPU."""
    from sglang_hybrid import cpu_support

    argv = [sys.executable, "-m", "sglang.launch_server", *launch_args]
    if cpu_support.activate():
        given = {a.split("=", 1)[0] for a in launch_args if a.startswith("--")}
        for flag, value in CPU_DEFAULTS.items():
            if flag not in given:
                argv += [flag] if value is None else [flag, value]
    return argv


def _serve(args: argparse.Namespace, rest: list[str]) -> None:
    model_path = args.model_path or ensure_tiny_checkpoint()
    argv = launch_server_argv(["--model-path", model_path, *rest])
    sys.stdout.flush()
    os.execv(argv[0], argv)


def _make_checkpoint(args: argparse.Namespace, rest: list[str]) -> None:
    if rest:
        raise SystemExit(f"sglang-hybrid make-checkpoint: unknown arguments {rest}")
    from sglang_hybrid.checkpoints.maker import make_checkpoint

    print(make_checkpoint(args.preset, args.out, seed=args.seed, near_bigram=args.near_bigram,
                          logit_scale=args.logit_scale))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sglang-hybrid")
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-checkpoint", help="write a preset checkpoint (config, random weights, tokenizer)")
    mk.add_argument("--preset", choices=sorted(PRESETS), required=True)
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--near-bigram", type=float, default=None, metavar="SCALE",
                    help="a speculative-decoding test model: a bigram model plus SCALE x its layers, whose draft "
                         "head is the bigram model (agrees always at 0, less often as SCALE grows)")
    mk.add_argument("--logit-scale", type=float, default=1.0, metavar="S",
                    help="with --near-bigram: S x every logit (same greedy choices, a sharper distribution "
                         "for tree drafts)")
    mk.set_defaults(func=_make_checkpoint)
    sv = sub.add_parser(
        "serve",
        help="run SGLang's server (python -m sglang.launch_server); other arguments pass through",
    )
    sv.add_argument("--model-path", default=None, help="checkpoint folder (default: the tiny preset, made on first use)")
    sv.set_defaults(func=_serve)
    args, rest = parser.parse_known_args(argv)
    args.func(args, rest)


if __name__ == "__main__":
    main()
