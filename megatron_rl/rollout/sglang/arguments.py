"""The command line of SGLang generators: their argument group, the API key as a secret, the `--sglang-<flag>`
passthrough of server flags (collected into `args.sglang`, checked by the run setup: `flags.py`), and the checks of
these flags together. --sglang-api-key is a run flag, not a passthrough: the key is both given to the servers a run
launches and sent by the client."""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "SGLANG_API_KEY"  # --sglang-api-key's default; SGLang 0.5.23's server reads no variable
REDACTED = "<redacted>"


class Secret:
    """A credential (--sglang-api-key): `value` holds it; repr and str show "<redacted>". It is not a str, so the
    run's logged config (`observability.metrics.run_config`, scalars only) leaves it out, and printing `args` does not
    show it."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return REDACTED

    __str__ = __repr__


def api_key(text: str) -> Secret:
    """argparse type of --sglang-api-key. The key goes into an `Authorization: Bearer <key>` header, so it must be
    printable ASCII without spaces. Errors never repeat the value (argparse would for a ValueError)."""
    if not text or not text.isascii() or not text.isprintable() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("the key must be non-empty printable ASCII without spaces (it is sent as "
                                         "an HTTP bearer token)")
    return Secret(text)


def redact_argv(argv: list[str]) -> list[str]:
    """A command line as it may be logged: the value of --sglang-api-key (`--sglang-api-key KEY` or
    `--sglang-api-key=KEY`) replaced by "<redacted>"."""
    out = list(argv)
    for i, word in enumerate(out):
        if word == "--sglang-api-key" and i + 1 < len(out):
            out[i + 1] = REDACTED
        elif word.startswith("--sglang-api-key="):
            out[i] = "--sglang-api-key=" + REDACTED
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The SGLang generators' own flags (--sglang-<flag> server flags pass through `collect_server_flags`)."""
    g = parser.add_argument_group("SGLang generators (--rollout-backend sglang)")
    g.add_argument("--rollout-server-urls", nargs="+", metavar="URL",
                   help="with --rollout-backend sglang: attach to these running servers (one per replica, "
                        "started with --skip-tokenizer-init and the run's model) instead of launching them")
    g.add_argument("--sglang-api-key", type=api_key, metavar="KEY",
                   help=f"with --rollout-backend sglang: the servers' API key (default: env {API_KEY_ENV}, which keeps "
                        "it off the command line). Launched servers get it as SGLang's --api-key; every request "
                        "(generation, pauses, weight updates) sends it as 'Authorization: Bearer KEY'; an attached "
                        "server that refuses it stops the run at start. megatron-rl never logs it")
    g.add_argument("--rollout-server-timeout", type=float, default=600.0,
                   help="seconds an SGLang server may take to start and answer /health")
    g.add_argument("--rollout-server-stall-timeout", type=float, default=300.0,
                   help="an SGLang server that finishes no request for this long and then fails /health is "
                        "restarted")
    g.add_argument("--rollout-server-max-restarts", type=int, default=3,
                   help="restarts of a failed SGLang server (re-synced, unfinished requests re-run) before the "
                        "run stops")


def collect_server_flags(unknown: list[str]) -> tuple[dict, list[str]]:
    """Every `--sglang-<flag> [value]` among the words argparse did not know, as {flag's field name: the value as
    a string, or True for a bare switch} (checked later by the run setup, `flags.check_server_flags`), and the
    words that remain."""
    flags, rest = {}, []
    i = 0
    while i < len(unknown):
        item = unknown[i]
        if item.startswith("--sglang-"):
            key, _, value = item[len("--sglang-"):].partition("=")
            if not value and i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
                value, i = unknown[i + 1], i + 1
            flags[key.replace("-", "_")] = value or True
        else:
            rest.append(item)
        i += 1
    return flags, rest


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The SGLang flags together: the key from env SGLANG_API_KEY when the flag is not given, one URL per replica,
    no server flags for attached servers, no built-in-engine-only feature; and none of them without
    --rollout-backend sglang."""
    if args.rollout_backend == "sglang":
        if args.sglang_api_key is None and os.environ.get(API_KEY_ENV):
            try:
                args.sglang_api_key = api_key(os.environ[API_KEY_ENV])
            except argparse.ArgumentTypeError as e:
                parser.error(f"env {API_KEY_ENV} (--sglang-api-key): {e}")
        if args.rollout_server_urls and len(args.rollout_server_urls) != args.rollout_num_replicas:
            parser.error(f"--rollout-server-urls has {len(args.rollout_server_urls)} URL(s) for "
                         f"--rollout-num-replicas {args.rollout_num_replicas}")
        if args.sglang and args.rollout_server_urls:
            parser.error(f"{', '.join('--sglang-' + k.replace('_', '-') for k in args.sglang)}: server flags go to "
                         "the servers a run launches, and --rollout-server-urls attaches to running ones instead "
                         "(start those with the flags)")
        if args.partial_rollout_max_tokens:
            parser.error("--partial-rollout-max-tokens is a built-in engine feature; SGLang has no per-request "
                         "token budget per weight version")
    elif args.sglang or args.rollout_server_urls or args.sglang_api_key is not None:
        flags = [f"--sglang-{k.replace('_', '-')}" for k in args.sglang] + \
            (["--rollout-server-urls"] if args.rollout_server_urls else []) + \
            (["--sglang-api-key"] if args.sglang_api_key is not None else [])
        parser.error(f"{', '.join(flags)} need(s) --rollout-backend sglang")
