"""Memory planner: per-GPU memory of every role under a mix, and the fastest mix that fits.

Model states (parameters, gradients, optimizer states) come from DeepSpeed's own estimators
(``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``); frozen
roles hold only 16-bit parameters (whole, or a 1/N shard plus a gathered working set). On top of
the states sits the largest transient of any phase: saved activations while a role trains, a
frozen forward's working set, or generation's KV cache. The activation coefficients are bytes per
token per decoder layer for a Llama-shaped model under bf16 with SDPA attention, as autograd saves
them (see ``train_activation_bytes``); they were checked against peaks measured on H200s
(benchmarks/results), which a test keeps within 15%.

LoRA (:class:`Lora`): the run's first trained role keeps its base frozen (16-bit, sharded as its
stage shards a trained model) and trains only its adapters, whose parameters, gradients and Adam
states are counted as a trained model of that many parameters; the reference is that base with
the adapters disabled, so there is no reference role.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from posttrain.errors import ConfigError
from posttrain.placement.dsconfig import master_weights, one_rank, params_offloaded, read_config, zero_stage
from posttrain.placement.plain import torch_roles
from posttrain.placement.roles import MIXES, STOCK_GATHER_MIXES, TRAINER_ROLES, roles_for, trained_config
from posttrain.planner.shapes import (
    SHAPES,
    Lora,
    ModelSize,
    adapter_params,
    merged_adapter_params,
    model_config,
    model_size,
)

GiB = 2**30


# Which roles each workload holds (its trainer's row of the role table: DPO with its reference, PPO
# with a reward model, GRPO/RLOO with a reference and Python reward functions; reward models are
# more frozen roles), and what kind of model each role is.
WORKLOADS: dict[str, dict[str, list[str]]] = {name: {kind: list(names) for kind, names in row.items()}
                                              for name, row in TRAINER_ROLES.items()}
ROLE_KINDS = {"policy": "causal", "reference": "causal", "student": "causal", "teacher": "causal",
              "value": "token", "reward": "sequence"}

# TRL's placements (trl.models.utils.prepare_deepspeed under one plugin): the frozen models get a
# copy of the trained role's config, at stage 0 unless that config is ZeRO-3.
BASELINES: dict[str, tuple[str, str]] = {"trl-zero2": ("zero2_train", "stage0"), "trl-zero3": ("zero3_train", "zero3_train")}

# posttrain's mixes from fastest to slowest (benchmarks/results): a replicated
# frozen model costs nothing to gather; a sharded one is gathered on every forward (posttrain.placement.frozen
# keeps that within a few percent); an offloaded one crosses PCIe on every forward; a ZeRO-3 policy
# also gathers to train and to generate.
SPEED_ORDER = ["zero2-replicated", "zero2-zero3", "zero2-zero3-offload", "zero3"]

# Bytes per token per decoder layer saved for backward (bf16, SDPA flash/efficient attention):
# two RMSNorms (fp32 input 4h, bf16 output fed to the projections 2h) = 12h; attention q 2h, k and v
# 2kv each, its output 2h and o_proj's contiguous input 2h = 6h + 4kv; MLP gate (SiLU input) 2f,
# SiLU output 2f, up 2f, down_proj input 2f = 8f; 2h more for residual/dropout bookkeeping (checked
# against H200 peaks, benchmarks/results).
ACT_H, ACT_KV, ACT_F = 20, 4, 8
# Causal-LM head per token and vocabulary entry while training: the bf16 logits, the contiguous
# shifted copy the log-prob kernel keeps, and their gradient when backward starts.
HEAD_TRAIN_V = 6
# A frozen forward keeps no activations: its working set is the bf16 logits plus one layer's
# intermediates.
HEAD_INFER_V = 2
# Optimizer step of a trained role with fp32 master weights, per parameter over N: under ZeRO-1/2
# DeepSpeed's step holds the bf16 gradient partition (2), its flat bf16 copy (2) and that copy cast
# to fp32 (4), 8 bytes/param/N as TRL's rows peak. posttrain's Session casts while flattening
# (zero_fixes.cast_grads_while_flattening): no flat bf16 copy, 6. ZeRO-3 steps one sub-group
# (sub_group_size, 1e9 parameters) at a time, with the same copies (6 under the Session).
STEP_BYTES = 8
STEP_BYTES_CAST = 6
# The same with bf16 master weights (master_weights: bf16): the gradient partition the optimizer
# reads is bf16 (2) and so are AdamW's temporaries (2). Derived from the fp32 figure, not measured.
STEP_BYTES_BF16 = 4
SUB_GROUP_SIZE = int(1e9)
# ZeRO-2 reduces a parameter larger than its gradient bucket outside the bucket (8B: the 525M-entry
# embedding and LM head): its bf16 gradient and fp32 averaging copies, 10 bytes per entry on the
# rank that reduces it.
OVERSIZED_GRAD_BYTES = 10
# DeepSpeed's ZeRO-3 default (posttrain's configs keep it): parameters a ZeRO-3 engine may keep
# gathered while it trains; a frozen ZeRO-3 engine with parameters offloaded fetches as many.
MAX_LIVE_PARAMETERS = int(1e9)


def shared_vocab(shapes: dict[str, str], workload: str) -> int:
    """The vocabulary every role of a run uses: the first trained role's."""
    main = shapes[WORKLOADS[workload]["trained"][0]]
    return SHAPES[main]["vocab_size"] if main in SHAPES else int(model_config(main).vocab_size)


def train_activation_bytes(m: ModelSize, tokens: int, checkpointing: bool = False) -> int:
    """Bytes saved for backward by a forward over ``tokens`` tokens, head included. With gradient
    checkpointing each decoder layer keeps only its bf16 input (2h per token) and one layer's
    activations exist at a time, while backward recomputes it (an estimate from the same
    coefficients, not yet checked against a GPU peak)."""
    per_layer = ACT_H * m.hidden + ACT_KV * m.kv_dim + ACT_F * m.intermediate
    head = HEAD_TRAIN_V * m.vocab if m.kind == "causal" else 8 * m.hidden
    layers = m.layers * 2 * m.hidden + per_layer if checkpointing else m.layers * per_layer
    return tokens * (layers + 8 * m.hidden + head)


def inference_bytes(m: ModelSize, tokens: int) -> int:
    """Peak working memory of a forward without gradients over ``tokens`` tokens."""
    layer = 2 * (2 * m.hidden + 3 * m.intermediate)
    head = HEAD_INFER_V * m.vocab if m.kind == "causal" else 0
    return tokens * (layer + head)


def kv_cache_bytes(m: ModelSize, sequences: int, length: int, prompt_slots: int | None = None,
                   prompt_len: int = 0) -> int:
    """Generation's KV cache: keys and values, bf16, every layer
    (2 * layers * kv_heads * head_dim * batch * (prompt + response) * 2 bytes). With the engine's
    shared prompt slots (``generation_shared_prompt_kv``), the rows hold their completions and
    each of ``prompt_slots`` slots a prompt of ``prompt_len``."""
    columns = sequences * length
    if prompt_slots is not None:
        columns = sequences * (length - prompt_len) + prompt_slots * prompt_len
    return columns * m.layers * 2 * m.kv_dim * 2


# posttrain.rollout's CUDA graph pool: the decode step's intermediates for one token, dominated
# by its float32 [batch, vocab] sampling tensors (logits, log-softmax, filtered, noised). An upper
# estimate, bytes per row per vocabulary entry; benchmarks/rollout_bench.py measures the pool
# (torch.cuda.memory_reserved() across capture).
GRAPH_POOL_BYTES_PER_ROW_VOCAB = 32


def fused_projection_bytes(m: ModelSize) -> int:
    """The engine's fused q|k|v and gate|up buffers (``generation_fused_projections``): those
    weights once more, bf16 (q's width is the hidden size in the Llama family)."""
    return m.layers * m.hidden * (m.hidden + 2 * m.kv_dim + 2 * m.intermediate) * 2


def rollout_engine_bytes(m: ModelSize, sequences: int, length: int, policy_stage: int,
                         fused_projections: bool = False, kv_cache: int | None = None) -> int:
    """What posttrain.rollout keeps for a whole run: its KV cache (``kv_cache``, default
    :func:`kv_cache_bytes` of every row), its graph pool, for a ZeRO-3 policy the persistent bf16
    copy the weights are gathered into once per rollout, and the fused projection buffers when
    they are asked for."""
    pool = GRAPH_POOL_BYTES_PER_ROW_VOCAB * sequences * m.vocab
    fused = fused_projection_bytes(m) if fused_projections else 0
    kv = kv_cache_bytes(m, sequences, length) if kv_cache is None else kv_cache
    return kv + pool + (2 * m.params if policy_stage == 3 else 0) + fused


@dataclass(frozen=True)
class Placement:
    trains: bool
    stage: int
    offload_params: bool = False
    reduce_bucket: int = 0  # ZeRO-2 gradient bucket (elements); ZeRO-3 derives it from the hidden size
    overlap_comm: bool = False
    master_weights: str = "fp32"  # a trained role's optimizer precision (dsconfig.master_weights)
    engine: str = "deepspeed"  # "torch": one process without a DeepSpeed engine (posttrain.placement.plain)
    cast_flat_grads: bool = False  # a trained role under posttrain's Session: STEP_BYTES_CAST

    @property
    def label(self) -> str:
        if self.engine == "torch":
            return "torch"
        if self.stage == 3:
            return "zero3-offload" if self.offload_params else "zero3"
        return "replicated" if self.stage == 0 else f"zero{self.stage}"


def placement(config: str | dict, trains: bool, one_process: bool = False) -> Placement:
    """A role's placement as the Session runs it: with ``one_process`` (a mix's config in a world
    of one) it is first simplified the way the Session does (dsconfig.one_rank)."""
    if config == "stage0":
        return Placement(trains, 0)
    cfg = read_config(config)
    if one_process:
        cfg, _ = one_rank(cfg, trains)
    zero = cfg.get("zero_optimization", {})
    bucket = zero.get("reduce_bucket_size", 5e8)
    return Placement(trains, zero_stage(cfg), params_offloaded(cfg), int(bucket) if bucket != "auto" else 0,
                     bool(zero.get("overlap_comm", False)), master_weights(cfg) if trains else "fp32")


def mix_configs(mix: str) -> tuple[str, str]:
    if mix in MIXES:
        return MIXES[mix]
    if mix in BASELINES:
        return BASELINES[mix]
    raise ConfigError(f"unknown mix {mix!r}: choose one of {', '.join([*MIXES, *BASELINES])}, or all")


@dataclass
class RolePlan:
    name: str
    size: ModelSize
    place: Placement
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # saved for backward (trained role) or a forward's working set (frozen)
    kv_cache: float = 0.0
    resident_grads: float = 0.0  # the part of ``grads`` DeepSpeed keeps between steps
    rollout: float = 0.0  # posttrain.rollout's cache, graph pool and ZeRO-3 copy, kept for the run
    adapters: int = 0  # LoRA: the parameters that train (its base is frozen); 0: the whole model trains

    @property
    def at_rest(self) -> float:
        return self.params + self.resident_grads + self.optimizer + self.rollout


@dataclass
class Plan:
    workload: str
    mix: str
    world_size: int
    gpu_memory: float
    roles: list[RolePlan]
    phases: dict[str, float] = field(default_factory=dict)  # transient bytes per phase

    @property
    def at_rest(self) -> float:
        return sum(r.at_rest for r in self.roles)

    @property
    def peak(self) -> float:
        return self.at_rest + max(self.phases.values(), default=0.0)

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_memory


def _states(r: RolePlan, world: int) -> None:
    """Memory a role holds between steps. For trained roles DeepSpeed's estimator gives the total
    of its states; its gradient share (6 bytes/param/N) exists only from backward to the step, so
    it counts in the train phase rather than at rest (seen on H200: a ZeRO-2 role holds 2P + 12P/N
    between steps, a ZeRO-3 role 16P/N, the extra 2P/N being its bf16 gradient partition)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p, n, place = r.size.params, world, r.place
    if place.trains and place.engine == "torch":
        # posttrain.placement.plain: the parameters in the optimizer's precision, their gradients (from
        # backward to the step; set to None after it) and AdamW's two states, nothing else.
        width = 2 if place.master_weights == "bf16" else 4
        r.params, r.grads, r.optimizer = width * p, width * p, 2 * width * p
    elif place.trains and place.master_weights == "bf16":
        # bf16 master weights, gradient partition and Adam states (DeepSpeed's estimators assume
        # fp32 ones). ZeRO-3 updates its bf16 partition in place (stage3.py shares the storage
        # when the dtypes match): 2 (weights) + 4 (Adam) + 2 (gradient partition) per param / N.
        # ZeRO-1/2 clone the bf16 partition into a master copy, 2 more per param / N, except in a
        # world of one, where Session.prepare lets the optimizer update the weights themselves
        # (session.share_bf16_master).
        adam, grad_partition = 4 * p / n, 2 * p / n
        if place.stage == 3:
            r.params, r.optimizer = 2 * p / n, adam
            r.grads, r.resident_grads = grad_partition, 2 * p / n
        else:
            r.params, r.optimizer = 2 * p, adam + (0 if n == 1 else 2 * p / n)
            r.grads = 2 * p + grad_partition
    elif place.trains and place.stage == 3:
        _, gpu, largest = estimate_zero3_model_states_mem_needs(p, r.size.largest_layer, num_gpus_per_node=n,
                                                                cpu_offload=False, zero_init=True)
        # 18 bytes/param/N + the largest layer gathered: 16-bit shard 2, fp32 master and Adam 12,
        # gradients 4 (the bf16 partition is kept, the rest is transient).
        r.params, r.optimizer = 2 * p / n, 12 * p / n
        r.grads = gpu - largest - r.params - r.optimizer
        r.resident_grads = 2 * p / n
    elif place.trains:
        _, gpu = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=n, cpu_offload=False)
        r.params, r.optimizer = 2 * p, 12 * p / n
        r.grads = gpu - r.params - r.optimizer
    elif place.stage == 3:
        # Frozen: only the 16-bit shard stays (on the CPU when offloaded).
        r.params = 0.0 if place.offload_params else 2 * p / n
    else:
        r.params = 2 * p


def _lora_states(r: RolePlan, world: int) -> None:
    """A LoRA role: its frozen 16-bit base (a 1/N shard under ZeRO-3), and the states of a trained
    model with the adapters' parameters."""
    adapters = RolePlan(r.name, replace(r.size, params=r.adapters, largest_layer=0), r.place)
    _states(adapters, world)
    # 16-bit on every path (posttrain.placement.plain keeps parameters outside the optimizer in bf16).
    base = 2 * r.size.params / (world if r.place.stage == 3 else 1)
    r.params = base + adapters.params
    r.grads, r.resident_grads, r.optimizer = adapters.grads, adapters.resident_grads, adapters.optimizer


def plan(
    workload: str,
    shapes: dict[str, str] | str,
    mix: str,
    *,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    response_len: int = 64,
    gpu_memory_gib: float = 139.0,
    generation_backend: str = "posttrain",
    master_weights: str = "fp32",
    gradient_checkpointing: bool = False,
    lora: Lora | None = None,
    single_process_engine: str = "auto",
    fused_projections: bool = False,
    shared_prompt_group: int | None = None,
) -> Plan:
    """Per-GPU memory of every role of ``workload`` under ``mix``.

    ``micro_batch`` counts prompts (PPO), pairs (DPO, two sequences each) or sequences (distill)
    per GPU; ``seq_len`` is the whole sequence (PPO: prompt plus ``response_len``).
    ``generation_backend`` (PPO): "posttrain" keeps its KV cache, graph pool and a ZeRO-3 policy's
    gathered copy for the whole run (at rest); "hf" (transformers' generate) holds them only while
    it generates. ``master_weights`` ("fp32" or "bf16") is the trained roles' optimizer precision,
    as the trainers' setting of that name; in a world of one the mix's configs are counted as the
    Session simplifies them (frozen ZeRO-3 roles replicated, one gradient bucket).
    ``gradient_checkpointing``: trained roles recompute their layers' activations in backward.
    ``lora``: the first trained role trains adapters (PPO's value model still trains in full, as
    the trainer does) and there is no reference role. ``single_process_engine`` (the trainers'
    setting): in a world of one, trained roles of a mix run without a DeepSpeed engine where the
    trainers would (posttrain.placement.plain.uses_torch: "auto" for bf16 master weights, and for fp32 ones in
    workloads whose trainer declares no decoded role, ``roles["decoded"]``: DPO, SFT, reward and
    distillation, planned without on-policy generation; "torch" always). ``fused_projections``: the
    rollout engine's fused projection copies (``generation_fused_projections``), for a whole run,
    where it copies: a policy on the torch path or with adapters (DeepSpeed's weights are views).
    ``shared_prompt_group``: the engine holds each prompt once for groups of that many rows
    (``generation_shared_prompt_kv`` with ``num_generations``)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    names = WORKLOADS[workload]
    if lora is not None:
        names = {**names, "frozen": [n for n in names["frozen"] if n != "reference"]}
    if isinstance(shapes, str):
        shapes = {}.fromkeys(names["trained"] + names["frozen"], shapes)
    train_cfg, frozen_cfg = mix_configs(mix)
    vocab = shared_vocab(shapes, workload)
    roles: list[RolePlan] = []
    # The Session simplifies a mix's placements in a world of one (not TRL's, nor the stock mix's).
    one_process = world_size == 1 and mix in MIXES and mix not in STOCK_GATHER_MIXES
    # The roles the Session would run on the torch path, by its own rule on the trainer's declaration.
    torch_path = torch_roles(roles_for(names["trained"], names["frozen"], mix, master_weights=master_weights,
                                       decoded=names.get("decoded", ())), single_process_engine,
                             world_size=world_size, mixed_precision="bf16") if mix in MIXES else set()
    for name in names["trained"] + names["frozen"]:
        trains = name in names["trained"]
        size = model_size(shapes[name], ROLE_KINDS[name], vocab)
        config = trained_config(train_cfg, master_weights, name) if trains else frozen_cfg
        r = RolePlan(name, size, placement(config, trains, one_process))
        if trains and mix in MIXES:
            r.place = replace(r.place, cast_flat_grads=True)
        if name in torch_path:
            r.place = replace(r.place, stage=0, reduce_bucket=0, overlap_comm=False, engine="torch")
        if lora is not None and name == names["trained"][0]:
            r.adapters = adapter_params(shapes[name], ROLE_KINDS[name], lora, vocab)
            _lora_states(r, world_size)
        else:
            _states(r, world_size)
        roles.append(r)
    by = {r.name: r for r in roles}
    n = world_size
    seqs = 2 * micro_batch if workload in ("dpo", "reward") else micro_batch
    tokens = seqs * seq_len

    def train(r: RolePlan) -> float:
        """The larger of forward+backward (activations saved, gradient buffers) and the step."""
        m, place = r.size, r.place
        step_bytes = (STEP_BYTES_BF16 if place.master_weights == "bf16"
                      else STEP_BYTES_CAST if place.cast_flat_grads and place.stage > 0 else STEP_BYTES)
        # With LoRA the frozen layers' activations are still saved (backward runs through them to
        # reach earlier adapters); only the adapters get gradients and an optimizer step.
        trained = r.adapters or m.params
        r.activations = train_activation_bytes(m, tokens, gradient_checkpointing)
        if place.engine == "torch":
            # No buckets: every gradient is live from the end of backward to the step (fused AdamW
            # steps in place), while the saved activations are freed as backward fills the
            # gradients; half of them is the overlap that fits one H200's DPO rows (NOTES s. 12).
            return r.grads + r.activations / 2
        if place.stage == 3:
            # Gathered parameters DeepSpeed keeps live for reuse by backward (max_live_parameters).
            buffers = 2 * min(MAX_LIVE_PARAMETERS, m.params)
            step = step_bytes * min(SUB_GROUP_SIZE, trained / n)
        else:
            # Gradients pass through bf16 bucket(s) of reduce_bucket_size (two with overlap_comm),
            # allocated whole however few parameters train (DeepSpeed's setup_buckets).
            buffers = 2 * place.reduce_bucket * (2 if place.overlap_comm else 1)
            if not r.adapters and m.largest_layer > place.reduce_bucket:
                buffers += OVERSIZED_GRAD_BYTES * m.largest_layer
            step = step_bytes * trained / n
        return max(r.activations + buffers, step)

    def forward(r: RolePlan) -> float:
        m, place = r.size, r.place
        if place.stage == 3:
            # Offloaded parameters are fetched up to max_live_parameters; otherwise the largest
            # layer is gathered at a time (DeepSpeed's estimator term).
            gathered = 2 * min(MAX_LIVE_PARAMETERS, m.params) if place.offload_params else 4 * m.largest_layer
        else:
            gathered = 0
        work = inference_bytes(m, tokens) + gathered
        if not place.trains:
            r.activations = max(r.activations, work)
        return work

    phases: dict[str, float] = {}
    if not WORKLOADS[workload]["frozen"]:  # SFT, reward: one trained model, forward and backward
        phases["train"] = train(by[names["trained"][0]])
    elif workload in ("dpo", "distill"):
        # LoRA DPO: the reference forward is the policy's own, adapters disabled.
        student, teacher = ((by["policy"], by.get("reference", by["policy"])) if workload == "dpo"
                            else (by["student"], by["teacher"]))
        phases["frozen_forward"] = forward(teacher)
        phases["train"] = train(student)
        if workload == "distill":
            # The teacher's fp32 log-probs stay alive through the student's backward, which keeps
            # its own fp32 log-softmax.
            phases["train"] += 8 * tokens * teacher.size.vocab
    else:
        policy = by["policy"]
        policy.kv_cache = kv_cache_bytes(policy.size, micro_batch, seq_len)
        engine_kv = policy.kv_cache
        if shared_prompt_group:
            from posttrain.rollout.prompt_cache import default_prompt_slots

            engine_kv = kv_cache_bytes(policy.size, micro_batch, seq_len,
                                       default_prompt_slots(micro_batch, shared_prompt_group), seq_len - response_len)
        prompt = micro_batch * (seq_len - response_len)
        gen = inference_bytes(policy.size, prompt) - HEAD_INFER_V * policy.size.vocab * prompt
        if generation_backend == "hf":
            gen += policy.kv_cache
            if policy.place.stage == 3:
                # TRL's unwrap_model_for_generation gathers a full copy of the ZeRO-3 policy to generate.
                gen += 2 * policy.size.params
        else:
            # The engine fuses DeepSpeed's flat buffers (and the ZeRO-3 copy) as views; it copies
            # only a torch-path policy's separately allocated weights, or with adapters.
            copies = fused_projections and (lora is not None or "policy" in torch_path)
            policy.rollout = rollout_engine_bytes(policy.size, micro_batch, seq_len, policy.place.stage, copies,
                                                  engine_kv)
            policy.kv_cache = engine_kv
            if lora is not None:  # the engine's merged adapted weights (its default lora_mode), bf16
                policy.rollout += 2 * merged_adapter_params(shapes["policy"], lora, vocab)
        phases["generate"] = gen
        # LoRA: the reference forward is the policy's own (adapters disabled).
        phases["score"] = max([forward(by[name]) for name in names["frozen"]]
                              + ([forward(policy)] if lora is not None else []))
        phases["train"] = max(train(by[name]) for name in names["trained"])
    return Plan(workload, mix, world_size, gpu_memory_gib * GiB, roles, phases)


def recommend(plans: list[Plan]) -> tuple[Plan | None, str]:
    """The fastest posttrain mix that fits, and why."""
    ranked = sorted((p for p in plans if p.mix in SPEED_ORDER), key=lambda p: SPEED_ORDER.index(p.mix))
    skipped = []
    for p in ranked:
        if p.fits:
            why = f"{p.mix} fits ({p.peak / GiB:.1f} of {p.gpu_memory / GiB:.1f} GiB per GPU)"
            if skipped:
                why += "; faster mixes do not: " + ", ".join(skipped)
            elif p.mix == SPEED_ORDER[0]:
                why += " and is the fastest placement (frozen models replicated: nothing to gather)"
                sharded = next((q for q in ranked if q.mix == "zero2-zero3" and q.fits), None)
                if sharded is not None:
                    why += (f"; zero2-zero3 needs {sharded.peak / GiB:.1f} GiB and its step measured 0.98-1.01x "
                            "this one's (DPO 1B and 3B, 2xH200)")
            else:
                why += " and is the fastest of the mixes considered"
            return p, why
        skipped.append(f"{p.mix} needs {p.peak / GiB:.1f} GiB")
    return None, "no mix fits: " + "; ".join(skipped) + ". Lower the micro batch or add GPUs."


MASTER_WEIGHTS_TEXT = {
    "fp32": "fp32 master weights and Adam states beside the bf16 weights (the default)",
    "bf16": "bf16 master weights, gradients and Adam states (TRL's footprint with a bf16 model)",
}


def precision_summary(best: dict[str, Plan | None]) -> str:
    """One line: which optimizer precision fits, and what fp32 master weights cost over bf16."""
    fp32, bf16 = best.get("fp32"), best.get("bf16")
    if fp32 is not None:
        line = f"master_weights fp32 fits ({fp32.mix}, {fp32.peak / GiB:.1f} GiB): keep it (the safer numerics)"
        if bf16 is not None:
            line += f"; bf16 would need {bf16.peak / GiB:.1f} GiB ({bf16.mix})"
        return line
    if bf16 is not None:
        return (f"only master_weights bf16 fits ({bf16.mix}, {bf16.peak / GiB:.1f} GiB): "
                "set master_weights: bf16 (with mixed_precision bf16)")
    return "neither master_weights fp32 nor bf16 fits"


def format_plan(p: Plan) -> str:
    """A table of one plan: GiB per GPU for every role and component."""
    g = lambda b: f"{b / GiB:7.2f}"  # noqa: E731
    trained = {r.place.master_weights for r in p.roles if r.place.trains}
    lines = [f"{p.workload} · mix {p.mix} · {p.world_size} GPUs · master weights {'/'.join(sorted(trained))} · GiB per GPU",
             f"{'role':10} {'place':13} {'params':>7} {'grads':>7} {'optim':>7} {'act':>7} {'kv':>7}"]
    for r in p.roles:
        lines.append(f"{r.name:10} {r.place.label:13} {g(r.params)} {g(r.grads)} {g(r.optimizer)} "
                     f"{g(r.activations)} {g(r.kv_cache)}")
    for r in p.roles:
        if r.rollout:
            lines.append(f"({r.name}: posttrain.rollout keeps {r.rollout / GiB:.2f} GiB for the run, counted at rest: "
                         "KV cache, graph pool" + (", the gathered ZeRO-3 copy" if r.place.stage == 3 else "")
                         + (", the merged LoRA weights" if r.adapters else "")
                         + "; generation_backend hf holds the cache only while generating)")
    for r in p.roles:
        if r.adapters:
            lines.append(f"({r.name}: LoRA, {r.adapters / 1e6:.2f}M adapter parameters train with their gradients and "
                         f"Adam states; its {r.size.params / 1e9:.2f}B base is frozen in params; the reference is that "
                         "base with adapters disabled: no reference role)")
    phases = ", ".join(f"{k} {v / GiB:.2f}" for k, v in p.phases.items())
    lines.append("(grads live from backward to the step; act: saved activations of a trained role, the forward's "
                 "working set of a frozen one; both count in their phase, not at rest)")
    lines.append(f"at rest {p.at_rest / GiB:.2f} + largest phase ({phases}) = peak {p.peak / GiB:.2f} GiB "
                 f"of {p.gpu_memory / GiB:.1f}: {'fits' if p.fits else 'DOES NOT FIT'}")
    return "\n".join(lines)
