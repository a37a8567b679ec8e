"""Command line: ``mmrl train``, ``mmrl eval``, ``mmrl export``, ``mmrl list``, ``mmrl explain``,
``mmrl serve-rewards``, ``mmrl new-plugin`` (also ``python -m mmrl``).

Configuration mistakes end with one line on stderr and exit code 2, never a traceback::

    $ mmrl train configs/toy.yaml algorithm.policy_loss.clip_hgh=0.3
    mmrl: config key 'algorithm.policy_loss.clip_hgh': got 0.3; allowed: options of policy loss 'grpo': ...

Errors of the inputs (a reward that fails, a checkpoint, a rollout that breaks the contract, a run in which no step
trained on any sample, an export whose output folder is in the way) end with one line and exit code 1.
``--traceback`` (or ``MMRL_TRACEBACK=1``) shows their full traceback instead, for developers.

Several processes: ``accelerate launch [--num_processes N] -m mmrl train CONFIG``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from mmrl.config import ConfigError
from mmrl.extras import MissingExtraError
from mmrl.registry import RegistryError

# A missing extra is a usage error too: the one line names the pip install command.
USAGE_ERRORS = (ConfigError, RegistryError, MissingExtraError)
TRACEBACK_HELP = "Show the full traceback of config and input errors instead of one line (also: MMRL_TRACEBACK=1)."


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    show_traceback = args.traceback or os.environ.get("MMRL_TRACEBACK", "") not in ("", "0")
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:
        # The reader of our output went away (`mmrl list | head`): not an error of the command. Point stdout at
        # devnull so the interpreter's final flush does not raise again, as the Python docs on SIGPIPE advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USAGE_ERRORS as error:
        if show_traceback:
            raise
        print(f"mmrl: {_one_line(error)}", file=sys.stderr)
        return 2
    except _user_errors() as error:
        if show_traceback:
            raise
        print(f"mmrl: {type(error).__name__}: {_one_line(error)}", file=sys.stderr)
        return 1


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by inputs (checkpoints, rollouts, rewards, groups, a run that trained on nothing), shown as one
    line with exit code 1."""
    from mmrl.algos import GroupError
    from mmrl.policy import ExportError
    from mmrl.reward import RewardError
    from mmrl.rollout import RolloutError
    from mmrl.trainer.checkpoint import CheckpointError
    from mmrl.trainer.updates import NoUpdateError

    return (CheckpointError, RewardError, RolloutError, GroupError, NoUpdateError, FileNotFoundError, ExportError)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# mmrl serve-rewards' limit flags (rewards/server.py: ServerLimits, whose field names they are).
SERVE_LIMIT_FLAGS = [
    ("--max-body-mb", float, "Largest request body in MiB (default 256)."),
    ("--max-megapixels", float, "Pixels of all images of one request together, in millions, checked from the PNG "
                                "headers before decoding (default 64)."),
    ("--max-json-depth", int, "Deepest JSON nesting of a request (default 32)."),
    ("--max-json-values", int, "Most JSON values (array elements, object members) in a request (default 1000000)."),
    ("--max-connections", int, "Connections served at once; more are answered 503 (default 64)."),
    ("--max-concurrent-requests", int, "Scoring requests read, decoded and scored at once; more wait up to "
                                       "--request-timeout, then get 503 (default 4)."),
    ("--idle-timeout", float, "Seconds a connection may take to send a request line before it is closed "
                              "(default 15)."),
    ("--request-timeout", float, "Seconds for a request's headers and body to arrive after its request line "
                                 "(default 60)."),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmrl", description="Group-relative RL for generative and multimodal models.")
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    commands = parser.add_subparsers(dest="command")

    train = commands.add_parser("train", help="Train from a YAML config.")
    train.add_argument("config", help="Path to a YAML recipe, e.g. configs/toy.yaml.")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. run.max_steps=10.")
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser(
        "eval", help="Evaluate a config's policy (or a checkpoint) on the held-out split; appends a line to "
        "evaluations.jsonl in the run folder.")
    evaluate.add_argument("config")
    evaluate.add_argument("overrides", nargs="*", help="e.g. run.resume=latest to evaluate the newest checkpoint.")
    evaluate.set_defaults(handler=_eval)

    export = commands.add_parser(
        "export", help="Write a run's trained policy (its latest checkpoint, or --checkpoint) to OUT as a folder the "
        "model's own library loads: a LoRA for diffusers' load_lora_weights or peft's PeftModel.from_pretrained, or "
        "full weights for from_pretrained.")
    export.add_argument("run", help="The run folder (run.output_dir), which holds checkpoints/.")
    export.add_argument("out", help="The folder to write; it must not exist or be empty (written aside, then renamed).")
    export.add_argument("--checkpoint", help="A checkpoint name in RUN/checkpoints (e.g. step-00000040) or a path "
                                             "(default: the latest complete one).")
    export.add_argument("--device", default="cpu", help="Device the model is loaded on to export it (default cpu).")
    export.add_argument("--weights", choices=("auto", "ema", "raw"), default="auto",
                        help="raw: the trained weights; ema: their moving average (runs with ema.enabled); auto "
                             "(default): the EMA when the run evaluated with it, else the trained weights.")
    export.set_defaults(handler=_export)

    listing = commands.add_parser("list", help="Show every registry: algorithms, plugins, rewards, and each plugin's "
                                               "own (model adapters, credit strategies, estimators, fixed choices).")
    listing.add_argument("--options", action="store_true", help="Also show each entry's options and defaults.")
    listing.set_defaults(handler=_list)

    explain = commands.add_parser("explain", help="Show every config field with its default, help and reference.")
    explain.add_argument("--plugin", help="Also show the section of this plugin.")
    explain.set_defaults(handler=_explain)

    serve = commands.add_parser("serve-rewards", help="Serve the reward functions of a config over HTTP (JSON).")
    serve.add_argument("config", help="YAML file with a rewards: {functions: [...]} section (a recipe works).")
    serve.add_argument("--port", type=int, default=8000, help="Port (default 8000; 0 picks a free one).")
    serve.add_argument("--host", default="127.0.0.1",
                       help="Address to bind (default 127.0.0.1: this machine only; any other address needs a token).")
    serve.add_argument("--token-file", help="File holding the token clients must send (default: the environment "
                                            "variable named by --token-env; never pass a token on the command line).")
    serve.add_argument("--token-env", default="MMRL_REWARD_TOKEN",
                       help="Environment variable holding the token (default MMRL_REWARD_TOKEN; unset: no token).")
    # Defaults are ServerLimits' (None: keep the default); the numbers in the help texts are checked by a test.
    for flag, kind, help_text in SERVE_LIMIT_FLAGS:
        serve.add_argument(flag, type=kind, default=None, help=help_text)
    serve.set_defaults(handler=_serve_rewards)

    scaffold = commands.add_parser("new-plugin", help="Scaffold an installable plugin package (entry point, config, "
                                                      "recipe, a test running mmrl.testing.check_plugin).")
    scaffold.add_argument("name", help="The plugin's registry name, a lowercase identifier such as my_modality.")
    scaffold.add_argument("--dir", help="The folder to create (default: ./mmrl-NAME); it must not exist.")
    scaffold.set_defaults(handler=_new_plugin)

    for command in commands.choices.values():  # accepted after the command too: `mmrl train CONFIG --traceback`
        command.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP)
    return parser


def _train(args: argparse.Namespace) -> int:
    from mmrl.config import load_config
    from mmrl.trainer import Trainer
    from mmrl.trainer.checkpoint import refuse_existing_run
    from mmrl.trainer.signals import stop_signals

    with stop_signals():  # SIGTERM/SIGINT while the models load are honoured like during training
        config = load_config(args.config, args.overrides)
        if config.run.resume is None:  # before minutes of model loading (train() checks it again for library users)
            refuse_existing_run(config.run.output_dir)
        trainer = Trainer(config)
        try:
            result = trainer.train()
        finally:
            trainer.close()
    if trainer.accelerator.is_main_process:
        steps = sorted(result.evaluations)
        if steps:
            first, last = result.evaluations[steps[0]], result.evaluations[steps[-1]]
            before, after = first.get("eval/reward_mean"), last.get("eval/reward_mean")
            if before is not None and after is not None and steps[0] != steps[-1]:
                print(f"held-out reward: {before:.4f} at step {steps[0]} -> {after:.4f} at step {steps[-1]}")
        if not result.stopped_early:
            state = "done"
        elif trainer.saved_step is not None:
            state = "stopped early after a checkpoint (continue with run.resume=latest)"
        else:
            state = "stopped early before the first step (nothing to checkpoint)"
        print(f"{state}: {result.step} steps; run folder {config.run.output_dir}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    config = load_config(args.config, args.overrides)
    trainer = Trainer(config)
    try:
        metrics = trainer.evaluate_checkpoint()
    finally:
        trainer.close()
    if trainer.accelerator.is_main_process:
        for name, value in sorted(metrics.items()):
            print(f"{name}: {value:.6g}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from mmrl.policy import EXPORT_INFO, export_run

    out = export_run(args.run, args.out, checkpoint=args.checkpoint, device=args.device, weights=args.weights)
    info = json.loads((out / EXPORT_INFO).read_text())
    weights = "EMA weights" if info["weights"] == "ema" else "trained weights"
    print(f"exported {info['checkpoint']} of {args.run} ({info['plugin']} plugin, {info['format']}, {weights}) "
          f"to {out}")
    return 0


# The core's registries: (title, "module:attribute", show descriptions). The plugins' own registries come from the
# entry-point group mmrl.registries (mmrl.registry.REGISTRY_GROUP), the built-in plugins' and a third party's alike.
REGISTRIES = [
    ("advantage_estimators", "mmrl.algos:advantage_estimators", True),
    ("policy_losses", "mmrl.algos:policy_losses", True),
    ("kl_estimators", "mmrl.algos:kl_estimators", True),
    ("aggregation_modes", "mmrl.algos:aggregation_modes", True),
    ("plugins", "mmrl.plugin:plugin_registry", False),
    ("reward_functions", "mmrl.rewards:reward_functions", False),
    ("pairwise_judges (reward pref_winrate)", "mmrl.rewards.preference:pairwise_judges", True),
]


def plugin_registries() -> list[tuple[str, Any]]:
    """The plugins' own registries, as ``mmrl list`` shows them: ``(title, entry point)`` sorted by the entry point's
    name (``plugin.registry``), the title ``"registry (plugin NAME)"``. Loading an entry point imports the module
    that defines the registry (which may need the plugin's extra)."""
    from importlib import metadata

    from mmrl.registry import REGISTRY_GROUP

    found = []
    for entry_point in sorted(metadata.entry_points(group=REGISTRY_GROUP), key=lambda ep: ep.name):
        plugin, _, name = entry_point.name.partition(".")
        found.append((f"{name or plugin} (plugin {plugin})", entry_point))
    return found


def _list(args: argparse.Namespace) -> int:
    import importlib

    for title, location, describe in REGISTRIES:
        module_name, attribute = location.split(":")
        _print_registry(title, getattr(importlib.import_module(module_name), attribute), describe, args.options)
    for title, entry_point in plugin_registries():
        try:
            registry = entry_point.load()
        except ImportError as error:  # listed all the same: what is missing (MissingExtraError names the extra)
            print(f"{title}:\n  (unavailable: {_one_line(error)})")
            continue
        _print_registry(title, registry, True, args.options)
    _print_plugin_choices()
    return 0


def _print_registry(title: str, registry: Any, describe: bool, options: bool) -> None:
    from mmrl.config.schema import option_kind

    print(f"{title}:")
    for name in registry.names():
        line = f"  {name}"
        if describe:
            line += f"  — {registry.describe(name)}"
        print(line)
        if options:
            for option in registry.options(name):
                default = "(required)" if option.required else repr(option.default)
                kind = option_kind(option)  # the type and declared range: "float, in [0, 1)"
                print(f"      {option.name} = {default}  " + (f"({kind})  " if kind else "") + option.help)


def _print_plugin_choices() -> None:
    """Each plugin's options that take one of a fixed set of names (the flow plugin's SDE kinds, the dLLM plugin's
    objectives): choices that are not registries, which only ``mmrl explain --plugin`` showed before."""
    from mmrl.config import describe_fields
    from mmrl.plugin import plugin_registry

    for plugin in plugin_registry.names():
        print(f"choices (plugin {plugin}):")
        try:
            config_class = plugin_registry.get(plugin).config_class
        except ImportError as error:
            print(f"  (unavailable: {_one_line(error)})")
            continue
        for key, kind, default, _, _ in describe_fields(config_class):
            choices = [part.strip() for part in kind.split("|")]
            if all(part.startswith("'") and part.endswith("'") for part in choices):
                print(f"  plugin.{key}: {' | '.join(part.strip(chr(39)) for part in choices)} (default {default})")


def _serve_rewards(args: argparse.Namespace) -> int:
    from mmrl.extras import require_extra

    require_extra("serve", "mmrl serve-rewards")
    from mmrl.rewards.server import ServerLimits, serve, server_token

    limits = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in SERVE_LIMIT_FLAGS}
    limits = ServerLimits(**{name: value for name, value in limits.items() if value is not None})
    token = server_token(args.token_file, args.token_env)
    return serve(args.config, host=args.host, port=args.port, token=token, limits=limits)


def _new_plugin(args: argparse.Namespace) -> int:
    from mmrl.scaffold import ScaffoldError, new_plugin

    try:
        root = new_plugin(args.name, args.dir)
    except ScaffoldError as error:
        print(f"mmrl: new-plugin: {_one_line(error)}", file=sys.stderr)
        return 2
    print(f"wrote plugin {args.name!r} to {root}: `pip install -e {root}`, then `pytest {root}` and "
          f"`mmrl train {root / 'configs' / (args.name + '.yaml')}`")
    return 0


def _explain(args: argparse.Namespace) -> int:
    import dataclasses
    import typing

    from mmrl.config import TrainConfig
    from mmrl.plugin import plugin_registry

    plugin_class = plugin_registry.get(args.plugin) if args.plugin else None  # an unknown name fails before output
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        if field.name != "plugin":
            print(f"{field.name}:")
            _print_fields(hints[field.name])
    if plugin_class is not None:
        print(f"plugin ({args.plugin}):")
        _print_fields(plugin_class.config_class)
    return 0


def _print_fields(section: type) -> None:
    """``key (type) = default`` and the help of every field of a config section, defaults written as in YAML."""
    import yaml

    from mmrl.config import describe_fields
    from mmrl.config.schema import REQUIRED

    for key, kind, default, help_text, ref in describe_fields(section):
        if default is REQUIRED:
            shown = "required"
        else:  # YAML flow style, as the value would be written in a config (null, true, [0.9, 0.999], {...})
            shown = yaml.safe_dump(default, default_flow_style=True, sort_keys=False, width=2**31).strip()
            shown = shown.removesuffix("...").strip()
        print(f"  {key} ({kind}) = {shown}\n      {help_text}" + (f" [{ref}]" if ref else ""))


if __name__ == "__main__":
    sys.exit(main())
