"""The ``flashrt`` type's processors: rename, batch and device steps only (the names lerobot's scripts
override). The flashrt policy normalizes, tokenizes and resizes inside its captured step, from the
checkpoint's own processor files, so these pipelines must not do it again."""

from __future__ import annotations

from typing import Any

from lerobot.processor import (
    AddBatchDimensionProcessorStep,
    DeviceProcessorStep,
    RenameObservationsProcessorStep,
)
from lerobot.processor.factory import make_policy_processor_pipelines

from lerobot_policy_flashrt.configuration_flashrt import FlashRTConfig


def make_flashrt_pre_post_processors(config: FlashRTConfig, dataset_stats: Any = None) -> tuple[Any, Any]:
    """(preprocessor, postprocessor); `dataset_stats` is not used (the checkpoint carries its own)."""
    return make_policy_processor_pipelines(
        input_steps=[RenameObservationsProcessorStep(rename_map={}), AddBatchDimensionProcessorStep(),
                     DeviceProcessorStep(device=config.device)],
        output_steps=[DeviceProcessorStep(device="cpu")],
    )
