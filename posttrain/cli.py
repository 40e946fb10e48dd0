"""``posttrain`` command line: the trainers (``posttrain sft|reward|dpo|ppo|distill|grpo|rloo|kto``, each
``posttrain.scripts.<name>``), ``posttrain plan`` (the memory planner) and ``posttrain
accelerate-config NAME`` (a shipped accelerate config's path)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from posttrain.errors import ConfigError
from posttrain.placement.launch import accelerate_config_command
from posttrain.placement.roles import MIXES
from posttrain.planner import longest, memory
from posttrain.planner import shapes as model_shapes


def _plan(argv: list[str]) -> int:
    try:
        return _plan_checked(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


def _plan_checked(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="posttrain plan", description="Per-GPU memory per role and mix; "
                                 "recommends the fastest mix that fits.")
    ap.add_argument("--workload", choices=list(memory.WORKLOADS), default="dpo")
    ap.add_argument("--shape", default="1b", help=f"a preset ({', '.join(memory.SHAPES)}), hub name or local path")
    ap.add_argument("--role-shape", action="append", default=[], metavar="ROLE=SHAPE")
    ap.add_argument("--mix", default="all", help=f"one of {', '.join(MIXES)}, trl-zero2, trl-zero3, or all")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--gpu-memory", type=float, default=139.0, help="GiB per GPU (an H200 shows 139.8)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--generation-backend", choices=["posttrain", "hf"], default="posttrain",
                    help="online workloads: posttrain.rollout (KV cache and graph held for the run) or generate")
    ap.add_argument("--master-weights", choices=["fp32", "bf16", "both"], default="both",
                    help="trained roles' optimizer precision: fp32 master weights and Adam states (16 bytes per "
                         "parameter, the default), bf16 (8, TRL's with a bf16 model), or both")
    ap.add_argument("--single-process-engine", "--single_process_engine", choices=["auto", "deepspeed", "torch"],
                    default="auto", help="world size 1: trained roles without a DeepSpeed engine (posttrain.placement.plain; "
                    "auto: for bf16 master weights, and for fp32 ones unless the workload decodes a trained role "
                    "(GRPO, RLOO, PPO), as the trainers' setting of that name)")
    ap.add_argument("--gradient-accumulation-steps", "--gradient_accumulation_steps", type=int, default=1,
                    help="micro-batches per optimizer step: above 1, ZeRO-1/2's accumulated gradient partition is "
                         "live in backward")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="trained roles recompute activations in backward (the DPO/GRPO/RLOO trainers' default)")
    ap.add_argument("--generation-fused-projections", "--generation_fused_projections", action="store_true",
                    help="the trainers' setting of that name: count the rollout engine's fused q|k|v and "
                         "gate|up copies where it makes them (a policy on the torch path, or with LoRA; "
                         "DeepSpeed's weights are fused as views, at no cost)")
    ap.add_argument("--generation-lora-mode", "--generation_lora_mode", choices=["auto", "merged", "live", "grouped"],
                    default="auto", help="the trainers' setting of that name, with --use-peft: merged counts a copy "
                    "of every adapted weight, grouped only the adapters' rows beside the base it reads in place "
                    "(auto: grouped)")
    ap.add_argument("--generation-shared-prompt-kv", "--generation_shared_prompt_kv", action="store_true",
                    help="the trainers' setting of that name: the rollout engine holds each prompt's KV once per "
                         "group of --num-generations rows (GRPO, RLOO)")
    ap.add_argument("--num-generations", "--num_generations", type=int, default=8,
                    help="completions per prompt (TRL's default 8), with --generation-shared-prompt-kv")
    ap.add_argument("--use-peft", "--use_peft", action="store_true",
                    help="LoRA (TRL's flag): the trained model's base is frozen and only its adapters train; no "
                         "reference role (the base with adapters disabled is the reference)")
    ap.add_argument("--lora-r", "--lora_r", type=int, default=16, help="LoRA rank (TRL's default 16)")
    ap.add_argument("--lora-dropout", "--lora_dropout", type=float, default=0.05,
                    help="LoRA dropout (TRL's default 0.05): a copy of each adapted layer's input kept for backward")
    ap.add_argument("--lora-target-modules", "--lora_target_modules", nargs="+", default=None, metavar="NAME",
                    help="modules that get adapters: names, or all-linear (default: peft's for the architecture)")
    ap.add_argument("--tool-tokens", "--tool_tokens", type=int, default=0,
                    help="GRPO/RLOO with tools: tool output tokens per sequence, inside --response-len (the KV "
                         "holds the prompt and every turn: --seq-len columns per sequence)")
    ap.add_argument("--generation-batch-size", "--generation_batch_size", type=int, default=None,
                    help="GRPO/RLOO/PPO: sequences generated at once over all processes (TRL's generation_batch_size, "
                         "a multiple of --micro-batch x --world-size; default one micro-batch per process)")
    ap.add_argument("--generation-kv-slots", "--generation_kv_slots", type=int, default=None,
                    help="the trainers' setting of that name: the rollout engine's KV cache holds this many sequences "
                         "and streams the rest through them (default: every sequence generated at once)")
    ap.add_argument("--vllm-enable-sleep-mode", "--vllm_enable_sleep_mode", action="store_true",
                    help="GRPO/RLOO: TRL's flag; posttrain's engine frees its KV cache and graphs while the policy "
                         "trains, so they count in the generate phase, not at rest")
    ap.add_argument("--repetition-penalty", "--repetition_penalty", type=float, default=1.0,
                    help="GRPO/RLOO: TRL's field (1: off); on posttrain's engine each slot keeps a set of the tokens "
                         "it holds and the step's sampler a larger pool")
    ap.add_argument("--async-generation", "--async_generation", action="store_true",
                    help="GRPO/RLOO: the trainers' streaming generation; counts the outputs of the sequences started and "
                         "not yet trained (the KV cache is the slots', as without it)")
    ap.add_argument("--max-staleness", "--max_staleness", type=int, default=4,
                    help="with --async-generation: TRL AsyncGRPO's bound, default 4 (max_staleness + 1 generation "
                         "batches in flight, max_inflight_tasks' default)")
    ap.add_argument("--generation-processes", "--generation_processes", type=int, default=0,
                    help="with --async-generation: the last N of --world-size GPUs only generate (the policy's bf16 copy "
                         "and the engine), the others train")
    ap.add_argument("--longest-completion", action="store_true",
                    help="GRPO/RLOO/PPO: search the longest max_completion_length (--response-len) whose plan fits, "
                         "the prompt (--seq-len minus --response-len) and the rest fixed")
    ap.add_argument("--length-step", type=int, default=longest.LENGTH_STEP,
                    help=f"--longest-completion's granularity in tokens (default {longest.LENGTH_STEP})")
    args = ap.parse_args(argv)
    for name in ("world_size", "micro_batch", "seq_len", "lora_r", "num_generations", "length_step"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    if args.response_len < 0 or args.gpu_memory <= 0:
        raise ConfigError("--response-len must be 0 or more and --gpu-memory (GiB per GPU) more than 0")
    names = memory.WORKLOADS[args.workload]
    launched = args.world_size
    if args.generation_processes:
        if not args.async_generation or not 0 < args.generation_processes < launched:
            raise ConfigError(f"--generation-processes plans generation ranks of --async-generation, 1 to "
                              f"--world-size minus 1 ({launched - 1}); got {args.generation_processes}")
        args.world_size = launched - args.generation_processes  # the training ranks: what the mixes plan
    generation_rows = rollout_rows(args, names)
    if args.vllm_enable_sleep_mode and (args.workload not in ("grpo", "rloo") or args.async_generation):
        raise ConfigError("--vllm-enable-sleep-mode plans grpo or rloo without --async-generation (streamed sequences "
                          "keep their cache across steps)")
    from posttrain.rollout.sampling import check_repetition_penalty  # here: the sampler imports transformers

    check_repetition_penalty(args.repetition_penalty)
    if args.repetition_penalty != 1.0 and args.workload not in ("grpo", "rloo"):
        raise ConfigError(f"--repetition-penalty plans grpo or rloo, whose rollouts sample with it (got "
                          f"{args.workload}): drop it")
    streamed = 0
    if args.async_generation:
        if args.workload not in ("grpo", "rloo") or args.generation_backend != "posttrain" or args.max_staleness < 0:
            raise ConfigError("--async-generation plans grpo or rloo on --generation-backend posttrain, with "
                              f"--max-staleness 0 or more (got {args.workload}, {args.generation_backend}, "
                              f"{args.max_staleness})")
        streamed = (args.max_staleness + 1) * (generation_rows or args.micro_batch)
    shape = model_shapes.resolve_shape(args.shape)
    shapes = {}.fromkeys(names["trained"] + names["frozen"], shape)
    for item in args.role_shape:
        role, _, value = item.partition("=")
        if role not in shapes or not value:
            raise ConfigError(f"--role-shape {item!r}: expected ROLE=SHAPE with ROLE one of {', '.join(shapes)}")
        shapes[role] = model_shapes.resolve_shape(value, f"--role-shape {role}")
        if role == "reference" and args.use_peft:
            raise ConfigError("--use-peft has no reference role (the reference is the base with adapters disabled): "
                              "drop --role-shape reference=...")
    mixes = list(MIXES) if args.mix == "all" else [args.mix]
    for mix in mixes:
        memory.mix_configs(mix)  # an unknown mix: its sentence, before any model is sized
    lora = None
    if args.use_peft:
        lora = memory.Lora(args.lora_r, tuple(args.lora_target_modules) if args.lora_target_modules else None,
                           args.lora_dropout)
    elif args.lora_target_modules or args.lora_r != 16 or args.lora_dropout != 0.05:
        raise ConfigError("--lora-r, --lora-dropout and --lora-target-modules plan adapters: add --use-peft")
    if args.gradient_accumulation_steps < 1:
        raise ConfigError(f"--gradient-accumulation-steps must be 1 or more, got {args.gradient_accumulation_steps}")
    if not 0.0 <= args.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    precisions = ["fp32", "bf16"] if args.master_weights == "both" else [args.master_weights]
    # GRPO/RLOO's groups share a prompt; PPO and distillation decode one completion per prompt.
    shared_group = None
    if args.generation_shared_prompt_kv:
        shared_group = args.num_generations if args.workload in ("grpo", "rloo") else 1
    best_of: dict[str, memory.Plan | None] = {}

    def plan_for(mix: str, precision: str, seq_len: int, response_len: int) -> memory.Plan:
        return memory.plan(args.workload, shapes, mix, world_size=args.world_size, micro_batch=args.micro_batch,
                           seq_len=seq_len, response_len=response_len, master_weights=precision,
                           gradient_checkpointing=args.gradient_checkpointing,
                           generation_backend=args.generation_backend, gpu_memory_gib=args.gpu_memory, lora=lora,
                           single_process_engine=args.single_process_engine,
                           fused_projections=args.generation_fused_projections,
                           shared_prompt_group=shared_group, tool_tokens=args.tool_tokens,
                           generation_batch=generation_rows, kv_slots=args.generation_kv_slots,
                           streamed_rows=streamed, lora_mode=args.generation_lora_mode,
                           sleep_mode=args.vllm_enable_sleep_mode,
                           gradient_accumulation_steps=args.gradient_accumulation_steps,
                           repetition_penalty=args.repetition_penalty != 1.0)

    if args.generation_processes:
        print(generation_rank_line(args, shapes, launched, generation_rows or args.micro_batch, lora) + "\n")
        streamed = 0  # the generation ranks hold what streams; a training rank's engine is evaluation's
    if args.longest_completion:
        return _longest(args, mixes, precisions, plan_for)
    for precision in precisions:
        plans = [plan_for(m, precision, args.seq_len, args.response_len) for m in mixes]
        print(f"== master_weights {precision}: {memory.MASTER_WEIGHTS_TEXT[precision]} ==\n")
        if streamed:
            slots = args.generation_kv_slots or generation_rows or args.micro_batch
            print(f"streaming: {slots} sequences decode in the engine's slots at once; up to {streamed} per process "
                  f"started and not yet trained ({args.max_staleness + 1} generation batches), their outputs "
                  f"{memory.streamed_bytes(streamed, args.seq_len - args.response_len, args.response_len) / 2**20:.1f} "
                  "MiB, counted with the rollout\n")
        if args.tool_tokens:
            print(f"multi-turn: each sequence's KV holds its prompt and every turn ({args.seq_len} columns: "
                  f"{args.seq_len - args.response_len} prompt, {args.response_len} completion of which "
                  f"{args.tool_tokens} tool output)\n")
        for p in plans:
            print(memory.format_plan(p) + "\n")
        best_of[precision], why = memory.recommend(plans)
        print(f"recommended: {best_of[precision].mix if best_of[precision] else 'none'} — {why}"
              + (f" (master_weights {precision})" if len(precisions) > 1 else "") + "\n")
    if len(precisions) > 1:
        print(memory.precision_summary(best_of))
    return 0 if any(best_of.values()) else 1


def generation_rank_line(args: argparse.Namespace, shapes: dict[str, str], launched: int, rows: int,
                         lora: memory.Lora | None) -> str:
    """What one generation rank holds: the policy's bf16 copy, the engine over its share of each generation batch
    (each training rank's ``rows``), the started sequences' outputs, a prefill's working set."""
    from posttrain.planner.shapes import merged_adapter_params, model_size

    gib = 2**30
    gen, trainers = args.generation_processes, args.world_size
    vocab = memory.shared_vocab(shapes, args.workload)
    size = model_size(shapes["policy"], "causal", vocab)
    share = -(-rows * trainers // gen)  # sequences of one generation batch on this rank
    slots = args.generation_kv_slots or share
    prompt = args.seq_len - args.response_len
    copy = 2 * size.params + (2 * merged_adapter_params(shapes["policy"], lora, vocab) if lora is not None else 0)
    engine = memory.rollout_engine_bytes(size, slots, args.seq_len, 0, args.generation_fused_projections)
    held = memory.streamed_bytes((args.max_staleness + 1) * share, prompt, args.response_len)
    tokens = min(share, slots) * prompt
    prefill = memory.inference_bytes(size, tokens) - memory.HEAD_INFER_V * size.vocab * tokens
    total = copy + engine + held + prefill
    return (f"generation ranks: {gen} of {launched} GPUs generate, {trainers} train (planned below); each generation "
            f"rank holds the policy's bf16 copy {copy / gib:.2f} GiB + the engine's KV cache and graph pool for "
            f"{slots} sequences {engine / gib:.2f} + the outputs of {(args.max_staleness + 1) * share} started "
            f"sequences {held / gib:.2f} + a prefill's working set {prefill / gib:.2f} = {total / gib:.2f} GiB of "
            f"{args.gpu_memory:.1f}: {'fits' if total <= args.gpu_memory * gib else 'DOES NOT FIT'} (a training "
            "rank's posttrain.rollout line below is the engine evaluation builds: none without an eval_dataset)")


def rollout_rows(args: argparse.Namespace, names: dict[str, list[str]]) -> int | None:
    """Sequences one process generates at once (None: one micro-batch); the rollout flags checked."""
    rollout = [f for f in ("generation_batch_size", "generation_kv_slots") if getattr(args, f) is not None]
    if (rollout or args.longest_completion) and not names.get("decoded"):
        flags = ", ".join(f"--{f.replace('_', '-')}" for f in [*rollout, *(["longest_completion"]
                                                                          if args.longest_completion else [])])
        raise ConfigError(f"{flags}: {args.workload} generates nothing; these plan the rollout of grpo, rloo or ppo")
    if args.generation_kv_slots is not None and args.generation_kv_slots < 1:
        raise ConfigError(f"--generation-kv-slots must be 1 or more, got {args.generation_kv_slots}")
    if args.longest_completion and (args.seq_len <= args.response_len or args.tool_tokens):
        raise ConfigError("--longest-completion keeps the prompt (--seq-len minus --response-len, which must be 1 or "
                          "more) and searches the completion; drop --tool-tokens")
    if args.generation_batch_size is None:
        return None
    per_step = args.micro_batch * args.world_size
    if args.generation_batch_size < 1 or args.generation_batch_size % per_step:
        raise ConfigError(f"--generation-batch-size must be a multiple of --micro-batch x --world-size ({per_step}), "
                          f"got {args.generation_batch_size}")
    return args.generation_batch_size // args.world_size


def _longest(args: argparse.Namespace, mixes: list[str], precisions: list[str], plan_for) -> int:
    """``posttrain plan --longest-completion``: per precision and mix, the longest completion that fits."""
    prompt = args.seq_len - args.response_len
    found: list[longest.Longest] = []
    for precision in precisions:
        print(f"== master_weights {precision}: {memory.MASTER_WEIGHTS_TEXT[precision]} ==\n")
        for mix in mixes:
            result = longest.longest_completion(lambda n, m=mix, p=precision: plan_for(m, p, prompt + n, n),
                                                args.length_step)
            print(f"{mix}, prompts of {prompt} tokens: {result.line()}")
            found.append(result)
        print()
    best = max((r for r in found if r.length is not None), key=lambda r: r.length, default=None)
    if best is not None and best.plan is not None:
        print(f"the longest plan ({best.length:,} tokens):\n" + memory.format_plan(best.plan))
    return 0 if best is not None else 1


# Trainer commands: each runs posttrain.scripts.<name>.main(argv), as examples/<name>.py does.
TRAINERS = ("sft", "reward", "dpo", "ppo", "distill", "grpo", "rloo", "kto")


def _trainer(name: str, argv: list[str]) -> int:
    from posttrain.scripts.args import run_script

    module = f"posttrain.scripts.{name}"
    if importlib.util.find_spec(module) is None:
        print(f"posttrain {name} is not available in this version of posttrain ({module} is missing)",
              file=sys.stderr)
        return 2
    return run_script(importlib.import_module(module).main, argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plan": _plan, "accelerate-config": accelerate_config_command,
                **{t: (lambda a, t=t: _trainer(t, a)) for t in TRAINERS}}
    if not argv or argv[0] not in commands:
        names = ",".join(commands)
        print(f"usage: posttrain {{{names}}} [options]   (posttrain COMMAND --help for each)", file=sys.stderr)
        if argv and not argv[0].startswith("-"):
            import difflib

            near = difflib.get_close_matches(argv[0], list(commands), n=1)
            print(f"unknown command {argv[0]!r}" + (f": did you mean {near[0]!r}?" if near else ""),
                  file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
