"""The reference of DPO and KTO (TRL's offline preference trainers): a frozen ``reference`` role under its own plugin,
freed after one pass with ``precompute_ref_log_probs``, or with LoRA and no ``ref_model`` the policy's base with
adapters disabled; a ``sync_ref_model`` reference is checkpointed beside the policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.models.sources import reference_source


class ReferenceRole:
    """Mixin of :class:`posttrain.trainers.loop.Trainer` subclasses that set ``cfg``, ``session``, ``phases``,
    ``tokenizer``, ``train_rows``/``eval_rows`` and implement ``_precompute(rows, batch_size)``."""

    reference: Any = None

    def _no_dropout(self, model: torch.nn.Module) -> None:
        if self.cfg.disable_dropout:
            from trl.trainer.utils import disable_dropout_in_model

            disable_dropout_in_model(model)

    def _load_reference(self, ref_model: Any, policy: Any, kwargs: dict[str, Any]) -> None:
        """The frozen reference role (``ref_model``, else the policy's weights); with ``precompute_ref_log_probs``
        its log-probs are taken over every row and its memory given back before the policy loads."""
        ref = self.session.load("reference", reference_source(ref_model, policy), **kwargs)
        self._no_dropout(ref)
        self.reference = self.session.prepare("reference", ref)
        if self.cfg.precompute_ref_log_probs:
            self._precompute_all()
            self.session.release("reference")
            self.reference = None

    def _precompute_all(self) -> None:
        with self.phases("precompute"):
            cfg = self.cfg
            self._precompute(self.train_rows, cfg.precompute_ref_batch_size or cfg.per_device_train_batch_size)
            if self.eval_rows is not None:
                self._precompute(self.eval_rows, cfg.precompute_ref_batch_size or cfg.per_device_eval_batch_size)

    def has_eval_data(self) -> bool:
        return self.eval_rows is not None

    def checkpoint_models(self) -> dict[str, Any]:
        # A synced reference is training state: it is saved beside the policy.
        return {"policy": self.tokenizer, **({"reference": None} if self.cfg.sync_ref_model else {})}

    def restore(self, state: dict[str, Any], checkpoint: Path) -> None:
        if self.cfg.sync_ref_model:
            self.session.load_weights("reference", checkpoint / "reference")
