"""The README's main job: a simulated robot control loop driving an embedded tiny Pi0.5 on flashrt.

    flashrt demo --rate-hz 20 --seconds 5          (python3 bootstrap.py main passes its arguments on)

On first use a tiny Pi0.5 with RANDOM weights is generated deterministically (seeded) and written as a
lerobot 0.6.1 policy directory: config.json, model.safetensors (lerobot key layout), the pre/post
processor JSON files with their normalization statistics, and a tiny SentencePiece tokenizer with
PaliGemma's conventions built from a fixed piece list. It is then loaded through the real loader
(`flashrt.load_policy`), exactly like a downloaded checkpoint, and run in a fixed-rate loop against a
toy robot: every tick reads two synthetic camera images and the joint state, calls `Policy.step`
(a new chunk is inferred every n_action_steps ticks), applies the action and sleeps to the next tick.

It prints step latency (p50 / p90 / p99 / max), jitter (p99 / p50), deadline misses at the loop rate,
the latency of the ticks that ran the network, and one JSON line. The weights are random: the actions
mean nothing; the demo measures the runtime, not a trained policy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: `flashrt --help` stays light
    import torch

DEMO_VERSION = "1"
SEED = 0
CAMERAS = ("top", "wrist")
STATE_DIM = ACTION_DIM = 7
PROMPT = "pick up the red cube and put it in the box"


@dataclass(frozen=True)
class DemoSizes:
    """Sizes of the embedded model (lerobot hard-codes 8 query heads and 1 K/V head)."""

    vision_width: int = 32
    vision_depth: int = 2
    vision_mlp: int = 64
    image_size: int = 56
    vlm_width: int = 64
    vlm_mlp: int = 128
    expert_width: int = 32
    expert_mlp: int = 64
    depth: int = 2
    head_dim: int = 16
    chunk_size: int = 10
    n_action_steps: int = 5
    num_steps: int = 10
    max_dim: int = 32
    max_tokens: int = 64
    patch: int = 14


SIZES = DemoSizes()

# ------------------------------------------------------------------------------------------ tokenizer
_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?-_'\n") + ["\u2581"]
_WORDS = ("the", "\u2581the", "\u2581pick", "\u2581up", "\u2581red", "\u2581cube", "\u2581and", "\u2581put",
          "\u2581it", "\u2581in", "\u2581box", "Task", "State", "Action", "pick")


def build_tokenizer(path: Path) -> int:
    """Write a tiny SentencePiece BPE model with PaliGemma's conventions (pad 0, eos 1, bos 2, unk 3,
    byte fallback, no dummy prefix); every word is reachable by merges of its prefixes. Returns its size."""
    from sentencepiece import sentencepiece_model_pb2 as pb2

    m = pb2.ModelProto()
    for piece, kind in (("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2)):
        m.pieces.add(piece=piece, score=0.0, type=kind)
    for b in range(256):
        m.pieces.add(piece=f"<0x{b:02X}>", score=0.0, type=6)
    normal = dict.fromkeys([*_CHARS, *(w[:i] for w in _WORDS for i in range(2, len(w) + 1))])
    for piece in normal:  # BPE merge priority follows the score, which falls with the id
        m.pieces.add(piece=piece, score=-float(len(m.pieces)), type=1)
    ts = m.trainer_spec
    ts.model_type, ts.vocab_size, ts.byte_fallback = pb2.TrainerSpec.BPE, len(m.pieces), True
    ts.pad_id, ts.eos_id, ts.bos_id, ts.unk_id = 0, 1, 2, 3
    ts.pad_piece, ts.eos_piece, ts.bos_piece, ts.unk_piece = "<pad>", "<eos>", "<bos>", "<unk>"
    ns = m.normalizer_spec
    ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces = "identity", False, False
    ns.escape_whitespaces = True
    path.write_bytes(m.SerializeToString())
    return len(m.pieces)


# ------------------------------------------------------------------------------------------ weights
_PG = "model.paligemma_with_expert.paligemma."
_VT = _PG + "model.vision_tower.vision_model."
_EX = "model.paligemma_with_expert.gemma_expert."


def _gemma_shapes(stem: str, width: int, mlp: int, s: DemoSizes, adaptive: bool) -> dict[str, tuple]:
    q, kv = 8 * s.head_dim, s.head_dim
    layer = {"self_attn.q_proj.weight": (q, width), "self_attn.k_proj.weight": (kv, width),
             "self_attn.v_proj.weight": (kv, width), "self_attn.o_proj.weight": (width, q),
             "mlp.gate_proj.weight": (mlp, width), "mlp.up_proj.weight": (mlp, width),
             "mlp.down_proj.weight": (width, mlp)}
    norms = ("input_layernorm", "post_attention_layernorm")
    if adaptive:
        layer.update({f"{n}.dense.{p}": shape for n in norms
                      for p, shape in (("weight", (3 * width, width)), ("bias", (3 * width,)))})
        final = {"norm.dense.weight": (3 * width, width), "norm.dense.bias": (3 * width,)}
    else:
        layer.update({f"{n}.weight": (width,) for n in norms})
        final = {"norm.weight": (width,)}
    out = {f"{stem}layers.{i}.{k}": v for i in range(s.depth) for k, v in layer.items()}
    return {**out, **{stem + k: v for k, v in final.items()}}


def _vision_shapes(s: DemoSizes) -> dict[str, tuple]:
    w, n_pos = s.vision_width, (s.image_size // s.patch) ** 2
    layer = {f"self_attn.{p}_proj.{t}": (w, w) if t == "weight" else (w,) for p in ("q", "k", "v", "out")
             for t in ("weight", "bias")}
    layer.update({f"layer_norm{i}.{p}": (w,) for i in (1, 2) for p in ("weight", "bias")})
    layer.update({"mlp.fc1.weight": (s.vision_mlp, w), "mlp.fc1.bias": (s.vision_mlp,),
                  "mlp.fc2.weight": (w, s.vision_mlp), "mlp.fc2.bias": (w,)})
    out = {f"{_VT}encoder.layers.{i}.{k}": v for i in range(s.vision_depth) for k, v in layer.items()}
    out.update({_VT + "embeddings.patch_embedding.weight": (w, 3, s.patch, s.patch),
                _VT + "embeddings.patch_embedding.bias": (w,),
                _VT + "embeddings.position_embedding.weight": (n_pos, w),
                _VT + "post_layernorm.weight": (w,), _VT + "post_layernorm.bias": (w,),
                _PG + "model.multi_modal_projector.linear.weight": (s.vlm_width, w),
                _PG + "model.multi_modal_projector.linear.bias": (s.vlm_width,)})
    return out


def lerobot_pi05_shapes(s: DemoSizes, vocab: int) -> dict[str, tuple]:
    """Every tensor of a lerobot 0.6.1 PI05Policy state dict, key -> shape (the layout it saves)."""
    we = s.expert_width
    shapes = {**_vision_shapes(s),
              _PG + "model.language_model.embed_tokens.weight": (vocab, s.vlm_width),
              _PG + "lm_head.weight": (vocab, s.vlm_width), _EX + "lm_head.weight": (vocab, we),
              **_gemma_shapes(_PG + "model.language_model.", s.vlm_width, s.vlm_mlp, s, adaptive=False),
              **_gemma_shapes(_EX + "model.", we, s.expert_mlp, s, adaptive=True)}
    for name, (out, inp) in {"action_in_proj": (we, s.max_dim), "action_out_proj": (s.max_dim, we),
                             "time_mlp_in": (we, we), "time_mlp_out": (we, we)}.items():
        shapes[f"model.{name}.weight"], shapes[f"model.{name}.bias"] = (out, inp), (out,)
    return shapes


def random_weights(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """Seeded N(0, 1/fan_in) weights (norm gains near 1 for SigLIP LayerNorms), in sorted key order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        t = torch.randn(shape, generator=g) / max(fan_in, 1) ** 0.5
        if len(shape) == 1:
            t = t * 0.05 + (1.0 if "layer_norm" in key or "post_layernorm" in key else 0.0)
        out[key] = t.contiguous()
    out[_PG + "lm_head.weight"] = out[_PG + "model.language_model.embed_tokens.weight"].clone()  # tied
    return out


# ------------------------------------------------------------------------------------------ policy dir
def _feature(kind: str, shape: tuple) -> dict[str, Any]:
    return {"type": kind, "shape": list(shape)}


def _config_json(s: DemoSizes) -> dict[str, Any]:
    inputs = {f"observation.images.{c}": _feature("VISUAL", (3, s.image_size, s.image_size)) for c in CAMERAS}
    inputs["observation.state"] = _feature("STATE", (STATE_DIM,))
    return {"type": "pi05", "n_obs_steps": 1, "input_features": inputs,
            "output_features": {"action": _feature("ACTION", (ACTION_DIM,))}, "device": "cpu",
            "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "dtype": "float32",
            "chunk_size": s.chunk_size, "n_action_steps": s.n_action_steps, "max_state_dim": s.max_dim,
            "max_action_dim": s.max_dim, "num_inference_steps": s.num_steps, "min_period": 0.004,
            "max_period": 4.0, "use_relative_actions": False,
            "image_resolution": [s.image_size, s.image_size],
            "empty_cameras": 0, "tokenizer_max_length": s.max_tokens,
            "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
            "flashrt_demo": f"RANDOM weights, generated by flashrt.demo (seed {SEED})",
            "flashrt_demo_version": DEMO_VERSION}


def _norm_step(registry: str, features: dict, state_file: str) -> dict[str, Any]:
    return {"registry_name": registry, "state_file": state_file,
            "config": {"eps": 1e-8, "features": features,
                       "norm_map": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}}}


def _processors(s: DemoSizes) -> tuple[dict, dict]:
    config = _config_json(s)
    pre_state, post_state = "policy_preprocessor_step_3_normalizer_processor.safetensors", \
        "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "relative_actions_processor",
         "config": {"enabled": False, "exclude_joints": ["gripper"], "action_names": None}},
        _norm_step("normalizer_processor", {**config["input_features"], **config["output_features"]},
                   pre_state),
        {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
        {"registry_name": "tokenizer_processor",
         "config": {"max_length": s.max_tokens, "task_key": "task", "padding_side": "right",
                    "padding": "max_length", "truncation": True,
                    "tokenizer_name": "google/paligemma-3b-pt-224"}},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}]}
    post = {"name": "policy_postprocessor", "steps": [
        _norm_step("unnormalizer_processor", config["output_features"], post_state),
        {"registry_name": "absolute_actions_processor", "config": {"enabled": False}},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}]}
    return pre, post


def _stats(seed: int) -> dict[str, torch.Tensor]:
    """Plausible joint statistics (radians; a gripper in [0, 1]) for state and action."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        center, spread = torch.randn(dim, generator=g) * 0.5, torch.rand(dim, generator=g) + 0.5
        center[-1], spread[-1] = 0.5, 0.5
        stats = {"mean": center, "std": spread / 2, "min": center - spread * 1.2,
                 "max": center + spread * 1.2, "q01": center - spread, "q99": center + spread}
        out.update({f"{key}.{k}": v.float().contiguous() for k, v in stats.items()})
    return out


def write_demo_checkpoint(folder: Path, sizes: DemoSizes = SIZES, seed: int = SEED) -> Path:
    """Write the random tiny Pi0.5 as a lerobot 0.6.1 policy dir into `folder` (created)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(folder / "tokenizer.model")
    save_file(random_weights(lerobot_pi05_shapes(sizes, vocab), seed), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_config_json(sizes), indent=4))
    pre, post = _processors(sizes)
    (folder / "policy_preprocessor.json").write_text(json.dumps(pre, indent=2))
    (folder / "policy_postprocessor.json").write_text(json.dumps(post, indent=2))
    stats = _stats(seed)
    save_file(stats, str(folder / pre["steps"][3]["state_file"]))
    actions = {k: v for k, v in stats.items() if k.startswith("action.")}
    save_file(actions, str(folder / post["steps"][0]["state_file"]))
    return folder


def default_checkpoint_dir() -> Path:
    from flashrt.paths import user_cache_dir

    return user_cache_dir("demo", f"pi05-tiny-random-v{DEMO_VERSION}")


def _demo_version(folder: Path) -> str | None:
    """The demo version recorded in folder/config.json; None when there is no config.json.
    Refuses a folder holding something else (a real checkpoint is never overwritten)."""
    config = folder / "config.json"
    if not config.is_file():
        if folder.exists() and any(folder.iterdir()):
            raise ValueError(f"{folder} is not empty and holds no flashrt demo checkpoint; "
                             "choose another folder")
        return None
    marker = json.loads(config.read_text()).get("flashrt_demo_version")
    if marker is None:
        raise ValueError(f"{folder} holds a checkpoint that flashrt.demo did not generate; refusing to "
                         "replace it (pass another --checkpoint folder)")
    return str(marker)


def ensure_demo_checkpoint(folder: Path | None = None) -> tuple[Path, bool]:
    """The demo checkpoint dir, (re)generated atomically (temp dir + rename) when absent or from another
    demo version. -> (dir, created)."""
    folder = Path(folder) if folder is not None else default_checkpoint_dir()
    if _demo_version(folder) == DEMO_VERSION and (folder / "model.safetensors").is_file():
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    try:
        write_demo_checkpoint(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder, True


# ------------------------------------------------------------------------------------------ the loop
class ToyRobot:
    """A 7-joint arm integrating its actions, seen by two synthetic 64 x 48 cameras."""

    def __init__(self, seed: int = SEED) -> None:
        rng = np.random.default_rng(seed)
        self.state = np.zeros(STATE_DIM, dtype=np.float32)
        self._scenes = {c: rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for c in CAMERAS}
        self.tick = 0

    def observe(self) -> dict[str, Any]:
        shift = self.tick % 64
        images = {c: np.roll(img, shift, axis=1) for c, img in self._scenes.items()}
        return {"images": images, "state": self.state.copy(), "prompt": PROMPT}

    def apply(self, action: np.ndarray) -> None:
        self.state += 0.05 * np.tanh(action[:STATE_DIM] - self.state).astype(np.float32)
        self.tick += 1


@dataclass
class LoopRecord:
    """Per tick: step latency; for ticks that ran the network, its latency; tick start lateness."""

    step_ms: list[float]
    infer_ms: list[float]
    start_error_ms: list[float]
    late_ticks: int
    ticks: int


def run_loop(step: Callable[[dict], np.ndarray], robot: ToyRobot, rate_hz: float, ticks: int,
             replanned: Callable[[], bool]) -> LoopRecord:
    """Fixed-rate loop: observe, step, apply, sleep to the next tick (a late tick does not queue up)."""
    period = 1.0 / rate_hz
    record = LoopRecord([], [], [], 0, ticks)
    scheduled = time.perf_counter()
    for _ in range(ticks):
        start = time.perf_counter()
        record.start_error_ms.append((start - scheduled) * 1e3)
        action = step(robot.observe())
        ms = (time.perf_counter() - start) * 1e3
        record.step_ms.append(ms)
        if replanned():
            record.infer_ms.append(ms)
        robot.apply(action)
        scheduled += period
        now = time.perf_counter()
        if now > scheduled:
            record.late_ticks += 1
            scheduled = now
        else:
            time.sleep(scheduled - now)
    return record


def _print_report(info: dict[str, Any], result: dict[str, Any]) -> None:
    from flashrt.profile import json_line

    print("flashrt demo: tiny Pi0.5 with RANDOM weights "
          "(its actions mean nothing; this measures the runtime)")
    print(f"  checkpoint  {info['path']} ({'generated now' if result['generated'] else 'cached'}), "
          f"lerobot layout, {info['variant']}, cameras {info['cameras']}, {info['num_steps']} denoise steps")
    print(f"  device      {info['device']}, backend {info['graphs']['backend']}, dtype {info['dtype']}, "
          f"load + capture {result['load_s']:.2f} s")
    print(f"  loop        {result['rate_hz']:g} Hz for {result['ticks']} ticks; a new chunk of "
          f"{info['chunk_size']} every {info['n_action_steps']} ticks")
    print(f"  {'ms':24}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}{'misses':>9}")
    rows = (("step, every tick", "step"), ("step, replanning ticks", "replan"),
            ("tick start lateness", "start_error"))
    for label, key in rows:
        s = result[key]
        misses = f"{s['deadline_misses']}/{s['count']}" if key != "start_error" else ""
        print(f"  {label:24}{s['p50']:8.2f}{s['p90']:8.2f}{s['p99']:8.2f}{s['max']:8.2f}{misses:>9}")
    print(f"  deadline {1000 / result['rate_hz']:.1f} ms: {result['step']['deadline_misses']} misses, "
          f"{result['late_ticks']}/{result['ticks']} late ticks; replan jitter (p99/p50) "
          f"{result['replan']['jitter']:.2f}, tick jitter (p99 start lateness) "
          f"{result['start_error']['p99']:.2f} ms")
    print(json_line({"demo": "pi05-tiny-random", **{k: v for k, v in result.items() if k != "generated"}}))


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """Use `threads` intra-op threads inside the block (0: leave torch's setting); restored after."""
    import torch

    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _measure(policy: Any, rate_hz: float, seconds: float) -> LoopRecord:
    for _ in range(3):  # warm-up, not timed
        policy.infer(ToyRobot().observe(), seed=0)
    policy.reset()
    ticks = max(int(round(rate_hz * seconds)), 1)
    replanned = lambda: policy.queued == policy.n_action_steps - 1
    return run_loop(policy.step, ToyRobot(), rate_hz, ticks, replanned)


def _summarize(record: LoopRecord, rate_hz: float) -> dict[str, Any]:
    from flashrt.profile import LatencyStats

    return {"rate_hz": rate_hz, "ticks": record.ticks, "late_ticks": record.late_ticks,
            "step": LatencyStats.from_samples(record.step_ms, rate_hz).to_dict(),
            "replan": LatencyStats.from_samples(record.infer_ms, rate_hz).to_dict(),
            "start_error": LatencyStats.from_samples(record.start_error_ms).to_dict()}


def demo(rate_hz: float = 20.0, seconds: float = 5.0, device: str = "auto", backend: str | None = None,
         threads: int = 1, checkpoint: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the simulated control loop on the embedded tiny Pi0.5 (random weights) and report latency.

    rate_hz     control rate of the loop (deadline = 1000 / rate_hz ms)
    seconds     how long the loop runs (ticks = rate_hz * seconds)
    device      "cpu", "cuda", "cuda:N" or "auto"
    backend     graph backend (default: cuda graphs on a GPU, eager on the CPU)
    threads     CPU threads for torch during the run (a model this small runs best on one, and a loaded
                machine punishes more); 0 keeps torch's setting. Restored afterwards.
    checkpoint  where the random checkpoint lives (default: the user cache dir); generated if absent
    """
    from flashrt.policy import load_policy

    if not rate_hz > 0 or not seconds > 0:
        raise ValueError("rate_hz and seconds must be positive")
    folder, generated = ensure_demo_checkpoint(Path(checkpoint) if checkpoint else None)
    with _torch_threads(threads):
        start = time.perf_counter()
        policy = load_policy(folder, device=device, backend=backend)
        load_s = time.perf_counter() - start
        record = _measure(policy, rate_hz, seconds)
    result = {"generated": generated, "load_s": load_s, **_summarize(record, rate_hz),
              "device": str(policy.frontend.device), "backend": policy.frontend.report()["backend"],
              "threads": threads}
    if not quiet:
        _print_report(policy.info(), result)
    return result
