"""`--sglang-<flag>`: SGLang server flags for the servers a run launches, checked at run setup.

`parse_args` collects every `--sglang-<flag> [value]` into `args.sglang` as strings (True for a bare flag), and
`build_run_setup` checks them with `check_server_flags`, so a launch and `--dry-run` accept and refuse the same
flags:

- flags the run sets itself on every server it launches are refused by name, with the run flag to use instead
  (`RUN_CONTROLLED`, a fixed list: this check needs no SGLang install);
- where SGLang is importable, each flag is looked up in SGLang's own command line, the parser
  `ServerArgs.add_cli_args` builds from ServerArgs' typed fields (their aliases, choices and type parsers
  included; `sglang.launch_server` parses the launch with that same parser): an unknown name is refused (with
  the closest names), a value is converted with the flag's type and checked against its choices, a switch takes
  true/false or no value. Without SGLang the flags pass unchecked.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.util

_MODEL = "the run serves the architecture of --model / --load-hf: it writes the config.json, DDMA sends the weights"
_TP = "--rollout-tensor-parallel-size sets it"
_DP = "one engine per replica (weight updates need dp_size 1); more replicas: --rollout-num-replicas"
_PP = "a generator replica is tensor-parallel only (DDMA sends SGLang TP shards): --rollout-tensor-parallel-size"
_EP = "--rollout-expert-parallel-size sets it (the expert layout DDMA sends)"
_NODE = "a replica's server runs on its leader's node, on the GPUs of the replica's ranks"
_ADDRESS = "the run picks the address of each server it launches (your own servers: --rollout-server-urls)"

# SGLang server arguments the run sets on every server it launches (SGLangServer.launch and sglang.build_engine),
# by field name and CLI alias, and what sets them instead.
RUN_CONTROLLED = {
    "model_path": _MODEL, "model": _MODEL,
    "tp_size": _TP, "tensor_parallel_size": _TP,
    "dp_size": _DP, "data_parallel_size": _DP,
    "pp_size": _PP, "pipeline_parallel_size": _PP,
    "ep_size": _EP, "expert_parallel_size": _EP, "ep": _EP,
    "nnodes": _NODE, "node_rank": _NODE,
    "host": _ADDRESS, "port": _ADDRESS,
    "skip_tokenizer_init": "always on: the run sends token ids",
    "load_format": "servers start on random weights (dummy) until the first DDMA publish brings the policy",
    "dtype": "--bf16 sets it (bfloat16, else float32)",
    "weight_version": "the run numbers the weight versions (one per DDMA publish)",
    "random_seed": "--seed sets it",
    "context_length": "--seq-length sets it",
    "max_running_requests": "--rollout-max-running sets it",
    "max_total_tokens": "--rollout-kv-cache-tokens sets it",
    "api_key": "--sglang-api-key sets it, or env SGLANG_API_KEY: the run's client sends the same key",
    "admin_api_key": "the run's client authenticates every request with --sglang-api-key, and with an admin key set "
                     "SGLang takes only that one for weight updates and pauses",
}

TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _flag(key: str) -> str:
    return "--sglang-" + key.replace("_", "-")


def refuse_run_controlled(flags: dict, dests: dict | None = None) -> None:
    """Raise ValueError naming every --sglang-<flag> the run sets itself, and what to use instead. `dests`: the
    SGLang field each flag name stands for, when it is an alias (from SGLang's command line)."""
    fields = {k: (dests or {}).get(k, k) for k in flags}
    refused = [f"{_flag(k)} ({RUN_CONTROLLED[f]})" for k, f in fields.items() if f in RUN_CONTROLLED]
    if refused:
        raise ValueError(f"{'; '.join(refused)}: the run sets this SGLang server argument itself on every server it "
                         "launches")


@functools.cache
def sglang_cli_actions() -> dict[str, argparse.Action] | None:
    """SGLang's server command line, option string -> argparse action, as `sglang.launch_server` builds it
    (`ServerArgs.add_cli_args`); None when SGLang cannot be imported here (the flags then go unchecked)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return {option: action for action in parser._actions for option in action.option_strings}


def _type_name(action: argparse.Action) -> str:
    kind = getattr(action.type, "__name__", None) or "str"
    return f"one of {list(action.choices)}" if action.choices is not None else kind


def _switch_value(key: str, value) -> bool:
    """A switch's value: True for a bare flag or a true word, False for a false word."""
    if isinstance(value, bool):
        return value
    if value.lower() in TRUE_WORDS:
        return True
    if value.lower() in FALSE_WORDS:
        return False
    raise ValueError(f"{_flag(key)} {value!r}: SGLang's --{key.replace('_', '-')} is a switch (true/false); give it "
                     f"alone, or as {_flag(key)}=true / =false")


def _convert(key: str, action: argparse.Action, value: str):
    """One value through the flag's own type parser and choices. Plain types (str, int, float) come back
    converted; a value SGLang parses with a function of its own (JSON, sizes like 1M) is checked with it and
    passed on as given, since SGLang parses the string again."""
    parse = action.type or str
    try:
        parsed = parse(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{_flag(key)} {value!r}: SGLang's --{key.replace('_', '-')} takes {_type_name(action)} "
                         f"({e})") from None
    if action.choices is not None and parsed not in action.choices:
        raise ValueError(f"{_flag(key)} {value!r}: SGLang's --{key.replace('_', '-')} takes {_type_name(action)}")
    return parsed if parse in (str, int, float) else value


def check_typed(flags: dict, actions: dict[str, argparse.Action]) -> dict:
    """Check `flags` (name -> string value, True for a bare flag) against SGLang's command line `actions` and
    return them ready for the launch: values converted, switches True (or, turned off, left out or as their
    --no- form). Raises ValueError naming the flag and the expected type or the closest names."""
    out = {}
    for key, value in flags.items():
        option = "--" + key.replace("_", "-")
        action = actions.get(option)
        if action is None:
            close = difflib.get_close_matches(option, list(actions), n=3, cutoff=0.8)
            hint = f"; did you mean {' or '.join(_flag(c[2:]) for c in close)}?" if close else ""
            raise ValueError(f"{_flag(key)}: SGLang's server has no --{key.replace('_', '-')}{hint}")
        refuse_run_controlled({key: value}, {key: action.dest})  # an alias the fixed list does not spell out
        if action.nargs == 0:  # store_true and friends: a switch
            on = _switch_value(key, value)
            if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
                name = action.option_strings[0][2:].replace("-", "_")
                on = on != option.startswith("--no-")
                out[name if on else "no_" + name] = True
            elif on:
                out[key] = True
            elif action.default:
                raise ValueError(f"{_flag(key)} false: SGLang's --{key.replace('_', '-')} is on by default and its "
                                 "command line cannot turn it off")
            continue
        if value is True and action.nargs == "?":  # an optional value, given none: SGLang uses the flag's const
            out[key] = True
            continue
        if value is True:
            raise ValueError(f"{_flag(key)} needs a value: SGLang's --{key.replace('_', '-')} takes "
                             f"{_type_name(action)}")
        if action.nargs in ("+", "*"):
            out[key] = [_convert(key, action, v) for v in value.split()]
        else:
            out[key] = _convert(key, action, value)
    return out


def check_server_flags(flags: dict) -> dict:
    """The run's --sglang-<flag> values, checked: run-controlled flags refused (always), then types, choices and
    names checked against SGLang's command line where SGLang is importable. Returns the flags to launch with."""
    refuse_run_controlled(flags)
    actions = sglang_cli_actions() if flags else None
    return dict(flags) if actions is None else check_typed(flags, actions)
