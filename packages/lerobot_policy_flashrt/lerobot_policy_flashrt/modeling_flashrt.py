"""`FlashRTPolicy`: lerobot's policy class over flashrt's drop-in (`flashrt.integrations.lerobot`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lerobot.configs.policies import PreTrainedConfig
from lerobot.policies.pretrained import PreTrainedPolicy

from flashrt.integrations.lerobot import INFERENCE_ONLY, plugin_load
from flashrt.integrations.lerobot import FlashRTPolicy as DropIn
from lerobot_policy_flashrt.configuration_flashrt import FlashRTConfig


class FlashRTPolicy(PreTrainedPolicy):
    """select_action / predict_action_chunk / reset of a flashrt policy; inference only (no weights of
    its own to train or save: `save_pretrained` writes the config that names the checkpoint)."""

    config_class = FlashRTConfig
    name = "flashrt"

    def __init__(self, config: FlashRTConfig, dataset_stats: Any = None, dataset_meta: Any = None,
                 **_: Any) -> None:
        super().__init__(config)
        self.flashrt: DropIn = plugin_load(config)

    @classmethod
    def from_pretrained(cls, pretrained_name_or_path: str | Path, *, config: FlashRTConfig | None = None,
                        **kwargs: Any) -> FlashRTPolicy:
        """The folder `save_pretrained` wrote (``--policy.path``): its config, no weights file."""
        if config is None:
            config = PreTrainedConfig.from_pretrained(pretrained_name_or_path, **kwargs)
        config.pretrained_path = Path(pretrained_name_or_path)
        return cls(config)

    def _save_pretrained(self, save_directory: Path) -> None:
        self.config._save_pretrained(save_directory)

    def get_optim_params(self) -> dict:
        raise NotImplementedError(INFERENCE_ONLY)

    def forward(self, batch: dict[str, Any]) -> tuple[Any, dict | None]:
        raise NotImplementedError(INFERENCE_ONLY)

    def reset(self) -> None:
        self.flashrt.reset()

    def predict_action_chunk(self, batch: dict[str, Any], **kwargs: Any) -> Any:
        return self.flashrt.predict_action_chunk(batch, noise=kwargs.get("noise"))

    def select_action(self, batch: dict[str, Any], **kwargs: Any) -> Any:
        return self.flashrt.select_action(batch, noise=kwargs.get("noise"))
