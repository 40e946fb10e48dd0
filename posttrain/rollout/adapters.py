"""peft LoRA adapters as the decode engine reads them: ``"merged"`` (W + scaling * B @ A buffers), ``"live"``
(low-rank terms in the step) or ``"grouped"`` (per q|k|v, gate|up, o and down: the adapters' A rows appended
to the frozen base rows, so one GEMM gives the projections and x A^T, then one expand GEMM; no second copy of
the base); updates need no recapture."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.errors import ConfigError

LORA_MODES = ("auto", "merged", "live", "grouped")


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft ``PeftModel``; others as they are."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def _peft() -> Any:
    import peft.tuners.lora as lora
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    return lora, BaseTunerLayer, AuxiliaryTrainingWrapper, ModulesToSaveWrapper


def active(layer: Any) -> list[str]:
    """The adapters a ``lora.Linear`` adds in its forward, in order (none when disabled or merged)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the engine cannot apply ``model``'s peft adapters exactly, or None."""
    if not hasattr(model, "peft_config") and not any("lora_" in n or "modules_to_save" in n or "trainable_tokens" in n
                                                     for n, _ in model.named_modules()):
        return None
    lora, base_tuner, auxiliary, modules_to_save = _peft()
    cfg = getattr(model, "active_peft_config", None)
    if cfg is not None and getattr(cfg, "is_prompt_learning", False):
        return f"peft {cfg.peft_type} (prompt learning) adds virtual tokens the engine does not run"
    for name, m in unwrap(model).named_modules():
        if isinstance(m, base_tuner):
            if not isinstance(m, lora.LoraLayer):
                return f"{name}: peft {type(m).__name__} adapters are not LoRA"
            if type(m) is not lora.Linear or type(m.get_base_layer()) is not nn.Linear:
                return f"{name}: LoRA on a {type(m.get_base_layer()).__name__} ({type(m).__name__}) is not supported"
            if getattr(m, "fan_in_fan_out", False):
                return f"{name}: LoRA with fan_in_fan_out is not supported"
            used = [a for a in m.active_adapters if a in m.lora_A]
            variants = [a for a in used if a in m.lora_variant]
            if variants:
                kind = "DoRA" if m.use_dora.get(variants[0]) else type(m.lora_variant[variants[0]]).__name__
                return f"{name}: LoRA variant {kind} (adapter {variants[0]!r}) is not supported"
            if m.disable_adapters and m.merged:
                return f"{name}: adapters merged into the base weights while disabled (peft would unmerge them)"
        elif isinstance(m, auxiliary):
            if not isinstance(m, modules_to_save):
                return f"{name}: peft {type(m).__name__} is not supported"
            if any(True for _ in m.original_module.children()):
                return f"{name}: modules_to_save on a module with submodules is not supported"
    return None


def resolve(module: nn.Module) -> nn.Module:
    """The module peft's forward runs for ``module`` (a ``modules_to_save`` wrapper's active copy)."""
    if not hasattr(module, "modules_to_save") or not hasattr(module, "original_module"):
        return module
    names = module.active_adapters
    if module.disable_adapters or not names or any(a not in module._adapters for a in names):
        return module.original_module
    return module.modules_to_save[names[0]]


@dataclass
class Appended:
    """Projections sharing an input, mode "grouped" on live weights: ``weight`` holds the base rows (the frozen
    base parameters are re-pointed at views of it, so the base is not copied) then every adapter's A rows;
    ``expand`` [out, R] is each adapter's B times its scaling (0 where inactive), block by block."""

    modules: list[Any]  # the projections, resolved (peft lora.Linear or nn.Linear)
    weight: torch.Tensor  # [out + R, in]
    bias: torch.Tensor | None  # [out + R]: the base biases, zeros under the A rows
    expand: torch.Tensor  # [out, R]
    expand_bias: torch.Tensor | None  # [out]: LoRA B biases times their scaling
    live: bool = True  # the base parameters point into ``weight`` (else a ZeRO-3 shadow refreshes its base rows)

    @property
    def extra_bytes(self) -> int:
        """Bytes beyond the base weights: the A rows and the expand block."""
        out = self.expand.shape[0]
        tensors = [self.weight[out:], self.expand, self.expand_bias, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# Appended buffers by their group's first projection: every engine on one model shares them (a second would
# re-point the base into its own buffer, and the two would take the base back from each other every rollout).
_APPENDED: weakref.WeakKeyDictionary[nn.Module, Appended] = weakref.WeakKeyDictionary()


def adapted(m: nn.Module) -> bool:
    """Whether ``m`` is a peft LoRA layer (adapters over a base layer)."""
    return hasattr(m, "lora_A") and hasattr(m, "base_layer")


def base_of(m: nn.Module) -> nn.Module:
    """The layer whose weight ``m`` adds its adapters to (``m`` itself if it has none)."""
    return m.get_base_layer() if adapted(m) else m


def appended_rank(ms: list[nn.Module]) -> int:
    """Rows mode "grouped" appends after the base rows of projections ``ms``: their adapters' ranks (a ZeRO-3
    partitioned A weight read by its ``ds_shape``)."""
    return sum(getattr(w, "ds_shape", w.shape)[0] for m in ms if adapted(m) for w in (m.lora_A[a].weight for a in m.lora_A))


class Adapters:
    """How the decoder reads projections (``tensor``), LoRA per ``mode``; ``refresh()`` once per rollout."""

    def __init__(self, model: nn.Module, mode: str = "auto", tensor: Any = None, layout: Any = None) -> None:
        """``tensor``: what the engine reads of a parameter (a ZeRO-3 shadow's view; None: the parameter);
        ``layout``: that shadow, where it laid the projection groups out with room for the A rows."""
        if mode not in LORA_MODES:
            raise ConfigError(f"lora_mode (--generation_lora_mode) {mode!r}: use one of {LORA_MODES}")
        if mode == "auto":  # grouped where the base can be appended to in place: live weights or a laid-out shadow
            mode = "grouped" if tensor is None or layout is not None else "merged"
        self.model, self.mode, self._tensor, self.layout = model, mode, tensor, layout
        self.lora = any(adapted(m) for m in model.modules())
        self.scales: dict[tuple[int, str], torch.Tensor] = {}  # (module id, adapter) -> 0-dim float32
        self.merged: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # module id -> weight, bias
        self.groups: dict[tuple[int, ...], tuple[list[Any], list[str], tuple]] = {}  # mode "grouped"
        self.adopted: set[int] = set()  # merged buffers that are slices of the engine's fused ones
        self.appended: dict[tuple[int, ...], Appended] = {}  # mode "grouped" on live weights
        self.repointed = 0  # base weights found re-allocated and pointed back into their appended buffer

    def tensor(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return self._tensor(t) if self._tensor is not None else t.detach()

    @property
    def appends(self) -> bool:
        """Mode "grouped" on live weights or a laid-out shadow: adapted projections read from appended buffers."""
        return self.mode == "grouped" and self.lora and (self._tensor is None or self.layout is not None)

    def module(self, m: nn.Module) -> nn.Module:
        return resolve(m) if self.lora else m

    @property
    def nbytes(self) -> int:
        """Bytes of the merged buffers outside the fused ones, and of the grouped copies."""
        merged = [t for key, (w, b) in self.merged.items() if key not in self.adopted for t in (w, b)]
        grouped = [t for _, _, terms in self.groups.values() for term in terms for t in term]
        return (sum(t.numel() * t.element_size() for t in merged + grouped if t is not None)
                + sum(a.extra_bytes for a in self.appended.values()))

    def _scale(self, layer: Any, adapter: str) -> torch.Tensor:
        key = (id(layer), adapter)
        if key not in self.scales:
            self.scales[key] = torch.zeros((), dtype=torch.float32, device=layer.lora_A[adapter].weight.device)
        return self.scales[key]

    def linear(self, m: nn.Module, terms: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """(weight, bias, LoRA terms) of projection ``m``; terms: (A, B, B's bias, scaling) per adapter."""
        m = self.module(m)
        if not (self.lora and adapted(m)):
            return self.tensor(m.weight), self.tensor(m.bias), None
        if self.mode == "merged":
            weight, bias = self._merged_buffers(m)
            return weight, bias, None
        base = m.get_base_layer()
        if not terms:
            return self.tensor(base.weight), self.tensor(base.bias), None
        found = tuple((self.tensor(m.lora_A[a].weight), self.tensor(m.lora_B[a].weight),
                       self.tensor(m.lora_B[a].bias), self._scale(m, a)) for a in m.lora_A)
        return self.tensor(base.weight), self.tensor(base.bias), found

    def append(self, modules: tuple[nn.Module, ...]) -> Appended | None:
        """Mode "grouped": ``modules``' appended layout, built once; None where none of them is adapted, or their
        base weights are trainable or unlike, or the shadow did not lay them out."""
        if not self.appends:
            return None
        ms = [self.module(m) for m in modules]
        if not any(adapted(m) for m in ms):
            return None
        key = tuple(id(m) for m in ms)
        if key in self.appended:
            return self.appended[key]
        ws = [base_of(m).weight for m in ms]
        if self.layout is not None:  # a ZeRO-3 shadow's layout: its base rows are refreshed by the shadow
            weight = self.layout.appended(ws)
            return None if weight is None else self._new_appended(key, ms, weight, live=False)
        shared = _APPENDED.get(ms[0])
        if shared is not None and [id(m) for m in shared.modules] == list(key):
            self.appended[key] = shared
            self._fill_appended(shared)
            return shared
        # A trainable base belongs to the optimizer (DeepSpeed flattens it): only frozen ones are re-pointed.
        if any(w.requires_grad or w.dim() != 2 for w in ws) or len({(w.dtype, w.device, w.shape[1]) for w in ws}) > 1:
            return None
        out = sum(w.shape[0] for w in ws)
        weight = torch.empty(out + appended_rank(ms), ws[0].shape[1], dtype=ws[0].dtype, device=ws[0].device)
        with torch.no_grad():
            o = 0
            for w in ws:
                weight[o : o + w.shape[0]].copy_(w)
                w.data = weight[o : o + w.shape[0]]  # the old storage frees: the base now lives here
                o += w.shape[0]
        _APPENDED[ms[0]] = entry = self._new_appended(key, ms, weight, live=True)
        return entry

    def _new_appended(self, key: tuple[int, ...], ms: list[Any], weight: torch.Tensor, live: bool) -> Appended:
        """``ms``' entry over ``weight`` (their base rows, then room for the A rows), registered and filled."""
        out = sum(self.tensor(base_of(m).weight).shape[0] for m in ms)
        like = {"dtype": weight.dtype, "device": weight.device}
        bias = torch.zeros(weight.shape[0], **like) if any(base_of(m).bias is not None for m in ms) else None
        lora_bias = any(m.lora_B[a].bias is not None for m in ms if adapted(m) for a in m.lora_B)
        entry = Appended(ms, weight, bias, torch.zeros(out, weight.shape[0] - out, **like),
                         torch.zeros(out, **like) if lora_bias else None, live=live)
        self.appended[key] = entry
        self._fill_appended(entry)
        return entry

    @torch.no_grad()
    def _fill_appended(self, entry: Appended) -> None:
        """The A rows, the scaled B blocks and the biases into ``entry``, in place; a base weight re-allocated
        since (``param.data`` replaced) is copied back in and re-pointed."""
        o = r0 = 0
        out = entry.expand.shape[0]
        for m in entry.modules:
            base = base_of(m)
            n = self.tensor(base.weight).shape[0]
            part = entry.weight[o : o + n]
            if entry.live and base.weight.data_ptr() != part.data_ptr():
                part.copy_(base.weight)
                base.weight.data = part
                self.repointed += 1
            if entry.bias is not None and base.bias is not None:
                entry.bias[o : o + n].copy_(self.tensor(base.bias))
            on = set(active(m)) if hasattr(m, "lora_A") else set()
            if entry.expand_bias is not None:
                entry.expand_bias[o : o + n].zero_()
            for a in getattr(m, "lora_A", {}):
                la, lb, lb_bias = (self.tensor(m.lora_A[a].weight), self.tensor(m.lora_B[a].weight),
                                   self.tensor(m.lora_B[a].bias))
                r = la.shape[0]
                scale = float(m.scaling[a]) if a in on else 0.0
                entry.weight[out + r0 : out + r0 + r].copy_(la)
                entry.expand[o : o + n, r0 : r0 + r].copy_(lb * scale)
                if entry.expand_bias is not None and lb_bias is not None:
                    entry.expand_bias[o : o + n].add_(lb_bias * scale)
                r0 += r
            o += n

    def group(self, modules: tuple[nn.Module, ...]) -> tuple | None:
        """Mode "grouped" where the base is not appended to (a ZeRO-3 shadow's views): per adapter, the stacked
        LoRA terms of projections sharing an input, or None."""
        if self.mode != "grouped" or not self.lora:
            return None
        ms = [self.module(m) for m in modules]
        if not all(adapted(m) for m in ms):
            return None
        names = list(ms[0].lora_A)
        if any(list(m.lora_A) != names for m in ms):
            return None
        key = tuple(id(m) for m in ms)
        if key not in self.groups:
            terms = []
            for a in names:
                la = [self.tensor(m.lora_A[a].weight) for m in ms]
                lb = [self.tensor(m.lora_B[a].weight) for m in ms]
                if len({t.dtype for t in la + lb}) > 1:
                    return None
                like = {"dtype": la[0].dtype, "device": la[0].device}
                rank, out = sum(t.shape[0] for t in la), sum(t.shape[0] for t in lb)
                with_bias = any(m.lora_B[a].bias is not None for m in ms)
                terms.append((torch.empty(rank, la[0].shape[1], **like), torch.zeros(out, rank, **like),
                              torch.zeros(out, **like) if with_bias else None, torch.zeros(out, **like)))
            self.groups[key] = (ms, names, tuple(terms))
            self._fill(key)
        return self.groups[key][2]

    @torch.no_grad()
    def _fill(self, key: tuple[int, ...]) -> None:
        """Copy a group's adapters and scalings (0 where not active) into its buffers, in place."""
        ms, names, terms = self.groups[key]
        for a, (stacked_a, block_b, bias, scale) in zip(names, terms):
            r0 = o0 = 0
            for m in ms:
                la, lb = self.tensor(m.lora_A[a].weight), self.tensor(m.lora_B[a].weight)
                r, o = la.shape[0], lb.shape[0]
                stacked_a[r0 : r0 + r].copy_(la)
                block_b[o0 : o0 + o, r0 : r0 + r].copy_(lb)  # off-diagonal blocks stay zero
                if bias is not None:
                    b = self.tensor(m.lora_B[a].bias)
                    bias[o0 : o0 + o].copy_(b) if b is not None else bias[o0 : o0 + o].zero_()
                scale[o0 : o0 + o].fill_(float(m.scaling[a]) if a in active(m) else 0.0)
                r0, o0 = r0 + r, o0 + o

    def _lora_layer(self, m: nn.Module) -> Any:
        """``m`` resolved, if it is a LoRA layer whose weight ``linear`` returns merged."""
        m = self.module(m)
        return m if self.lora and adapted(m) else None

    def weight_shape(self, m: nn.Module) -> tuple[int, int, torch.dtype, torch.device]:
        """(out, in, dtype, device) of the weight ``linear(m)`` returns, without allocating it."""
        lora = self._lora_layer(m)
        w = self.tensor(lora.get_base_layer().weight if lora is not None else self.module(m).weight)
        return w.shape[0], w.shape[1], w.dtype, w.device

    def has_bias(self, m: nn.Module) -> bool:
        """Whether ``linear(m)`` returns a bias (mode "merged": also where only an adapter has one)."""
        lora = self._lora_layer(m)
        if lora is None:
            return self.module(m).bias is not None
        if self.mode == "merged":
            return lora.get_base_layer().bias is not None or any(lora.lora_B[a].bias is not None for a in lora.lora_A)
        return lora.get_base_layer().bias is not None

    def adopt(self, m: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Mode "merged": fused-buffer slices become ``m``'s merged buffers; False if not applicable."""
        lora = self._lora_layer(m)
        if lora is None or self.mode != "merged":
            return False
        self.merged[id(lora)] = (weight, bias)
        self.adopted.add(id(lora))
        self._merge(lora)
        return True

    def _merged_buffers(self, m: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if id(m) not in self.merged:
            base = m.get_base_layer()
            w = self.tensor(base.weight)
            with_bias = base.bias is not None or any(m.lora_B[a].bias is not None for a in m.lora_A)
            b = torch.empty(w.shape[0], dtype=w.dtype, device=w.device) if with_bias else None
            self.merged[id(m)] = (torch.empty_like(w), b)
            self._merge(m)
        return self.merged[id(m)]

    @torch.no_grad()
    def _merge(self, m: Any) -> None:
        """peft's ``merge`` arithmetic into ``m``'s buffers, per active adapter in order."""
        weight, bias = self.merged[id(m)]
        base = m.get_base_layer()
        weight.copy_(self.tensor(base.weight))
        if bias is not None:
            b0 = self.tensor(base.bias)
            bias.copy_(b0) if b0 is not None else bias.zero_()
        for a in active(m):
            la, lb = self.tensor(m.lora_A[a].weight), self.tensor(m.lora_B[a].weight)
            weight.add_((lb @ la) * m.scaling[a])
            if bias is not None and m.lora_B[a].bias is not None:
                bias.add_(self.tensor(m.lora_B[a].bias) * m.scaling[a])

    @torch.no_grad()
    def refresh(self) -> None:
        """Once per rollout, in place: merged buffers, scalings and grouped copies."""
        if not self.lora:
            return
        for key in self.groups:
            self._fill(key)
        for entry in self.appended.values():
            self._fill_appended(entry)
        for m in self.model.modules():
            if not adapted(m):
                continue
            if self.mode == "merged":
                if id(m) in self.merged:
                    self._merge(m)
                continue
            on = set(active(m))
            for a in m.lora_A:
                self._scale(m, a).fill_(float(m.scaling[a]) if a in on else 0.0)
