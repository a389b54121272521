"""The ``hone`` command line.

Each subcommand validates the whole config first (so a typo never costs a model load) and
imports the heavy machinery (torch, transformers, datasets) only once it needs it, which keeps
``--help`` and ``validate`` instant.
"""

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from hone import __version__
from hone.errors import HoneError

EXAMPLES = """\
examples:
  hone validate examples/quickstart.yml
  hone validate cfg.yml --set optimizer.learning_rate=1e-4 --set data.sequence_len=4096
  hone preprocess examples/chat_lora.yml
  hone train examples/quickstart.yml
  hone train examples/distributed.yml --nproc-per-node 2
  hone generate runs/quickstart --prompt "What color is a lemon?"
  hone chat runs/quickstart
  hone convert axolotl.yml -o hone.yml
  hone plan examples/compile.yml --gpu-memory 24GiB
  hone bench benchmarks/specs/qwen3-8b-lora.yml
"""


def _prepare_libraries(verbose: bool, load_libraries: bool = True) -> None:
    """Offline first, and no per-shard progress bars from the libraries unless asked for.

    Uses the libraries' documented switches (environment variables read at import, and their
    public progress-bar toggles); nothing of theirs is patched. ``load_libraries=False``
    (``hone validate``, which loads no model or data) sets only the environment variables, so
    datasets and transformers (seconds of imports) stay unimported unless a check needs them.
    """
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    # the libraries' deprecation notices about their own internals (e.g. PEFT reading a
    # transformers attribute renamed in v5) are not the user's to act on
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import logging

    # transformers and PEFT import torchao and bitsandbytes whenever they are installed (hone's
    # `quant` extra); on import those log that their GPU-only kernels do not load on this
    # machine, and torch logs a deprecation of torchao's. None of it is about the user's run.
    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if not load_libraries:
        return
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        # CRITICAL, not ERROR: datasets logs a bad file at ERROR ("Failed to load JSON from
        # file ...") right before raising, and hone's own message says it better, with the line.
        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:  # not installed: nothing to quieten
        pass


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set training.max_steps=100 (values are YAML; "
        "list elements by index: data.datasets.0.path=x.jsonl); repeatable",
    )


def _load(args: argparse.Namespace, check_files: bool = True, output_dir: bool = True, build_preset: bool = True):
    """Validate the config and (optionally) what it names on disk: data files, the model
    directory's metadata, the tokenizer, and (``output_dir``) that the run directory can be
    written. Warnings (options the user opted into) go to stderr. ``build_preset=False``: a
    preset's overrides are checked without building its config (no torch import)."""
    from hone.config import ConfigError, load_config
    from hone.preflight import run_preflight

    cfg = load_config(args.config, args.overrides)
    if check_files:
        checked = run_preflight(cfg, output_dir=output_dir, build_preset=build_preset)
        if checked.issues:
            from hone.config.loader import mark_overridden

            raise ConfigError(mark_overridden(checked.issues, args.overrides), str(args.config))
        for warning in checked.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    return cfg


def _experts_format(cfg) -> str | None:
    """``experts in MXFP4 as shipped`` for a checkpoint whose config.json says so."""
    from hone.models.model_dir import ships_mxfp4

    return "experts in MXFP4 as shipped (LoRA only)" if ships_mxfp4(cfg.model) else None


def cmd_validate(args: argparse.Namespace) -> int:
    """A verdict and a short summary; ``--verbose`` adds the resolved config (every default)."""
    from hone.config.loader import dump_config
    from hone.config.summary import summarize

    cfg = _load(args, build_preset=False)
    if args.full or args.verbose:
        print(f"# {args.config}: valid. Resolved config (defaults filled in):")
        print(dump_config(cfg), end="")
        return 0
    print(f"{args.config}: valid")
    print("\n".join(summarize(cfg, _experts_format(cfg))))
    print(f"  (every setting with its default: hone validate {args.config} --verbose)")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from hone.config import HoneConfig

    text = json.dumps(HoneConfig.model_json_schema(), indent=2)
    if args.output:
        from hone.atomic import atomic_write_text

        atomic_write_text(args.output, text + "\n")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    cfg = _load(args, output_dir=False)
    from hone.data.prepare import prepare_data
    from hone.data.summary import render_summary
    from hone.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    prepared = prepare_data(cfg, tokenizer, use_cache=not args.no_cache)
    print(render_summary(prepared))
    if args.show:
        import os

        from hone.data.show import render_rows

        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        print(render_rows(prepared.train, tokenizer, args.show, color=color))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise HoneError(f"--nproc-per-node {args.nproc_per_node}: give a number of processes of at least 1")
    if args.overwrite:
        args.overrides = [*args.overrides, "training.overwrite_output_dir=true"]
    if args.nproc_per_node is not None and args.nproc_per_node > 1:
        return launch_torchrun(args)
    from hone.runtime.world import world_from_env
    from hone.train.start_guard import StartGuard

    world = world_from_env()
    if world.distributed:  # a rank never outlives its launcher (see hone.train.lifeline)
        from hone.train.lifeline import die_with_launcher

        die_with_launcher()
    guard = StartGuard()
    cfg = None
    try:
        with guard:  # a start that fails before step 1 leaves nothing behind
            cfg = _load(args)
            if cfg.training.overwrite_output_dir and world.is_main:  # before the guard records the directory
                from hone.train.run import overwrite_output_dir

                overwrite_output_dir(cfg.training.output_dir, lambda message: print(message, file=sys.stderr))
            if world.is_main:  # rank 0 owns the run directory (and its lock); the others never undo its files
                guard.watch(cfg.training.output_dir)
            from hone.train.run import run_training

            result = run_training(cfg, step_callback=guard.on_step)
    except KeyboardInterrupt as exc:  # a second Ctrl-C, or one before the loop: say what is left
        if cfg is None:
            raise
        if world.is_main:
            from hone.train.rerun import stopped_now_message

            message = stopped_now_message(cfg.training.output_dir, getattr(exc, "step", None), guard.started)
            print(message, file=sys.stderr, flush=True)
        return 130
    if result.interrupted:  # a checkpoint was saved; the conventional signal exit codes
        return 143 if result.interrupted == "SIGTERM" else 130
    return 0


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """``python -m hone.train.torchrun --standalone --nproc-per-node N -m hone train CFG ...``: the same
    ``hone train`` (config, overrides, verbosity) in N processes of this host, with torchrun's
    single-host rendezvous (:mod:`hone.train.torchrun` is torchrun with a one-line failure)."""
    command = [
        sys.executable,
        "-m",
        "hone.train.torchrun",
        "--standalone",
        f"--nproc-per-node={args.nproc_per_node}",
        "-m",
        "hone",
    ]
    if args.verbose:
        command.append("--verbose")
    command += ["train", str(args.config)]
    for override in args.overrides:
        command += ["--set", override]
    return command


def launch_torchrun(args: argparse.Namespace) -> int:
    """``hone train CFG --nproc-per-node N``: check what can be checked here (the config, the
    process count against the GPUs), then become ``torchrun`` running ``hone train`` N times."""
    import os

    from hone.runtime.world import World, world_from_env
    from hone.train.distributed import DistributedSetupError, check_launch

    if world_from_env().distributed:
        raise DistributedSetupError(
            f"--nproc-per-node {args.nproc_per_node}: this process was itself started by torchrun; "
            "give the process count to one of them (torchrun --nproc-per-node N -m hone train CFG, "
            "or hone train CFG --nproc-per-node N), not both"
        )
    cfg = _load(args)
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.nproc_per_node
    check_launch(cfg, World(0, n, 0), device_type, local_processes=n)
    from hone.train.lifeline import LAUNCHER_PID_ENV
    from hone.train.run_lock import RunDirLocked, lock_problem

    problem = lock_problem(cfg.training.output_dir)  # refused here, not in N ranks' tracebacks
    if problem is not None:
        raise RunDirLocked(problem)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # torchrun keeps this pid: the ranks' parent
    command = torchrun_command(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)  # torchrun takes over this process: signals are its
    return 0  # not reached


def cmd_generate(args: argparse.Namespace) -> int:
    from hone.export.generate import generate, load_for_inference
    from hone.train.device import checked_device

    device = checked_device(args.device) if args.device is not None else None
    model, tokenizer = load_for_inference(args.run_dir, device=device)
    prompts = args.prompt or []
    for prompt in prompts:
        text = generate(
            model,
            tokenizer,
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            chat=args.chat,
        )
        print(f">>> {prompt}\n{text}\n")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from hone.export.merge import merge_adapter

    out = merge_adapter(args.run_dir, args.output)
    print(f"merged model written to {out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import shlex

    from hone.bench.harness import run_bench
    from hone.bench.report import write_reports
    from hone.bench.spec import load_spec, parse_spec

    if args.spec is not None:
        spec = load_spec(args.spec, args.overrides, args.only)
    elif args.only:
        raise HoneError("--only picks conditions of a spec file: give one (hone bench SPEC.yml --only ...)")
    elif args.preset is not None:
        spec = parse_spec(
            {
                "name": f"{args.preset} seq {args.seq}",
                "workload": {"preset": args.preset, "layers": args.layers, "sequence_len": args.seq},
                "conditions": [
                    {"name": "reference", "reference": "hf-peft", "gradient_checkpointing": args.checkpointing},
                    {"name": "hone", "set": {"memory.activation_checkpointing": "full" if args.checkpointing else "none"}},
                ],
                "warmup_steps": args.warmup,
                "timed_steps": args.steps,
            },
            "flags",
        )
    else:
        raise HoneError("give a spec file (hone bench SPEC.yml) or --preset for the quick form")
    out = args.out or Path("results") / spec.name.replace(" ", "-").replace("/", "-")

    def show(row: dict) -> None:
        if row["status"] == "ok":
            print(
                f"  {row['condition']} #{row['replicate']}: {row['median_ms']:.1f} ms/step, "
                f"first step {row['first_step_s']:.1f} s, peak {row['peak_alloc_gib']} GiB, loss {row['final_loss']}",
                flush=True,
            )
        else:
            print(f"  {row['condition']} #{row['replicate']}: {row['status']}: {row['error']}", flush=True)

    command = "hone bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    if spec.kind != "table":  # one process per (condition, length)
        from hone.bench.longest import run_by_length, write_lengths_report

        print(f"hone bench: {spec.name}: {spec.kind} over {len(spec.conditions)} conditions -> {out}", flush=True)

        def show_length(row: dict) -> None:
            if row["status"] == "summary":
                print(f"  {row['condition']}: longest {row['longest']:,} tokens", flush=True)
            elif row["status"] == "ok":
                print(
                    f"  {row['condition']} @ {row['sequence_len']:,}: {row['tokens_per_s']:,.0f} tok/s, "
                    f"GPU {row.get('peak_alloc_gib')} GiB, host {row.get('peak_host_gib')} GiB",
                    flush=True,
                )
            else:
                print(f"  {row['condition']} @ {row['sequence_len']:,}: {row['status']}: {row['error']}", flush=True)

        rows = run_by_length(spec, out, on_row=show_length)
        table = write_lengths_report(spec, rows, out, command)
        print(table.read_text())
        print(f"results: {out / 'results.jsonl'}, {table}")
        # a longest search expects failures (that is how it finds the limit); lengths do not
        return 0 if spec.kind == "longest" or all(r["status"] == "ok" for r in rows) else 1
    refusals = _bench_refusals(spec, args.spec if args.spec is not None else spec.name)
    if refusals:  # before any row runs: a refused row would fail at its start, after the rows before it
        raise HoneError(
            f"{len(refusals)} condition(s) of the spec would be refused (nothing was run; `hone plan SPEC` shows "
            "each plan):\n" + "\n".join(refusals)
        )
    print(f"hone bench: {spec.name}: {len(spec.conditions)} conditions x {spec.replicates} replicate(s) -> {out}", flush=True)
    rows = run_bench(spec, out, on_row=show)
    table, chart = write_reports(spec, rows, out, command=command)
    print(table.read_text())
    print(f"results: {out / 'results.jsonl'}, {table}, {chart}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _plan_configs(args: argparse.Namespace) -> list[tuple[str, object, int, bool]]:
    """(title, config, processes, own data) to plan: the config file (``--nproc-per-node``; its
    data may be prepared), or each hone condition of a bench spec (a YAML file with a
    ``workload``; its ``nproc`` unless the flag is given), whose data is random tokens the bench
    writes, which need not exist."""
    import yaml

    try:
        raw = yaml.safe_load(args.config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        raw = None  # load_config reports it
    seq_len = getattr(args, "seq_len", None)
    if seq_len is not None and seq_len < 8:
        raise HoneError(f"--seq-len {seq_len}: give a sequence length of at least 8 tokens")
    if isinstance(raw, dict) and "workload" in raw:
        from hone.bench.spec import load_spec

        spec_overrides = list(args.overrides or []) + ([f"workload.sequence_len={seq_len}"] if seq_len else [])
        return _spec_configs(load_spec(args.config, spec_overrides), args.config, args.nproc_per_node)
    from hone.config import ConfigError, load_config
    from hone.preflight import preflight

    cfg = load_config(args.config, list(args.overrides or []) + ([f"data.sequence_len={seq_len}"] if seq_len else []))
    missing = preflight(cfg, output_dir=False, weights=False)
    needed = [issue for issue in missing if issue.path.startswith("model.")]
    if needed:  # the model's config.json is read; the data is not
        raise ConfigError(needed, str(args.config))
    for issue in missing:
        print(f"note: {issue.path}: {issue.message} (not needed for the plan)", file=sys.stderr)
    return [(str(args.config), cfg, args.nproc_per_node or 1, True)]


def _spec_configs(spec, label: object, processes: int | None = None) -> list[tuple[str, object, int, bool]]:
    """:func:`_plan_configs`'s rows for each hone condition of a loaded bench spec (``processes``:
    instead of each condition's ``nproc``)."""
    from hone.bench.worker import _hone_config

    scratch = Path("bench-scratch")
    random_rows = scratch / "random.jsonl"
    return [
        (f"{label} [{c.name}]", _hone_config(spec, c, scratch, random_rows), processes or c.nproc, False)
        for c in spec.conditions
        if c.reference is None
    ]


def _plan_facts(cfg, processes: int, own_data: bool, device: str, budget: int | None, host_budget: int | None):
    """The :class:`RunFacts` the plan decides with: the device, its memory budget, the processes
    and what is known of the data."""
    import torch

    from hone.runtime.world import World
    from hone.transforms.base import RunFacts

    world, data = World(0, processes, 0), _prepared_data_facts(cfg, own_data)
    return RunFacts(torch.device(device), memory_bytes=budget, world=world, host_memory_bytes=host_budget, **data)


def _refusal(cfg, facts, decided=None) -> str | None:
    """What ``hone train`` would refuse before loading anything (its whole message), or None."""
    from hone.transforms.planner import PlanError, plan_optimizations

    try:
        plan_optimizations(cfg, facts, decided=decided)
    except PlanError as refusal:
        return str(refusal)
    return None


def cmd_plan(args: argparse.Namespace) -> int:
    from hone.transforms.card import host_memory
    from hone.transforms.plan_report import device_memory, plan_view, render_plan

    host_budget, host_source = host_memory(getattr(args, "host_memory", None))
    configs = _plan_configs(args)
    if not configs:
        raise HoneError(f"{args.config}: the bench spec has no hone condition to plan (only reference rows)")
    from hone.transforms.decide import decide
    from hone.transforms.planner import decisions

    refused = 0
    for title, cfg, processes, own_data in configs:
        budget, source = device_memory(args.device, args.gpu_memory, cfg.memory.gpu_memory_bytes)
        facts = _plan_facts(cfg, processes, own_data, args.device, budget, host_budget)
        decided = decide(cfg, facts)
        view = plan_view(cfg, title, args.device, budget, source, host_budget, host_source, decided, processes)
        print(render_plan(view, transforms=decisions(cfg, facts, decided=decided), wide=args.wide), flush=True)
        refusal = _refusal(cfg, facts, decided)  # said in full, not only in a cut table cell
        if refusal is not None:
            refused += 1
            print(f"error: {title}: {refusal}", file=sys.stderr, flush=True)
    return 2 if refused else 0


def _bench_refusals(spec, label: object) -> list[str]:
    """``title: message`` of every hone condition of ``spec`` its run would refuse at its start,
    planned as the bench's worker plans it (this machine's device and memory, the row's
    processes), so a spec with a refused row spends no GPU time on the rows before it."""
    import torch

    from hone.transforms.card import host_memory
    from hone.transforms.plan_report import device_memory

    device = "cuda" if torch.cuda.is_available() else "cpu"
    host_budget, _ = host_memory(None)
    refusals = []
    for title, cfg, processes, own_data in _spec_configs(spec, label):
        budget, _ = device_memory(device, None, cfg.memory.gpu_memory_bytes)
        refusal = _refusal(cfg, _plan_facts(cfg, processes, own_data, device, budget, host_budget))
        if refusal is not None:
            refusals.append(f"{title}: {refusal}")
    return refusals


def _prepared_data_facts(cfg, own_data: bool) -> dict:
    """What the plan knows of the data (:class:`RunFacts` fields): the prepared data's statistics
    where ``hone preprocess`` (or a run) has cached them, as the run reads them (exact row and
    pair lengths); else what the config implies, with a note. A bench spec's rows (not
    ``own_data``) are random tokens, made by the bench: the config's bounds."""
    from hone.train.run import data_facts, shape_note

    if own_data:
        from hone.data.prepare import prepared_stats
        from hone.models.tokenizer import load_tokenizer

        try:
            stats = prepared_stats(cfg, load_tokenizer(cfg.model))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot load here: the config's bounds
            stats = None
        if stats is not None:
            print("note: the plan uses the prepared data's statistics (row and pair lengths), as the run will", file=sys.stderr)
            return {**data_facts(cfg, stats), "shapes_known": True}
        print("note: the data is not prepared: the plan assumes the config's bounds (run `hone preprocess` for exact lengths)",
              file=sys.stderr)  # fmt: skip
    return {"shape_note": shape_note(cfg, None), "shapes_known": False}


# --- hone convert / hone chat (issue 16) ----------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    """Translate an Axolotl config, write it atomically, then validate it with hone's loader."""
    import yaml

    from hone.atomic import atomic_write_text
    from hone.config import ConfigError, load_config
    from hone.convert.axolotl import convert_axolotl, render_conversion

    try:
        raw = yaml.safe_load(args.source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HoneError(f"Axolotl config not found: {args.source}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise HoneError(f"cannot read the Axolotl config {args.source}: {exc}") from None
    if not isinstance(raw, dict):
        raise HoneError(f"{args.source}: an Axolotl config is a mapping of keys, got {type(raw).__name__}")
    if args.output.exists() and not args.force:
        raise HoneError(f"{args.output} exists: pass --force to overwrite it, or choose another -o")
    conversion = convert_axolotl(raw)
    atomic_write_text(args.output, render_conversion(conversion, str(args.source)))
    print(f"wrote {args.output}")
    if conversion.untranslated:
        print(f"not translated ({len(conversion.untranslated)}):")
        for item in conversion.untranslated:
            print(f"  {item.key}: {item.reason}")
    for note in conversion.notes:
        print(f"note: {note}")
    try:
        load_config(args.output)
    except ConfigError:
        print(f"{args.output} does not validate; fix it by hand:", file=sys.stderr)
        raise
    print(f"{args.output}: valid (schema and combinations; run `hone validate {args.output}` to check the files it names)")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from hone.export.chat import chat_loop, load_chat_model
    from hone.train.device import checked_device

    device = checked_device(args.device) if args.device is not None else None
    model, tokenizer, setup = load_chat_model(args.run_dir, device=device)
    return chat_loop(
        model,
        tokenizer,
        setup,
        sys.stdin,
        sys.stdout,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        system=args.system,
        interactive=sys.stdin.isatty(),
    )


def _add_convert_and_chat(add: Callable[..., argparse.ArgumentParser]) -> None:
    p = add(
        "convert",
        cmd_convert,
        "translate an Axolotl config into a hone config",
        "Translate the Axolotl config SOURCE into a hone config (-o), listing every key that has no "
        "hone equivalent with the reason (printed, and as a comment block at the top of the output), "
        "then validate the result with hone's config loader (exit 0 valid, 2 not). A config of an objective or "
        "modality hone does not train (rl, reward models, multimodal, diffusion) is refused: exit 2, nothing "
        "written. See docs/convert.md.",
    )
    p.add_argument("source", type=Path, help="Axolotl YAML config")
    p.add_argument("--output", "-o", type=Path, required=True, help="hone YAML config to write")
    p.add_argument("--force", action="store_true", help="overwrite --output if it exists")

    p = add(
        "chat",
        cmd_chat,
        "chat with a fine-tuned run (or a model directory) in the terminal",
        "Load the final adapter or model of RUN (a training.output_dir), or a model directory, and chat: "
        "each line you type is a user turn, rendered with the run's chat template together with the "
        "conversation so far; the reply streams as it is generated. /reset starts a new conversation, "
        "/exit (or Ctrl-D) quits.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN", help="run directory written by `hone train`, or a model directory")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (with --temperature > 0)")
    p.add_argument("--system", default=None, help="system message at the start of every conversation")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")


# --- end hone convert / hone chat -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hone",
        description="Fine-tune Hugging Face causal language models from one YAML file.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hone {__version__}")
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="keep the libraries' own progress bars, warnings and log lines, and show the traceback behind an error",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help_text: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    p = add(
        "validate",
        cmd_validate,
        "check a config and summarize what it trains",
        "Validate CONFIG (schema, value ranges, combinations, and that the files it names exist) "
        "without loading a model or data. Prints a short summary (--verbose: the resolved config "
        "with every default filled in), or every problem at once with its key path, line and what "
        "is allowed; exits 2 on any problem.",
    )
    _add_config_args(p)
    p.add_argument(
        "--verbose",
        "-v",
        dest="full",
        action="store_true",
        help="print the resolved config with every default filled in",
    )

    p = add(
        "schema",
        cmd_schema,
        "print the JSON schema of the config",
        "Print the JSON schema of hone's config (for editor completion and docs).",
    )
    p.add_argument("--output", "-o", type=Path, help="write to this file instead of stdout")

    p = add(
        "plan",
        cmd_plan,
        "estimate memory by component and what fits, without loading weights",
        "Validate CONFIG and print, without loading weights or data: the optimizations it asks "
        "for, the estimated peak GPU memory by component (weights, trainable state, optimizer, "
        "activations, loss, workspace) under each activation-checkpointing policy against the "
        "card's memory, and the longest sequence each policy fits. CONFIG may also be a bench "
        "spec (each hone condition is planned). See docs/plan.md.",
    )
    _add_config_args(p)
    p.add_argument(
        "--gpu-memory",
        help="plan for a card of this size, e.g. 80GiB, 24GB, 141GiB (default: the local CUDA device's memory, else 80GiB)",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="device the run trains on (resolves torch_compile: auto); default cuda",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="plan for N data-parallel processes (resolves distributed.strategy: auto); default 1",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help="plan at this sequence length instead of the config's data.sequence_len (a bench spec's workload.sequence_len)",
    )
    p.add_argument(
        "--host-memory",
        default=None,
        help="host memory for offloaded layer inputs and the process, e.g. 128GiB (default: this machine's RAM)",
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="print everything: the planner's reasons in full and the longest sequence of every combination "
        "(default: at most 100 columns)",
    )

    p = add(
        "preprocess",
        cmd_preprocess,
        "tokenize and cache the datasets, print a summary",
        "Load, format, tokenize and cache the datasets of CONFIG, then print rows, tokens, trained "
        "tokens, dropped/truncated rows, a length histogram and the cache path. A later "
        "`hone train` with the same data options reuses the cache.",
    )
    _add_config_args(p)
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the cache")
    p.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="print the first N training rows as the model sees them, trained tokens marked (see docs/datasets.md)",
    )

    p = add(
        "train",
        cmd_train,
        "fine-tune a model",
        "Fine-tune the model of CONFIG. Outputs go to training.output_dir: the resolved config, "
        "metrics.jsonl, TensorBoard events, loss.png, checkpoints and the final adapter or model. "
        "Ctrl-C stops after the step in progress and saves a checkpoint (a second Ctrl-C stops at once); "
        "`--set training.resume=latest` continues from the last checkpoint, --overwrite starts over. "
        "--nproc-per-node N trains data-parallel in N processes (one per GPU) through torchrun; "
        "see docs/distributed.md for torchrun itself and several hosts.",
    )
    _add_config_args(p)
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="train in N processes of this host (one per GPU; gloo on CPU) under torchrun (default: one process)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a training.output_dir holding an earlier run, removing its files first "
        "(sets training.overwrite_output_dir; only a directory holding nothing but hone's run files is cleared)",
    )

    p = add(
        "generate",
        cmd_generate,
        "generate text with a fine-tuned run",
        "Load the final adapter or model of RUN_DIR (a training.output_dir) and complete prompts.",
    )
    p.add_argument("run_dir", type=Path, help="run directory written by `hone train`")
    p.add_argument("--prompt", "-p", action="append", required=True, help="prompt text; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the chat template (default: as the run's data was formatted)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")

    p = add(
        "merge",
        cmd_merge,
        "merge a LoRA adapter into its base model",
        "Merge the LoRA adapter of RUN_DIR into the base weights and save a full model (safetensors).",
    )
    p.add_argument("run_dir", type=Path, help="run directory written by `hone train`")
    p.add_argument("--output", "-o", type=Path, required=True, help="directory for the merged model")

    p = add(
        "bench",
        cmd_bench,
        "time hone against a plain transformers + PEFT reference",
        "Run each condition of SPEC (a YAML benchmark spec: workload, conditions, replicates) in a "
        "fresh process through the code path of `hone train`, beside the built-in hf-peft "
        "reference, and write results.jsonl, table.md (ratios to the reference) and chart.png. "
        "A failing condition becomes a row that says so. See benchmarks/README.md.",
    )
    p.add_argument("spec", type=Path, nargs="?", help="benchmark spec (YAML)")
    p.add_argument("--out", type=Path, help="results directory (default results/<spec name>)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec key, e.g. --set timed_steps=20",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="CONDITION",
        help="run only this condition of the spec: its exact name or its number (1 is the first); repeat for more",
    )
    quick = p.add_argument_group("quick form (no spec file): reference vs hone on one preset")
    quick.add_argument("--preset", help="architecture preset, e.g. qwen3-8b")
    quick.add_argument("--seq", type=int, default=2048)
    quick.add_argument("--layers", type=int, default=None)
    quick.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=False)
    quick.add_argument("--warmup", type=int, default=4)
    quick.add_argument("--steps", type=int, default=12)

    _add_convert_and_chat(add)  # hone convert, hone chat
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("validate", "plan", "preprocess", "train", "generate", "merge", "chat"):
        _prepare_libraries(args.verbose, load_libraries=args.command != "validate")
    try:
        return args.func(args)
    except HoneError as exc:
        if getattr(exc, "quiet", False):  # another rank failed and said so itself
            return exc.exit_code
        if args.verbose and exc.__cause__ is not None:  # the traceback of what went wrong inside
            import traceback

            traceback.print_exception(exc.__cause__)
        print(f"error: {_rank_prefix()}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not an error of ours
        sys.stderr.close()
        return 0


def _rank_prefix() -> str:
    """``[rank 1] `` in a process that torchrun started among several (so a message says whose it is)."""
    import os

    world = os.environ.get("WORLD_SIZE")
    if world and world != "1":
        return f"[rank {os.environ.get('RANK', '?')}] "
    return ""


if __name__ == "__main__":
    sys.exit(main())
