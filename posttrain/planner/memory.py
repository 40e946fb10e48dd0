"""Memory planner: per-GPU memory of every role under a mix, and the fastest mix that fits."""

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
    adapted_inputs,
    adapter_params,
    appended_adapter_params,
    merged_adapter_params,
    model_config,
    model_size,
)

GiB = 2**30


# Which roles each workload holds (its trainer's row of the role table), and each role's model kind.
WORKLOADS: dict[str, dict[str, list[str]]] = {name: {kind: list(names) for kind, names in row.items()}
                                              for name, row in TRAINER_ROLES.items()}
ROLE_KINDS = {"policy": "causal", "reference": "causal", "student": "causal", "teacher": "causal",
              "value": "token", "reward": "sequence"}

# TRL's placements (prepare_deepspeed): frozen models get the trained config, at stage 0 unless ZeRO-3.
BASELINES: dict[str, tuple[str, str]] = {"trl-zero2": ("zero2_train", "stage0"), "trl-zero3": ("zero3_train", "zero3_train")}

# posttrain's mixes from fastest to slowest: gathers per forward, PCIe per forward, gathers to train too.
SPEED_ORDER = ["zero2-replicated", "zero2-zero3", "zero2-zero3-offload", "zero3"]

# Bytes per token per decoder layer saved for backward (bf16, SDPA): two RMSNorms 12h; attention
# q, output and o_proj input 6h, k and v 4kv; MLP gate, SiLU output, up, down_proj input 8f; 2h more.
ACT_H, ACT_KV, ACT_F = 20, 4, 8
# Causal-LM head per token and vocab entry while training: bf16 logits, shifted copy, their gradient.
HEAD_TRAIN_V = 6
# A frozen forward's working set: the bf16 logits plus one layer's intermediates.
HEAD_INFER_V = 2
# Workloads whose causal LMs score through TRL's fused LM head or posttrain's chunked one (never the logits).
CHUNKED_HEAD_WORKLOADS = ("grpo", "rloo")
# TRL's fused head per token, bytes per hidden unit: the bf16 hidden state it keeps for backward 2, and in
# backward that state's float32 gradient 4 and its bf16 copy 2; a frozen forward keeps only the state's copy.
FUSED_HEAD_TRAIN_H = 8
FUSED_HEAD_INFER_H = 2
# Plus one bf16 tile of TOKEN_CHUNK_SIZE x vocabulary chunk (trl.kernels.chunked_logprob) at a time.
HEAD_TILE_BYTES = 4096 * 32768 * 2
# A trained head's backward under the fused head: the float32 weight gradient and its bf16 copy, per weight.
FUSED_HEAD_WEIGHT_GRAD = 6
# LoRA dropout, per token and input feature of an adapted layer: the dropped bf16 input and its mask, kept
# for backward by each layer whose activations are kept (one at a time under checkpointing).
LORA_DROPOUT_BYTES = 3
# Optimizer step with fp32 master weights, bytes per parameter over N: bf16 gradient partition 2,
# its flat bf16 copy 2, that copy in fp32 4; the Session casts while flattening (no flat copy): 6.
# ZeRO-3 steps one sub-group of SUB_GROUP_SIZE parameters at a time.
STEP_BYTES = 8
STEP_BYTES_CAST = 6
STEP_BYTES_BF16 = 4  # bf16 master weights: bf16 gradient partition 2 and AdamW temporaries 2
SUB_GROUP_SIZE = int(1e9)
# ZeRO-2 reduces a parameter larger than its bucket outside it: bf16 gradient and fp32 averaging copy.
OVERSIZED_GRAD_BYTES = 10
# DeepSpeed's ZeRO-3 default: parameters a training engine keeps gathered (an offloaded frozen one fetches).
MAX_LIVE_PARAMETERS = int(1e9)


def shared_vocab(shapes: dict[str, str], workload: str) -> int:
    """The vocabulary every role of a run uses: the first trained role's."""
    main = shapes[WORKLOADS[workload]["trained"][0]]
    return SHAPES[main]["vocab_size"] if main in SHAPES else int(model_config(main).vocab_size)


def train_activation_bytes(m: ModelSize, tokens: int, checkpointing: bool = False, chunked_head: bool = False) -> int:
    """Bytes kept for backward over ``tokens`` tokens, head included; checkpointing: 2h/token/layer + 1;
    ``chunked_head``: a causal LM's head is TRL's fused one (a tile at a time, never the logits)."""
    per_layer = ACT_H * m.hidden + ACT_KV * m.kv_dim + ACT_F * m.intermediate
    chunked = chunked_head and m.kind == "causal"
    head = (FUSED_HEAD_TRAIN_H * m.hidden if chunked else HEAD_TRAIN_V * m.vocab) if m.kind == "causal" else 8 * m.hidden
    layers = m.layers * 2 * m.hidden + per_layer if checkpointing else m.layers * per_layer
    return tokens * (layers + 8 * m.hidden + head) + (HEAD_TILE_BYTES if chunked else 0)


def head_backward_bytes(m: ModelSize, tokens: int) -> int:
    """Of :func:`train_activation_bytes` under the fused head, what only its backward holds: the saved hidden
    state and its float32 gradient (the bf16 copy goes on into the layers' backward), and the tile."""
    return tokens * (FUSED_HEAD_TRAIN_H - 2) * m.hidden + HEAD_TILE_BYTES


def inference_bytes(m: ModelSize, tokens: int, chunked_head: bool = False) -> int:
    """Peak working memory of a forward without gradients over ``tokens`` tokens (``chunked_head``: a causal
    LM's log-probs a tile at a time)."""
    layer = 2 * (2 * m.hidden + 3 * m.intermediate)
    if m.kind != "causal":
        return tokens * layer
    if chunked_head:
        return tokens * (layer + FUSED_HEAD_INFER_H * m.hidden) + HEAD_TILE_BYTES
    return tokens * (layer + HEAD_INFER_V * m.vocab)


def check_tool_tokens(workload: str, tool_tokens: int, response_len: int, shared_prompt_group: int | None) -> None:
    """Multi-turn sequences: the tool output lies inside the completion budget (TRL's), as the KV counts it."""
    from posttrain.errors import ConfigError

    if not tool_tokens:
        return
    if workload not in ("grpo", "rloo"):
        raise ConfigError(f"--tool-tokens: multi-turn tool use runs in GRPO and RLOO, not {workload}")
    if tool_tokens < 0 or tool_tokens >= response_len:
        raise ConfigError(f"--tool-tokens {tool_tokens} must be 0 or more and below --response-len {response_len}: "
                          "the tool output is part of the completion budget (max_completion_length), with the "
                          "model's own turns")
    if shared_prompt_group:
        raise ConfigError("--tool-tokens with --generation-shared-prompt-kv: multi-turn tool use keeps each "
                          "sequence's prompt in its own slot; drop one")


def kv_cache_bytes(m: ModelSize, sequences: int, length: int, prompt_slots: int | None = None,
                   prompt_len: int = 0) -> int:
    """bf16 KV cache, all layers; shared prompt slots: completions, plus ``prompt_slots`` x ``prompt_len``."""
    columns = sequences * length
    if prompt_slots is not None:
        columns = sequences * (length - prompt_len) + prompt_slots * prompt_len
    return columns * m.layers * 2 * m.kv_dim * 2


# posttrain.rollout's CUDA graph pool, an upper estimate: four float32 [batch, vocab] sampling tensors.
GRAPH_POOL_BYTES_PER_ROW_VOCAB = 32
# The repetition penalty: each slot's bool set of the tokens it holds (rollout.slots.Slots.seen), kept with the
# slots, and in the step's pool three more float32 [batch, vocab] (the raw logits, the scaled ones, their select).
PENALTY_SEEN_BYTES_PER_ROW_VOCAB = 1
PENALTY_POOL_BYTES_PER_ROW_VOCAB = 12


def fused_projection_bytes(m: ModelSize) -> int:
    """The engine's fused q|k|v and gate|up buffers (``generation_fused_projections``), bf16."""
    return m.layers * m.hidden * (m.hidden + 2 * m.kv_dim + 2 * m.intermediate) * 2


def streamed_bytes(rows: int, prompt_len: int, response_len: int) -> int:
    """Streaming generation's held outputs: each started sequence's prompt ids and mask (int64) and its completion's
    ids (int64) and sampling log-probs (float32); its KV is the engine's slots'."""
    return rows * (16 * prompt_len + 12 * response_len)


def graph_pool_bytes(m: ModelSize, sequences: int, penalty: bool = False) -> int:
    """The engine's CUDA graph pool for ``sequences`` slots (:data:`GRAPH_POOL_BYTES_PER_ROW_VOCAB`, more with
    the repetition ``penalty``)."""
    per = GRAPH_POOL_BYTES_PER_ROW_VOCAB + (PENALTY_POOL_BYTES_PER_ROW_VOCAB if penalty else 0)
    return per * sequences * m.vocab


def rollout_engine_bytes(m: ModelSize, sequences: int, length: int, policy_stage: int,
                         fused_projections: bool = False, kv_cache: int | None = None, penalty: bool = False) -> int:
    """posttrain.rollout's bytes: KV cache (default all rows'), graphs, ZeRO-3 copy, fused projections, the
    repetition ``penalty``'s token sets."""
    pool = graph_pool_bytes(m, sequences, penalty)
    fused = fused_projection_bytes(m) if fused_projections else 0
    kv = kv_cache_bytes(m, sequences, length) if kv_cache is None else kv_cache
    seen = PENALTY_SEEN_BYTES_PER_ROW_VOCAB * sequences * m.vocab if penalty else 0
    return kv + pool + (2 * m.params if policy_stage == 3 else 0) + fused + seen


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
    """A role's placement as the Session runs it (``one_process``: simplified by dsconfig.one_rank)."""
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
    lora_mode: str = ""  # LoRA: how the rollout engine holds the adapters (generation_lora_mode, resolved)
    sleeps: bool = False  # the engine frees its KV cache and graph pool while training (vllm_enable_sleep_mode)

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
    """A role's states; trained grads beyond ``resident_grads`` count in the train phase, not at rest."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p, n, place = r.size.params, world, r.place
    if place.trains and place.engine == "torch":
        # Parameters and gradients in the optimizer's precision, and AdamW's two states.
        width = 2 if place.master_weights == "bf16" else 4
        r.params, r.grads, r.optimizer = width * p, width * p, 2 * width * p
    elif place.trains and place.master_weights == "bf16":
        # DeepSpeed's estimators assume fp32 states. ZeRO-3 updates its bf16 partition in place;
        # ZeRO-1/2 clone it into a master copy, except in a world of one (share_bf16_master).
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
        # Of the gradients only the bf16 partition is kept between steps.
        r.params, r.optimizer = 2 * p / n, 12 * p / n
        r.grads = gpu - largest - r.params - r.optimizer
        r.resident_grads = 2 * p / n
    elif place.trains:
        _, gpu = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=n, cpu_offload=False)
        r.params, r.optimizer = 2 * p, 12 * p / n
        r.grads = gpu - r.params - r.optimizer
    elif place.stage == 3:  # frozen: only the 16-bit shard (on the CPU when offloaded)
        r.params = 0.0 if place.offload_params else 2 * p / n
    else:
        r.params = 2 * p


def _lora_states(r: RolePlan, world: int) -> None:
    """A LoRA role: its frozen 16-bit base, plus a trained model's states for the adapters."""
    adapters = RolePlan(r.name, replace(r.size, params=r.adapters, largest_layer=0), r.place)
    _states(adapters, world)
    base = 2 * r.size.params / (world if r.place.stage == 3 else 1)
    r.params = base + adapters.params
    r.grads, r.resident_grads, r.optimizer = adapters.grads, adapters.resident_grads, adapters.optimizer


def plan(workload: str, shapes: dict[str, str] | str, mix: str, *, world_size: int, micro_batch: int,
         seq_len: int, response_len: int = 64, gpu_memory_gib: float = 139.0,
         generation_backend: str = "posttrain", master_weights: str = "fp32",
         gradient_checkpointing: bool = False, lora: Lora | None = None, single_process_engine: str = "auto",
         fused_projections: bool = False, shared_prompt_group: int | None = None, tool_tokens: int = 0,
         generation_batch: int | None = None, kv_slots: int | None = None, streamed_rows: int = 0,
         lora_mode: str = "auto", sleep_mode: bool = False, gradient_accumulation_steps: int = 1,
         repetition_penalty: bool = False) -> Plan:
    """Per-GPU memory per role; ``micro_batch``: prompts/pairs/seqs; ``seq_len`` has the response;
    ``tool_tokens``: multi-turn tool use (GRPO/RLOO), tool output per sequence inside the response budget;
    ``generation_batch``: sequences one process generates at once (default ``micro_batch``); ``kv_slots``: the
    engine's KV budget in sequences (``generation_kv_slots``, default ``generation_batch``); ``streamed_rows``:
    streaming generation's sequences started and not yet trained per process (their outputs held on the GPU);
    ``lora_mode``: the engine's ``generation_lora_mode`` (merged: a copy of each adapted weight; grouped: the A rows
    and expand blocks beside the base read in place; live: nothing; auto: grouped); ``sleep_mode``: the engine frees
    its KV cache and graph pool while the policy trains (``vllm_enable_sleep_mode``), so they count in the generate
    phase, not at rest; ``gradient_accumulation_steps`` above 1: ZeRO-1/2's bf16 gradient partition, which micro-batches
    accumulate into, is live through every backward but the first; ``repetition_penalty``: the sampler's penalty is
    on (each engine slot's token set and the step's larger pool)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    names = WORKLOADS[workload]
    check_tool_tokens(workload, tool_tokens, response_len, shared_prompt_group)
    if lora is not None:
        names = {**names, "frozen": [n for n in names["frozen"] if n != "reference"]}
    if isinstance(shapes, str):
        shapes = {}.fromkeys(names["trained"] + names["frozen"], shapes)
    train_cfg, frozen_cfg = mix_configs(mix)
    vocab = shared_vocab(shapes, workload)
    roles: list[RolePlan] = []
    one_process = world_size == 1 and mix in MIXES and mix not in STOCK_GATHER_MIXES
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
    chunked = workload in CHUNKED_HEAD_WORKLOADS

    def train(r: RolePlan) -> float:
        """The larger of forward+backward (activations saved, gradient buffers) and the step."""
        m, place = r.size, r.place
        step_bytes = (STEP_BYTES_BF16 if place.master_weights == "bf16"
                      else STEP_BYTES_CAST if place.cast_flat_grads and place.stage > 0 else STEP_BYTES)
        # LoRA: backward still runs through the frozen layers; only the adapters step.
        trained = r.adapters or m.params
        r.activations = train_activation_bytes(m, tokens, gradient_checkpointing, chunked)
        if chunked and m.kind == "causal" and not r.adapters:  # the fused head's backward of a trained head
            r.activations += FUSED_HEAD_WEIGHT_GRAD * m.vocab * m.hidden
        if r.adapters and lora.dropout and m.kind == "causal":
            inputs = adapted_inputs(shapes[r.name], lora, vocab)
            r.activations += tokens * LORA_DROPOUT_BYTES * (inputs // m.layers if gradient_checkpointing else inputs)
        if place.engine == "torch":
            # No buckets; activations are freed as backward fills the gradients (overlap: NOTES s. 12).
            return r.grads + r.activations / 2
        if place.stage == 3:
            buffers = 2 * min(MAX_LIVE_PARAMETERS, m.params)
            step = step_bytes * min(SUB_GROUP_SIZE, trained / n)
        else:
            # bf16 gradient bucket(s), two with overlap_comm, allocated whole however few parameters train.
            buffers = 2 * place.reduce_bucket * (2 if place.overlap_comm else 1)
            if gradient_accumulation_steps > 1:  # and the partition the micro-batches accumulate into
                buffers += 2 * trained / n
            if not r.adapters and m.largest_layer > place.reduce_bucket:
                buffers += OVERSIZED_GRAD_BYTES * m.largest_layer
            step = step_bytes * trained / n
        if r.adapters and chunked and m.kind == "causal" and place.stage < 3:
            # A frozen head's fused backward (its tile, the float32 hidden gradient) ends before the first adapter's
            # gradient, so before ZeRO-1/2's buckets exist: the larger of the two is live, not both (NOTES s. 46).
            head = head_backward_bytes(m, tokens)
            return max(r.activations - head + max(head, buffers), step)
        return max(r.activations + buffers, step)

    def forward(r: RolePlan) -> float:
        m, place = r.size, r.place
        if place.stage == 3:  # offloaded: fetched up to max_live_parameters, else the largest layer
            gathered = 2 * min(MAX_LIVE_PARAMETERS, m.params) if place.offload_params else 4 * m.largest_layer
        else:
            gathered = 0
        work = inference_bytes(m, tokens, chunked) + gathered
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
        if workload == "distill":  # the teacher's fp32 log-probs live through the student's backward
            phases["train"] += 8 * tokens * teacher.size.vocab
    else:
        policy = by["policy"]
        rows = generation_batch or micro_batch
        slots = kv_slots or rows  # the engine streams the rows through its slots
        policy.kv_cache = kv_cache_bytes(policy.size, rows, seq_len)
        engine_kv = kv_cache_bytes(policy.size, slots, seq_len)
        if shared_prompt_group:
            from posttrain.rollout.prompt_cache import default_prompt_slots

            engine_kv = kv_cache_bytes(policy.size, slots, seq_len,
                                       default_prompt_slots(slots, shared_prompt_group), seq_len - response_len)
        # Multi-turn with generate: each turn re-prefills the conversation so far (the last one nearly all of it);
        # the engine prefills only the appended tool output into the sequence's slot.
        prefilled = rows if generation_backend == "hf" else min(rows, slots)
        prompt = prefilled * (seq_len if tool_tokens and generation_backend == "hf" else seq_len - response_len)
        gen = inference_bytes(policy.size, prompt) - HEAD_INFER_V * policy.size.vocab * prompt
        if generation_backend == "hf":
            gen += policy.kv_cache
            if policy.place.stage == 3:  # TRL's unwrap_model_for_generation gathers a full copy
                gen += 2 * policy.size.params
        else:
            # Fused projections are views of DeepSpeed's flat buffers; copies otherwise.
            lora_mode = "grouped" if lora_mode == "auto" else lora_mode
            # grouped LoRA fuses each group itself (in place, or in a ZeRO-3 shadow's layout): no copies.
            appends = lora is not None and lora_mode == "grouped"
            copies = fused_projections and not appends and (lora is not None or "policy" in torch_path)
            policy.rollout = rollout_engine_bytes(policy.size, slots, seq_len, policy.place.stage, copies,
                                                  engine_kv, repetition_penalty)
            policy.kv_cache = engine_kv
            policy.lora_mode = lora_mode if lora is not None else ""
            if lora is not None and lora_mode == "merged":  # a bf16 copy of every adapted weight
                policy.rollout += 2 * merged_adapter_params(shapes["policy"], lora, vocab)
            elif lora is not None and lora_mode == "grouped":
                policy.rollout += 2 * appended_adapter_params(shapes["policy"], lora, vocab)
            policy.rollout += streamed_bytes(streamed_rows, seq_len - response_len, response_len)
            if sleep_mode:  # the cache and the graph pool live only while generating
                asleep = engine_kv + graph_pool_bytes(policy.size, slots, repetition_penalty)
                policy.rollout -= asleep
                policy.sleeps = True
                gen += asleep
        phases["generate"] = gen
        # LoRA: the reference forward is the policy's own, adapters disabled.
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


MASTER_WEIGHTS_TEXT = {"fp32": "fp32 master weights and Adam states beside the bf16 weights (the default)",
                       "bf16": "bf16 master weights, gradients and Adam states (TRL's footprint with a bf16 "
                               "model)"}


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
        if r.rollout or r.sleeps:
            held = ([] if r.sleeps else ["KV cache", "graph pool"]) + (
                ["the gathered ZeRO-3 copy"] if r.place.stage == 3 else []) + (
                [{"merged": "the merged LoRA weights", "grouped": "the LoRA adapters' rows beside the base it reads "
                  "in place"}[r.lora_mode]] if r.lora_mode in ("merged", "grouped") else [])
            lines.append(f"({r.name}: posttrain.rollout keeps {r.rollout / GiB:.2f} GiB for the run, counted at rest"
                         + (f": {', '.join(held)}" if held else "")
                         + ("; its KV cache and graph pool, freed while the policy trains (vllm_enable_sleep_mode), "
                            "count in the generate phase" if r.sleeps else
                            "; generation_backend hf holds the cache only while generating") + ")")
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
