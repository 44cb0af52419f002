"""Checkpoint I/O: open weight files lazily, map keys declaratively and strictly, load modules from meta.

Public API::

    ckpt = open_checkpoint("ckpt_dir_or_file", subkey=None)   # read-only lazy Mapping[str, Tensor]
    wmap = WeightMap([Rule("model.layers.{i}.w", "layers.{i}.w"),
                      Rule(("{p}.weight_g", "{p}.weight_v"), "{p}.weight", transforms.weight_norm(0)),
                      Rule(Alt("time_mlp_in.weight", "action_time_mlp_in.weight"), "time_in.weight")],
                     ignore=("*.num_batches_tracked",))
    module = load_module(lambda: Model(cfg), ckpt, wmap, device="cuda", dtype=torch.bfloat16)

See `checkpoint`, `weightmap` and `loading` for the exact rules. (`flashrt.io.digest`, the tensor-data
digest for calibration cache keys, is imported on its own.)
"""

from flashrt.io import transforms
from flashrt.io.checkpoint import TORCH_SUFFIXES, Checkpoint, TensorInfo, open_checkpoint, save_safetensors
from flashrt.io.loading import build_on_meta, expected_slots, load_module, meta_tensors, reset_derived
from flashrt.io.weightmap import Alt, MapPlan, Production, Rule, WeightMap

__all__ = [
    "Alt", "Checkpoint", "MapPlan", "Production", "Rule", "TORCH_SUFFIXES", "TensorInfo", "WeightMap",
    "build_on_meta", "expected_slots", "load_module", "meta_tensors", "open_checkpoint", "reset_derived",
    "save_safetensors", "transforms",
]
