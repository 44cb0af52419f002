"""`FlashRTConfig`: the ``flashrt`` policy type, which names a flashrt policy checkpoint to serve."""

from __future__ import annotations

from dataclasses import dataclass

from lerobot.configs.policies import PreTrainedConfig

from flashrt.integrations.lerobot import INFERENCE_ONLY


@PreTrainedConfig.register_subclass("flashrt")
@dataclass
class FlashRTConfig(PreTrainedConfig):
    """What `flashrt.load_policy` takes. ``checkpoint``: a policy folder (lerobot or openpi layout) or a
    hub id in the local cache; a relative path in a saved ``config.json`` is relative to its folder."""

    checkpoint: str = ""
    precision: str = "float32"
    tokenizer: str | None = None
    embodiment: str | None = None

    @property
    def observation_delta_indices(self) -> None:
        return None

    @property
    def action_delta_indices(self) -> None:
        return None

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self):
        raise NotImplementedError(INFERENCE_ONLY)

    def get_scheduler_preset(self) -> None:
        return None

    def validate_features(self) -> None:
        """The flashrt policy checks its observations itself (names, shapes) at every call."""
